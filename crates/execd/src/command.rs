//! `POST /command` (foreground stream or background), `GET /command/status/{id}`, `GET /command/{id}/logs`
//! and `DELETE /command?id=`. Every command gets its own process group so a timeout, an interrupt or a
//! client disconnect can kill everything it started.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use nix::sys::signal::Signal;
use serde::Deserialize;
use tokio::sync::{mpsc, watch};
use warren_api::execd::{CommandStatus, EventKind, RunCommandRequest};

use crate::error::{code, ApiError, ApiJson, ApiResult};
use crate::lines::Lines;
use crate::logbuf::LogBuffer;
use crate::process::{self, kill_group, ProcessSpec, Program, Running, StdinMode, Stream};
use crate::reaper::Exit;
use crate::sse;
use crate::AppState;

/// Response header carrying the byte cursor of `GET /command/{id}/logs` (the offset to read from next).
pub const TAIL_CURSOR_HEADER: &str = "EXECD-COMMANDS-TAIL-CURSOR";
/// Grace between SIGTERM and SIGKILL on interrupt.
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(2);
/// Finished executions kept for status queries before the oldest are forgotten.
const MAX_FINISHED: usize = 1024;

/// One execution, foreground or background.
pub struct Exec {
    pub id: String,
    pub content: String,
    pub pgid: i32,
    pub started_at: DateTime<Utc>,
    state: Mutex<ExecState>,
    done: watch::Sender<bool>,
    /// Combined output; only background executions keep one.
    pub log: Option<Arc<LogBuffer>>,
}

#[derive(Default)]
struct ExecState {
    finished_at: Option<DateTime<Utc>>,
    exit_code: Option<i32>,
    error: Option<String>,
}

impl Exec {
    fn state(&self) -> MutexGuard<'_, ExecState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self, exit: Exit, timed_out: bool) {
        {
            let mut st = self.state();
            st.finished_at = Some(Utc::now());
            match exit {
                Exit::Code(c) => {
                    st.exit_code = Some(c);
                    if c != 0 {
                        st.error = Some(format!("exit status {c}"));
                    }
                }
                Exit::Signal(s) => {
                    st.exit_code = Some(-1);
                    st.error = Some(if timed_out {
                        "timeout: signal: killed".to_string()
                    } else {
                        signal_text(s)
                    });
                }
            }
        }
        if let Some(log) = &self.log {
            log.close();
        }
        self.done.send_replace(true);
    }

    pub fn running(&self) -> bool {
        !*self.done.borrow()
    }

    pub fn status(&self) -> CommandStatus {
        let st = self.state();
        CommandStatus {
            id: self.id.clone(),
            content: self.content.clone(),
            running: st.finished_at.is_none(),
            exit_code: st.exit_code,
            error: st.error.clone(),
            started_at: rfc3339(self.started_at),
            finished_at: st.finished_at.map(rfc3339),
        }
    }

    /// Waits until the process has been reaped, at most `limit`. Returns whether it finished.
    async fn wait_done(&self, limit: Duration) -> bool {
        let mut rx = self.done.subscribe();
        let finished = tokio::time::timeout(limit, rx.wait_for(|d| *d))
            .await
            .is_ok();
        finished
    }
}

pub fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn signal_text(sig: i32) -> String {
    match Signal::try_from(sig) {
        Ok(Signal::SIGKILL) => "signal: killed".to_string(),
        Ok(Signal::SIGTERM) => "signal: terminated".to_string(),
        Ok(Signal::SIGINT) => "signal: interrupt".to_string(),
        Ok(s) => format!("signal: {}", s.as_str()),
        Err(_) => format!("signal: {sig}"),
    }
}

/// Registry of executions.
#[derive(Default)]
pub struct Commands {
    table: Mutex<HashMap<String, Arc<Exec>>>,
}

impl Commands {
    fn table(&self) -> MutexGuard<'_, HashMap<String, Arc<Exec>>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Arc<Exec>> {
        self.table().get(id).cloned()
    }

    /// Kills the process group of every execution still running.
    pub fn kill_all(&self) {
        for exec in self.table().values().filter(|e| e.running()) {
            kill_group(exec.pgid, Signal::SIGKILL);
        }
    }

    fn insert(&self, exec: Arc<Exec>) {
        let mut table = self.table();
        if table.len() >= MAX_FINISHED {
            let mut finished: Vec<(DateTime<Utc>, String)> = table
                .values()
                .filter(|e| !e.running())
                .map(|e| (e.started_at, e.id.clone()))
                .collect();
            finished.sort();
            for (_, id) in finished.iter().take(table.len() + 1 - MAX_FINISHED) {
                table.remove(id);
            }
        }
        table.insert(exec.id.clone(), exec);
    }
}

/// Validates a request into a spec; failures here are synchronous 400s, before any stream starts.
fn spec_from_request(app: &AppState, req: &RunCommandRequest) -> ApiResult<(ProcessSpec, String)> {
    let (program, content) = match (&req.argv, &req.command) {
        (Some(argv), _) if !argv.is_empty() => (Program::Argv(argv.clone()), argv.join(" ")),
        (_, Some(cmd)) if !cmd.trim().is_empty() => (Program::Shell(cmd.clone()), cmd.clone()),
        _ => {
            return Err(ApiError::bad_body(
                "command (or argv) is required and must not be empty",
            ))
        }
    };
    if req.gid.is_some() && req.uid.is_none() {
        return Err(ApiError::bad_body("gid requires uid"));
    }
    if req.timeout == Some(0) {
        return Err(ApiError::bad_body("timeout must be at least 1 ms"));
    }
    let spec = ProcessSpec {
        program,
        cwd: app.resolve(req.cwd.as_deref().unwrap_or("")),
        envs: req.envs.clone().unwrap_or_default(),
        uid: req.uid,
        gid: req.gid,
        combine_output: req.background,
    };
    Ok((spec, content))
}

pub async fn run(
    State(app): State<Arc<AppState>>,
    ApiJson(req): ApiJson<RunCommandRequest>,
) -> ApiResult<Response> {
    let (spec, content) = spec_from_request(&app, &req)?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let timeout = req.timeout.map(Duration::from_millis);
    let (stream, response) = sse::channel();
    let tx = stream.tx.clone();
    let _ = tx.send(sse::init(&id)).await;

    // A foreground command keeps the spare shell from starting until it ends (see `crate::spare`).
    let busy = (!req.background).then(|| app.spare.busy());
    let started = match app.spare.take(&spec) {
        Some(running) => Ok(running),
        None => process::spawn(&app.reaper, &spec, StdinMode::Null),
    };
    let running = match started {
        Ok(r) => r,
        Err(e) => {
            let msg = e.full_message();
            tracing::info!(exec = %id, error = %msg, "command failed to start");
            let _ = tx.send(sse::error(msg.clone(), vec![msg])).await;
            return Ok(response);
        }
    };
    tracing::info!(exec = %id, pid = running.pid, background = req.background, "command started");
    let log = req.background.then(|| Arc::new(LogBuffer::default()));
    let exec = Arc::new(Exec {
        id: id.clone(),
        content,
        pgid: running.pid,
        started_at: Utc::now(),
        state: Mutex::new(ExecState::default()),
        done: watch::channel(false).0,
        log: log.clone(),
    });
    app.commands.insert(exec.clone());

    if let Some(log) = log {
        tokio::spawn(supervise_background(exec, running, log, timeout));
        let _ = tx.send(sse::complete(0)).await;
    } else {
        tokio::spawn(supervise_foreground(exec, running, stream, timeout, busy));
    }
    Ok(response)
}

/// The bytes a command wrote, as they were read, tagged by stream.
type Output = mpsc::Receiver<(Stream, Vec<u8>)>;

/// Starts one reader per output pipe; their bytes arrive on the returned channel.
fn spawn_pumps(
    stdout: Option<tokio::net::unix::pipe::Receiver>,
    stderr: Option<tokio::net::unix::pipe::Receiver>,
) -> (Vec<tokio::task::JoinHandle<()>>, Output) {
    let (otx, orx) = mpsc::channel::<(Stream, Vec<u8>)>(64);
    let pumps = [(stdout, Stream::Stdout), (stderr, Stream::Stderr)]
        .into_iter()
        .filter_map(|(p, s)| p.map(|p| tokio::spawn(process::pump(p, s, otx.clone()))))
        .collect();
    (pumps, orx)
}

async fn supervise_background(
    exec: Arc<Exec>,
    running: Running,
    log: Arc<LogBuffer>,
    timeout: Option<Duration>,
) {
    let Running {
        pid,
        exit,
        stdout,
        stderr,
        ..
    } = running;
    let (pumps, mut orx) = spawn_pumps(stdout, stderr);
    let writer = tokio::spawn(async move {
        while let Some((_, bytes)) = orx.recv().await {
            log.append(&bytes);
        }
    });
    let (exit, timed_out) = wait_exit(
        pid,
        exit,
        timeout,
        &tokio_util::sync::CancellationToken::new(),
    )
    .await;
    drain(pumps).await;
    let _ = tokio::time::timeout(process::DRAIN_AFTER_EXIT, writer).await;
    tracing::info!(exec = %exec.id, ?exit, "background command finished");
    exec.finish(exit, timed_out);
}

async fn supervise_foreground(
    exec: Arc<Exec>,
    running: Running,
    stream: sse::EventStream,
    timeout: Option<Duration>,
    busy: Option<crate::spare::Busy>,
) {
    let started = Instant::now();
    let Running {
        pid,
        exit,
        stdout,
        stderr,
        ..
    } = running;
    let (pumps, mut orx) = spawn_pumps(stdout, stderr);
    let tx = stream.tx.clone();
    let forward = tokio::spawn(async move {
        // One event per line (see `crate::lines`); each stream's last unterminated line once
        // both have ended.
        let mut framers = [
            (EventKind::Stdout, Lines::default()),
            (EventKind::Stderr, Lines::default()),
        ];
        while let Some((s, bytes)) = orx.recv().await {
            let (kind, lines) = match s {
                Stream::Stdout => &mut framers[0],
                Stream::Stderr => &mut framers[1],
            };
            for line in lines.feed(&bytes) {
                if tx.send(sse::event(*kind, Some(line))).await.is_err() {
                    return;
                }
            }
        }
        for (kind, lines) in &mut framers {
            if let Some(line) = lines.finish() {
                let _ = tx.send(sse::event(*kind, Some(line))).await;
            }
        }
    });
    let (exit, timed_out) = wait_exit(pid, exit, timeout, &stream.cancelled).await;
    drain(pumps).await;
    let _ = forward.await;
    let elapsed = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
    tracing::info!(exec = %exec.id, ?exit, elapsed_ms = elapsed, "command finished");
    exec.finish(exit, timed_out);
    drop(busy);
    let _ = stream
        .tx
        .send(terminal_event(exit, timed_out, timeout, elapsed))
        .await;
}

/// The last event of a stream for a process that ended with `exit`.
pub fn terminal_event(
    exit: Exit,
    timed_out: bool,
    timeout: Option<Duration>,
    elapsed_ms: i64,
) -> warren_api::execd::StreamEvent {
    match exit {
        Exit::Code(0) => sse::complete(elapsed_ms),
        Exit::Code(c) => sse::error(c.to_string(), vec![format!("exit status {c}")]),
        Exit::Signal(s) => {
            let mut tb = vec![signal_text(s)];
            if timed_out {
                tb.push(format!(
                    "command timed out after {} ms",
                    timeout.map(|t| t.as_millis()).unwrap_or(0)
                ));
            }
            sse::error("-1", tb)
        }
    }
}

/// Waits for the exit status, killing the process group on timeout or cancellation (client gone).
async fn wait_exit(
    pgid: i32,
    mut exit: tokio::sync::oneshot::Receiver<Exit>,
    timeout: Option<Duration>,
    cancelled: &tokio_util::sync::CancellationToken,
) -> (Exit, bool) {
    let deadline = async {
        match timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    let mut timed_out = false;
    tokio::select! {
        r = &mut exit => return (r.unwrap_or(Exit::Code(-1)), false),
        _ = deadline => {
            tracing::info!(pgid, "command timed out, killing its process group");
            timed_out = true;
        }
        _ = cancelled.cancelled() => tracing::info!(pgid, "client went away, killing the command's process group"),
    }
    kill_group(pgid, Signal::SIGKILL);
    (exit.await.unwrap_or(Exit::Signal(libc::SIGKILL)), timed_out)
}

/// Lets the pumps finish reading what is buffered, but not wait for grandchildren holding the pipes.
async fn drain(pumps: Vec<tokio::task::JoinHandle<()>>) {
    let aborts: Vec<_> = pumps.iter().map(|p| p.abort_handle()).collect();
    if tokio::time::timeout(process::DRAIN_AFTER_EXIT, futures::future::join_all(pumps))
        .await
        .is_err()
    {
        for a in aborts {
            a.abort();
        }
    }
}

pub async fn status(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<axum::Json<CommandStatus>> {
    let exec = app.commands.get(&id).ok_or_else(|| unknown(&id))?;
    Ok(axum::Json(exec.status()))
}

#[derive(Deserialize)]
pub struct LogsQuery {
    #[serde(default)]
    cursor: Option<String>,
}

pub async fn logs(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<LogsQuery>,
) -> ApiResult<Response> {
    let exec = app.commands.get(&id).ok_or_else(|| unknown(&id))?;
    let cursor = match q.cursor.as_deref().map(str::trim).filter(|c| !c.is_empty()) {
        None => 0,
        Some(c) => c.parse::<usize>().map_err(|_| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                code::INVALID_REQUEST_BODY,
                "cursor must be a non-negative integer",
            )
        })?,
    };
    let (text, next) = match &exec.log {
        Some(log) => log.tail(cursor),
        None => (String::new(), cursor),
    };
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp.headers_mut()
        .insert(TAIL_CURSOR_HEADER, HeaderValue::from(next as u64));
    Ok(resp)
}

#[derive(Deserialize)]
pub struct InterruptQuery {
    #[serde(default)]
    id: Option<String>,
}

pub async fn interrupt(
    State(app): State<Arc<AppState>>,
    Query(q): Query<InterruptQuery>,
) -> ApiResult<StatusCode> {
    let id =
        q.id.filter(|s| !s.is_empty())
            .ok_or_else(|| ApiError::missing_query("id"))?;
    let exec = app.commands.get(&id).ok_or_else(|| unknown(&id))?;
    if exec.running() {
        tracing::info!(exec = %id, pgid = exec.pgid, "interrupting command");
        kill_group(exec.pgid, Signal::SIGTERM);
        if !exec.wait_done(INTERRUPT_GRACE).await {
            kill_group(exec.pgid, Signal::SIGKILL);
            exec.wait_done(Duration::from_secs(2)).await;
        }
    }
    // Whatever the leader left behind in its group goes too.
    kill_group(exec.pgid, Signal::SIGKILL);
    Ok(StatusCode::OK)
}

fn unknown(id: &str) -> ApiError {
    ApiError::not_found(code::CONTEXT_NOT_FOUND, format!("command {id} not found"))
}
