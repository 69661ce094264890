//! The audit middleware: what of each request goes into the audit log (`audit_log`): the
//! mutating calls of the API, named by route with ids shown as `{id}`, and every request the
//! endpoint proxy takes.

use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use chrono::Utc;

use crate::audit_log::AuditEntry;
use crate::http::AppState;
use crate::keys::Caller;

pub use crate::audit_log::ClientAddr;

/// The route a path is, ids shown as `{id}`, the sandbox it names, and the other object it names.
fn action_of(method: &Method, path: &str) -> (String, Option<String>, Option<String>) {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    let parts: Vec<&str> = p.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["sandboxes", id, "proxy", port, ..] => {
            (format!("proxy {port}"), Some((*id).to_string()), None)
        }
        ["sandboxes", id, rest @ ..] if !id.is_empty() => {
            let mut action = format!("{method} /sandboxes/{{id}}");
            for r in rest {
                action.push('/');
                action.push_str(if r.chars().all(|c| c.is_ascii_digit()) {
                    "{port}"
                } else {
                    r
                });
            }
            (action, Some((*id).to_string()), None)
        }
        [coll @ ("snapshots" | "pools" | "templates"), id, rest @ ..] => {
            let tail: String = rest.iter().map(|r| format!("/{r}")).collect();
            (
                format!("{method} /{coll}/{{id}}{tail}"),
                None,
                Some((*id).to_string()),
            )
        }
        ["admin", "keys", id, rest @ ..] => {
            let tail: String = rest.iter().map(|r| format!("/{r}")).collect();
            (
                format!("{method} /admin/keys/{{id}}{tail}"),
                None,
                Some((*id).to_string()),
            )
        }
        _ => (format!("{method} {p}"), None, None),
    }
}

/// Whether a request is one the log keeps: every change, and every proxied request.
fn audited(method: &Method, path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    let proxied = p.starts_with("/sandboxes/") && p.split('/').nth(3) == Some("proxy");
    proxied || !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Set on the answer to a request that host routing or a signed URL took to a sandbox (see
/// `signed`): its path is the app's, not an API route.
#[derive(Debug, Clone)]
pub struct Routed {
    /// `None` when the request opened nothing (a bad signature names no sandbox worth keeping).
    pub sandbox: Option<String>,
    pub port: Option<u16>,
    /// What opened it: `signed-url`, `endpoint-token`.
    pub opened_by: &'static str,
}

/// The middleware, outside `auth` (so refused calls are kept too): the caller is read from the
/// response, where `auth` leaves it.
pub async fn middleware(State(app): State<AppState>, req: Request, next: Next) -> Response {
    // Host routing is decided inside (`signed::ByHost`): every request may turn out to be proxied.
    let api_call = audited(req.method(), req.uri().path());
    let (mut action, mut sandbox, mut object) = action_of(req.method(), req.uri().path());
    let request_id = req
        .headers()
        .get(warren_api::REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let client = req
        .extensions()
        .get::<ClientAddr>()
        .map(|c| c.0.to_string());
    let resp = next.run(req).await;
    let routed = resp.extensions().get::<Routed>().cloned();
    if routed.is_none() && !api_call {
        return resp;
    }
    let mut opened_by = "endpoint-token";
    if let Some(r) = &routed {
        action = match r.port {
            Some(port) => format!("proxy {port}"),
            None => "proxy".to_string(),
        };
        sandbox = r.sandbox.clone();
        // The path was the app's: it names nothing of Warren's.
        object = None;
        opened_by = r.opened_by;
    }
    if sandbox.is_none() && action == "POST /sandboxes" {
        // A create names its sandbox in the answer's Location.
        sandbox = resp
            .headers()
            .get(axum::http::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|l| l.rsplit('/').next())
            .map(str::to_string);
    }
    let caller = resp.extensions().get::<Caller>();
    // The proxy opened with an endpoint token or a signed URL (no key): the sandbox's tenant.
    let by_token = || {
        // Only a request that opened the port is the sandbox's tenant's: one refused, or cut
        // short before its credential was looked at, is nobody's (and bounded as such).
        let opened = resp
            .extensions()
            .get::<crate::http::proxy::PortOpened>()
            .is_some();
        sandbox
            .as_deref()
            .filter(|_| opened && action.starts_with("proxy"))
            .and_then(|id| app.sandboxes.get(id))
            .map(|r| (r.tenant, opened_by.to_string()))
    };
    let (tenant, key_id) = match caller {
        Some(c) => (Some(c.tenant.clone()), Some(c.key_id.clone())),
        None => by_token().map_or((None, None), |(t, k)| (Some(t), Some(k))),
    };
    app.audit.record(&AuditEntry {
        time: Utc::now(),
        tenant,
        key_id,
        action,
        sandbox,
        object,
        status: resp.status().as_u16(),
        request_id,
        client,
    });
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_name_routes_not_ids_and_never_a_proxied_path() {
        let a = |m: Method, p: &str| action_of(&m, p);
        assert_eq!(
            a(Method::POST, "/v1/sandboxes/abc/pause"),
            (
                "POST /sandboxes/{id}/pause".into(),
                Some("abc".into()),
                None
            )
        );
        assert_eq!(
            a(Method::GET, "/v1/sandboxes/abc/endpoints/8080").0,
            "GET /sandboxes/{id}/endpoints/{port}"
        );
        assert_eq!(
            a(Method::POST, "/sandboxes/abc/proxy/8080/secret/path"),
            ("proxy 8080".into(), Some("abc".into()), None)
        );
        assert_eq!(
            a(Method::DELETE, "/v1/snapshots/s1"),
            ("DELETE /snapshots/{id}".into(), None, Some("s1".into()))
        );
        assert_eq!(
            a(Method::POST, "/v1/admin/keys/k1/rotate"),
            (
                "POST /admin/keys/{id}/rotate".into(),
                None,
                Some("k1".into())
            )
        );
        assert!(audited(&Method::GET, "/v1/sandboxes/abc/proxy/8080/x"));
        assert!(!audited(&Method::GET, "/v1/sandboxes/abc"));
        assert!(audited(&Method::DELETE, "/v1/sandboxes/abc"));
    }
}
