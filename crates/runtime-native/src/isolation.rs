//! The isolation helper: what makes execd's isolated sessions (`/v1/isolated/…`) in a sandbox
//! created with `extensions["bootstrap.execd.isolation"] = "enable"`.
//!
//! A session is a set of namespaces of its own (mount, PID, UTS, IPC, cgroup, and network unless
//! shared) with the sandbox's tree read-only and the session's workspace writable, read-only or an
//! overlay. Making one takes `unshare` and `mount`, which the sandbox's seccomp filter refuses to
//! everything in it, execd included. So the sandbox's PID 1 forks this helper before it puts that
//! filter on execd: the helper keeps the capabilities of the sandbox's root (in the sandbox's own
//! user namespace, never the host's — there is no helper without one) and a filter that allows
//! only the namespace and mount calls beyond the sandbox's. It listens on nothing but a socket
//! pair whose other end is execd's. Whatever it starts in a session — the session's shell, a
//! background run, a files worker — takes the sandbox's own filter and capability set first, so
//! code in a session can do no more than code in the sandbox, and sees less.
//!
//! Process tree of one session (all in the sandbox's PID namespace but the last two levels):
//! helper → keeper (the session's namespaces but PID; waits for the session's PID 1) → session
//! init (PID 1 of the session, reaps) ; helper → runner (joins the session) → the process asked for.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};
use warren_execd::isolation::channel::{self, Mount, Reply, Request};

use crate::rootfs::{self, mount_api};
use crate::security;

/// How many sessions one sandbox holds at once (execd answers 429 past its own, lower, bound).
const MAX_SESSIONS: usize = 64;

/// What the setup helper readies for an isolation helper before it forks the sandbox's PID 1:
/// the socket pair (execd's end goes to PID 1), the filters, compiled while errors can still be
/// reported, and the sandbox's mount namespace.
pub(crate) struct Prepared {
    execd_end: Option<OwnedFd>,
    helper_end: OwnedFd,
    helper_filter: crate::seccomp::Program,
    session_filter: crate::seccomp::Program,
    /// The hardening floor, laid under what sessions run as it is under execd's children.
    floor: Option<Floor>,
    mount_ns: OwnedFd,
}

type Floor = std::sync::Arc<warren_execd::hardening::Floor>;

impl Prepared {
    /// In the setup helper, after it unshared the sandbox's namespaces; `host_proc` is the
    /// host's /proc, opened before.
    pub(crate) fn new(
        host_proc: &OwnedFd,
        floor: Option<&warren_api::hardening::FloorPolicy>,
    ) -> Result<Self, String> {
        let (execd_end, helper_end) = channel::pair().map_err(|e| format!("socket pair: {e}"))?;
        // A session's processes hold the sandbox's capabilities when they are lowered.
        let held = security::KEPT_CAPABILITIES
            .iter()
            .fold(0u64, |m, c| m | 1u64 << c.index());
        let floor = floor
            .map(|p| warren_execd::hardening::Floor::with_held(p, held, held))
            .transpose()
            .map_err(|e| format!("hardening: {e}"))?
            .map(std::sync::Arc::new);
        Ok(Self {
            execd_end: Some(execd_end),
            helper_end,
            helper_filter: security::isolation_helper_filter()
                .map_err(|e| warren_core::error_chain(&e))?,
            session_filter: security::seccomp_filter().map_err(|e| warren_core::error_chain(&e))?,
            floor,
            mount_ns: open_at(host_proc, c"self/ns/mnt")?,
        })
    }

    /// execd's end of the pair, for the sandbox's PID 1.
    pub(crate) fn take_execd_end(&mut self) -> Option<OwnedFd> {
        self.execd_end.take()
    }
}

/// `openat(dir, path)`, read-only, close-on-exec.
pub(crate) fn open_at(dir: &OwnedFd, path: &std::ffi::CStr) -> Result<OwnedFd, String> {
    // SAFETY: openat(2) under a descriptor we own, with a NUL-terminated path.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            path.as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(format!(
            "opening /proc/{}: {}",
            path.to_string_lossy(),
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a fresh descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Forks the helper from the setup helper, once the sandbox's PID 1 has set the sandbox up, and
/// returns its pid (as the host numbers it). The helper lives in the host's PID namespace, where
/// the sandbox's code cannot name it, so cannot signal it: a helper forked from PID 1, as this one
/// once was, was a process of the sandbox's own user, and its code could stop or kill it and hang
/// every session. What it starts goes into the sandbox's PID namespace (`sandbox_pid_ns`), as
/// before. It joins the sandbox's mount namespace (its root and working folder become the
/// sandbox's root) and, last, its user namespace, with the capabilities of the sandbox's root
/// there and never the host's. It holds nothing but its socket, and the sandbox's /dev/null as
/// stdio.
pub(crate) fn start(
    prepared: Prepared,
    userns: &OwnedFd,
    sandbox_pid_ns: &OwnedFd,
) -> Result<i32, String> {
    let Prepared {
        execd_end,
        helper_end,
        helper_filter,
        session_filter,
        floor,
        mount_ns,
    } = prepared;
    drop(execd_end);
    // SAFETY: the caller is single-threaded (the setup helper).
    match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Parent { child } => Ok(child.as_raw()),
        ForkResult::Child => {
            // SAFETY: prctl(2) with integer and string arguments. Not dumpable from the start: it
            // runs the host's binary, and its memory is the setup helper's.
            unsafe {
                libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
                libc::prctl(libc::PR_SET_NAME, c"warren-isolate".as_ptr(), 0, 0, 0);
            }
            let fail = |what: &str, e: &dyn std::fmt::Display| -> ! {
                let _ = (what, e);
                // SAFETY: _exit in a forked child (nothing to report to: execd learns of it when
                // its socket closes, and the setup helper sees the exit).
                unsafe { libc::_exit(1) }
            };
            if let Err(e) = setns(mount_ns.as_fd(), CloneFlags::CLONE_NEWNS) {
                fail("joining the sandbox's mounts", &e);
            }
            if let Err(e) = setns(sandbox_pid_ns.as_fd(), CloneFlags::CLONE_NEWPID) {
                fail("joining the sandbox's processes", &e);
            }
            stdio_to_null();
            if security::close_descriptors_except(&[helper_end.as_raw_fd(), userns.as_raw_fd()])
                .is_err()
            {
                fail("closing descriptors", &"");
            }
            // (the namespace's descriptor stays; what the helper starts closes it with the rest)
            if let Err(e) = crate::userns::join(userns) {
                fail("joining the user namespace", &e);
            }
            if let Err(e) = security::install_seccomp(&helper_filter) {
                fail("seccomp", &warren_core::error_chain(&e));
            }
            let mut helper = Helper {
                sock: helper_end,
                session_filter,
                floor,
                sessions: HashMap::new(),
                next: 1,
            };
            helper.serve();
            helper.shut_down();
            // SAFETY: _exit in a forked child, skipping the parent's atexit handlers.
            unsafe { libc::_exit(0) }
        }
    }
}

/// stdin, stdout and stderr on the sandbox's /dev/null (or closed without one): the setup
/// helper's are the server's reply pipe and the sandbox's log on the host.
fn stdio_to_null() {
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null");
    for fd in 0..3 {
        match &null {
            // SAFETY: dup2 of a descriptor we own onto a standard one.
            Ok(n) => unsafe {
                libc::dup2(n.as_raw_fd(), fd);
            },
            // SAFETY: closing a standard descriptor nothing here uses.
            Err(_) => unsafe {
                libc::close(fd);
            },
        }
    }
}

struct Session {
    /// The keeper process: in the session's namespaces but PID.
    keeper: Pid,
    /// The session's namespaces, which a runner joins, in the order it joins them (mount last).
    /// Sent by the session's PID 1, which may open its own: /proc/<pid>/ns of the session's
    /// non-dumpable processes, or a pidfd's setns, would need ptrace rights over them. The
    /// network namespace only when the session has its own: the sandbox's belongs to the host's
    /// user namespace, which a runner may not join (and is in already).
    namespaces: Vec<(CloneFlags, OwnedFd)>,
}

/// The namespaces a session's PID 1 sends, in the order a runner joins them.
const NAMESPACES: [(&str, CloneFlags); 6] = [
    ("ipc", CloneFlags::CLONE_NEWIPC),
    ("uts", CloneFlags::CLONE_NEWUTS),
    ("cgroup", CloneFlags::CLONE_NEWCGROUP),
    ("net", CloneFlags::CLONE_NEWNET),
    ("pid", CloneFlags::CLONE_NEWPID),
    ("mnt", CloneFlags::CLONE_NEWNS),
];

struct Helper {
    sock: OwnedFd,
    session_filter: crate::seccomp::Program,
    floor: Option<Floor>,
    sessions: HashMap<u64, Session>,
    next: u64,
}

impl Helper {
    fn serve(&mut self) {
        loop {
            self.reap();
            // Runners end on their own (their process ended): collected within a second.
            let mut poll = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll(2) on one pollfd we own.
            if unsafe { libc::poll(&mut poll, 1, 1000) } <= 0 {
                continue;
            }
            let (request, fds) = match channel::recv::<Request>(&self.sock) {
                Ok(Some(got)) => got,
                Ok(None) => return,
                Err(e) => {
                    eprintln!("warren isolation helper: {e}");
                    return;
                }
            };
            let reply = match request {
                Request::Create {
                    mounts,
                    private_tmp,
                    share_net,
                } => match self.create(&mounts, private_tmp, share_net) {
                    Ok(id) => Reply::Created { session: id },
                    Err(error) => Reply::Failed { error },
                },
                Request::Exec {
                    session,
                    argv,
                    env,
                    cwd,
                    uid,
                    gid,
                } => match self.exec(session, Program::Exec { argv, env }, &cwd, (uid, gid), fds) {
                    Ok(()) => Reply::Done,
                    Err(error) => Reply::Failed { error },
                },
                Request::FilesWorker {
                    session,
                    uid,
                    gid,
                    workdir,
                } => {
                    let program = Program::FilesWorker { uid, gid, workdir };
                    // The worker takes its identity itself, with root's rights.
                    match self.exec(session, program, "/", (0, 0), fds) {
                        Ok(()) => Reply::Done,
                        Err(error) => Reply::Failed { error },
                    }
                }
                Request::Destroy { session } => {
                    if let Some(s) = self.sessions.remove(&session) {
                        let _ = nix::sys::signal::kill(s.keeper, nix::sys::signal::SIGKILL);
                        let _ = waitpid(s.keeper, None);
                    }
                    Reply::Done
                }
            };
            if channel::send(&self.sock, &reply, &[]).is_err() {
                return;
            }
        }
    }

    /// execd has gone (the sandbox is ending): ends every session and reaps every process this
    /// helper started before it leaves. Were they left, they would be reparented to the server
    /// (the subreaper above this helper) and, in the sandbox's PID namespace, hold up its PID 1's
    /// exit until something reaped them. Bounded: the sandbox's end kills them all anyway.
    fn shut_down(&mut self) {
        for s in self.sessions.values() {
            let _ = nix::sys::signal::kill(s.keeper, nix::sys::signal::SIGKILL);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    /// Collects ended keepers and runners, and forgets sessions whose keeper ended.
    fn reap(&mut self) {
        while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            match status.pid() {
                Some(pid) => self.sessions.retain(|_, s| s.keeper != pid),
                None => break,
            }
        }
    }

    fn create(
        &mut self,
        mounts: &[Mount],
        private_tmp: bool,
        share_net: bool,
    ) -> Result<u64, String> {
        if self.sessions.len() >= MAX_SESSIONS {
            return Err(format!("at most {MAX_SESSIONS} sessions at once"));
        }
        let (report_r, report_w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
        let (ns_ours, ns_theirs) = channel::pair().map_err(|e| format!("socket pair: {e}"))?;
        // SAFETY: the helper is single-threaded.
        let keeper = match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
            ForkResult::Child => {
                drop(report_r);
                drop(ns_ours);
                keep_session(
                    mounts,
                    (private_tmp, share_net),
                    report_w,
                    ns_theirs,
                    &self.session_filter,
                )
            }
            ForkResult::Parent { child } => child,
        };
        drop(report_w);
        drop(ns_theirs);
        // The keeper writes `init <pid>` (the session's PID 1, as we number it) and that process
        // `ready` once all is made, or either an error; EOF without both means it died.
        // Bounded: the keeper is a process of the sandbox's PID namespace, which the sandbox's
        // code may stop; the helper answers execd one request at a time and must not hang on it.
        let report = read_to_end_within(report_r, REPORT_WITHIN_MS);
        let fail = |why: String| {
            let _ = nix::sys::signal::kill(keeper, nix::sys::signal::SIGKILL);
            let _ = waitpid(keeper, None);
            Err(why)
        };
        let mut init = None;
        let mut ready = false;
        for line in report.lines() {
            if let Some(pid) = line.strip_prefix("init ") {
                init = pid.trim().parse::<i32>().ok().map(Pid::from_raw);
            } else if line == "ready" {
                ready = true;
            }
        }
        let (Some(_), true) = (init, ready) else {
            let why = report
                .lines()
                .find(|l| !l.starts_with("init ") && *l != "ready")
                .unwrap_or("the session ended while it was made");
            return fail(why.to_string());
        };
        let namespaces = match channel::recv::<Vec<String>>(&ns_ours) {
            Ok(Some((names, fds))) if names.len() == fds.len() => names
                .iter()
                .zip(fds)
                .filter_map(|(name, fd)| {
                    NAMESPACES
                        .iter()
                        .find(|(n, _)| n == name)
                        .map(|(_, flag)| (*flag, fd))
                })
                .collect::<Vec<_>>(),
            _ => return fail("the session did not send its namespaces".into()),
        };
        let id = self.next;
        self.next += 1;
        self.sessions.insert(id, Session { keeper, namespaces });
        Ok(id)
    }

    fn exec(
        &mut self,
        session: u64,
        program: Program,
        cwd: &str,
        (uid, gid): (u32, u32),
        fds: Vec<OwnedFd>,
    ) -> Result<(), String> {
        let s = self
            .sessions
            .get(&session)
            .ok_or_else(|| "no such session".to_string())?;
        let [stdin, stdout, stderr, status]: [OwnedFd; 4] = fds
            .try_into()
            .map_err(|_| "an exec takes four descriptors".to_string())?;
        let cstrings = |v: &[String]| {
            v.iter()
                .map(|a| CString::new(a.as_bytes()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| "an argument or variable holds a NUL byte".to_string())
        };
        let what = match program {
            Program::Exec { argv, mut env } => {
                if self.floor.is_some() {
                    // execd's settings stay out of a session under the floor, as out of commands
                    env.retain(|kv| {
                        let name = kv.split_once('=').map_or(kv.as_str(), |(k, _)| k);
                        !warren_execd::hardening::Floor::strips(
                            warren_execd::hardening::Role::UserCode,
                            name,
                        )
                    });
                }
                let (argv, env) = (cstrings(&argv)?, cstrings(&env)?);
                if argv.is_empty() {
                    return Err("nothing to run".into());
                }
                What::Exec { argv, env }
            }
            Program::FilesWorker { uid, gid, workdir } => What::FilesWorker {
                uid,
                gid,
                workdir: workdir.into(),
            },
        };
        let cwd = CString::new(cwd).map_err(|_| "cwd holds a NUL byte".to_string())?;
        // SAFETY: the helper is single-threaded.
        match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
            ForkResult::Parent { .. } => Ok(()),
            ForkResult::Child => {
                let code = run_in_session(
                    s,
                    what,
                    &cwd,
                    (uid, gid),
                    [stdin, stdout, stderr],
                    status,
                    &self.session_filter,
                    self.floor.as_deref(),
                );
                // SAFETY: _exit in a forked child.
                unsafe { libc::_exit(code) }
            }
        }
    }
}

/// How long the keeper gets to make a session and report.
const REPORT_WITHIN_MS: i32 = 10_000;

/// What `pipe` carries until its writers close it, or until `within_ms` have passed.
fn read_to_end_within(pipe: OwnedFd, within_ms: i32) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(within_ms as u64);
    let mut file = std::fs::File::from(pipe);
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut poll = libc::pollfd {
            fd: file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd we own.
        let ready = unsafe { libc::poll(&mut poll, 1, left.as_millis() as i32) };
        if ready < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if ready <= 0 {
            break;
        }
        match file.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One line on a pipe another process writes lines on too: in a single write, so the lines do
/// not interleave (pipe writes up to PIPE_BUF are atomic).
fn say(pipe: &mut std::fs::File, line: &str) {
    let mut line = line.replace('\n', " ");
    let mut end = line.len().min(libc::PIPE_BUF - 1);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    line.truncate(end);
    let mut bytes = line.into_bytes();
    bytes.push(b'\n');
    let _ = pipe.write_all(&bytes);
}

/// The keeper: makes the session's namespaces and mounts, forks the session's PID 1, and lives as
/// long as it does. Never returns.
fn keep_session(
    mounts: &[Mount],
    (private_tmp, share_net): (bool, bool),
    report: OwnedFd,
    ns_sock: OwnedFd,
    filter: &crate::seccomp::Program,
) -> ! {
    // SAFETY: prctl(2) with a string argument: named for what it is in the sandbox's `ps`.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"session-keeper".as_ptr(), 0, 0, 0) };
    // Nothing of the helper's stays open here (execd's socket, other sessions' namespaces, which
    // would live on as long as this session does).
    let _ = security::close_descriptors_except(&[report.as_raw_fd(), ns_sock.as_raw_fd()]);
    let mut report = std::fs::File::from(report);
    let fail = |report: &mut std::fs::File, why: String| -> ! {
        say(report, &why);
        // SAFETY: _exit in a forked child.
        unsafe { libc::_exit(1) }
    };
    if let Err(why) = make_session(mounts, private_tmp, share_net) {
        fail(&mut report, why)
    }
    // SAFETY: the keeper is single-threaded (forked from the helper).
    match unsafe { fork() } {
        Err(e) => fail(&mut report, format!("fork: {e}")),
        Ok(ForkResult::Child) => session_init(report, ns_sock, share_net, filter),
        Ok(ForkResult::Parent { child }) => {
            say(&mut report, &format!("init {child}"));
            drop(report);
            drop(ns_sock);
            // The keeper needs no privilege from here on.
            let _ = security::install_seccomp(filter);
            let _ = security::restrict_privileges(false);
            let code = loop {
                match waitpid(child, None) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    Ok(WaitStatus::Exited(_, code)) => break code,
                    _ => break 1,
                }
            };
            // SAFETY: _exit in a forked child.
            unsafe { libc::_exit(code) }
        }
    }
}

/// What execd checked already, checked again where the rights are: every path of a mount is
/// absolute and plain, outside the kernel's trees, and (sources) names no symlink — a path
/// through `/proc/<pid>/root` into another session would otherwise be followed with the helper's
/// rights.
fn check_mounts(mounts: &[Mount]) -> Result<(), String> {
    for m in mounts {
        let (source, target) = match m {
            Mount::Writable { path } | Mount::ReadOnly { path } | Mount::Overlay { path } => {
                (path, path)
            }
            Mount::Bind { source, dest, .. } => (source, dest),
        };
        if let Some(why) =
            channel::mount_path_problem(source).or_else(|| channel::mount_path_problem(target))
        {
            return Err(format!("refused mount {source} on {target}: {why}"));
        }
        if std::fs::canonicalize(source).map_or(true, |real| real != Path::new(source)) {
            return Err(format!("refused mount of {source}: not a canonical path"));
        }
    }
    Ok(())
}

/// The session's namespaces and mounts, made in the keeper.
fn make_session(mounts: &[Mount], private_tmp: bool, share_net: bool) -> Result<(), String> {
    check_mounts(mounts)?;
    let mut flags = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWCGROUP;
    if !share_net {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    unshare(flags).map_err(|e| format!("unshare: {e}"))?;
    if !share_net {
        rootfs::loopback_up().map_err(|e| format!("bringing up lo: {e}"))?;
    }
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
        .map_err(|e| format!("making / private: {e}"))?;
    // The sandbox's whole tree read-only, then writable again where the session writes.
    mount_api::set_recursive(libc::AT_FDCWD, c"/", mount_api::MOUNT_ATTR_RDONLY)
        .map_err(|e| format!("making / read-only: {e}"))?;
    writable(Path::new("/dev"))?;
    // /proc as the sandbox has it: writable at the top (a process's own files), its read-only
    // parts (/proc/sys and the like) still read-only.
    mount_api::clear(
        libc::AT_FDCWD,
        c"/proc",
        mount_api::MOUNT_ATTR_RDONLY,
        false,
    )
    .map_err(|e| format!("making /proc writable: {e}"))?;
    let tmpfs = |target: &str, options: &str| {
        if !Path::new(target).is_dir() {
            return Ok(());
        }
        mount(
            Some("tmpfs"),
            target,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(options),
        )
        .map_err(|e| format!("a tmpfs on {target}: {e}"))
    };
    tmpfs("/dev/shm", "mode=1777")?;
    tmpfs("/run", "mode=755")?;
    if private_tmp {
        tmpfs("/tmp", "mode=1777")?;
    } else {
        bind_writable(Path::new("/tmp"), Path::new("/tmp"))?;
    }
    // The overlays' upper layers: a tmpfs of this session's, reachable only through this
    // descriptor (never attached to the tree), so no other session or sandbox process sees it.
    let scratch = if mounts.iter().any(|m| matches!(m, Mount::Overlay { .. })) {
        Some(
            mount_api::tmpfs_detached(&[("mode", "700")])
                .map_err(|e| format!("the session's upper layer: {e}"))?,
        )
    } else {
        None
    };
    for (i, m) in mounts.iter().enumerate() {
        match m {
            Mount::Writable { path } => bind_writable(Path::new(path), Path::new(path))?,
            Mount::ReadOnly { path } => {
                rootfs::bind(Path::new(path), Path::new(path), true, MsFlags::empty())
                    .map_err(|e| warren_core::error_chain(&e))?
            }
            Mount::Bind {
                source,
                dest,
                readonly: true,
            } => rootfs::bind(Path::new(source), Path::new(dest), true, MsFlags::empty())
                .map_err(|e| warren_core::error_chain(&e))?,
            Mount::Bind { source, dest, .. } => bind_writable(Path::new(source), Path::new(dest))?,
            Mount::Overlay { path } => {
                let scratch = scratch.as_ref().ok_or("no upper layer")?;
                overlay(path, scratch, i)?;
            }
        }
    }
    Ok(())
}

/// `source` bound at `target`, writable (the tree above it was made read-only).
fn bind_writable(source: &Path, target: &Path) -> Result<(), String> {
    rootfs::bind(source, target, false, MsFlags::empty())
        .map_err(|e| warren_core::error_chain(&e))?;
    writable(target)
}

fn writable(target: &Path) -> Result<(), String> {
    let c = CString::new(target.as_os_str().as_encoded_bytes())
        .map_err(|_| "a path holds a NUL byte".to_string())?;
    mount_api::clear(libc::AT_FDCWD, &c, mount_api::MOUNT_ATTR_RDONLY, true)
        .map_err(|e| format!("making {} writable: {e}", target.display()))
}

/// An overlay at `path`: the sandbox's folder below, upper and work folders `i` of `scratch`.
fn overlay(path: &str, scratch: &OwnedFd, i: usize) -> Result<(), String> {
    for sub in [format!("{i}"), format!("{i}/u"), format!("{i}/w")] {
        let c = CString::new(sub).map_err(|_| "NUL".to_string())?;
        // SAFETY: mkdirat(2) under a descriptor we own, with a NUL-terminated name.
        if unsafe { libc::mkdirat(scratch.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
            return Err(format!(
                "the upper layer of {path}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    let base = format!("/proc/self/fd/{}/{i}", scratch.as_raw_fd());
    let options = format!("lowerdir={path},upperdir={base}/u,workdir={base}/w");
    let try_mount = |extra: &str| {
        mount(
            Some("overlay"),
            path,
            Some("overlay"),
            MsFlags::empty(),
            Some(format!("{options}{extra}").as_str()),
        )
    };
    // In a user namespace other than the host's, overlayfs keeps its own attributes as user
    // xattrs (`userxattr`); kernels that do not need it refuse nothing without it.
    try_mount("")
        .or_else(|_| try_mount(",userxattr"))
        .map_err(|e| format!("an overlay on {path}: {e}"))
}

/// The session's PID 1: sends the session's namespaces, then reaps until killed.
fn session_init(
    mut report: std::fs::File,
    ns_sock: OwnedFd,
    share_net: bool,
    filter: &crate::seccomp::Program,
) -> ! {
    // SAFETY: prctl(2) with integer arguments. The session ends with its keeper.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        libc::prctl(libc::PR_SET_NAME, c"session-init".as_ptr(), 0, 0, 0);
    }
    // /proc stays the sandbox's (masked, and locked so by the kernel): a procfs of the session's
    // own PID namespace is refused here, since the sandbox's masks are mounts the sandbox's user
    // namespace does not own (the kernel's mount_too_revealing). Session processes see the
    // sandbox's processes listed there, but cannot signal them (they have no pid in the
    // session's namespace) nor inspect them (each runs in a user namespace of its own: see
    // `run_in_session`).
    // Our namespaces, for the helper's runners.
    let mut names = Vec::new();
    let mut fds = Vec::new();
    for (name, _) in NAMESPACES {
        if name == "net" && share_net {
            continue;
        }
        match std::fs::File::open(format!("/proc/self/ns/{name}")) {
            Ok(f) => {
                names.push(name.to_string());
                fds.push(OwnedFd::from(f));
            }
            Err(e) => {
                say(
                    &mut report,
                    &format!("opening the session's {name} namespace: {e}"),
                );
                // SAFETY: _exit in a forked child.
                unsafe { libc::_exit(1) }
            }
        }
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    if let Err(e) = channel::send(&ns_sock, &names, &raw) {
        say(
            &mut report,
            &format!("sending the session's namespaces: {e}"),
        );
        // SAFETY: _exit in a forked child.
        unsafe { libc::_exit(1) }
    }
    drop((fds, ns_sock));
    say(&mut report, "ready");
    drop(report);
    let _ = security::install_seccomp(filter);
    let _ = security::restrict_privileges(false);
    // PID 1 of a namespace gets only the signals it handles from inside it: none.
    loop {
        match nix::sys::wait::wait() {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => {
                // No children: wait for one (a SIGCHLD interrupts the sleep).
                // SAFETY: pause(2) takes no arguments.
                unsafe { libc::pause() };
            }
        }
    }
}

/// The runner: joins session `s`, starts the process, reports its pid and how it ended on
/// `status`. Returns the runner's exit code.
#[allow(clippy::too_many_arguments)]
fn run_in_session(
    s: &Session,
    what: What,
    cwd: &CString,
    (uid, gid): (u32, u32),
    stdio: [OwnedFd; 3],
    status: OwnedFd,
    filter: &crate::seccomp::Program,
    floor: Option<&warren_execd::hardening::Floor>,
) -> i32 {
    let mut status = std::fs::File::from(status);
    // SAFETY: prctl(2) with integer and string arguments.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        libc::prctl(libc::PR_SET_NAME, c"session-runner".as_ptr(), 0, 0, 0);
    }
    let joined = s
        .namespaces
        .iter()
        .try_for_each(|(flag, fd)| setns(fd.as_fd(), *flag));
    if let Err(e) = joined {
        say(&mut status, &format!("error joining the session: {e}"));
        return 1;
    }
    // Nothing of the helper's stays open (execd's socket, the sessions' namespaces).
    let keep: Vec<RawFd> = stdio
        .iter()
        .map(|f| f.as_raw_fd())
        .chain([status.as_raw_fd()])
        .collect();
    let _ = security::close_descriptors_except(&keep);
    // The child goes into a user namespace of its own, under the sandbox's and mapping the same
    // ids: its root is the sandbox's root to files, but to the kernel's ptrace checks it is in
    // another namespace without CAP_SYS_PTRACE there, so the sandbox's processes — listed in the
    // sandbox's /proc when the session cannot have its own — are beyond its reach (their
    // /proc/<pid>/root, fd, mem, environ), as are the session's own keeper and PID 1.
    let (Ok((unshared_r, unshared_w)), Ok((mapped_r, mapped_w))) = (
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC),
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC),
    ) else {
        say(&mut status, "error pipe");
        return 1;
    };
    // SAFETY: the runner is single-threaded (forked from the helper).
    match unsafe { fork() } {
        Err(e) => {
            say(&mut status, &format!("error fork: {e}"));
            1
        }
        Ok(ForkResult::Child) => {
            drop((unshared_r, mapped_w));
            let status_fd = status.as_raw_fd();
            let why = match own_user_namespace(stdio, status_fd, unshared_w, mapped_r, filter) {
                Ok(()) => exec_child(what, cwd, (uid, gid), status_fd, floor),
                Err(why) => why,
            };
            say(&mut status, &format!("error {why}"));
            // SAFETY: _exit in a forked child.
            unsafe { libc::_exit(127) }
        }
        Ok(ForkResult::Parent { child }) => {
            drop(stdio);
            drop((unshared_w, mapped_r));
            let mut byte = [0u8; 1];
            let unshared = std::fs::File::from(unshared_r)
                .read_exact(&mut byte)
                .is_ok();
            if unshared {
                if let Err(why) = map_identity(child) {
                    // (someone else wrote its maps first, say): it must not wait on, dumpable
                    say(&mut status, &format!("error {why}"));
                    let _ = nix::sys::signal::kill(child, nix::sys::signal::SIGKILL);
                    drop(mapped_w);
                } else {
                    let _ = std::fs::File::from(mapped_w).write_all(b"m");
                }
            }
            say(&mut status, &format!("pid {child}"));
            let _ = security::install_seccomp(filter);
            let _ = security::restrict_privileges(false);
            let line = loop {
                match waitpid(child, None) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    Ok(WaitStatus::Exited(_, code)) => break format!("exit {code}"),
                    Ok(WaitStatus::Signaled(_, sig, _)) => break format!("signal {}", sig as i32),
                    Ok(_) => continue,
                    Err(e) => break format!("error wait: {e}"),
                }
            };
            say(&mut status, &line);
            0
        }
    }
}

/// In the child: its stdio, then a user namespace of its own, mapped by the runner (see
/// `run_in_session`), under the sandbox's privilege boundary. The runner may write the maps only
/// while the child is dumpable, and a dumpable process is open to the sandbox's root (it owns the
/// new namespace): so before that, the child holds nothing but its session's stdio and pipes, and
/// is under the sandbox's seccomp filter and capability set, never the helper's wider ones; and
/// it waits for its maps a bounded time.
fn own_user_namespace(
    stdio: [OwnedFd; 3],
    status_fd: RawFd,
    unshared: OwnedFd,
    mapped: OwnedFd,
    filter: &crate::seccomp::Program,
) -> Result<(), String> {
    for (target, fd) in stdio.iter().enumerate() {
        nix::unistd::dup2(fd.as_raw_fd(), target as RawFd).map_err(|e| format!("dup2: {e}"))?;
    }
    drop(stdio);
    let _ =
        security::close_descriptors_except(&[status_fd, unshared.as_raw_fd(), mapped.as_raw_fd()]);
    unshare(CloneFlags::CLONE_NEWUSER).map_err(|e| format!("a user namespace: {e}"))?;
    // Without `no_new_privs`, a filter needs CAP_SYS_ADMIN (in the namespace): before the drop.
    security::install_seccomp(filter).map_err(|e| warren_core::error_chain(&e))?;
    security::restrict_privileges(false).map_err(|e| warren_core::error_chain(&e))?;
    // Dumpable, so the runner (same owner) may write its id maps; the exec that follows sets
    // this as it sets it for any program, and a files worker clears it first thing.
    // SAFETY: prctl(2) with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) };
    std::fs::File::from(unshared)
        .write_all(b"u")
        .map_err(|e| format!("runner: {e}"))?;
    let mut poll = libc::pollfd {
        fd: mapped.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) on one pollfd we own.
    if unsafe { libc::poll(&mut poll, 1, MAP_WAIT_MS) } <= 0 {
        return Err("the runner did not map the user namespace in time".into());
    }
    let mut byte = [0u8; 1];
    std::fs::File::from(mapped)
        .read_exact(&mut byte)
        .map_err(|_| "the runner could not map the user namespace".to_string())
}

/// How long a session process waits for its id maps.
const MAP_WAIT_MS: i32 = 5000;

/// Maps `child`'s new user namespace onto the ids of ours, one to one.
fn map_identity(child: Pid) -> Result<(), String> {
    for kind in ["uid_map", "gid_map"] {
        let ours = std::fs::read_to_string(format!("/proc/self/{kind}"))
            .map_err(|e| format!("reading {kind}: {e}"))?;
        let identity: String = ours
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() == 3).then(|| format!("{} {} {}\n", f[0], f[0], f[2]))
            })
            .collect();
        std::fs::write(format!("/proc/{child}/{kind}"), identity)
            .map_err(|e| format!("writing {kind}: {e}"))?;
    }
    Ok(())
}

/// In the session, under the sandbox's privilege boundary (see `own_user_namespace`): a session
/// of its own, the identity (under the hardening floor, when there is one, for a program), then
/// the program. Returns only why it could not start.
fn exec_child(
    what: What,
    cwd: &CString,
    (uid, gid): (u32, u32),
    status_fd: RawFd,
    floor: Option<&warren_execd::hardening::Floor>,
) -> String {
    // The status pipe is close-on-exec: the runner reports how the program ends.
    // SAFETY: fcntl(2) on our own descriptor.
    unsafe { libc::fcntl(status_fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    let _ = nix::unistd::setsid();
    // SAFETY: chdir(2) with NUL-terminated paths.
    if unsafe { libc::chdir(cwd.as_ptr()) } != 0 && unsafe { libc::chdir(c"/".as_ptr()) } != 0 {
        return format!("chdir: {}", std::io::Error::last_os_error());
    }
    // SAFETY: prctl(2) with integer arguments: the runner's death signal is not for the program.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0) };
    if let (Some(floor), What::Exec { .. }) = (floor, &what) {
        // The floor makes the identity change itself, between its steps.
        if let Err(e) = floor.lower(Some(warren_execd::hardening::Identity { uid, gid })) {
            return format!("the hardening floor: {e}");
        }
    } else {
        // SAFETY: plain syscalls on this single thread's credentials.
        unsafe {
            if libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()) != 0
                || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
                || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
            {
                return format!("taking {uid}:{gid}: {}", std::io::Error::last_os_error());
            }
        }
    }
    match what {
        What::Exec { argv, env } => match nix::unistd::execve(&argv[0], &argv, &env) {
            Err(e) => format!("{}: {e}", argv[0].to_string_lossy()),
            Ok(never) => match never {},
        },
        What::FilesWorker { uid, gid, workdir } => {
            // In this process, never an exec of the binary: that is the host's `warren`, which
            // the session's code could then reach through the worker's /proc/<pid>/exe.
            // SAFETY: fd 0 is the worker's connection (stdin, dup'ed above); nothing else owns it.
            let conn = unsafe { OwnedFd::from_raw_fd(0) };
            let code = warren_execd::identity::serve_worker(conn, uid, gid, workdir);
            // SAFETY: _exit in a forked child, skipping the helper's atexit handlers.
            unsafe { libc::_exit(code) }
        }
    }
}

/// What a session process is asked to be, as the helper received it.
enum Program {
    Exec { argv: Vec<String>, env: Vec<String> },
    FilesWorker { uid: u32, gid: u32, workdir: String },
}

/// A [`Program`] ready to run in the forked child.
enum What {
    Exec {
        argv: Vec<CString>,
        env: Vec<CString>,
    },
    FilesWorker {
        uid: u32,
        gid: u32,
        workdir: std::path::PathBuf,
    },
}
