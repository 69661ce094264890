//! Warren's own routes beside the OpenSandbox protocol: the admin API (`/v1/admin/…`, admin keys
//! only: tenants' keys, which `warren key` also edits offline) and a tenant's usage (`/v1/usage`).

use serde::{Deserialize, Serialize};

/// An admin key names the tenant it acts for.
pub const TENANT_HEADER: &str = "X-Warren-Tenant";

/// `POST /v1/admin/keys`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CreateKeyRequest {
    pub tenant: String,
    /// `admin`, `full` or `read-only`.
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A key as listed: never its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct KeyInfo {
    pub id: String,
    pub tenant: String,
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub created_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotated_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
}

/// A key just made or rotated: its text, shown this once and kept nowhere.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct IssuedKey {
    #[serde(flatten)]
    pub info: KeyInfo,
    pub key: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListKeysResponse {
    pub items: Vec<KeyInfo>,
}

/// `GET /v1/usage`: what the caller's tenant uses, and its quotas (`None`: no quota).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub tenant: String,
    /// Sandboxes not yet ended, warm pool ones included.
    pub sandboxes: u64,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub creates_last_minute: u64,
    /// What its snapshots take in the image store (the layers they add).
    #[serde(default)]
    pub snapshot_bytes: u64,
    pub quota: QuotaInfo,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct QuotaInfo {
    pub sandboxes: Option<u64>,
    pub cpu_millis: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub creates_per_minute: Option<u64>,
    #[serde(default)]
    pub snapshot_bytes: Option<u64>,
}
