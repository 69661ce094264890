//! The config sections whose code lives elsewhere (`quotas`, `audit`, `tls`, `signed`, `metrics`): their
//! shapes and defaults are here, so that `config` depends on no other module of the server.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Deserialize;

/// One tenant's quotas as written (`cpu` and `memory` as in `resourceLimits`).
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaSpec {
    pub sandboxes: Option<u64>,
    pub cpu: Option<String>,
    pub memory: Option<String>,
    pub creates_per_minute: Option<u64>,
    /// What its snapshots may take in the image store, in all (as `memory` is written: `50Gi`):
    /// the layers they add to their sandboxes' images.
    pub snapshot_storage: Option<String>,
}

/// `[quotas]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaSection {
    /// Every tenant's but the default one's (the server's own key), unless it has its own.
    #[serde(default)]
    pub default: QuotaSpec,
    #[serde(default)]
    pub tenants: HashMap<String, QuotaSpec>,
}

/// `[audit]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditSection {
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The file is rotated when it grows past this.
    #[serde(default = "default_rotate_bytes")]
    pub rotate_bytes: u64,
    /// Older files kept (`audit.jsonl.1` … `.N`).
    #[serde(default = "default_keep")]
    pub keep_files: u32,
}

fn yes() -> bool {
    true
}

fn default_rotate_bytes() -> u64 {
    64 << 20
}

fn default_keep() -> u32 {
    5
}

impl Default for AuditSection {
    fn default() -> Self {
        Self {
            enabled: true,
            rotate_bytes: default_rotate_bytes(),
            keep_files: default_keep(),
        }
    }
}

/// `[tls]`: either `cert_file` and `key_file`, or `self_signed`; neither serves plain HTTP.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// PEM: the server's certificate, then its chain.
    pub cert_file: Option<PathBuf>,
    /// PEM: its private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// Make a development certificate (and its CA) in `<data dir>/tls/`.
    #[serde(default)]
    pub self_signed: bool,
}

/// `[endpoints]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointsSection {
    /// A wildcard DNS name that points at Warren (`sandboxes.example.com`, maybe with `:port` for
    /// the URLs handed out): requests for `{token}.{domain}` and `{port}-{id}.{domain}` go to that
    /// sandbox's port, and signed URLs are handed out in that form.
    pub domain: Option<String>,
    /// Hand out endpoints without `expires` as `{port}-{id}.{domain}` too (they still need their
    /// token header); by default they stay on the path proxy.
    #[serde(default)]
    pub host_urls: bool,
    /// The longest a signed URL may live, in seconds.
    #[serde(default = "default_max_signed_seconds")]
    pub max_signed_seconds: u64,
    /// The signing keys, one per line: the first signs, every one verifies (so a new key can be
    /// put first and the old one dropped later). Default: `<data dir>/endpoint-signing-keys`,
    /// made with one random key when missing; on replicas (`[kubernetes] shared_key_file`), one
    /// derived from the key they share.
    pub signing_keys_file: Option<PathBuf>,
}

fn default_max_signed_seconds() -> u64 {
    86_400
}

impl Default for EndpointsSection {
    fn default() -> Self {
        Self {
            domain: None,
            host_urls: false,
            max_signed_seconds: default_max_signed_seconds(),
            signing_keys_file: None,
        }
    }
}

/// `[metrics]`: Prometheus metrics at `/metrics`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    /// Record and serve metrics (default on): `/metrics` on the API's listener answers an admin
    /// key (the server's own or a tenant admin's); off, it answers 404 and nothing is recorded.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// A listener of its own that serves `/metrics` alone, without a key, for a Prometheus that
    /// scrapes over a private network or this host's loopback (`127.0.0.1:9464`); default: none.
    pub listen: Option<String>,
}

/// `[timeline]`: each sandbox's flight recorder (`GET /v1/sandboxes/{id}/timeline`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimelineSection {
    /// Record (default on); off, nothing is recorded and timelines answer 404.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// JSON bytes kept per sandbox (default 1 MiB); past them the oldest events go.
    #[serde(default = "timeline_max_bytes")]
    pub max_bytes: usize,
    /// `"text"` (default) keeps each command's and code cell's text (its first 4 KiB); `"hash"`
    /// keeps only its SHA-256, for commands that may carry secrets.
    #[serde(default = "timeline_commands")]
    pub commands: String,
}

fn timeline_max_bytes() -> usize {
    1 << 20
}

fn timeline_commands() -> String {
    "text".into()
}

impl Default for TimelineSection {
    fn default() -> Self {
        Self {
            enabled: true,
            max_bytes: timeline_max_bytes(),
            commands: timeline_commands(),
        }
    }
}

impl TimelineSection {
    /// The recorder's settings; a bad `commands` is an error naming the section.
    pub fn settings(&self) -> anyhow::Result<crate::timeline::Settings> {
        let commands = match self.commands.as_str() {
            "text" => crate::timeline::CommandText::Full,
            "hash" => crate::timeline::CommandText::Hash,
            other => {
                anyhow::bail!("[timeline] commands = {other:?}: expected \"text\" or \"hash\"")
            }
        };
        anyhow::ensure!(
            self.max_bytes >= 4096,
            "[timeline] max_bytes = {}: at least 4096",
            self.max_bytes
        );
        Ok(crate::timeline::Settings {
            enabled: self.enabled,
            max_bytes: self.max_bytes,
            commands,
        })
    }
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: None,
        }
    }
}
