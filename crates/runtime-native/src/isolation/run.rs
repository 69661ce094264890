//! Running in a session: the runner joins the session's namespaces, takes the sandbox's own
//! filter and capabilities, and becomes the program asked for (a command, or a files worker).

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};

use crate::{isolation::session::say, isolation::Session, security};

/// The runner: joins session `s`, starts the process, reports its pid and how it ended on
/// `status`. Returns the runner's exit code.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_in_session(
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
pub(super) enum Program {
    Exec { argv: Vec<String>, env: Vec<String> },
    FilesWorker { uid: u32, gid: u32, workdir: String },
}

/// A [`Program`] ready to run in the forked child.
pub(super) enum What {
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
