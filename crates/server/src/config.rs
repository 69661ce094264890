//! Server configuration: defaults < TOML file < `WARREN_*` environment < command-line flags.
//! The variables it reads are named in `warren_env`, with every other one Warren reads.
//!
//! Why one file: one struct per TOML section, each field documented beside its serde default, so
//! every setting, its meaning and its default read in one place; ~150 of its lines are tests of
//! loading. Sections whose code lives in other modules are in `sections`.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;
use warren_env::EnvVars;

pub use warren_local::{API_KEY_FILE, DEFAULT_LISTEN};

mod sections;
pub use sections::{
    AuditSection, EndpointsSection, MetricsSection, QuotaSection, QuotaSpec, TimelineSection,
    TlsSection,
};

/// The TOML file. Unknown keys are errors: a typo must not silently fall back to a default.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub api_key: Option<String>,
    /// Host (and port) put in endpoint URLs, when clients reach Warren under another name.
    pub public_host: Option<String>,
    /// Upper bound for `timeout` on create, in seconds.
    pub max_sandbox_timeout_seconds: Option<i64>,

    /// How long records of sandboxes that ended on their own stay listable, in seconds (a deleted
    /// sandbox is forgotten at once).
    pub terminated_retention_seconds: Option<i64>,
    #[serde(default)]
    pub runtime: RuntimeSection,
    /// `[docker]` and `[kubernetes]`: each backend's own section, kept as written here and read
    /// by the backend's crate (`DockerSection`, `KubernetesSection`), which owns its fields.
    #[serde(default)]
    pub docker: toml::Table,
    #[serde(default)]
    pub kubernetes: toml::Table,
    #[serde(default)]
    pub storage: StorageSection,
    #[serde(default)]
    pub limits: LimitsSection,
    #[serde(default)]
    pub network: NetworkSection,
    #[serde(default)]
    pub images: ImagesSection,
    #[serde(default)]
    pub http: HttpSection,
    /// `[registries."<host>"]`: mirrors, plain HTTP, extra CA, credentials per registry.
    #[serde(default)]
    pub registries: warren_registry::RegistriesConfig,
    /// `[[pools]]`: warm pools (name, template, capacitySpec, maxWaitSeconds), as `POST /v1/pools`.
    #[serde(default)]
    pub pools: Vec<warren_api::lifecycle::PoolSpec>,
    /// `[quotas]`: tenants' quotas (see `quotas`).
    #[serde(default)]
    pub quotas: QuotaSection,
    /// `[audit]`: the audit log (see `audit`).
    #[serde(default)]
    pub audit: AuditSection,
    /// `[tls]`: HTTPS for the API and the proxy (see `tls`).
    #[serde(default)]
    pub tls: TlsSection,
    /// `[endpoints]`: signed endpoint URLs and host-based routing (see `signed`).
    #[serde(default)]
    pub endpoints: EndpointsSection,
    /// `[metrics]`: Prometheus metrics (see `metrics`).
    #[serde(default)]
    pub metrics: MetricsSection,
    /// `[timeline]`: each sandbox's flight recorder (see `timeline`).
    #[serde(default)]
    pub timeline: TimelineSection,
}

/// `[http]`: the API's front door (see `front`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSection {
    /// How long a connection may take to send a request's headers, and may sit idle between
    /// requests, before it is closed.
    #[serde(default = "default_header_timeout")]
    pub header_timeout_seconds: f64,
    /// Connections served at once; more wait in the listen queue until one closes.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Browser origins (`https://app.example.com`, or `*`) allowed to call the API and the
    /// header-authenticated proxy; none by default.
    #[serde(default)]
    pub cors_allowed_origins: Vec<String>,
}

fn default_header_timeout() -> f64 {
    20.0
}

fn default_max_connections() -> usize {
    10_000
}

impl Default for HttpSection {
    fn default() -> Self {
        Self {
            header_timeout_seconds: default_header_timeout(),
            max_connections: default_max_connections(),
            cors_allowed_origins: Vec::new(),
        }
    }
}

/// `[images]`: the native runtime's image store.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImagesSection {
    /// `missing` (default): a create for an image not in the store pulls it from its registry;
    /// `never`: only imported or already pulled images can be used.
    #[serde(default = "default_pull")]
    pub pull: PullPolicy,
    /// Different images pulled at once, at most; more wait their turn.
    #[serde(default = "default_max_concurrent_pulls")]
    pub max_concurrent_pulls: usize,
    /// What one image, all its layers together, may unpack to (pulls and snapshots alike): bytes
    /// of data written (runs of zeros stay holes and are not counted) …
    #[serde(default = "default_max_unpacked_bytes")]
    pub max_unpacked_bytes: String,
    /// … its files' sizes, holes included …
    #[serde(default = "default_max_apparent_bytes")]
    pub max_apparent_bytes: String,
    /// … entries …
    #[serde(default = "default_max_entries")]
    pub max_entries: u64,
    /// … and folders above an entry (at most 1,536, what a snapshot can keep).
    #[serde(default = "default_max_depth")]
    pub max_depth: usize,
}

impl Default for ImagesSection {
    fn default() -> Self {
        ImagesSection {
            pull: default_pull(),
            max_concurrent_pulls: default_max_concurrent_pulls(),
            max_unpacked_bytes: default_max_unpacked_bytes(),
            max_apparent_bytes: default_max_apparent_bytes(),
            max_entries: default_max_entries(),
            max_depth: default_max_depth(),
        }
    }
}

impl ImagesSection {
    /// The unpack bounds these settings give. Checked at start, so that a typo is an error then.
    pub fn unpack_limits(&self) -> anyhow::Result<warren_image::UnpackLimits> {
        if self.max_depth == 0 || self.max_depth > warren_image::MAX_DEPTH {
            anyhow::bail!(
                "max_depth must be 1 to {} (what a snapshot can keep), not {}",
                warren_image::MAX_DEPTH,
                self.max_depth
            );
        }
        if self.max_concurrent_pulls == 0 {
            anyhow::bail!("max_concurrent_pulls must be at least 1");
        }
        Ok(warren_image::UnpackLimits {
            max_entries: self.max_entries,
            max_depth: self.max_depth,
            max_data_bytes: warren_core::parse_size_bytes(
                "max_unpacked_bytes",
                &self.max_unpacked_bytes,
            )?,
            max_apparent_bytes: warren_core::parse_size_bytes(
                "max_apparent_bytes",
                &self.max_apparent_bytes,
            )?,
        })
    }
}

fn default_max_concurrent_pulls() -> usize {
    4
}

fn default_max_unpacked_bytes() -> String {
    "64Gi".into()
}

fn default_max_apparent_bytes() -> String {
    "1Ti".into()
}

fn default_max_entries() -> u64 {
    2_000_000
}

fn default_max_depth() -> usize {
    warren_image::MAX_DEPTH
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PullPolicy {
    Missing,
    Never,
}

fn default_pull() -> PullPolicy {
    PullPolicy::Missing
}

/// `[network]`: sandbox networking and egress control.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSection {
    /// What a sandbox created without `networkPolicy` may reach: `deny` (nothing; it gets no
    /// network link at all) or `allow` (full egress, through the DNS filter and the firewall).
    #[serde(default = "deny")]
    pub default_action: String,
    /// Sandbox links are /30s from this IPv4 range; one range per server on a host.
    #[serde(default = "default_subnet")]
    pub subnet: String,
    /// Where the DNS filter forwards allowed queries (`ip:port`); default: the first `nameserver`
    /// of the host's /etc/resolv.conf.
    pub dns_upstream: Option<String>,
    /// CA files (PEM) the credential vault's proxy trusts for real servers, besides the public roots.
    #[serde(default)]
    pub upstream_ca_files: Vec<PathBuf>,
}

fn deny() -> String {
    "deny".into()
}

fn default_subnet() -> String {
    "10.213.0.0/16".into()
}

impl Default for NetworkSection {
    fn default() -> Self {
        Self {
            default_action: deny(),
            subnet: default_subnet(),
            dns_upstream: None,
            upstream_ca_files: Vec::new(),
        }
    }
}

/// `[storage]`: what `volumes` may mount.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageSection {
    /// Host folders under which `host` volumes may be mounted; empty (the default) allows none.
    #[serde(default)]
    pub allowed_host_paths: Vec<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeSection {
    #[serde(default)]
    pub kind: RuntimeKind,
    /// `embedded` (Warren's own namespaces code) or an OCI runtime binary: `runc`, `crun`, `runsc`.
    #[serde(default = "default_oci")]
    pub oci_runtime: String,
    pub execd_path: Option<PathBuf>,
    /// Sandbox setup helpers started ahead of need (embedded runtime, cgroup v1): each already sits
    /// in a cgroup of its own, which takes the slow cgroup migration off the create path. 0 disables.
    /// Ignored on cgroup v2, where helpers start inside their cgroup and a cgroup cannot be renamed.
    #[serde(default = "default_standby")]
    pub standby_helpers: usize,
    /// Native runtime: creates in flight at once (the rest wait their turn, first come first served);
    /// default: the number of CPUs; 0: no limit.
    pub max_parallel_creates: Option<usize>,
    /// How long a sandbox may take to start (setup, then execd listening) before its create fails
    /// and what it made is removed; default 15 (native) or 30 (docker, which may also pull).
    pub start_timeout_seconds: Option<f64>,
    /// Whether execd keeps a spare shell for the next command (docs/native-runtime.md). Off,
    /// every sandbox gets `WARREN_SPARE_SHELL=0` in its environment unless its create sets it,
    /// and every command starts its own `bash -c`.
    #[serde(default = "default_spare_shell")]
    pub spare_shell: bool,
    /// Native runtime: each sandbox's root is a range of 65,536 unprivileged host ids of its own (a
    /// user namespace), not host root (docs/security-model.md). Default: on with the embedded
    /// runtime, runc and crun; gVisor (`runsc`) has none (its Sentry is the sandbox's kernel).
    /// `false` is the explicit opt-out.
    pub user_namespaces: Option<bool>,
    /// The first host id of the sandboxes' ranges (default 2³¹), and how many ranges (default:
    /// all that fit below 2³² − 1, 32,767): one per live sandbox.
    #[serde(default = "default_userns_first_id")]
    pub userns_first_id: u32,
    pub userns_ranges: Option<u32>,
    /// How the server reaches execd: `unix` (default: a socket only the host's root can open) or
    /// `tcp` (embedded runtime: a loopback port of the host, every request carrying the sandbox's
    /// execd credential; the transport of runtimes whose sandboxes live elsewhere, served here).
    #[serde(default = "default_execd_transport")]
    pub execd_transport: warren_api::lifecycle::ExecdTransport,
    /// Hardening, under the reference's name for its switch (OSEP-0018). execd is every sandbox's
    /// init whatever this says; on, it also lays the floor under every process it starts for user
    /// code (docs/security-model.md, "Hardening"): execd's settings out of the environment, no
    /// capabilities, no new privileges, and a seccomp deny list over the sandbox's own filter.
    #[serde(default)]
    pub execd_run_as_init: bool,
    /// What the floor keeps and refuses, with `execd_run_as_init` (`keep_capabilities`,
    /// `seccomp_deny`); by default no capability and the reference's deny list.
    #[serde(default)]
    pub hardening: warren_api::hardening::FloorPolicy,
}

impl RuntimeSection {
    /// The floor sandboxes get, checked: `None` when hardening is off.
    pub fn floor(&self) -> anyhow::Result<Option<warren_api::hardening::FloorPolicy>> {
        if !self.execd_run_as_init {
            anyhow::ensure!(
                self.hardening == Default::default(),
                "[runtime.hardening] is set but [runtime] execd_run_as_init is not: the floor is off"
            );
            return Ok(None);
        }
        self.hardening
            .check()
            .map_err(|e| anyhow::anyhow!("[runtime.hardening] {e}"))?;
        if let Some(unknown) = self
            .hardening
            .deny_list()
            .iter()
            .find(|n| warren_seccomp::number(n).is_none())
        {
            anyhow::bail!("[runtime.hardening] seccomp_deny: {unknown:?} is not an x86-64 syscall");
        }
        Ok(Some(self.hardening.clone()))
    }
}

fn default_execd_transport() -> warren_api::lifecycle::ExecdTransport {
    warren_api::lifecycle::ExecdTransport::Unix
}

fn default_userns_first_id() -> u32 {
    1 << 31
}

fn default_spare_shell() -> bool {
    true
}

fn default_standby() -> usize {
    2
}

/// Which runtime runs sandboxes (`[runtime] kind`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeKind {
    /// Warren's own (`oci_runtime = "embedded"`) or an OCI runtime binary on this host.
    #[default]
    Native,
    /// A Docker Engine (`[docker]`).
    Docker,
    /// Pods on a Kubernetes cluster (`[kubernetes]`).
    Kubernetes,
}

impl RuntimeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RuntimeKind::Native => "native",
            RuntimeKind::Docker => "docker",
            RuntimeKind::Kubernetes => "kubernetes",
        }
    }
}
fn default_oci() -> String {
    "embedded".into()
}

impl Default for RuntimeSection {
    fn default() -> Self {
        Self {
            kind: RuntimeKind::default(),
            oci_runtime: default_oci(),
            execd_path: None,
            standby_helpers: default_standby(),
            max_parallel_creates: None,
            start_timeout_seconds: None,
            spare_shell: default_spare_shell(),
            user_namespaces: None,
            userns_first_id: default_userns_first_id(),
            userns_ranges: None,
            execd_transport: default_execd_transport(),
            execd_run_as_init: false,
            hardening: Default::default(),
        }
    }
}

/// Defaults applied when a create request leaves a limit out.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    #[serde(default = "default_pids")]
    pub pids: u64,
    /// Open files per process of a sandbox (its hard `RLIMIT_NOFILE`; the soft one is the
    /// server's own at start, 1024 on most systems).
    #[serde(default = "default_open_files")]
    pub open_files: u64,
    /// For creates that name no memory: a sandbox without a bound could take the host's memory,
    /// and with it every other sandbox's. `"none"` leaves such creates unbounded.
    #[serde(default = "default_memory")]
    pub default_memory: Option<String>,
    /// For creates that name no CPU (`"none"`: no quota).
    #[serde(default = "default_cpu")]
    pub default_cpu: Option<String>,
    /// `ephemeral-storage` for creates that leave it out, so that no sandbox can fill the host's
    /// disk. Unset: [`DEFAULT_EPHEMERAL_STORAGE`] on a runtime that bounds disk writes (see
    /// [`LimitsSection::resolve_disk_default`]); `"none"` leaves such creates unbounded.
    pub default_ephemeral_storage: Option<String>,
    /// Sandboxes that have not ended, at most (warm pools' included); a create beyond is 429.
    #[serde(default = "default_max_sandboxes")]
    pub max_sandboxes: usize,
    /// Creates admitted at once (running or waiting for a create slot); more are 429.
    #[serde(default = "default_max_creates_in_flight")]
    pub max_creates_in_flight: usize,
    /// Renew on access (`extensions["access.renew.extend.seconds"]`) never keeps a sandbox past
    /// this long after its creation, in seconds.
    #[serde(default = "default_renew_on_access_max_lifetime")]
    pub renew_on_access_max_lifetime_seconds: u64,
}

fn default_renew_on_access_max_lifetime() -> u64 {
    86_400
}

fn default_max_sandboxes() -> usize {
    1024
}

fn default_max_creates_in_flight() -> usize {
    128
}

impl LimitsSection {
    /// The limits of a create that asks for none. Checked at start, so that a typo here is an
    /// error then, not a 400 on every create.
    pub fn defaults(&self) -> Result<warren_core::ResourceLimits, warren_core::QuantityError> {
        Ok(warren_core::ResourceLimits {
            cpu_millis: self
                .default_cpu
                .as_deref()
                .filter(|v| *v != "none")
                .map(warren_core::parse_cpu_millis)
                .transpose()?,
            memory_bytes: self
                .default_memory
                .as_deref()
                .filter(|v| *v != "none")
                .map(warren_core::parse_memory_bytes)
                .transpose()?,
            pids: self.pids,
            disk_bytes: self
                .default_ephemeral_storage
                .as_deref()
                .filter(|v| *v != "none")
                .map(warren_core::parse_disk_bytes)
                .transpose()?,
        })
    }

    /// Settles `default_ephemeral_storage` for a runtime that does (or does not) always bound
    /// disk writes: unset becomes [`DEFAULT_EPHEMERAL_STORAGE`] where it is enforced and no bound
    /// elsewhere (gVisor holds root writes in the sandbox's memory, under its memory limit; Docker
    /// bounds them only on some storage drivers). A bound the operator set is kept as set: where
    /// the runtime cannot keep it, creates are refused with the reason (501), as when they name one.
    pub fn resolve_disk_default(&mut self, runtime_bounds_disk: bool) {
        match self.default_ephemeral_storage.as_deref() {
            None if runtime_bounds_disk => {
                self.default_ephemeral_storage = Some(DEFAULT_EPHEMERAL_STORAGE.into());
            }
            None | Some("none") => self.default_ephemeral_storage = None,
            Some(_) => {}
        }
    }
}

/// The bound on a sandbox's root filesystem writes when neither the create nor the config names
/// one. The disk is sparse: only what a sandbox writes takes room on the host.
pub const DEFAULT_EPHEMERAL_STORAGE: &str = "10Gi";

fn default_pids() -> u64 {
    4096
}

fn default_open_files() -> u64 {
    65_536
}

fn default_memory() -> Option<String> {
    Some("4Gi".into())
}

fn default_cpu() -> Option<String> {
    Some("2".into())
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self {
            pids: default_pids(),
            open_files: default_open_files(),
            default_memory: default_memory(),
            default_cpu: default_cpu(),
            default_ephemeral_storage: None,
            max_sandboxes: default_max_sandboxes(),
            max_creates_in_flight: default_max_creates_in_flight(),
            renew_on_access_max_lifetime_seconds: default_renew_on_access_max_lifetime(),
        }
    }
}

/// Settings after every source has been applied.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub api_key: Option<String>,
    pub insecure_no_auth: bool,
    pub public_host: Option<String>,
    pub max_timeout_seconds: Option<i64>,
    pub terminated_retention_seconds: i64,
    pub runtime: RuntimeSection,
    /// The backends' own sections, as written (see [`FileConfig::docker`]).
    pub docker: toml::Table,
    pub kubernetes: toml::Table,
    pub storage: StorageSection,
    pub limits: LimitsSection,
    pub network: NetworkSection,
    pub images: ImagesSection,
    pub http: HttpSection,
    pub registries: warren_registry::RegistriesConfig,
    pub pools: Vec<warren_api::lifecycle::PoolSpec>,
    pub quotas: QuotaSection,
    pub audit: AuditSection,
    pub tls: TlsSection,
    pub endpoints: EndpointsSection,
    pub metrics: MetricsSection,
    pub timeline: TimelineSection,
    pub config_file: Option<PathBuf>,
}

/// Flags from the command line; `None` means "not given".
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub config: Option<PathBuf>,
    pub insecure_no_auth: bool,
    /// `--tls-self-signed`: as `[tls] self_signed = true`.
    pub tls_self_signed: bool,
}

/// A source of environment variables, so tests pass a map instead of touching the process env.
pub trait EnvSource {
    fn get(&self, key: &str) -> Option<String>;
}

pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        warren_env::var(key)
    }
}

impl<const N: usize> EnvSource for [(&str, &str); N] {
    fn get(&self, key: &str) -> Option<String> {
        self.iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_string())
    }
}

pub fn default_data_dir(env: &dyn EnvSource) -> PathBuf {
    warren_local::default_data_dir(|k| env.get(k))
}

impl ServerConfig {
    pub fn load(flags: &Overrides, env: &dyn EnvSource) -> anyhow::Result<Self> {
        use anyhow::Context;
        let config_file = flags
            .config
            .clone()
            .or_else(|| env.get(EnvVars::WARREN_CONFIG).map(PathBuf::from));
        let file: FileConfig = match &config_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading config {}", path.display()))?;
                toml::from_str(&text)
                    .with_context(|| format!("parsing config {}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let listen = flags
            .listen
            .clone()
            .or_else(|| env.get(EnvVars::WARREN_LISTEN))
            .or(file.listen.clone())
            .unwrap_or_else(|| DEFAULT_LISTEN.to_string());
        let listen: SocketAddr = listen
            .parse()
            .with_context(|| format!("invalid listen address {listen:?}"))?;
        let data_dir = flags
            .data_dir
            .clone()
            .or_else(|| env.get(EnvVars::WARREN_DATA_DIR).map(PathBuf::from))
            .or(file.data_dir.clone())
            .unwrap_or_else(|| default_data_dir(env));
        let api_key = env.get(EnvVars::WARREN_API_KEY).or(file.api_key.clone());
        let mut runtime = file.runtime.clone();
        if let Some(p) = env.get(EnvVars::WARREN_EXECD_PATH) {
            runtime.execd_path = Some(PathBuf::from(p));
        }
        file.limits.defaults().context("[limits]")?;
        file.runtime.floor()?;
        file.images.unpack_limits().context("[images]")?;
        file.quotas.check().context("[quotas]")?;
        if flags.insecure_no_auth && !listen.ip().is_loopback() {
            anyhow::bail!(
                "--insecure-no-auth is accepted only on a loopback address, not {listen}"
            );
        }
        Ok(Self {
            listen,
            data_dir,
            api_key,
            insecure_no_auth: flags.insecure_no_auth,
            public_host: file.public_host.clone(),
            max_timeout_seconds: file.max_sandbox_timeout_seconds,

            terminated_retention_seconds: file.terminated_retention_seconds.unwrap_or(3600),
            runtime,
            docker: file.docker.clone(),
            kubernetes: file.kubernetes.clone(),
            storage: file.storage.clone(),
            limits: file.limits.clone(),
            network: file.network.clone(),
            images: file.images.clone(),
            http: {
                let t = file.http.header_timeout_seconds;
                anyhow::ensure!(
                    t.is_finite() && (0.1..=3600.0).contains(&t),
                    "[http] header_timeout_seconds must be between 0.1 and 3600, not {t}"
                );
                anyhow::ensure!(
                    file.http.max_connections > 0,
                    "[http] max_connections must be at least 1"
                );
                file.http.clone()
            },
            registries: file.registries.clone(),
            pools: file.pools.clone(),
            quotas: file.quotas.clone(),
            audit: file.audit.clone(),
            metrics: file.metrics.clone(),
            timeline: file.timeline.clone(),
            tls: {
                let mut tls = file.tls.clone();
                tls.self_signed |= flags.tls_self_signed;
                tls
            },
            endpoints: {
                file.endpoints.check().context("[endpoints]")?;
                file.endpoints.clone()
            },
            config_file,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_images_and_registries_parse_as_documented() {
        let text = r#"
[images]
pull = "never"

[registries."docker.io"]
mirrors = ["mirror.internal:5000"]
upstream = false

[registries."mirror.internal:5000"]
insecure = true

[[pools]]
name = "py"
template = { image = { uri = "python:3.11" }, entrypoint = ["tail", "-f", "/dev/null"], resourceLimits = { cpu = "1", memory = "2Gi" } }
capacitySpec = { bufferMin = 5, bufferMax = 10, poolMin = 0, poolMax = 50 }
maxWaitSeconds = 30
"#;
        let file: FileConfig = toml::from_str(text).expect("parse");
        assert_eq!(file.images.pull, PullPolicy::Never);
        assert!(!file.registries.hosts["docker.io"].upstream);
        assert!(file.registries.hosts["mirror.internal:5000"].insecure);
        assert_eq!(file.pools.len(), 1);
        assert_eq!(file.pools[0].capacity_spec.pool_max, 50);
        assert_eq!(file.pools[0].max_wait_seconds, Some(30));
        assert_eq!(
            file.pools[0]
                .template
                .image
                .as_ref()
                .map(|i| i.uri.as_str()),
            Some("python:3.11")
        );
        let default: FileConfig = toml::from_str("").expect("empty");
        assert_eq!(default.images.pull, PullPolicy::Missing);
    }

    #[test]
    fn the_runtime_kind_is_one_of_the_known_ones() {
        let default: FileConfig = toml::from_str("").expect("empty");
        assert_eq!(default.runtime.kind, RuntimeKind::Native);
        let docker: FileConfig = toml::from_str("[runtime]\nkind = \"docker\"\n").expect("docker");
        assert_eq!(docker.runtime.kind, RuntimeKind::Docker);
        let err = toml::from_str::<FileConfig>("[runtime]\nkind = \"podman\"\n")
            .expect_err("unknown kind")
            .to_string();
        assert!(err.contains("native") && err.contains("docker"), "{err}");
    }

    #[test]
    fn precedence_flags_over_env_over_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("warren.toml");
        std::fs::write(&file, "listen = \"127.0.0.1:9000\"\napi_key = \"from-file\"\n[runtime]\noci_runtime = \"runsc\"\n").expect("write");
        let flags = Overrides {
            config: Some(file.clone()),
            ..Default::default()
        };
        let cfg =
            ServerConfig::load(&flags, &[(EnvVars::WARREN_API_KEY, "from-env")]).expect("load");
        assert_eq!(cfg.listen.port(), 9000);
        assert_eq!(cfg.api_key.as_deref(), Some("from-env"));
        assert_eq!(cfg.runtime.oci_runtime, "runsc");
        let flags = Overrides {
            config: Some(file),
            listen: Some("127.0.0.1:9100".into()),
            ..Default::default()
        };
        let cfg = ServerConfig::load(&flags, &[(EnvVars::WARREN_LISTEN, "127.0.0.1:9200")])
            .expect("load");
        assert_eq!(cfg.listen.port(), 9100);
    }

    #[test]
    fn unknown_keys_and_insecure_on_public_address_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("warren.toml");
        std::fs::write(&file, "listn = \"x\"\n").expect("write");
        let flags = Overrides {
            config: Some(file),
            ..Default::default()
        };
        assert!(ServerConfig::load(&flags, &[("X", "y")]).is_err());
        let flags = Overrides {
            listen: Some("0.0.0.0:8080".into()),
            insecure_no_auth: true,
            ..Default::default()
        };
        assert!(ServerConfig::load(&flags, &[("X", "y")]).is_err());
    }

    #[test]
    fn limit_defaults_are_checked_at_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("warren.toml");
        let load = |text: &str| {
            std::fs::write(&file, text).expect("write");
            let flags = Overrides {
                config: Some(file.clone()),
                ..Default::default()
            };
            ServerConfig::load(&flags, &[("X", "y")])
        };
        let cfg = load("[limits]\ndefault_ephemeral_storage = \"10Gi\"\n").expect("load");
        assert_eq!(
            cfg.limits.default_ephemeral_storage.as_deref(),
            Some("10Gi")
        );
        for bad in [
            "default_ephemeral_storage = \"lots\"",
            "default_memory = \"1Mi\"",
            "default_cpu = \"many\"",
        ] {
            let err = load(&format!("[limits]\n{bad}\n")).expect_err(bad);
            assert!(format!("{err:#}").contains("[limits]"), "{err:#}");
        }
        // the disk default, settled per runtime
        let settled = |set: Option<&str>, bounds: bool| {
            let mut limits = LimitsSection {
                default_ephemeral_storage: set.map(str::to_string),
                ..LimitsSection::default()
            };
            limits.resolve_disk_default(bounds);
            limits.defaults().expect("defaults").disk_bytes
        };
        assert_eq!(settled(None, true), Some(10 << 30), "bounded by default");
        assert_eq!(settled(None, false), None, "gVisor, Docker");
        assert_eq!(settled(Some("none"), true), None, "the operator's choice");
        assert_eq!(settled(Some("5Gi"), false), Some(5 << 30), "kept as set");
        let cfg =
            load("[images]\nmax_unpacked_bytes = \"10Gi\"\nmax_entries = 5000\nmax_depth = 64\n")
                .expect("load");
        let limits = cfg.images.unpack_limits().expect("limits");
        assert_eq!(
            (limits.max_data_bytes, limits.max_entries, limits.max_depth),
            (10 << 30, 5000, 64)
        );
        assert_eq!(limits.max_apparent_bytes, 1 << 40, "the default");
        for bad in [
            "max_unpacked_bytes = \"huge\"",
            "max_depth = 5000",
            "max_depth = 0",
            "max_concurrent_pulls = 0",
        ] {
            let err = load(&format!("[images]\n{bad}\n")).expect_err(bad);
            assert!(format!("{err:#}").contains("[images]"), "{err:#}");
        }
    }
}
