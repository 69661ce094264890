//! Persistent shell sessions (`POST /session`, `POST /session/{id}/run`, `DELETE /session/{id}`).
//!
//! A session is one long-lived bash reading a script from a pipe, so `cd`, exported variables and
//! functions survive between runs. Each run writes the command (single-quoted, run through `eval` so a
//! syntax error cannot desynchronise the shell) followed by two markers carrying a random token: one on
//! stdout with the exit code, one on stderr. A run ends when both markers have been read, which also
//! guarantees its output never leaks into the next run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::response::Response;
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use warren_api::execd::EventKind;

use crate::error::{code, ApiError, ApiJson, ApiResult, OptionalJson};
use crate::lines::Lines;
use crate::process::{self, kill_group, shell, ProcessSpec, Program, StdinMode, Utf8Carry};
use crate::reaper::Exit;
use crate::sse;
use crate::AppState;

#[derive(Debug, Default, Deserialize)]
pub struct CreateSessionRequest {
    #[serde(default)]
    pub cwd: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct CreateSessionResponse {
    pub session_id: String,
}

#[derive(Debug, Deserialize)]
pub struct RunInSessionRequest {
    pub command: String,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Milliseconds.
    #[serde(default)]
    pub timeout: Option<u64>,
}

struct SessionIo {
    stdin: pipe::Sender,
    stdout: pipe::Receiver,
    stderr: pipe::Receiver,
}

pub struct Session {
    pgid: i32,
    io: tokio::sync::Mutex<SessionIo>,
    dead: Arc<AtomicBool>,
}

#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Arc<Session>>>,
}

impl Sessions {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.map().get(id).cloned()
    }

    /// Kills every session shell (execd shutting down).
    pub fn kill_all(&self) {
        for (_, s) in self.map().drain() {
            kill_group(s.pgid, Signal::SIGKILL);
        }
    }
}

pub async fn create(
    State(app): State<Arc<AppState>>,
    OptionalJson(req): OptionalJson<CreateSessionRequest>,
) -> ApiResult<axum::Json<CreateSessionResponse>> {
    let mut argv = vec![shell().to_string()];
    if argv[0].ends_with("bash") {
        argv.extend(["--noprofile".to_string(), "--norc".to_string()]);
    }
    let spec = ProcessSpec {
        program: Program::Argv(argv),
        // `$NAME` in it expands as a shell would, from the sandbox's environment.
        cwd: app.resolve(&crate::process::expand_vars(
            req.cwd.as_deref().unwrap_or(""),
            &crate::process::base_env(),
        )),
        envs: Default::default(),
        uid: None,
        gid: None,
        combine_output: false,
    };
    let running = process::spawn(&app.reaper, &spec, StdinMode::Piped)
        .map_err(|e| ApiError::runtime(e.full_message()))?;
    let (Some(stdin), Some(stdout), Some(stderr)) = (running.stdin, running.stdout, running.stderr)
    else {
        kill_group(running.pid, Signal::SIGKILL);
        return Err(ApiError::runtime("session shell has no pipes"));
    };
    let id = uuid::Uuid::new_v4().simple().to_string();
    let dead = Arc::new(AtomicBool::new(false));
    let session = Arc::new(Session {
        pgid: running.pid,
        io: tokio::sync::Mutex::new(SessionIo {
            stdin,
            stdout,
            stderr,
        }),
        dead: dead.clone(),
    });
    let exit = running.exit;
    let sid = id.clone();
    tokio::spawn(async move {
        let status = exit.await;
        dead.store(true, Ordering::SeqCst);
        tracing::info!(session = %sid, ?status, "session shell exited");
    });
    app.sessions.map().insert(id.clone(), session);
    tracing::info!(session = %id, pid = running.pid, "session created");
    Ok(axum::Json(CreateSessionResponse { session_id: id }))
}

pub async fn delete(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult<()> {
    let session = app
        .sessions
        .map()
        .remove(&id)
        .ok_or_else(|| not_found(&id))?;
    kill_group(session.pgid, Signal::SIGKILL);
    tracing::info!(session = %id, "session deleted");
    Ok(())
}

pub async fn run(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<RunInSessionRequest>,
) -> ApiResult<Response> {
    let session = app.sessions.get(&id).ok_or_else(|| not_found(&id))?;
    if session.dead.load(Ordering::SeqCst) {
        app.sessions.map().remove(&id);
        return Err(ApiError::not_found(
            code::CONTEXT_NOT_FOUND,
            format!("session {id} has exited"),
        ));
    }
    if req.command.trim().is_empty() {
        return Err(ApiError::bad_body("command must not be empty"));
    }
    if req.timeout == Some(0) {
        return Err(ApiError::bad_body("timeout must be at least 1 ms"));
    }
    let cwd = req
        .cwd
        .as_deref()
        .filter(|c| !c.is_empty())
        .map(|c| app.resolve(&crate::process::expand_vars(c, &crate::process::base_env())));
    let (stream, response) = sse::channel();
    let app2 = app.clone();
    tokio::spawn(async move {
        let dead = run_in_session(
            &session,
            &id,
            &req.command,
            cwd.as_deref(),
            req.timeout,
            stream,
        )
        .await;
        if dead {
            kill_group(session.pgid, Signal::SIGKILL);
            app2.sessions.map().remove(&id);
        }
    });
    Ok(response)
}

/// `s` as one single-quoted shell word.
pub(crate) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script one run writes to the shell.
fn script(command: &str, cwd: Option<&std::path::Path>, token: &str) -> String {
    let cd = cwd
        .map(|c| format!("cd {} && ", quote(&c.to_string_lossy())))
        .unwrap_or_default();
    format!(
        "{cd}{{ eval {cmd}\n}} </dev/null\nprintf '{out}%d__\\n' \"$?\"\nprintf '{err}\\n' >&2\n",
        cmd = quote(command),
        out = out_marker(token),
        err = err_marker(token),
    )
}

fn out_marker(token: &str) -> String {
    format!("__WARREN_END_{token}_")
}

fn err_marker(token: &str) -> String {
    format!("__WARREN_END_{token}__")
}

/// Splits one stream of a session run into the command's output and the end marker that the run's
/// script prints after it (on stdout followed by the exit code and `__\n`), whatever pieces the pipe
/// delivers them in: output is released as soon as it cannot be the start of the marker, and never
/// cuts a UTF-8 character.
pub struct MarkerScan {
    buf: Vec<u8>,
    carry: Utf8Carry,
    marker: Vec<u8>,
    /// Stdout: the marker is followed by the exit code.
    with_rc: bool,
}

/// What one [`MarkerScan::feed`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scanned {
    /// Output that is now certain (may be empty).
    pub text: String,
    /// The marker was read (on stdout with its exit code; `-1` when that was not a number): the
    /// command is done on this stream and nothing after the marker is its output.
    pub end: Option<i32>,
}

impl MarkerScan {
    pub fn new(marker: Vec<u8>, with_rc: bool) -> Self {
        Self {
            buf: Vec::new(),
            carry: Utf8Carry::default(),
            marker,
            with_rc,
        }
    }

    pub fn feed(&mut self, bytes: &[u8]) -> Scanned {
        self.buf.extend_from_slice(bytes);
        let Some(pos) = find(&self.buf, &self.marker) else {
            let upto = safe_len(&self.buf, &self.marker);
            return Scanned {
                text: self.release(upto),
                end: None,
            };
        };
        let end = if self.with_rc {
            parse_rc(&self.buf[pos + self.marker.len()..]).map(|parsed| parsed.unwrap_or(-1))
        } else {
            Some(0)
        };
        let mut text = self.release(pos);
        if end.is_some() {
            text.push_str(&self.carry.finish());
            self.buf.clear();
        }
        Scanned { text, end }
    }

    /// The stream ended before its marker: everything held back.
    pub fn finish(&mut self) -> String {
        let n = self.buf.len();
        let mut text = self.release(n);
        text.push_str(&self.carry.finish());
        text
    }

    fn release(&mut self, upto: usize) -> String {
        let rest = self.buf.split_off(upto);
        let chunk = std::mem::replace(&mut self.buf, rest);
        self.carry.push(&chunk)
    }
}

/// How much of `buf` can be emitted without possibly cutting a marker that is still arriving.
fn safe_len(buf: &[u8], marker: &[u8]) -> usize {
    let max = marker.len().saturating_sub(1).min(buf.len());
    for k in (1..=max).rev() {
        if buf.ends_with(&marker[..k]) {
            return buf.len() - k;
        }
    }
    buf.len()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Parses `<digits>__\n` after the stdout marker. `None` while incomplete.
fn parse_rc(rest: &[u8]) -> Option<Result<i32, ()>> {
    let end = find(rest, b"__\n")?;
    Some(
        std::str::from_utf8(&rest[..end])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(()),
    )
}

/// Per-stream state of one run.
struct Side {
    scan: MarkerScan,
    /// The command's output, one event per line as for `/command` (see `crate::lines`).
    lines: Lines,
    done: bool,
    kind: EventKind,
}

impl Side {
    fn new(kind: EventKind, marker: Vec<u8>) -> Self {
        Self {
            scan: MarkerScan::new(marker, kind == EventKind::Stdout),
            lines: Lines::default(),
            done: false,
            kind,
        }
    }

    /// Sends the lines `text` completes, and with `last` the unterminated rest; the client may be
    /// gone, but the run still has to reach its markers to keep the shell in sync.
    async fn send(
        &mut self,
        text: String,
        last: bool,
        tx: &tokio::sync::mpsc::Sender<warren_api::execd::StreamEvent>,
    ) {
        let mut lines = self.lines.feed(text.as_bytes());
        if last {
            lines.extend(self.lines.finish());
        }
        for line in lines {
            let _ = tx.send(sse::event(self.kind, Some(line))).await;
        }
    }
}

/// Runs one command; returns whether the session is now unusable.
async fn run_in_session(
    session: &Session,
    id: &str,
    command: &str,
    cwd: Option<&std::path::Path>,
    timeout: Option<u64>,
    stream: sse::EventStream,
) -> bool {
    let tx = stream.tx.clone();
    let mut io = session.io.lock().await;
    let started = Instant::now();
    let _ = tx.send(sse::init(id)).await;
    let token = uuid::Uuid::new_v4().simple().to_string();
    if let Err(e) = io
        .stdin
        .write_all(script(command, cwd, &token).as_bytes())
        .await
    {
        let _ = tx
            .send(sse::error(
                format!("session shell is gone: {e}"),
                vec![e.to_string()],
            ))
            .await;
        return true;
    }
    let mut out = Side::new(EventKind::Stdout, out_marker(&token).into_bytes());
    let mut err = Side::new(EventKind::Stderr, err_marker(&token).into_bytes());
    let mut rc: Option<i32> = None;
    let deadline = async {
        match timeout {
            Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);
    let mut interrupted_at: Option<Instant> = None;
    let mut timed_out = false;
    let mut obuf = vec![0u8; 64 * 1024];
    let mut ebuf = vec![0u8; 64 * 1024];
    let SessionIo { stdout, stderr, .. } = &mut *io;
    while !(out.done && err.done) {
        let give_up = async {
            match interrupted_at {
                Some(t) => tokio::time::sleep_until((t + Duration::from_secs(2)).into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = stdout.read(&mut obuf), if !out.done => match r {
                Ok(0) | Err(_) => {
                    // The shell itself exited (e.g. the command ran `exit`).
                    let rest = out.scan.finish();
                    out.send(rest, true, &tx).await;
                    let _ = tx.send(sse::error("-1", vec!["session shell exited".to_string()])).await;
                    return true;
                }
                Ok(n) => {
                    let scanned = out.scan.feed(&obuf[..n]);
                    out.send(scanned.text, scanned.end.is_some(), &tx).await;
                    if scanned.end.is_some() {
                        rc = scanned.end;
                        out.done = true;
                    }
                }
            },
            r = stderr.read(&mut ebuf), if !err.done => match r {
                Ok(0) | Err(_) => {
                    let rest = err.scan.finish();
                    err.send(rest, true, &tx).await;
                    err.done = true;
                }
                Ok(n) => {
                    let scanned = err.scan.feed(&ebuf[..n]);
                    err.send(scanned.text, scanned.end.is_some(), &tx).await;
                    err.done = scanned.end.is_some();
                }
            },
            _ = &mut deadline, if interrupted_at.is_none() => {
                tracing::info!(session = %id, "session command timed out");
                timed_out = true;
                kill_descendants(session.pgid);
                interrupted_at = Some(Instant::now());
            }
            _ = stream.cancelled.cancelled(), if interrupted_at.is_none() => {
                tracing::info!(session = %id, "client went away, killing the session command");
                kill_descendants(session.pgid);
                interrupted_at = Some(Instant::now());
            }
            _ = give_up => {
                tracing::warn!(session = %id, "session did not recover after kill, dropping it");
                let _ = tx.send(sse::error("-1", vec!["session killed".to_string()])).await;
                return true;
            }
        }
    }
    let elapsed = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
    let rc = rc.unwrap_or(-1);
    let mut ev = crate::command::terminal_event(Exit::Code(rc), false, None, elapsed);
    if timed_out {
        if let Some(e) = ev.error.as_mut() {
            e.traceback.push(format!(
                "command timed out after {} ms",
                timeout.unwrap_or(0)
            ));
        }
    }
    let _ = tx.send(ev).await;
    false
}

/// Kills every descendant of the session shell but not the shell, so the session survives a timeout.
pub(crate) fn kill_descendants(shell_pid: i32) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The command name may contain spaces and parentheses; fields resume after the last ')'.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        if let Some(ppid) = after
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<i32>().ok())
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut stack = children.get(&shell_pid).cloned().unwrap_or_default();
    while let Some(pid) = stack.pop() {
        if let Some(c) = children.get(&pid) {
            stack.extend(c);
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(code::CONTEXT_NOT_FOUND, format!("session {id} not found"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn scans_the_marker_in_any_pieces() {
        let stream = "héllo\n__WARREN_END_ab_7__\ntrailing".as_bytes();
        for cut in 0..stream.len() {
            let mut scan = MarkerScan::new(b"__WARREN_END_ab_".to_vec(), true);
            let first = scan.feed(&stream[..cut]);
            let second = scan.feed(&stream[cut..]);
            let end = first.end.or(second.end);
            let text = if first.end.is_some() {
                first.text
            } else {
                first.text + &second.text
            };
            assert_eq!((text.as_str(), end), ("héllo\n", Some(7)), "cut at {cut}");
        }
    }

    #[test]
    fn holds_back_partial_marker() {
        let m = b"__WARREN_END_abc_";
        assert_eq!(safe_len(b"hello __WAR", m), 6);
        assert_eq!(safe_len(b"hello", m), 5);
        assert_eq!(safe_len(b"", m), 0);
    }

    #[test]
    fn parses_exit_code() {
        assert_eq!(parse_rc(b"17__\nrest"), Some(Ok(17)));
        assert_eq!(parse_rc(b"17_"), None);
        assert_eq!(parse_rc(b"x__\n"), Some(Err(())));
    }
}
