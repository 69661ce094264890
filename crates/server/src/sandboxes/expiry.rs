//! Expiry: the reaper that deletes sandboxes past their time, and the shutdown's delete of all.

use std::time::Duration;

use chrono::Utc;
use warren_api::lifecycle::SandboxState;
use warren_store::SandboxRecord;

use super::{Sandboxes, REASON_DELETE_FAILED, REASON_TTL_EXPIRY, REASON_USER_DELETE};

impl Sandboxes {
    /// Background loop: expires sandboxes on time and forgets ended ones after the retention period.
    /// Run again should it panic (see `supervise`).
    pub fn spawn_reaper(&self) -> tokio::task::JoinHandle<()> {
        let idle = self.clone();
        // (detached: it runs as long as the reaper does, the server's life)
        drop(crate::supervise::supervised("idle", move || {
            idle.clone().idle_loop()
        }));
        let reaper = self.clone();
        crate::supervise::supervised("reaper", move || reaper.clone().reap())
    }

    pub(super) async fn reap(self) {
        let this = self;
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = Utc::now();
            let retention = this.inner.retention;
            // With replicas, the one that leads expires sandboxes (each expiring them all would
            // write each delete once per replica); without, this server.
            let leads = this.leads();
            let expired = |r: &SandboxRecord| {
                leads
                    && !r.state.is_terminal()
                    && r.state != SandboxState::Stopping
                    && r.state != SandboxState::Pending
                    && r.expires_at.is_some_and(|t| t <= now)
            };
            let forgotten =
                |r: &SandboxRecord| r.state.is_terminal() && now - r.last_transition_at > retention;
            this.prune_timelines();
            for rec in this.select(|r| expired(r) || forgotten(r)) {
                if expired(&rec) {
                    let this = this.clone();
                    tokio::spawn(async move {
                        // Renew may have raced us; re-check under the operation lock inside delete.
                        if this
                            .get(&rec.id)
                            .and_then(|r| r.expires_at)
                            .is_some_and(|t| t <= Utc::now())
                        {
                            match this.delete(&rec.id, REASON_TTL_EXPIRY).await {
                                Ok(()) => {
                                    tracing::info!(sandbox_id = %rec.id, "sandbox expired")
                                }
                                Err(e) => {
                                    tracing::debug!(sandbox_id = %rec.id, error = %e, "expiry skipped")
                                }
                            }
                        }
                    });
                } else if forgotten(&rec) {
                    if rec.reason.as_deref() == Some(REASON_DELETE_FAILED) {
                        // Its delete failed: one more try before the record goes.
                        if let Err(e) = this
                            .inner
                            .runtime
                            .destroy(&rec.id, &rec.runtime_state)
                            .await
                        {
                            tracing::warn!(sandbox_id = %rec.id, error = %e, "removing a sandbox whose delete failed failed again; forgetting it");
                        }
                        let _ = this.inner.images.release(&rec.id);
                    }
                    this.forget(&rec.id);
                }
            }
        }
    }

    /// Stops every live sandbox (used by `warren run`'s embedded server and tests, not by `serve`, whose
    /// sandboxes outlive it).
    pub async fn delete_all(&self) {
        for rec in self.all() {
            if !rec.state.is_terminal() {
                let _ = self.delete(&rec.id, REASON_USER_DELETE).await;
            }
        }
    }
}
