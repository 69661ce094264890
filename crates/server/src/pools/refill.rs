//! The task per pool that keeps it full: makes warm sandboxes while nobody waits, holds back
//! while claims come in quick succession, and replaces ones that died.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use warren_api::lifecycle::SandboxState;
use warren_store::SandboxRecord;

use super::{hold, Pool, Pools, REFILL_PARALLEL};
use crate::sandboxes::REASON_USER_DELETE;

impl Pools {
    /// Keeps the pool at `bufferMax` warm sandboxes, within `poolMax` in all.
    /// A pool's refill loop, run again should it panic (see `supervise`).
    pub(super) fn spawn_refill(&self, pool: Arc<Pool>) {
        let this = self.clone();
        crate::supervise::supervised("pool refill", move || {
            this.clone().refill_loop(pool.clone())
        });
    }

    async fn refill_loop(self, pool: Arc<Pool>) {
        let mut failures = 0u32;
        let sandboxes = self.inner.sandboxes.clone();
        while !pool.closed.load(Ordering::SeqCst) {
            // Registered before counting, so an allocated sandbox ending meanwhile is not missed.
            let ended = sandboxes.pool_sandbox_ended().notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let cap = pool.spec.capacity_spec;
            let (warm, creating) = self.live_warm_and_creating(&pool);
            let allocated = self.allocated(&pool.key) + pool.claiming.load(Ordering::SeqCst);
            let want = cap.buffer_max.min(cap.pool_max.saturating_sub(allocated));
            // With replicas, one makes the warm sandboxes (they all claim them): N replicas each
            // filling the pool would make N times what it wants.
            let makes = sandboxes.leads();
            if makes && warm + creating < want && creating < REFILL_PARALLEL {
                if let Some(until) = self.held_until(&pool, warm, want) {
                    // A claim's first command runs now; a waiting create or the hold's end wakes
                    // this up to look again.
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => {}
                        () = pool.refill.notified() => {}
                    }
                    continue;
                }
                let admitted = self.inner.quotas.admit(
                    &pool.tenant,
                    &pool.plan.limits,
                    &sandboxes.live_of(&pool.tenant),
                    true,
                    false,
                );
                let Ok(admission) = admitted else {
                    // At its tenant's quota: until a sandbox of the tenant ends (or a second).
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                        () = &mut ended => {}
                        () = pool.refill.notified() => {}
                    }
                    continue;
                };
                pool.creating.fetch_add(1, Ordering::SeqCst);
                let me = self.clone();
                let p = pool.clone();
                let made = tokio::spawn(async move {
                    let _admission = admission;
                    let out = me
                        .inner
                        .sandboxes
                        .create_in_background(p.plan.clone(), p.demand.background.clone())
                        .await;
                    match out {
                        Ok(rec) => {
                            // Looked at under the lock `delete` drains the list with, after it
                            // marks the pool closed: a sandbox is either drained or deleted here.
                            // It stops counting as being made only once it counts as warm, under
                            // the lock the refill loop counts both under: in between, the loop
                            // would see one too few and make a sandbox past `poolMax`.
                            let mut warm = p.warm.lock().unwrap_or_else(|e| e.into_inner());
                            if p.closed.load(Ordering::SeqCst) {
                                drop(warm);
                                let _ =
                                    me.inner.sandboxes.delete(&rec.id, REASON_USER_DELETE).await;
                                // Counted as being made until it is gone: `retire` waits for it.
                                p.creating.fetch_sub(1, Ordering::SeqCst);
                                return true;
                            }
                            p.creating.fetch_sub(1, Ordering::SeqCst);
                            // With replicas the list may have it already: the records' feed
                            // brings this replica's own warm sandboxes too (see
                            // `live_warm_and_creating`).
                            if !warm.contains(&rec.id) {
                                warm.push_back(rec.id);
                            }
                            drop(warm);
                            p.available.notify_one();
                            p.refill.notify_one();
                            true
                        }
                        Err(e) => {
                            p.creating.fetch_sub(1, Ordering::SeqCst);
                            tracing::warn!(pool = %p.spec.name, "making a warm sandbox failed: {e}");
                            p.refill.notify_one();
                            false
                        }
                    }
                });
                // Failures back off (a missing image must not spin); successes go on at once.
                if creating + 1 >= REFILL_PARALLEL || failures > 0 {
                    match made.await {
                        Ok(true) => failures = 0,
                        _ => {
                            failures += 1;
                            let backoff = Duration::from_millis(200 * u64::from(failures.min(25)));
                            tokio::time::sleep(backoff).await;
                        }
                    }
                }
                continue;
            }
            // Nothing to do until a claim, a finished create or the end of an allocated sandbox;
            // look again now and then all the same (a record changed outside the registry's
            // update, as at recovery).
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                tokio::select! {
                    () = pool.refill.notified() => {}
                    () = ended => {}
                }
            })
            .await;
        }
    }

    /// Until when a refill of `pool` waits for the claims just made (see [`CLAIM_HOLD`]); `None`
    /// when it may start now.
    fn held_until(&self, pool: &Pool, warm: u32, want: u32) -> Option<tokio::time::Instant> {
        let last = *self
            .inner
            .last_claim
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        hold(
            pool.demand.background.is_on(),
            warm,
            want,
            last,
            tokio::time::Instant::now(),
        )
    }

    /// How many warm sandboxes `pool` holds, after dropping from its list those that ended while
    /// warm (their main process exited): they are no one's to claim, and counting them would keep
    /// the pool from making replacements; and how many are being made, counted under the same
    /// lock (a finished create moves from one count to the other under it).
    pub(super) fn live_warm_and_creating(&self, pool: &Pool) -> (u32, u32) {
        let sandboxes = &self.inner.sandboxes;
        let mut warm = pool.warm.lock().unwrap_or_else(|e| e.into_inner());
        if sandboxes.shares_records() {
            // The replicas' warm sandboxes are every replica's: the list is what the records say
            // (those another replica made, less those another claimed).
            let name = pool.key.as_str();
            let is_warm = |r: &SandboxRecord| {
                r.warm_pool.as_deref() == Some(name) && r.state == SandboxState::Running
            };
            warm.retain(|id| sandboxes.get(id).is_some_and(|r| is_warm(&r)));
            let added: Vec<String> = sandboxes
                .select(|r| is_warm(r) && !warm.contains(&r.id))
                .into_iter()
                .map(|r| r.id)
                .collect();
            if !added.is_empty() {
                warm.extend(added);
                pool.available.notify_waiters();
            }
        } else {
            warm.retain(|id| sandboxes.state(id) == Some(SandboxState::Running));
        }
        (warm.len() as u32, pool.creating.load(Ordering::SeqCst))
    }
}
