//! Wire types of the OpenSandbox Sandbox Protocol as Warren speaks it.
//!
//! This crate is wire types only: it depends on serde (and `warren-env`, for the names of the
//! variables the server sets in a sandbox), so clients (SDK, CLI, MCP) never pull in the server or
//! a runtime.
//! Field names are camelCase on the lifecycle API and snake_case on execd, exactly as the official SDKs
//! expect; see `shared/reference/opensandbox-protocol.md`.

pub mod admin;
pub mod desktop;
pub mod error;
pub mod execd;
pub mod hardening;
pub mod isolated;
pub mod lifecycle;

pub use error::{ErrorBody, ErrorCode};

/// Header carrying the lifecycle API key.
pub const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";
/// Header carrying the per-sandbox endpoint token on proxied requests.
pub const ACCESS_TOKEN_HEADER: &str = "X-Warren-Sandbox-Token";
/// The credential execd checks on every request when it is started with one (over TCP); the
/// reference execd's header for its `--access-token`.
pub const EXECD_TOKEN_HEADER: &str = "X-EXECD-ACCESS-TOKEN";
/// Request id header, generated when the client sends none.
pub const REQUEST_ID_HEADER: &str = "X-Request-ID";
/// The execd port inside every sandbox.
pub const EXECD_PORT: u16 = 44772;
/// The control port of the egress sidecar beside a sandbox (Kubernetes), which checks execd's
/// credential: `PUT /policy`.
pub const EGRESS_SIDECAR_PORT: u16 = 44774;
/// What a connection to execd's relay starts with, before the sandbox's address and a newline
/// (`warren-execd relay`, for sandboxes on a network with no other way in).
pub const RELAY_PREAMBLE: &str = "WARREN-RELAY ";
/// The port execd's relay listens on in its container.
pub const RELAY_PORT: u16 = 44773;
/// Inside every sandbox, whatever the runtime: where execd's binary is mounted (read-only).
pub const EXECD_IN_SANDBOX: &str = "/.warren/execd";
/// The egress policy surface port.
pub const EGRESS_PORT: u16 = 18080;

/// The gateway's marker on a 503 that was never forwarded (the sandbox is parked): the 1.1.2
/// clients replay any request, POSTs included, on it. Warren strips it from every answer it relays.
pub const WAKE_HEADER: &str = "opensandbox-wake";
/// The Jupyter port the code-interpreter SDK health-checks.
pub const JUPYTER_PORT: u16 = 44771;
