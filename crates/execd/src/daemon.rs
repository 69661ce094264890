//! Wiring of the whole daemon: reaper, listeners, the sandbox entrypoint and signals.
//!
//! Docker semantics: the sandbox ends with its main process, so when an entrypoint is given execd exits
//! with the entrypoint's exit code; SIGTERM/SIGINT to execd are forwarded to the entrypoint first.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};

use crate::reaper::{self, Exit, Reaper};
use crate::{router, AppState};

/// How long the entrypoint gets to stop after a forwarded SIGTERM before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct Config {
    pub sockets: Vec<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub workdir: PathBuf,
    pub entrypoint: Vec<String>,
    /// Serve the Jupyter health port here once a kernel can start.
    pub jupyter_port: Option<u16>,
    /// Closed once every listener is bound (see `adopt_ready_fd`).
    pub ready_fd: Option<OwnedFd>,
}

/// Takes the `--ready-fd` descriptor: marks it close-on-exec, so no process execd starts holds it,
/// and owns it, so that dropping it tells the other end that execd listens. `None` (with a
/// warning) when `fd` is not open.
pub fn adopt_ready_fd(fd: i32) -> Option<OwnedFd> {
    // SAFETY: fcntl on a descriptor number only reads and sets its flags; a closed one fails.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        tracing::warn!(
            fd,
            "--ready-fd is not an open descriptor above stderr; ignored"
        );
        return None;
    }
    // SAFETY: the descriptor is open (fcntl succeeded) and nothing else in execd owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Runs until the entrypoint exits or a stop signal arrives; returns execd's exit code.
pub async fn run(config: Config) -> anyhow::Result<i32> {
    crate::oom::remember();
    if let Err(e) = reaper::become_subreaper() {
        tracing::warn!(error = %e, "could not become child subreaper; grandchildren may be left as zombies");
    }
    let reaper = Reaper::new();
    tokio::spawn({
        let reaper = reaper.clone();
        async move {
            if let Err(e) = reaper.run().await {
                tracing::error!(error = %e, "reaper stopped");
            }
        }
    });
    let state = Arc::new(AppState::new(reaper.clone(), config.workdir.clone()));
    let app = router(state.clone());

    let mut entry_pid = None;
    let entry_exit = if config.entrypoint.is_empty() {
        None
    } else {
        let (first, rest) = config
            .entrypoint
            .split_first()
            .context("empty entrypoint")?;
        // posix_spawn rather than Command: see `crate::spawn`. Same environment, stdio and process
        // group as execd.
        let program = crate::spawn::resolve(first, std::env::var("PATH").ok().as_deref())
            .with_context(|| format!("starting entrypoint {first}"))?;
        let env: Vec<(String, String)> = std::env::vars().collect();
        let argv = std::iter::once(first).chain(rest).map(std::ffi::OsStr::new);
        let (pid, exit) = reaper
            .start(|| {
                crate::spawn::spawn(
                    &program,
                    argv,
                    env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                    &config.workdir,
                    crate::spawn::Stdio {
                        stdin: crate::spawn::Stdin::Inherit,
                        stdout: None,
                        stderr: None,
                        new_group: false,
                        extra: &[],
                    },
                )
            })
            .with_context(|| format!("starting entrypoint {first}"))?;
        tracing::info!(pid, entrypoint = ?config.entrypoint, "entrypoint started");
        entry_pid = Some(pid);
        Some(exit)
    };
    // Listen only once the entrypoint runs: the server treats a connectable socket as "ready", so an
    // entrypoint that cannot start must fail the create, not a moment after it.
    let mut servers = tokio::task::JoinSet::new();
    for path in &config.sockets {
        // A stale socket from a previous run would make bind fail.
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("binding unix socket {}", path.display()))?;
        tracing::info!(socket = %path.display(), "listening");
        servers.spawn(axum::serve(listener, app.clone()).into_future());
    }
    if let Some(addr) = config.listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        tracing::info!(addr = %listener.local_addr().unwrap_or(addr), "listening");
        // Event streams are many small writes; Nagle would hold each back for the peer's delayed ACK.
        let listener =
            axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
                let _ = tcp.set_nodelay(true);
            });
        servers.spawn(axum::serve(listener, app.clone()).into_future());
    }
    // Before anyone learns that execd is ready, who may then stop it: a SIGTERM with no handler yet
    // would end execd without the entrypoint hearing of it (outside a PID namespace, where the
    // kernel does not shield PID 1).
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    // Listening: whoever waits on the other end of the ready pipe may connect now.
    drop(config.ready_fd);
    tokio::spawn({
        let (state, reaper) = (state.clone(), reaper.clone());
        async move { state.spare.keep(reaper, state.workdir.clone()).await }
    });
    if let Some(port) = config.jupyter_port {
        // Not in `servers`: it waits for a kernel to appear and may never listen, which is not a failure.
        tokio::spawn(crate::interpreter::jupyter_port::serve(port));
    }

    let entry_wait = async {
        match entry_exit {
            Some(rx) => rx.await.unwrap_or(Exit::Code(1)),
            None => std::future::pending().await,
        }
    };
    tokio::pin!(entry_wait);

    let code = tokio::select! {
        exit = &mut entry_wait => {
            tracing::info!(?exit, "entrypoint exited");
            exit.shell_code()
        }
        Some(res) = servers.join_next() => {
            state.shutdown();
            let res = res.context("server task panicked")?;
            res.context("server failed")?;
            anyhow::bail!("server stopped unexpectedly");
        }
        _ = async { tokio::select! { _ = sigterm.recv() => {}, _ = sigint.recv() => {} } } => {
            tracing::info!("stop signal received");
            match entry_pid {
                Some(pid) => {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
                    match tokio::time::timeout(STOP_GRACE, &mut entry_wait).await {
                        Ok(exit) => exit.shell_code(),
                        Err(_) => {
                            tracing::warn!(pid, "entrypoint ignored SIGTERM, killing it");
                            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                            entry_wait.await.shell_code()
                        }
                    }
                }
                None => 0,
            }
        }
    };
    state.shutdown();
    for path in &config.sockets {
        let _ = std::fs::remove_file(path);
    }
    Ok(code)
}
