//! Builds the runtime a server's config names: the one place that knows every backend, so the
//! server itself knows only the `Runtime` trait.

use std::sync::Arc;

use anyhow::Context;
use warren_core::Runtime;
use warren_runtime_docker::{DockerConfig, DockerRuntime};
use warren_runtime_kubernetes::{
    Connection, EgressSidecar, KubernetesConfig, KubernetesRuntime, PodSettings,
};
use warren_runtime_native::{NativeConfig, NativeRuntime};
use warren_server::config::RuntimeKind;
use warren_server::ServerConfig;

/// The runtime `config` asks for, set up (the native runtime's cgroups and helpers, the Docker
/// daemon's client).
pub fn make_runtime(config: &ServerConfig) -> anyhow::Result<Arc<dyn Runtime>> {
    let exe = std::env::current_exe().context("locating the warren binary")?;
    let start_timeout = |default: u64| match config.runtime.start_timeout_seconds {
        None => Ok(std::time::Duration::from_secs(default)),
        Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => {
            Ok(std::time::Duration::from_secs_f64(s))
        }
        Some(s) => Err(anyhow::anyhow!(
            "[runtime] start_timeout_seconds = {s}: use a number of seconds above 0 (at most a day)"
        )),
    };
    let execd_path = match &config.runtime.execd_path {
        Some(p) => p.clone(),
        None => exe.with_file_name("warren-execd"),
    };
    let execd_tcp = config.runtime.execd_transport == warren_api::lifecycle::ExecdTransport::Tcp;
    match config.runtime.kind {
        RuntimeKind::Native => {}
        RuntimeKind::Kubernetes => return kubernetes(config, start_timeout(120)?),
        RuntimeKind::Docker if execd_tcp => {
            anyhow::bail!("[runtime] execd_transport = \"tcp\" is served by the native runtime's embedded mode only")
        }
        RuntimeKind::Docker => {
            let docker = DockerConfig {
                host: config.docker.host.clone(),
                oci_runtime: config.docker.runtime.clone(),
                pull: match config.docker.pull.as_deref() {
                    None | Some("missing") => true,
                    Some("never") => false,
                    Some(other) => {
                        anyhow::bail!("[docker] pull = {other:?}: use \"missing\" or \"never\"")
                    }
                },
                registries: config.registries.clone(),
                data_dir: config.data_dir.clone(),
                // The daemon bind-mounts it: it must be an absolute host path.
                execd_path: std::fs::canonicalize(&execd_path)
                    .with_context(|| format!("locating execd at {}", execd_path.display()))?,
                ready_timeout: start_timeout(30)?,
                tls: config
                    .docker
                    .tls_cert_path
                    .as_deref()
                    .map(warren_runtime_docker::TlsFiles::in_dir),
                sandbox_host: config.docker.sandbox_host.clone(),
                network: config.docker.network.clone(),
            };
            return Ok(Arc::new(DockerRuntime::new(docker)?));
        }
    }
    // The config file may hold the API key; the host image must not show it.
    let extra_masked_files = config
        .config_file
        .iter()
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    let native = NativeConfig {
        data_dir: config.data_dir.clone(),
        execd_path,
        helper_exe: exe,
        cgroup_parent: "warren".into(),
        cgroup_root: "/sys/fs/cgroup".into(),
        extra_masked_files,
        ready_timeout: start_timeout(15)?,
        oci_runtime: config.runtime.oci_runtime.clone(),
        standby_helpers: config.runtime.standby_helpers,
        max_parallel_creates: match config.runtime.max_parallel_creates {
            Some(0) => None,
            Some(n) => Some(n),
            None => std::thread::available_parallelism().ok().map(|n| n.get()),
        },
        userns_ids: config
            .runtime
            .user_namespaces
            .unwrap_or(matches!(
                config.runtime.oci_runtime.as_str(),
                "embedded" | "" | "runc" | "crun"
            ))
            .then(|| {
                let first = config.runtime.userns_first_id;
                let fit = ((u64::from(u32::MAX) - u64::from(first)) / 65_536) as u32;
                (first, config.runtime.userns_ranges.unwrap_or(fit))
            }),
        execd_tcp,
    };
    Ok(Arc::new(NativeRuntime::new(native)?))
}

/// The Kubernetes runtime: `[kubernetes]`, or the cluster Warren runs in.
fn kubernetes(
    config: &ServerConfig,
    ready_timeout: std::time::Duration,
) -> anyhow::Result<Arc<dyn Runtime>> {
    let k = &config.kubernetes;
    let connection = match &k.api_server {
        Some(server) => Connection {
            server: server.trim_end_matches('/').to_string(),
            token: match &k.token_file {
                Some(f) => Some(
                    std::fs::read_to_string(f)
                        .with_context(|| format!("[kubernetes] token_file {}", f.display()))?
                        .trim()
                        .to_string(),
                ),
                None => None,
            },
            ca_pem: match &k.ca_file {
                Some(f) => Some(
                    std::fs::read(f)
                        .with_context(|| format!("[kubernetes] ca_file {}", f.display()))?,
                ),
                None => None,
            },
        },
        None => Connection::in_cluster().context(
            "[runtime] kind = \"kubernetes\": not in a cluster (no KUBERNETES_SERVICE_HOST and service account); set [kubernetes] api_server",
        )?,
    };
    let instance = match &k.instance {
        Some(i) => i.clone(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_ascii_lowercase())
            .unwrap_or_else(|_| "warren".into()),
    };
    warren_runtime_kubernetes::check_label_value("[kubernetes] instance", &instance)
        .map_err(anyhow::Error::msg)?;
    let shared_key = match &k.shared_key_file {
        Some(f) => {
            let bytes = std::fs::read(f)
                .with_context(|| format!("[kubernetes] shared_key_file {}", f.display()))?;
            let key = bytes.trim_ascii().to_vec();
            warren_runtime_kubernetes::check_key(&key).map_err(|e| {
                anyhow::anyhow!("[kubernetes] shared_key_file {}: {e}", f.display())
            })?;
            Some(key)
        }
        None => None,
    };
    if let Some(u) = &k.egress_dns_upstream {
        u.parse::<std::net::SocketAddr>().map_err(|_| {
            anyhow::anyhow!("[kubernetes] egress_dns_upstream {u:?} is not ip:port")
        })?;
    }
    let runtime = KubernetesRuntime::new(KubernetesConfig {
        connection,
        namespace: k
            .namespace
            .clone()
            .unwrap_or_else(warren_runtime_kubernetes::default_namespace),
        pod: PodSettings {
            instance,
            execd_image: k
                .execd_image
                .clone()
                .unwrap_or_else(|| "warren:latest".into()),
            execd_image_path: k
                .execd_image_path
                .clone()
                .unwrap_or_else(|| "/usr/local/bin/warren-execd".into()),
            runtime_class: k.runtime_class.clone(),
            node_selector: k.node_selector.clone(),
            tolerations: warren_runtime_kubernetes::tolerations(&k.tolerations),
            image_pull_secrets: k.image_pull_secrets.clone(),
            allowed_host_paths: k.allowed_host_paths.clone(),
            egress: k.egress_sidecar.then(|| EgressSidecar {
                command: k
                    .warren_image_path
                    .clone()
                    .unwrap_or_else(|| "/usr/local/bin/warren".into()),
                dns_upstream: k.egress_dns_upstream.clone(),
            }),
        },
        ready_timeout,
        shared_key,
        lease_duration: std::time::Duration::from_secs(k.lease_seconds.max(1)),
    })?;
    Ok(Arc::new(runtime))
}
