//! API-key authentication for the lifecycle API, and the key's life on disk: with no key configured
//! the server generates one, stores it 0600 in the data dir and says where.

use std::path::Path;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rand::RngCore;
use subtle::ConstantTimeEq;
use warren_api::{ErrorCode, API_KEY_HEADER};

use crate::error::ApiError;
use crate::AppState;

/// Paths that answer without a key: health, the OpenAPI document and its pages, and the sandbox
/// proxy (which checks its own per-sandbox token).
fn is_public(path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    matches!(p, "/health" | "/openapi.json" | "/docs" | "/redoc") || is_proxy_path(p)
}

fn is_proxy_path(p: &str) -> bool {
    let mut parts = p.trim_start_matches('/').splitn(4, '/');
    parts.next() == Some("sandboxes") && parts.next().is_some() && parts.next() == Some("proxy")
}

pub async fn require_api_key(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = app.api_key.as_deref() else {
        return next.run(req).await;
    };
    if is_public(req.uri().path()) {
        return next.run(req).await;
    }
    match req.headers().get(API_KEY_HEADER) {
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::MissingApiKey,
            format!("missing {API_KEY_HEADER} header"),
        )
        .into_response(),
        Some(v) if bool::from(v.as_bytes().ct_eq(key.as_bytes())) => next.run(req).await,
        Some(_) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::InvalidApiKey,
            "invalid API key",
        )
        .into_response(),
    }
}

pub use warren_local::key_file;

/// Returns the stored key, generating and storing one (0600) on first use.
pub fn load_or_generate_key(data_dir: &Path) -> std::io::Result<(String, bool)> {
    let path = key_file(data_dir);
    if let Ok(k) = std::fs::read_to_string(&path) {
        let k = k.trim().to_string();
        if !k.is_empty() {
            return Ok((k, false));
        }
    }
    std::fs::create_dir_all(data_dir)?;
    let mut bytes = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut bytes);
    let key: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    crate::state_file::replace(&path, key.as_bytes())?;
    Ok((key, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_paths() {
        assert!(is_public("/health"));
        assert!(is_public("/v1/health"));
        assert!(is_public("/sandboxes/abc/proxy/44772/ping"));
        assert!(is_public("/v1/sandboxes/abc/proxy/8080"));
        assert!(!is_public("/v1/sandboxes/abc"));
        assert!(!is_public("/v1/sandboxes"));
        assert!(!is_public("/v1/sandboxes/proxy"));
    }

    #[test]
    fn generated_key_is_private_and_stable() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let (k1, fresh) = load_or_generate_key(dir.path()).expect("generate");
        assert!(fresh);
        assert_eq!(k1.len(), 64);
        let mode = std::fs::metadata(key_file(dir.path()))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let (k2, fresh) = load_or_generate_key(dir.path()).expect("reload");
        assert!(!fresh);
        assert_eq!(k1, k2);
    }
}
