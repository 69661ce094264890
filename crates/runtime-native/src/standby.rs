//! The standby pool: setup helpers forked from the zygote ahead of need, each waiting for the
//! spec of the next sandbox, so that a create skips the fork.

use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use warren_core::{ResourceLimits, RuntimeError, SandboxSpec};

use crate::reply::read_line;
use crate::{lock, zygote, Cgroup, NativeRuntime, INIT_SUBCOMMAND, JOINED_LINE};

/// A setup helper started ahead of need, already joined to a cgroup of its own and waiting on stdin
/// for a sandbox spec.
pub(crate) struct Standby {
    helper: zygote::Helper,
    cgroup: Cgroup,
}

#[derive(Default)]
pub(crate) struct StandbyPool {
    ready: Vec<Standby>,
    starting: usize,
    closed: bool,
}

pub(crate) const STANDBY_PREFIX: &str = ".standby-";

pub(crate) static STANDBY_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl NativeRuntime {
    /// Standby cgroups of a server that died (the pid in their name is gone); their helpers exited
    /// when that server's end of the pipe closed.
    pub(crate) fn remove_stale_standby(&self) {
        let probe = Cgroup::at(&self.inner.layout, &self.inner.config.cgroup_parent, "x");
        for parent in probe.dirs().iter().filter_map(|d| d.parent()) {
            let Ok(entries) = fs::read_dir(parent) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(rest) = name.strip_prefix(STANDBY_PREFIX) else {
                    continue;
                };
                let owner: Option<i32> = rest.rsplit('-').next().and_then(|p| p.parse().ok());
                if owner.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
                    let _ = Cgroup::at(&self.inner.layout, &self.inner.config.cgroup_parent, &name)
                        .remove(Duration::from_secs(1));
                }
            }
        }
    }

    /// A helper started now: create the sandbox's cgroup; the helper joins it itself.
    pub(crate) fn cold_helper(
        &self,
        spec: &SandboxSpec,
        log: fs::File,
    ) -> Result<zygote::Helper, RuntimeError> {
        let cg = Cgroup::create(
            &self.inner.layout,
            &self.inner.config.cgroup_parent,
            &spec.id,
            &spec.limits,
        )
        .map_err(|e| {
            RuntimeError::backend_with(format!("creating the cgroup of sandbox {}", spec.id), e)
        })?;
        self.spawn_helper(&cg, log.into())
            .map_err(|e| RuntimeError::backend_with("starting the sandbox setup helper", e))
    }

    /// A setup helper in the cgroup `cg`: forked by the zygote (straight into it on v2), or exec'd
    /// when the zygote fails; either joins through `Cgroup::join_files` where it was not created
    /// inside.
    pub(crate) fn spawn_helper(
        &self,
        cg: &Cgroup,
        stderr: OwnedFd,
    ) -> std::io::Result<zygote::Helper> {
        let join = cg.join_files();
        match self
            .inner
            .zygote
            .fork_helper(&join, cg.clone_into_dir(), &stderr)
        {
            Ok(helper) => return Ok(helper),
            Err(e) => {
                tracing::warn!(error = %e, "the zygote could not fork a setup helper; exec'ing one")
            }
        }
        let mut cmd = Command::new(&self.inner.config.helper_exe);
        warren_core::fd_limit::restore_in_child(&mut cmd);
        cmd.arg(INIT_SUBCOMMAND);
        for file in &join {
            cmd.arg("--join").arg(file);
        }
        let (stdin, theirs) = zygote::spec_channel()?;
        let child = cmd
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .env_clear()
            // Out of the server's process group, as the zygote is: see `Zygote::start`.
            .process_group(0)
            .spawn()?;
        Ok(zygote::Helper::spawned(child, stdin))
    }

    /// A standby helper, already in a cgroup of its own: the cgroup is renamed to the sandbox's and
    /// given its limits. `None` when there is none ready (or it cannot be adopted).
    pub(crate) fn take_standby(&self, id: &str, limits: &ResourceLimits) -> Option<zygote::Helper> {
        let mut standby = lock(&self.inner.standby).ready.pop()?;
        let adopted = standby
            .cgroup
            .rename(id)
            .and_then(|cg| cg.apply(limits).map(|()| cg));
        match (standby.helper.is_running(), adopted) {
            (true, Ok(_)) => Some(standby.helper),
            (_, adopted) => {
                tracing::warn!(
                    sandbox_id = id,
                    "a standby setup helper was unusable; starting a fresh one"
                );
                standby.helper.kill();
                standby.helper.wait();
                let cg = adopted.unwrap_or(standby.cgroup);
                let _ = cg.remove(Duration::from_secs(1));
                None
            }
        }
    }

    /// Tops the standby pool up to its target in a background thread.
    pub(crate) fn refill_standby(&self) {
        // On v2 every adoption would fail (no rename) after costing a helper and its cgroup.
        let target = if self.inner.layout.can_rename() {
            self.inner.config.standby_helpers
        } else {
            0
        };
        let missing = {
            let mut pool = lock(&self.inner.standby);
            let missing = target.saturating_sub(pool.ready.len() + pool.starting);
            pool.starting += missing;
            missing
        };
        if missing == 0 {
            return;
        }
        let this = self.clone();
        std::thread::spawn(move || {
            for _ in 0..missing {
                // `starting` counts down only once a helper is in the pool or gone for good:
                // `close_standby` waits for it to reach zero.
                if lock(&this.inner.standby).closed {
                    lock(&this.inner.standby).starting -= 1;
                    continue;
                }
                let started = this.start_standby();
                let mut pool = lock(&this.inner.standby);
                match started {
                    Ok(s) if !pool.closed => {
                        pool.ready.push(s);
                        pool.starting -= 1;
                    }
                    Ok(mut s) => {
                        drop(pool);
                        s.helper.kill();
                        s.helper.wait();
                        let _ = s.cgroup.remove(Duration::from_secs(1));
                        lock(&this.inner.standby).starting -= 1;
                    }
                    Err(e) => {
                        pool.starting -= 1;
                        tracing::warn!(error = %e, "starting a standby setup helper failed");
                    }
                }
            }
        });
    }

    pub(crate) fn start_standby(&self) -> Result<Standby, RuntimeError> {
        let name = format!(
            "{STANDBY_PREFIX}{}",
            STANDBY_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let name = format!("{name}-{}", std::process::id());
        let none = ResourceLimits {
            cpu_millis: None,
            memory_bytes: None,
            pids: 64,
            disk_bytes: None,
        };
        let cgroup = Cgroup::create(
            &self.inner.layout,
            &self.inner.config.cgroup_parent,
            &name,
            &none,
        )
        .map_err(|e| RuntimeError::backend_with("creating a standby cgroup", e))?;
        let null = fs::OpenOptions::new().write(true).open("/dev/null");
        let spawned = null.and_then(|null| self.spawn_helper(&cgroup, null.into()));
        let mut helper = match spawned {
            Ok(h) => h,
            Err(e) => {
                let _ = cgroup.remove(Duration::from_secs(1));
                return Err(RuntimeError::backend_with(
                    "starting a standby setup helper",
                    e,
                ));
            }
        };
        // Ready only once it has joined: renaming the cgroup before that would break its join.
        if read_line(helper.stdout.as_mut()).as_deref() != Some(JOINED_LINE) {
            helper.kill();
            helper.wait();
            let _ = cgroup.remove(Duration::from_secs(1));
            return Err(RuntimeError::backend(
                "a standby setup helper could not join its cgroup",
            ));
        }
        Ok(Standby { helper, cgroup })
    }

    /// Ends the standby helpers and removes their cgroups (server shutdown).
    pub fn close_standby(&self) {
        let ready = {
            let mut pool = lock(&self.inner.standby);
            pool.closed = true;
            std::mem::take(&mut pool.ready)
        };
        for mut s in ready {
            s.helper.kill();
            s.helper.wait();
            let _ = s.cgroup.remove(Duration::from_secs(1));
        }
        // Helpers still starting are ended by their refill thread once it sees `closed`; the server
        // exits right after this returns, which would kill that thread first and leave the
        // helper's cgroup behind (seen in CI after a test stopped its server mid-refill).
        let deadline = Instant::now() + Duration::from_secs(3);
        while lock(&self.inner.standby).starting > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.inner.zygote.stop();
    }
}
