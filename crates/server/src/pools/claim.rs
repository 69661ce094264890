//! Handing out warm sandboxes: which pool a create goes to, and the claim, which pops a warm
//! sandbox and relabels it, or waits in line for one.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use warren_api::ErrorCode;
use warren_store::SandboxRecord;

use super::{not_found, pool_not_found, same_sandbox, Pool, Pools, DEFAULT_MAX_WAIT, POOL_REF};
use crate::error::{ErrorKind, SandboxError};
use crate::sandboxes::{isolation_requested, ISOLATION_EXTENSION};
use crate::stored::pool_key;
use crate::validate::CreatePlan;

impl Pools {
    /// The pool a create goes to: the one its `poolRef` names (400 if unknown, or if the request
    /// asks for something the pool's sandboxes are not), else the first whose template the
    /// request matches exactly (ignoring metadata, extensions and timeout), else none.
    pub fn route(&self, plan: &CreatePlan) -> Result<Option<String>, SandboxError> {
        if !plan.hooks.is_empty() {
            // A warm sandbox is Running already: its preStart would come too late.
            if plan.extensions.contains_key(POOL_REF) {
                return Err(SandboxError::invalid(
                    "a create from a pool takes no lifecycle hooks (preStart, periodic)",
                ));
            }
            return Ok(None);
        }
        if let Some(name) = plan.extensions.get(POOL_REF) {
            let key = pool_key(&plan.tenant, name);
            // A pool's name holds no `/`: one that does would name another tenant's key.
            let found = (!name.contains('/')).then(|| self.pool(&key)).flatten();
            let pool = found.ok_or_else(|| {
                SandboxError::bad_request(
                    ErrorCode::InvalidParameter,
                    format!("extensions.poolRef: no pool named {name:?}"),
                )
            })?;
            if plan.snapshot_id.is_some()
                || !plan.volumes.is_empty()
                || plan.network_policy.is_some()
                || plan.credential_proxy
            {
                return Err(SandboxError::invalid(
                    "a create from a pool takes no snapshotId, volumes, networkPolicy or credentialProxy",
                ));
            }
            if !plan.image.is_empty() && plan.image != pool.plan.image {
                return Err(SandboxError::invalid(format!(
                    "extensions.poolRef: pool {name} runs image {:?}, not {:?}",
                    pool.plan.image, plan.image
                )));
            }
            if isolation_requested(&plan.extensions) && !isolation_requested(&pool.plan.extensions)
            {
                return Err(SandboxError::invalid(format!(
                    "extensions.poolRef: pool {name} makes sandboxes without isolated sessions \
                     (its template has no extensions.{ISOLATION_EXTENSION} = enable)"
                )));
            }
            return Ok(Some(key));
        }
        let pools = self.inner.pools.lock().unwrap_or_else(|e| e.into_inner());
        let mut keys: Vec<&String> = pools
            .iter()
            .filter(|(_, p)| p.tenant == plan.tenant)
            .map(|(k, _)| k)
            .collect();
        keys.sort();
        Ok(keys
            .into_iter()
            .find(|k| same_sandbox(&pools[*k].plan, plan))
            .cloned())
    }

    /// Hands out a warm sandbox of `name` with the create's metadata, extensions and expiry; waits
    /// (FIFO) up to the pool's limit when none is warm, then 429. `None` when the pool went away while
    /// the create waited and no pool serves it any more: a create that only matched the pool's
    /// template is then made like any other (its client asked for a sandbox, not for that pool);
    /// one that named the pool (`poolRef`) gets a 404 that says so.
    pub async fn claim(
        &self,
        name: &str,
        plan: &CreatePlan,
    ) -> Result<Option<SandboxRecord>, SandboxError> {
        let mut pool = self.pool(name).ok_or_else(|| not_found(name))?;
        let wait = pool
            .spec
            .max_wait_seconds
            .map(Duration::from_secs)
            .unwrap_or(DEFAULT_MAX_WAIT);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(rec) = self.claim_from(&pool, plan, deadline, wait).await? {
                return Ok(Some(rec));
            }
            // Closed while this create waited: replaced (PUT) or deleted. It goes where it routes
            // now: the successor, another pool whose template it matches, or no pool.
            let gone = || {
                pool_not_found(format!(
                    "pool {} was deleted while this create waited for a warm sandbox",
                    pool.spec.name
                ))
            };
            match self.route(plan) {
                Ok(Some(next)) => match self.pool(&next) {
                    Some(p) if !Arc::ptr_eq(&p, &pool) => pool = p,
                    _ => return Err(gone()),
                },
                Ok(None) => return Ok(None),
                Err(_) => return Err(gone()),
            }
        }
    }

    /// [`Pools::claim`] from one pool; `None` once that pool is closed.
    async fn claim_from(
        &self,
        pool: &Arc<Pool>,
        plan: &CreatePlan,
        deadline: tokio::time::Instant,
        wait: Duration,
    ) -> Result<Option<SandboxRecord>, SandboxError> {
        let name = pool.key.as_str();
        let mut waiting = None;
        loop {
            // Registered before looking, so a sandbox added in between is not missed.
            let notified = pool.available.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let next = {
                let mut warm = pool.warm.lock().unwrap_or_else(|e| e.into_inner());
                let next = warm.pop_front();
                if next.is_some() {
                    pool.claiming.fetch_add(1, Ordering::SeqCst);
                    *self
                        .inner
                        .last_claim
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(tokio::time::Instant::now());
                }
                next
            };
            if let Some(id) = next {
                // Off the warm list and not yet the client's: if this request were dropped in
                // between (its client went away), the sandbox would run on, in no list. The
                // hand-over is a task of its own; a claimant that left gets a sandbox that expires.
                let (sandboxes, pool_name) = (self.inner.sandboxes.clone(), name.to_owned());
                let (metadata, extensions) = (plan.metadata.clone(), plan.extensions.clone());
                let timeout = plan.timeout_seconds;
                let claiming = pool.claiming.clone();
                let handed = tokio::spawn(async move {
                    let rec = sandboxes
                        .claim(&id, &pool_name, metadata, extensions, timeout)
                        .await;
                    claiming.fetch_sub(1, Ordering::SeqCst);
                    rec
                })
                .await
                .map_err(|e| SandboxError::internal("handing out a warm sandbox", &e))?;
                pool.refill.notify_one();
                if let Some(rec) = handed {
                    crate::metrics::pool_claim(name, true);
                    return Ok(Some(rec));
                }
                continue; // it died while warm: the next one
            }
            if pool.closed.load(Ordering::SeqCst) {
                return Ok(None);
            }
            if waiting.is_none() {
                let (guard, first) = pool.demand.wait();
                if first {
                    self.inner.sandboxes.promote_pending(name);
                }
                waiting = Some(guard);
            }
            pool.refill.notify_one();
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                crate::metrics::pool_claim(name, false);
                return Err(SandboxError::new(
                    ErrorKind::Busy,
                    ErrorCode::PoolExhausted,
                    format!(
                        "pool {name} had no free sandbox within {} s ({} allocated of at most {}); retry later",
                        wait.as_secs(),
                        self.allocated(name),
                        pool.spec.capacity_spec.pool_max
                    ),
                ));
            }
        }
    }

    pub(super) fn allocated(&self, name: &str) -> u32 {
        self.inner
            .sandboxes
            .count(|r| r.pool_ref.as_deref() == Some(name) && !r.state.is_terminal()) as u32
    }
}
