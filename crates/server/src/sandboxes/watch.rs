//! Watching sandboxes end by themselves, and recovering the records after a restart.

use std::sync::Arc;

use warren_api::lifecycle::SandboxState;
use warren_core::Liveness;
use warren_store::SandboxRecord;

use super::{lock, moved, Entry, Sandboxes};

impl Sandboxes {
    /// What a sandbox found ended at recovery still holds (the runtime's remains, the image
    /// lease), removed whatever is left of it.
    async fn release_ended(&self, rec: &SandboxRecord) {
        let _ = self
            .inner
            .runtime
            .destroy(&rec.id, &rec.runtime_state)
            .await;
        let _ = self.inner.images.release(&rec.id);
    }

    /// Watches a running sandbox: if its processes end by themselves it becomes Terminated (exit 0) or
    /// Failed, its resources are released, and its record stays to say why.
    pub(super) fn watch(&self, rec: &SandboxRecord) {
        let this = self.clone();
        let id = rec.id.clone();
        let exit = self.inner.runtime.wait_exit(&rec.id, &rec.runtime_state);
        let watcher = self.clone();
        let watched = id.clone();
        let watch = async move {
            let info = exit.await;
            let Some(entry) = this.entry(&id) else { return };
            let _op = entry.op.lock().await;
            let rec = lock(&entry.record).clone();
            if rec.state.is_terminal() || rec.state == SandboxState::Stopping {
                return;
            }
            let (state, message) = ended_by_itself(&info);
            tracing::info!(sandbox_id = %id, %message, "sandbox ended by itself");
            if let Err(e) = this.inner.runtime.destroy(&id, &rec.runtime_state).await {
                tracing::warn!(sandbox_id = %id, error = %e, "cleaning up an ended sandbox failed");
            }
            this.unlink(&id).await;
            let _ = this.inner.images.release(&id);
            this.update(&entry, |r| {
                moved(r, state, Some("process_exited"), Some(message))
            });
            this.inner.execd_conns.forget(&id);
        };
        tokio::spawn(async move {
            // A panic here is this sandbox's alone: it ends Failed, not running unwatched.
            if futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(watch))
                .await
                .is_err()
            {
                if let Some(entry) = watcher.entry(&watched) {
                    let _op = entry.op.lock().await;
                    if !lock(&entry.record).state.is_terminal() {
                        watcher
                            .failed_by_panic(&entry, "watching the sandbox")
                            .await;
                    }
                }
            }
        });
    }

    /// Loads persisted records after a (re)start and re-attaches to sandboxes that still run.
    /// With shared records: follows the runtime's records instead, from the ones there now.
    pub async fn recover(&self) -> anyhow::Result<()> {
        if let Some(shared) = self.inner.records.feed() {
            self.follow_shared(shared).await;
            return Ok(());
        }
        let (records, errors) = self.inner.records.load()?;
        for e in errors {
            tracing::error!(error = %e, "skipping an unreadable sandbox record");
        }
        for mut rec in records {
            if !rec.state.is_terminal() {
                let liveness = if rec.runtime_state.is_null() {
                    Liveness::Gone
                } else {
                    self.inner
                        .runtime
                        .liveness(&rec.id, &rec.runtime_state)
                        .await
                };
                match (rec.state, liveness) {
                    (SandboxState::Stopping, _) => {
                        // A delete was in flight: finish it, whether or not its kill already
                        // landed (the reason stays the delete's, not "lost").
                        self.release_ended(&rec).await;
                        let reason = rec.reason.clone();
                        moved(&mut rec, SandboxState::Terminated, reason.as_deref(), None);
                        self.persist(&rec);
                    }
                    (_, Liveness::Gone) => {
                        self.release_ended(&rec).await;
                        let was = rec.state;
                        moved(&mut rec,
                            SandboxState::Failed,
                            Some("lost"),
                            Some(format!("the sandbox's processes ended while the server was down (it was {})", was.as_str())),
                        );
                        self.persist(&rec);
                    }
                    (SandboxState::Running, Liveness::Paused) => {
                        // Frozen by a step the server did not finish (a snapshot's copy, a pause
                        // it had not recorded, so never answered): thawed, as the record says.
                        if let Err(e) = self.inner.runtime.resume(&rec.id, &rec.runtime_state).await
                        {
                            tracing::warn!(sandbox_id = %rec.id, error = %e, "thawing a sandbox left frozen failed");
                            let reason = rec.reason.clone();
                            moved(&mut rec, SandboxState::Paused, reason.as_deref(), None);
                            self.persist(&rec);
                        }
                    }
                    (_, Liveness::Paused) => {
                        let reason = rec.reason.clone();
                        moved(&mut rec, SandboxState::Paused, reason.as_deref(), None);
                        self.persist(&rec);
                    }
                    (_, Liveness::Running) => {
                        if rec.state != SandboxState::Running {
                            moved(&mut rec, SandboxState::Running, None, None);
                            self.persist(&rec);
                        }
                    }
                }
            }
            let watch = rec.state == SandboxState::Running || rec.state == SandboxState::Paused;
            let entry = Arc::new(Entry::new(&rec, true, self.inner.timeline.clone()));
            self.inner
                .entries
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.id.clone(), entry);
            if watch {
                if let Some(index) = rec.network_link {
                    // The link survived in the sandbox's namespace; the firewall's sets did not.
                    let policy = self
                        .network_policy(&rec.id)
                        .unwrap_or_else(|_| self.inner.network.default_policy());
                    let relinked = match self.inner.network.egress().await {
                        Ok(eg) => self
                            .link(&eg, &rec.id, &rec.runtime_state, policy, Some(index))
                            .await
                            .map(|_| ()),
                        Err(e) => Err(e),
                    };
                    let relinked = match relinked {
                        // The proxy's CA key lived in the old process: a new CA goes in.
                        Ok(()) if rec.credential_proxy => match self.inner.network.egress().await {
                            Ok(eg) => self.start_credential_proxy(&eg, &rec.id).await,
                            Err(e) => Err(e),
                        },
                        other => other,
                    };
                    if let Err(e) = relinked {
                        tracing::error!(sandbox_id = %rec.id, error = %e, "re-attaching the network link failed");
                    }
                }
                self.watch(&rec);
                if let Some(hooks) = rec
                    .lifecycle_hooks
                    .as_ref()
                    .and_then(|v| serde_json::from_value::<crate::hooks::Hooks>(v.clone()).ok())
                {
                    self.arm_periodic(&rec.id, &hooks.periodic);
                }
            }
        }
        let known: Vec<String> = self
            .all()
            .into_iter()
            .filter(|r| !r.state.is_terminal())
            .map(|r| r.id)
            .collect();
        self.inner.runtime.sweep_orphans(&known).await;
        Ok(())
    }
}

/// The state and message of a sandbox that ended by itself (or was removed outside Warren).
pub(super) fn ended_by_itself(info: &warren_core::ExitInfo) -> (SandboxState, String) {
    let (state, message) = match (info.code, info.signal) {
        _ if info.vanished => (
            SandboxState::Terminated,
            "the sandbox was removed outside Warren".to_string(),
        ),
        (Some(0), _) => (
            SandboxState::Terminated,
            "the main process exited with code 0".to_string(),
        ),
        (Some(c), _) => (
            SandboxState::Failed,
            format!("the main process exited with code {c}"),
        ),
        (None, Some(s)) => (
            SandboxState::Failed,
            format!("the main process was killed by signal {s}"),
        ),
        (None, None) => (
            SandboxState::Failed,
            "the sandbox's processes ended".to_string(),
        ),
    };
    let message = match &info.detail {
        Some(detail) => format!("{message} ({detail})"),
        None => message,
    };
    (state, message)
}
