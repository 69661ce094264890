//! Builds the runtime a server's config names: the one place that knows every backend, so the
//! server itself knows only the `Runtime` trait.

use std::sync::Arc;

use anyhow::Context;
use warren_core::Runtime;
use warren_runtime_docker::{DockerConfig, DockerRuntime};
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
