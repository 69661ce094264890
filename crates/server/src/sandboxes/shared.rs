//! Records shared by replicas: with a runtime whose backend keeps the records
//! ([`warren_core::SharedRecords`]: the Kubernetes runtime with a shared key), every replica serves
//! every sandbox. The records live with the sandboxes, not in the journal:
//!
//! - A create hands the runtime the record with the sandbox (no write of its own); a renew, a
//!   metadata patch and a delete write the changed record there *before* this server takes it, so
//!   a replica asked next sees what this one answered.
//! - Each sandbox's secret is derived from the key the replicas share, so every replica reaches
//!   its execd and checks its endpoint tokens, and no secret is stored.
//! - A follower reads every change in the backend's order (one task, one feed): it adopts other
//!   replicas' sandboxes, takes their renewals and metadata, and ends sandboxes — whichever replica
//!   deleted them, or nobody did. It, not a watcher per sandbox, ends them: it has seen a delete's
//!   record (Stopping, with the delete's reason) before the sandbox's removal, which separate
//!   watchers could see in either order.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;
use warren_api::lifecycle::SandboxState;
use warren_core::{ExitInfo, RecordEvent, SharedPhase, SharedRecords};
use warren_store::SandboxRecord;

use super::watch::ended_by_itself;
use super::{lock, moved, Entry, Sandboxes, REASON_USER_DELETE};
use crate::error::SandboxError;

/// How long a start waits for the backend's first list before it serves without it (the
/// follower adopts what it lists later).
const SYNC_WAIT: Duration = Duration::from_secs(30);
/// How soon a change that found its sandbox in an operation is tried again.
const RETRY: Duration = Duration::from_millis(50);
/// How long another replica's delete may take before this one removes the sandbox itself (the
/// other may have stopped between marking the record and removing the sandbox).
const DELETE_GRACE: Duration = Duration::from_secs(30);

/// Record fields that stay with each server: the secret (derived), how its runtime reaches the
/// sandbox (the backend's to say), and a host network link (no shared backend has one).
const LOCAL_FIELDS: [&str; 3] = ["token", "runtime_state", "network_link"];

/// The record as the backend keeps it.
pub(super) fn wire_form(rec: &SandboxRecord) -> Value {
    let mut v = serde_json::to_value(rec).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        for f in LOCAL_FIELDS {
            o.remove(f);
        }
    }
    v
}

/// The record of sandbox `id` from what the backend keeps (`None`: not a record of `id`).
fn from_wire(
    shared: &dyn SharedRecords,
    id: &str,
    record: &Value,
    state: &Value,
) -> Option<SandboxRecord> {
    let mut v = record.clone();
    let o = v.as_object_mut()?;
    o.insert("token".into(), Value::String(shared.secret(id)));
    o.insert("runtime_state".into(), state.clone());
    let rec: SandboxRecord = serde_json::from_value(v).ok()?;
    (rec.id == id).then_some(rec)
}

impl Sandboxes {
    /// Whether the records are shared with other replicas.
    pub fn shares_records(&self) -> bool {
        self.inner.records.feed().is_some()
    }

    /// Whether this server does the common chores (expiring sandboxes, making the pools' warm
    /// sandboxes): always, unless it shares its sandboxes with other replicas and another leads.
    pub fn leads(&self) -> bool {
        self.inner.records.leads()
    }

    /// With shared records: hands warm sandbox `rec` (claimed as `claimed`) over only if no other
    /// replica claimed it first, by a compare-and-swap on its record. Without: always. A sandbox
    /// another replica took is no longer warm here from now on (its record follows on the feed),
    /// so the pool does not offer it again meanwhile.
    pub(super) async fn claim_shared(
        &self,
        entry: &Entry,
        rec: &SandboxRecord,
        claimed: &SandboxRecord,
    ) -> bool {
        match self.inner.records.claim(rec, claimed).await {
            Ok(true) => true,
            Ok(false) => {
                self.update(entry, |r| r.warm_pool = None);
                false
            }
            Err(e) => {
                tracing::warn!(sandbox_id = %rec.id, error = %e, "claiming a warm sandbox failed; taking another");
                false
            }
        }
    }

    /// With shared records: writes `rec` where the other replicas read it. Called before this
    /// server takes `rec` as the sandbox's record, so a failure changes nothing.
    pub(super) async fn share(&self, rec: &SandboxRecord) -> Result<(), SandboxError> {
        self.inner.records.share(rec).await
    }

    /// Starts following the shared records and waits (within [`SYNC_WAIT`]) until those there now
    /// are this server's too.
    pub(super) async fn follow_shared(&self, shared: Arc<dyn SharedRecords>) {
        let (synced, mut first_list) = tokio::sync::watch::channel(false);
        let this = self.clone();
        // Run again should it panic: a new feed starts from every record there, which the
        // follower takes as it takes changes. Detached: it follows for as long as the server runs.
        let follower = crate::supervise::supervised("shared records", move || {
            Follower {
                sandboxes: this.clone(),
                shared: shared.clone(),
                deleting: HashMap::new(),
                busy: HashMap::new(),
                synced: synced.clone(),
            }
            .run()
        });
        drop(follower);
        if tokio::time::timeout(SYNC_WAIT, first_list.wait_for(|s| *s))
            .await
            .is_err()
        {
            tracing::warn!("the shared records were not listed in time; serving, and adopting them as they come");
        }
    }
}

struct Follower {
    sandboxes: Sandboxes,
    shared: Arc<dyn SharedRecords>,
    /// The sandboxes whose latest record in the backend says a delete began, with its reason:
    /// what their removal is read against, whatever this server has taken of that record yet.
    /// (Only those: a copy of every record would cost each replica a kilobyte or more per sandbox.)
    deleting: HashMap<String, String>,
    /// Changes whose sandbox was in an operation of this server's (its create, a delete): the
    /// latest per sandbox, tried again shortly. The operation may have made them moot.
    busy: HashMap<String, RecordEvent>,
    synced: tokio::sync::watch::Sender<bool>,
}

impl Follower {
    async fn run(mut self) {
        let mut feed = self.shared.follow();
        loop {
            let event = if self.busy.is_empty() {
                feed.next().await
            } else {
                match tokio::time::timeout(RETRY, feed.next()).await {
                    Ok(event) => event,
                    Err(_) => {
                        for (_, event) in std::mem::take(&mut self.busy) {
                            self.take(event);
                        }
                        continue;
                    }
                }
            };
            let Some(event) = event else { return };
            match &event {
                RecordEvent::Synced => {
                    self.synced.send_replace(true);
                    continue;
                }
                RecordEvent::Seen {
                    id,
                    record: Some(r),
                    ..
                } => {
                    if r["state"] == "Stopping" {
                        let reason = r["reason"].as_str().unwrap_or(REASON_USER_DELETE);
                        self.deleting.insert(id.clone(), reason.to_string());
                    } else {
                        self.deleting.remove(id);
                    }
                }
                _ => {}
            }
            self.take(event);
        }
    }

    /// Applies one change, or keeps it for later when its sandbox is in an operation.
    fn take(&mut self, event: RecordEvent) {
        let id = match &event {
            RecordEvent::Seen { id, .. } | RecordEvent::Gone { id } => id.clone(),
            RecordEvent::Synced => return,
        };
        // A change kept for later is outdone by this one: replayed after it, an older view could
        // bring back a sandbox this one ended.
        self.busy.remove(&id);
        let Some(entry) = self.sandboxes.entry(&id) else {
            if let RecordEvent::Seen {
                record: Some(record),
                state,
                phase,
                ..
            } = &event
            {
                self.adopt(&id, record, state, phase);
            }
            if matches!(event, RecordEvent::Gone { .. }) {
                self.deleting.remove(&id);
            }
            return;
        };
        // An operation of this server's holds the sandbox (its create, a delete, a renew): what
        // it does comes first, and the change is looked at again after.
        let Ok(_op) = entry.op.try_lock() else {
            self.busy.insert(id, event);
            return;
        };
        let deleted = self.deleting.get(&id).cloned();
        match event {
            RecordEvent::Seen {
                record,
                state,
                phase,
                ..
            } => {
                // The latest record there is: a change kept for later was outdone by any newer.
                if let Some(theirs) = record
                    .as_ref()
                    .and_then(|r| from_wire(&*self.shared, &id, r, &Value::Null))
                {
                    self.merge(&entry, &theirs);
                }
                match phase {
                    SharedPhase::Running => self.running(&entry, state),
                    SharedPhase::Ended(exit) => self.ended(&id, &entry, deleted, &exit),
                    SharedPhase::Starting => {}
                }
            }
            RecordEvent::Gone { .. } => {
                let exit = ExitInfo {
                    code: None,
                    signal: None,
                    vanished: true,
                    detail: None,
                };
                self.ended(&id, &entry, deleted, &exit);
                self.deleting.remove(&id);
            }
            RecordEvent::Synced => {}
        }
    }

    /// Takes on another replica's sandbox (or this server's own, after a restart).
    fn adopt(&self, id: &str, record: &Value, state: &Value, phase: &SharedPhase) {
        let Some(mut rec) = from_wire(&*self.shared, id, record, state) else {
            tracing::warn!(sandbox_id = %id, "a sandbox's shared record is unreadable; not adopted");
            return;
        };
        // Being removed, or ended: nothing to serve, but something to remove should whoever
        // began it be gone (a replica stopped between marking a delete and making it, a Pod that
        // failed while no replica ran). Removing twice is harmless.
        let leftover = match phase {
            SharedPhase::Ended(exit) => !exit.vanished,
            _ => rec.state == SandboxState::Stopping,
        };
        if leftover {
            self.remove_in_background(id, state.clone(), Duration::ZERO);
        }
        if leftover || rec.state.is_terminal() || matches!(phase, SharedPhase::Ended(_)) {
            return;
        }
        let running = *phase == SharedPhase::Running;
        if running && rec.state != SandboxState::Running {
            moved(&mut rec, SandboxState::Running, Some("ready"), None);
        } else if !running {
            // Another replica's create in flight: Pending here as there.
            rec.state = SandboxState::Pending;
        }
        let warm_and_running = running && rec.warm_pool.is_some();
        let entry = Arc::new(Entry::new(
            &rec,
            true,
            self.sandboxes.inner.timeline.clone(),
        ));
        self.sandboxes
            .inner
            .entries
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id.to_string())
            .or_insert(entry);
        if warm_and_running {
            // Another replica's warm sandbox, this one's to claim too.
            self.sandboxes.inner.pool_sandbox_ended.notify_waiters();
        }
    }

    /// Takes another replica's changes to what a client may change: expiry, metadata, the egress
    /// policy, and a delete it began.
    fn merge(&self, entry: &Entry, theirs: &SandboxRecord) {
        let ours = lock(&entry.record).clone();
        if ours.state.is_terminal() || ours.state == SandboxState::Stopping {
            return;
        }
        let same = ours.expires_at == theirs.expires_at
            && ours.metadata == theirs.metadata
            && ours.extensions == theirs.extensions
            && ours.network_policy == theirs.network_policy
            && ours.warm_pool == theirs.warm_pool
            && ours.pool_ref == theirs.pool_ref;
        let deleting = theirs.state == SandboxState::Stopping;
        if same && !deleting {
            return;
        }
        self.sandboxes.update(entry, |r| {
            r.expires_at = theirs.expires_at;
            r.metadata = theirs.metadata.clone();
            r.extensions = theirs.extensions.clone();
            r.network_policy = theirs.network_policy.clone();
            // Claimed by another replica: no longer warm here.
            r.warm_pool = theirs.warm_pool.clone();
            r.pool_ref = theirs.pool_ref.clone();
            if deleting {
                moved(r, SandboxState::Stopping, theirs.reason.as_deref(), None);
            }
        });
        if deleting {
            self.sandboxes.inner.execd_conns.forget(&ours.id);
            // The replica deleting it removes it within moments; should it stop before, this one
            // does (the removal then ends it here as there).
            self.remove_in_background(&ours.id, ours.runtime_state.clone(), DELETE_GRACE);
        }
        if ours.warm_pool != theirs.warm_pool {
            // Claimed by another replica: its pool has one fewer warm.
            self.sandboxes.inner.pool_sandbox_ended.notify_waiters();
        }
    }

    /// Removes sandbox `id` from the backend after `grace`, unless this server no longer knows it
    /// as being deleted by then.
    fn remove_in_background(&self, id: &str, state: Value, grace: Duration) {
        let sandboxes = self.sandboxes.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            let still = grace.is_zero()
                || sandboxes
                    .get(&id)
                    .is_some_and(|r| r.state == SandboxState::Stopping);
            if still {
                if let Err(e) = sandboxes.inner.runtime.destroy(&id, &state).await {
                    tracing::warn!(sandbox_id = %id, error = %e, "removing a sandbox left behind failed");
                }
            }
        });
    }

    /// Another replica's create is done.
    fn running(&self, entry: &Entry, state: Value) {
        if lock(&entry.record).state == SandboxState::Pending {
            let rec = self.sandboxes.update(entry, |r| {
                r.runtime_state = state;
                moved(r, SandboxState::Running, Some("ready"), None);
            });
            if rec.warm_pool.is_some() {
                self.sandboxes.inner.pool_sandbox_ended.notify_waiters();
            }
        }
    }

    /// The sandbox will run no more: removed by a replica's delete (`deleted`: the reason its latest
    /// record gives), or ended by itself.
    fn ended(&self, id: &str, entry: &Entry, deleted: Option<String>, exit: &ExitInfo) {
        let ours = lock(&entry.record).clone();
        if ours.state.is_terminal() {
            return;
        }
        let sandboxes = &self.sandboxes;
        sandboxes.inner.execd_conns.forget(id);
        if ours.state == SandboxState::Pending {
            // Another replica's create that failed: its caller was told, and no record is left.
            sandboxes.forget(id);
            return;
        }
        let deleted = deleted.or_else(|| {
            (ours.state == SandboxState::Stopping)
                .then(|| ours.reason.clone())
                .flatten()
        });
        if let Some(reason) = deleted {
            sandboxes.update(entry, |r| {
                moved(r, SandboxState::Terminated, Some(&reason), None)
            });
            if reason == REASON_USER_DELETE {
                sandboxes.forget(id);
            }
            return;
        }
        let (state, message) = ended_by_itself(exit);
        tracing::info!(sandbox_id = %id, %message, "sandbox ended by itself");
        if !exit.vanished {
            // Its Pod stays until someone removes it: every replica tries, the first one does.
            let runtime = sandboxes.inner.runtime.clone();
            let (id, runtime_state) = (id.to_string(), ours.runtime_state.clone());
            tokio::spawn(async move {
                if let Err(e) = runtime.destroy(&id, &runtime_state).await {
                    tracing::warn!(sandbox_id = %id, error = %e, "cleaning up an ended sandbox failed");
                }
            });
        }
        sandboxes.update(entry, |r| {
            moved(r, state, Some("process_exited"), Some(message))
        });
    }
}

#[cfg(test)]
mod tests;
