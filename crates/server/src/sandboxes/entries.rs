//! The registry's entries: one per sandbox, its record (persisted in the journal on every change)
//! and its recent state changes, and the lookups every other room of the registry goes through.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex as StdMutex};

use chrono::{DateTime, Utc};
use warren_api::lifecycle::SandboxState;
use warren_core::{Runtime, RuntimeError};
use warren_image::ImageStore;
use warren_store::SandboxRecord;

use super::{lock, moved, Sandboxes};
use crate::error::SandboxError;
use crate::execd_conns::{ExecdConns, ExecdEndpoint};
use crate::timeline::Timeline;

pub(super) struct Entry {
    /// The current record; held only for short, non-async sections.
    pub(super) record: StdMutex<SandboxRecord>,
    /// Serialises lifecycle operations on one sandbox (create, delete, pause, …).
    pub(super) op: Arc<tokio::sync::Mutex<()>>,
    /// Its state changes since this server started (diagnostics), the newest [`MAX_EVENTS`]. In
    /// memory only: the journal keeps the record, not its history.
    pub(super) events: StdMutex<Events>,
    /// Its flight recorder (see `timeline`): kept as long as the entry is.
    pub(super) timeline: Arc<Timeline>,
}

/// State changes kept per sandbox.
const MAX_EVENTS: usize = 200;

/// One state change of a sandbox, as diagnostics show it.
#[derive(Debug, Clone)]
pub struct LifecycleEvent {
    pub at: DateTime<Utc>,
    pub state: SandboxState,
    pub reason: Option<String>,
    pub message: Option<String>,
}

#[derive(Debug, Default, Clone)]
pub struct Events {
    pub list: VecDeque<LifecycleEvent>,
    /// Older events dropped past [`MAX_EVENTS`].
    pub dropped: usize,
    /// The record was read back from the journal at start: what happened before is not known.
    pub recovered: bool,
}

impl Events {
    pub(super) fn push(&mut self, rec: &SandboxRecord) {
        if self.list.len() == MAX_EVENTS {
            self.list.pop_front();
            self.dropped += 1;
        }
        self.list.push_back(LifecycleEvent {
            at: rec.last_transition_at,
            state: rec.state,
            reason: rec.reason.clone(),
            message: rec.message.clone(),
        });
    }
}

impl Entry {
    pub(super) fn new(
        rec: &SandboxRecord,
        recovered: bool,
        timeline: Arc<crate::timeline::Settings>,
    ) -> Self {
        let mut events = Events {
            recovered,
            ..Events::default()
        };
        events.push(rec);
        let timeline = Arc::new(Timeline::new(timeline));
        if recovered {
            // What happened before this server started is not known here.
            timeline.record(
                "recovered",
                serde_json::json!({"state": rec.state.as_str()}),
            );
        } else {
            timeline.record(
                "created",
                serde_json::json!({
                    "image": rec.image,
                    "snapshotId": rec.snapshot_id,
                    "pool": rec.warm_pool.as_ref().or(rec.pool_ref.as_ref()),
                }),
            );
            record_state(&timeline, rec);
        }
        if rec.state.is_terminal() {
            timeline.end();
        }
        Entry {
            record: StdMutex::new(rec.clone()),
            op: Arc::new(tokio::sync::Mutex::new(())),
            events: StdMutex::new(events),
            timeline,
        }
    }
}

/// A state change, on the sandbox's timeline.
fn record_state(timeline: &Timeline, rec: &SandboxRecord) {
    timeline.record(
        "state",
        serde_json::json!({
            "state": rec.state.as_str(),
            "reason": rec.reason,
            "message": rec.message,
        }),
    );
}

impl Sandboxes {
    pub fn runtime(&self) -> &Arc<dyn Runtime> {
        &self.inner.runtime
    }

    pub fn execd_conns(&self) -> &Arc<ExecdConns> {
        &self.inner.execd_conns
    }

    /// Whether a connection to `id`'s execd may be parked: the sandbox is up (paused ones keep theirs).
    /// Every way out of these states calls `ExecdConns::forget` after the record moved on.
    pub fn execd_live(&self, id: &str) -> impl FnOnce() -> bool + Send + 'static {
        let this = self.clone();
        let id = id.to_string();
        move || {
            this.get(&id).is_some_and(|r| {
                matches!(
                    r.state,
                    SandboxState::Running
                        | SandboxState::Pausing
                        | SandboxState::Paused
                        | SandboxState::Resuming
                )
            })
        }
    }

    pub(super) fn entry(&self, id: &str) -> Option<Arc<Entry>> {
        self.inner
            .entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    pub fn images(&self) -> &Arc<ImageStore> {
        &self.inner.images
    }

    pub fn get(&self, id: &str) -> Option<SandboxRecord> {
        self.entry(id).map(|e| lock(&e.record).clone())
    }

    /// The state changes of sandbox `id` this server has seen.
    pub fn events(&self, id: &str) -> Option<Events> {
        self.entry(id).map(|e| lock(&e.events).clone())
    }

    /// Sandbox `id`'s flight recorder, and its tenant, until the retention period after its end:
    /// with its record, or after a user's delete forgot the record.
    pub fn timeline_of(&self, id: &str) -> Option<(String, Arc<Timeline>)> {
        match self.entry(id) {
            Some(e) => Some((lock(&e.record).tenant.clone(), e.timeline.clone())),
            None => self.inner.kept_timelines.get(id),
        }
    }

    /// Sandbox `id`'s flight recorder, while its record is kept (for recording into).
    pub fn timeline(&self, id: &str) -> Option<Arc<Timeline>> {
        self.entry(id).map(|e| e.timeline.clone())
    }

    /// Where and how the server reaches sandbox `id`'s execd (`None`: no such sandbox).
    pub fn execd_endpoint(&self, id: &str) -> Option<ExecdEndpoint> {
        let entry = self.entry(id)?;
        let record = lock(&entry.record);
        Some(self.endpoint_of(&record))
    }

    /// Where and how the server reaches the execd of the sandbox `record` is of: the runtime's
    /// address, with the credential of the record's secret where the transport needs it.
    pub fn endpoint_of(&self, record: &SandboxRecord) -> ExecdEndpoint {
        ExecdEndpoint::new(
            self.inner
                .runtime
                .execd_address(&record.id, &record.runtime_state),
            &record.token,
        )
    }

    /// The state of sandbox `id`, without copying its record (pools look at every warm one of
    /// theirs each time a sandbox is claimed or ends).
    pub fn state(&self, id: &str) -> Option<SandboxState> {
        self.entry(id).map(|e| lock(&e.record).state)
    }

    /// Every record, newest first.
    pub fn all(&self) -> Vec<SandboxRecord> {
        let mut records = self.select(|_| true);
        records.sort_by(|a, b| {
            b.created_at
                .cmp(&a.created_at)
                .then_with(|| a.id.cmp(&b.id))
        });
        records
    }

    /// `tenant`'s sandboxes that have not ended (warm pool ones too): what its quotas count.
    pub fn live_of(&self, tenant: &str) -> Vec<SandboxRecord> {
        self.select(|r| r.tenant == tenant && !r.state.is_terminal())
    }

    /// The records `pred` accepts, in no order; only those are copied. Background loops that look
    /// at every sandbox often (expiry, pool refills) use this rather than `all`, whose copy and sort
    /// of every record made each look cost in proportion to the sandboxes alive.
    pub fn select(&self, pred: impl Fn(&SandboxRecord) -> bool) -> Vec<SandboxRecord> {
        self.entries()
            .iter()
            .filter_map(|e| {
                let rec = lock(&e.record);
                pred(&rec).then(|| rec.clone())
            })
            .collect()
    }

    /// How many records `pred` accepts, copying none.
    pub fn count(&self, pred: impl Fn(&SandboxRecord) -> bool) -> usize {
        self.entries()
            .iter()
            .filter(|e| pred(&lock(&e.record)))
            .count()
    }

    /// How many records are in each state, in one pass (the order of [`SandboxState::ALL`]).
    pub fn count_by_state(&self) -> [usize; SandboxState::ALL.len()] {
        let mut counts = [0; SandboxState::ALL.len()];
        for e in self.entries() {
            let state = lock(&e.record).state;
            if let Some(i) = SandboxState::ALL.iter().position(|s| *s == state) {
                counts[i] += 1;
            }
        }
        counts
    }

    /// The entries, taken out of the map's lock before any record is locked.
    pub(super) fn entries(&self) -> Vec<Arc<Entry>> {
        self.inner
            .entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub(super) fn persist(&self, record: &SandboxRecord) {
        self.inner.records.persist(record);
    }

    pub(super) fn update(
        &self,
        entry: &Entry,
        f: impl FnOnce(&mut SandboxRecord),
    ) -> SandboxRecord {
        let (snapshot, ended) = {
            let mut rec = lock(&entry.record);
            let was_terminal = rec.state.is_terminal();
            let was = (rec.state, rec.last_transition_at);
            f(&mut rec);
            if (rec.state, rec.last_transition_at) != was {
                lock(&entry.events).push(&rec);
                record_state(&entry.timeline, &rec);
                if rec.state.is_terminal() {
                    entry.timeline.end();
                } else {
                    // A delete that failed is tried again: the timeline goes on.
                    entry.timeline.reopen();
                }
            }
            (rec.clone(), !was_terminal && rec.state.is_terminal())
        };
        self.persist(&snapshot);
        if ended && (snapshot.pool_ref.is_some() || snapshot.warm_pool.is_some()) {
            // However it ended (deleted, expired, died; claimed or still warm), its pool may make
            // another now.
            self.inner.pool_sandbox_ended.notify_waiters();
        }
        snapshot
    }

    /// Rings whenever a sandbox allocated from a pool ends (pools wait on it to refill at once).
    pub fn pool_sandbox_ended(&self) -> &tokio::sync::Notify {
        &self.inner.pool_sandbox_ended
    }

    /// What every verb on an existing sandbox starts with: its entry (404 if unknown), its
    /// operation lock, held until the returned [`Held`] is dropped, and its record once the lock
    /// is held. A user's delete that held the lock before may have forgotten the sandbox: what
    /// waited behind it answers as for any unknown sandbox (404), not with the Terminated state of
    /// a record nobody can see any more.
    pub(super) async fn hold(&self, id: &str) -> Result<Held, SandboxError> {
        let entry = self.entry(id).ok_or_else(|| SandboxError::not_found(id))?;
        let op = entry.op.clone().lock_owned().await;
        match self.entry(id) {
            Some(current) if Arc::ptr_eq(&current, &entry) => {}
            _ => return Err(SandboxError::not_found(id)),
        }
        let rec = lock(&entry.record).clone();
        Ok(Held {
            entry,
            rec,
            _op: op,
        })
    }

    /// The move every verb that drives the runtime makes on a held sandbox: to `via` (with
    /// `reason`) while `call` runs, then where `settle` says from its result — on to a state, or
    /// back to where the sandbox was (its reason and message as they were) when nothing happened.
    /// `settle` also gives the verb's answer.
    pub(super) async fn step<T, U>(
        &self,
        held: &Held,
        via: SandboxState,
        reason: Option<&str>,
        call: impl std::future::Future<Output = Result<T, RuntimeError>>,
        settle: impl FnOnce(Result<T, RuntimeError>) -> (Settle, Result<U, SandboxError>),
    ) -> Result<U, SandboxError> {
        self.update(&held.entry, |r| moved(r, via, reason, None));
        let (to, answer) = settle(call.await);
        match to {
            Settle::To {
                state,
                reason,
                message,
            } => self.update(&held.entry, |r| moved(r, state, reason.as_deref(), message)),
            Settle::Back => self.update(&held.entry, |r| r.take_back(&held.rec)),
        };
        answer
    }

    /// Drops an ended sandbox's record: list and get no longer know it.
    /// Drops the deleted sandboxes' timelines whose retention ended (the expiry loop).
    pub(super) fn prune_timelines(&self) {
        self.inner.kept_timelines.prune();
    }

    pub(super) fn forget(&self, id: &str) {
        if let Some(e) = self.entry(id) {
            // Kept until the retention period after its end, when the record would have gone.
            let (tenant, ended) = {
                let r = lock(&e.record);
                (r.tenant.clone(), r.last_transition_at)
            };
            let until = ended + self.inner.retention;
            // Forgotten (a record that never started is too): no more events come.
            e.timeline.end();
            self.inner
                .kept_timelines
                .keep(id, &tenant, e.timeline.clone(), until);
        }
        self.inner.hook_runs.forget(id);
        self.inner.activity.forget(id);
        self.inner
            .entries
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.inner.records.remove(id);
    }
}

/// A sandbox a verb holds (see [`Sandboxes::hold`]): no other verb acts on it meanwhile.
pub(super) struct Held {
    pub(super) entry: Arc<Entry>,
    /// The record as it was when the lock was taken.
    pub(super) rec: SandboxRecord,
    _op: tokio::sync::OwnedMutexGuard<()>,
}

/// Where a [`Sandboxes::step`] leaves the sandbox once its call has answered.
pub(super) enum Settle {
    To {
        state: SandboxState,
        reason: Option<String>,
        message: Option<String>,
    },
    /// Back where it was: the call changed nothing.
    Back,
}

impl Settle {
    pub(super) fn to(state: SandboxState, reason: &str) -> Self {
        Self::To {
            state,
            reason: Some(reason.to_owned()),
            message: None,
        }
    }
}
