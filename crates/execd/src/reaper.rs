//! The single child reaper.
//!
//! As PID 1 execd inherits every orphan of the sandbox and must reap them, yet it must also learn the exit
//! status of its own children. Two independent `waitpid` users would steal each other's statuses, so there
//! is exactly one: on every SIGCHLD it loops `waitpid(-1, WNOHANG)` and hands each status to whoever
//! registered that pid; unregistered pids (orphans) are just reaped.
//!
//! The table lock is held across `fork/exec + register`, and the reaper takes it before calling `waitpid`.
//! That closes the race where a child exits before it is registered, and it also keeps the reaper away from
//! the `waitpid` that `std::process::Command::spawn` itself performs when `exec` fails.
//! Therefore nothing in execd may use `tokio::process` or `Child::wait`.
//!
//! Every child execd starts runs user code, so the reaper is also where the floor goes under them
//! when hardening is on (see `hardening`): a spawn through it cannot leave the floor out.

use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    /// The shell convention (`128 + signal`), used for execd's own exit code.
    pub fn shell_code(self) -> i32 {
        match self {
            Self::Code(c) => c,
            Self::Signal(s) => 128 + s,
        }
    }
}

#[derive(Default)]
struct Table {
    waiters: HashMap<i32, oneshot::Sender<Exit>>,
}

/// Cheap to clone; all clones share one table.
#[derive(Clone, Default)]
pub struct Reaper {
    table: Arc<Mutex<Table>>,
    floor: Option<Arc<crate::hardening::Floor>>,
}

/// A spawned child whose exit status will be delivered by the reaper.
pub struct Spawned {
    pub child: Child,
    pub exit: oneshot::Receiver<Exit>,
}

impl Reaper {
    pub fn new() -> Self {
        Self::default()
    }

    /// A reaper whose spawns all start under `floor`.
    pub fn with_floor(floor: Option<Arc<crate::hardening::Floor>>) -> Self {
        Self {
            floor,
            ..Self::default()
        }
    }

    /// The floor children start under, if hardening is on. Whoever starts a child without
    /// [`Reaper::spawn`] (with `posix_spawn`, which runs nothing between fork and exec) must not
    /// when there is one.
    pub fn floor(&self) -> Option<&Arc<crate::hardening::Floor>> {
        self.floor.as_ref()
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // A poisoned table only means a panic elsewhere while holding it; the map itself stays valid.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers the pid `start` returns for exit delivery. The table stays locked while `start`
    /// runs, so a child that exits at once cannot be reaped before its waiter exists. For children
    /// started without `Command` (`posix_spawn`), which cannot go under the floor: refused when
    /// there is one.
    pub fn start(
        &self,
        start: impl FnOnce() -> std::io::Result<i32>,
    ) -> std::io::Result<(i32, oneshot::Receiver<Exit>)> {
        if self.floor.is_some() {
            return Err(std::io::Error::other(
                "a child started without Command would escape the hardening floor",
            ));
        }
        self.register(start)
    }

    fn register(
        &self,
        start: impl FnOnce() -> std::io::Result<i32>,
    ) -> std::io::Result<(i32, oneshot::Receiver<Exit>)> {
        let mut table = self.lock();
        // Under the table's lock: spawns are serialised, as `oom::for_child` needs.
        let pid = crate::oom::for_child(start)?;
        let (tx, rx) = oneshot::channel();
        table.waiters.insert(pid, tx);
        Ok((pid, rx))
    }

    /// Spawns `cmd` (user code, as execd's user) and registers its pid before the reaper can see
    /// it exit.
    pub fn spawn(&self, cmd: &mut Command) -> std::io::Result<Spawned> {
        self.spawn_as(cmd, crate::hardening::Role::UserCode, None)
    }

    /// [`Reaper::spawn`] for `role`, as `identity` (else execd's user): under the floor, which then
    /// makes the identity change itself; `cmd` must not have one of its own.
    pub fn spawn_as(
        &self,
        cmd: &mut Command,
        role: crate::hardening::Role,
        identity: Option<crate::hardening::Identity>,
    ) -> std::io::Result<Spawned> {
        match (&self.floor, identity) {
            (Some(floor), _) => floor.prepare(cmd, role, identity),
            (None, Some(id)) => {
                std::os::unix::process::CommandExt::gid(cmd, id.gid);
                std::os::unix::process::CommandExt::uid(cmd, id.uid);
            }
            (None, None) => {}
        }
        let mut child = None;
        let (_, exit) = self.register(|| {
            let c = cmd.spawn()?;
            let pid = i32::try_from(c.id()).map_err(std::io::Error::other)?;
            child = Some(c);
            Ok(pid)
        })?;
        let child = child.ok_or_else(|| std::io::Error::other("spawned without a child"))?;
        Ok(Spawned { child, exit })
    }

    /// Reaps everything that has exited and dispatches statuses. Returns how many were reaped.
    pub fn reap_now(&self) -> usize {
        Self::reap_locked(&mut self.lock())
    }

    /// `reap_now` unless a spawn holds the table right now (`None` then).
    fn try_reap_now(&self) -> Option<usize> {
        match self.table.try_lock() {
            Ok(mut table) => Some(Self::reap_locked(&mut table)),
            Err(TryLockError::Poisoned(e)) => Some(Self::reap_locked(&mut e.into_inner())),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    fn reap_locked(table: &mut Table) -> usize {
        let mut reaped = 0;
        loop {
            let (pid, exit) = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (pid, Exit::Code(code)),
                Ok(WaitStatus::Signaled(pid, sig, _)) => (pid, Exit::Signal(sig as i32)),
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                Ok(_) => continue,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "waitpid failed");
                    break;
                }
            };
            reaped += 1;
            match table.waiters.remove(&pid.as_raw()) {
                Some(tx) => {
                    // The receiver may be gone (caller lost interest); the status is simply dropped.
                    let _ = tx.send(exit);
                }
                None => tracing::debug!(pid = pid.as_raw(), ?exit, "reaped orphan"),
            }
        }
        reaped
    }

    /// Runs forever, reaping on every SIGCHLD. Must be started before the first spawn can matter; an initial
    /// sweep catches anything that exited before the signal handler was installed.
    pub async fn run(self) -> std::io::Result<()> {
        let mut sigchld = signal(SignalKind::child())?;
        loop {
            // waitpid with WNOHANG never blocks, but the table lock may be held across a fork/exec
            // on another thread: then reap off the runtime. Spawns on the runtime's own thread
            // cannot hold it here, so this is rare, and most exits cost no thread hand-off.
            if self.try_reap_now().is_none() {
                let this = self.clone();
                let _ = tokio::task::spawn_blocking(move || this.reap_now()).await;
            }
            if sigchld.recv().await.is_none() {
                return Ok(());
            }
        }
    }
}

/// When execd is not PID 1 (tests, or a runtime that runs its own init), become a child subreaper so that
/// background grandchildren of commands are still reparented to, and reaped by, execd.
pub fn become_subreaper() -> std::io::Result<()> {
    if std::process::id() == 1 {
        return Ok(());
    }
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes one integer argument and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn delivers_status_of_fast_exiting_child() {
        let reaper = Reaper::new();
        tokio::spawn(reaper.clone().run());
        for code in [0, 3, 7] {
            let spawned = reaper
                .spawn(
                    Command::new("/bin/sh")
                        .arg("-c")
                        .arg(format!("exit {code}")),
                )
                .expect("spawn");
            let exit = tokio::time::timeout(std::time::Duration::from_secs(5), spawned.exit)
                .await
                .expect("timely")
                .expect("status");
            assert_eq!(exit, Exit::Code(code));
        }
    }
}
