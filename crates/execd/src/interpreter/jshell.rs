//! Java without a Jupyter kernel: where the image has a JDK (`java` with the `jdk.jshell` module)
//! but no Java kernelspec, a context is one JShell — the JDK's own REPL engine, the one IJava (the
//! reference's Java kernel) is built on — driven by a small program execd writes next to the
//! connection files and starts with `java WarrenJShell.java` (see that file for its wire).
//!
//! State stays between runs; a cell is split into snippets as JShell's REPL splits them; a cell that
//! ends in an expression answers its value; a runtime exception is an `EvalException` (the name
//! IJava gives it) and a compile error a `CompilationException`, each with the message and the
//! trace. An interrupt stops the running snippet (JShell's `stop`), the state kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::unix::pipe;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use warren_api::execd::EventKind;

use super::kernel::{
    describe_exit, keep_tail, results_of, write_private, KillOnDrop, START_TIMEOUT,
};
use super::tools::{failure, Interrupter, ToolLaunch};
use crate::process::{command_env, kill_group};
use crate::reaper::{Exit, Spawned};
use crate::sse::{self, EventStream};

/// The driver, written into the context's folder at start.
const DRIVER: &str = include_str!("WarrenJShell.java");
const NAME: &str = "java (jshell)";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Io {
    stdin: pipe::Sender,
    wire: Lines<BufReader<pipe::Receiver>>,
}

pub struct Jshell {
    pub pid: i32,
    io: tokio::sync::Mutex<Io>,
    /// Why the JVM is gone, once it is.
    died: Arc<Mutex<Option<String>>>,
    exit: watch::Receiver<Option<Exit>>,
    dir: PathBuf,
    tasks: Vec<AbortHandle>,
}

/// One line of the driver's wire.
fn decode(line: &str) -> Option<(char, String)> {
    let (kind, payload) = line.split_once(' ')?;
    let kind = kind.chars().next()?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .ok()?;
    Some((kind, String::from_utf8_lossy(&bytes).into_owned()))
}

impl Jshell {
    pub async fn start(l: &ToolLaunch<'_>) -> Result<Jshell, String> {
        let dir = l.folder("java")?;
        let driver = dir.join("WarrenJShell.java");
        write_private(&driver, DRIVER.as_bytes())
            .map_err(|e| format!("writing {}: {e}", driver.display()))?;
        let (err_r, err_w) = std::io::pipe().map_err(|e| format!("creating a pipe: {e}"))?;
        let mut cmd = Command::new(l.program);
        cmd.arg(&driver)
            .current_dir(l.cwd)
            .env_clear()
            .envs(command_env(&BTreeMap::new()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err_w);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let Spawned { mut child, exit } = l
            .reaper
            .spawn(&mut cmd)
            .map_err(|e| format!("starting {}: {e}", l.program.display()))?;
        drop(cmd);
        let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
        let mut guard = KillOnDrop(Some(pid));
        let pipes = (child.stdin.take(), child.stdout.take());
        let (Some(stdin), Some(stdout)) = pipes else {
            return Err("the JVM's pipes are missing".into());
        };
        let stdin = pipe::Sender::from_owned_fd(stdin.into()).map_err(|e| e.to_string())?;
        let stdout = pipe::Receiver::from_owned_fd(stdout.into()).map_err(|e| e.to_string())?;
        let tail = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        if let Ok(rx) = pipe::Receiver::from_owned_fd(err_r.into()) {
            tasks.push(tokio::spawn(keep_tail(rx, tail.clone())).abort_handle());
        }
        let died = Arc::new(Mutex::new(None));
        let (exit_tx, exit_rx) = watch::channel(None);
        {
            let (died, tail, sources) = (died.clone(), tail.clone(), l.sources.clone());
            let oom_before = sources.oom_kills();
            tokio::spawn(async move {
                let status = exit.await.unwrap_or(Exit::Code(-1));
                let oom = matches!(status, Exit::Signal(9))
                    && sources.oom_kills().unwrap_or(0) > oom_before.unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(20)).await;
                *lock(&died) = Some(describe_exit(NAME, status, oom, &lock(&tail)));
                let _ = exit_tx.send(Some(status));
            });
        }
        let mut wire = BufReader::new(stdout).lines();
        let mut exit_watch = exit_rx.clone();
        let ready = tokio::time::timeout(START_TIMEOUT, async {
            tokio::select! {
                line = wire.next_line() => line.ok().flatten(),
                _ = exit_watch.wait_for(|e| e.is_some()) => None,
            }
        })
        .await;
        match ready {
            Ok(Some(line)) if decode(&line).is_some_and(|(k, _)| k == 'D') => {}
            Ok(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Err(lock(&died).clone().unwrap_or_else(|| {
                    format!(
                        "{NAME} did not start: {}",
                        String::from_utf8_lossy(&lock(&tail))
                    )
                }));
            }
            Err(_) => {
                return Err(format!(
                    "{NAME} did not start within {} s",
                    START_TIMEOUT.as_secs()
                ))
            }
        }
        lock(&tail).clear();
        guard.0 = None;
        Ok(Jshell {
            pid,
            io: tokio::sync::Mutex::new(Io { stdin, wire }),
            died,
            exit: exit_rx,
            dir,
            tasks,
        })
    }

    pub fn died(&self) -> Option<String> {
        lock(&self.died).clone()
    }

    /// Runs `code`, sending its events (from `init` to the terminal one) to `out`.
    pub async fn run(
        &self,
        id: &str,
        code: &str,
        out: &EventStream,
        interrupts: watch::Receiver<u64>,
    ) {
        let send = |ev| async {
            let _ = out.tx.send(ev).await;
        };
        send(sse::init(id)).await;
        let started = Instant::now();
        let mut io = self.io.lock().await;
        let framed = [
            format!("{}\n", code.len()).into_bytes(),
            code.as_bytes().to_vec(),
        ]
        .concat();
        if io.stdin.write_all(&framed).await.is_err() {
            return send(self.gone().await).await;
        }
        let pid = self.pid;
        let mut interrupter = Interrupter::new(interrupts, move || {
            // The JVM only: a SIGINT to its group would end JShell's agent JVM, and the state.
            let _ = kill(Pid::from_raw(pid), Signal::SIGINT);
        });
        let mut failed = false;
        loop {
            let line = tokio::select! {
                line = io.wire.next_line() => line,
                () = interrupter.wait(&out.cancelled) => continue,
            };
            let Ok(Some(line)) = line else {
                return send(self.gone().await).await;
            };
            let Some((kind, text)) = decode(&line) else {
                continue;
            };
            match kind {
                'O' => send(sse::event(EventKind::Stdout, Some(text))).await,
                'E' => send(sse::event(EventKind::Stderr, Some(text))).await,
                'R' => {
                    send(warren_api::execd::StreamEvent {
                        results: Some(results_of(&serde_json::json!({ "text/plain": text }))),
                        ..sse::event(EventKind::Result, None)
                    })
                    .await
                }
                'X' => {
                    failed = true;
                    let mut lines = text.split('\n');
                    let ename = lines.next().unwrap_or("Error").to_string();
                    let evalue = lines.next().unwrap_or_default().to_string();
                    send(failure(
                        &ename,
                        &evalue,
                        lines.map(str::to_string).collect(),
                    ))
                    .await;
                }
                'D' => break,
                _ => {}
            }
        }
        if !failed {
            send(sse::complete(started.elapsed().as_millis() as i64)).await;
        }
    }

    /// The error event for a JVM that went away mid-run (its reason, once the reaper has it).
    async fn gone(&self) -> warren_api::execd::StreamEvent {
        let mut exit = self.exit.clone();
        let _ = tokio::time::timeout(Duration::from_secs(2), exit.wait_for(|e| e.is_some())).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        super::kernel_died(
            self.died()
                .unwrap_or_else(|| format!("{NAME} stopped answering")),
        )
    }

    pub fn kill(&self) {
        kill_group(self.pid, Signal::SIGKILL);
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Ends the JVM: its input closes (the driver returns), then the group is killed.
    pub async fn shutdown(&self) {
        {
            let mut io = self.io.lock().await;
            let _ = io.stdin.shutdown().await;
        }
        let mut exit = self.exit.clone();
        let _ = tokio::time::timeout(Duration::from_secs(2), exit.wait_for(|e| e.is_some())).await;
        self.kill();
    }

    pub fn folder(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Jshell {
    fn drop(&mut self) {
        self.kill();
        for t in &self.tasks {
            t.abort();
        }
    }
}
