//! execd's command line: `warren-execd [--socket PATH]... [--listen ADDR] [--listen-fd FD]
//! [--access-token-sha256 HEX] [--workdir DIR] [--jupyter-port N] [--ready-fd FD]
//! [-- ENTRYPOINT ARGV...]`, parsed and run; or `warren-execd relay …` (see [`crate::relay`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

use crate::daemon::{self, Config};

#[derive(Debug, Parser)]
#[command(
    name = "warren-execd",
    version,
    about = "Warren's in-sandbox daemon (OpenSandbox execd API)"
)]
struct Args {
    /// Serve the API on this Unix socket (repeatable).
    #[arg(long = "socket", value_name = "PATH")]
    sockets: Vec<PathBuf>,
    /// Serve the API on this TCP address. Defaults to 0.0.0.0:44772 when no socket is given either.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Working directory for the entrypoint, commands and relative paths; default: the one execd
    /// was started in (a container's, its image's `WORKDIR`), else `/`.
    #[arg(long, value_name = "DIR")]
    workdir: Option<PathBuf>,
    /// Where the code-interpreter SDK's health check connects once a Jupyter kernel can start
    /// (`$JUPYTER_PORT`, else 44771); 0 disables it.
    #[arg(long, value_name = "PORT")]
    jupyter_port: Option<u16>,
    /// A listening Unix or TCP socket to serve on, bound by whoever started execd (outside the
    /// sandbox).
    #[arg(long, value_name = "FD")]
    listen_fd: Option<i32>,
    /// Answer only requests whose `X-EXECD-ACCESS-TOKEN` hashes to this SHA-256 (hex), on every
    /// listener: for a TCP listener others can reach. Only the hash is given, since a sandbox's
    /// processes can read execd's command line.
    #[arg(long, value_name = "HEX")]
    access_token_sha256: Option<String>,
    /// A descriptor execd closes once it listens: whoever holds the other end of this pipe learns
    /// that execd is ready without polling its socket.
    #[arg(long, value_name = "FD")]
    ready_fd: Option<i32>,
    /// The floor under user code, as JSON (`{"keep_capabilities": […], "seccomp_deny": […]}`;
    /// `{}` for the defaults): see the `hardening` module.
    #[arg(long, value_name = "JSON")]
    floor: Option<String>,
    /// The sandbox's main process; execd exits with its exit code.
    #[arg(last = true, value_name = "ENTRYPOINT")]
    entrypoint: Vec<String>,
}

/// execd's whole life from its command line (`args[0]` is the program name): logging, the runtime,
/// the daemon. Returns the exit code: the entrypoint's, or 1 when execd itself could not run.
/// This is the `warren-execd` binary's `main`; the embedded runtime, which runs execd in the
/// sandbox's PID 1 without exec'ing the binary, builds the [`Config`] itself and calls [`serve`].
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    if args.get(1).is_some_and(|a| a == crate::relay::RELAY_ARG) {
        return crate::relay::run(&args[2..]);
    }
    init_logging(None);
    let args = Args::parse_from(args);
    let access = match args
        .access_token_sha256
        .as_deref()
        .map(crate::access::Verifier::from_hex)
    {
        Some(Err(e)) => {
            eprintln!("warren-execd: {e}");
            return 2;
        }
        Some(Ok(v)) => Some(v),
        None => None,
    };
    let floor = match args.floor.as_deref().map(serde_json::from_str) {
        Some(Err(e)) => {
            eprintln!("warren-execd: --floor: {e}");
            return 2;
        }
        Some(Ok(f)) => Some(f),
        None => None,
    };
    // Before anything is spawned: the entrypoint and commands must not inherit it.
    let ready_fd = args.ready_fd.and_then(daemon::adopt_ready_fd);
    let listeners: Vec<_> = args
        .listen_fd
        .and_then(daemon::adopt_listen_fd)
        .into_iter()
        .collect();
    let listen = match (
        &args.listen,
        args.sockets.is_empty() && listeners.is_empty(),
    ) {
        (None, true) => Some(SocketAddr::from(([0, 0, 0, 0], warren_api::EXECD_PORT))),
        (l, _) => *l,
    };
    serve(Config {
        sockets: args.sockets,
        listeners,
        listen,
        workdir: args.workdir.unwrap_or_else(|| {
            std::env::current_dir()
                .ok()
                .filter(|d| d.is_absolute())
                .unwrap_or_else(|| PathBuf::from("/"))
        }),
        entrypoint: args.entrypoint,
        jupyter_port: match args.jupyter_port {
            Some(port) => (port != 0).then_some(port),
            None => jupyter_port_from_env(),
        },
        ready_fd,
        isolation_helper: None,
        access,
        floor,
    })
}

/// Logs to stderr, filtered by `filter`, or else by `RUST_LOG` (default `info`). Does nothing when
/// the process already has a subscriber: the embedded runtime's zygote sets one up once, and the
/// sandboxes' PID 1s it forks inherit it instead of building their own. (The embedded runtime
/// passes `info`: a sandbox's `RUST_LOG` is meant for its own programs.)
pub fn init_logging(filter: Option<&str>) {
    if tracing::dispatcher::has_been_set() {
        return;
    }
    let filter = match filter {
        Some(f) => tracing_subscriber::EnvFilter::new(f),
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter)
        .try_init();
}

/// The health port without `--jupyter-port` (the binary's and the embedded runtime's one rule):
/// `$JUPYTER_PORT`, else the default; 0 (or a value that is not a port) turns it off.
pub fn jupyter_port_from_env() -> Option<u16> {
    match warren_env::var_os(warren_env::EnvVars::JUPYTER_PORT) {
        Some(v) => v.to_str()?.trim().parse::<u16>().ok().filter(|p| *p != 0),
        None => Some(crate::interpreter::jupyter_port::DEFAULT_PORT),
    }
}

/// Runs the daemon on a current-thread runtime until the entrypoint exits; returns the exit code.
/// Must be called from the only thread of its process.
pub fn serve(config: Config) -> i32 {
    // The sandbox's processes get Docker's (and runc's) umask, whatever the process that started
    // execd had: a server, runtime or shell with a stricter one would otherwise make every file
    // a sandbox writes unreadable to its other users.
    // SAFETY: umask(2) only swaps the process's file-creation mask.
    unsafe { libc::umask(0o022) };
    // One thread: execd mostly waits on pipes and sockets, and every sandbox starts one. Worker
    // threads would cost each sandbox their creation, and each request hand-offs between them.
    // Blocking file work still runs on tokio's blocking pool.
    // Forked while this process has one thread: the runtime below may start more.
    let forker = match crate::forker::Forker::start() {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!("warren-execd: no files workers' forker: {e}");
            None
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren-execd: cannot start runtime: {e}");
            return 1;
        }
    };
    let code = match runtime.block_on(daemon::run(config, forker)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("warren-execd: {e:#}");
            1
        }
    };
    // Do not wait for lingering streams or blocking tasks: the sandbox's main process is gone.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    code
}
