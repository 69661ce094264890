//! What a sandbox does while it lives, as the server drives it: periodic hooks, and the idle
//! policy that pauses or deletes a sandbox nobody uses.

use std::time::Duration;

use chrono::Utc;
use warren_api::lifecycle::SandboxState;
use warren_store::SandboxRecord;

use super::Sandboxes;

impl Sandboxes {
    /// Runs `periodic` hooks of sandbox `id` on their schedules while it lives: each in a task of
    /// its own, one run at a time (a run that outlasts its interval delays the next), skipped while
    /// the sandbox is not Running, and ended once the sandbox is.
    pub(super) fn arm_periodic(&self, id: &str, periodic: &[crate::hooks::Periodic]) {
        for p in periodic.iter().cloned() {
            let this = self.clone();
            let id = id.to_string();
            tokio::spawn(async move {
                let Ok(schedule) = crate::hooks::Schedule::parse(&p.schedule) else {
                    return; // checked at create: a record from elsewhere
                };
                let label = format!("periodic {}", p.name);
                let mut after = Utc::now();
                loop {
                    let Some(next) = schedule.next_after(after) else {
                        return;
                    };
                    let wait = (next - Utc::now()).to_std().unwrap_or_default();
                    tokio::time::sleep(wait).await;
                    let Some(rec) = this.get(&id) else {
                        return;
                    };
                    if rec.state.is_terminal() {
                        return;
                    }
                    if rec.state == SandboxState::Running {
                        let run = crate::hooks::run(&this.endpoint_of(&rec), &label, &p.hook).await;
                        this.inner.hook_runs.record(&id, run);
                    }
                    // Missed times (a long run, a pause) are skipped, not run in a burst.
                    after = next.max(Utc::now());
                }
            });
        }
    }

    /// The idle policy of sandbox `rec`, if it has one.
    pub fn idle_policy(rec: &SandboxRecord) -> Option<crate::idle::IdlePolicy> {
        rec.lifecycle_hooks
            .as_ref()
            .and_then(|v| serde_json::from_value::<crate::hooks::Hooks>(v.clone()).ok())
            .and_then(|h| h.idle)
    }

    /// Something starts for sandbox `id` (a relayed request): it is not idle until the guard goes.
    pub fn busy(&self, id: &str) -> crate::idle::Busy {
        self.inner.activity.begin(id)
    }

    /// A request for paused sandbox `rec`, whose idle policy wakes it on access: resumes it (or
    /// waits for a resume under way) for at most `idle::WAKE_WAIT`. True once it is Running.
    pub async fn wake(&self, rec: &SandboxRecord) -> bool {
        let id = rec.id.clone();
        let this = self.clone();
        let woken = tokio::time::timeout(crate::idle::WAKE_WAIT, async move {
            loop {
                match this.get(&id).map(|r| r.state) {
                    Some(SandboxState::Running) => return true,
                    // (a resume counts as activity: `freeze_for`)
                    Some(SandboxState::Paused) => {
                        if let Err(e) = this.freeze_for(&id, false, "wake_on_access").await {
                            tracing::debug!(sandbox_id = %id, error = %e, "wake on access");
                        }
                    }
                    // Pausing or resuming: its operation holds the lock; look again shortly.
                    Some(SandboxState::Pausing) | Some(SandboxState::Resuming) => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    _ => return false,
                }
            }
        });
        // The resume runs on if the wait gives up (its client is answered 503 and retries).
        match tokio::spawn(woken).await {
            Ok(Ok(running)) => running,
            _ => false,
        }
    }

    /// Background loop: pauses Running sandboxes whose idle policy's timeout has passed with
    /// nothing under way (after asking their activity probe, if they have one).
    pub(super) async fn idle_loop(self) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let running =
                self.select(|r| r.state == SandboxState::Running && r.lifecycle_hooks.is_some());
            for rec in running {
                let Some(policy) = Self::idle_policy(&rec) else {
                    continue;
                };
                let Some(timeout) = policy.idle_timeout_seconds else {
                    continue;
                };
                let Some(idle) = self.inner.activity.idle_for(&rec.id, self.inner.started) else {
                    continue;
                };
                if idle < Duration::from_secs(timeout) {
                    continue;
                }
                if let Some(probe) = &policy.probe {
                    if self.probe_active(&rec, probe).await {
                        self.inner.activity.touch(&rec.id);
                        continue;
                    }
                }
                let this = self.clone();
                tokio::spawn(async move {
                    match this.freeze_for(&rec.id, true, "idle_timeout").await {
                        Ok(()) => {
                            tracing::info!(sandbox_id = %rec.id, idle_s = idle.as_secs(), "paused for idleness")
                        }
                        Err(e) => {
                            tracing::debug!(sandbox_id = %rec.id, error = %e, "idle pause skipped")
                        }
                    }
                });
            }
        }
    }

    /// Asks the sandbox's activity probe whether it is busy.
    pub(super) async fn probe_active(
        &self,
        rec: &SandboxRecord,
        probe: &crate::idle::Probe,
    ) -> bool {
        let endpoint = self.endpoint_of(rec);
        let path = format!("/proxy/{}{}", probe.port, probe.path);
        match tokio::time::timeout(
            Duration::from_secs(probe.timeout_seconds),
            crate::sandbox_files::get(&endpoint, &path),
        )
        .await
        {
            Ok(Ok((status, body))) => crate::idle::probe_says_active(status, &body),
            _ => false,
        }
    }

    /// The last runs of a sandbox's lifecycle hooks, one line each.
    pub fn hook_runs(&self, id: &str) -> String {
        self.inner.hook_runs.text(id)
    }
}
