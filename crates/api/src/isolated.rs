//! Wire types of execd's isolated execution API (`/v1/isolated/…`), as the 1.1.1 SDKs' generated
//! models read and write them (snake_case; every field the SDK models require is always sent).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /v1/isolated/session`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CreateSessionRequest {
    #[serde(default)]
    pub profile: Option<String>,
    /// The single-overlay shorthand: put first among `overlays`.
    #[serde(default)]
    pub workspace: Option<WorkspaceSpec>,
    #[serde(default)]
    pub overlays: Option<Vec<OverlaySpec>>,
    #[serde(default)]
    pub extra_writable: Option<Vec<String>>,
    #[serde(default)]
    pub binds: Option<Vec<BindMount>>,
    #[serde(default)]
    pub share_net: Option<bool>,
    #[serde(default)]
    pub env_passthrough: Option<EnvPassthrough>,
    #[serde(default)]
    pub uid: Option<u32>,
    #[serde(default)]
    pub gid: Option<u32>,
    #[serde(default)]
    pub uid_mode: Option<String>,
    #[serde(default)]
    pub idle_timeout_seconds: Option<i64>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct WorkspaceSpec {
    pub path: String,
    #[serde(default)]
    pub mode: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct OverlaySpec {
    pub path: String,
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persist: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct BindMount {
    pub source: String,
    #[serde(default)]
    pub dest: Option<String>,
    #[serde(default)]
    pub readonly: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct EnvPassthrough {
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub keys: Option<Vec<String>>,
}

/// 201 to a create.
#[derive(Debug, Clone, Serialize)]
pub struct CreateSessionResponse {
    pub session_id: String,
    pub created_at: String,
}

/// `GET /v1/isolated/session/{id}`: the state and the normalised options it was made with.
#[derive(Debug, Clone, Serialize)]
pub struct SessionState {
    /// `active` or `dead`.
    pub status: String,
    pub created_at: String,
    pub last_run_at: String,
    /// Only with an idle timeout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_remaining_seconds: Option<i64>,
    pub profile: String,
    /// Only for a session of one overlay.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace: Option<WorkspaceSpec>,
    pub overlays: Vec<OverlaySpec>,
    pub extra_writable: Vec<String>,
    pub binds: Vec<BindMount>,
    pub share_net: bool,
    pub env_passthrough: EnvPassthrough,
    pub uid: u32,
    pub gid: u32,
    pub uid_mode: String,
    /// Always sent, 0 included (0: never collected).
    pub idle_timeout_seconds: i64,
}

/// One item of `GET /v1/isolated/sessions`.
#[derive(Debug, Clone, Serialize)]
pub struct SessionSummary {
    pub session_id: String,
    pub status: String,
    pub created_at: String,
    pub last_run_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_remaining_seconds: Option<i64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SessionList {
    pub sessions: Vec<SessionSummary>,
}

/// `POST /v1/isolated/session/{id}/run`.
#[derive(Debug, Clone, Deserialize)]
pub struct RunRequest {
    pub code: String,
    #[serde(default)]
    pub envs: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub timeout_seconds: Option<i64>,
    #[serde(default)]
    pub background: Option<bool>,
}

/// 202 to a background run.
#[derive(Debug, Clone, Serialize)]
pub struct BackgroundRunResponse {
    pub session_id: String,
    pub run_id: String,
    pub started_at: String,
}

/// `GET /v1/isolated/session/{id}/runs/{run}`.
#[derive(Debug, Clone, Serialize)]
pub struct RunStatus {
    pub session_id: String,
    pub run_id: String,
    pub running: bool,
    pub started_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /v1/isolated/capabilities`.
#[derive(Debug, Clone, Serialize)]
pub struct Capabilities {
    pub available: bool,
    pub isolator: String,
    pub version: String,
    pub message: String,
    pub setpriv_available: bool,
    pub userns_available: bool,
    pub commit_supported: bool,
    pub diff_supported: bool,
    /// execd as init and the floor under user code (see [`crate::hardening`]).
    pub hardening: crate::hardening::HardeningStatus,
}

/// The header that carries the next log offset.
pub const TAIL_CURSOR_HEADER: &str = "EXECD-ISOLATED-TAIL-CURSOR";
