//! Teardown: the sandbox's processes ended, its isolation helper stopped, its cgroup, mounts,
//! folders and id range released.

use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::children::{pidfd_exited, pidfd_open, reap_pidfd_with};
use crate::{
    cgroup, children, process_start_time, start_time_even_exited, NativeRuntime, ISOLATION_FILE,
};

pub(crate) fn is_alive(pid: i32) -> bool {
    process_start_time(pid).is_some()
}

pub(crate) fn wait_gone(pid: i32, within: Duration) {
    let deadline = Instant::now() + within;
    while is_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub(crate) fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    let tail = lines.into_iter().rev().collect::<Vec<_>>().join(" | ");
    if tail.is_empty() {
        "no output".into()
    } else {
        tail
    }
}

impl NativeRuntime {
    /// Ends and reaps sandbox `id`'s isolation helper, if it has one (see `isolation::start`). It
    /// lives in the host's PID namespace, so PID 1's end does not end it; it leaves by itself once
    /// execd's end of its socket has closed and it has reaped what it started, and its setup
    /// helper has exited, so it is the server's (the subreaper's) child to reap. Killed if it has
    /// not left within a few seconds. The pid is trusted only with the start time it was
    /// recorded with.
    pub(crate) fn end_isolation_helper(&self, id: &str) {
        let Ok(record) = fs::read_to_string(self.sandbox_dir(id).join(ISOLATION_FILE)) else {
            return;
        };
        let mut words = record.split_whitespace().map(|w| w.parse::<u64>().ok());
        let (Some(Some(pid)), Some(Some(start))) = (words.next(), words.next()) else {
            return;
        };
        let pid = pid as i32;
        if pid <= 1 {
            return;
        }
        // The pidfd first: the helper may have left already, and a zombie child of ours keeps its
        // pid (and start time) until we reap it.
        let Some(fd) = pidfd_open(pid) else {
            return;
        };
        if start_time_even_exited(pid) != Some(start) {
            return;
        }
        if !pidfd_exited(&fd, 3000) {
            tracing::warn!(
                sandbox_id = id,
                "the isolation helper did not leave; killed"
            );
            // SAFETY: pidfd_send_signal(2) on a pidfd we own: it names exactly that process.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    libc::SIGKILL,
                    0,
                    0,
                )
            };
            pidfd_exited(&fd, 2000);
        }
        let _ = reap_pidfd_with(&fd, libc::WEXITED | libc::WNOHANG);
    }

    /// Kills and reaps the server's children that sit in sandbox `id`'s cgroup. A setup helper killed
    /// before it answered may have forked the sandbox's PID 1 already; that process was reparented to
    /// the server (the subreaper), and with no `wait_exit` for a create that failed, nothing else
    /// would reap it. Only our own children are touched, each through a pidfd: a child's pid cannot
    /// be reused before we reap it.
    pub(crate) fn reap_strays(&self, id: &str, within: Duration) {
        let marker = format!("/{}/{id}\n", self.inner.config.cgroup_parent);
        let in_sandbox = |c: &children::OwnChild| {
            fs::read_to_string(format!("/proc/{}/cgroup", c.pid))
                .is_ok_and(|cg| cg.contains(&marker))
        };
        if !children::reap_own_children(in_sandbox, true, within) {
            tracing::warn!(
                sandbox_id = id,
                "processes of a failed start are still alive"
            );
        }
    }

    /// Kills and removes everything a sandbox holds on the host. Safe to call repeatedly.
    pub(crate) fn teardown(&self, id: &str, pid: Option<i32>) {
        // kill(0) or kill(-1) would hit our own group or everything: only ever signal a real pid.
        let pid = pid.filter(|p| *p > 1);
        if let Some(oci) = &self.inner.oci {
            oci.teardown(id, &self.sandbox_dir(id));
        }
        let cg = self.cgroup(id);
        // Opened before the kill, while the pid still names the verified process: its end is then
        // waited for with one poll, not by reading /proc/PID/stat every 2 ms (~0.6 % of the
        // machine's CPU at 10 creates in flight).
        let pidfd = pid.and_then(pidfd_open);
        if let Some(pid) = pid {
            // SAFETY: kill(2); the pid was verified to be the sandbox's init (or is our fresh child).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // Frozen tasks cannot die; thaw after the kill is queued.
        if cg.is_frozen() {
            let _ = cg.set_frozen(false);
        }
        // A PID 1 that cannot die yet (see `leftovers`) is reaped later.
        let mut unreaped = None;
        match (pid, pidfd) {
            (Some(_), Some(fd)) => {
                // Reaped here too: the server (its subreaper) is PID 1's parent, and a create that
                // failed after PID 1 started has no `wait_exit` to do it, which left a zombie per
                // failure until the server exited. Where `wait_exit` waits as well, one of the two
                // finds nothing to reap; where the server is not the parent (gVisor, a sandbox
                // adopted after a restart), the kernel says so and nothing happens.
                if pidfd_exited(&fd, 5000) {
                    let _ = reap_pidfd_with(&fd, libc::WEXITED | libc::WNOHANG);
                } else {
                    unreaped = Some(fd);
                }
            }
            (Some(pid), None) => wait_gone(pid, Duration::from_secs(5)),
            (None, _) => {}
        }
        self.end_isolation_helper(id);
        let cgroup_left = match cg.remove(Duration::from_secs(3)) {
            Ok(()) => false,
            Err(e) => {
                tracing::warn!(sandbox_id = id, error = %e, "cgroup removal failed; retried in the background");
                true
            }
        };
        if let (Some(slots), None) = (&self.inner.userns, &unreaped) {
            // Its processes are gone: the range may serve another sandbox. (A PID 1 that cannot
            // die yet keeps it until the server restarts.)
            slots.release(id);
        }
        if cgroup_left || unreaped.is_some() {
            self.inner.leftovers.add(id, unreaped);
        }
        if self.inner.oci.is_some() {
            cgroup::remove_everywhere(
                &self.inner.config.cgroup_root,
                &self.inner.config.cgroup_parent,
                id,
            );
        }
        if let Err(e) = self.inner.folders.remove(id) {
            tracing::warn!(sandbox_id = id, error = %e, "sandbox folder removal failed");
        }
    }
}
