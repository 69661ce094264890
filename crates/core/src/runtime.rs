//! The backend trait. A runtime turns a `SandboxSpec` into running isolation with execd as its first
//! process, and reports what it made as an opaque `RuntimeState` that the server persists and hands back
//! after a restart, so a backend can re-attach without the server knowing its internals.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::image::ResolvedImage;
use futures::future::BoxFuture;
pub use warren_api::lifecycle::{ExecdTransport, HostVolumes, ImageSource, RuntimeCapabilities};

/// Limits always applied; the server fills defaults for what the request leaves out.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResourceLimits {
    pub cpu_millis: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub pids: u64,
    /// `ephemeral-storage`: the most the sandbox's root filesystem may hold beyond its image.
    /// Records written before the field existed read as unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
}

/// The image of one sandbox, as its runtime's [`ImageSource`] needs it.
#[derive(Debug, Clone)]
pub enum SandboxImage {
    Resolved(ResolvedImage),
    Reference {
        name: String,
        auth: Option<warren_api::lifecycle::ImageAuth>,
    },
}

/// A storage mount, validated by the server (target path, allowed host folder, names).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeMount {
    /// Absolute, normalised path inside the sandbox.
    pub target: String,
    pub read_only: bool,
    pub source: VolumeSource,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum VolumeSource {
    /// A host folder (or file), already resolved: canonical, under an allowed path, `subPath` applied.
    Host(PathBuf),
    /// A named volume that outlives sandboxes; the runtime decides where it lives.
    Named {
        claim: String,
        /// Relative, normalised, without `..`.
        sub_path: Option<String>,
        create_if_missing: bool,
        /// Remove it with the sandbox, if this sandbox created it and nobody else uses it.
        delete_on_termination: bool,
    },
}

/// Everything a runtime needs to start one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: String,
    pub image: SandboxImage,
    pub entrypoint: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub limits: ResourceLimits,
    pub volumes: Vec<VolumeMount>,
    /// Made ahead of need (a warm pool's sandbox): while this is on, where the runtime can, the
    /// sandbox's CPU yields to the sandboxes in use, from its setup on, until [`Runtime::promote`].
    pub background: Background,
    /// The SHA-256 (hex) of the credential the server sends execd over TCP: a runtime whose execd
    /// listens on TCP starts it with `--access-token-sha256` this. Only the verifier enters the
    /// sandbox, where its processes can read it; the credential stays with the server.
    pub execd_verifier: String,
    /// Asked for isolated sessions inside (`extensions["bootstrap.execd.isolation"] = "enable"`):
    /// a runtime that can offer them starts what execd needs to make them.
    pub isolation: bool,
    /// With [`Runtime::shared_records`]: the sandbox's record, which the backend keeps with the
    /// sandbox from its creation on. `None` otherwise.
    pub record: Option<serde_json::Value>,
    /// With [`RuntimeCapabilities::egress_addresses`]: what the sandbox may reach, when its policy
    /// lets anything out (`None`: nothing, the default).
    pub egress: Option<crate::EgressPolicy>,
    /// The floor execd lays under user code (the operator's `[runtime] execd_run_as_init`):
    /// `None` when hardening is off.
    pub hardening: Option<warren_api::hardening::FloorPolicy>,
}

/// Whether sandboxes made ahead of need still yield their CPU (off by default: a sandbox someone
/// waits for never yields). Shared between the server and the creates in flight: the server turns
/// it off when clients start waiting for those sandboxes, even mid-create, then promotes the ones
/// already lowered; a runtime reads it before lowering a new sandbox's share and again after, so
/// that either order ends at the normal share.
#[derive(Debug, Clone, Default)]
pub struct Background(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Background {
    pub fn new(on: bool) -> Self {
        Self(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(on)))
    }

    pub fn is_on(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn set(&self, on: bool) {
        self.0.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Where execd listens, as the server reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecdAddress {
    /// A Unix socket on the server's host (only the host's root can connect).
    Unix(PathBuf),
    /// A TCP address (another host, a pod, or a loopback port): execd checks the credential.
    Tcp(std::net::SocketAddr),
    /// execd at `target` (its usual port), reached through the relay at `relay` (execd's `relay`
    /// mode), which a connection's first line tells where to: a network with no other way in.
    /// execd checks the credential.
    Relayed {
        relay: std::net::SocketAddr,
        target: std::net::IpAddr,
    },
}

/// Backend-specific facts about a live sandbox (pids, paths, container ids), persisted by the server.
pub type RuntimeState = serde_json::Value;

/// How a sandbox's main process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit code, or `None` when it was killed by a signal or the status could not be collected
    /// (e.g. after a server restart the sandbox is no longer our child).
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The sandbox was removed by someone else (a container deleted behind Warren's back), rather
    /// than ending by itself.
    pub vanished: bool,
    /// What the runtime knows of why (a Pod evicted for memory pressure), for the sandbox's status.
    pub detail: Option<String>,
}

/// What a runtime finds when asked about a sandbox it created earlier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    Running,
    Paused,
    Gone,
}

/// Error kinds the server maps onto statuses; backend detail stays in the message and source.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Exhausted(String),
    /// The image is not available to the runtime (and could not be pulled).
    #[error("{0}")]
    ImageNotFound(String),
    /// The request cannot be satisfied as given (a named volume that does not exist, …).
    #[error("{0}")]
    Invalid(String),
    /// The backend itself cannot be reached (a stopped Docker daemon): try again later.
    #[error("{0}")]
    Unavailable(String),
    /// The sandbox did not come up: it exited during its start, or missed the start timeout. The
    /// message is the caller's to read (unlike a backend failure's, which stays in the log).
    #[error("{0}")]
    StartFailed(String),
    #[error("{message}")]
    Backend {
        message: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl RuntimeError {
    pub fn backend(message: impl Into<String>) -> Self {
        Self::Backend {
            message: message.into(),
            source: None,
        }
    }

    pub fn backend_with(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Backend {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

/// What a runtime declares of itself in [`RuntimeCapabilities`]: everything but what its facets
/// say (snapshots, egress), so that a flag and the code behind it cannot disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuntimeFeatures {
    /// How the server reaches a sandbox's execd.
    pub execd_transport: ExecdTransport,
    /// `pause` and `resume` work.
    pub pause: bool,
    /// `ephemeral-storage` bounds a sandbox's root file system writes on every host it runs on:
    /// only such a runtime gets the server's default bound for creates that name none.
    pub disk_bound: bool,
    /// Sandbox root is an unprivileged range of host ids of its own.
    pub user_namespaces: bool,
    /// execd's isolated sessions work.
    pub isolated_sessions: bool,
    /// Whose folders `host` volumes mount.
    pub host_volumes: HostVolumes,
    /// Where images come from; with [`ImageSource::Engine`] the spec carries a reference.
    pub image_source: ImageSource,
    /// How many creates may run at once, when creating is bound by this machine's CPUs (native):
    /// more at a time only makes every one of them slower. `None`: no limit.
    pub create_parallelism: Option<usize>,
}

/// The facet of a runtime whose sandboxes' network namespaces are this host's.
pub trait NetworkLinks: Send + Sync {
    /// The host pid of a process in the sandbox's network namespace (where its link goes);
    /// `None`: the sandbox is not running.
    fn network_pid(&self, state: &RuntimeState) -> Option<i32>;
}

/// The facet of a runtime that keeps each sandbox's writes in an overlayfs layer on this host.
pub trait WritableLayers: Send + Sync {
    /// The sandbox's writable (upper) layer: everything it wrote.
    fn upper_dir(&self, id: &str) -> PathBuf;

    /// With a user namespace: the host id that is id 0 in sandbox `id` (its range's first), so
    /// what its upper dir holds can be recorded with the sandbox's own ids. `None`: the sandbox's
    /// ids are the host's.
    fn id_base(&self, id: &str) -> Option<u32>;
}

/// The facet of a runtime whose backend enforces egress itself.
#[async_trait::async_trait]
pub trait EgressEnforcer: Send + Sync {
    /// Rules naming hosts are enforced too, not only addresses and networks.
    fn names(&self) -> bool;

    /// Makes `policy` what the sandbox may reach (`None`: nothing), in force when this returns.
    /// `credential` is the sandbox's execd credential, which an enforcer beside the sandbox checks
    /// as execd does.
    async fn set_egress(
        &self,
        id: &str,
        state: &RuntimeState,
        policy: Option<&crate::EgressPolicy>,
        credential: &str,
    ) -> Result<(), RuntimeError>;
}

/// What every runtime can be asked, derived from what it declares and the facets it has.
pub trait RuntimeExt {
    /// What this runtime can do (`/health` reports it; the server checks it instead of the
    /// runtime's name): its [`RuntimeFeatures`], with `snapshots` true exactly when it has
    /// [`WritableLayers`], `egress_policy` when it has [`NetworkLinks`], and `egress_addresses`
    /// and `egress_names` when it has an [`EgressEnforcer`].
    fn capabilities(&self) -> RuntimeCapabilities;
}

impl<R: Runtime + ?Sized> RuntimeExt for R {
    fn capabilities(&self) -> RuntimeCapabilities {
        let f = self.features();
        RuntimeCapabilities {
            execd_transport: f.execd_transport,
            pause: f.pause,
            snapshots: self.layers().is_some(),
            egress_policy: self.links().is_some(),
            egress_addresses: self.enforcer().is_some(),
            egress_names: self.enforcer().is_some_and(|e| e.names()),
            disk_bound: f.disk_bound,
            user_namespaces: f.user_namespaces,
            isolated_sessions: f.isolated_sessions,
            host_volumes: f.host_volumes,
            image_source: f.image_source,
            create_parallelism: f.create_parallelism,
        }
    }
}

#[async_trait::async_trait]
pub trait Runtime: Send + Sync + 'static {
    /// Short name for logs and `/health` ("native/embedded", "native/runsc", …).
    fn name(&self) -> String;

    /// Creates and starts the sandbox; returns once execd's socket accepts connections. On error nothing
    /// of the sandbox is left behind.
    async fn create(&self, spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError>;

    /// Where the server reaches the sandbox's execd (`state` is what [`Runtime::create`] returned).
    /// Over TCP the server sends the sandbox's execd credential with every request, whose
    /// verifier [`SandboxSpec::execd_verifier`] the runtime gave execd.
    fn execd_address(&self, id: &str, state: &RuntimeState) -> ExecdAddress;

    /// Resolves when the sandbox's main process has ended (or at once if it already has).
    fn wait_exit(&self, id: &str, state: &RuntimeState) -> BoxFuture<'static, ExitInfo>;

    async fn pause(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError>;
    async fn resume(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError>;

    /// A sandbox created with [`SandboxSpec::background`] is someone's now: it gets the CPU share
    /// every sandbox has. A few microseconds; runtimes that make no difference do nothing.
    fn promote(&self, _id: &str) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Kills everything and removes every host resource the sandbox held. Idempotent.
    async fn destroy(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError>;

    /// The server is stopping: release what the runtime holds for future sandboxes (sandboxes
    /// themselves keep running and are re-adopted at the next start).
    async fn shutdown(&self) {}

    /// After a server restart: is this sandbox still there?
    async fn liveness(&self, id: &str, state: &RuntimeState) -> Liveness;

    /// Whose sandboxes these are, for a refusal that names why (`sandboxes of the docker/runsc
    /// runtime`, `sandboxes on a remote Docker daemon`).
    fn sandboxes_described(&self) -> String {
        format!("sandboxes of the {} runtime", self.name())
    }

    /// The names the backend knows sandbox `id` by (a container, a Pod and its namespace), for
    /// `diagnostics/context`: nothing secret, nothing of the host's layout.
    fn backend_identifiers(&self, _id: &str) -> std::collections::BTreeMap<String, String> {
        std::collections::BTreeMap::new()
    }

    /// What this runtime declares it can do; the rest of its [`RuntimeCapabilities`] follows from
    /// the facets below (see [`RuntimeExt::capabilities`]).
    fn features(&self) -> RuntimeFeatures;

    /// Sandboxes whose network namespace is on this host, where the server gives each a link of
    /// its own and enforces its egress policy there. `None`: no link (gVisor runs its own network
    /// stack; a remote daemon's sandboxes are on its host).
    fn links(&self) -> Option<&dyn NetworkLinks> {
        None
    }

    /// Sandboxes whose writes are an overlayfs layer on this host (snapshots copy it). `None`: no
    /// snapshots.
    fn layers(&self) -> Option<&dyn WritableLayers> {
        None
    }

    /// A backend that enforces egress policies itself, without a link (a NetworkPolicy per
    /// sandbox on Kubernetes, and a sidecar for rules naming hosts).
    fn enforcer(&self) -> Option<&dyn EgressEnforcer> {
        None
    }

    /// After a server restart, once every known sandbox was looked at: remove what the runtime finds
    /// of Warren's that is not among `known` (leftovers of a crash in the middle of a create).
    async fn sweep_orphans(&self, _known: &[String]) {}

    /// The backend keeps the sandboxes' records, shared by every server that uses it (see
    /// [`crate::shared`]). `None`: the server's own journal holds them.
    fn shared_records(&self) -> Option<std::sync::Arc<dyn crate::SharedRecords>> {
        None
    }

    /// With [`HostVolumes::Node`]: the node folders `host` volumes may mount, the runtime's own
    /// allow list (the server checks each is a plain absolute path).
    fn node_host_paths(&self) -> Vec<std::path::PathBuf> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeRuntime;

    /// A runtime's snapshot and egress flags are what its facets are, never a second word on them.
    #[test]
    fn capabilities_follow_the_facets() {
        let fake = FakeRuntime::default();
        let caps = fake.capabilities();
        assert!(fake.layers().is_none() && !caps.snapshots);
        assert!(fake.links().is_none() && !caps.egress_policy);
        assert!(fake.enforcer().is_none() && !caps.egress_addresses && !caps.egress_names);
        let f = crate::fake::FEATURES;
        assert_eq!(
            (caps.pause, caps.image_source, caps.create_parallelism),
            (f.pause, f.image_source, f.create_parallelism)
        );
        // and /health says so on the wire
        let wire = serde_json::to_value(caps).expect("json");
        assert_eq!(wire["imageSource"], "engine");
        assert!(wire.get("createParallelism").is_none());
    }
}
