//! A pool's own verbs: create, update (a new spec replaces the warm sandboxes; capacity alone
//! keeps them), delete (retiring what it made), get and list.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use warren_api::lifecycle::{Pool as WirePool, PoolSpec, PoolStatus, PoolUpdate};
use warren_api::ErrorCode;

use super::{from_config, not_found, revision, Pool, Pools, RETIRE_WAIT};
use crate::error::SandboxError;
use crate::keys::Caller;
use crate::sandboxes::REASON_USER_DELETE;
use crate::stored::pool_key;

impl Pools {
    pub fn create(&self, spec: PoolSpec, tenant: &str) -> Result<WirePool, SandboxError> {
        let pool = self.insert(self.prepare(spec, false, Utc::now(), tenant)?)?;
        self.spawn_refill(pool.clone());
        self.save();
        Ok(self.wire(&pool))
    }

    /// `PUT /pools/{name}`. With only `capacitySpec` (the reference's shape) the sizes change and
    /// the warm sandboxes stay (those beyond the new `bufferMax` go); with a `template` the pool
    /// is replaced: its warm sandboxes go and new ones are made. Either way the new spec is
    /// checked first (a bad one changes nothing), and the new pool takes the name in the same
    /// step the old one gives it up, so no create meanwhile finds no pool of that name; creates
    /// waiting on the old one move to the new one.
    pub async fn update(
        &self,
        tenant: &str,
        name: &str,
        update: PoolUpdate,
    ) -> Result<WirePool, SandboxError> {
        if update.name.as_deref().is_some_and(|n| n != name) {
            return Err(SandboxError::invalid(
                "the body's name must be the pool's name",
            ));
        }
        let key = pool_key(tenant, name);
        let old = self.pool(&key).ok_or_else(|| not_found(name))?;
        let keep_warm = update.template.is_none();
        let spec = PoolSpec {
            name: name.to_owned(),
            template: update.template.unwrap_or_else(|| old.spec.template.clone()),
            capacity_spec: update.capacity_spec,
            max_wait_seconds: update.max_wait_seconds.or(old.spec.max_wait_seconds),
        };
        let new = self.prepare(spec, false, old.created_at, tenant)?;
        let (old, moved, extra) = {
            let mut pools = self.inner.pools.lock().unwrap_or_else(|e| e.into_inner());
            let current = pools.get(&key).cloned().ok_or_else(|| not_found(name))?;
            if current.from_config {
                return Err(from_config(name));
            }
            if !Arc::ptr_eq(&current, &old) {
                // Another update won meanwhile: this one's kept fields came from the pool before it.
                return Err(SandboxError::conflict(
                    ErrorCode::InvalidState,
                    format!("pool {name} was changed by another request meanwhile; send the update again"),
                ));
            }
            let (mut moved, mut extra) = (0, Vec::new());
            if keep_warm {
                // Closed under the warm list's lock, as a refill looks at it: each sandbox is
                // either on the list drained here or deleted by the refill that made it.
                let mut from = old.warm.lock().unwrap_or_else(|e| e.into_inner());
                old.closed.store(true, Ordering::SeqCst);
                let mut to = new.warm.lock().unwrap_or_else(|e| e.into_inner());
                for id in from.drain(..) {
                    if (to.len() as u32) < new.spec.capacity_spec.buffer_max {
                        to.push_back(id);
                        moved += 1;
                    } else {
                        extra.push(id);
                    }
                }
            }
            pools.insert(key.clone(), new.clone());
            (old, moved, extra)
        };
        for _ in 0..moved {
            new.available.notify_one();
        }
        self.spawn_refill(new.clone());
        self.save();
        self.retire(old).await;
        for id in extra {
            let _ = self.inner.sandboxes.delete(&id, REASON_USER_DELETE).await;
        }
        Ok(self.wire(&new))
    }

    pub async fn delete(&self, tenant: &str, name: &str) -> Result<(), SandboxError> {
        let key = pool_key(tenant, name);
        let pool = {
            let mut pools = self.inner.pools.lock().unwrap_or_else(|e| e.into_inner());
            let pool = pools.get(&key).cloned().ok_or_else(|| not_found(name))?;
            if pool.from_config {
                return Err(from_config(name));
            }
            pools.remove(&key);
            pool
        };
        self.save();
        self.retire(pool).await;
        Ok(())
    }

    /// Ends a pool that is no longer registered: its refill stops, its waiters wake (to find the
    /// pool's successor or none), its warm sandboxes are deleted.
    async fn retire(&self, pool: Arc<Pool>) {
        pool.closed.store(true, Ordering::SeqCst);
        pool.refill.notify_one();
        pool.available.notify_waiters();
        let warm: Vec<String> = pool
            .warm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        // In a task of its own: were this request dropped (its client gone), the sandboxes drained
        // above would be nobody's, unlisted and running until a restart.
        let sandboxes = self.inner.sandboxes.clone();
        let deleting = tokio::spawn(async move {
            for id in warm {
                let _ = sandboxes.delete(&id, REASON_USER_DELETE).await;
            }
        });
        let _ = deleting.await;
        // Sandboxes being made when the pool closed delete themselves once made (see
        // `refill_loop`): the pool is gone when they are, so that a delete leaves nothing running.
        let deadline = tokio::time::Instant::now() + RETIRE_WAIT;
        while pool.creating.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn get(&self, tenant: &str, name: &str) -> Result<WirePool, SandboxError> {
        let pool = self
            .pool(&pool_key(tenant, name))
            .ok_or_else(|| not_found(name))?;
        Ok(self.wire(&pool))
    }

    /// The pools of the tenants `caller` sees, by name.
    pub fn list(&self, caller: &Caller) -> Vec<WirePool> {
        let mut pools: Vec<Arc<Pool>> = self
            .inner
            .pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|p| caller.sees(&p.tenant))
            .cloned()
            .collect();
        pools.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        pools.iter().map(|p| self.wire(p)).collect()
    }

    /// Each pool's key (`tenant/name`, or the name for the default tenant) and its live warm
    /// sandboxes, for `/metrics`.
    pub fn warm_counts(&self) -> Vec<(String, u32)> {
        let pools: Vec<Arc<Pool>> = self
            .inner
            .pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        pools
            .iter()
            .map(|p| (p.key.clone(), self.live_warm_and_creating(p).0))
            .collect()
    }

    fn wire(&self, pool: &Pool) -> WirePool {
        let (available, creating) = self.live_warm_and_creating(pool);
        let allocated = self.allocated(&pool.key);
        WirePool {
            spec: pool.spec.clone(),
            status: PoolStatus {
                total: available + allocated + creating,
                allocated,
                available,
                revision: revision(&pool.spec),
            },
            created_at: crate::time::rfc3339(pool.created_at),
        }
    }
}
