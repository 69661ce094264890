//! execd wire types: the streaming event format and the command/file request bodies.
//!
//! Events are written as one compact JSON object per line followed by a blank line (no `data:` prefix),
//! with an integer millisecond `timestamp` on every event: the official SDKs drop events without it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `WARREN_SPARE_SHELL=0` in a sandbox's environment: execd keeps no spare shell, every command
/// starts its own. The server sets it in every sandbox when `[runtime] spare_shell = false`.
pub const SPARE_SHELL_ENV: &str = warren_env::EnvVars::WARREN_SPARE_SHELL;

/// One event of a `/command`, `/session/{id}/run` or `/code` stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamEvent {
    #[serde(rename = "type")]
    pub kind: EventKind,
    pub timestamp: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_count: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_time: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub results: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ExecError>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Init,
    Stdout,
    Stderr,
    Status,
    ExecutionCount,
    Result,
    Error,
    ExecutionComplete,
    Ping,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecError {
    pub ename: String,
    pub evalue: String,
    #[serde(default)]
    pub traceback: Vec<String>,
}

/// `POST /command`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunCommandRequest {
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default)]
    pub background: bool,
    /// Milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envs: Option<BTreeMap<String, String>>,
}

/// `GET /command/status/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandStatus {
    pub id: String,
    pub content: String,
    pub running: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub started_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

/// File metadata; `mode` is the octal permission written as a decimal integer (`644`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    pub path: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    pub modified_at: String,
    pub created_at: String,
    pub owner: String,
    pub group: String,
    pub mode: u32,
}

/// `GET /metrics`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub cpu_count: f64,
    pub cpu_used_pct: f64,
    pub mem_total_mib: f64,
    pub mem_used_mib: f64,
    pub timestamp: i64,
}

/// `POST /code/context`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CreateContextRequest {
    #[serde(default)]
    pub language: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// A code context: one kernel whose state survives between runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodeContext {
    pub id: String,
    pub language: String,
}

/// `POST /code`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunCodeRequest {
    #[serde(default)]
    pub code: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<RunCodeContext>,
}

/// Which context a run goes to: `id`, or the default context of `language` (Python when neither).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunCodeContext {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
}
