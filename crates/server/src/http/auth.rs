//! Authentication for the lifecycle API: who calls (a [`Caller`]: the server's own key, or a
//! tenant's key from the key store), what its role lets it do, and which tenant's objects it sees.
//! With no key configured the server generates one, stores it 0600 in the data dir and says where.
//!
//! The server's own key (`WARREN_API_KEY`, `api_key`, or the generated one) is the default tenant's
//! admin key, so a single-key setup works as it always did. An admin sees every tenant's objects,
//! or one tenant's when it names it (`X-Warren-Tenant`), and then acts for it. Another tenant's
//! sandbox answers exactly as a missing one does (`guard`), on every route under
//! `/sandboxes/{id}` and in the endpoint proxy.

use std::path::Path;

use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rand::RngCore;
use subtle::ConstantTimeEq;
use warren_api::{ErrorCode, API_KEY_HEADER};

use crate::error::{ErrorKind, SandboxError};
use crate::http::AppState;
use crate::keys::{check_tenant, Role};

pub use crate::keys::Caller;
pub use warren_api::admin::TENANT_HEADER;

/// Paths that answer without a key: health, the OpenAPI document and its pages, and the sandbox
/// proxy (which checks its own per-sandbox token, or a key).
fn is_public(path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    matches!(p, "/health" | "/openapi.json" | "/docs" | "/redoc") || is_proxy_path(p)
}

fn is_proxy_path(p: &str) -> bool {
    let mut parts = p.trim_start_matches('/').splitn(4, '/');
    parts.next() == Some("sandboxes") && parts.next().is_some() && parts.next() == Some("proxy")
}

/// The sandbox a path under `/sandboxes/{id}` names, if it is one (not the collection).
fn sandbox_in_path(path: &str) -> Option<&str> {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    let rest = p.strip_prefix("/sandboxes/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

fn is_endpoint_path(path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    p.strip_prefix("/sandboxes/")
        .and_then(|rest| rest.split('/').nth(1))
        == Some("endpoints")
}

fn is_admin_path(path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    // `/metrics` counts every tenant's sandboxes.
    p == "/admin" || p.starts_with("/admin/") || p == "/metrics"
}

fn forbidden(message: impl Into<String>) -> Response {
    SandboxError::new(ErrorKind::Forbidden, ErrorCode::Forbidden, message).into_response()
}

/// The caller a request's key makes, or why there is none (401, or 403 for a tenant it may not
/// name). `Ok(None)`: no key was sent.
pub fn caller_of(app: &AppState, req: &Request) -> Result<Option<Caller>, SandboxError> {
    let Some(server_key) = app.api_key.as_deref() else {
        return acting(Caller::server(), req).map(Some);
    };
    let Some(presented) = req.headers().get(API_KEY_HEADER) else {
        return Ok(None);
    };
    let caller = if bool::from(presented.as_bytes().ct_eq(server_key.as_bytes())) {
        Caller::server()
    } else if let Some(key) = presented
        .to_str()
        .ok()
        .and_then(|text| app.keys.authenticate(text))
    {
        Caller {
            key_id: key.id,
            all_tenants: key.role == Role::Admin,
            role: key.role,
            tenant: key.tenant,
        }
    } else {
        return Err(SandboxError::new(
            ErrorKind::Unauthenticated,
            ErrorCode::InvalidApiKey,
            "invalid API key",
        ));
    };
    acting(caller, req).map(Some)
}

/// Applies `X-Warren-Tenant`: an admin acts for the tenant it names; anyone else may name only its own.
fn acting(mut caller: Caller, req: &Request) -> Result<Caller, SandboxError> {
    let Some(named) = req.headers().get(TENANT_HEADER) else {
        return Ok(caller);
    };
    let named = named.to_str().unwrap_or_default();
    if let Err(e) = check_tenant(named) {
        return Err(SandboxError::invalid(format!("{TENANT_HEADER}: {e}")));
    }
    match caller.role {
        Role::Admin => {
            caller.tenant = named.to_string();
            caller.all_tenants = false;
            Ok(caller)
        }
        _ if named == caller.tenant => Ok(caller),
        _ => Err(SandboxError::new(
            ErrorKind::Forbidden,
            ErrorCode::Forbidden,
            format!(
                "this key belongs to tenant {}; only an admin key acts for another",
                caller.tenant
            ),
        )),
    }
}

pub async fn require_api_key(
    State(app): State<AppState>,
    mut req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_string();
    let caller = match caller_of(&app, &req) {
        Ok(c) => c,
        // Public paths need no key, and the proxy has its own tokens: a bad key there is no key.
        Err(_) if is_public(&path) => None,
        Err(e) => return e.into_response(),
    };
    if is_public(&path) {
        let Some(c) = caller else {
            return next.run(req).await;
        };
        req.extensions_mut().insert(c.clone());
        let mut resp = next.run(req).await;
        resp.extensions_mut().insert(c);
        return resp;
    }
    let Some(caller) = caller else {
        return SandboxError::new(
            ErrorKind::Unauthenticated,
            ErrorCode::MissingApiKey,
            format!("missing {API_KEY_HEADER} header"),
        )
        .into_response();
    };
    // A refusal of a valid key is that key's: the audit line names its tenant and key, and the
    // call counts against that tenant, not against the anonymous callers.
    let refused = |mut resp: Response| {
        resp.extensions_mut().insert(caller.clone());
        resp
    };
    if caller.role == Role::ReadOnly && !matches!(*req.method(), Method::GET | Method::HEAD) {
        return refused(forbidden("this key is read-only"));
    }
    if caller.role == Role::ReadOnly && is_endpoint_path(&path) {
        // An endpoint carries a token that opens the port: commands on execd's, the policy on
        // the egress surface's. Not for a key that may only read.
        return refused(forbidden(
            "a read-only key gets no endpoint (its token opens the port)",
        ));
    }
    if is_admin_path(&path) && caller.role != Role::Admin {
        return refused(forbidden("only an admin key manages keys"));
    }
    if let Some(id) = sandbox_in_path(&path) {
        if let Some(resp) = guard(&app, &caller, id) {
            return refused(resp);
        }
    }
    req.extensions_mut().insert(caller.clone());
    let mut resp = next.run(req).await;
    // For the audit log, outside this layer.
    resp.extensions_mut().insert(caller);
    resp
}

/// Another tenant's sandbox answers as a missing one, and both answer here, before the route
/// looks at anything else (a bad port or body would otherwise tell a missing sandbox from a
/// hidden one). `raw` is the path's segment, percent-decoded as the route's extractor decodes it:
/// `%36f…` names the sandbox `6f…`.
pub fn guard(app: &AppState, caller: &Caller, raw: &str) -> Option<Response> {
    let id = percent_encoding::percent_decode_str(raw).decode_utf8_lossy();
    // A deleted sandbox's timeline outlives its record (see `timeline::Kept`): its tenant still
    // sees that, and the routes answer 404 for everything else of it, as for any missing sandbox.
    let seen = match app.sandboxes.get(&id) {
        Some(rec) => caller.sees(&rec.tenant),
        None => app
            .sandboxes
            .timeline_of(&id)
            .is_some_and(|(tenant, _)| caller.sees(&tenant)),
    };
    (!seen).then(|| SandboxError::not_found(&id).into_response())
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
    fn the_sandbox_a_path_names() {
        assert_eq!(
            sandbox_in_path("/v1/sandboxes/abc/endpoints/8080"),
            Some("abc")
        );
        assert_eq!(sandbox_in_path("/sandboxes/abc"), Some("abc"));
        assert_eq!(sandbox_in_path("/v1/sandboxes"), None);
        assert_eq!(sandbox_in_path("/v1/sandboxes/"), None);
        assert_eq!(sandbox_in_path("/v1/pools/abc"), None);
        assert!(is_admin_path("/v1/admin/keys") && is_admin_path("/admin/keys/x"));
        assert!(!is_admin_path("/v1/administrators"));
        assert!(is_admin_path("/v1/metrics") && is_admin_path("/metrics"));
        assert!(!is_admin_path("/v1/metrics/events"));
        assert!(is_endpoint_path("/v1/sandboxes/abc/endpoints/8080"));
        assert!(!is_endpoint_path("/v1/sandboxes/abc"));
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
