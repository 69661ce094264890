//! Making a session: the keeper unshares the session's namespaces, checks and makes its mounts
//! (the sandbox's tree read-only, the workspace writable, read-only or an overlay, a private
//! `/tmp`), and forks the session's init, which reaps until the session ends.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};
use warren_execd::isolation::channel::{self, Mount};

use crate::{
    isolation::NAMESPACES,
    rootfs::{self, mount_api},
    security,
};

/// How long the keeper gets to make a session and report.
pub(super) const REPORT_WITHIN_MS: i32 = 10_000;

/// What `pipe` carries until its writers close it, or until `within_ms` have passed.
pub(super) fn read_to_end_within(pipe: OwnedFd, within_ms: i32) -> String {
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
pub(super) fn say(pipe: &mut std::fs::File, line: &str) {
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
pub(super) fn keep_session(
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
