//! Lifecycle API types (`/v1/sandboxes…`), camelCase on the wire.
//!
//! Why one file: one serde type per object of the lifecycle API (sandboxes, health, volumes,
//! snapshots, pools, diagnostics, templates), with next to no logic, kept together so that the
//! `/v1` schema reads in one place.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `image` in a create request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ImageSpec {
    pub uri: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ImageAuth>,
}

#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageAuth {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for ImageAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageAuth")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Platform {
    pub os: String,
    pub arch: String,
}

/// `POST /sandboxes` body. Unknown fields are accepted (newer SDKs send more) but the ones Warren does
/// not implement are rejected explicitly by the server rather than silently dropped.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CreateSandboxRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    /// Seconds; `None` (absent or JSON null) means manual cleanup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_limits: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_requests: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub network_policy: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub credential_proxy: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_access: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<Vec<Volume>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub lifecycle: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extensions: Option<BTreeMap<String, String>>,
}

/// Lifecycle states; clients must tolerate values they do not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum SandboxState {
    Pending,
    Running,
    Pausing,
    Paused,
    Resuming,
    Stopping,
    Terminated,
    Failed,
}

impl SandboxState {
    pub const ALL: [SandboxState; 8] = [
        Self::Pending,
        Self::Running,
        Self::Pausing,
        Self::Paused,
        Self::Resuming,
        Self::Stopping,
        Self::Terminated,
        Self::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Pausing => "Pausing",
            Self::Paused => "Paused",
            Self::Resuming => "Resuming",
            Self::Stopping => "Stopping",
            Self::Terminated => "Terminated",
            Self::Failed => "Failed",
        }
    }

    /// Parses a state name case-insensitively (the CLI and query strings are lenient).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|st| st.as_str().eq_ignore_ascii_case(s))
    }

    /// Terminal states: the sandbox's processes are gone and only its record remains.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Terminated | Self::Failed)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    pub state: SandboxState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_at: Option<String>,
}

/// `GET /sandboxes/{id}`, list items, and the create response (which omits `image`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    pub id: String,
    pub status: SandboxStatus,
    pub created_at: String,
    pub entrypoint: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    /// The snapshot the sandbox was restored from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extensions: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Pagination {
    pub page: u32,
    pub page_size: u32,
    pub total_items: u64,
    pub total_pages: u32,
    pub has_next_page: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ListSandboxesResponse {
    pub items: Vec<Sandbox>,
    pub pagination: Pagination,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RenewExpirationRequest {
    pub expires_at: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RenewExpirationResponse {
    pub expires_at: String,
}

/// `GET /sandboxes/{id}/endpoints/{port}`: no scheme in `endpoint`; clients send every header in `headers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

/// `POST /metrics/events`, sent fire-and-forget by the SDK after each create.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct MetricsEvent {
    pub event_type: String,
    #[serde(default)]
    pub sandbox_id: Option<String>,
    #[serde(default)]
    pub image: Option<String>,
    #[serde(default)]
    pub create_duration_ms: Option<i64>,
    #[serde(default)]
    pub success: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    pub status: String,
    /// The runtime this server runs sandboxes with, and what it can do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RuntimeInfo {
    /// The configured kind (`native`, `docker`).
    pub kind: String,
    /// The runtime in full (`native/embedded`, `native/runsc`, `docker/runsc`, …).
    pub name: String,
    pub capabilities: RuntimeCapabilities,
}

/// What a runtime can do: what `/health` reports and what the server checks (instead of asking
/// which runtime it runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RuntimeCapabilities {
    /// How the server reaches a sandbox's execd.
    pub execd_transport: ExecdTransport,
    /// `POST /sandboxes/{id}/pause|resume`.
    pub pause: bool,
    /// Snapshots (and templates, built on them) of a sandbox's file system.
    pub snapshots: bool,
    /// A network link whose egress a policy governs (`networkPolicy`, the credential vault).
    pub egress_policy: bool,
    /// Without a link: the runtime's backend enforces policies whose rules all name addresses or
    /// networks (a NetworkPolicy per sandbox on Kubernetes). Rules naming hosts need a link.
    #[serde(default)]
    pub egress_addresses: bool,
    /// With `egress_addresses`: rules naming hosts too, enforced by a proxy beside the sandbox that
    /// answers its DNS (the egress sidecar on Kubernetes).
    #[serde(default)]
    pub egress_names: bool,
    /// `ephemeral-storage` bounds a sandbox's root file system writes (the default bound applies).
    pub disk_bound: bool,
    /// Sandbox root is an unprivileged range of host ids of its own.
    pub user_namespaces: bool,
    /// execd's isolated sessions, for sandboxes that ask (`bootstrap.execd.isolation`).
    pub isolated_sessions: bool,
    /// Whose folders `host` volumes mount, if anyone's (`pvc` volumes work on every runtime).
    pub host_volumes: HostVolumes,
    /// Where images come from.
    #[serde(default)]
    pub image_source: ImageSource,
    /// How many creates run at once, when creating is bound by the server's CPUs (the rest queue
    /// in order); absent: no bound (the work is elsewhere, e.g. in a Docker daemon).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_parallelism: Option<usize>,
}

/// Where a runtime gets its images from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ImageSource {
    /// Warren's own image store: the server resolves and leases the image before the runtime
    /// creates the sandbox (`warren image …` manages it).
    #[default]
    Store,
    /// The runtime's engine (a Docker daemon, a kubelet) resolves and pulls references itself.
    Engine,
}

/// Whose folders `host` volumes mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum HostVolumes {
    /// The server's own host's, under `[storage] allowed_host_paths`, symlinks resolved there.
    Server,
    /// The node's that runs the sandbox, under the runtime's own allow list, checked by name (the
    /// node resolves the rest).
    Node,
    /// No one's.
    None,
}

/// How the server reaches execd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ExecdTransport {
    /// A Unix socket on the server's host.
    Unix,
    /// TCP, with a per-sandbox credential execd checks on every request.
    Tcp,
}

/// A storage mount: exactly one of `host`, `pvc` (a named volume) or `ossfs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    pub mount_path: String,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostVolume>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvc: Option<PvcVolume>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub ossfs: Option<serde_json::Value>,
}

/// A folder of the host (only under the server's `allowed_host_paths`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HostVolume {
    pub path: String,
}

/// A named volume that outlives the sandbox (a Docker named volume, or a folder Warren keeps).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PvcVolume {
    pub claim_name: String,
    #[serde(default = "yes")]
    pub create_if_not_exists: bool,
    /// Removes the volume with the sandbox, if this sandbox created it.
    #[serde(default)]
    pub delete_on_sandbox_termination: bool,
    /// Kubernetes-only settings, accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_modes: Option<Vec<String>>,
}

fn yes() -> bool {
    true
}

/// `POST /sandboxes/{id}/snapshots` body (optional).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CreateSnapshotRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Lifecycle state of a snapshot: `Creating`, `Ready`, `Failed` (`Deleting` is never observable
/// here: deletion is immediate).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SnapshotStatus {
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_at: Option<String>,
}

/// A point-in-time capture of a sandbox's file system, restorable with `snapshotId` on create.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub id: String,
    pub sandbox_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub status: SnapshotStatus,
    pub created_at: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ListSnapshotsResponse {
    pub items: Vec<Snapshot>,
    pub pagination: Pagination,
}

/// A warm pool's sizes (the reference's Pool CRD `capacitySpec`): `bufferMin..=bufferMax` warm
/// sandboxes kept ready, `poolMax` sandboxes at most in all (warm + allocated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CapacitySpec {
    pub buffer_max: u32,
    pub buffer_min: u32,
    pub pool_max: u32,
    pub pool_min: u32,
}

/// `POST /pools`, `PUT /pools/{name}` body, and the `[[pools]]` entries of Warren's config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    pub name: String,
    /// What every sandbox of the pool is: a create request (image, entrypoint, env, resourceLimits).
    pub template: CreateSandboxRequest,
    pub capacity_spec: CapacitySpec,
    /// How long a create waits for a warm sandbox when the pool is empty before answering 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_seconds: Option<u64>,
}

/// `PUT /pools/{name}` body. The reference's shape is `{capacitySpec}` alone, which changes the
/// sizes and keeps the warm sandboxes; with a `template` (Warren's own) the pool is replaced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PoolUpdate {
    /// The pool's own name, if given (anything else is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<CreateSandboxRequest>,
    pub capacity_spec: CapacitySpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_seconds: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    /// Warm and allocated sandboxes, plus those being made.
    pub total: u32,
    pub allocated: u32,
    /// Warm, ready to hand out.
    pub available: u32,
    /// Changes whenever the pool's spec does (a digest of it).
    pub revision: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    #[serde(flatten)]
    pub spec: PoolSpec,
    pub status: PoolStatus,
    pub created_at: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ListPoolsResponse {
    pub items: Vec<Pool>,
}

/// `GET /sandboxes/{id}/diagnostics/logs|events?scope=…`: best-effort diagnostic text, sent inline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DiagnosticContent {
    pub sandbox_id: String,
    /// `logs` or `events`.
    pub kind: String,
    pub scope: String,
    /// Always `inline` here (the protocol also knows `url`).
    pub delivery: String,
    pub content_type: String,
    /// Older text was dropped to stay within the server's bounds.
    pub truncated: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_length: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// `GET /sandboxes/{id}/diagnostics/context`: where the sandbox runs, for a support ticket or a
/// log search. Identifier values are strings and name nothing secret.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DiagnosticContext {
    pub sandbox_id: String,
    /// The runtime's kind: `native`, `docker` or `kubernetes`.
    pub backend_type: String,
    pub backend_identifiers: std::collections::BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<SandboxState>,
}

/// `POST /templates` body (the reference's fsb template: a golden image built from an OCI image).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CreateTemplateRequest {
    pub image: String,
    /// Where the reference uploads the built artifacts; Warren records it and keeps the golden
    /// image in its own store.
    pub publish: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_limits: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<TemplateReadiness>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TemplateReadiness {
    /// `tcp://127.0.0.1:PORT` (something listens there) or `cmd://COMMAND` (it exits 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_seconds: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TemplateStatus {
    /// `Pending`, `Building`, `Succeeded` or `Failed`.
    pub phase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Template {
    pub template_id: String,
    pub image: String,
    pub publish: String,
    pub format: String,
    pub status: TemplateStatus,
    pub created_at: String,
    pub updated_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_limits: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<TemplateReadiness>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ListTemplatesResponse {
    pub items: Vec<Template>,
    pub pagination: Pagination,
}
