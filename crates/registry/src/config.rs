//! Per-registry settings (`[registries."<host>"]` in Warren's config): mirrors, plain HTTP, an extra
//! CA, credentials.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;

/// Settings for every registry, keyed by host (`docker.io`, `ghcr.io`, `127.0.0.1:5000`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct RegistriesConfig {
    pub hosts: BTreeMap<String, HostConfig>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    /// Tried in order before the registry itself: `host[:port]` (HTTPS unless that host is marked
    /// `insecure`) or an explicit `http://` / `https://` URL.
    #[serde(default)]
    pub mirrors: Vec<String>,
    /// `false`: only the mirrors are asked, never the registry itself (air-gapped sites, tests).
    #[serde(default = "yes")]
    pub upstream: bool,
    /// Plain HTTP is allowed for this host (never otherwise).
    #[serde(default)]
    pub insecure: bool,
    /// An extra CA bundle (PEM) trusted for this host, besides the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
}

fn yes() -> bool {
    true
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            mirrors: Vec::new(),
            upstream: true,
            insecure: false,
            ca_file: None,
            username: None,
            password: None,
        }
    }
}

impl fmt::Debug for HostConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostConfig")
            .field("mirrors", &self.mirrors)
            .field("upstream", &self.upstream)
            .field("insecure", &self.insecure)
            .field("ca_file", &self.ca_file)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// A user name and password for one pull (`image.auth`) or one host (config).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl RegistriesConfig {
    pub fn host(&self, host: &str) -> Option<&HostConfig> {
        self.hosts.get(host)
    }

    /// Credentials the config holds for `host`.
    pub fn credentials(&self, host: &str) -> Option<Credentials> {
        let h = self.host(host)?;
        Some(Credentials {
            username: h.username.clone()?,
            password: h.password.clone().unwrap_or_default(),
        })
    }
}

/// Where to ask for one registry's content: a base URL (`https://host:port`) and the host whose
/// settings (TLS, credentials) apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub base: String,
    pub host: String,
    pub mirror: bool,
}

/// Docker Hub's API lives on another host than its name.
const DOCKER_HUB_API: &str = "registry-1.docker.io";

impl RegistriesConfig {
    /// The endpoints to try for `registry`, in order: its mirrors, then (unless disabled) itself.
    pub fn endpoints(&self, registry: &str) -> Result<Vec<Endpoint>, String> {
        let settings = self.host(registry);
        let mut out = Vec::new();
        for mirror in settings.map(|s| s.mirrors.as_slice()).unwrap_or(&[]) {
            out.push(self.endpoint(mirror, true)?);
        }
        if settings.is_none_or(|s| s.upstream) {
            let api = if registry == warren_image::DOCKER_HUB {
                DOCKER_HUB_API
            } else {
                registry
            };
            let mut endpoint = self.endpoint(api, false)?;
            // Settings and credentials are the registry's, whichever host serves its API.
            endpoint.host = registry.to_owned();
            if self.host(registry).is_some_and(|s| s.insecure) {
                endpoint.base = format!("http://{api}");
            }
            out.push(endpoint);
        }
        if out.is_empty() {
            return Err(format!(
                "registry {registry} has no mirrors and `upstream = false`"
            ));
        }
        Ok(out)
    }

    fn endpoint(&self, spec: &str, mirror: bool) -> Result<Endpoint, String> {
        let spec = spec.trim_end_matches('/');
        let (scheme, host) = match spec.split_once("://") {
            Some((scheme @ ("http" | "https"), host)) => (Some(scheme), host),
            Some(_) => {
                return Err(format!(
                    "registry address {spec:?}: only http:// and https://"
                ))
            }
            None => (None, spec),
        };
        if host.is_empty() || host.contains(['/', '?', '#', '@', ' ']) {
            return Err(format!(
                "registry address {spec:?} must be host[:port] or scheme://host[:port]"
            ));
        }
        let scheme = scheme.unwrap_or(if self.host(host).is_some_and(|h| h.insecure) {
            "http"
        } else {
            "https"
        });
        Ok(Endpoint {
            base: format!("{scheme}://{host}"),
            host: host.to_owned(),
            mirror,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same shape the server reads from TOML, written as JSON for brevity.
    fn config(json: &str) -> RegistriesConfig {
        serde_json::from_str(json).expect("config")
    }

    #[test]
    fn docker_hub_goes_to_its_api_host_after_mirrors() {
        let c = config(
            r#"{"docker.io": {"mirrors": ["127.0.0.1:5001", "https://m.example"]}, "127.0.0.1:5001": {"insecure": true}}"#,
        );
        let e = c.endpoints("docker.io").expect("endpoints");
        let bases: Vec<&str> = e.iter().map(|e| e.base.as_str()).collect();
        assert_eq!(
            bases,
            [
                "http://127.0.0.1:5001",
                "https://m.example",
                "https://registry-1.docker.io"
            ]
        );
        assert_eq!(e[2].host, "docker.io");
        assert!(e[0].mirror && !e[2].mirror);
    }

    #[test]
    fn plain_http_only_when_marked_insecure() {
        let c = config(r#"{"10.0.0.1:5000": {"insecure": true}}"#);
        assert_eq!(
            c.endpoints("10.0.0.1:5000").expect("e")[0].base,
            "http://10.0.0.1:5000"
        );
        assert_eq!(
            c.endpoints("10.0.0.2:5000").expect("e")[0].base,
            "https://10.0.0.2:5000"
        );
    }

    #[test]
    fn upstream_can_be_turned_off() {
        let c = config(r#"{"docker.io": {"mirrors": ["http://127.0.0.1:1"], "upstream": false}}"#);
        assert_eq!(c.endpoints("docker.io").expect("e").len(), 1);
        let c = config(r#"{"docker.io": {"upstream": false}}"#);
        assert!(c.endpoints("docker.io").is_err());
        let c = config(r#"{"docker.io": {"mirrors": ["ftp://x"]}}"#);
        assert!(c.endpoints("docker.io").is_err());
    }

    #[test]
    fn debug_never_shows_passwords() {
        let c = config(r#"{"r.example": {"username": "u", "password": "hunter2"}}"#);
        assert!(!format!("{c:?}").contains("hunter2"));
        let creds = c.credentials("r.example").expect("creds");
        assert!(!format!("{creds:?}").contains("hunter2"));
    }
}
