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
mod staging;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine;
use futures::future::BoxFuture;
use hyper::Method;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use warren_core::{
    policy, ExecdAddress, ExecdTransport, ExitInfo, HostVolumes, ImageSource, Liveness,
    NetworkLinks, Runtime, RuntimeError, RuntimeFeatures, RuntimeState, SandboxImage, SandboxSpec,
    VolumeMount, VolumeSource, EXECD_IN_SANDBOX, EXECD_SOCKET_NAME, SOCKET_DIR_IN_SANDBOX,
};
use warren_env::EnvVars;

pub use client::{Client, DockerError, Endpoint, TlsFiles};

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

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct RelayedExecd {
    relay: std::net::SocketAddr,
    ip: std::net::IpAddr,
}

/// How execd gets into a container and is reached.
enum Delivery {
    /// Bind-mounted from this host; a Unix socket in a bind-mounted host folder.
    Local,
    /// From the named volume holding it; TCP, reached through the relay on the daemon's host.
    Remote { volume: String, network: String },
}

/// A sandbox's volumes as Docker mounts, and which named volumes resolving them created.
#[derive(Default)]
struct Mounts {
    mounts: Vec<Value>,
    created: Vec<String>,
    delete_on_exit: Vec<String>,
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

    /// The image's config, pulling it first when the daemon does not have it.
    async fn ensure_image(
        &self,
        name: &str,
        auth: Option<&warren_api::lifecycle::ImageAuth>,
    ) -> Result<Value, RuntimeError> {
        let path = format!("/images/{}/json", client::encode(name));
        match self.client.call::<Value>(Method::GET, &path, None).await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(self.map_err(&format!("inspecting image {name}"), e)),
        }
        if !self.config.pull {
            return Err(RuntimeError::ImageNotFound(format!(
                "image {name:?} is not on the Docker host, and this server does not pull ([docker] pull = \"never\")"
            )));
        }
        // The daemon connects wherever a create's name points; a caller must not make it reach
        // the host's own or private services, nor learn from its errors which ports are open.
        warren_registry::delegated_pull_allowed(&self.config.registries, name)
            .await
            .map_err(|why| {
                RuntimeError::ImageNotFound(format!(
                    "image {name:?} is not on the Docker host, and it is not pulled: {why}"
                ))
            })?;
        let registry_auth = auth.map(|a| {
            let json = json!({"username": a.username, "password": a.password});
            base64::engine::general_purpose::URL_SAFE.encode(json.to_string())
        });
        tracing::info!(image = name, "pulling");
        self.client
            .pull(name, registry_auth)
            .await
            .map_err(|e| match e {
                DockerError::Api { message, .. } => RuntimeError::ImageNotFound(format!(
                    "image {name:?} is not on the Docker host and pulling it failed: {message}"
                )),
                e => self.map_err(&format!("pulling image {name}"), e),
            })?;
        self.client
            .call::<Value>(Method::GET, &path, None)
            .await
            .map_err(|e| self.map_err(&format!("inspecting image {name}"), e))
    }

    fn create_body(
        &self,
        spec: &SandboxSpec,
        image: &str,
        image_config: &Value,
        volumes: &[Value],
        delivery: &Delivery,
    ) -> Value {
        let workdir = image_config["Config"]["WorkingDir"]
            .as_str()
            .filter(|w| w.starts_with('/'))
            .unwrap_or("/");
        let mut entrypoint = match delivery {
            Delivery::Local => vec![
                EXECD_IN_SANDBOX.to_string(),
                "--socket".into(),
                format!("{SOCKET_DIR_IN_SANDBOX}/{EXECD_SOCKET_NAME}"),
            ],
            Delivery::Remote { .. } => vec![
                format!("{EXECD_DIR}/warren-execd"),
                "--listen".into(),
                format!("0.0.0.0:{}", warren_api::EXECD_PORT),
                // only the verifier: the credential itself never enters the sandbox
                "--access-token-sha256".into(),
                spec.execd_verifier.clone(),
            ],
        };
        if let Some(floor) = &spec.hardening {
            entrypoint.extend(["--floor".into(), serde_json::json!(floor).to_string()]);
        }
        entrypoint.extend(["--workdir".into(), workdir.to_string(), "--".into()]);
        entrypoint.extend(spec.entrypoint.iter().cloned());
        // Docker adds the image's own env; ours (and the request's) win.
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        env.insert("HOME".into(), "/root".into());
        env.insert("LANG".into(), "C.UTF-8".into());
        if let Some(image_env) = image_config["Config"]["Env"].as_array() {
            for kv in image_env.iter().filter_map(|v| v.as_str()) {
                if let Some((k, v)) = kv.split_once('=') {
                    env.insert(k.into(), v.into());
                }
            }
        }
        env.extend(spec.env.clone());
        let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        // Structured mounts, not `Binds` strings: a `:` in a path cannot be misread.
        let mut mounts = match delivery {
            Delivery::Local => vec![
                bind_mount(&self.config.execd_path, EXECD_IN_SANDBOX, true),
                bind_mount(&self.run_dir(&spec.id), SOCKET_DIR_IN_SANDBOX, false),
            ],
            Delivery::Remote { volume, .. } => vec![json!({
                "Type": "volume", "Source": volume, "Target": EXECD_DIR, "ReadOnly": true,
                "VolumeOptions": {"NoCopy": true},
            })],
        };
        mounts.extend(volumes.iter().cloned());
        let network = match delivery {
            Delivery::Local => "none",
            Delivery::Remote { network, .. } => network,
        };
        let mut host = json!({
            "Mounts": mounts,
            "NetworkMode": network,
            "CapDrop": ["ALL"],
            "CapAdd": policy::KEPT_CAPABILITIES,
            "SecurityOpt": security_opts(self.config.oci_runtime.as_deref()),
            "PidsLimit": spec.limits.pids,
            "RestartPolicy": {"Name": "no"},
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}},
        });
        if let Some(m) = spec.limits.cpu_millis {
            host["NanoCpus"] = json!(m * 1_000_000);
        }
        if let Some(b) = spec.limits.memory_bytes {
            host["Memory"] = json!(b);
            host["MemorySwap"] = json!(b);
        }
        if let Some(b) = spec.limits.disk_bytes {
            // Docker bounds a container's writable layer only on some storage drivers (overlay2
            // over XFS with `pquota`, say); elsewhere the create fails and `create` says why.
            host["StorageOpt"] = json!({"size": b.to_string()});
        }
        if let Some(r) = &self.config.oci_runtime {
            host["Runtime"] = json!(r);
        }
        // Open files per process, as native sandboxes get them (`[limits] open_files`), not the
        // daemon's own limit.
        if let Some((soft, hard)) = warren_core::fd_limit::for_children() {
            host["Ulimits"] = json!([{"Name": "nofile", "Soft": soft, "Hard": hard}]);
        }
        json!({
            "Image": image,
            "Entrypoint": entrypoint,
            "Cmd": [],
            "Env": env,
            "User": "0:0",
            "Hostname": spec.id.chars().take(12).collect::<String>(),
            "WorkingDir": workdir,
            "Labels": {LABEL_SANDBOX: spec.id, LABEL_OWNER: self.owner},
            "HostConfig": host,
        })
    }

    /// Docker mounts for sandbox `id`'s volumes; named volumes are Docker named volumes (created
    /// here, labelled as Warren's, when missing and allowed). On error, volumes created so far are
    /// removed (the caller removes what was staged).
    async fn volume_mounts(
        &self,
        id: &str,
        volumes: &[VolumeMount],
    ) -> Result<Mounts, RuntimeError> {
        let mut out = Mounts::default();
        for (n, v) in volumes.iter().enumerate() {
            match self.volume_mount(id, n, v, &mut out).await {
                Ok(mount) => out.mounts.push(mount),
                Err(e) => {
                    self.remove_volumes(&out.created).await;
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// The Docker mount of sandbox `id`'s `n`th volume `v`; a named volume created for it is
    /// recorded in `out`.
    async fn volume_mount(
        &self,
        id: &str,
        n: usize,
        v: &VolumeMount,
        out: &mut Mounts,
    ) -> Result<Value, RuntimeError> {
        let invalid = |e: std::io::Error, what: String| match e.kind() {
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::NotFound => {
                RuntimeError::Invalid(format!("{what}: {e}"))
            }
            _ => RuntimeError::backend_with(what, e),
        };
        let (claim, sub_path, create_if_missing, delete_on_termination) = match &v.source {
            VolumeSource::Host(_) if !self.local => {
                return Err(RuntimeError::Unsupported(
                    "host volumes need a Docker daemon on this host; this one is reached over TCP \
                     (use a named volume)"
                        .into(),
                ));
            }
            // Canonical when the server checked it: from `/`, with no link on the way, it is
            // still what was checked (see `warren_core::beneath`); a sandbox with a folder above
            // it mounted may change that at any time, so the daemon gets it staged.
            VolumeSource::Host(path) => {
                let what = format!("volume at {}", v.target);
                let rel = path.strip_prefix("/").unwrap_or(path);
                let opened = warren_core::beneath::open_beneath(Path::new("/"), rel, false)
                    .map_err(|e| invalid(e, what.clone()))?;
                let staged = self
                    .staging
                    .stage(id, n, &opened, v.read_only)
                    .map_err(|e| RuntimeError::backend_with(format!("staging the {what}"), e))?;
                return Ok(bind_mount(&staged, &v.target, v.read_only));
            }
            VolumeSource::Named {
                claim,
                sub_path,
                create_if_missing,
                delete_on_termination,
            } => (claim, sub_path, *create_if_missing, *delete_on_termination),
        };
        let info = match self.volume(claim).await? {
            Some(info) => info,
            None if !create_if_missing => {
                return Err(RuntimeError::Invalid(format!(
                    "volume {claim:?} does not exist (createIfNotExists is false)"
                )));
            }
            None => {
                let body = json!({"Name": claim, "Labels": {LABEL_OWNER: self.owner}});
                let info = self
                    .client
                    .call::<Value>(Method::POST, "/volumes/create", Some(&body))
                    .await
                    .map_err(|e| self.map_err(&format!("creating volume {claim}"), e))?;
                out.created.push(claim.clone());
                if delete_on_termination {
                    out.delete_on_exit.push(claim.clone());
                }
                info
            }
        };
        let Some(sub) = sub_path else {
            return Ok(
                json!({"Type": "volume", "Source": claim, "Target": v.target,
                             "ReadOnly": v.read_only}),
            );
        };
        // Docker 20.10 has no volume subpaths: bind the folder inside the volume's mount point
        // (local driver, daemon on this host), creating it like k8s does — inside the volume only:
        // its contents are sandboxes', and a link there must not make the server create, or
        // Docker mount, a host folder. The daemon is given the folder staged, never its path in
        // the volume, which a sandbox using the volume may swap for a link after this check.
        let base = info["Mountpoint"].as_str().unwrap_or_default();
        let what =
            format!("volume {claim:?}: subPath {sub:?} (it needs a local volume on this host)");
        let opened = if base.is_empty() {
            Err(std::io::Error::other("not a local volume"))
        } else {
            warren_core::beneath::open_beneath(Path::new(base), Path::new(sub), true)
        }
        .map_err(|e| RuntimeError::Invalid(format!("{what}: {e}")))?;
        if !self.local {
            // Unchanged for a daemon elsewhere: its volumes are not this host's to stage.
            return Ok(bind_mount(
                &Path::new(base).join(sub),
                &v.target,
                v.read_only,
            ));
        }
        let staged = self
            .staging
            .stage(id, n, &opened, v.read_only)
            .map_err(|e| RuntimeError::backend_with(format!("staging volume {claim:?}"), e))?;
        Ok(bind_mount(&staged, &v.target, v.read_only))
    }

    /// `Some(inspect)` when the named volume exists.
    async fn volume(&self, claim: &str) -> Result<Option<Value>, RuntimeError> {
        match self
            .client
            .call::<Value>(
                Method::GET,
                &format!("/volumes/{}", client::encode(claim)),
                None,
            )
            .await
        {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(self.map_err(&format!("inspecting volume {claim}"), e)),
        }
    }

    /// Removes named volumes; one still in use by another container stays (Docker refuses).
    async fn remove_volumes(&self, claims: &[String]) {
        for claim in claims {
            match self
                .client
                .call::<Value>(
                    Method::DELETE,
                    &format!("/volumes/{}", client::encode(claim)),
                    None,
                )
                .await
            {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => tracing::info!(volume = %claim, error = %e, "volume not removed"),
            }
        }
    }

    /// The container's id, and where execd is when it is reached through the relay.
    async fn try_create(
        &self,
        spec: &SandboxSpec,
        name: &str,
        volumes: &Mounts,
    ) -> Result<(String, Option<RelayedExecd>), RuntimeError> {
        let SandboxImage::Reference { name: image, auth } = &spec.image else {
            return Err(RuntimeError::Unsupported(
                "the Docker runtime runs images from the Docker host; the built-in `host` image and \
                 imported images need the native runtime"
                    .into(),
            ));
        };
        if image == "host" {
            return Err(RuntimeError::Unsupported(
                "the built-in `host` image needs the native runtime".into(),
            ));
        }
        let image_config = self.ensure_image(image, auth.as_ref()).await?;
        let run_dir = self.run_dir(&spec.id);
        let mut subnet = String::new();
        let delivery = if self.local {
            warren_core::mount_socket_dir(&run_dir).map_err(|e| {
                RuntimeError::backend_with(
                    format!("mounting the socket folder {}", run_dir.display()),
                    e,
                )
            })?;
            Delivery::Local
        } else {
            let (network, net) = self.sandbox_network().await?;
            subnet = net;
            Delivery::Remote {
                volume: execd_volume_name(&self.execd_build(image).await?),
                network,
            }
        };
        let body = self.create_body(spec, image, &image_config, &volumes.mounts, &delivery);
        let created: Value = self
            .client
            .call(
                Method::POST,
                &format!("/containers/create?name={}", client::encode(name)),
                Some(&body),
            )
            .await
            .map_err(|e| match e {
                DockerError::Api { .. }
                    if spec.limits.disk_bytes.is_some() && e.to_string().contains("storage-opt") =>
                {
                    RuntimeError::Unsupported(format!(
                        "ephemeral-storage: this Docker daemon cannot bound a container's writes ({e})"
                    ))
                }
                e => self.map_err("creating the container", e),
            })?;
        let container = created["Id"]
            .as_str()
            .ok_or_else(|| RuntimeError::backend("Docker returned no container id"))?
            .to_string();
        self.client
            .call::<Value>(
                Method::POST,
                &format!("/containers/{container}/start"),
                None,
            )
            .await
            .map_err(|e| self.map_err("starting the container", e))?;
        let execd = match delivery {
            Delivery::Local => {
                let socket = run_dir.join(EXECD_SOCKET_NAME);
                self.wait_ready(&container, &Probe::Socket(&socket)).await?;
                None
            }
            Delivery::Remote { network, .. } => {
                let info = self.inspect(&container).await?;
                let ip = info["NetworkSettings"]["Networks"][network.as_str()]["IPAddress"]
                    .as_str()
                    .and_then(|a| a.parse::<std::net::IpAddr>().ok())
                    .ok_or_else(|| {
                        RuntimeError::backend(format!("the container has no address on {network}"))
                    })?;
                let relay = self.relay(image, &subnet).await?;
                let execd = RelayedExecd { relay, ip };
                self.wait_ready(&container, &Probe::Relayed(execd)).await?;
                Some(execd)
            }
        };
        Ok((container, execd))
    }

    /// The relay's address, the relay made (or found, or made again) first. It runs
    /// `warren-execd relay` from an image of execd alone (imported once per execd build) in the
    /// daemon host's network namespace: the host reaches its bridges' containers, which containers
    /// of a network with traffic between them off cannot. One relay per daemon, shared by every
    /// server using it (any build's relay speaks the same).
    async fn relay(&self, image: &str, subnet: &str) -> Result<std::net::SocketAddr, RuntimeError> {
        // one server makes it at a time
        let _one = self.relay.lock().await;
        let addr = self
            .relay_addr()
            .ok_or_else(|| RuntimeError::backend("no address for the Docker host"))?;
        // Running, for this network: a network removed and made again (`docker network prune`)
        // may have another subnet, which the relay would refuse.
        let current = self.inspect(RELAY_CONTAINER).await.is_ok_and(|i| {
            i["State"]["Running"] == json!(true) && i["Config"]["Labels"][LABEL_RELAY_TO] == subnet
        });
        if !current {
            let build = self.execd_build(image).await?;
            self.ensure_relay(&build, subnet).await?;
        }
        Ok(addr)
    }

    fn relay_addr(&self) -> Option<std::net::SocketAddr> {
        self.sandbox_ip
            .map(|ip| std::net::SocketAddr::new(ip, warren_api::RELAY_PORT))
    }

    async fn running(&self, container: &str) -> bool {
        self.inspect(container)
            .await
            .is_ok_and(|i| i["State"]["Running"] == json!(true))
    }

    async fn ensure_relay(&self, digest: &str, subnet: &str) -> Result<(), RuntimeError> {
        let image = format!("warren-execd:{digest}");
        let path = format!("/images/{}/json", client::encode(&image));
        if let Err(e) = self.client.call::<Value>(Method::GET, &path, None).await {
            if !e.is_not_found() {
                return Err(self.map_err("looking up execd's image", e));
            }
            let execd_path = self.config.execd_path.clone();
            let (_, archive) = tokio::task::spawn_blocking(move || execd_archive(&execd_path))
                .await
                .map_err(|e| RuntimeError::backend_with("reading execd", e))?
                .map_err(|e| RuntimeError::backend(format!("reading execd: {e}")))?;
            self.client
                .import_image("warren-execd", digest, archive.binary)
                .await
                .map_err(|e| self.map_err("importing execd's image", e))?;
        }
        let _ = self.remove(RELAY_CONTAINER).await; // stopped, or for a network gone since
        let body = json!({
            "Image": image,
            "Entrypoint": ["/warren-execd", "relay",
                           "--listen", format!("0.0.0.0:{}", warren_api::RELAY_PORT),
                           "--to", subnet, "--port", warren_api::EXECD_PORT.to_string()],
            "Cmd": [],
            "User": "65534:65534",
            "Labels": {LABEL_RELAY: digest, LABEL_RELAY_TO: subnet},
            "HostConfig": {
                "NetworkMode": "host",
                "RestartPolicy": {"Name": "unless-stopped"},
                "ReadonlyRootfs": true,
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "LogConfig": {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}},
            },
        });
        let path = format!(
            "/containers/create?name={}",
            client::encode(RELAY_CONTAINER)
        );
        match self
            .client
            .call::<Value>(Method::POST, &path, Some(&body))
            .await
        {
            // another server made it meanwhile
            Ok(_) | Err(DockerError::Api { status: 409, .. }) => {}
            Err(e) => return Err(self.map_err("creating the relay", e)),
        }
        self.try_action(RELAY_CONTAINER, "start").await;
        if !self.running(RELAY_CONTAINER).await {
            return Err(RuntimeError::backend(format!(
                "the relay did not start: {}",
                self.logs_tail(RELAY_CONTAINER).await
            )));
        }
        Ok(())
    }

    /// This execd build's short digest, its volume on the remote daemon uploaded the first time
    /// (per server start, and per execd build: the volume, [`execd_volume_name`], is named for the
    /// binary's digest). Uploading needs a container to write through; one is created from `image`
    /// (already on the daemon), never started, and removed.
    async fn execd_build(&self, image: &str) -> Result<String, RuntimeError> {
        self.execd_build
            .get_or_try_init(|| self.upload_execd(image))
            .await
            .cloned()
    }

    async fn upload_execd(&self, image: &str) -> Result<String, RuntimeError> {
        let path = self.config.execd_path.clone();
        let (digest, archive) = tokio::task::spawn_blocking(move || execd_archive(&path))
            .await
            .map_err(|e| RuntimeError::backend_with("reading execd", e))?
            .map_err(|e| RuntimeError::backend(format!("reading execd: {e}")))?;
        let build = digest[..16].to_string();
        let volume = execd_volume_name(&build);
        // Shared by every server using this execd build on the daemon: no owner label, so no
        // server's sweep removes it from under another.
        let create = json!({"Name": volume, "Labels": {LABEL_EXECD: digest}});
        self.client
            .call::<Value>(Method::POST, "/volumes/create", Some(&create))
            .await
            .map_err(|e| self.map_err("creating execd's volume", e))?;
        let helper = format!(
            "warren-execd-upload-{}-{}",
            &digest[..12],
            std::process::id()
        );
        let body = json!({
            "Image": image,
            "Entrypoint": [format!("{EXECD_DIR}/warren-execd")],
            "Cmd": [],
            "Labels": {LABEL_OWNER: self.owner},
            "HostConfig": {
                "NetworkMode": "none",
                "Mounts": [{"Type": "volume", "Source": volume, "Target": EXECD_DIR,
                            "VolumeOptions": {"NoCopy": true}}],
            },
        });
        let _ = self.remove(&helper).await; // one left by a server that stopped mid-upload
        self.client
            .call::<Value>(
                Method::POST,
                &format!("/containers/create?name={}", client::encode(&helper)),
                Some(&body),
            )
            .await
            .map_err(|e| self.map_err("creating the container that uploads execd", e))?;
        let result = async {
            // `ready` is written after the binary: a volume that has it holds all of it
            let ready = format!(
                "/containers/{helper}/archive?path={}",
                client::encode(&format!("{EXECD_DIR}/ready"))
            );
            let (status, _) = self
                .client
                .send(Method::HEAD, &ready, None, &[])
                .await
                .map_err(|e| self.map_err("looking into execd's volume", e))?;
            if status.is_success() {
                return Ok(());
            }
            tracing::info!(volume = %volume, bytes = archive.binary_len, "uploading execd to the Docker host");
            for tar in [archive.binary, archive.ready] {
                self.client
                    .put_archive(&helper, EXECD_DIR, tar)
                    .await
                    .map_err(|e| self.map_err("uploading execd", e))?;
            }
            Ok(())
        }
        .await;
        let _ = self.remove(&helper).await;
        result.map(|()| build)
    }

    /// The sandboxes' network and its subnet: `[docker] network`, or Warren's own, internal (no
    /// route out) with traffic between containers off (made when missing; a racing server that
    /// made it first is fine). Looked up on every create: one removed meanwhile (`docker network
    /// prune` once no sandbox used it) is made again.
    async fn sandbox_network(&self) -> Result<(String, String), RuntimeError> {
        let name = self
            .config
            .network
            .clone()
            .unwrap_or_else(|| SANDBOX_NETWORK.to_string());
        let path = format!("/networks/{}", client::encode(&name));
        let info = match self.client.call::<Value>(Method::GET, &path, None).await {
            Ok(info) => info,
            Err(e) if e.is_not_found() && self.config.network.is_none() => {
                let body = json!({
                    "Name": name,
                    "Driver": "bridge",
                    "CheckDuplicate": true,
                    "Internal": true,
                    "Options": {"com.docker.network.bridge.enable_icc": "false"},
                    // shared by every server on the daemon, like execd's volume
                    "Labels": {"io.warren.network": "sandboxes"},
                });
                match self
                    .client
                    .call::<Value>(Method::POST, "/networks/create", Some(&body))
                    .await
                {
                    Ok(_) | Err(DockerError::Api { status: 409, .. }) => {}
                    Err(e) => return Err(self.map_err("creating the sandbox network", e)),
                }
                self.client
                    .call::<Value>(Method::GET, &path, None)
                    .await
                    .map_err(|e| self.map_err("looking up the sandbox network", e))?
            }
            Err(e) => return Err(self.map_err(&format!("looking up network {name}"), e)),
        };
        let subnet = info["IPAM"]["Config"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|c| c["Subnet"].as_str())
            .ok_or_else(|| RuntimeError::backend(format!("network {name} has no subnet")))?
            .to_string();
        Ok((name, subnet))
    }

    async fn wait_ready(&self, container: &str, probe: &Probe<'_>) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + self.config.ready_timeout;
        let mut checks = 0u32;
        loop {
            if probe.answers().await {
                return Ok(());
            }
            checks += 1;
            // Every ~50 ms (TCP: every check) also ask the daemon whether the container is still up.
            if checks.is_multiple_of(probe.checks_per_inspect()) {
                let state = self.inspect(container).await?;
                if state["State"]["Running"] != json!(true) {
                    return Err(RuntimeError::backend(format!(
                        "the container exited during start (exit code {}): {}",
                        state["State"]["ExitCode"],
                        self.logs_tail(container).await
                    )));
                }
            }
            if Instant::now() > deadline {
                return Err(RuntimeError::backend(format!(
                    "execd did not become ready within {:?}: {}",
                    self.config.ready_timeout,
                    self.logs_tail(container).await
                )));
            }
            tokio::time::sleep(probe.interval()).await;
        }
    }

    /// The container's init pid (with its start time), when the daemon runs on this host.
    async fn init_pid(&self, container: &str) -> Option<(i32, u64)> {
        if !self.local_daemon() {
            return None;
        }
        let info = self.inspect(container).await.ok()?;
        let pid = i32::try_from(info["State"]["Pid"].as_i64()?)
            .ok()
            .filter(|p| *p > 1)?;
        Some((pid, warren_core::process_start_time(pid)?))
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

    /// The container's last log lines (execd's own messages), for error messages.
    async fn logs_tail(&self, container: &str) -> String {
        use http_body_util::BodyExt;
        let path = format!("/containers/{container}/logs?stdout=1&stderr=1&tail=20");
        let Ok((_, body)) = self.client.send(Method::GET, &path, None, &[]).await else {
            return String::new();
        };
        let Ok(bytes) = body.collect().await.map(|b| b.to_bytes()) else {
            return String::new();
        };
        demux_logs(&bytes).trim().to_string()
    }

    /// Force-removes the container. The daemon sometimes gives up killing one (a gVisor sandbox that
    /// does not die within its wait, seen under load): then unpause, kill and try again, a few times.
    async fn remove(&self, container: &str) -> Result<(), RuntimeError> {
        // A paused container is resumed first. The daemon's forced removal kills it and resumes it
        // only after: under gVisor a paused sandbox cannot take the kill, the daemon waits 10 s,
        // kills runsc's processes directly, fails to resume what is then gone, and removes the
        // container while containerd keeps its task and its shim process — one leaked per deleted
        // paused sandbox. Not paused (the usual case), this answers 409 and costs one round trip.
        self.try_action(container, "unpause").await;
        let path = format!("/containers/{container}?force=true&v=true");
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.client.call::<Value>(Method::DELETE, &path, None).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_not_found() => return Ok(()),
                // "removal already in progress"
                Err(DockerError::Api { status: 409, .. }) => return Ok(()),
                Err(e @ DockerError::Api { status: 500, .. }) if attempt < 4 => {
                    tracing::warn!(container, error = %e, attempt, "removing the container failed; retrying");
                    for action in ["unpause", "kill"] {
                        self.try_action(container, action).await;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(self.map_err("removing the container", e)),
            }
        }
    }

    /// `POST /containers/{container}/{action}`, whose failure (not paused, already gone) is fine.
    async fn try_action(&self, container: &str, action: &str) {
        let _ = self
            .client
            .call::<Value>(
                Method::POST,
                &format!("/containers/{container}/{action}"),
                None,
            )
            .await;
    }

    fn remove_dir(&self, id: &str) {
        warren_core::unmount_socket_dir(&self.run_dir(id));
        let dir = self.config.data_dir.join("sandboxes").join(id);
        if let Err(e) = warren_fstree::remove_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(sandbox_id = id, error = %e, "removing the sandbox folder");
            }
        }
    }
}

/// How a create sees that execd is up.
enum Probe<'a> {
    /// Its Unix socket accepts.
    Socket(&'a Path),
    /// It answers HTTP through the relay. A connection alone proves nothing: the relay (and the
    /// daemon's port proxy before it) accepts before execd listens. Any answer will do (a 401: the
    /// probe has no credential).
    Relayed(RelayedExecd),
}

impl Probe<'_> {
    async fn answers(&self) -> bool {
        match self {
            Self::Socket(socket) => match warren_core::socket_connect_path(socket) {
                Ok((_handle, reachable)) => {
                    tokio::net::UnixStream::connect(&reachable).await.is_ok()
                }
                Err(_) => false,
            },
            Self::Relayed(e) => {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let probe = async {
                    let mut s = tokio::net::TcpStream::connect(e.relay).await.ok()?;
                    let request = format!(
                        "{}{}\nGET /ping HTTP/1.1\r\nHost: execd\r\nConnection: close\r\n\r\n",
                        warren_api::RELAY_PREAMBLE,
                        e.ip
                    );
                    s.write_all(request.as_bytes()).await.ok()?;
                    let mut head = [0u8; 8];
                    s.read_exact(&mut head).await.ok()?;
                    Some(head.starts_with(b"HTTP/1."))
                };
                tokio::time::timeout(Duration::from_secs(2), probe)
                    .await
                    .ok()
                    .flatten()
                    .unwrap_or(false)
            }
        }
    }

    fn interval(&self) -> Duration {
        match self {
            Self::Socket(_) => Duration::from_millis(2),
            Self::Relayed(_) => Duration::from_millis(20),
        }
    }

    fn checks_per_inspect(&self) -> u32 {
        match self {
            Self::Socket(_) => 25,
            Self::Relayed(_) => 3,
        }
    }
}

/// The volume holding execd build `build` (its short digest) on a remote daemon.
fn execd_volume_name(build: &str) -> String {
    format!("warren-execd-{build}")
}

/// execd as two tar archives for a volume: the binary, then a `ready` marker (its digest).
struct ExecdArchive {
    binary: bytes::Bytes,
    binary_len: usize,
    ready: bytes::Bytes,
}

/// execd's SHA-256 (hex) and its archives.
fn execd_archive(path: &Path) -> std::io::Result<(String, ExecdArchive)> {
    use sha2::Digest;
    let bin = std::fs::read(path)?;
    let digest = format!("{:x}", sha2::Sha256::digest(&bin));
    let tar_of = |name: &str, data: &[u8], mode: u32| -> std::io::Result<bytes::Bytes> {
        let mut b = tar::Builder::new(Vec::with_capacity(data.len() + 2048));
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append_data(&mut h, name, data)?;
        Ok(bytes::Bytes::from(b.into_inner()?))
    };
    let archive = ExecdArchive {
        binary: tar_of("warren-execd", &bin, 0o755)?,
        binary_len: bin.len(),
        ready: tar_of("ready", digest.as_bytes(), 0o644)?,
    };
    Ok((digest, archive))
}

/// A host name or address as an IP (a name is looked up once, when the runtime starts).
fn resolve(host: &str) -> Result<std::net::IpAddr, RuntimeError> {
    if let Ok(ip) = host.parse() {
        return Ok(ip);
    }
    use std::net::ToSocketAddrs;
    (host, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .map(|a| a.ip())
        .ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "[docker] the Docker host {host:?} does not resolve to an address"
            ))
        })
}

/// `no-new-privileges` always. Under gVisor, Warren's own deny-list profile instead of Docker's default
/// one: gVisor cannot evaluate the default profile's argument rules for `clone` (no thread could start).
fn security_opts(oci_runtime: Option<&str>) -> Vec<String> {
    let mut opts = vec!["no-new-privileges".to_string()];
    if oci_runtime.is_some_and(|r| r.contains("runsc") || r.contains("gvisor")) {
        opts.push(format!("seccomp={}", policy::oci_seccomp(true)));
    }
    opts
}

fn bind_mount(source: &Path, target: &str, read_only: bool) -> Value {
    json!({"Type": "bind", "Source": source, "Target": target, "ReadOnly": read_only})
}

fn state_of(state: &RuntimeState) -> Option<DockerState> {
    serde_json::from_value(state.clone()).ok()
}

/// Docker's log stream without a TTY is framed: 8-byte headers (stream, 0, 0, 0, big-endian length).
fn demux_logs(bytes: &[u8]) -> String {
    let mut out = Vec::new();
    let mut rest = bytes;
    while rest.len() >= 8 {
        let len = u32::from_be_bytes([rest[4], rest[5], rest[6], rest[7]]) as usize;
        let end = (8 + len).min(rest.len());
        out.extend_from_slice(&rest[8..end]);
        rest = &rest[end..];
    }
    String::from_utf8_lossy(&out).to_string()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_frames() {
        let mut b = vec![1, 0, 0, 0, 0, 0, 0, 3];
        b.extend_from_slice(b"ab\n");
        b.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 2]);
        b.extend_from_slice(b"c\n");
        assert_eq!(demux_logs(&b), "ab\nc\n");
    }

    #[test]
    fn create_body_has_isolation_and_limits() {
        let rt = DockerRuntime::new(DockerConfig {
            host: Some("unix:///nonexistent".into()),
            oci_runtime: Some("runsc".into()),
            pull: false,
            registries: Default::default(),
            data_dir: std::env::temp_dir().join("warren-docker-unit"),
            execd_path: "/opt/warren-execd".into(),
            ready_timeout: Duration::from_secs(1),
            tls: None,
            sandbox_host: None,
            network: None,
        })
        .expect("runtime");
        let spec = SandboxSpec {
            id: "abc".into(),
            image: SandboxImage::Reference {
                name: "img".into(),
                auth: None,
            },
            entrypoint: vec!["tail".into(), "-f".into(), "/dev/null".into()],
            execd_verifier: String::new(),
            record: None,
            egress: None,
            hardening: None,
            env: [("A".to_string(), "1".to_string())].into_iter().collect(),
            limits: warren_core::ResourceLimits {
                cpu_millis: Some(500),
                memory_bytes: Some(1 << 30),
                pids: 100,
                disk_bytes: None,
            },
            volumes: Vec::new(),
            background: Default::default(),
            isolation: false,
        };
        let b = rt.create_body(
            &spec,
            "img",
            &json!({"Config": {"Env": ["PATH=/bin", "A=0"], "WorkingDir": "/work"}}),
            &[json!({"Type": "volume", "Source": "vol", "Target": "/data", "ReadOnly": true})],
            &Delivery::Local,
        );
        assert_eq!(b["HostConfig"]["Mounts"][2]["Source"], "vol");
        assert_eq!(b["Entrypoint"][0], EXECD_IN_SANDBOX);
        assert_eq!(b["Entrypoint"][4], "/work");
        assert_eq!(b["Entrypoint"][6], "tail");
        assert!(b["Env"].as_array().expect("env").contains(&json!("A=1")));
        assert!(b["Env"]
            .as_array()
            .expect("env")
            .contains(&json!("PATH=/bin")));
        let h = &b["HostConfig"];
        assert_eq!(h["NetworkMode"], "none");
        assert_eq!(h["CapDrop"], json!(["ALL"]));
        assert_eq!(h["SecurityOpt"][0], "no-new-privileges");
        assert!(h["SecurityOpt"][1]
            .as_str()
            .expect("seccomp")
            .starts_with("seccomp={"));
        assert_eq!(security_opts(Some("runc")), ["no-new-privileges"]);
        assert_eq!(h["NanoCpus"], 500_000_000);
        assert_eq!(h["Memory"], h["MemorySwap"]);
        assert_eq!(h["PidsLimit"], 100);
        assert_eq!(h["Runtime"], "runsc");
        assert_eq!(h["Mounts"][0]["Source"], "/opt/warren-execd");
        assert_eq!(h["Mounts"][0]["Target"], EXECD_IN_SANDBOX);
        assert_eq!(h["Mounts"][0]["ReadOnly"], true);
        assert_eq!(b["Labels"][LABEL_SANDBOX], "abc");
        assert!(h.get("PortBindings").is_none());

        // A remote daemon: execd from its volume, on TCP with only the verifier, nothing published.
        let spec = SandboxSpec {
            execd_verifier: "ab".repeat(32),
            ..spec
        };
        let remote = Delivery::Remote {
            volume: "warren-execd-0123".into(),
            network: SANDBOX_NETWORK.into(),
        };
        let b = rt.create_body(&spec, "img", &json!({}), &[], &remote);
        let h = &b["HostConfig"];
        assert_eq!(b["Entrypoint"][0], "/.warren/bin/warren-execd");
        assert_eq!(b["Entrypoint"][1], "--listen");
        assert_eq!(b["Entrypoint"][3], "--access-token-sha256");
        assert_eq!(b["Entrypoint"][4], "ab".repeat(32));
        assert_eq!(h["Mounts"][0]["Type"], "volume");
        assert_eq!(h["Mounts"][0]["Source"], "warren-execd-0123");
        assert_eq!(h["Mounts"][0]["ReadOnly"], true);
        assert_eq!(h["Mounts"].as_array().map(Vec::len), Some(1));
        assert_eq!(h["NetworkMode"], SANDBOX_NETWORK);
        // nothing published: the relay is the way in
        assert!(h.get("PortBindings").is_none() && b.get("ExposedPorts").is_none());

        // Hardening on: execd is told the floor before the entrypoint.
        let spec = SandboxSpec {
            hardening: Some(Default::default()),
            ..spec
        };
        let b = rt.create_body(&spec, "img", &json!({}), &[], &remote);
        let args: Vec<&str> = b["Entrypoint"]
            .as_array()
            .expect("entrypoint")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let at = args.iter().position(|a| *a == "--floor").expect("--floor");
        assert_eq!(args[at + 1], "{}");
        assert!(at < args.iter().position(|a| *a == "--").expect("--"));
    }

    #[test]
    fn execd_archive_is_a_tar_of_the_binary_then_a_marker() {
        let dir =
            std::env::temp_dir().join(format!("warren-docker-archive-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let bin = dir.join("execd");
        std::fs::write(&bin, b"\x7fELF not really").expect("write");
        let (digest, a) = execd_archive(&bin).expect("archive");
        assert_eq!(digest.len(), 64);
        let mut t = tar::Archive::new(a.binary.as_ref());
        let mut entries = t.entries().expect("entries");
        let e = entries.next().expect("one").expect("entry");
        assert_eq!(e.path().expect("path").to_str(), Some("warren-execd"));
        assert_eq!(e.header().mode().expect("mode"), 0o755);
        assert_eq!(e.header().size().expect("size"), 15);
        let mut t = tar::Archive::new(a.ready.as_ref());
        let e = t
            .entries()
            .expect("entries")
            .next()
            .expect("one")
            .expect("entry");
        assert_eq!(e.path().expect("path").to_str(), Some("ready"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
