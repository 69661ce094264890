//! One isolated session as execd holds it: its shell (a bash started in the session's namespaces,
//! stdout and stderr on one pipe, as the reference merges them), the runs made in it, and the
//! background runs with their logs.
//!
//! A foreground run writes the code to the shell (through `eval`, stdin from /dev/null, so neither
//! a syntax error nor a read of stdin can desynchronise the shell), then an end marker with the exit
//! status; output before the marker is the run's, one `stdout` event per line (empty lines
//! dropped, as the reference does). Runs are serialised. A background run is a shell of its own in
//! the session, its output kept as the bytes written (16 MiB) and read by byte offset.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use warren_api::execd::{EventKind, ExecError, StreamEvent};
use warren_api::isolated::RunStatus;

use super::helper::{self, End, Helper};
use super::options::Options;
use crate::command::rfc3339;
use crate::lines::Lines;
use crate::logbuf::LogBuffer;
use crate::session::{quote, MarkerScan};
use crate::sse;

/// Background runs kept per session (finished ones beyond this are forgotten, oldest first).
const MAX_RUNS: usize = 64;

pub struct Shell {
    stdin: pipe::Sender,
    output: pipe::Receiver,
}

pub struct IsoSession {
    pub id: String,
    pub helper_id: u64,
    pub options: Options,
    pub env: Vec<String>,
    pub created_at: DateTime<Utc>,
    last_run_at: Mutex<DateTime<Utc>>,
    /// The shell's pid, as the sandbox numbers it.
    pub shell_pid: i32,
    pub shell: tokio::sync::Mutex<Shell>,
    pub dead: Arc<AtomicBool>,
    runs: Mutex<BTreeMap<String, Arc<BackgroundRun>>>,
}

pub struct BackgroundRun {
    pub id: String,
    pub started_at: DateTime<Utc>,
    pub log: LogBuffer,
    state: Mutex<RunState>,
}

#[derive(Default)]
struct RunState {
    finished_at: Option<DateTime<Utc>>,
    exit_code: Option<i32>,
    error: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shell every session and background run uses.
fn shell_path() -> String {
    crate::process::shell().to_string()
}

impl IsoSession {
    /// Starts the session's shell in helper session `helper_id` and checks it answers.
    pub async fn start(
        helper: &Arc<Helper>,
        id: String,
        helper_id: u64,
        options: Options,
        env: Vec<String>,
    ) -> Result<Arc<Self>, String> {
        let (stdin, stdin_theirs) = helper::pipe_out().map_err(|e| e.to_string())?;
        let (output, out_theirs) = helper::pipe_in().map_err(|e| e.to_string())?;
        let err_theirs = out_theirs.try_clone().map_err(|e| e.to_string())?;
        let mut argv = vec![shell_path()];
        if argv[0].ends_with("bash") {
            argv.extend(["--noprofile".to_string(), "--norc".to_string()]);
        }
        let started = helper
            .exec(
                helper_id,
                argv,
                env.clone(),
                options.workdir().to_string(),
                (options.uid, options.gid),
                [stdin_theirs, out_theirs, err_theirs],
            )
            .await?;
        let now = Utc::now();
        let session = Arc::new(Self {
            id,
            helper_id,
            options,
            env,
            created_at: now,
            last_run_at: Mutex::new(now),
            shell_pid: started.pid,
            shell: tokio::sync::Mutex::new(Shell { stdin, output }),
            dead: Arc::new(AtomicBool::new(false)),
            runs: Mutex::new(BTreeMap::new()),
        });
        let dead = session.dead.clone();
        let mut end = started.end;
        tokio::spawn(async move {
            let _ = end.wait_for(Option::is_some).await;
            dead.store(true, Ordering::SeqCst);
        });
        // The shell answers a first, empty run, or the session is no good.
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let cancel = tokio_util::sync::CancellationToken::new();
        let outcome = session.run("true", None, None, tx, cancel).await;
        while rx.try_recv().is_ok() {}
        match outcome {
            Outcome::Exited(0) => Ok(session),
            other => Err(format!("the session's shell did not start: {other:?}")),
        }
    }

    pub fn last_run_at(&self) -> DateTime<Utc> {
        *lock(&self.last_run_at)
    }

    fn touch(&self) {
        *lock(&self.last_run_at) = Utc::now();
    }

    /// Seconds left before the idle collector takes it, with an idle timeout.
    pub fn idle_remaining(&self) -> Option<i64> {
        let timeout = self.options.idle_timeout_seconds;
        (timeout > 0).then(|| {
            let idle = (Utc::now() - self.last_run_at()).num_seconds();
            (timeout - idle).max(0)
        })
    }

    pub fn status(&self) -> &'static str {
        if self.dead.load(Ordering::SeqCst) {
            "dead"
        } else {
            "active"
        }
    }

    /// Whether a background run is still going.
    pub fn busy_in_background(&self) -> bool {
        lock(&self.runs).values().any(|r| r.running())
    }

    /// One foreground run: events go to `tx`. Serialised with the session's other runs.
    pub async fn run(
        &self,
        code: &str,
        envs: Option<&BTreeMap<String, String>>,
        timeout: Option<Duration>,
        tx: tokio::sync::mpsc::Sender<StreamEvent>,
        cancelled: tokio_util::sync::CancellationToken,
    ) -> Outcome {
        let mut shell = self.shell.lock().await;
        let token = uuid::Uuid::new_v4().simple().to_string();
        let marker = format!("__ISOLATED_RUN_END_{token}_");
        // With envs: a subshell, so they (and anything the code exports or cd's) do not stay.
        let body = format!("eval {}", quote(code));
        let body = match envs.filter(|e| !e.is_empty()) {
            Some(envs) => {
                let exports: String = envs
                    .iter()
                    .map(|(k, v)| format!("export {k}={}\n", quote(v)))
                    .collect();
                format!("(\n{exports}{body}\n)")
            }
            None => format!("{{ {body}\n}}"),
        };
        let script = format!("{body} </dev/null\nprintf '{marker}%d__\\n' \"$?\"\n");
        if let Err(e) = shell.stdin.write_all(script.as_bytes()).await {
            self.dead.store(true, Ordering::SeqCst);
            return Outcome::ShellGone(e.to_string());
        }
        let mut scan = MarkerScan::new(marker.into_bytes(), true);
        let mut lines = Lines::default();
        let mut buf = vec![0u8; 64 * 1024];
        let deadline = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        let mut stopped: Option<(Instant, &'static str)> = None;
        let send = |text: String, last: bool, lines: &mut Lines| {
            let mut out = lines.feed(text.as_bytes());
            if last {
                out.extend(lines.finish());
            }
            out.into_iter().filter(|l| l != "\n" && !l.is_empty())
        };
        loop {
            let give_up = async {
                match stopped {
                    Some((t, _)) => {
                        tokio::time::sleep_until((t + Duration::from_secs(2)).into()).await
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = shell.output.read(&mut buf) => match r {
                    Ok(0) | Err(_) => {
                        for line in send(scan.finish(), true, &mut lines) {
                            let _ = tx.send(sse::event(EventKind::Stdout, Some(line))).await;
                        }
                        self.dead.store(true, Ordering::SeqCst);
                        return Outcome::ShellGone(
                            "session process exited without end marker (process may have died or called exit)".into(),
                        );
                    }
                    Ok(n) => {
                        let scanned = scan.feed(&buf[..n]);
                        for line in send(scanned.text, scanned.end.is_some(), &mut lines) {
                            let _ = tx.send(sse::event(EventKind::Stdout, Some(line))).await;
                        }
                        if let Some(rc) = scanned.end {
                            self.touch();
                            return match stopped {
                                Some((_, why)) => Outcome::Stopped(why),
                                None => Outcome::Exited(rc),
                            };
                        }
                    }
                },
                _ = &mut deadline, if stopped.is_none() => {
                    crate::session::kill_descendants(self.shell_pid);
                    stopped = Some((Instant::now(), "context deadline exceeded"));
                }
                _ = cancelled.cancelled(), if stopped.is_none() => {
                    crate::session::kill_descendants(self.shell_pid);
                    stopped = Some((Instant::now(), "context canceled"));
                }
                _ = give_up => {
                    self.dead.store(true, Ordering::SeqCst);
                    return Outcome::ShellGone("the session did not recover after its run was stopped".into());
                }
            }
        }
    }

    /// Starts a background run: a shell of its own in the session, with the session's
    /// environment and `envs`, in its workspace.
    pub async fn start_background(
        self: &Arc<Self>,
        helper: &Arc<Helper>,
        code: &str,
        envs: Option<&BTreeMap<String, String>>,
    ) -> Result<Arc<BackgroundRun>, String> {
        let (output, out_theirs) = helper::pipe_in().map_err(|e| e.to_string())?;
        let err_theirs = out_theirs.try_clone().map_err(|e| e.to_string())?;
        let stdin = helper::null().map_err(|e| e.to_string())?;
        let mut env: HashMap<String, String> = self
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if let Some(envs) = envs {
            env.extend(envs.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        let started = helper
            .exec(
                self.helper_id,
                vec![shell_path(), "-c".into(), code.to_string()],
                env,
                self.options.workdir().to_string(),
                (self.options.uid, self.options.gid),
                [stdin, out_theirs, err_theirs],
            )
            .await?;
        self.touch();
        let run = Arc::new(BackgroundRun {
            id: uuid::Uuid::new_v4().to_string(),
            started_at: Utc::now(),
            log: LogBuffer::default(),
            state: Mutex::new(RunState::default()),
        });
        {
            let mut runs = lock(&self.runs);
            while runs.len() >= MAX_RUNS {
                let Some(oldest) = runs
                    .values()
                    .filter(|r| !r.running())
                    .min_by_key(|r| r.started_at)
                    .map(|r| r.id.clone())
                else {
                    break;
                };
                runs.remove(&oldest);
            }
            runs.insert(run.id.clone(), run.clone());
        }
        let (run2, session) = (run.clone(), Arc::downgrade(self));
        let mut end = started.end;
        tokio::spawn(async move {
            let mut output = output;
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match output.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => run2.log.append(&buf[..n]),
                }
            }
            let ended = end
                .wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|e| e.clone());
            run2.log.close();
            let mut st = lock(&run2.state);
            st.finished_at = Some(Utc::now());
            match ended {
                Some(End::Exit(code)) => st.exit_code = Some(code),
                Some(End::Signal(sig)) => st.exit_code = Some(128 + sig),
                Some(End::Failed(why)) => st.error = Some(why),
                None => st.error = Some("session terminated".into()),
            }
            drop(st);
            if let Some(s) = session.upgrade() {
                if s.dead.load(Ordering::SeqCst) {
                    let mut st = lock(&run2.state);
                    st.exit_code = None;
                    st.error = Some("session terminated".into());
                }
                s.touch();
            }
        });
        Ok(run)
    }

    pub fn background_run(&self, id: &str) -> Option<Arc<BackgroundRun>> {
        lock(&self.runs).get(id).cloned()
    }
}

impl BackgroundRun {
    pub fn running(&self) -> bool {
        lock(&self.state).finished_at.is_none()
    }

    pub fn status(&self, session_id: &str) -> RunStatus {
        let st = lock(&self.state);
        RunStatus {
            session_id: session_id.to_string(),
            run_id: self.id.clone(),
            running: st.finished_at.is_none(),
            started_at: rfc3339(self.started_at),
            exit_code: st.exit_code,
            finished_at: st.finished_at.map(rfc3339),
            error: st.error.clone(),
        }
    }
}

/// How a foreground run ended.
#[derive(Debug)]
pub enum Outcome {
    Exited(i32),
    /// Stopped by its timeout or its client going away: the reference's context error.
    Stopped(&'static str),
    /// The shell ended (the code ran `exit`, or it was killed): the session is over.
    ShellGone(String),
}

impl Outcome {
    /// The run's last event, as the reference sends it.
    pub fn event(&self, elapsed_ms: i64) -> StreamEvent {
        let error = |ename: &str, evalue: String, text: Option<String>| StreamEvent {
            text,
            error: Some(ExecError {
                ename: ename.to_string(),
                evalue,
                traceback: Vec::new(),
            }),
            ..sse::event(EventKind::Error, None)
        };
        match self {
            Outcome::Exited(0) => sse::complete(elapsed_ms),
            Outcome::Exited(rc) => error(
                "ExitError",
                rc.to_string(),
                Some(format!("command exited with code {rc}")),
            ),
            Outcome::Stopped(why) => error("RuntimeError", why.to_string(), None),
            Outcome::ShellGone(why) => error("RuntimeError", why.clone(), None),
        }
    }
}
