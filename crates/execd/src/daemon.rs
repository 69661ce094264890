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
    /// Unix sockets to bind.
    pub sockets: Vec<PathBuf>,
    /// Sockets bound already, outside the sandbox, by whoever started execd (see
    /// `warren_core::bind_socket_in`).
    pub listeners: Vec<Listener>,
    pub listen: Option<SocketAddr>,
    pub workdir: PathBuf,
    pub entrypoint: Vec<String>,
    /// Serve the Jupyter health port here once a kernel can start.
    pub jupyter_port: Option<u16>,
    /// Closed once every listener is bound (see `adopt_ready_fd`).
    pub ready_fd: Option<OwnedFd>,
    /// The isolation helper's socket, where the runtime started one (see `isolation`).
    pub isolation_helper: Option<OwnedFd>,
    /// Answer only requests that carry this credential (see `access`).
    pub access: Option<crate::access::Verifier>,
    /// The floor under user code the server asks for (`--floor`; see `hardening`).
    pub floor: Option<warren_api::hardening::FloorPolicy>,
}

/// A listening socket handed to execd.
#[derive(Debug)]
pub enum Listener {
    Unix(std::os::unix::net::UnixListener),
    /// Bound outside the sandbox's network namespace (a loopback port of the host): the sandbox's
    /// own processes cannot reach it, and whoever can must hold execd's credential.
    Tcp(std::net::TcpListener),
}

impl std::os::fd::AsRawFd for Listener {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }
}

/// As the sandbox's init, execd lets go of what its runtime handed it from the host that the
/// sandbox could reach through `/proc/1/*` (an OCI runtime starts it with the caller's stdin and a
/// host log as stdout and stderr): it becomes non-dumpable, so no process of the sandbox may follow
/// its `/proc/1/{exe,fd/*,map_files/*}` links or read its memory (the sandbox keeps no
/// `CAP_SYS_PTRACE`; the embedded runtime's PID 1 is non-dumpable already), and takes stdin from the
/// sandbox's own `/dev/null`. stdout and stderr move onto the captured output (see `output`).
fn shed_host_objects() {
    // SAFETY: prctl(PR_SET_DUMPABLE) takes integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "could not make execd non-dumpable");
    }
    match std::fs::File::open("/dev/null") {
        // SAFETY: dup2 of a descriptor we own onto stdin; it touches no memory.
        Ok(null) => unsafe {
            libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 0);
        },
        Err(e) => tracing::warn!(error = %e, "no /dev/null in the sandbox; stdin stays as given"),
    }
}

/// Takes the `--listen-fd` descriptor: a listening Unix or TCP socket bound outside the sandbox
/// (by an OCI runtime's caller, passed with `--preserve-fds`), marked close-on-exec. `None` (with
/// a warning) when `fd` is not an open socket.
pub fn adopt_listen_fd(fd: i32) -> Option<Listener> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: fcntl on a descriptor number only reads and sets its flags; a closed one fails.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        tracing::warn!(
            fd,
            "--listen-fd is not an open descriptor above stderr; ignored"
        );
        return None;
    }
    // SAFETY: the descriptor is open (fcntl succeeded) and nothing else in execd owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let is_socket = nix::sys::stat::fstat(owned.as_raw_fd())
        .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK);
    if !is_socket {
        tracing::warn!(fd, "--listen-fd is not a socket; ignored");
        return None;
    }
    use nix::sys::socket::SockaddrLike;
    match nix::sys::socket::getsockname::<nix::sys::socket::SockaddrStorage>(owned.as_raw_fd()) {
        Ok(addr) if addr.family() == Some(nix::sys::socket::AddressFamily::Unix) => Some(
            Listener::Unix(std::os::unix::net::UnixListener::from(owned)),
        ),
        Ok(_) => Some(Listener::Tcp(std::net::TcpListener::from(owned))),
        Err(e) => {
            tracing::warn!(fd, error = %e, "--listen-fd: getsockname failed; ignored");
            None
        }
    }
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

/// Serves `app` on a TCP listener.
fn serve_tcp(
    servers: &mut tokio::task::JoinSet<std::io::Result<()>>,
    listener: tokio::net::TcpListener,
    app: axum::Router,
) {
    // Event streams are many small writes; Nagle would hold each back for the peer's delayed ACK.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        let _ = tcp.set_nodelay(true);
    });
    servers.spawn(axum::serve(listener, app).into_future());
}

/// Starts the entrypoint with `posix_spawn` rather than `Command` (see `crate::spawn`): the same
/// environment and process group as execd; stdout and stderr into the captured output when execd
/// is the sandbox's init.
fn start_entrypoint(
    reaper: &Reaper,
    program: &std::path::Path,
    first: &str,
    rest: &[String],
    workdir: &std::path::Path,
    output: Option<&crate::output::Output>,
) -> anyhow::Result<(i32, tokio::sync::oneshot::Receiver<Exit>)> {
    let env: Vec<(String, String)> = warren_env::vars().collect();
    let argv = std::iter::once(first)
        .chain(rest.iter().map(String::as_str))
        .map(std::ffi::OsStr::new);
    reaper
        .start(|| {
            crate::spawn::spawn(
                program,
                argv,
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                workdir,
                crate::spawn::Stdio {
                    stdin: crate::spawn::Stdin::Inherit,
                    stdout: output.map(|o| o.fd()),
                    stderr: output.map(|o| o.fd()),
                    new_group: false,
                    extra: &[],
                },
            )
        })
        .with_context(|| format!("starting entrypoint {first}"))
}

/// Runs until the entrypoint exits or a stop signal arrives; returns execd's exit code.
/// `forker` makes the files workers (see `forker`), forked before the runtime started.
/// Signals an init passes on to the entrypoint as they come, as the reference's execd does: a
/// reload (`HUP`), an application's own (`USR1`, `USR2`), and a terminal resize (`WINCH`).
const FORWARDED: [(SignalKind, Signal); 4] = [
    (SignalKind::hangup(), Signal::SIGHUP),
    (SignalKind::user_defined1(), Signal::SIGUSR1),
    (SignalKind::user_defined2(), Signal::SIGUSR2),
    (SignalKind::window_change(), Signal::SIGWINCH),
];

fn forward_signals(pid: i32) -> anyhow::Result<()> {
    for (kind, sig) in FORWARDED {
        let mut stream = signal(kind).with_context(|| format!("installing the {sig} handler"))?;
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                // (gone already: its exit ends execd's wait)
                let _ = kill(Pid::from_raw(pid), sig);
            }
        });
    }
    Ok(())
}

pub async fn run(mut config: Config, forker: Option<crate::forker::Forker>) -> anyhow::Result<i32> {
    // `ps` in the sandbox names PID 1 as the reference's does, whatever the binary is called.
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"execd".as_ptr(), 0, 0, 0) };
    crate::oom::remember();
    let subreaper = match reaper::become_subreaper() {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "could not become child subreaper; grandchildren may be left as zombies");
            false
        }
    };
    // Before any child: every one of them starts under the floor when there is one. A policy that
    // cannot be laid is execd's failure to start, never user code run without it.
    let hardening = crate::hardening::Hardening::resolve(
        config.floor.as_ref(),
        warren_env::var(crate::hardening::ISOLATION_CONFIG_VAR).as_deref(),
        crate::hardening::Supervision::detect(subreaper),
    )
    .map_err(|e| anyhow::anyhow!("hardening: {e}"))?;
    let reaper = Reaper::with_floor(hardening.floor.clone());
    tokio::spawn({
        let reaper = reaper.clone();
        async move {
            if let Err(e) = reaper.run().await {
                tracing::error!(error = %e, "reaper stopped");
            }
        }
    });
    // As the sandbox's init (PID 1 of its PID namespace), output goes to a ring in memory, not to
    // the host file the runtime gave us (see `output`).
    let output = if std::process::id() == 1 {
        shed_host_objects();
        crate::output::start()
    } else {
        None
    };
    let mut state = AppState::new(reaper.clone(), config.workdir.clone());
    state.hardening = hardening.status;
    state.isolation = crate::isolation::Isolation::new(config.isolation_helper.take());
    state.forker = forker;
    // A desktop asked for is up (its X server answering) before execd listens, and before the
    // entrypoint starts, which may want to draw on it.
    if let Some(size) = warren_env::var(warren_api::desktop::DESKTOP_ENV) {
        let desktop = crate::desktop::Desktop::start(&reaper, &size)
            .await
            .map_err(|e| anyhow::anyhow!("the desktop: {e}"))?;
        state.desktop = Some(Arc::new(desktop));
    }
    if warren_env::is_set(warren_api::desktop::BROWSER_ENV) {
        let browser = crate::browser::Browser::start(&reaper, state.desktop.is_some())
            .await
            .map_err(|e| anyhow::anyhow!("the browser: {e}"))?;
        state.browser = Some(Arc::new(browser));
    }
    let state = Arc::new(state);
    crate::isolation::Isolation::start_collector(&state);
    let app = match config.access.take() {
        Some(verifier) => router(state.clone()).layer(axum::middleware::from_fn_with_state(
            Arc::new(verifier),
            crate::access::check,
        )),
        None => router(state.clone()),
    };

    let mut entry_pid = None;
    let entry_exit = if config.entrypoint.is_empty() {
        None
    } else {
        let (first, rest) = config
            .entrypoint
            .split_first()
            .context("empty entrypoint")?;
        let program =
            crate::spawn::resolve(first, warren_env::var(warren_env::EnvVars::PATH).as_deref())
                .with_context(|| format!("starting entrypoint {first}"))?;
        let (pid, exit) = match reaper.floor() {
            None => start_entrypoint(&reaper, &program, first, rest, &config.workdir, output)?,
            // Under the floor: through `Command`, whose fork can lower the child before its exec.
            Some(_) => {
                let mut cmd = std::process::Command::new(&program);
                std::os::unix::process::CommandExt::arg0(&mut cmd, first);
                cmd.args(rest).current_dir(&config.workdir);
                if let Some(o) = output {
                    cmd.stdout(o.file()?).stderr(o.file()?);
                }
                let spawned = reaper
                    .spawn_as(&mut cmd, crate::hardening::Role::Entrypoint, None)
                    .with_context(|| format!("starting entrypoint {first}"))?;
                let pid = i32::try_from(spawned.child.id()).unwrap_or(i32::MAX);
                (pid, spawned.exit)
            }
        };
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
    for listener in config.listeners {
        match listener {
            Listener::Unix(listener) => {
                listener
                    .set_nonblocking(true)
                    .context("handed-over socket")?;
                let listener =
                    tokio::net::UnixListener::from_std(listener).context("handed-over socket")?;
                tracing::info!("listening on the handed-over socket");
                servers.spawn(axum::serve(listener, app.clone()).into_future());
            }
            Listener::Tcp(listener) => {
                listener
                    .set_nonblocking(true)
                    .context("handed-over socket")?;
                let listener =
                    tokio::net::TcpListener::from_std(listener).context("handed-over socket")?;
                tracing::info!("listening on the handed-over TCP socket");
                serve_tcp(&mut servers, listener, app.clone());
            }
        }
    }
    if let Some(addr) = config.listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        tracing::info!(addr = %listener.local_addr().unwrap_or(addr), "listening");
        serve_tcp(&mut servers, listener, app.clone());
    }
    // Before anyone learns that execd is ready, who may then stop it: a SIGTERM with no handler yet
    // would end execd without the entrypoint hearing of it (outside a PID namespace, where the
    // kernel does not shield PID 1).
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    if let Some(pid) = entry_pid {
        forward_signals(pid)?;
    }
    // Listening: whoever waits on the other end of the ready pipe may connect now.
    drop(config.ready_fd);
    // What execd says from here on is the sandbox's business, kept with the entrypoint's output.
    if let Some(output) = output {
        output.take_over_stdio();
    }
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
