//! The open-file limit: raised for the server, given back to the sandboxes it starts.
//!
//! The server holds descriptors per sandbox — a pidfd to see its end, up to a few parked connections
//! to its execd, its log while it starts — and one per client connection. The soft limit most
//! systems hand a process is 1024 (systemd's default, kept low because `select(2)` cannot watch a
//! descriptor above 1023), which would stop a server at a few hundred sandboxes with `EMFILE` on
//! every accept and create. So the server raises its soft limit to the hard one at start, as Go
//! programs, nginx or dockerd do. What it spawns gets the original soft limit back: sandboxes are
//! other people's programs, and those may still use `select`.

use std::io;
use std::process::Command;
use std::sync::OnceLock;

/// The soft limit the process started with, once [`raise`] has run.
static ORIGINAL_SOFT: OnceLock<libc::rlim_t> = OnceLock::new();

/// The most a process the server starts may raise its limit to (see [`cap_children`]).
static CHILD_HARD: OnceLock<libc::rlim_t> = OnceLock::new();

/// Caps the hard limit of what this process starts from now on at `max` (`[limits] open_files`):
/// a sandbox's 4,096 processes could otherwise each open as many files as the host allows its
/// root (20,000 here, a million elsewhere). The first call wins.
pub fn cap_children(max: u64) {
    let _ = CHILD_HARD.set(max.max(1));
}

/// The hard limit a child gets where this process's is `hard`.
fn child_hard(hard: libc::rlim_t) -> libc::rlim_t {
    CHILD_HARD.get().map_or(hard, |cap| hard.min(*cap))
}

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit; (before, after). Remembers the
/// soft limit it found for [`restore_in_child`]. Calling it again changes nothing.
pub fn raise() -> io::Result<(u64, u64)> {
    let mut lim = get()?;
    let before = lim.rlim_cur;
    let original = *ORIGINAL_SOFT.get_or_init(|| before);
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit with a valid, initialised struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok((original, lim.rlim_cur))
}

/// Makes `cmd`'s process start with the soft limit this process had before [`raise`] (nothing to
/// do if it never ran).
pub fn restore_in_child(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let soft = ORIGINAL_SOFT.get().copied();
    let cap = CHILD_HARD.get().copied();
    if soft.is_none() && cap.is_none() {
        return;
    }
    // SAFETY: between fork and exec only getrlimit/setrlimit run, both async-signal-safe, on
    // stack memory (`get` allocates nothing, nor does `last_os_error`).
    unsafe {
        cmd.pre_exec(move || {
            let mut lim = get()?;
            if let Some(cap) = cap {
                lim.rlim_max = lim.rlim_max.min(cap);
            }
            lim.rlim_cur = soft.unwrap_or(lim.rlim_cur).min(lim.rlim_max);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// (soft, hard) for a sandbox started by a runtime that applies limits itself (an OCI runtime's
/// `process.rlimits`): the soft limit from before [`raise`]; `None` if it never ran.
pub fn for_children() -> Option<(u64, u64)> {
    let soft = *ORIGINAL_SOFT.get()?;
    let hard = child_hard(get().ok()?.rlim_max);
    Some((soft.min(hard), hard))
}

fn get() -> io::Result<libc::rlimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(lim)
}
