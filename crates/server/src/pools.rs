//! Warm pools: sandboxes made ahead of time from a template and handed out by creates that name
//! the pool (`extensions.poolRef`) or ask for exactly the template. A claim pops a warm sandbox
//! and relabels it (O(1), no process work); a task per pool refills in the background. When a
//! pool is empty a create waits, first come first served, up to the pool's `maxWaitSeconds`, then
//! answers 429 with `Retry-After` — never a silent failure.
//!
//! Warm sandboxes are ordinary sandboxes marked `warm_pool` in their record: not listed, no
//! expiry. After a server restart they are adopted again when they still match their pool.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use warren_api::lifecycle::{
    CapacitySpec, Pool as WirePool, PoolSpec, PoolStatus, PoolUpdate, SandboxState,
};
use warren_api::ErrorCode;
use warren_core::Background;
use warren_store::{SandboxRecord, DEFAULT_TENANT};

use crate::config::LimitsSection;
use crate::error::{ErrorKind, SandboxError};
use crate::keys::Caller;
use crate::quotas::Quotas;
use crate::sandboxes::{isolation_requested, ISOLATION_EXTENSION};
use crate::sandboxes::{Sandboxes, REASON_USER_DELETE};
use crate::stored::{pool_key, Stored};
use crate::validate::{create_plan, CreatePlan};
use crate::volumes::StoragePolicy;

/// The extension naming the pool a create wants (as in the reference's Kubernetes pool mode).
pub const POOL_REF: &str = "poolRef";
const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(30);
/// Warm sandboxes one pool makes at the same time.
const REFILL_PARALLEL: u32 = 2;
/// How long a pool's delete waits for the sandboxes it was making to be made and deleted.
const RETIRE_WAIT: Duration = Duration::from_secs(60);
/// How long after a claim (from any pool) no refill starts, while the pool still holds more than
/// a [`HOLD_FLOOR`]th of what it wants and nobody waits for it. A claimed sandbox's client goes
/// on at once to its first command, which takes a few ms; a refill started beside it (~20 ms of
/// CPU) made that claim ~2.5 ms slower on this project's machine, even at nice 19 and the
/// smallest CPU share: with two vCPUs a busy one slows the other (a nice-19 busy loop alone cost
/// a claim ~1.2 ms). So claims in quick succession — a client's claim → command → delete cycles
/// (~8 ms from a compiled client, more from Python), a burst served from the pool — leave the
/// refills to the pause after them, down to the floor; claims further apart than this (fewer
/// than 50 a second) find every gap used as before.
const CLAIM_HOLD: Duration = Duration::from_millis(20);
/// The share of what a pool wants warm (`bufferMax`, within `poolMax`) below which claims no
/// longer hold its refills: a pool drained by a steady stream of claims refills as it did.
const HOLD_FLOOR: u32 = 4;
const MAX_NAME_LEN: usize = 63;

#[derive(Clone)]
pub struct Pools {
    inner: Arc<Inner>,
}

struct Inner {
    sandboxes: Sandboxes,
    /// A template's image is resolved for the pool's tenant as any create's is.
    stored: Stored,
    /// Warm sandboxes are their tenant's: a pool makes none past its tenant's quotas.
    quotas: Arc<Quotas>,
    limits: LimitsSection,
    max_timeout: Option<i64>,
    storage: Arc<StoragePolicy>,
    /// API-made pools are kept here; pools of the config file are not (they are the file's).
    file: PathBuf,
    pools: Mutex<HashMap<String, Arc<Pool>>>,
    /// Serializes [`Pools::save`].
    saving: Mutex<()>,
    /// When the last warm sandbox was handed out, from any pool (see [`CLAIM_HOLD`]).
    last_claim: Mutex<Option<tokio::time::Instant>>,
}

struct Pool {
    spec: PoolSpec,
    /// Whose pool it is; only that tenant's creates are served from it.
    tenant: String,
    /// Its name in the registry and on its sandboxes' records (`warm_pool`, `pool_ref`): the
    /// tenant's name for it, qualified unless the tenant is the default one (see [`pool_key`]).
    key: String,
    /// When the pool was first made (kept across updates and restarts).
    created_at: DateTime<Utc>,
    /// The template as a validated create, marked as this pool's warm sandbox.
    plan: CreatePlan,
    from_config: bool,
    warm: Mutex<VecDeque<String>>,
    creating: AtomicU32,
    /// Taken off the warm list and being handed to a client: counted as allocated, since its
    /// record says so only once the hand-over is done (else a refill would replace it early).
    claiming: Arc<AtomicU32>,
    /// A warm sandbox was added (wakes one waiting create).
    available: tokio::sync::Notify,
    /// Something changed that may call for more warm sandboxes.
    refill: tokio::sync::Notify,
    closed: AtomicBool,
    demand: Demand,
}

/// Whether anyone waits for a pool's next sandbox. While nobody does, the sandboxes it makes
/// yield their CPU to the sandboxes in use (a claimed one's first command above all) until they
/// are claimed; a waiting create turns that off, and it stays off until the last one is served.
struct Demand {
    background: Background,
    waiting: Mutex<u32>,
}

impl Demand {
    fn new() -> Self {
        Demand {
            background: Background::new(true),
            waiting: Mutex::new(0),
        }
    }

    /// Counts a waiting create for as long as the guard lives (a create's future may be dropped at
    /// any await, when its client goes away). `true` with the first one: the sandboxes being
    /// made already yield, and need promoting.
    fn wait(&self) -> (Waiting<'_>, bool) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        *waiting += 1;
        if *waiting == 1 {
            self.background.set(false);
        }
        (Waiting(self), *waiting == 1)
    }
}

struct Waiting<'a>(&'a Demand);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waiting = self.0.waiting.lock().unwrap_or_else(|e| e.into_inner());
        *waiting -= 1;
        if *waiting == 0 {
            self.0.background.set(true);
        }
    }
}

impl Pools {
    pub fn new(
        sandboxes: Sandboxes,
        stored: Stored,
        quotas: Arc<Quotas>,
        limits: LimitsSection,
        max_timeout: Option<i64>,
        storage: Arc<StoragePolicy>,
        data_dir: &std::path::Path,
    ) -> Self {
        Pools {
            inner: Arc::new(Inner {
                sandboxes,
                stored,
                quotas,
                limits,
                max_timeout,
                storage,
                file: data_dir.join("pools.json"),
                pools: Mutex::new(HashMap::new()),
                saving: Mutex::new(()),
                last_claim: Mutex::new(None),
            }),
        }
    }

    /// Starts the config's pools and those the API made in an earlier run, adopting warm sandboxes
    /// that survived a restart and removing those no pool wants any more.
    pub async fn start(&self, from_config: &[PoolSpec]) -> anyhow::Result<()> {
        use anyhow::Context;
        // Refills start only once the warm sandboxes that survived are back on their lists: a
        // refill that looked first would see none and make a pool's worth more.
        let mut started = Vec::new();
        let now = Utc::now();
        for spec in from_config {
            let pool = self
                .prepare(spec.clone(), true, now, DEFAULT_TENANT)
                .map_err(|e| anyhow::anyhow!("pool {:?} in the config: {e}", spec.name))?;
            self.insert(pool.clone())
                .map_err(|e| anyhow::anyhow!("pool {:?} in the config: {e}", spec.name))?;
            started.push(pool);
        }
        let saved: Vec<SavedPool> = match std::fs::read(&self.inner.file) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .with_context(|| format!("parsing {}", self.inner.file.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(e).with_context(|| format!("reading {}", self.inner.file.display()))
            }
        };
        for SavedPool {
            spec,
            created_at,
            tenant,
        } in saved
        {
            match self
                .prepare(spec.clone(), false, created_at.unwrap_or(now), &tenant)
                .and_then(|p| self.insert(p))
            {
                Ok(pool) => started.push(pool),
                Err(e) => {
                    tracing::error!(pool = %spec.name, "saved pool not started: {e}")
                }
            }
        }
        for rec in self.inner.sandboxes.all() {
            let Some(pool_name) = rec.warm_pool.clone() else {
                continue;
            };
            let pool = self.pool(&pool_name);
            let usable = rec.state == SandboxState::Running
                && pool.as_ref().is_some_and(|p| fits(&p.plan, &rec));
            // Beyond bufferMax (the config shrank), the extra ones go too.
            let adopted = pool.as_ref().filter(|_| usable).is_some_and(|p| {
                let mut warm = p.warm.lock().unwrap_or_else(|e| e.into_inner());
                let room = (warm.len() as u32) < p.spec.capacity_spec.buffer_max;
                if room {
                    warm.push_back(rec.id.clone());
                }
                room
            });
            if !adopted {
                let _ = self
                    .inner
                    .sandboxes
                    .delete(&rec.id, REASON_USER_DELETE)
                    .await;
            }
        }
        for pool in started {
            self.spawn_refill(pool);
        }
        Ok(())
    }

    fn pool(&self, name: &str) -> Option<Arc<Pool>> {
        self.inner
            .pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// A validated pool, not yet in the registry and not refilling.
    fn prepare(
        &self,
        spec: PoolSpec,
        from_config: bool,
        created_at: DateTime<Utc>,
        tenant: &str,
    ) -> Result<Arc<Pool>, SandboxError> {
        validate_spec(&spec)?;
        if self.inner.sandboxes.shares_records() && !from_config {
            // Every replica has the config's pools; one made through one replica's API would be
            // that replica's alone.
            return Err(SandboxError::new(
                ErrorKind::Unsupported,
                ErrorCode::ApiNotSupported,
                "when replicas share their sandboxes ([kubernetes] shared_key_file), pools come from the config file, which every replica has",
            ));
        }
        let mut plan = create_plan(
            spec.template.clone(),
            &self.inner.limits,
            self.inner.max_timeout,
            &self.inner.storage,
        )
        .map_err(|e| SandboxError::invalid(format!("template: {}", e.public_message())))?;
        if plan.snapshot_id.is_some() || !plan.volumes.is_empty() || plan.image_auth.is_some() {
            return Err(SandboxError::invalid(
                "template: pools take an image without auth, and no volumes or snapshotId",
            ));
        }
        let key = pool_key(tenant, &spec.name);
        plan.warm_pool = Some(key.clone());
        plan.set_tenant(tenant)?;
        // Its sandboxes are its tenant's: an image naming another tenant's snapshot is refused
        // here, as a create's is (a pool saved with a snapshot since deleted does not start).
        self.inner.stored.resolve(&mut plan)?;
        plan.timeout_seconds = None;
        plan.metadata = BTreeMap::new();
        // Of the template's extensions only one shapes the sandbox: isolated sessions.
        plan.extensions
            .retain(|k, _| k == crate::sandboxes::ISOLATION_EXTENSION);
        Ok(Arc::new(Pool {
            spec,
            tenant: tenant.to_string(),
            key,
            created_at,
            plan,
            from_config,
            warm: Mutex::new(VecDeque::new()),
            creating: AtomicU32::new(0),
            claiming: Arc::new(AtomicU32::new(0)),
            available: tokio::sync::Notify::new(),
            refill: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
            demand: Demand::new(),
        }))
    }

    /// Registers a prepared pool under its name (409 if the name is taken).
    fn insert(&self, pool: Arc<Pool>) -> Result<Arc<Pool>, SandboxError> {
        let mut pools = self.inner.pools.lock().unwrap_or_else(|e| e.into_inner());
        if pools.contains_key(&pool.key) {
            return Err(SandboxError::conflict(
                ErrorCode::InvalidState,
                format!("pool {} exists", pool.spec.name),
            ));
        }
        pools.insert(pool.key.clone(), pool.clone());
        Ok(pool)
    }

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

    fn allocated(&self, name: &str) -> u32 {
        self.inner
            .sandboxes
            .count(|r| r.pool_ref.as_deref() == Some(name) && !r.state.is_terminal()) as u32
    }

    /// Keeps the pool at `bufferMax` warm sandboxes, within `poolMax` in all.
    /// A pool's refill loop, run again should it panic (see `supervise`).
    fn spawn_refill(&self, pool: Arc<Pool>) {
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
    fn live_warm_and_creating(&self, pool: &Pool) -> (u32, u32) {
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

    fn save(&self) {
        // Held from the snapshot to the rename: two saves racing cannot leave the older on disk.
        let _saving = self.inner.saving.lock().unwrap_or_else(|e| e.into_inner());
        let specs: Vec<SavedPool> = {
            let pools = self.inner.pools.lock().unwrap_or_else(|e| e.into_inner());
            let mut specs: Vec<SavedPool> = pools
                .values()
                .filter(|p| !p.from_config)
                .map(|p| SavedPool {
                    spec: p.spec.clone(),
                    created_at: Some(p.created_at),
                    tenant: p.tenant.clone(),
                })
                .collect();
            specs.sort_by(|a, b| (&a.tenant, &a.spec.name).cmp(&(&b.tenant, &b.spec.name)));
            specs
        };
        let write = serde_json::to_vec_pretty(&specs)
            .map_err(std::io::Error::other)
            .and_then(|bytes| crate::state_file::replace(&self.inner.file, &bytes));
        if let Err(e) = write {
            tracing::error!("saving pools to {} failed: {e}", self.inner.file.display());
        }
    }
}

/// An API-made pool as kept in the data dir (files written before `createdAt` was kept lack it).
#[derive(serde::Serialize, serde::Deserialize)]
struct SavedPool {
    #[serde(flatten)]
    spec: PoolSpec,
    #[serde(default, rename = "createdAt", skip_serializing_if = "Option::is_none")]
    created_at: Option<DateTime<Utc>>,
    /// Files written before tenants lack it: the default tenant's.
    #[serde(default = "warren_store::default_tenant")]
    tenant: String,
}

/// The pool's revision: a digest of its spec, so it changes exactly when the spec does.
fn revision(spec: &PoolSpec) -> String {
    let bytes = serde_json::to_vec(spec).unwrap_or_default();
    let digest = Sha256::digest(&bytes);
    digest[..6].iter().map(|b| format!("{b:02x}")).collect()
}

fn not_found(name: &str) -> SandboxError {
    pool_not_found(format!("pool {name} not found"))
}

fn pool_not_found(message: String) -> SandboxError {
    SandboxError::new(ErrorKind::NotFound, ErrorCode::PoolNotFound, message)
}

fn validate_spec(spec: &PoolSpec) -> Result<(), SandboxError> {
    let name_ok = !spec.name.is_empty()
        && spec.name.len() <= MAX_NAME_LEN
        && spec
            .name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !spec.name.starts_with('-');
    if !name_ok {
        return Err(SandboxError::invalid(
            "pool name must be 1 to 63 of [a-z0-9-], not starting with -",
        ));
    }
    let CapacitySpec {
        buffer_max,
        buffer_min,
        pool_max,
        pool_min,
    } = spec.capacity_spec;
    if buffer_min > buffer_max || pool_min > pool_max || buffer_max > pool_max || pool_max == 0 {
        return Err(SandboxError::invalid(
            "capacitySpec: need bufferMin ≤ bufferMax ≤ poolMax, poolMin ≤ poolMax, poolMax ≥ 1",
        ));
    }
    if pool_max > 10_000 {
        return Err(SandboxError::invalid("capacitySpec.poolMax: at most 10000"));
    }
    Ok(())
}

/// A request for exactly the sandbox a pool makes (metadata, extensions and timeout aside).
fn from_config(name: &str) -> SandboxError {
    SandboxError::conflict(
        ErrorCode::InvalidState,
        format!("pool {name} is defined in the config file; change it there"),
    )
}

fn same_sandbox(template: &CreatePlan, plan: &CreatePlan) -> bool {
    let mut candidate = plan.clone();
    candidate.warm_pool = template.warm_pool.clone();
    candidate.timeout_seconds = template.timeout_seconds;
    candidate.metadata = template.metadata.clone();
    candidate.extensions = template.extensions.clone();
    candidate == *template
        && isolation_requested(&plan.extensions) == isolation_requested(&template.extensions)
}

/// A warm sandbox from before a restart still is what the pool's template makes.
fn fits(template: &CreatePlan, rec: &SandboxRecord) -> bool {
    rec.image == template.image
        && template
            .entrypoint
            .as_ref()
            .is_none_or(|e| *e == rec.entrypoint)
        && rec.env == template.env
        && rec.limits == template.limits
}

/// The rule of [`CLAIM_HOLD`]: until when a refill waits, given whether nobody waits for the pool,
/// how many of the `want`ed sandboxes are warm, and the last claim.
fn hold(
    nobody_waits: bool,
    warm: u32,
    want: u32,
    last_claim: Option<tokio::time::Instant>,
    now: tokio::time::Instant,
) -> Option<tokio::time::Instant> {
    if !nobody_waits || warm <= want / HOLD_FLOOR {
        return None;
    }
    let until = last_claim? + CLAIM_HOLD;
    (now < until).then_some(until)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_in_quick_succession_hold_refills_down_to_the_floor_and_never_a_waiting_create() {
        let now = tokio::time::Instant::now();
        let just = Some(now - Duration::from_millis(3));
        let until = just.map(|t| t + CLAIM_HOLD);
        assert_eq!(
            hold(true, 20, 25, just, now),
            until,
            "a claim 3 ms ago holds"
        );
        assert_eq!(hold(true, 20, 25, None, now), None, "no claim yet");
        let long_ago = Some(now - CLAIM_HOLD - Duration::from_millis(1));
        assert_eq!(hold(true, 20, 25, long_ago, now), None, "the hold is over");
        assert_eq!(hold(false, 20, 25, just, now), None, "a create waits");
        assert_eq!(
            hold(true, 6, 25, just, now),
            None,
            "at the floor (a quarter)"
        );
        assert_eq!(hold(true, 7, 25, just, now), until, "above the floor");
        assert_eq!(hold(true, 0, 1, just, now), None, "an empty pool of one");
    }

    #[test]
    fn a_pool_makes_sandboxes_in_the_background_only_while_nobody_waits() {
        let demand = Demand::new();
        let made_now = demand.background.clone(); // what a create in flight holds
        assert!(made_now.is_on());
        let (first, is_first) = demand.wait();
        assert!(is_first, "the first waiter promotes what is being made");
        assert!(!made_now.is_on(), "creates in flight see it at once");
        let (second, is_first) = demand.wait();
        assert!(!is_first);
        drop(first);
        assert!(!made_now.is_on(), "someone still waits");
        drop(second);
        assert!(made_now.is_on(), "nobody waits: background again");
    }
}
