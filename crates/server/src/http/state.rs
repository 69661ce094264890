//! What every handler shares: the server's parts, cloned into each request.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::config::ServerConfig;
use crate::http::tls;
use crate::sandboxes::Sandboxes;
use crate::{audit_log, keys, pools, quotas, signing, snapshots, stored, templates, volumes};

#[derive(Clone)]
pub struct AppState {
    pub config: Arc<ServerConfig>,
    pub storage: Arc<volumes::StoragePolicy>,
    pub api_key: Option<Arc<str>>,
    /// Tenants' keys (`keys.json` in the data dir), besides the server's own `api_key`.
    pub keys: Arc<keys::KeyStore>,
    pub quotas: Arc<quotas::Quotas>,
    pub audit: Arc<audit_log::AuditLog>,
    pub sandboxes: Sandboxes,
    pub snapshots: snapshots::Snapshots,
    pub pools: pools::Pools,
    pub templates: templates::Templates,
    /// What every create's references to stored objects go through (`stored`).
    pub stored: stored::Stored,
    /// The keys that sign endpoint URLs (`signing`).
    pub signing: Arc<signing::SigningKeys>,
    /// HTTPS, when `[tls]` asks for it.
    pub tls: Option<Arc<tls::Tls>>,
    pub local_addr: SocketAddr,
    /// The Prometheus recorder's handle; `None`: `[metrics] enabled = false`.
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}
