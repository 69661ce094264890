//! The sandbox registry: the single owner of every sandbox's record. Each lifecycle verb takes the
//! sandbox's operation lock, moves the state machine, persists the record, and drives the runtime.
//! Background tasks watch for sandboxes whose processes end on their own and for expiry.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex, RwLock};

use warren_api::lifecycle::SandboxState;
use warren_api::ErrorCode;
use warren_core::{Runtime, RuntimeExt};
use warren_image::ImageStore;
use warren_store::{SandboxRecord, Store};

use crate::error::{ErrorKind, SandboxError};
use crate::execd_conns::ExecdConns;
use crate::network::Network;

mod activity;
mod capture;
mod create;
mod egress;
mod entries;
mod expiry;
mod records;
mod shared;
#[cfg(test)]
pub(crate) mod tests;
mod verbs;
mod watch;

pub use capture::snapshot_source_state;
pub use create::{isolation_requested, ISOLATION_EXTENSION};
use entries::Entry;
pub use entries::{Events, LifecycleEvent};

/// The reason of a sandbox whose `preStart` hook failed.
pub const REASON_PRE_START_FAILED: &str = "prestart_hook_failed";
pub const REASON_USER_DELETE: &str = "user_delete";
pub const REASON_TTL_EXPIRY: &str = "ttl_expiry";
/// The runtime could not remove the sandbox: a delete (or its record's end) tries again.
pub const REASON_DELETE_FAILED: &str = "delete_failed";

#[derive(Clone)]
pub struct Sandboxes {
    inner: Arc<Inner>,
}

struct Inner {
    /// Checked for room before each create (`disk_space`).
    data_dir: PathBuf,
    runtime: Arc<dyn Runtime>,
    /// The journal, or the runtime's backend shared with other replicas (see `records`).
    records: Box<dyn records::Records>,
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
    /// How each sandbox's flight recorder is set.
    timeline: Arc<crate::timeline::Settings>,
    /// Timelines whose records were forgotten before their retention ended.
    kept_timelines: crate::timeline::Kept,
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

fn limit_reached(message: String) -> SandboxError {
    SandboxError::new(ErrorKind::Busy, ErrorCode::LimitReached, message)
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Moves a record through the store's transition table. A refused move is a bug (the verbs check
/// the state under the sandbox's lock first): it is logged, and the record stays as it was rather
/// than, say, a deleted sandbox coming back to Running.
fn moved(r: &mut SandboxRecord, to: SandboxState, reason: Option<&str>, message: Option<String>) {
    match r.transition(to, reason, message) {
        Ok(()) if to.is_terminal() => crate::metrics::sandbox_ended(to.as_str(), reason),
        Ok(()) => {}
        Err(e) => {
            tracing::error!(error = %e, "a state change the transition table refuses (a bug in Warren); the record stays as it was");
        }
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
    pub timeline: crate::timeline::Settings,
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
            timeline,
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
        let this = Self {
            inner: Arc::new(Inner {
                data_dir: data_dir.to_path_buf(),
                create_slots,
                records: match runtime.shared_records() {
                    Some(shared) => Box::new(records::Shared(shared)),
                    None => Box::new(records::Journal(store)),
                },
                runtime,
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
                timeline: Arc::new(timeline),
                kept_timelines: Default::default(),
            }),
        };
        this.inner
            .network
            .observe(Arc::new(egress::Recorder(Arc::downgrade(&this.inner))));
        this
    }
}
