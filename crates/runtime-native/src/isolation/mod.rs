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
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use nix::sched::{setns, CloneFlags};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};
use warren_execd::isolation::channel::{self, Mount, Reply, Request};

use crate::{
    isolation::run::run_in_session, isolation::run::Program, isolation::run::What,
    isolation::session::keep_session, isolation::session::read_to_end_within,
    isolation::session::REPORT_WITHIN_MS, security,
};

mod run;
mod session;

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
