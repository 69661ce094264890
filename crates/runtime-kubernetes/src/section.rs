//! `[kubernetes]` of the server's config file: this backend's own section, read with serde where
//! the file is parsed, and made into a [`KubernetesConfig`] here (reading the files it names).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::{Connection, EgressSidecar, KubernetesConfig, PodSettings};

fn default_lease_seconds() -> u64 {
    15
}

/// `[kubernetes]`: where the cluster is and what the sandboxes' Pods get.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSection {
    /// The API server's URL; default: the cluster Warren runs in (its service account).
    pub api_server: Option<String>,
    /// A bearer token file and a CA bundle for `api_server` (outside a cluster).
    pub token_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    /// Where the sandboxes' Pods go; default: Warren's own namespace in a cluster, else `default`.
    pub namespace: Option<String>,
    /// This server's label value on its Pods (`io.warren.owner`); default: the host name (a
    /// StatefulSet's Pod name). Without `shared_key_file` each server must have its own: it
    /// removes the Pods of its instance that it has no record of. With it, every replica of one
    /// service has the same.
    pub instance: Option<String>,
    /// A file holding a key (32 bytes or more) every replica of one service holds: the sandboxes'
    /// records then live on their Pods, each sandbox's secret derives from the key, and the
    /// replicas (same `instance`, same key) serve one set of sandboxes. Unset: each server keeps
    /// its records in its data dir.
    pub shared_key_file: Option<PathBuf>,
    /// With `shared_key_file`: how long the replicas' Lease (which one makes the pools' warm
    /// sandboxes) lasts unrenewed, in seconds; a replica that dies hands it on after this long.
    #[serde(default = "default_lease_seconds")]
    pub lease_seconds: u64,
    /// The image the init container copies execd from (`scripts/build-image` makes it).
    pub execd_image: Option<String>,
    /// Where execd is in that image.
    pub execd_image_path: Option<String>,
    /// A container beside every sandbox, from `execd_image`, holding its egress policy in the Pod's
    /// network namespace and answering its DNS: rules naming hosts (`pypi.org`, `*.example.com`)
    /// work, not only addresses (a NetworkPolicy's reach). Off by default.
    #[serde(default)]
    pub egress_sidecar: bool,
    /// Where the `warren` binary is in `execd_image` (the sidecar runs `warren egress-sidecar`).
    pub warren_image_path: Option<String>,
    /// Where the sidecar sends allowed DNS queries (`ip:port`); default: the first `nameserver` of
    /// the Pod's resolv.conf (the cluster's DNS).
    pub egress_dns_upstream: Option<String>,
    /// `runtimeClassName` of every sandbox Pod (gVisor, Kata…).
    pub runtime_class: Option<String>,
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default)]
    pub tolerations: Vec<BTreeMap<String, String>>,
    /// Secrets in the namespace every sandbox Pod pulls its image with (`imagePullSecrets`); a
    /// create's own `image.auth` adds a Secret of its own.
    #[serde(default)]
    pub image_pull_secrets: Vec<String>,
    /// Node folders `host` volumes may mount (absolute, checked by name: the node resolves them);
    /// empty (the default): none.
    #[serde(default)]
    pub allowed_host_paths: Vec<PathBuf>,
}

impl Default for KubernetesSection {
    fn default() -> Self {
        Self {
            api_server: None,
            token_file: None,
            ca_file: None,
            namespace: None,
            instance: None,
            shared_key_file: None,
            lease_seconds: default_lease_seconds(),
            execd_image: None,
            execd_image_path: None,
            egress_sidecar: false,
            warren_image_path: None,
            egress_dns_upstream: None,
            runtime_class: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            image_pull_secrets: Vec::new(),
            allowed_host_paths: Vec::new(),
        }
    }
}

impl KubernetesSection {
    /// The runtime's config: the connection (from `api_server` and its files, or the cluster
    /// Warren runs in), the Pods' settings, and the shared key if one is named. `Err` names the
    /// setting that is wrong.
    pub fn config(&self, ready_timeout: Duration) -> Result<KubernetesConfig, String> {
        let read = |what: &str, f: &PathBuf| {
            std::fs::read(f).map_err(|e| format!("[kubernetes] {what} {}: {e}", f.display()))
        };
        let connection = match &self.api_server {
            Some(server) => Connection {
                server: server.trim_end_matches('/').to_string(),
                token: match &self.token_file {
                    Some(f) => Some(
                        std::fs::read_to_string(f)
                            .map_err(|e| format!("[kubernetes] token_file {}: {e}", f.display()))?
                            .trim()
                            .to_string(),
                    ),
                    None => None,
                },
                ca_pem: match &self.ca_file {
                    Some(f) => Some(read("ca_file", f)?),
                    None => None,
                },
            },
            None => Connection::in_cluster().ok_or(
                "[runtime] kind = \"kubernetes\": not in a cluster (no KUBERNETES_SERVICE_HOST and service account); set [kubernetes] api_server",
            )?,
        };
        let instance = match &self.instance {
            Some(i) => i.clone(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_ascii_lowercase())
                .unwrap_or_else(|_| "warren".into()),
        };
        crate::check_label_value("[kubernetes] instance", &instance)?;
        let shared_key = match &self.shared_key_file {
            Some(f) => {
                let key = read("shared_key_file", f)?.trim_ascii().to_vec();
                crate::check_key(&key)
                    .map_err(|e| format!("[kubernetes] shared_key_file {}: {e}", f.display()))?;
                Some(key)
            }
            None => None,
        };
        if let Some(u) = &self.egress_dns_upstream {
            u.parse::<std::net::SocketAddr>()
                .map_err(|_| format!("[kubernetes] egress_dns_upstream {u:?} is not ip:port"))?;
        }
        Ok(KubernetesConfig {
            connection,
            namespace: self
                .namespace
                .clone()
                .unwrap_or_else(crate::default_namespace),
            pod: PodSettings {
                instance,
                execd_image: self
                    .execd_image
                    .clone()
                    .unwrap_or_else(|| "warren:latest".into()),
                execd_image_path: self
                    .execd_image_path
                    .clone()
                    .unwrap_or_else(|| "/usr/local/bin/warren-execd".into()),
                runtime_class: self.runtime_class.clone(),
                node_selector: self.node_selector.clone(),
                tolerations: crate::tolerations(&self.tolerations),
                image_pull_secrets: self.image_pull_secrets.clone(),
                allowed_host_paths: self.allowed_host_paths.clone(),
                egress: self.egress_sidecar.then(|| EgressSidecar {
                    command: self
                        .warren_image_path
                        .clone()
                        .unwrap_or_else(|| "/usr/local/bin/warren".into()),
                    dns_upstream: self.egress_dns_upstream.clone(),
                }),
            },
            ready_timeout,
            shared_key,
            lease_duration: Duration::from_secs(self.lease_seconds.max(1)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outside() -> KubernetesSection {
        KubernetesSection {
            api_server: Some("https://127.0.0.1:6443/".into()),
            instance: Some("warren-0".into()),
            ..KubernetesSection::default()
        }
    }

    #[test]
    fn defaults_fill_what_is_unset() {
        let config = outside().config(Duration::from_secs(120)).expect("config");
        assert_eq!(config.connection.server, "https://127.0.0.1:6443");
        assert_eq!(config.pod.execd_image, "warren:latest");
        assert_eq!(config.pod.execd_image_path, "/usr/local/bin/warren-execd");
        assert!(config.pod.egress.is_none() && config.shared_key.is_none());
        assert_eq!(config.lease_duration, Duration::from_secs(15));
    }

    #[test]
    fn a_wrong_setting_is_named() {
        let bad = |s: KubernetesSection| {
            s.config(Duration::from_secs(1))
                .map(drop)
                .expect_err("refused")
        };
        let err = bad(KubernetesSection {
            instance: Some("Not A Label!".into()),
            ..outside()
        });
        assert!(err.contains("[kubernetes] instance"), "{err}");
        let err = bad(KubernetesSection {
            egress_dns_upstream: Some("dns".into()),
            ..outside()
        });
        assert!(err.contains("egress_dns_upstream"), "{err}");
        let dir = tempfile::tempdir().expect("tempdir");
        let short = dir.path().join("key");
        std::fs::write(&short, "too short\n").expect("write");
        let err = bad(KubernetesSection {
            shared_key_file: Some(short),
            ..outside()
        });
        assert!(err.contains("shared_key_file"), "{err}");
        let err = bad(KubernetesSection {
            token_file: Some(dir.path().join("missing")),
            ..outside()
        });
        assert!(err.contains("[kubernetes] token_file"), "{err}");
    }
}
