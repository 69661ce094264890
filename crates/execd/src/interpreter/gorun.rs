//! Go without a Jupyter kernel (none is on a registry this project can reach): where the image has
//! a Go toolchain (Debian's `golang-go`), each run is a program of its own, built with `go build`
//! and run, its output streamed. A cell without a `package` clause is taken as `package main`. A
//! build failure is a `CompilationError` with the compiler's words; a program that fails, an
//! `ExitError` (`exit status N`, or the signal). Nothing is kept between runs but the build cache,
//! which makes the next build of the same imports quick. The toolchain is kept off the network
//! (`GOPROXY=off`, `GOTOOLCHAIN=local`) and needs no C compiler (`CGO_ENABLED=0`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch};
use warren_api::execd::EventKind;

use super::tools::{failure, Interrupter, ToolLaunch};
use crate::process::{self, kill_group, ProcessSpec, Program, Running, StdinMode, Utf8Carry};
use crate::reaper::{Exit, Reaper};
use crate::sse::{self, EventStream};

/// How much of the compiler's output an error keeps.
const COMPILER_OUTPUT: usize = 16 * 1024;
/// After an interrupt's SIGINT, how long a program gets before its group is killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(2);

pub struct GoRun {
    go: PathBuf,
    dir: PathBuf,
    cwd: PathBuf,
    reaper: Reaper,
}

impl GoRun {
    pub fn start(l: &ToolLaunch<'_>) -> Result<GoRun, String> {
        Ok(GoRun {
            go: l.program.to_path_buf(),
            dir: l.folder("go")?,
            cwd: l.cwd.to_path_buf(),
            reaper: l.reaper.clone(),
        })
    }

    fn env(&self) -> BTreeMap<String, String> {
        let at = |p: &str| self.dir.join(p).display().to_string();
        [
            ("GOCACHE", at("cache")),
            ("GOPATH", at("gopath")),
            ("GOTMPDIR", self.dir.display().to_string()),
            ("GOPROXY", "off".to_string()),
            ("GOTOOLCHAIN", "local".to_string()),
            ("GOFLAGS", "-mod=mod".to_string()),
            ("GOTELEMETRY", "off".to_string()),
            ("CGO_ENABLED", "0".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn spawn(&self, argv: Vec<String>, cwd: &Path) -> Result<Running, String> {
        process::spawn(
            &self.reaper,
            &ProcessSpec {
                program: Program::Argv(argv),
                cwd: cwd.to_path_buf(),
                envs: self.env(),
                uid: None,
                gid: None,
                combine_output: false,
            },
            StdinMode::Null,
        )
        .map_err(|e| e.full_message())
    }

    /// Builds and runs `code`, sending its events (from `init` to the terminal one) to `out`.
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
        let source = if code.lines().any(|l| l.trim_start().starts_with("package ")) {
            code.to_string()
        } else {
            format!("package main\n\n{code}\n")
        };
        let (main, program) = (self.dir.join("main.go"), self.dir.join("program"));
        if let Err(e) = std::fs::write(&main, source) {
            return send(failure(
                "RuntimeError",
                &format!("writing {}: {e}", main.display()),
                vec![],
            ))
            .await;
        }
        let _ = std::fs::remove_file(&program);
        let mut interrupter = Interrupter::new(interrupts, || {});
        // The build: its output is the error's, not the run's.
        let build = match self.spawn(
            vec![
                self.go.display().to_string(),
                "build".into(),
                "-o".into(),
                program.display().to_string(),
                main.display().to_string(),
            ],
            &self.dir,
        ) {
            Ok(r) => r,
            Err(e) => return send(failure("RuntimeError", &e, vec![])).await,
        };
        let builder = build.pid;
        let (mut chunks, exit) = stream(build);
        let mut compiler = String::new();
        let status = tokio::select! {
            status = collect(&mut chunks, exit, |_, text| {
                if compiler.len() < COMPILER_OUTPUT {
                    compiler.push_str(&text);
                }
            }) => status,
            () = interrupter.wait(&out.cancelled) => None,
        };
        match status {
            Some(Exit::Code(0)) => {}
            None => {
                kill_group(builder, Signal::SIGKILL);
                return send(failure(
                    "KeyboardInterrupt",
                    "interrupted while building",
                    vec![],
                ))
                .await;
            }
            Some(_) => {
                let lines: Vec<String> = compiler
                    .lines()
                    .filter(|l| !l.starts_with("# "))
                    .map(|l| l.replace(&main.display().to_string(), "main.go"))
                    .collect();
                let evalue = lines
                    .first()
                    .cloned()
                    .unwrap_or_else(|| "the build failed".into());
                return send(failure("CompilationError", &evalue, lines)).await;
            }
        }
        // The program: its output streamed as it comes.
        let run = match self.spawn(vec![program.display().to_string()], &self.cwd) {
            Ok(r) => r,
            Err(e) => return send(failure("RuntimeError", &e, vec![])).await,
        };
        let pgid = run.pid;
        let (mut chunks, mut exit) = stream(run);
        let mut stopping: Option<Instant> = None;
        let status = loop {
            tokio::select! {
                chunk = chunks.recv() => match chunk {
                    Some((kind, text)) => send(sse::event(kind, Some(text))).await,
                    None => break exit.await.unwrap_or(Exit::Code(-1)),
                },
                () = interrupter.wait(&out.cancelled) => {
                    kill_group(pgid, Signal::SIGINT);
                    stopping.get_or_insert_with(Instant::now);
                }
                () = async {
                    match stopping {
                        Some(at) => tokio::time::sleep_until((at + INTERRUPT_GRACE).into()).await,
                        None => std::future::pending().await,
                    }
                } => {
                    kill_group(pgid, Signal::SIGKILL);
                    stopping = None;
                }
                status = &mut exit => {
                    // what is left in the pipes still comes first
                    while let Some((kind, text)) = chunks.recv().await {
                        send(sse::event(kind, Some(text))).await;
                    }
                    break status.unwrap_or(Exit::Code(-1));
                }
            }
        };
        kill_group(pgid, Signal::SIGKILL); // anything it left running
        let ev = match status {
            Exit::Code(0) => sse::complete(started.elapsed().as_millis() as i64),
            _ if interrupter.interrupted() => failure("KeyboardInterrupt", "interrupted", vec![]),
            Exit::Code(c) => failure("ExitError", &format!("exit status {c}"), vec![]),
            Exit::Signal(s) => {
                let name = Signal::try_from(s).map(|s| s.as_str()).unwrap_or("?");
                failure(
                    "ExitError",
                    &format!("killed by signal {s} ({name})"),
                    vec![],
                )
            }
        };
        send(ev).await;
    }

    pub fn kill(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running process's output as (stdout or stderr, text) chunks, UTF-8 whole, in arrival order
/// per stream; the channel ends once both pipes are closed.
fn stream(
    r: Running,
) -> (
    mpsc::Receiver<(EventKind, String)>,
    tokio::sync::oneshot::Receiver<Exit>,
) {
    let (tx, rx) = mpsc::channel(64);
    for (pipe, kind) in [(r.stdout, EventKind::Stdout), (r.stderr, EventKind::Stderr)] {
        if let Some(pipe) = pipe {
            tokio::spawn(forward(pipe, kind, tx.clone()));
        }
    }
    (rx, r.exit)
}

async fn forward(mut pipe: pipe::Receiver, kind: EventKind, tx: mpsc::Sender<(EventKind, String)>) {
    let mut buf = vec![0u8; 8192];
    let mut carry = Utf8Carry::default();
    while let Ok(n @ 1..) = pipe.read(&mut buf).await {
        let text = carry.push(&buf[..n]);
        if !text.is_empty() && tx.send((kind, text)).await.is_err() {
            return;
        }
    }
    let rest = carry.finish();
    if !rest.is_empty() {
        let _ = tx.send((kind, rest)).await;
    }
}

/// Everything a process prints, to `each`, and how it ended.
async fn collect(
    chunks: &mut mpsc::Receiver<(EventKind, String)>,
    exit: tokio::sync::oneshot::Receiver<Exit>,
    mut each: impl FnMut(EventKind, String),
) -> Option<Exit> {
    while let Some((kind, text)) = chunks.recv().await {
        each(kind, text);
    }
    Some(exit.await.unwrap_or(Exit::Code(-1)))
}
