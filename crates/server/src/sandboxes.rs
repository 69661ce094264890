//! The sandbox registry: the single owner of every sandbox's record. Each lifecycle verb takes the
//! sandbox's operation lock, moves the state machine, persists the record, and drives the runtime.
//! Background tasks watch for sandboxes whose processes end on their own and for expiry.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use warren_api::lifecycle::SandboxState;
use warren_api::ErrorCode;
use warren_core::{
    Background, ImageSource, Liveness, Runtime, RuntimeError, RuntimeExt, SandboxImage, SandboxSpec,
};
use warren_image::ImageStore;
use warren_store::{SandboxRecord, Store};

use crate::error::ApiError;
use crate::execd_conns::{ExecdConns, ExecdEndpoint};
use crate::network::{needs_link, runtime_policy, Network};
use crate::validate::CreatePlan;

mod shared;

/// The reason of a sandbox whose `preStart` hook failed.
pub const REASON_PRE_START_FAILED: &str = "prestart_hook_failed";
pub const REASON_USER_DELETE: &str = "user_delete";
pub const REASON_TTL_EXPIRY: &str = "ttl_expiry";
/// The runtime could not remove the sandbox: a delete (or its record's end) tries again.
pub const REASON_DELETE_FAILED: &str = "delete_failed";

struct Entry {
    /// The current record; held only for short, non-async sections.
    record: StdMutex<SandboxRecord>,
    /// Serialises lifecycle operations on one sandbox (create, delete, pause, …).
    op: tokio::sync::Mutex<()>,
    /// Its state changes since this server started (diagnostics), the newest [`MAX_EVENTS`]. In
    /// memory only: the journal keeps the record, not its history.
    events: StdMutex<Events>,
}

/// State changes kept per sandbox.
const MAX_EVENTS: usize = 200;

/// The create extension that asks for execd's isolated sessions (`/v1/isolated/…`), as the
/// reference names it.
pub const ISOLATION_EXTENSION: &str = "bootstrap.execd.isolation";

/// Whether a create's extensions ask for isolated sessions.
pub fn isolation_requested(extensions: &BTreeMap<String, String>) -> bool {
    extensions
        .get(ISOLATION_EXTENSION)
        .is_some_and(|v| v == "enable")
}

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
    fn push(&mut self, rec: &SandboxRecord) {
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
    fn new(rec: &SandboxRecord, recovered: bool) -> Self {
        let mut events = Events {
            recovered,
            ..Events::default()
        };
        events.push(rec);
        Entry {
            record: StdMutex::new(rec.clone()),
            op: tokio::sync::Mutex::new(()),
            events: StdMutex::new(events),
        }
    }
}

#[derive(Clone)]
pub struct Sandboxes {
    inner: Arc<Inner>,
}

struct Inner {
    /// Checked for room before each create (`disk_space`).
    data_dir: PathBuf,
    runtime: Arc<dyn Runtime>,
    store: Store,
    /// The runtime's backend keeps the records, shared with other replicas (see `shared`); the
    /// journal then holds none.
    shared: Option<Arc<dyn warren_core::SharedRecords>>,
    images: Arc<ImageStore>,
    entries: RwLock<HashMap<String, Arc<Entry>>>,
    retention: chrono::Duration,
    /// Bounds creates in flight when the runtime asks for it (FIFO: first come, first created).
    create_slots: Option<tokio::sync::Semaphore>,
    network: Arc<Network>,
    /// Pulls images a create names but the store lacks; `None` when pulls are off.
    puller: Option<warren_registry::Puller>,
    pool_sandbox_ended: tokio::sync::Notify,
    /// The last runs of sandboxes' lifecycle hooks (diagnostics).
    hook_runs: crate::hooks::Runs,
    /// What is under way for each sandbox (`idle`).
    activity: Arc<crate::idle::Activity>,
    /// When this server started: a sandbox it has seen no activity of is idle from then.
    started: std::time::Instant,
    /// Keep-alive connections to each live sandbox's execd, for the endpoint proxy.
    execd_conns: Arc<ExecdConns>,
    /// Set in every sandbox's environment unless its create sets the variable itself (the
    /// server's settings for execd, such as `[runtime] spare_shell`). Not in the record: it is
    /// the server's, not the client's.
    default_env: BTreeMap<String, String>,
    /// The floor execd lays under user code (`[runtime] execd_run_as_init`), checked at start.
    floor: Option<warren_api::hardening::FloorPolicy>,
    caps: Caps,
    /// Creates admitted and not yet done (see `Caps::creates_in_flight`).
    in_flight: std::sync::atomic::AtomicUsize,
}

/// What one server takes on at once, whoever asks: beyond it a create is answered 429 with
/// `Retry-After` instead of queueing without end (`[limits] max_sandboxes`, `max_creates_in_flight`).
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Sandboxes that have not ended (warm pool sandboxes included).
    pub sandboxes: usize,
    /// Creates admitted and not yet answered (they wait their turn for a create slot).
    pub creates_in_flight: usize,
}

/// One admitted create, counted until it is done.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn limit_reached(message: String) -> ApiError {
    ApiError::new(
        http::StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::LimitReached,
        message,
    )
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Moves a record through the store's transition table. A refused move is a bug (the verbs check
/// the state under the sandbox's lock first): it is logged, and the record stays as it was rather
/// than, say, a deleted sandbox coming back to Running.
fn moved(r: &mut SandboxRecord, to: SandboxState, reason: Option<&str>, message: Option<String>) {
    if let Err(e) = r.transition(to, reason, message) {
        tracing::error!(error = %e, "a state change the transition table refuses (a bug in Warren); the record stays as it was");
    }
}

/// The server's settings for its sandboxes.
pub struct Options {
    /// How long an ended sandbox stays listed.
    pub retention_seconds: i64,
    /// Where to pull images a create names but the store lacks; `None`: no pulls.
    pub registries: Option<warren_registry::RegistriesConfig>,
    /// Different images pulled at once, at most.
    pub max_pulls: usize,
    /// Set in every sandbox's environment unless its create sets the variable.
    pub default_env: BTreeMap<String, String>,
    /// The floor under user code in every sandbox; `None`: hardening off.
    pub floor: Option<warren_api::hardening::FloorPolicy>,
    pub caps: Caps,
}

impl Sandboxes {
    pub fn new(
        data_dir: &Path,
        runtime: Arc<dyn Runtime>,
        store: Store,
        images: ImageStore,
        network: Arc<Network>,
        options: Options,
    ) -> Self {
        let Options {
            retention_seconds,
            registries,
            max_pulls,
            default_env,
            floor,
            caps,
        } = options;
        let images = Arc::new(images);
        let puller = registries.map(|config| {
            warren_registry::Puller::new(
                warren_registry::Client::new(config),
                images.clone(),
                max_pulls,
            )
        });
        let create_slots = runtime
            .capabilities()
            .create_parallelism
            .map(|n| tokio::sync::Semaphore::new(n.max(1)));
        Self {
            inner: Arc::new(Inner {
                data_dir: data_dir.to_path_buf(),
                create_slots,
                shared: runtime.shared_records(),
                runtime,
                store,
                images,
                puller,
                pool_sandbox_ended: tokio::sync::Notify::new(),
                hook_runs: Default::default(),
                activity: Default::default(),
                started: std::time::Instant::now(),
                execd_conns: Arc::default(),
                entries: RwLock::new(HashMap::new()),
                retention: chrono::Duration::seconds(retention_seconds),
                network,
                default_env,
                floor,
                caps,
                in_flight: Default::default(),
            }),
        }
    }

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

    fn entry(&self, id: &str) -> Option<Arc<Entry>> {
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

    /// The entries, taken out of the map's lock before any record is locked.
    fn entries(&self) -> Vec<Arc<Entry>> {
        self.inner
            .entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    fn persist(&self, record: &SandboxRecord) {
        if self.inner.shared.is_some() {
            return;
        }
        if let Err(e) = self.inner.store.save(record) {
            tracing::error!(sandbox_id = %record.id, error = %e, "persisting sandbox record failed");
        }
    }

    fn update(&self, entry: &Entry, f: impl FnOnce(&mut SandboxRecord)) -> SandboxRecord {
        let (snapshot, ended) = {
            let mut rec = lock(&entry.record);
            let was_terminal = rec.state.is_terminal();
            let was = (rec.state, rec.last_transition_at);
            f(&mut rec);
            if (rec.state, rec.last_transition_at) != was {
                lock(&entry.events).push(&rec);
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

    /// The image from the store, leased to `holder`; pulled first when it is missing and pulls are
    /// on (concurrent creates of one image share the pull).
    async fn store_image(
        &self,
        name: &str,
        auth: Option<&warren_api::lifecycle::ImageAuth>,
        holder: &str,
    ) -> Result<warren_image::ResolvedImage, ApiError> {
        let resolve = || {
            // Resolving and leasing are file work that may wait on the store's lock during an
            // import.
            let images = self.inner.images.clone();
            let (name, holder) = (name.to_owned(), holder.to_owned());
            async move {
                tokio::task::spawn_blocking(move || {
                    let image = images.resolve(&name)?;
                    images.lease(&holder, &image)?;
                    Ok(image)
                })
                .await
                .map_err(|e| ApiError::internal("resolving the image", &e))
            }
        };
        match resolve().await? {
            Ok(image) => return Ok(image),
            Err(warren_image::ImageError::NotFound { .. }) if self.inner.puller.is_some() => {}
            Err(e) => return Err(image_error(name, e)),
        }
        let Some(puller) = &self.inner.puller else {
            unreachable!("checked above");
        };
        let credentials = auth.map(|a| warren_registry::Credentials {
            username: a.username.clone(),
            password: a.password.clone(),
        });
        puller
            .pull(name, credentials, None)
            .await
            .map_err(|e| pull_error(&e))?;
        resolve().await?.map_err(|e| image_error(name, e))
    }

    /// A 507 while the data dir's filesystem is too full for `what` ("a sandbox", "a snapshot")
    /// to be made (see `disk_space`).
    /// 400 where the runtime keeps no writable layer to copy (its capabilities say so).
    pub fn check_snapshots(&self) -> Result<(), ApiError> {
        if self.inner.runtime.capabilities().snapshots {
            Ok(())
        } else {
            Err(self.snapshots_unsupported())
        }
    }

    fn snapshots_unsupported(&self) -> ApiError {
        ApiError::new(
            http::StatusCode::BAD_REQUEST,
            ErrorCode::ApiNotSupported,
            format!(
                "snapshots: the {} runtime keeps no writable layer Warren can copy (the native runtime, embedded or runc, can)",
                self.inner.runtime.name()
            ),
        )
    }

    pub fn check_room(&self, what: &str) -> Result<(), ApiError> {
        crate::disk_space::check(&self.inner.data_dir, what)
    }

    /// Creates a sandbox and returns once execd answers. On failure nothing remains: no record, no
    /// lease, no runtime resource.
    pub async fn create(&self, plan: CreatePlan) -> Result<SandboxRecord, ApiError> {
        self.create_in_background(plan, Background::default()).await
    }

    /// [`Sandboxes::create`] for a sandbox made ahead of need: while `background` is on, its CPU
    /// yields to the sandboxes in use (see [`Background`]).
    pub async fn create_in_background(
        &self,
        plan: CreatePlan,
        background: Background,
    ) -> Result<SandboxRecord, ApiError> {
        self.check_room("a sandbox")?;
        if plan.hooks.idle.is_some() && !self.inner.runtime.capabilities().pause {
            return Err(ApiError::new(
                http::StatusCode::BAD_REQUEST,
                ErrorCode::ApiNotSupported,
                format!(
                    "lifecycle.idlePolicy pauses and wakes sandboxes, which {} cannot do",
                    self.inner.runtime.sandboxes_described()
                ),
            ));
        }
        let caps = self.inner.caps;
        let in_flight = self
            .inner
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _in_flight = InFlight(&self.inner.in_flight);
        if in_flight >= caps.creates_in_flight {
            return Err(limit_reached(format!(
                "{} creates are in flight, the most this server takes at once ([limits] max_creates_in_flight); retry shortly",
                caps.creates_in_flight
            )));
        }
        let id = uuid::Uuid::new_v4().to_string();
        let image = match self.inner.runtime.capabilities().image_source {
            ImageSource::Store => {
                let image = self
                    .store_image(&plan.image, plan.image_auth.as_ref(), &id)
                    .await?;
                SandboxImage::Resolved(image)
            }
            ImageSource::Engine => SandboxImage::Reference {
                name: plan.image.clone(),
                auth: plan.image_auth.clone(),
            },
        };
        let entrypoint = plan
            .entrypoint
            .clone()
            .unwrap_or_else(|| default_entrypoint(&image));
        let policy = plan
            .network_policy
            .clone()
            .unwrap_or_else(|| self.inner.network.default_policy());
        let caps_now = self.inner.runtime.capabilities();
        // What the runtime enforces itself when it has no link (a NetworkPolicy).
        let mut by_address = None;
        let egress = if needs_link(&policy) && !caps_now.egress_policy && caps_now.egress_addresses
        {
            let checked = if plan.credential_proxy {
                Err(ApiError::new(
                    http::StatusCode::BAD_REQUEST,
                    ErrorCode::ApiNotSupported,
                    format!(
                        "the credential vault needs a network link, which sandboxes of the {} runtime do not have",
                        self.inner.runtime.name()
                    ),
                ))
            } else {
                runtime_policy(&policy, &self.inner.runtime.name(), caps_now.egress_names)
            };
            match checked {
                Ok(p) => by_address = Some(p),
                Err(e) => {
                    let _ = self.inner.images.release(&id);
                    return Err(e);
                }
            }
            None
        } else if needs_link(&policy) {
            if !caps_now.egress_policy {
                let _ = self.inner.images.release(&id);
                return Err(ApiError::new(
                    http::StatusCode::BAD_REQUEST,
                    ErrorCode::ApiNotSupported,
                    format!(
                        "networkPolicy: Warren cannot enforce network policies on {} (the native runtime, embedded or runc, and Docker on this host can)",
                        self.inner.runtime.sandboxes_described()
                    ),
                ));
            }
            match self.inner.network.egress().await {
                Ok(e) => Some(e),
                Err(e) => {
                    let _ = self.inner.images.release(&id);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let isolation = isolation_requested(&plan.extensions);
        let now = Utc::now();
        let hooks = plan.hooks.clone();
        let record = SandboxRecord {
            id: id.clone(),
            image: plan.image.clone(),
            snapshot_id: plan.snapshot_id.clone(),
            warm_pool: plan.warm_pool.clone(),
            pool_ref: None,
            entrypoint: entrypoint.clone(),
            env: plan.env.clone(),
            metadata: plan.metadata,
            extensions: plan.extensions,
            limits: plan.limits.clone(),
            created_at: now,
            expires_at: plan
                .timeout_seconds
                .map(|t| now + chrono::Duration::seconds(t)),
            state: SandboxState::Pending,
            reason: None,
            message: None,
            last_transition_at: now,
            token: match &self.inner.shared {
                Some(shared) => shared.secret(&id),
                None => crate::tokens::new_secret(),
            },
            runtime_state: serde_json::Value::Null,
            network_policy: serde_json::to_value(&policy).ok(),
            network_link: None,
            credential_proxy: plan.credential_proxy,
            lifecycle_hooks: (!hooks.is_empty())
                .then(|| serde_json::to_value(&hooks).ok())
                .flatten(),
            tenant: plan.tenant.clone(),
        };
        let entry = Arc::new(Entry::new(&record, false));
        let _op = entry.op.lock().await;
        {
            // Counted and inserted under one lock: concurrent creates cannot all slip under the cap.
            let mut entries = self
                .inner
                .entries
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let live = entries
                .values()
                .filter(|e| !lock(&e.record).state.is_terminal())
                .count();
            if live >= caps.sandboxes {
                drop(entries);
                let _ = self.inner.images.release(&id);
                return Err(limit_reached(format!(
                    "{live} sandboxes are running, the most this server runs at once ([limits] max_sandboxes); retry when one ends"
                )));
            }
            entries.insert(id.clone(), entry.clone());
        }
        self.persist(&record);

        let mut env = self.inner.default_env.clone();
        env.extend(plan.env);
        let spec = SandboxSpec {
            id: id.clone(),
            image,
            entrypoint,
            env,
            limits: plan.limits,
            volumes: plan.volumes,
            background,
            isolation,
            execd_verifier: crate::tokens::execd_verifier(&record.token),
            record: self
                .inner
                .shared
                .as_ref()
                .map(|_| shared::wire_form(&record)),
            egress: by_address,
            hardening: self.inner.floor.clone(),
        };
        // The semaphore is never closed; were it, creating without a slot is still correct.
        let _slot = match &self.inner.create_slots {
            Some(s) => s.acquire().await.ok(),
            None => None,
        };
        // A panic while the runtime makes this sandbox (a bug in Warren or a runtime) is this
        // sandbox's failure alone: it is marked Failed with what could be made of it released,
        // instead of a task that ends silently and a record left Pending for ever.
        let provisioned = std::panic::AssertUnwindSafe(self.provision(
            &id,
            &spec,
            egress.as_ref(),
            &policy,
            plan.credential_proxy,
        ));
        let created = match futures::FutureExt::catch_unwind(provisioned).await {
            Ok(created) => created,
            Err(_) => return Err(self.failed_by_panic(&entry, "creating the sandbox").await),
        };
        match created {
            Ok((state, link)) => {
                let made = self.update(&entry, |r| {
                    r.runtime_state = state;
                    r.network_link = link;
                });
                if let Some(pre_start) = &hooks.pre_start {
                    if let Some(failed) = self.pre_start(&entry, &made, pre_start).await {
                        return Ok(failed);
                    }
                }
                let rec = self.update(&entry, |r| {
                    moved(r, SandboxState::Running, Some("ready"), None);
                });
                // Idle from now, not from the server's start.
                self.inner.activity.touch(&id);
                self.arm_periodic(&id, &hooks.periodic);
                if self.inner.shared.is_none() {
                    // With shared records, ends come from the records' feed (`shared`).
                    self.watch(&rec);
                }
                if rec.warm_pool.is_some() {
                    // A pool's sandbox waits for a client whose first command should not pay for
                    // the connect. Others open theirs on first use: a parked connection is ~17 KiB
                    // of server memory, which an idle sandbox nobody has called yet need not hold.
                    self.inner.execd_conns.prewarm(
                        id.clone(),
                        self.endpoint_of(&rec),
                        self.execd_live(&id),
                    );
                }
                Ok(rec)
            }
            Err(e) => {
                self.inner
                    .entries
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
                let _ = self.inner.store.remove(&id);
                let _ = self.inner.images.release(&id);
                Err(e)
            }
        }
    }

    /// Runs a new sandbox's `preStart` hook before it is reported Running. `None` when it
    /// succeeded; else the sandbox, ended Failed with the hook's exit code and the end of its output
    /// (what the runtime made of it released, as for a sandbox whose processes ended).
    async fn pre_start(
        &self,
        entry: &Arc<Entry>,
        rec: &SandboxRecord,
        hook: &crate::hooks::Hook,
    ) -> Option<SandboxRecord> {
        let run = crate::hooks::run(&self.endpoint_of(rec), "preStart", hook).await;
        let (ok, summary) = (run.succeeded(), run.summary());
        self.inner.hook_runs.record(&rec.id, run);
        if ok {
            return None;
        }
        tracing::info!(sandbox_id = %rec.id, hook = %summary, "the preStart hook failed");
        self.inner.execd_conns.forget(&rec.id);
        if let Err(e) = self
            .inner
            .runtime
            .destroy(&rec.id, &rec.runtime_state)
            .await
        {
            tracing::warn!(sandbox_id = %rec.id, error = %e, "removing a sandbox whose preStart hook failed");
        }
        self.unlink(&rec.id).await;
        let _ = self.inner.images.release(&rec.id);
        Some(self.update(entry, |r| {
            moved(
                r,
                SandboxState::Failed,
                Some(REASON_PRE_START_FAILED),
                Some(format!("the preStart hook failed: {summary}")),
            )
        }))
    }

    /// Runs `periodic` hooks of sandbox `id` on their schedules while it lives: each in a task of
    /// its own, one run at a time (a run that outlasts its interval delays the next), skipped while
    /// the sandbox is not Running, and ended once the sandbox is.
    fn arm_periodic(&self, id: &str, periodic: &[crate::hooks::Periodic]) {
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
                            tracing::debug!(sandbox_id = %id, error = %e.message, "wake on access");
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
    async fn idle_loop(self) {
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
                            tracing::debug!(sandbox_id = %rec.id, error = %e.message, "idle pause skipped")
                        }
                    }
                });
            }
        }
    }

    /// Asks the sandbox's activity probe whether it is busy.
    async fn probe_active(&self, rec: &SandboxRecord, probe: &crate::idle::Probe) -> bool {
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

    /// The runtime's part of a create: the sandbox made, then its network link (and credential
    /// proxy) if its policy lets anything out; a failure of the link undoes the sandbox.
    async fn provision(
        &self,
        id: &str,
        spec: &SandboxSpec,
        egress: Option<&Arc<warren_egress::Egress>>,
        policy: &warren_egress::NetworkPolicy,
        credential_proxy: bool,
    ) -> Result<(warren_core::RuntimeState, Option<u32>), ApiError> {
        match self.inner.runtime.create(spec).await {
            Ok(state) => match egress {
                // The link comes once the sandbox's namespace exists; a failure undoes the create.
                Some(eg) => {
                    let linked = match self.link(eg, id, &state, policy.clone(), None).await {
                        Ok(index) if credential_proxy => {
                            self.start_credential_proxy(eg, id).await.map(|()| index)
                        }
                        other => other,
                    };
                    match linked {
                        Ok(index) => Ok((state, Some(index))),
                        Err(e) => {
                            let _ = self.inner.runtime.destroy(id, &state).await;
                            self.unlink(id).await;
                            Err(e)
                        }
                    }
                }
                None => Ok((state, None)),
            },
            Err(e) => Err(match crate::disk_space::shortage(&self.inner.data_dir) {
                // Filled while this create ran: say so, as the runtime's own error rarely can.
                Some(why) => crate::disk_space::insufficient(format!(
                    "creating the sandbox failed: {why} ({e})"
                )),
                None => ApiError::from_runtime("creating the sandbox", e),
            }),
        }
    }

    /// After a panic in a task of the sandbox in `entry` (`task` says which): releases what the
    /// runtime made of it (by the state on record: none yet while it is created), marks it Failed,
    /// and returns the "internal error" a caller waiting for that task gets.
    async fn failed_by_panic(&self, entry: &Entry, task: &str) -> ApiError {
        let (id, state) = {
            let r = lock(&entry.record);
            (r.id.clone(), r.runtime_state.clone())
        };
        tracing::error!(sandbox_id = %id, task, "a sandbox's task panicked; it is marked Failed");
        if let Err(e) = self.inner.runtime.destroy(&id, &state).await {
            tracing::warn!(sandbox_id = %id, error = %e, "cleaning up after the panic failed");
        }
        self.unlink(&id).await;
        let _ = self.inner.images.release(&id);
        self.inner.execd_conns.forget(&id);
        let message = format!("{task} panicked (a bug in Warren); the server's log has it");
        self.update(entry, |r| {
            moved(
                r,
                SandboxState::Failed,
                Some("internal_error"),
                Some(message.clone()),
            )
        });
        ApiError::internal(
            task,
            &std::io::Error::other(format!("sandbox {id}: {message}")),
        )
    }

    /// Gives a sandbox its network link (`index` re-adopts an existing one).
    async fn link(
        &self,
        egress: &Arc<warren_egress::Egress>,
        id: &str,
        state: &warren_core::RuntimeState,
        policy: warren_egress::NetworkPolicy,
        index: Option<u32>,
    ) -> Result<u32, ApiError> {
        let links = self.inner.runtime.links().ok_or_else(|| {
            ApiError::internal(
                "linking the sandbox",
                &std::io::Error::other("the runtime gives sandboxes no link"),
            )
        })?;
        let pid = links.network_pid(state).ok_or_else(|| {
            ApiError::internal(
                "linking the sandbox",
                &std::io::Error::other("its init process is gone"),
            )
        })?;
        let (eg, id2) = (egress.clone(), id.to_string());
        let link = tokio::task::spawn_blocking(move || eg.attach(&id2, pid, policy, index))
            .await
            .map_err(|e| ApiError::internal("linking the sandbox", &e))?
            .map_err(|e| match e {
                // Capacity, not a fault: every address of the subnet is some sandbox's; as with
                // other exhausted capacity, 429 and a retry later.
                warren_egress::EgressError::Exhausted(_) => ApiError::new(
                    http::StatusCode::TOO_MANY_REQUESTS,
                    ErrorCode::Unknown,
                    format!("giving the sandbox its network link: {e}; [network] subnet sets how many sandboxes with a network policy can exist at once"),
                ),
                e => ApiError::internal("giving the sandbox its network link", &e),
            })?;
        Ok(link.index)
    }

    /// Turns the credential proxy on and puts its CA into the sandbox's trust store.
    async fn start_credential_proxy(
        &self,
        egress: &Arc<warren_egress::Egress>,
        id: &str,
    ) -> Result<(), ApiError> {
        let pem = egress
            .enable_credential_proxy(id)
            .map_err(|e| ApiError::internal("starting the credential proxy", &e))?;
        let endpoint = self
            .execd_endpoint(id)
            .ok_or_else(|| ApiError::not_found(id))?;
        crate::network::install_ca(&endpoint, &pem)
            .await
            .map_err(|e| {
                ApiError::internal(
                    "installing the credential proxy's CA in the sandbox",
                    &std::io::Error::other(e),
                )
            })
    }

    pub fn network(&self) -> &Network {
        &self.inner.network
    }

    /// Removes what the egress controller holds for a sandbox (nothing when it never had a link).
    async fn unlink(&self, id: &str) {
        if let Some(eg) = self.inner.network.started() {
            if eg.has(id) {
                let (eg, id) = (eg.clone(), id.to_string());
                let _ = tokio::task::spawn_blocking(move || eg.detach(&id)).await;
            }
        }
    }

    pub fn network_shutdown(&self) {
        self.inner.network.shutdown();
    }

    pub fn default_network_policy(&self) -> warren_egress::NetworkPolicy {
        self.inner.network.default_policy()
    }

    /// The sandbox's egress policy.
    pub fn network_policy(&self, id: &str) -> Result<warren_egress::NetworkPolicy, ApiError> {
        let rec = self.get(id).ok_or_else(|| ApiError::not_found(id))?;
        Ok(match rec.network_policy {
            None => self.inner.network.default_policy(),
            // A record this server cannot read (a field of a newer version's, say) fails closed:
            // the default may be allow-all.
            Some(v) => serde_json::from_value(v).unwrap_or_else(|e| {
                tracing::warn!(sandbox_id = %id, error = %e, "unreadable stored network policy; treating it as deny-all");
                warren_egress::NetworkPolicy::deny_all()
            }),
        })
    }

    /// Turns the credential proxy on for a running sandbox that was made without it (a sandbox
    /// from a template, whose first vault create asks for it): the proxy's CA goes into its trust
    /// and the record keeps the choice, so a restarted server starts the proxy again. Needs the
    /// sandbox's network link: a vault for a sandbox that reaches nothing would inject nowhere.
    pub async fn enable_credential_proxy(&self, id: &str) -> Result<(), ApiError> {
        let entry = self.live_entry(id)?;
        let _op = entry.op.lock().await;
        self.still_known(id, &entry)?;
        let rec = lock(&entry.record).clone();
        if rec.credential_proxy {
            return Ok(());
        }
        if rec.state != SandboxState::Running {
            return Err(ApiError::conflict(
                ErrorCode::SandboxNotRunning,
                format!("sandbox {id} is {}", rec.state.as_str()),
            ));
        }
        if rec.network_link.is_none() {
            return Err(ApiError::conflict(
                ErrorCode::InvalidState,
                format!(
                    "sandbox {id} reaches no network, so a credential vault would inject nowhere: give it a networkPolicy that lets it reach something first (PUT /sandboxes/{id}/networkpolicy)"
                ),
            ));
        }
        let eg = self.inner.network.egress().await?;
        self.start_credential_proxy(&eg, id).await?;
        let mut updated = rec;
        updated.credential_proxy = true;
        if let Err(e) = self.share(&updated).await {
            tracing::warn!(sandbox_id = %id, error = %e.message, "the credential proxy is on but its record was not shared");
        }
        self.update(&entry, |r| r.credential_proxy = true);
        Ok(())
    }

    /// Changes a running sandbox's egress policy; in force when this returns.
    pub async fn update_network_policy(
        &self,
        id: &str,
        change: impl FnOnce(&mut warren_egress::NetworkPolicy),
    ) -> Result<warren_egress::NetworkPolicy, ApiError> {
        let entry = self.live_entry(id)?;
        let _op = entry.op.lock().await;
        self.still_known(id, &entry)?;
        let rec = lock(&entry.record).clone();
        if !matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
            return Err(ApiError::conflict(
                ErrorCode::SandboxNotRunning,
                format!("sandbox {id} is {}", rec.state.as_str()),
            ));
        }
        let mut policy = self.network_policy(id)?;
        change(&mut policy);
        let caps = self.inner.runtime.capabilities();
        if !caps.egress_policy && caps.egress_addresses {
            // The runtime's backend enforces it; the record follows once it is in force.
            let by_address = match needs_link(&policy) {
                true => Some(runtime_policy(
                    &policy,
                    &self.inner.runtime.name(),
                    caps.egress_names,
                )?),
                false => None,
            };
            let credential = crate::tokens::execd_credential(&rec.token);
            let enforcer = self.inner.runtime.enforcer().ok_or_else(|| {
                ApiError::from_runtime(
                    "updating the policy",
                    RuntimeError::Unsupported(format!(
                        "{} do not enforce network policies themselves",
                        self.inner.runtime.sandboxes_described()
                    )),
                )
            })?;
            enforcer
                .set_egress(id, &rec.runtime_state, by_address.as_ref(), &credential)
                .await
                .map_err(|e| ApiError::from_runtime("updating the policy", e))?;
            let value = serde_json::to_value(&policy).ok();
            let mut updated = rec.clone();
            updated.network_policy = value.clone();
            if let Err(e) = self.share(&updated).await {
                tracing::warn!(sandbox_id = %id, error = %e.message, "the new policy is in force but its record was not shared");
            }
            self.update(&entry, |r| r.network_policy = value);
            return Ok(policy);
        }
        let link = match rec.network_link {
            Some(index) => {
                let eg = self.inner.network.egress().await?;
                let (p, id2) = (policy.clone(), id.to_string());
                tokio::task::spawn_blocking(move || eg.set_policy(&id2, p))
                    .await
                    .map_err(|e| ApiError::internal("updating the policy", &e))?
                    .map_err(|e| ApiError::internal("updating the policy", &e))?;
                Some(index)
            }
            None if needs_link(&policy) => {
                if !self.inner.runtime.capabilities().egress_policy {
                    return Err(ApiError::new(
                        http::StatusCode::BAD_REQUEST,
                        ErrorCode::ApiNotSupported,
                        format!(
                            "Warren cannot enforce network policies on {}",
                            self.inner.runtime.sandboxes_described()
                        ),
                    ));
                }
                let eg = self.inner.network.egress().await?;
                Some(
                    self.link(&eg, id, &rec.runtime_state, policy.clone(), None)
                        .await?,
                )
            }
            None => None,
        };
        let value = serde_json::to_value(&policy).ok();
        self.update(&entry, |r| {
            r.network_policy = value;
            r.network_link = link;
        });
        Ok(policy)
    }

    /// Watches a running sandbox: if its processes end by themselves it becomes Terminated (exit 0) or
    /// Failed, its resources are released, and its record stays to say why.
    fn watch(&self, rec: &SandboxRecord) {
        let this = self.clone();
        let id = rec.id.clone();
        let exit = self.inner.runtime.wait_exit(&rec.id, &rec.runtime_state);
        let watcher = self.clone();
        let watched = id.clone();
        let watch = async move {
            let info = exit.await;
            let Some(entry) = this.entry(&id) else { return };
            let _op = entry.op.lock().await;
            let rec = lock(&entry.record).clone();
            if rec.state.is_terminal() || rec.state == SandboxState::Stopping {
                return;
            }
            let (state, message) = ended_by_itself(&info);
            tracing::info!(sandbox_id = %id, %message, "sandbox ended by itself");
            if let Err(e) = this.inner.runtime.destroy(&id, &rec.runtime_state).await {
                tracing::warn!(sandbox_id = %id, error = %e, "cleaning up an ended sandbox failed");
            }
            this.unlink(&id).await;
            let _ = this.inner.images.release(&id);
            this.update(&entry, |r| {
                moved(r, state, Some("process_exited"), Some(message))
            });
            this.inner.execd_conns.forget(&id);
        };
        tokio::spawn(async move {
            // A panic here is this sandbox's alone: it ends Failed, not running unwatched.
            if futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(watch))
                .await
                .is_err()
            {
                if let Some(entry) = watcher.entry(&watched) {
                    let _op = entry.op.lock().await;
                    if !lock(&entry.record).state.is_terminal() {
                        watcher
                            .failed_by_panic(&entry, "watching the sandbox")
                            .await;
                    }
                }
            }
        });
    }

    fn live_entry(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        self.entry(id).ok_or_else(|| ApiError::not_found(id))
    }

    /// After waiting for a sandbox's operation lock: a user's delete that held it forgot the
    /// sandbox, and what waited behind it answers as for any unknown sandbox (404), not with the
    /// Terminated state of a record nobody can see any more.
    fn still_known(&self, id: &str, entry: &Arc<Entry>) -> Result<(), ApiError> {
        match self.entry(id) {
            Some(current) if Arc::ptr_eq(&current, entry) => Ok(()),
            _ => Err(ApiError::not_found(id)),
        }
    }

    /// Kills a sandbox. Its record is kept as Terminated with `reason` for the retention period,
    /// except after a user's delete, which forgets it at once.
    pub async fn delete(&self, id: &str, reason: &str) -> Result<(), ApiError> {
        let entry = self.live_entry(id)?;
        let _op = entry.op.lock().await;
        self.still_known(id, &entry)?;
        let rec = lock(&entry.record).clone();
        // A sandbox whose delete failed still holds what the runtime made: a delete tries again.
        if rec.state.is_terminal() && rec.reason.as_deref() != Some(REASON_DELETE_FAILED) {
            if reason == REASON_USER_DELETE {
                // Ended on its own and still listed: what it held went when it ended; a user's
                // delete takes its record out of the list too (204, as the reference answers).
                self.forget(id);
                return Ok(());
            }
            return Err(ApiError::new(
                http::StatusCode::NOT_FOUND,
                ErrorCode::SandboxNotFound,
                format!("sandbox {id} is already {}", rec.state.as_str()),
            ));
        }
        let mut stopping = rec.clone();
        moved(&mut stopping, SandboxState::Stopping, Some(reason), None);
        match self.share(&stopping).await {
            // Gone already (removed by another replica, or behind Warren's back): still removed.
            Err(e) if e.status != http::StatusCode::NOT_FOUND => return Err(e),
            _ => {}
        }
        self.update(&entry, |r| *r = stopping);
        self.inner.execd_conns.forget(id);
        let result = self.inner.runtime.destroy(id, &rec.runtime_state).await;
        if let Err(RuntimeError::Unavailable(_)) = &result {
            // Nothing was removed: the sandbox stays as it was, and the delete can be retried.
            if let Err(e) = self.share(&rec).await {
                tracing::warn!(sandbox_id = %id, error = %e.message, "could not take back the record of a delete that failed");
            }
            self.update(&entry, |r| r.take_back(&rec));
            return Err(ApiError::from_runtime(
                "deleting the sandbox",
                result
                    .err()
                    .unwrap_or_else(|| RuntimeError::Unavailable(String::new())),
            ));
        }
        let _ = self.inner.images.release(id);
        self.unlink(id).await;
        match result {
            Ok(()) => {
                self.update(&entry, |r| {
                    moved(r, SandboxState::Terminated, Some(reason), None)
                });
                if reason == REASON_USER_DELETE {
                    // A deleted sandbox is gone at once, as in the reference: clients that count their
                    // sandboxes by a metadata tag (the official client-side pools) wait for the list to
                    // shrink. Sandboxes that ended on their own stay visible for the retention period.
                    self.forget(id);
                }
                Ok(())
            }
            Err(e) => {
                let err = ApiError::from_runtime("deleting the sandbox", e);
                self.update(&entry, |r| {
                    moved(
                        r,
                        SandboxState::Failed,
                        Some(REASON_DELETE_FAILED),
                        Some(err.message.clone()),
                    )
                });
                Err(err)
            }
        }
    }

    pub async fn pause(&self, id: &str) -> Result<(), ApiError> {
        self.freeze_for(id, true, "user_pause").await
    }

    pub async fn resume(&self, id: &str) -> Result<(), ApiError> {
        self.freeze_for(id, false, "user_resume").await
    }

    /// Pause (`true`) or resume, for `reason` (a user's call, an idle timeout, a wake on access):
    /// Running → Pausing → Paused, or Paused → Resuming → Running; on a runtime error the sandbox
    /// stays where it was.
    async fn freeze_for(&self, id: &str, pause: bool, reason: &str) -> Result<(), ApiError> {
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
        let entry = self.live_entry(id)?;
        let _op = entry.op.lock().await;
        self.still_known(id, &entry)?;
        let rec = lock(&entry.record).clone();
        if rec.state != from {
            return Err(ApiError::conflict(
                code,
                format!(
                    "sandbox {id} is {}, not {}",
                    rec.state.as_str(),
                    from.as_str()
                ),
            ));
        }
        self.update(&entry, |r| moved(r, via, None, None));
        let result = if pause {
            self.inner.runtime.pause(id, &rec.runtime_state).await
        } else {
            self.inner.runtime.resume(id, &rec.runtime_state).await
        };
        match result {
            Ok(()) => {
                if !pause {
                    // A resumed sandbox is idle from its resume.
                    self.inner.activity.touch(id);
                }
                self.update(&entry, |r| moved(r, to, Some(reason), None));
                Ok(())
            }
            Err(e) => {
                self.update(&entry, |r| moved(r, from, None, None));
                Err(ApiError::from_runtime(context, e))
            }
        }
    }

    /// Gives a sandbox made ahead of need the CPU share every sandbox has.
    fn promote(&self, id: &str) {
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

    /// Captures the file system of sandbox `id` as the store image `image_name`: its image's
    /// layers plus its writable layer. A running sandbox is frozen for the copy (its processes stop
    /// for that long and continue after, memory intact), a paused one stays paused.
    /// Captures sandbox `id`'s files as image `image_name`; answers the bytes it adds to the store
    /// (its own layer's; the ones below are its sandbox's image's).
    pub async fn capture(&self, id: &str, image_name: &str) -> Result<u64, ApiError> {
        let entry = self.live_entry(id)?;
        let _op = entry.op.lock().await;
        self.still_known(id, &entry)?;
        let rec = lock(&entry.record).clone();
        snapshot_source_state(&rec)?;
        self.check_snapshots()?;
        let layers = self
            .inner
            .runtime
            .layers()
            .ok_or_else(|| self.snapshots_unsupported())?;
        let upper = layers.upper_dir(id);
        let images = self.inner.images.clone();
        let holder = id.to_owned();
        let base = tokio::task::spawn_blocking(move || images.leased(&holder))
            .await
            .map_err(|e| ApiError::internal("reading the sandbox's image", &e))?
            .map_err(|e| ApiError::internal("reading the sandbox's image", &e))?
            .ok_or_else(|| {
                ApiError::new(
                    http::StatusCode::BAD_REQUEST,
                    ErrorCode::ApiNotSupported,
                    format!("sandbox {id} runs the built-in host image (or one from before snapshots existed): nothing to snapshot"),
                )
            })?;
        let freeze = rec.state == SandboxState::Running;
        if freeze {
            self.inner
                .runtime
                .pause(id, &rec.runtime_state)
                .await
                .map_err(|e| ApiError::from_runtime("freezing the sandbox for its snapshot", e))?;
        }
        let images = self.inner.images.clone();
        let name = image_name.to_owned();
        let id_base = layers.id_base(id);
        let captured = tokio::task::spawn_blocking(move || {
            images.commit_snapshot(&name, &base, &upper, id_base)
        })
        .await;
        if freeze {
            if let Err(e) = self.inner.runtime.resume(id, &rec.runtime_state).await {
                tracing::error!(sandbox = id, "thawing after a snapshot failed: {e}");
            }
        }
        captured
            .map_err(|e| ApiError::internal("capturing the file system", &e))?
            .map_err(|e| match e {
                // What the sandbox made cannot be a layer (a path past what a layer holds): the
                // caller's to know, without the host path of the sandbox's folder.
                warren_image::ImageError::InvalidSource { reason, .. } => ApiError::new(
                    http::StatusCode::UNPROCESSABLE_ENTITY,
                    ErrorCode::SnapshotInvalidSourceState,
                    format!("the sandbox's files cannot be captured: {reason}"),
                ),
                e => ApiError::internal("capturing the file system", &e),
            })
            .map(|(_, adds)| adds)
    }

    pub async fn renew(
        &self,
        id: &str,
        expires_at: DateTime<Utc>,
    ) -> Result<DateTime<Utc>, ApiError> {
        self.renew_to(id, expires_at, false).await
    }

    /// Renew on access: like [`Sandboxes::renew`], but only ever later (a renew that landed
    /// meanwhile is not undone).
    pub async fn extend(
        &self,
        id: &str,
        expires_at: DateTime<Utc>,
    ) -> Result<DateTime<Utc>, ApiError> {
        self.renew_to(id, expires_at, true).await
    }

    async fn renew_to(
        &self,
        id: &str,
        expires_at: DateTime<Utc>,
        only_later: bool,
    ) -> Result<DateTime<Utc>, ApiError> {
        let entry = self.live_entry(id)?;
        let _op = entry.op.lock().await;
        self.still_known(id, &entry)?;
        let rec = lock(&entry.record).clone();
        if rec.state.is_terminal() || rec.state == SandboxState::Stopping {
            return Err(ApiError::conflict(
                ErrorCode::InvalidState,
                format!("sandbox {id} is {}", rec.state.as_str()),
            ));
        }
        if rec.expires_at.is_none() {
            return Err(ApiError::conflict(
                ErrorCode::InvalidExpiration,
                format!("sandbox {id} has no expiry (manual cleanup)"),
            ));
        }
        if expires_at <= Utc::now() {
            return Err(ApiError::bad_request(
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
        self.update(&entry, |r| r.expires_at = Some(expires_at));
        Ok(expires_at)
    }

    pub async fn patch_metadata(
        &self,
        id: &str,
        patch: Vec<(String, Option<String>)>,
    ) -> Result<SandboxRecord, ApiError> {
        let entry = self.live_entry(id)?;
        let _op = entry.op.lock().await;
        self.still_known(id, &entry)?;
        if lock(&entry.record).state.is_terminal() {
            return Err(ApiError::conflict(
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
        Ok(self.update(&entry, |r| r.metadata = patched.metadata))
    }

    /// Loads persisted records after a (re)start and re-attaches to sandboxes that still run.
    /// With shared records: follows the runtime's records instead, from the ones there now.
    pub async fn recover(&self) -> anyhow::Result<()> {
        if let Some(shared) = self.inner.shared.clone() {
            self.follow_shared(shared).await;
            return Ok(());
        }
        let (records, errors) = self.inner.store.load_all()?;
        for e in errors {
            tracing::error!(error = %e, "skipping an unreadable sandbox record");
        }
        for mut rec in records {
            if !rec.state.is_terminal() {
                let liveness = if rec.runtime_state.is_null() {
                    Liveness::Gone
                } else {
                    self.inner
                        .runtime
                        .liveness(&rec.id, &rec.runtime_state)
                        .await
                };
                match (rec.state, liveness) {
                    (SandboxState::Stopping, _) => {
                        // A delete was in flight: finish it, whether or not its kill already
                        // landed (the reason stays the delete's, not "lost").
                        let _ = self
                            .inner
                            .runtime
                            .destroy(&rec.id, &rec.runtime_state)
                            .await;
                        let _ = self.inner.images.release(&rec.id);
                        let reason = rec.reason.clone();
                        moved(&mut rec, SandboxState::Terminated, reason.as_deref(), None);
                        self.persist(&rec);
                    }
                    (_, Liveness::Gone) => {
                        let _ = self
                            .inner
                            .runtime
                            .destroy(&rec.id, &rec.runtime_state)
                            .await;
                        let _ = self.inner.images.release(&rec.id);
                        let was = rec.state;
                        moved(&mut rec,
                            SandboxState::Failed,
                            Some("lost"),
                            Some(format!("the sandbox's processes ended while the server was down (it was {})", was.as_str())),
                        );
                        self.persist(&rec);
                    }
                    (SandboxState::Running, Liveness::Paused) => {
                        // Frozen by a step the server did not finish (a snapshot's copy, a pause
                        // it had not recorded, so never answered): thawed, as the record says.
                        if let Err(e) = self.inner.runtime.resume(&rec.id, &rec.runtime_state).await
                        {
                            tracing::warn!(sandbox_id = %rec.id, error = %e, "thawing a sandbox left frozen failed");
                            let reason = rec.reason.clone();
                            moved(&mut rec, SandboxState::Paused, reason.as_deref(), None);
                            self.persist(&rec);
                        }
                    }
                    (_, Liveness::Paused) => {
                        let reason = rec.reason.clone();
                        moved(&mut rec, SandboxState::Paused, reason.as_deref(), None);
                        self.persist(&rec);
                    }
                    (_, Liveness::Running) => {
                        if rec.state != SandboxState::Running {
                            moved(&mut rec, SandboxState::Running, None, None);
                            self.persist(&rec);
                        }
                    }
                }
            }
            let watch = rec.state == SandboxState::Running || rec.state == SandboxState::Paused;
            let entry = Arc::new(Entry::new(&rec, true));
            self.inner
                .entries
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.id.clone(), entry);
            if watch {
                if let Some(index) = rec.network_link {
                    // The link survived in the sandbox's namespace; the firewall's sets did not.
                    let policy = self
                        .network_policy(&rec.id)
                        .unwrap_or_else(|_| self.inner.network.default_policy());
                    let relinked = match self.inner.network.egress().await {
                        Ok(eg) => self
                            .link(&eg, &rec.id, &rec.runtime_state, policy, Some(index))
                            .await
                            .map(|_| ()),
                        Err(e) => Err(e),
                    };
                    let relinked = match relinked {
                        // The proxy's CA key lived in the old process: a new CA goes in.
                        Ok(()) if rec.credential_proxy => match self.inner.network.egress().await {
                            Ok(eg) => self.start_credential_proxy(&eg, &rec.id).await,
                            Err(e) => Err(e),
                        },
                        other => other,
                    };
                    if let Err(e) = relinked {
                        tracing::error!(sandbox_id = %rec.id, error = %e.message, "re-attaching the network link failed");
                    }
                }
                self.watch(&rec);
                if let Some(hooks) = rec
                    .lifecycle_hooks
                    .as_ref()
                    .and_then(|v| serde_json::from_value::<crate::hooks::Hooks>(v.clone()).ok())
                {
                    self.arm_periodic(&rec.id, &hooks.periodic);
                }
            }
        }
        let known: Vec<String> = self
            .all()
            .into_iter()
            .filter(|r| !r.state.is_terminal())
            .map(|r| r.id)
            .collect();
        self.inner.runtime.sweep_orphans(&known).await;
        Ok(())
    }

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

    async fn reap(self) {
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
                                    tracing::debug!(sandbox_id = %rec.id, error = %e.message, "expiry skipped")
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

    /// Drops an ended sandbox's record: list and get no longer know it.
    fn forget(&self, id: &str) {
        self.inner.hook_runs.forget(id);
        self.inner.activity.forget(id);
        self.inner
            .entries
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        if self.inner.shared.is_none() {
            let _ = self.inner.store.remove(id);
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

/// The state and message of a sandbox that ended by itself (or was removed outside Warren).
fn ended_by_itself(info: &warren_core::ExitInfo) -> (SandboxState, String) {
    let (state, message) = match (info.code, info.signal) {
        _ if info.vanished => (
            SandboxState::Terminated,
            "the sandbox was removed outside Warren".to_string(),
        ),
        (Some(0), _) => (
            SandboxState::Terminated,
            "the main process exited with code 0".to_string(),
        ),
        (Some(c), _) => (
            SandboxState::Failed,
            format!("the main process exited with code {c}"),
        ),
        (None, Some(s)) => (
            SandboxState::Failed,
            format!("the main process was killed by signal {s}"),
        ),
        (None, None) => (
            SandboxState::Failed,
            "the sandbox's processes ended".to_string(),
        ),
    };
    let message = match &info.detail {
        Some(detail) => format!("{message} ({detail})"),
        None => message,
    };
    (state, message)
}

fn image_error(name: &str, e: warren_image::ImageError) -> ApiError {
    match e {
        warren_image::ImageError::NotFound { .. } => ApiError::new(
            http::StatusCode::NOT_FOUND,
            ErrorCode::ImageNotFound,
            format!("image {name:?} is not in the local store and this server does not pull ([images] pull = \"never\"); pull it with `warren image pull {name}`, import it with `warren image import {name} PATH`, or use the built-in \"host\" image"),
        ),
        warren_image::ImageError::InvalidName { .. } => ApiError::invalid(format!("invalid image reference {name:?}")),
        other => ApiError::internal("resolving the image", &other),
    }
}

/// Snapshots are taken of Running or Paused sandboxes only (409 otherwise).
pub fn snapshot_source_state(rec: &SandboxRecord) -> Result<(), ApiError> {
    if matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
        return Ok(());
    }
    Err(ApiError::conflict(
        ErrorCode::SnapshotInvalidSourceState,
        format!(
            "sandbox {} is {}; snapshots are taken of Running or Paused sandboxes",
            rec.id,
            rec.state.as_str()
        ),
    ))
}

/// The main process of a create that names none: the image's Entrypoint + Cmd, as `docker run`
/// would start (store images; an Engine image's config is the daemon's to read), else a process
/// that keeps the sandbox up.
fn default_entrypoint(image: &SandboxImage) -> Vec<String> {
    if let SandboxImage::Resolved(warren_image::ResolvedImage::Layers { config, .. }) = image {
        let argv: Vec<String> = config
            .entrypoint
            .iter()
            .chain(&config.cmd)
            .cloned()
            .collect();
        if argv.first().is_some_and(|a| !a.is_empty()) {
            return argv;
        }
    }
    vec!["tail".into(), "-f".into(), "/dev/null".into()]
}

/// A failed pull as the create's answer: the message names the image and the cause.
fn pull_error(e: &warren_registry::PullError) -> ApiError {
    use warren_registry::PullErrorKind as K;
    let (status, code) = match e.kind() {
        K::BadName => (http::StatusCode::BAD_REQUEST, ErrorCode::InvalidParameter),
        K::NotFound => (http::StatusCode::NOT_FOUND, ErrorCode::ImageNotFound),
        K::Denied => (http::StatusCode::FORBIDDEN, ErrorCode::ImagePullDenied),
        K::Upstream => (http::StatusCode::BAD_GATEWAY, ErrorCode::ImagePullFailed),
        K::Invalid => (
            http::StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::ImageInvalid,
        ),
        K::Internal => return ApiError::internal("pulling the image", e),
    };
    ApiError::new(status, code, e.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use warren_core::{ExitInfo, RuntimeState};

    /// A runtime that panics while it makes a sandbox (`in_create`) or else while it waits for
    /// one to end, counting the clean-ups the server asks of it.
    #[derive(Default)]
    struct PanickingRuntime {
        in_create: bool,
        destroyed: AtomicU32,
    }

    #[async_trait::async_trait]
    impl Runtime for PanickingRuntime {
        fn name(&self) -> String {
            "panicking".into()
        }
        fn features(&self) -> warren_core::RuntimeFeatures {
            warren_core::fake::FEATURES
        }
        async fn create(&self, _spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError> {
            if self.in_create {
                panic!("a bug while making the sandbox")
            }
            Ok(serde_json::json!({"made": true}))
        }
        fn execd_address(&self, id: &str, _: &RuntimeState) -> warren_core::ExecdAddress {
            warren_core::ExecdAddress::Unix(PathBuf::from(format!("/nonexistent/{id}")))
        }
        fn wait_exit(
            &self,
            _: &str,
            _: &RuntimeState,
        ) -> futures::future::BoxFuture<'static, ExitInfo> {
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                panic!("a bug while watching the sandbox")
            })
        }
        async fn pause(&self, _: &str, _: &RuntimeState) -> Result<(), RuntimeError> {
            Ok(())
        }
        async fn resume(&self, _: &str, _: &RuntimeState) -> Result<(), RuntimeError> {
            Ok(())
        }
        async fn destroy(&self, _: &str, _: &RuntimeState) -> Result<(), RuntimeError> {
            self.destroyed.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        async fn liveness(&self, _: &str, _: &RuntimeState) -> Liveness {
            Liveness::Gone
        }
    }

    /// A create of the smallest kind, for a runtime that takes image references.
    pub(crate) fn plan() -> CreatePlan {
        CreatePlan {
            image: "any:latest".into(),
            snapshot_id: None,
            warm_pool: None,
            image_auth: None,
            volumes: Vec::new(),
            entrypoint: Some(vec!["true".into()]),
            timeout_seconds: Some(60),
            limits: warren_core::ResourceLimits {
                cpu_millis: None,
                memory_bytes: None,
                pids: 64,
                disk_bytes: None,
            },
            env: BTreeMap::new(),
            metadata: BTreeMap::new(),
            extensions: BTreeMap::new(),
            network_policy: None,
            credential_proxy: false,
            hooks: Default::default(),
            tenant: warren_store::default_tenant(),
        }
    }

    /// Sandboxes over `runtime`, with everything else in `dir`.
    pub(crate) fn sandboxes(dir: &Path, runtime: Arc<dyn Runtime>) -> Sandboxes {
        Sandboxes::new(
            dir,
            runtime,
            Store::open(dir).expect("store"),
            ImageStore::open(dir).expect("images"),
            Arc::new(
                Network::new(&crate::config::NetworkSection::default(), dir).expect("network"),
            ),
            Options {
                retention_seconds: 3600,
                registries: None,
                max_pulls: 1,
                default_env: BTreeMap::new(),
                floor: None,
                caps: Caps {
                    sandboxes: 10,
                    creates_in_flight: 10,
                },
            },
        )
    }

    #[tokio::test]
    async fn a_panic_while_creating_fails_that_sandbox_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let runtime = Arc::new(PanickingRuntime {
            in_create: true,
            ..Default::default()
        });
        let sandboxes = sandboxes(dir.path(), runtime.clone());
        for _ in 0..2 {
            let err = tokio::spawn({
                let sandboxes = sandboxes.clone();
                async move { sandboxes.create(plan()).await }
            })
            .await
            .expect("the panic stays inside the create")
            .expect_err("the create fails");
            assert_eq!(err.status, http::StatusCode::INTERNAL_SERVER_ERROR);
        }
        let records = sandboxes.all();
        assert_eq!(records.len(), 2, "both kept to say why: {records:?}");
        for r in &records {
            assert_eq!(r.state, SandboxState::Failed);
            assert_eq!(r.reason.as_deref(), Some("internal_error"));
        }
        assert_eq!(
            runtime.destroyed.load(Ordering::SeqCst),
            2,
            "each cleaned up"
        );
        // the records on disk say the same: a restart does not find them Pending
        let (stored, _) = Store::open(dir.path())
            .expect("reopen")
            .load_all()
            .expect("load");
        assert!(
            stored.iter().all(|r| r.state == SandboxState::Failed),
            "{stored:?}"
        );
    }

    #[tokio::test]
    async fn a_panic_while_watching_fails_that_sandbox_and_cleans_it_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let runtime = Arc::new(PanickingRuntime::default());
        let sandboxes = sandboxes(dir.path(), runtime.clone());
        let rec = sandboxes.create(plan()).await.expect("made");
        assert_eq!(rec.state, SandboxState::Running);
        let failed = async {
            loop {
                match sandboxes.get(&rec.id) {
                    Some(r) if r.state == SandboxState::Failed => return r,
                    _ => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        };
        let r = tokio::time::timeout(Duration::from_secs(10), failed)
            .await
            .expect("marked Failed");
        assert_eq!(r.reason.as_deref(), Some("internal_error"));
        assert_eq!(
            runtime.destroyed.load(Ordering::SeqCst),
            1,
            "its sandbox removed"
        );
    }
}
