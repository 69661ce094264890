//! The Docker runtime: each sandbox is a container on a Docker Engine (the daemon on this host, found
//! through `DOCKER_HOST` or the config, or a daemon on another host over TCP with TLS), set up like a
//! native sandbox:
//!
//! - execd is the container's PID 1 and the user's entrypoint runs as its child;
//! - with a daemon on this host (a Unix socket) execd is bind-mounted read-only from the host (no
//!   copy per sandbox), and the server reaches it through a Unix socket in a per-sandbox host folder
//!   bind-mounted at `/.warren/run`, exactly as on the native runtime (no container networking);
//! - with a daemon elsewhere (`tcp://`) nothing of this host can be mounted: execd is uploaded once
//!   into a named volume on that daemon (named for its digest) and mounted read-only from there; it
//!   listens on TCP in the container with the sandbox's credential checked on every request. Those
//!   sandboxes sit on an internal network of Warren's (no route out, no traffic between
//!   containers: no network, as everywhere by default), which nothing can be published from; one
//!   relay per daemon (`warren-execd relay`, from an image of execd alone, in the daemon host's
//!   network namespace) listens on one port of that host, and the server reaches each sandbox's
//!   execd through it;
//! - limits (cpu, memory without extra swap, pids), the same capability set as native sandboxes,
//!   `no-new-privileges`, network `none` (loopback only) on this host, an optional OCI runtime
//!   (`runsc`);
//! - labels name the sandbox and the Warren data dir that owns it, so after a restart Warren finds its
//!   containers, and removes the ones it has no record of.
//!
//! When the daemon cannot be reached every operation fails with [`RuntimeError::Unavailable`] (a 503),
//! and works again once it is back. Sandboxes keep running meanwhile when the daemon has
//! `live-restore` on, and their execd stays reachable (the socket does not go through the daemon).

mod client;
mod create;
mod delivery;
mod mounts;
mod section;
mod staging;
mod teardown;

use delivery::{resolve, RelayedExecd};

use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use hyper::Method;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use warren_core::{
    ExecdAddress, ExecdTransport, ExitInfo, HostVolumes, ImageSource, Liveness, NetworkLinks,
    Runtime, RuntimeError, RuntimeFeatures, RuntimeState, SandboxSpec, EXECD_SOCKET_NAME,
};
use warren_env::EnvVars;

pub use client::{Client, DockerError, Endpoint, TlsFiles};
pub use section::{Common, DockerSection};

/// Label carrying the sandbox id.
pub const LABEL_SANDBOX: &str = "io.warren.sandbox";
/// Label carrying the data dir of the Warren server that owns the container.
pub const LABEL_OWNER: &str = "io.warren.owner";
/// Label carrying the digest of the execd binary a volume holds (remote daemons).
pub const LABEL_EXECD: &str = "io.warren.execd";
/// Where execd's volume is mounted in containers on a remote daemon.
const EXECD_DIR: &str = "/.warren/bin";
/// The network Warren makes on a remote daemon for its sandboxes, unless `[docker] network` names one.
pub const SANDBOX_NETWORK: &str = "warren-sandboxes";
/// The relay's container on a remote daemon (one per daemon).
const RELAY_CONTAINER: &str = "warren-relay";
/// Label carrying the execd digest of a relay container.
pub const LABEL_RELAY: &str = "io.warren.relay";
/// Label carrying the network (subnet) a relay reaches.
pub const LABEL_RELAY_TO: &str = "io.warren.relay.to";

#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// `DOCKER_HOST` syntax; `None` means `$DOCKER_HOST`, else `unix:///var/run/docker.sock`.
    pub host: Option<String>,
    /// An OCI runtime registered with the daemon (`runsc` for gVisor); `None` is the daemon's default.
    pub oci_runtime: Option<String>,
    /// Pull images the daemon does not have (else they must be there already).
    pub pull: bool,
    /// The server's `[registries]`: a registry configured there may be private; the daemon is
    /// asked to pull from any other only if it is public (see `delegated_pull_allowed`).
    pub registries: warren_registry::RegistriesConfig,
    pub data_dir: PathBuf,
    /// The static execd binary on the host: bind-mounted by a daemon on this host, uploaded to a
    /// daemon elsewhere.
    pub execd_path: PathBuf,
    pub ready_timeout: Duration,
    /// TLS to a `tcp://` daemon: its CA, and Warren's client certificate and key.
    pub tls: Option<TlsFiles>,
    /// Where the server reaches a remote daemon's relay (its host's address); default: the host of
    /// `host`.
    pub sandbox_host: Option<String>,
    /// The network sandboxes on a remote daemon join; default [`SANDBOX_NETWORK`], made by Warren
    /// internal (no route out) with traffic between containers off. One named here is used as it
    /// is (the relay, in the host's network namespace, reaches its containers).
    pub network: Option<String>,
}

/// What the server persists about a container.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct DockerState {
    container: String,
    /// The container's init as the host sees it, and its start time (for a network link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pid: Option<(i32, u64)>,
    /// Named volumes this sandbox created with `deleteOnSandboxTermination`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    delete_volumes: Vec<String>,
    /// Where execd is on a remote daemon: the container's address on the sandboxes' network, and
    /// the relay it was reached through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    execd: Option<RelayedExecd>,
}

pub struct DockerRuntime {
    client: std::sync::Arc<Client>,
    /// The daemon is reached over a Unix socket, so it runs on this host and its pids are ours.
    local: bool,
    /// A remote daemon's host, where its relay is reached.
    sandbox_ip: Option<std::net::IpAddr>,
    config: DockerConfig,
    owner: String,
    /// On a remote daemon: execd's short digest, once its volume is uploaded.
    execd_build: tokio::sync::OnceCell<String>,
    /// Held while the relay is looked at (and made), so that this server makes it once.
    relay: tokio::sync::Mutex<()>,
    /// Where volumes are staged for a daemon on this host (see [`staging`]).
    staging: staging::Staging,
}

impl DockerRuntime {
    pub fn new(config: DockerConfig) -> Result<Self, RuntimeError> {
        let host = config
            .host
            .clone()
            .or_else(|| warren_env::var(EnvVars::DOCKER_HOST))
            .unwrap_or_else(|| warren_env::DEFAULT_DOCKER_HOST.to_string());
        let mut endpoint = Endpoint::parse(&host).map_err(RuntimeError::Unsupported)?;
        let tls = config.tls.clone().or_else(|| {
            // Docker's own variables, when the host came from the environment too
            (config.host.is_none()
                && warren_env::var(EnvVars::DOCKER_TLS_VERIFY).is_some_and(|v| v != "0"))
            .then(|| {
                warren_env::var_os(EnvVars::DOCKER_CERT_PATH)
                    .map(PathBuf::from)
                    .or_else(|| {
                        warren_env::var_os(EnvVars::HOME).map(|h| PathBuf::from(h).join(".docker"))
                    })
                    .map(|d| TlsFiles::in_dir(&d))
            })
            .flatten()
        });
        if let Some(files) = &tls {
            endpoint = endpoint
                .with_tls(files)
                .map_err(|e| RuntimeError::Unsupported(format!("[docker] TLS: {e}")))?;
        } else if host.starts_with("https://") {
            return Err(RuntimeError::Unsupported(
                "[docker] host is https://: give the CA and client certificate ([docker] tls_cert_path)"
                    .into(),
            ));
        }
        let local = matches!(endpoint, Endpoint::Unix(_));
        let sandbox_ip = match (&config.sandbox_host, endpoint.host()) {
            (Some(h), _) => Some(resolve(h)?),
            (None, Some(h)) if !local => Some(resolve(h)?),
            _ => None,
        };
        std::fs::create_dir_all(config.data_dir.join("sandboxes")).map_err(|e| {
            RuntimeError::backend_with(format!("creating {}", config.data_dir.display()), e)
        })?;
        let owner = config.data_dir.to_string_lossy().to_string();
        Ok(Self {
            client: std::sync::Arc::new(Client::new(endpoint)),
            local,
            sandbox_ip,
            owner,
            execd_build: tokio::sync::OnceCell::new(),
            relay: tokio::sync::Mutex::new(()),
            staging: staging::Staging::new(&config.data_dir),
            config,
        })
    }

    fn run_dir(&self, id: &str) -> PathBuf {
        self.config.data_dir.join("sandboxes").join(id).join("run")
    }

    fn container_name(id: &str) -> String {
        format!("warren-{id}")
    }

    fn map_err(&self, what: &str, e: DockerError) -> RuntimeError {
        match e {
            DockerError::Unavailable { .. } => RuntimeError::Unavailable(format!("{what}: {e}")),
            e if e.is_not_found() => RuntimeError::NotFound(format!("{what}: {e}")),
            DockerError::Api { status: 409, .. } => RuntimeError::Conflict(format!("{what}: {e}")),
            e => RuntimeError::backend(format!("{what}: {e}")),
        }
    }

    /// A daemon reached over a Unix socket runs here; one over TCP may not.
    fn local_daemon(&self) -> bool {
        self.local
    }

    async fn inspect(&self, container: &str) -> Result<Value, RuntimeError> {
        self.client
            .call(Method::GET, &format!("/containers/{container}/json"), None)
            .await
            .map_err(|e| self.map_err("inspecting the container", e))
    }
}

fn state_of(state: &RuntimeState) -> Option<DockerState> {
    serde_json::from_value(state.clone()).ok()
}

impl NetworkLinks for DockerRuntime {
    fn network_pid(&self, state: &RuntimeState) -> Option<i32> {
        let st: DockerState = serde_json::from_value(state.clone()).ok()?;
        let (pid, start) = st.pid?;
        (warren_core::process_start_time(pid) == Some(start)).then_some(pid)
    }
}

#[async_trait::async_trait]
impl Runtime for DockerRuntime {
    fn name(&self) -> String {
        match &self.config.oci_runtime {
            Some(r) => format!("docker/{r}"),
            None => "docker".into(),
        }
    }

    fn backend_identifiers(&self, id: &str) -> std::collections::BTreeMap<String, String> {
        [("container".to_string(), Self::container_name(id))].into()
    }

    fn sandboxes_described(&self) -> String {
        if self.local {
            format!("sandboxes of the {} runtime", self.name())
        } else {
            // Its containers' network namespaces are on another host, out of this host's firewall.
            "sandboxes on a remote Docker daemon (their network lives on its host, out of Warren's reach)"
                .into()
        }
    }

    fn features(&self) -> RuntimeFeatures {
        RuntimeFeatures {
            execd_transport: if self.local {
                ExecdTransport::Unix
            } else {
                ExecdTransport::Tcp
            },
            pause: true,
            // StorageOpt bounds the root only on some storage drivers.
            disk_bound: false,
            // The daemon's `userns-remap` is its own.
            user_namespaces: false,
            isolated_sessions: false,
            // A daemon elsewhere would mount its own host's folders.
            host_volumes: if self.local {
                HostVolumes::Server
            } else {
                HostVolumes::None
            },
            image_source: ImageSource::Engine,
            create_parallelism: None,
        }
    }

    /// gVisor keeps its own network stack inside the sandbox: a link in the container's host-side
    /// namespace would not reach it. The daemon must be on this host (its pids are ours). (No
    /// `layers`: no writable layer on this host that Warren can copy.)
    fn links(&self) -> Option<&dyn NetworkLinks> {
        (self.config.oci_runtime.as_deref() != Some("runsc") && self.local_daemon())
            .then_some(self as &dyn NetworkLinks)
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError> {
        let name = Self::container_name(&spec.id);
        let volumes = match self.volume_mounts(&spec.id, &spec.volumes).await {
            Ok(v) => v,
            Err(e) => {
                self.staging.remove(&spec.id);
                return Err(e);
            }
        };
        match self.try_create(spec, &name, &volumes).await {
            Ok((container, execd)) => serde_json::to_value(DockerState {
                pid: self.init_pid(&container).await,
                container,
                delete_volumes: volumes.delete_on_exit,
                execd,
            })
            .map_err(|e| RuntimeError::backend_with("encoding state", e)),
            Err(e) => {
                // Nothing half-made: the container (if any), the folder and the volumes this
                // create made go.
                let _ = self.remove(&name).await;
                self.remove_dir(&spec.id);
                self.staging.remove(&spec.id);
                self.remove_volumes(&volumes.created).await;
                Err(e)
            }
        }
    }

    fn execd_address(&self, id: &str, state: &RuntimeState) -> ExecdAddress {
        match state_of(state).and_then(|s| s.execd) {
            // the relay where this server's config says now (`sandbox_host` may have changed)
            Some(e) => ExecdAddress::Relayed {
                relay: self.relay_addr().unwrap_or(e.relay),
                target: e.ip,
            },
            None => ExecdAddress::Unix(self.run_dir(id).join(EXECD_SOCKET_NAME)),
        }
    }

    fn wait_exit(&self, id: &str, state: &RuntimeState) -> BoxFuture<'static, ExitInfo> {
        let container = state_of(state)
            .map(|s| s.container)
            .unwrap_or_else(|| Self::container_name(id));
        let client = self.client.clone();
        Box::pin(async move {
            let path = format!("/containers/{container}/wait?condition=not-running");
            loop {
                match client.send(Method::POST, &path, None, &[]).await {
                    Ok((status, body)) => {
                        use http_body_util::BodyExt;
                        // The answer comes when the container stops; a daemon that goes away
                        // meanwhile cuts the body, and then the wait starts over once it is back.
                        let Ok(bytes) = body.collect().await.map(|b| b.to_bytes()) else {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            continue;
                        };
                        if status.as_u16() == 404 {
                            return ExitInfo {
                                code: None,
                                signal: None,
                                vanished: true,
                                detail: None,
                            };
                        }
                        if !status.is_success() {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            continue;
                        }
                        let v: Value = serde_json::from_slice(&bytes).unwrap_or_default();
                        // `docker rm -f` marks the removal before it kills: a container being (or
                        // already) removed was deleted behind Warren's back, not ended by itself.
                        let path = format!("/containers/{container}/json");
                        let vanished = match client.call::<Value>(Method::GET, &path, None).await {
                            Err(e) => e.is_not_found(),
                            Ok(info) => {
                                info["State"]["Dead"] == json!(true)
                                    || info["State"]["Status"] == "removing"
                                    || info["RemovalInProgress"] == json!(true)
                            }
                        };
                        let code = v["StatusCode"].as_i64().map(|c| c as i32);
                        return match code {
                            _ if vanished => ExitInfo {
                                code: None,
                                signal: None,
                                vanished: true,
                                detail: None,
                            },
                            // 128+n: killed by signal n (the shell convention Docker follows)
                            Some(c) if c > 128 && c < 160 => ExitInfo {
                                code: None,
                                signal: Some(c - 128),
                                vanished: false,
                                detail: None,
                            },
                            c => ExitInfo {
                                code: c,
                                signal: None,
                                vanished: false,
                                detail: None,
                            },
                        };
                    }
                    Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                }
            }
        })
    }

    async fn pause(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError> {
        let c = state_of(state)
            .map(|s| s.container)
            .unwrap_or_else(|| Self::container_name(id));
        self.client
            .call::<Value>(Method::POST, &format!("/containers/{c}/pause"), None)
            .await
            .map(|_| ())
            .map_err(|e| self.map_err("pausing the container", e))
    }

    async fn resume(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError> {
        let c = state_of(state)
            .map(|s| s.container)
            .unwrap_or_else(|| Self::container_name(id));
        self.client
            .call::<Value>(Method::POST, &format!("/containers/{c}/unpause"), None)
            .await
            .map(|_| ())
            .map_err(|e| self.map_err("resuming the container", e))
    }

    async fn destroy(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError> {
        let st = state_of(state);
        let c = st
            .as_ref()
            .map(|s| s.container.clone())
            .unwrap_or_else(|| Self::container_name(id));
        self.remove(&c).await?;
        self.remove_dir(id);
        // after the container: its mounts were copies of these
        self.staging.remove(id);
        if let Some(st) = st {
            self.remove_volumes(&st.delete_volumes).await;
        }
        Ok(())
    }

    async fn liveness(&self, id: &str, state: &RuntimeState) -> Liveness {
        let c = state_of(state)
            .map(|s| s.container)
            .unwrap_or_else(|| Self::container_name(id));
        match self.inspect(&c).await {
            Ok(v) => match v["State"]["Status"].as_str() {
                Some("running") => Liveness::Running,
                Some("paused") => Liveness::Paused,
                _ => Liveness::Gone,
            },
            Err(RuntimeError::NotFound(_)) => Liveness::Gone,
            // The daemon is away: do not give up on sandboxes we cannot see; the exit watch will
            // tell once it is back.
            Err(e) => {
                tracing::warn!(sandbox_id = id, error = %e, "cannot check the container; assuming it runs");
                Liveness::Running
            }
        }
    }

    async fn sweep_orphans(&self, known: &[String]) {
        // Needs no daemon: the staged volumes are mounts on this host.
        self.staging.sweep(known);
        let filters = json!({"label": [format!("{LABEL_OWNER}={}", self.owner)]}).to_string();
        let path = format!(
            "/containers/json?all=true&filters={}",
            client::encode(&filters)
        );
        let list: Vec<Value> = match self.client.call(Method::GET, &path, None).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list Warren's containers to remove leftovers");
                return;
            }
        };
        for c in list {
            let id = c["Labels"][LABEL_SANDBOX]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if known.contains(&id) {
                continue;
            }
            let cid = c["Id"].as_str().unwrap_or_default();
            tracing::info!(sandbox_id = %id, container = cid, "removing a container Warren has no record of");
            let _ = self.remove(cid).await;
            if warren_core::is_valid_sandbox_id(&id) {
                self.remove_dir(&id);
            }
        }
    }
}
