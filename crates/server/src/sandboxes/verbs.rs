//! The lifecycle verbs on a sandbox that exists: delete, pause and resume, claim from a pool,
//! renew, and metadata.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use warren_api::lifecycle::SandboxState;
use warren_api::ErrorCode;
use warren_core::RuntimeError;
use warren_store::SandboxRecord;

use super::entries::Settle;
use super::{lock, moved, Sandboxes, REASON_DELETE_FAILED, REASON_USER_DELETE};
use crate::error::{ErrorKind, SandboxError};

impl Sandboxes {
    /// Kills a sandbox. Its record is kept as Terminated with `reason` for the retention period,
    /// except after a user's delete, which forgets it at once.
    pub async fn delete(&self, id: &str, reason: &str) -> Result<(), SandboxError> {
        let held = self.hold(id).await?;
        let rec = held.rec.clone();
        // A sandbox whose delete failed still holds what the runtime made: a delete tries again.
        if rec.state.is_terminal() && rec.reason.as_deref() != Some(REASON_DELETE_FAILED) {
            if reason == REASON_USER_DELETE {
                // Ended on its own and still listed: what it held went when it ended; a user's
                // delete takes its record out of the list too (204, as the reference answers).
                self.forget(id);
                return Ok(());
            }
            return Err(SandboxError::new(
                ErrorKind::NotFound,
                ErrorCode::SandboxNotFound,
                format!("sandbox {id} is already {}", rec.state.as_str()),
            ));
        }
        let mut stopping = rec.clone();
        moved(&mut stopping, SandboxState::Stopping, Some(reason), None);
        match self.share(&stopping).await {
            // Gone already (removed by another replica, or behind Warren's back): still removed.
            Err(e) if e.kind != ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let destroyed = async {
            self.inner.execd_conns.forget(id);
            let result = self.inner.runtime.destroy(id, &rec.runtime_state).await;
            if let Err(RuntimeError::Unavailable(_)) = &result {
                // Nothing was removed: the sandbox stays as it was, and the delete can be retried.
                if let Err(e) = self.share(&rec).await {
                    tracing::warn!(sandbox_id = %id, error = %e, "could not take back the record of a delete that failed");
                }
            } else {
                let _ = self.inner.images.release(id);
                self.unlink(id).await;
            }
            result
        };
        self.step(
            &held,
            SandboxState::Stopping,
            Some(reason),
            destroyed,
            |result| match result {
                Ok(()) => (Settle::to(SandboxState::Terminated, reason), Ok(())),
                Err(e @ RuntimeError::Unavailable(_)) => (
                    Settle::Back,
                    Err(SandboxError::from_runtime("deleting the sandbox", e)),
                ),
                Err(e) => {
                    let err = SandboxError::from_runtime("deleting the sandbox", e);
                    let failed = Settle::To {
                        state: SandboxState::Failed,
                        reason: Some(REASON_DELETE_FAILED.to_owned()),
                        message: Some(err.public_message()),
                    };
                    (failed, Err(err))
                }
            },
        )
        .await?;
        if reason == REASON_USER_DELETE {
            // A deleted sandbox is gone at once, as in the reference: clients that count their
            // sandboxes by a metadata tag (the official client-side pools) wait for the list to
            // shrink. Sandboxes that ended on their own stay visible for the retention period.
            self.forget(id);
        }
        Ok(())
    }

    pub async fn pause(&self, id: &str) -> Result<(), SandboxError> {
        self.freeze_for(id, true, "user_pause").await
    }

    pub async fn resume(&self, id: &str) -> Result<(), SandboxError> {
        self.freeze_for(id, false, "user_resume").await
    }

    /// Pause (`true`) or resume, for `reason` (a user's call, an idle timeout, a wake on access):
    /// Running → Pausing → Paused, or Paused → Resuming → Running; on a runtime error the sandbox
    /// stays where it was.
    pub(super) async fn freeze_for(
        &self,
        id: &str,
        pause: bool,
        reason: &str,
    ) -> Result<(), SandboxError> {
        let (from, via, to, code, context) = if pause {
            (
                SandboxState::Running,
                SandboxState::Pausing,
                SandboxState::Paused,
                ErrorCode::SandboxNotRunning,
                "pausing the sandbox",
            )
        } else {
            (
                SandboxState::Paused,
                SandboxState::Resuming,
                SandboxState::Running,
                ErrorCode::SandboxNotPaused,
                "resuming the sandbox",
            )
        };
        let held = self.hold(id).await?;
        let rec = &held.rec;
        if rec.state != from {
            return Err(SandboxError::conflict(
                code,
                format!(
                    "sandbox {id} is {}, not {}",
                    rec.state.as_str(),
                    from.as_str()
                ),
            ));
        }
        let call = async {
            if pause {
                self.inner.runtime.pause(id, &rec.runtime_state).await
            } else {
                self.inner.runtime.resume(id, &rec.runtime_state).await
            }
        };
        self.step(&held, via, None, call, |result| match result {
            Ok(()) => {
                if !pause {
                    // A resumed sandbox is idle from its resume.
                    self.inner.activity.touch(id);
                }
                (Settle::to(to, reason), Ok(()))
            }
            Err(e) => (Settle::Back, Err(SandboxError::from_runtime(context, e))),
        })
        .await
    }

    /// Gives a sandbox made ahead of need the CPU share every sandbox has.
    pub(super) fn promote(&self, id: &str) {
        if let Err(e) = self.inner.runtime.promote(id) {
            // It still works, only with less CPU while the machine is busy.
            tracing::warn!(sandbox_id = %id, error = %e, "giving a warm sandbox its CPU share failed");
        }
    }

    /// Promotes the warm sandboxes of `pool` still being made: creates wait for them now.
    pub fn promote_pending(&self, pool: &str) {
        let pending: Vec<String> = self
            .inner
            .entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(|e| {
                let r = lock(&e.record);
                (r.state == SandboxState::Pending && r.warm_pool.as_deref() == Some(pool))
                    .then(|| r.id.clone())
            })
            .collect();
        for id in pending {
            self.promote(&id);
        }
    }

    /// Hands warm sandbox `id` of `pool` to a client: it becomes visible, with the client's
    /// metadata, extensions and expiry. `None` if it is no longer a usable warm sandbox (it died, or
    /// someone else took it).
    pub async fn claim(
        &self,
        id: &str,
        pool: &str,
        metadata: BTreeMap<String, String>,
        extensions: BTreeMap<String, String>,
        timeout_seconds: Option<i64>,
    ) -> Option<SandboxRecord> {
        let entry = self.entry(id)?;
        let _op = entry.op.lock().await;
        let rec = lock(&entry.record).clone();
        if rec.state != SandboxState::Running || rec.warm_pool.as_deref() != Some(pool) {
            return None;
        }
        let now = Utc::now();
        let mut claimed = rec.clone();
        claimed.warm_pool = None;
        claimed.pool_ref = Some(pool.to_owned());
        claimed.metadata = metadata;
        claimed.extensions = extensions;
        claimed.expires_at = timeout_seconds.map(|t| now + chrono::Duration::seconds(t));
        if !self.claim_shared(&entry, &rec, &claimed).await {
            // Another replica's now: its record comes through the feed.
            return None;
        }
        self.promote(id);
        Some(self.update(&entry, |r| {
            r.warm_pool = None;
            r.pool_ref = claimed.pool_ref;
            r.metadata = claimed.metadata;
            r.extensions = claimed.extensions;
            r.expires_at = claimed.expires_at;
        }))
    }

    pub async fn renew(
        &self,
        id: &str,
        expires_at: DateTime<Utc>,
    ) -> Result<DateTime<Utc>, SandboxError> {
        self.renew_to(id, expires_at, false).await
    }

    /// Renew on access: like [`Sandboxes::renew`], but only ever later (a renew that landed
    /// meanwhile is not undone).
    pub async fn extend(
        &self,
        id: &str,
        expires_at: DateTime<Utc>,
    ) -> Result<DateTime<Utc>, SandboxError> {
        self.renew_to(id, expires_at, true).await
    }

    pub(super) async fn renew_to(
        &self,
        id: &str,
        expires_at: DateTime<Utc>,
        only_later: bool,
    ) -> Result<DateTime<Utc>, SandboxError> {
        let held = self.hold(id).await?;
        let rec = held.rec.clone();
        if rec.state.is_terminal() || rec.state == SandboxState::Stopping {
            return Err(SandboxError::conflict(
                ErrorCode::InvalidState,
                format!("sandbox {id} is {}", rec.state.as_str()),
            ));
        }
        if rec.expires_at.is_none() {
            return Err(SandboxError::conflict(
                ErrorCode::InvalidExpiration,
                format!("sandbox {id} has no expiry (manual cleanup)"),
            ));
        }
        if expires_at <= Utc::now() {
            return Err(SandboxError::bad_request(
                ErrorCode::InvalidExpiration,
                "expiresAt must be in the future",
            ));
        }
        if only_later && rec.expires_at >= Some(expires_at) {
            return Ok(rec.expires_at.unwrap_or(expires_at));
        }
        let mut renewed = rec;
        renewed.expires_at = Some(expires_at);
        self.share(&renewed).await?;
        self.update(&held.entry, |r| r.expires_at = Some(expires_at));
        Ok(expires_at)
    }

    pub async fn patch_metadata(
        &self,
        id: &str,
        patch: Vec<(String, Option<String>)>,
    ) -> Result<SandboxRecord, SandboxError> {
        let held = self.hold(id).await?;
        let entry = &held.entry;
        if held.rec.state.is_terminal() {
            return Err(SandboxError::conflict(
                ErrorCode::InvalidState,
                format!("sandbox {id} has ended"),
            ));
        }
        let mut patched = lock(&entry.record).clone();
        for (k, v) in patch {
            match v {
                Some(v) => patched.metadata.insert(k, v),
                None => patched.metadata.remove(&k),
            };
        }
        self.share(&patched).await?;
        Ok(self.update(entry, |r| r.metadata = patched.metadata))
    }
}
