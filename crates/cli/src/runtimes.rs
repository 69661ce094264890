//! Builds the runtime a server's config names: the one place that knows every backend, so the
//! server itself knows only the `Runtime` trait.

use std::sync::Arc;

use anyhow::Context;
use warren_core::Runtime;
use warren_runtime_docker::{DockerRuntime, DockerSection};
use warren_runtime_kubernetes::{KubernetesRuntime, KubernetesSection};
use warren_runtime_native::{NativeConfig, NativeRuntime};
use warren_server::config::RuntimeKind;
use warren_server::ServerConfig;

/// The runtime `config` asks for, set up (the native runtime's cgroups and helpers, the Docker
/// daemon's client).
pub fn make_runtime(config: &ServerConfig) -> anyhow::Result<Arc<dyn Runtime>> {
    let exe = std::env::current_exe().context("locating the warren binary")?;
    let docker_section: DockerSection = section("docker", &config.docker)?;
    let kubernetes_section: KubernetesSection = section("kubernetes", &config.kubernetes)?;
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
        RuntimeKind::Kubernetes => {
            let k8s = kubernetes_section
                .config(start_timeout(120)?)
                .map_err(anyhow::Error::msg)?;
            return Ok(Arc::new(KubernetesRuntime::new(k8s)?));
        }
        RuntimeKind::Docker if execd_tcp => {
            anyhow::bail!("[runtime] execd_transport = \"tcp\" is served by the native runtime's embedded mode only")
        }
        RuntimeKind::Docker => {
            let docker = docker_section
                .config(warren_runtime_docker::Common {
                    registries: config.registries.clone(),
                    data_dir: config.data_dir.clone(),
                    // The daemon bind-mounts it: it must be an absolute host path.
                    execd_path: std::fs::canonicalize(&execd_path)
                        .with_context(|| format!("locating execd at {}", execd_path.display()))?,
                    ready_timeout: start_timeout(30)?,
                })
                .map_err(anyhow::Error::msg)?;
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

/// Reads both backend sections of a config file as their crates define them, whichever runtime
/// is chosen: a misspelt key in either is named as the file is loaded, before anything starts.
pub fn check_sections(
    docker: &toml::Table,
    kubernetes: &toml::Table,
    file: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let checked = section::<DockerSection>("docker", docker)
        .and_then(|_| section::<KubernetesSection>("kubernetes", kubernetes));
    match file {
        Some(f) => checked
            .with_context(|| format!("config {}", f.display()))
            .map(drop),
        None => checked.map(drop),
    }
}

/// A backend's `[name]` section, read by the type its crate defines.
fn section<T: serde::de::DeserializeOwned>(name: &str, table: &toml::Table) -> anyhow::Result<T> {
    T::deserialize(toml::Value::Table(table.clone())).with_context(|| format!("[{name}]"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each backend's section is read by its own crate's type, strictly: a misspelt setting is
    /// named, whichever runtime is chosen.
    #[test]
    fn backend_sections_are_read_strictly() {
        let table = |text: &str| -> toml::Table { toml::from_str(text).expect("toml") };
        let docker: DockerSection = section("docker", &table("runtime = \"runsc\"")).expect("ok");
        assert_eq!(docker.runtime.as_deref(), Some("runsc"));
        let err = section::<DockerSection>("docker", &table("hots = \"tcp://x:1\""))
            .expect_err("misspelt");
        assert!(format!("{err:#}").contains("[docker]") && format!("{err:#}").contains("hots"));
        let k8s: KubernetesSection = section("kubernetes", &toml::Table::new()).expect("empty");
        assert_eq!(k8s.lease_seconds, 15);
        let err = section::<KubernetesSection>("kubernetes", &table("lease_seconds = \"x\""))
            .expect_err("wrong type");
        assert!(format!("{err:#}").contains("[kubernetes]"), "{err:#}");
    }
}
