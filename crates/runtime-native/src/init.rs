//! The setup helper: a fresh single-threaded process (`warren __sandbox-init`) that joins the sandbox's
//! cgroup, unshares namespaces, forks the sandbox's PID 1, builds its root filesystem, drops privileges
//! and runs execd there (in process: see `prepare_execd`). It never runs inside the multi-threaded
//! server, so `fork` here is sound.
//!
//! Protocol: spec JSON on stdin, one `InitReply` JSON line on stdout. The forked child reports setup
//! failures through a pipe: EOF without data means setup succeeded and execd is starting. execd
//! holds a copy of stdout (`--ready-fd`) until it listens, so EOF on stdout means "ready" (or "gone").

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};

use nix::sched::{unshare, CloneFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};

use crate::rootfs;
use crate::security;
use crate::spec::{InitReply, InitSpec, EXECD_SOCKET_NAME, JOINED_LINE};
use warren_execd::daemon::Listener;

/// execd's log level in sandboxes of the embedded runtime (set once in the zygote; see `zygote`).
pub(crate) const EXECD_LOG_LEVEL: &str = "info";

/// Entry point of `warren __sandbox-init`. Never returns.
pub fn main() -> ! {
    // `--join <file>` (see `Cgroup::join_files`), repeated.
    let args: Vec<String> = std::env::args().skip(2).collect();
    let join = args
        .chunks(2)
        .filter_map(|pair| match pair {
            [flag, procs] if flag == "--join" => Some(procs.clone()),
            _ => None,
        })
        .collect();
    helper(join)
}

/// The helper's work, in a fresh exec or in a child the zygote forked (see `zygote`). Never returns.
pub(crate) fn helper(join: Vec<String>) -> ! {
    let reply = match run(join) {
        Ok((pid, execd_port, isolation_helper)) => InitReply::Started {
            pid,
            execd_port,
            isolation_helper,
        },
        Err(error) => InitReply::Failed { error },
    };
    let mut out = std::io::stdout().lock();
    let line = serde_json::to_string(&reply)
        .unwrap_or_else(|_| "{\"Failed\":{\"error\":\"reply\"}}".into());
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
    std::process::exit(if matches!(reply, InitReply::Started { .. }) {
        0
    } else {
        1
    })
}

fn run(join: Vec<String>) -> Result<(i32, Option<u16>, Option<i32>), String> {
    // A standby helper joins its cgroup before it has a sandbox: the migration is the slow part of
    // setup on cgroup v1, and this way it is off the create path. (A helper the zygote created
    // inside its cgroup, on v2, has nothing to join.)
    for file in &join {
        fs::write(file, "0").map_err(|e| format!("joining cgroup {file}: {e}"))?;
    }
    // Tells the server the helper is in its cgroup, which may now be renamed to a sandbox's (see
    // `JOINED_LINE`).
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{JOINED_LINE}");
    let _ = out.flush();
    drop(out);
    let (input, fds) = crate::zygote::receive_spec().map_err(|e| format!("reading spec: {e}"))?;
    let spec: InitSpec =
        serde_json::from_slice(&input).map_err(|e| format!("parsing spec: {e}"))?;
    // What came with the spec: the server's user namespace for this sandbox's ids when it has
    // one, then the root overlay it made, if it did.
    let mut fds = fds.into_iter();
    let sent_userns = if spec.userns.is_some() {
        fds.next()
    } else {
        None
    };
    let premade_root = fds.next();
    if let Some(log) = &spec.log_path {
        // A standby helper was started before its sandbox had a log; from here on it writes there.
        let f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("opening {}: {e}", log.display()))?;
        nix::unistd::dup2(f.as_raw_fd(), 2).map_err(|e| format!("dup2: {e}"))?;
    }

    // execd's socket, bound here in the host's folder before anything is unshared: execd gets the
    // listening descriptor, so the sandbox needs no host folder it can write in (such a folder took
    // writes outside the sandbox's `ephemeral-storage`). A TCP listener, likewise, is bound in the
    // host's network namespace, on loopback: the sandbox's processes, in a network namespace of
    // their own, cannot reach it; a host process that can must hold execd's credential.
    let (listener, execd_port) = match &spec.execd_tcp_verifier {
        None => (
            Listener::Unix(
                warren_core::bind_socket_in(&spec.socket_dir, EXECD_SOCKET_NAME).map_err(|e| {
                    format!(
                        "binding execd's socket in {}: {e}",
                        spec.socket_dir.display()
                    )
                })?,
            ),
            None,
        ),
        Some(_) => {
            let tcp = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
                .map_err(|e| format!("binding execd's loopback port: {e}"))?;
            let port = tcp
                .local_addr()
                .map_err(|e| format!("execd's loopback port: {e}"))?
                .port();
            (Listener::Tcp(tcp), Some(port))
        }
    };

    // Compile seccomp before unsharing so a failure costs nothing.
    let filter = security::seccomp_filter().map_err(|e| warren_core::error_chain(&e))?;
    // The sandbox's user namespace: PID 1 idmaps the layers through it when it mounts the root
    // itself, and joins it last. The server's, or (the spec came through a pipe) one of our own.
    let sandbox_ns = match (sent_userns, spec.userns) {
        (Some(ns), _) => Some(ns),
        (None, Some(range)) => Some(
            crate::userns::make(range)
                .map_err(|e| format!("making the sandbox's user namespace: {e}"))?,
        ),
        (None, None) => None,
    };
    let namespaces = UserNamespaces {
        sandbox: sandbox_ns,
        // Each volume's idmapping: made here, while this process's pids are the host /proc's.
        volumes: match spec.userns {
            Some(range) => crate::userns::volume_namespaces(range, &spec.volumes)
                .map_err(|e| format!("idmapping the volumes: {e}"))?,
            None => Vec::new(),
        },
    };
    // The host's /proc, kept: once PID 1 has pivoted into the sandbox's root, this process's root
    // is that root too (it shares the mount namespace), and /proc there is the sandbox's.
    let host_proc: OwnedFd = fs::File::open("/proc")
        .map_err(|e| format!("/proc: {e}"))?
        .into();
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWPID
            | CloneFlags::CLONE_NEWCGROUP,
    )
    .map_err(|e| format!("unshare: {e}"))?;
    // Sessions: made by a helper this process forks once PID 1 has set the sandbox up (see
    // `isolation::start`); PID 1 gets execd's end of the helper's socket now.
    let mut isolation = match (&namespaces.sandbox, spec.isolation) {
        (Some(_), true) => Some(crate::isolation::Prepared::new(
            &host_proc,
            spec.hardening.as_ref(),
        )?),
        _ => None,
    };
    let isolation_end = isolation
        .as_mut()
        .and_then(crate::isolation::Prepared::take_execd_end);

    let (read_end, write_end) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: this helper process is single-threaded (a fresh exec of the warren binary that
    // dispatches here before starting any runtime or thread, or a child of the single-threaded
    // zygote), so the child may run arbitrary code.
    match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Child => {
            drop(read_end);
            drop((isolation, host_proc));
            let mut errors = fs::File::from(write_end);
            match prepare_execd(
                &spec,
                &filter,
                errors.as_raw_fd(),
                premade_root.as_ref(),
                listener,
                namespaces,
                isolation_end,
            ) {
                Ok(config) => {
                    // Set up: EOF on the error pipe tells the helper so (as a successful execve
                    // closing it used to). From here on failures show in the sandbox log.
                    drop(errors);
                    warren_execd::cli::init_logging(Some(EXECD_LOG_LEVEL));
                    let code = warren_execd::cli::serve(config);
                    // SAFETY: _exit ends PID 1 (and so the sandbox) without the zygote's atexit
                    // handlers or stdio buffers.
                    unsafe { libc::_exit(code) }
                }
                Err(err) => {
                    let _ = errors.write_all(err.as_bytes());
                    // SAFETY: _exit in the forked child, skipping atexit handlers and buffered stdio of the parent.
                    unsafe { libc::_exit(127) }
                }
            }
        }
        ForkResult::Parent { child } => {
            drop(write_end);
            drop(listener);
            drop(premade_root);
            drop(isolation_end);
            let mut msg = String::new();
            let _ = fs::File::from(read_end).read_to_string(&mut msg);
            if !msg.is_empty() {
                let _ = waitpid(child, None).map(|s| matches!(s, WaitStatus::Exited(..)));
                return Err(msg);
            }
            let helper = match (isolation, &namespaces.sandbox) {
                (Some(prepared), Some(ns)) => {
                    Some(start_isolation_helper(prepared, ns, &host_proc, child)?)
                }
                _ => None,
            };
            Ok((child.as_raw(), execd_port, helper))
        }
    }
}

/// Forks the isolation helper into the host's PID namespace, whose children go into the
/// sandbox's (see `isolation::start`). A helper that cannot start fails the create: the sandbox
/// was asked with sessions.
fn start_isolation_helper(
    prepared: crate::isolation::Prepared,
    userns: &OwnedFd,
    host_proc: &OwnedFd,
    pid1: nix::unistd::Pid,
) -> Result<i32, String> {
    let path = std::ffi::CString::new(format!("{pid1}/ns/pid")).map_err(|e| e.to_string())?;
    let sandbox_pid_ns = crate::isolation::open_at(host_proc, &path)?;
    // Our own children went into the sandbox's PID namespace since the unshare; the helper's
    // place is ours.
    let own_pid_ns = crate::isolation::open_at(host_proc, c"self/ns/pid")?;
    nix::sched::setns(&own_pid_ns, CloneFlags::CLONE_NEWPID)
        .map_err(|e| format!("setns back to our PID namespace: {e}"))?;
    crate::isolation::start(prepared, userns, &sandbox_pid_ns)
        .map_err(|e| format!("starting the isolation helper: {e}"))
}

/// The user namespaces of a sandbox in a range: its own, which PID 1 joins last, and one per
/// volume, which that volume is idmapped through (`userns::volume_namespaces`).
struct UserNamespaces {
    sandbox: Option<OwnedFd>,
    volumes: Vec<OwnedFd>,
}

/// In the sandbox's PID 1: everything up to running execd — namespaces' contents, root file
/// system, then the privilege boundary. Returns execd's configuration, or the error text.
fn prepare_execd(
    spec: &InitSpec,
    filter: &crate::seccomp::Program,
    error_pipe: std::os::fd::RawFd,
    premade_root: Option<&OwnedFd>,
    listener: Listener,
    namespaces: UserNamespaces,
    isolation_helper: Option<OwnedFd>,
) -> Result<warren_execd::daemon::Config, String> {
    let UserNamespaces {
        sandbox: userns,
        volumes: volume_ns,
    } = namespaces;
    // A session of its own, as container runtimes give a container's init: without it the sandbox
    // sat in the server's process group, and a Ctrl-C or hangup of the terminal that runs
    // `warren serve` (a signal to that whole group) reached execd, which stops on SIGINT, and so
    // ended every sandbox the server meant to keep running for its next start.
    nix::unistd::setsid().map_err(|e| format!("setsid: {e}"))?;
    nix::unistd::sethostname(&spec.hostname).map_err(|e| format!("sethostname: {e}"))?;
    rootfs::loopback_up().map_err(|e| format!("bringing up lo: {e}"))?;
    if userns.is_some() {
        // Root in a user namespace has no privilege over the network namespace (the initial
        // one owns it): ports below 1024 and ping sockets are opened to every id of this
        // sandbox's own network instead, so a web server on port 80 and `ping` work as before.
        // (Both settings belong to the network namespace; /proc/sys/net is the caller's.)
        for (file, value) in [
            ("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0"),
            ("/proc/sys/net/ipv4/ping_group_range", "0 2147483647"),
        ] {
            fs::write(file, value).map_err(|e| format!("{file}: {e}"))?;
        }
    }
    rootfs::build(spec, premade_root, userns.as_ref(), &volume_ns)
        .map_err(|e| warren_core::error_chain(&e))?;
    // Mounted: closed now, before the sweep of every descriptor but execd's below (an owned
    // descriptor that sweep closed would abort when dropped).
    drop(volume_ns);
    std::env::set_current_dir(&spec.workdir)
        .or_else(|_| std::env::set_current_dir("/"))
        .map_err(|e| format!("chdir: {e}"))?;

    // execd keeps a copy of the reply pipe (stdout) open until it listens, so the server's read
    // of the reply ends just when the sandbox is ready, instead of it polling execd's socket.
    // SAFETY: F_DUPFD duplicates an open descriptor to the lowest free number ≥ 3, without
    // close-on-exec; it touches no memory.
    let ready_fd = unsafe { libc::fcntl(1, libc::F_DUPFD, 3) };
    if ready_fd < 0 {
        return Err(format!("dup: {}", std::io::Error::last_os_error()));
    }
    // The command line the binary would have had, for /proc/1/cmdline.
    let ready = ready_fd.to_string();
    let listener_fd = listener.as_raw_fd();
    let mut argv: Vec<String> = [
        "warren-execd",
        "--listen-fd",
        &listener_fd.to_string(),
        "--workdir",
        &spec.workdir,
        "--ready-fd",
        &ready,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let access = match &spec.execd_tcp_verifier {
        Some(verifier) => {
            argv.extend(["--access-token-sha256".to_string(), verifier.clone()]);
            Some(warren_execd::access::Verifier::from_hex(verifier)?)
        }
        None => None,
    };
    argv.push("--".into());
    argv.extend(spec.entrypoint.iter().cloned());
    if argv.iter().chain(&spec.env).any(|a| a.contains('\0')) {
        return Err("the entrypoint or env contains a NUL byte".into());
    }

    // stdin from /dev/null; stdout/stderr stay on the sandbox log the server opened for us.
    let null = fs::File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
    let null: OwnedFd = null.into();
    nix::unistd::dup2(null.as_raw_fd(), 0).map_err(|e| format!("dup2: {e}"))?;
    // Our stdout is the reply pipe to the server; only execd's ready descriptor keeps it (and
    // closes it once listening), the sandbox's processes must not.
    nix::unistd::dup2(2, 1).map_err(|e| format!("dup2: {e}"))?;
    drop(null);

    // execd runs right here, in this process, instead of from an `execve` of its binary: the exec
    // of a 10 MB static binary (mapping, relocation, libc start-up) cost ~0.6 ms of CPU per
    // sandbox on this project's machine. What an exec would have given, done by hand:
    // - a clean environment: the sandbox's own (this process was forked from the zygote, which
    //   the server starts with an empty one, so no server secret was ever in this memory);
    // - no descriptors but stdio, the ready descriptor, execd's listening socket and (until execd
    //   runs) the error pipe;
    // - not dumpable, so the sandbox's processes cannot read this memory, its environment or
    //   follow /proc/1/exe (the host's `warren` binary) — the sandbox keeps no CAP_SYS_PTRACE;
    // - the name `execd` (comm), with `warren-execd` and as much of its command line as fits in
    //   /proc/1/cmdline.
    let in_userns = userns.is_some();
    if let Some(ns) = userns {
        // execd's own /proc/self/oom_score_adj, opened while it is still this process's to open
        // (see `warren_execd::oom::descriptor`).
        warren_execd::oom::remember();
        // Last, with every mount made: from here on this process is root of its own range.
        crate::userns::join(&ns).map_err(|e| format!("joining the user namespace: {e}"))?;
    }
    let keep: Vec<i32> = [ready_fd, error_pipe, listener_fd]
        .into_iter()
        .chain(warren_execd::oom::descriptor())
        .chain(isolation_helper.as_ref().map(|fd| fd.as_raw_fd()))
        .collect();
    security::close_descriptors_except(&keep)
        .map_err(|e| format!("closing inherited descriptors: {e}"))?;
    security::present_as(&argv).map_err(|e| warren_core::error_chain(&e))?;
    if in_userns {
        // Without `no_new_privs` a filter needs CAP_SYS_ADMIN (in the namespace) to be
        // installed: before the capabilities go.
        security::install_seccomp(filter).map_err(|e| warren_core::error_chain(&e))?;
        security::restrict_privileges(false).map_err(|e| warren_core::error_chain(&e))?;
    } else {
        security::restrict_privileges(true).map_err(|e| warren_core::error_chain(&e))?;
        security::install_seccomp(filter).map_err(|e| warren_core::error_chain(&e))?;
    }
    for key in warren_env::names_os() {
        std::env::remove_var(key);
    }
    for kv in &spec.env {
        if let Some((k, v)) = kv.split_once('=') {
            if !k.is_empty() {
                std::env::set_var(k, v);
            }
        }
    }
    // What `warren-execd --socket … --workdir … --ready-fd N -- ENTRYPOINT` would parse, built
    // without its argument parser (clap's set-up was ~0.5 % of the machine's CPU per sandbox).
    Ok(warren_execd::daemon::Config {
        sockets: Vec::new(),
        listeners: vec![listener],
        listen: None,
        access,
        workdir: spec.workdir.clone().into(),
        entrypoint: spec.entrypoint.clone(),
        jupyter_port: warren_execd::cli::jupyter_port_from_env(),
        ready_fd: warren_execd::daemon::adopt_ready_fd(ready_fd),
        isolation_helper,
        floor: spec.hardening.clone(),
    })
}
