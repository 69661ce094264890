//! The server's own child processes: watching and reaping them through pidfds, and finding the ones
//! a failure left behind.
//!
//! The server is the child subreaper of every sandbox's PID 1 and of setup helpers whose zygote
//! died. A pid is only safe to signal or wait on while it is our unreaped child (it cannot be reused
//! before we reap it), so everything here goes through a pidfd opened from such a pid.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use warren_core::ExitInfo;

/// One of the server's children, as `/proc/PID/stat` shows it.
pub(crate) struct OwnChild {
    pub pid: i32,
    pub comm: String,
    /// Exited and waiting to be reaped.
    pub zombie: bool,
}

/// The processes whose parent is this one.
pub(crate) fn own_children() -> Vec<OwnChild> {
    let me = std::process::id() as i32;
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let child = parse_stat(pid, &stat)?;
            (child.1 == me).then_some(child.0)
        })
        .collect()
}

/// `pid (comm) state ppid …` into the child and its parent. The command name may hold spaces and
/// `)`, so it runs from the first `(` to the last `)`.
fn parse_stat(pid: i32, stat: &str) -> Option<(OwnChild, i32)> {
    let (_, rest) = stat.split_once(" (")?;
    let (comm, tail) = rest.rsplit_once(") ")?;
    let mut fields = tail.split_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let child = OwnChild {
        pid,
        comm: comm.to_string(),
        zombie: state == "Z",
    };
    Some((child, ppid))
}

/// Reaps the server's children that `select` picks, until none is left or `within` has passed;
/// whether none is left. With `kill` each is sent SIGKILL and waited for (the rest of `within`);
/// without, only the ones that have exited are reaped and the others are looked at again every
/// 50 ms — for helpers that are still finishing.
pub(crate) fn reap_own_children(
    select: impl Fn(&OwnChild) -> bool,
    kill: bool,
    within: Duration,
) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let chosen: Vec<OwnChild> = own_children().into_iter().filter(|c| select(c)).collect();
        if chosen.is_empty() {
            return true;
        }
        for child in chosen.iter().filter(|c| kill || c.zombie) {
            let Some(fd) = pidfd_open(child.pid) else {
                continue;
            };
            if kill {
                // SAFETY: kill(2) of our own unreaped child, which the pid still names.
                unsafe { libc::kill(child.pid, libc::SIGKILL) };
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if pidfd_exited(&fd, i32::try_from(left.as_millis()).unwrap_or(i32::MAX)) {
                let _ = reap_pidfd_with(&fd, libc::WEXITED | libc::WNOHANG);
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50).min(deadline - Instant::now()));
    }
}

pub(crate) fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new fd we take ownership of, or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a freshly opened descriptor owned by nobody else.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Waits up to `timeout_ms` (-1: for ever) for the process behind `pidfd` to exit; whether it has.
pub(crate) fn pidfd_exited(pidfd: &OwnedFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: poll on one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if n >= 0 {
            return n > 0;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return true;
        }
    }
}

/// Collects the exit status when the process is our child (we are its subreaper); otherwise its
/// parent reaps it and we only know it ended.
pub(crate) fn reap_pidfd(fd: &OwnedFd) -> Option<ExitInfo> {
    reap_pidfd_with(fd, libc::WEXITED)
}

/// `waitid` on a pidfd with `flags`; `None` when there was nothing to reap (not our child, already
/// reaped, or with `WNOHANG` still running).
pub(crate) fn reap_pidfd_with(fd: &OwnedFd, flags: libc::c_int) -> Option<ExitInfo> {
    // SAFETY: zeroed siginfo is a valid out-parameter for waitid.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    const P_PIDFD: libc::idtype_t = 3;
    // SAFETY: waitid on a pidfd we own with a valid siginfo pointer.
    let rc = unsafe { libc::waitid(P_PIDFD, fd.as_raw_fd() as libc::id_t, &mut info, flags) };
    // With WNOHANG and the child still running, waitid succeeds and leaves si_pid 0.
    // SAFETY: `info` was zeroed and, on success, filled by waitid.
    if rc != 0 || unsafe { info.si_pid() } == 0 {
        return None;
    }
    // SAFETY: waitid filled `info` for a CLD_* event.
    let (code, status) = unsafe { (info.si_code, info.si_status()) };
    Some(if code == libc::CLD_EXITED {
        ExitInfo {
            code: Some(status),
            signal: None,
            vanished: false,
            detail: None,
        }
    } else {
        ExitInfo {
            code: None,
            signal: Some(status),
            vanished: false,
            detail: None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_with_awkward_command_names() {
        let (c, ppid) = parse_stat(42, "42 (a) b) c) S 7 42 42 0 -1").expect("parses");
        assert_eq!(
            (c.pid, c.comm.as_str(), c.zombie, ppid),
            (42, "a) b) c", false, 7)
        );
        let (c, _) = parse_stat(9, "9 (warren-setup) Z 1 0").expect("parses");
        assert!(c.zombie);
        assert!(parse_stat(9, "9 (cut short").is_none());
    }

    #[test]
    fn exited_children_are_reaped_and_live_ones_killed() {
        let sleeper = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("spawn sleep");
        let quick = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let (slow_pid, quick_pid) = (sleeper.id() as i32, quick.id() as i32);
        // Deliberately not waited on through `Child`: the reaper must do it.
        std::mem::forget((sleeper, quick));

        // Without `kill`, the finished child is reaped and the sleeper left alone.
        let done = reap_own_children(|c| c.pid == quick_pid, false, Duration::from_secs(5));
        assert!(done, "the exited child was reaped");
        assert!(!std::path::Path::new(&format!("/proc/{quick_pid}")).exists());
        assert!(std::path::Path::new(&format!("/proc/{slow_pid}")).exists());

        let done = reap_own_children(|c| c.pid == slow_pid, true, Duration::from_secs(5));
        assert!(done, "the sleeper was killed and reaped");
        assert!(!std::path::Path::new(&format!("/proc/{slow_pid}")).exists());
    }
}
