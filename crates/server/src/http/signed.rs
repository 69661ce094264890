//! Endpoint URLs a browser can open: signed, expiring URLs that carry their own credential, and
//! host-based routing (`[endpoints] domain`).
//!
//! A signed URL names one port of one sandbox until a time: its route token is
//! `{id}-{port}-{expires}-{signature}`, the reference's signed-route shape (OSEP-0011), with the
//! sandbox id as 32 hex digits (no dashes) and the expiry in base 36, so that the whole token fits
//! one DNS label (63 bytes) and also serves as a host name. The signature is an HMAC-SHA256, under
//! the server's signing key, of the id, port and expiry, cut to 80 bits (16 base-32 digits): it
//! can only be guessed online, one request at a time.
//!
//! The token opens its port through `/signed/{token}/…` on Warren's listener, or as the host
//! `{token}.{domain}` when a wildcard DNS name points at Warren; the latter serves the app at `/`,
//! in an origin of its own. Nothing else is needed: no header, no cookie, so WebSockets work too.
//! A token opens nothing once it has expired, once its sandbox is gone, or once its key is taken
//! out of the signing-key file (read again on SIGHUP).
//!
//! Host routing also takes `{port}-{id}.{domain}` with the credentials the path proxy takes (the
//! port's token header, or a key).

use axum::extract::{OriginalUri, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::{Extension, Router};
use http::StatusCode;
use warren_api::ErrorCode;

use crate::error::{ErrorKind, SandboxError};
use crate::http::audit::Routed;
use crate::http::AppState;
use crate::signing::label_byte;

pub use crate::config::EndpointsSection;

impl EndpointsSection {
    pub fn check(&self) -> anyhow::Result<()> {
        if let Some(d) = &self.domain {
            let host = host_part(d);
            anyhow::ensure!(
                !host.is_empty()
                    && host.len() <= 190
                    && host
                        .split('.')
                        .all(|l| !l.is_empty() && l.len() <= 63 && l.bytes().all(label_byte)),
                "domain {d:?} is not a DNS name"
            );
        }
        anyhow::ensure!(
            self.max_signed_seconds >= 1,
            "max_signed_seconds must be at least 1"
        );
        anyhow::ensure!(
            !self.host_urls || self.domain.is_some(),
            "host_urls needs a domain"
        );
        Ok(())
    }

    /// The domain's host name, lower case, without a port.
    fn host(&self) -> Option<String> {
        self.domain
            .as_deref()
            .map(|d| host_part(d).to_ascii_lowercase())
    }
}

/// `host[:port]` → `host` (a bracketed IPv6 address is not a DNS name and is left whole).
fn host_part(h: &str) -> &str {
    match h.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            host
        }
        _ => h,
    }
}

/// What the endpoint route hands out for `expires`: the URL without a scheme.
pub fn signed_endpoint(
    app: &AppState,
    api_host: &str,
    id: &str,
    port: u16,
    expires: u64,
    now: u64,
) -> Result<String, SandboxError> {
    if port == warren_api::EXECD_PORT || port == warren_api::EGRESS_PORT {
        // A URL anyone may hold for hours must not run commands or change the egress policy;
        // these ports keep their token header, which the SDK sends.
        return Err(SandboxError::invalid(format!(
            "port {port} is Warren's own (execd, egress): signed URLs open application ports only"
        )));
    }
    let max = app.config.endpoints.max_signed_seconds;
    if expires - now > max {
        return Err(SandboxError::invalid(format!(
            "expires is more than {max} s away ([endpoints] max_signed_seconds)"
        )));
    }
    let token = app
        .signing
        .token(id, port, expires)
        .ok_or_else(|| SandboxError::invalid(format!("sandbox {id} cannot have a signed URL")))?;
    Ok(match &app.config.endpoints.domain {
        Some(domain) => format!("{token}.{domain}"),
        None => format!("{api_host}/signed/{token}"),
    })
}

/// The unsigned endpoint in host form, when `[endpoints] host_urls` asks for it.
pub fn host_endpoint(app: &AppState, id: &str, port: u16) -> Option<String> {
    let e = &app.config.endpoints;
    e.host_urls
        .then_some(e.domain.as_ref())
        .flatten()
        .map(|domain| format!("{port}-{id}.{domain}"))
}

/// Sends each request to one of two routers by its host: a host under `[endpoints] domain` (a
/// sandbox's own: `{token}.{domain}` or `{port}-{id}.{domain}`) to the endpoint hosts' router,
/// where every path is the app's (an app's `/v1/sandboxes` is the app's, not Warren's); any other
/// to the API's. axum routes by path only, so the host is looked at here, once.
#[derive(Clone)]
pub struct ByHost {
    /// The domain's host name, lower case, without a port.
    domain: String,
    hosts: Router,
    api: Router,
}

impl ByHost {
    pub fn around(app: &AppState, api: Router) -> Router {
        match app.config.endpoints.host() {
            None => api,
            Some(domain) => Router::new().fallback_service(ByHost {
                domain,
                hosts: host_router(app.clone()),
                api,
            }),
        }
    }
}

impl tower::Service<Request> for ByHost {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        let router = match endpoint_label(&self.domain, &req) {
            Some(label) => {
                req.extensions_mut().insert(EndpointHost(label));
                self.hosts.clone()
            }
            None => self.api.clone(),
        };
        Box::pin(tower::ServiceExt::oneshot(router, req))
    }
}

/// The label before `.{domain}` in a request's host, if its host is under the domain. A deeper
/// name is nobody's: it comes back empty, which opens nothing.
fn endpoint_label(domain: &str, req: &Request) -> Option<String> {
    let host = req
        .headers()
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().host())
        // A fully qualified name (`….example.com.`) is the same name.
        .map(|h| host_part(h).trim_end_matches('.').to_ascii_lowercase())?;
    let label = host.strip_suffix(domain)?.strip_suffix('.')?;
    Some(if label.contains('.') {
        String::new()
    } else {
        label.to_string()
    })
}

/// The label `ByHost` found in the request's host.
#[derive(Clone)]
struct EndpointHost(String);

/// A sandbox's own host: every path is its app's.
fn host_router(app: AppState) -> Router {
    Router::new()
        .route("/", any(on_host))
        .route("/{*rest}", any(on_host))
        .with_state(app)
}

/// Signed paths on Warren's own host, under `/v1` and unprefixed, outside the key check: the
/// token is the credential.
pub fn path_router() -> Router<AppState> {
    // `/signed/` too: an empty token is answered as a token that opens nothing.
    let signed = Router::new()
        .route("/signed/", any(on_path))
        .route("/signed/{token}", any(on_path))
        .route("/signed/{token}/", any(on_path))
        .route("/signed/{token}/{*rest}", any(on_path));
    Router::new().nest("/v1", signed.clone()).merge(signed)
}

/// `{token}.{domain}` opens its port; `{port}-{id}.{domain}` opens as the path proxy does (the
/// port's token, or a key of the sandbox's tenant).
async fn on_host(
    State(app): State<AppState>,
    Extension(EndpointHost(label)): Extension<EndpointHost>,
    req: Request,
) -> Response {
    let rest = req.uri().path().trim_start_matches('/').to_string();
    match label.split_once('-') {
        Some((port, id)) if port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit()) => {
            let routed = Routed {
                sandbox: Some(id.to_string()),
                port: port.parse().ok(),
                opened_by: "endpoint-token",
            };
            // Opened as the path proxy is: the port's token, or a key of the sandbox's tenant (an
            // admin's), another tenant's key answering as for a missing sandbox. This runs outside
            // `auth`, so the key is read here; a bad one is no key, as on the path proxy. The
            // proxy strips the key (and the tenant header) before anything reaches the app, and
            // no browser sends the header by itself, so the app's host never learns a key.
            let caller = crate::http::auth::caller_of(&app, &req).ok().flatten();
            let mut req = req;
            if let Some(c) = &caller {
                req.extensions_mut().insert(c.clone());
            }
            let mut resp = crate::http::proxy::forward(
                State(app),
                id.to_string(),
                port.to_string(),
                rest,
                req,
            )
            .await;
            host_only_cookies(&mut resp);
            if let Some(c) = caller {
                // For the audit log: the key that asked, as `auth` leaves it for the path proxy.
                resp.extensions_mut().insert(c);
            }
            with_routed(resp, routed)
        }
        _ => open_signed(&app, &label, &rest, Opened::OnHost, req).await,
    }
}

/// `/signed/{token}/{rest}` on Warren's own host, under `/v1` or not: the token and the rest are
/// read from the path as it came (the rest still percent-encoded, as on a host of its own), and
/// `/signed/{token}` without a slash after the token is sent to the one with it.
async fn on_path(State(app): State<AppState>, req: Request) -> Response {
    // The whole URI: `nest` took `/v1` off the request's.
    let uri = req
        .extensions()
        .get::<OriginalUri>()
        .map_or_else(|| req.uri().clone(), |u| u.0.clone());
    let path = uri.path();
    let after = path.strip_prefix("/v1").unwrap_or(path);
    let tail = after.strip_prefix("/signed/").unwrap_or_default();
    let (token, rest) = tail.split_once('/').unwrap_or((tail, ""));
    let how = if tail.contains('/') {
        Opened::OnPath
    } else {
        // The same URL with the slash, its query kept.
        Opened::Bare(match uri.query() {
            Some(q) => format!("{path}/?{q}"),
            None => format!("{path}/"),
        })
    };
    open_signed(&app, token, rest, how, req).await
}

/// Where a signed token came.
#[derive(Clone, PartialEq, Eq)]
enum Opened {
    /// As a host of its own, `{token}.{domain}`.
    OnHost,
    /// On Warren's own host, `/signed/{token}/…`.
    OnPath,
    /// `/signed/{token}` without the slash after it, and where it is sent: the same with one.
    Bare(String),
}

async fn open_signed(
    app: &AppState,
    token: &str,
    rest: &str,
    how: Opened,
    req: Request,
) -> Response {
    let now = chrono::Utc::now().timestamp().max(0) as u64;
    let (id, port) = match app.signing.verify(token, now) {
        Ok(opened) => opened,
        Err(why) => {
            let resp = SandboxError::new(
                ErrorKind::Unauthenticated,
                ErrorCode::InvalidAccessToken,
                why,
            )
            .into_response();
            return with_routed(
                resp,
                Routed {
                    sandbox: None,
                    port: None,
                    opened_by: "signed-url",
                },
            );
        }
    };
    let routed = Routed {
        sandbox: Some(id.clone()),
        port: Some(port),
        opened_by: "signed-url",
    };
    let resp = match how {
        // The URL as handed out names the app's root without its slash: a page there resolves
        // `app.js` to `/signed/app.js`, beside the token. Sent to the same URL with the slash
        // (308 keeps the method and body), its relative links load as they would at the app's `/`.
        Opened::Bare(location) => (
            StatusCode::PERMANENT_REDIRECT,
            [(http::header::LOCATION, location)],
        )
            .into_response(),
        Opened::OnPath if req.headers().contains_key("service-worker") => SandboxError::new(
            ErrorKind::Forbidden,
            ErrorCode::InvalidAccessToken,
            "an app on a signed path cannot register a service worker (it would be Warren's origin's): use host routing ([endpoints] domain)",
        )
        .into_response(),
        Opened::OnPath => {
            let mut resp = crate::http::proxy::relay(app, &id, port, rest, req).await;
            confine_to_opaque_origin(&mut resp);
            resp
        }
        Opened::OnHost => {
            let mut resp = crate::http::proxy::relay(app, &id, port, rest, req).await;
            host_only_cookies(&mut resp);
            resp
        }
    };
    with_routed(resp, routed)
}

/// For the audit log: which sandbox and port the request opened, and by what.
fn with_routed(mut resp: Response, routed: Routed) -> Response {
    resp.extensions_mut().insert(routed);
    resp
}

/// A page on a signed path is served from Warren's own origin, which it must not act as: it
/// runs in an opaque origin of its own (`Content-Security-Policy: sandbox` without
/// `allow-same-origin`), so it reads no cookie or storage of Warren's origin, registers no service
/// worker, and its requests are cross-origin; it sets no cookie there either (another tenant's
/// signed path would be sent it). Scripts, forms, WebSockets and relative links still work.
fn confine_to_opaque_origin(resp: &mut Response) {
    let h = resp.headers_mut();
    h.remove(http::header::SET_COOKIE);
    h.remove("service-worker-allowed");
    h.append(
        http::header::CONTENT_SECURITY_POLICY,
        http::HeaderValue::from_static(
            "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads",
        ),
    );
}

/// On a sandbox's own host, an app's cookies stay on that host: a `Domain` attribute would send
/// them to every other sandbox (another tenant's) under the endpoint domain.
fn host_only_cookies(resp: &mut Response) {
    let cookies: Vec<http::HeaderValue> = match resp.headers_mut().entry(http::header::SET_COOKIE) {
        http::header::Entry::Occupied(e) => e.remove_entry_mult().1.collect(),
        http::header::Entry::Vacant(_) => return,
    };
    for c in cookies {
        let Ok(text) = c.to_str() else {
            continue;
        };
        let kept: Vec<&str> = text
            .split(';')
            .filter(|part| {
                !part
                    .trim_start()
                    .get(..6)
                    .is_some_and(|p| p.eq_ignore_ascii_case("domain"))
            })
            .collect();
        if let Ok(v) = http::HeaderValue::from_str(&kept.join(";")) {
            resp.headers_mut().append(http::header::SET_COOKIE, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_under_the_domain_is_a_sandbox_s_and_any_other_is_the_api_s() {
        let label = |host: &str| {
            let req = Request::builder()
                .uri("/v1/sandboxes")
                .header(http::header::HOST, host)
                .body(axum::body::Body::empty())
                .expect("request");
            endpoint_label("sbx.example.com", &req)
        };
        assert_eq!(
            label("8080-abc.sbx.example.com").as_deref(),
            Some("8080-abc")
        );
        assert_eq!(
            label("TOKEN.Sbx.Example.Com:8443").as_deref(),
            Some("token")
        );
        assert_eq!(label("token.sbx.example.com.").as_deref(), Some("token"));
        // Deeper names are nobody's: an empty label, which opens nothing.
        assert_eq!(label("a.b.sbx.example.com").as_deref(), Some(""));
        // The domain itself, other domains, and names that only end alike are the API's.
        assert_eq!(label("sbx.example.com"), None);
        assert_eq!(label("evilsbx.example.com"), None);
        assert_eq!(label("127.0.0.1:8080"), None);
        // HTTP/2 has no Host header: the authority is in the URI.
        let req = Request::builder()
            .uri("https://t.sbx.example.com/x")
            .body(axum::body::Body::empty())
            .expect("request");
        assert_eq!(
            endpoint_label("sbx.example.com", &req).as_deref(),
            Some("t")
        );
    }

    #[test]
    fn a_host_loses_its_port() {
        assert_eq!(host_part("sbx.example.com:8443"), "sbx.example.com");
        assert_eq!(host_part("sbx.example.com"), "sbx.example.com");
        assert_eq!(host_part("[::1]"), "[::1]");
    }

    #[test]
    fn an_app_s_cookies_stay_on_its_host_and_a_signed_path_keeps_none() {
        let mut resp = Response::new(axum::body::Body::empty());
        for c in [
            "a=1; Domain=.example.com; Path=/",
            "b=2;domain=example.com",
            "c=3; Path=/; HttpOnly",
        ] {
            resp.headers_mut()
                .append(http::header::SET_COOKIE, http::HeaderValue::from_static(c));
        }
        host_only_cookies(&mut resp);
        let kept: Vec<_> = resp
            .headers()
            .get_all(http::header::SET_COOKIE)
            .iter()
            .map(|v| v.to_str().expect("text").to_string())
            .collect();
        assert_eq!(kept, ["a=1; Path=/", "b=2", "c=3; Path=/; HttpOnly"]);
        resp.headers_mut().insert(
            "service-worker-allowed",
            http::HeaderValue::from_static("/"),
        );
        confine_to_opaque_origin(&mut resp);
        assert!(resp.headers().get(http::header::SET_COOKIE).is_none());
        assert!(resp.headers().get("service-worker-allowed").is_none());
        let csp = resp.headers()[http::header::CONTENT_SECURITY_POLICY]
            .to_str()
            .expect("text");
        assert!(
            csp.starts_with("sandbox ") && !csp.contains("allow-same-origin"),
            "{csp}"
        );
    }
}
