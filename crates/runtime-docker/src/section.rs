//! `[docker]` of the server's config file: this backend's own section, read with serde where the
//! file is parsed, and made into a [`DockerConfig`] here with what the server holds in common.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::{DockerConfig, TlsFiles};

/// `[docker]`: used when `runtime.kind = "docker"`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerSection {
    /// `unix:///path` or `tcp://host:port`; default `$DOCKER_HOST`, else `unix:///var/run/docker.sock`.
    pub host: Option<String>,
    /// An OCI runtime registered with the daemon, e.g. `runsc` for gVisor.
    pub runtime: Option<String>,
    /// `missing` (default): pull images the daemon does not have; `never`: only use local ones.
    pub pull: Option<String>,
    /// TLS to a `tcp://` daemon (`--tlsverify`): a folder with `ca.pem`, `cert.pem` and `key.pem`,
    /// as in `DOCKER_CERT_PATH` (which, with `DOCKER_TLS_VERIFY`, applies when `host` is unset).
    pub tls_cert_path: Option<PathBuf>,
    /// Where the server reaches a remote daemon's relay (port 44773 of its host); default: the
    /// host of `host`.
    pub sandbox_host: Option<String>,
    /// The network sandboxes on a remote daemon join; default: `warren-sandboxes`, made by Warren
    /// internal, with traffic between containers off.
    pub network: Option<String>,
}

/// What the Docker runtime takes from the server's own sections.
pub struct Common {
    pub registries: warren_registry::RegistriesConfig,
    pub data_dir: PathBuf,
    /// The static execd binary, as an absolute host path: the daemon bind-mounts it.
    pub execd_path: PathBuf,
    pub ready_timeout: Duration,
}

impl DockerSection {
    /// The runtime's config; `Err` names the setting that is wrong.
    pub fn config(&self, common: Common) -> Result<DockerConfig, String> {
        Ok(DockerConfig {
            host: self.host.clone(),
            oci_runtime: self.runtime.clone(),
            pull: match self.pull.as_deref() {
                None | Some("missing") => true,
                Some("never") => false,
                Some(other) => {
                    return Err(format!(
                        "[docker] pull = {other:?}: use \"missing\" or \"never\""
                    ))
                }
            },
            registries: common.registries,
            data_dir: common.data_dir,
            execd_path: common.execd_path,
            ready_timeout: common.ready_timeout,
            tls: self.tls_cert_path.as_deref().map(TlsFiles::in_dir),
            sandbox_host: self.sandbox_host.clone(),
            network: self.network.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common() -> Common {
        Common {
            registries: Default::default(),
            data_dir: "/var/lib/warren".into(),
            execd_path: "/usr/local/bin/warren-execd".into(),
            ready_timeout: Duration::from_secs(30),
        }
    }

    #[test]
    fn pull_takes_missing_or_never() {
        let section = |pull: Option<&str>| DockerSection {
            pull: pull.map(String::from),
            ..DockerSection::default()
        };
        assert!(section(None).config(common()).expect("default").pull);
        assert!(
            section(Some("missing"))
                .config(common())
                .expect("missing")
                .pull
        );
        assert!(!section(Some("never")).config(common()).expect("never").pull);
        let err = section(Some("always"))
            .config(common())
            .expect_err("refused");
        assert!(
            err.contains("[docker] pull") && err.contains("never"),
            "{err}"
        );
    }
}
