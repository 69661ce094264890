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
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use warren_api::lifecycle::{CapacitySpec, PoolSpec, SandboxState};
use warren_api::ErrorCode;
use warren_core::Background;
use warren_store::{SandboxRecord, DEFAULT_TENANT};

use crate::config::LimitsSection;
use crate::error::{ErrorKind, SandboxError};
use crate::quotas::Quotas;
use crate::sandboxes::isolation_requested;
use crate::sandboxes::{Sandboxes, REASON_USER_DELETE};
use crate::stored::{pool_key, Stored};
use crate::validate::{create_plan, CreatePlan};
use crate::volumes::StoragePolicy;

mod admin;
mod claim;
mod refill;

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
