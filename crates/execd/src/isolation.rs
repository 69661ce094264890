//! The isolated execution API (`/v1/isolated/…`: sessions of per-run namespaces inside the sandbox,
//! as the 1.1.1 SDKs' `sandbox.isolation` calls it) — answered as the reference answers it in a
//! sandbox where isolation cannot run: capabilities say so (`available: false`, and why), and every
//! other route is 503 `SERVICE_UNAVAILABLE`.
//!
//! Why it cannot run here: a session is a set of fresh namespaces and an overlay made from inside
//! the sandbox, which takes `unshare`, `mount` and `pivot_root`; Warren's sandboxes refuse those to
//! everything in them (seccomp and a dropped CAP_SYS_ADMIN), execd included. The reference lifts its
//! own limits for a whole sandbox on request (`bootstrap.execd.isolation`); doing that safely — a
//! helper with the rights, sessions still under the strict filter — is not built yet.

use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use crate::error::{code, ApiError};

/// Why no session can be made, as capabilities report it.
const WHY: &str = "isolated sessions are not available in Warren sandboxes: they need namespaces \
    and mounts made from inside the sandbox, which its seccomp filter and capabilities refuse";

/// `GET /v1/isolated/capabilities`: always 200, as in the reference.
pub async fn capabilities() -> Json<Value> {
    Json(json!({
        "available": false,
        "isolator": "warren",
        "version": env!("CARGO_PKG_VERSION"),
        "message": WHY,
        "setpriv_available": false,
        "userns_available": false,
        "commit_supported": false,
        "diff_supported": false,
    }))
}

/// Every other `/v1/isolated/…` route.
pub async fn unavailable() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        code::SERVICE_UNAVAILABLE,
        format!("isolation unavailable: {WHY}"),
    )
}
