//! The endpoint proxy: `/sandboxes/{id}/proxy/{port}/…` on Warren's own listener, forwarded to execd
//! over the sandbox's Unix socket (execd's own routes for port 44772, its `/proxy/{port}` for the rest).
//! Bodies stream in both directions; WebSocket and other upgrades are spliced after the 101.
//! Credentials that opened the proxy (the endpoint token, the API key) are stripped before forwarding:
//! no server secret ever enters a sandbox.

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use warren_api::lifecycle::SandboxState;
use warren_api::{ErrorCode, ACCESS_TOKEN_HEADER, API_KEY_HEADER, EXECD_PORT};

use crate::error::{ErrorKind, SandboxError};
use crate::execd_conns;
use crate::http::auth::Caller;
use crate::http::recorder::terminal;
use crate::http::AppState;
use crate::keys::Role;

pub async fn proxy_root(
    state: State<AppState>,
    Path((id, port)): Path<(String, String)>,
    req: Request,
) -> Response {
    forward(state, id, port, String::new(), req).await
}

pub async fn proxy_path(
    state: State<AppState>,
    Path((id, port, rest)): Path<(String, String, String)>,
    req: Request,
) -> Response {
    forward(state, id, port, rest, req).await
}

/// How `req` may open `port` of sandbox `rec` (`None`: no such sandbox, which only a key may
/// learn). The token is the one for this port alone (see `tokens`); the reference egress sidecar's
/// header is accepted for the egress surface. A key opens only its tenant's sandboxes (an admin's,
/// any), and a read-only key none: it is no key here.
enum Opened {
    ByToken,
    ByKey,
    /// A key that does not see this sandbox (or there is none): it answers as a missing one.
    KeyNotHere,
    No,
}

fn opened(rec: Option<&warren_store::SandboxRecord>, port: u16, req: &Request) -> Opened {
    let header = |name: &str| req.headers().get(name).map(|v| v.as_bytes());
    let secret = rec.map(|r| r.token.as_str());
    let token_ok = |presented: Option<&[u8]>| match (secret, presented) {
        (Some(secret), Some(t)) => crate::tokens::opens(secret, port, t),
        // The same work for a sandbox that does not exist, so timing does not tell either.
        (None, Some(t)) => {
            let _ = crate::tokens::opens("", port, t);
            false
        }
        (_, None) => false,
    };
    if token_ok(header(ACCESS_TOKEN_HEADER))
        || (port == warren_api::EGRESS_PORT && token_ok(header(crate::network::EGRESS_AUTH_HEADER)))
    {
        return Opened::ByToken;
    }
    match req
        .extensions()
        .get::<Caller>()
        .filter(|c| c.role != Role::ReadOnly)
    {
        Some(c) if rec.is_some_and(|r| c.sees(&r.tenant)) => Opened::ByKey,
        Some(_) => Opened::KeyNotHere,
        None => Opened::No,
    }
}

/// The path proxy's (and host routing's) entry: `port` of sandbox `id`, opened by the request's
/// token header or key.
pub(crate) async fn forward(
    State(app): State<AppState>,
    id: String,
    port: String,
    rest: String,
    req: Request,
) -> Response {
    let Ok(port) = port.parse::<u16>() else {
        return SandboxError::invalid(format!("invalid port {port:?}")).into_response();
    };
    let rec = app.sandboxes.get(&id);
    // Credentials first: whether a sandbox exists is for those who may open it (or hold a key that
    // sees it).
    match opened(rec.as_ref(), port, &req) {
        Opened::ByToken => crate::metrics::proxy_request("token"),
        Opened::ByKey => crate::metrics::proxy_request("key"),
        Opened::KeyNotHere => return SandboxError::not_found(&id).into_response(),
        Opened::No => {
            let missing = req.headers().get(ACCESS_TOKEN_HEADER).is_none()
                && req.headers().get(API_KEY_HEADER).is_none()
                && req
                    .headers()
                    .get(crate::network::EGRESS_AUTH_HEADER)
                    .is_none();
            let msg = if missing {
                format!("missing {ACCESS_TOKEN_HEADER}: send the headers returned by GET /sandboxes/{{id}}/endpoints/{port}")
            } else {
                format!("invalid access token for port {port} of this sandbox (each port has its own: GET /sandboxes/{{id}}/endpoints/{port})")
            };
            return SandboxError::new(
                ErrorKind::Unauthenticated,
                ErrorCode::InvalidAccessToken,
                msg,
            )
            .into_response();
        }
    }
    let Some(rec) = rec else {
        return SandboxError::not_found(&id).into_response();
    };
    relay_to(&app, rec, port, &rest, req).await
}

/// Relays `req` to `port` of sandbox `id`, to the path `/{rest}`: the caller has already shown it
/// may (a signed URL).
pub(crate) async fn relay(
    app: &AppState,
    id: &str,
    port: u16,
    rest: &str,
    req: Request,
) -> Response {
    match app.sandboxes.get(id) {
        Some(rec) => {
            crate::metrics::proxy_request("signed-url");
            relay_to(app, rec, port, rest, req).await
        }
        None => SandboxError::not_found(id).into_response(),
    }
}

/// Set on the answer to a request that showed it may open the port (the audit log's test for
/// attributing it to the sandbox's tenant: a refused or malformed one is nobody's).
#[derive(Debug, Clone, Copy)]
pub struct PortOpened;

async fn relay_to(
    app: &AppState,
    rec: warren_store::SandboxRecord,
    port: u16,
    rest: &str,
    req: Request,
) -> Response {
    use tracing::Instrument;
    // Traced to the answer's head (a streamed body goes on after it).
    // An app's own path (any port but execd's) may carry what its app keeps secret: not traced.
    let path = (port == EXECD_PORT).then(|| format!("/{rest}"));
    let span = tracing::info_span!("proxy", sandbox_id = %rec.id, port, path = path.as_deref());
    let mut resp = relay_opened(app, rec, port, rest, req)
        .instrument(span)
        .await;
    resp.extensions_mut().insert(PortOpened);
    resp
}

async fn relay_opened(
    app: &AppState,
    rec: warren_store::SandboxRecord,
    port: u16,
    rest: &str,
    req: Request,
) -> Response {
    let id = rec.id.clone();
    let mut rec = rec;
    if matches!(
        rec.state,
        SandboxState::Paused | SandboxState::Pausing | SandboxState::Resuming
    ) {
        if let Some(policy) = crate::sandboxes::Sandboxes::idle_policy(&rec) {
            // Parked by its idle policy (or by hand): woken for this request, which is held
            // meanwhile, or answered with the gateway's marker so that the clients replay it.
            if !policy.wake_on_access || !app.sandboxes.wake(&rec).await {
                return parked(&id, policy.wake_on_access);
            }
            match app.sandboxes.get(&id) {
                Some(now) => rec = now,
                None => return SandboxError::not_found(&id).into_response(),
            }
        }
    }
    match rec.state {
        SandboxState::Running => {}
        SandboxState::Paused | SandboxState::Pausing => {
            return SandboxError::conflict(
                ErrorCode::SandboxNotRunning,
                format!("sandbox {id} is paused; resume it first"),
            )
            .into_response()
        }
        other => {
            return SandboxError::conflict(
                ErrorCode::SandboxNotRunning,
                format!("sandbox {id} is {}", other.as_str()),
            )
            .into_response()
        }
    }
    renew_on_access(app, &rec);
    // Activity, for idle policies: from now until the answer has been sent whole.
    let busy = app.sandboxes.busy(&id);
    if port == warren_api::EGRESS_PORT {
        return egress_surface(app, &id, rest, req).await;
    }
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let path = if port == EXECD_PORT {
        format!("/{rest}{query}")
    } else {
        format!("/proxy/{port}/{rest}{query}")
    };

    let Ok(upstream_uri) = path.parse::<http::Uri>() else {
        return SandboxError::invalid("invalid proxied path").into_response();
    };
    // Calls to execd that the sandbox's timeline keeps (runs, file changes) are watched as they pass.
    let (mut req, recording) = if port == EXECD_PORT {
        crate::http::recorder::start(app.sandboxes.timeline(&id), &upstream_uri, req)
    } else {
        (req, None)
    };
    let devtools = port == warren_api::desktop::CDP_PORT;
    let forwarded = devtools.then(|| Forwarded::of(app, &req, rest));
    let client_upgrade = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>();
    let (mut parts, body) = req.into_parts();
    parts.headers.remove(ACCESS_TOKEN_HEADER);
    parts.headers.remove(API_KEY_HEADER);
    parts.headers.remove(crate::http::auth::TENANT_HEADER);
    parts.headers.remove(crate::network::EGRESS_AUTH_HEADER);
    parts
        .headers
        .insert(http::header::HOST, HeaderValue::from_static("localhost"));
    // The app sees `Host: localhost`. For the DevTools port, these say the URL its caller used,
    // for execd to write DevTools' WebSocket addresses with (see `warren_execd::browser`); execd
    // takes them off before Chromium sees them, so no app gets a signed URL's token from them.
    // Always Warren's there: a caller's own are replaced.
    if let Some(f) = forwarded {
        for name in warren_api::desktop::FORWARDED_HEADERS {
            parts.headers.remove(name);
        }
        f.insert(&mut parts.headers);
    }
    let upstream_path = upstream_uri.path().to_string();
    parts.uri = upstream_uri;
    parts.version = http::Version::HTTP_11;
    let mut upstream_req = Request::from_parts(parts, body);

    let endpoint = app.sandboxes.endpoint_of(&rec);
    let conns = app.sandboxes.execd_conns();
    // An upgrade takes its connection over for good, so it gets a fresh one and never gives it back.
    let reusable = client_upgrade.is_none();
    // A connection that execd closes before it took the request gives the request back; it is sent
    // once more on a fresh connection (a parked connection execd closed meanwhile; also seen rarely
    // through gVisor's host-UDS relay). A request that was already (partly) sent is never replayed.
    let mut fresh = 0;
    let mut try_parked = reusable;
    let mut resp = loop {
        let parked = if std::mem::take(&mut try_parked) {
            conns.take(&id)
        } else {
            None
        };
        let was_parked = parked.is_some();
        let opened = match parked {
            Some(s) => Ok(s),
            None => {
                fresh += 1;
                execd_conns::open(&endpoint).await
            }
        };
        let mut sender = match opened {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(sandbox_id = %id, error = %e, "execd socket unreachable");
                return SandboxError::new(
                    ErrorKind::Upstream,
                    ErrorCode::ProxyUnavailable,
                    format!("sandbox {id} is not answering"),
                )
                .into_response();
            }
        };
        match sender.try_send_request(upstream_req).await {
            Ok(r) => {
                if reusable {
                    conns.put_back(id.clone(), sender, app.sandboxes.execd_live(&id));
                }
                break r;
            }
            Err(mut e) => {
                if was_parked {
                    tracing::debug!(sandbox_id = %id, error = %e.error(), "a parked execd connection failed");
                } else {
                    tracing::warn!(sandbox_id = %id, error = %e.error(), attempts = fresh, "proxied request failed");
                }
                match e.take_message() {
                    Some(req) if fresh < 2 => upstream_req = req,
                    _ => {
                        return SandboxError::new(
                            ErrorKind::Upstream,
                            ErrorCode::ProxyUnavailable,
                            format!("sandbox {id} dropped the request"),
                        )
                        .into_response()
                    }
                }
            }
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        if let Some(client_upgrade) = client_upgrade {
            // An upgraded connection (a terminal, a websocket) is activity while it is open, and
            // a session on the sandbox's timeline.
            let busy = app.sandboxes.busy(&id);
            let session = app.sandboxes.timeline(&id).map(|t| {
                let of = t.record(
                    "session.open",
                    serde_json::json!({"port": port, "path": upstream_path}),
                );
                (t, of, std::time::Instant::now())
            });
            let terminal = session
                .as_ref()
                .filter(|(t, _, _)| {
                    t.enabled() && port == EXECD_PORT && terminal::is_terminal(&upstream_path)
                })
                .map(|(t, of, _)| (t.clone(), *of));
            tokio::spawn(async move {
                let _busy = busy;
                let _closed = SessionClosed(session);
                match (client_upgrade.await, upstream_upgrade.await) {
                    (Ok(client), Ok(upstream)) => {
                        let mut client = TokioIo::new(client);
                        let mut upstream = TokioIo::new(upstream);
                        match terminal {
                            // A terminal's typed lines go on the timeline as they pass.
                            Some((timeline, of)) => {
                                terminal::splice(client, upstream, timeline, of).await
                            }
                            None => {
                                let _ =
                                    tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                            }
                        }
                    }
                    (a, b) => {
                        tracing::debug!(client = a.is_ok(), upstream = b.is_ok(), "upgrade failed")
                    }
                }
            });
        }
    }
    let (mut parts, body) = resp.into_parts();
    // Only Warren says a sandbox is parked: the newest clients replay a request (a POST too) on
    // this header, so one a sandbox's process sent would make them resend what it already took.
    parts.headers.remove(warren_api::WAKE_HEADER);
    let body = BusyBody {
        inner: Body::new(body),
        busy,
        sent: crate::metrics::proxy_response_bytes(),
    };
    let resp = Response::from_parts(parts, Body::new(body));
    match recording {
        Some(recording) => recording.answered(resp),
        None => resp,
    }
}

/// The answer for a request to a sandbox its idle policy parked that was not woken in time (or
/// is not woken on access): 503 with the gateway's marker, never relayed, so clients replay it.
fn parked(id: &str, wakes: bool) -> Response {
    let message = if wakes {
        format!(
            "sandbox {id} is waking from an idle pause and did not resume within {} s; retry",
            crate::idle::WAKE_WAIT.as_secs()
        )
    } else {
        format!(
            "sandbox {id} is paused (its idle policy does not wake it on access); resume it first"
        )
    };
    let mut resp = SandboxError::new(
        ErrorKind::Unavailable,
        ErrorCode::SandboxNotRunning,
        message,
    )
    .into_response();
    let h = resp.headers_mut();
    h.insert(warren_api::WAKE_HEADER, HeaderValue::from_static("expired"));
    h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
}

/// Port 18080 is the egress surface, served by Warren itself (nothing listens in the sandbox):
/// `/policy` (GET, PUT/POST, PATCH, DELETE) and `/healthz`. Errors are plain text, as the reference
/// sidecar's are.
async fn egress_surface(app: &AppState, id: &str, rest: &str, req: Request) -> Response {
    let method = req.method().clone();
    let body = match axum::body::to_bytes(req.into_body(), 1 << 20).await {
        Ok(b) => b,
        Err(_) => return (StatusCode::PAYLOAD_TOO_LARGE, "body too large").into_response(),
    };
    let path = rest.trim_end_matches('/');
    if path == "credential-vault" || path.starts_with("credential-vault/") {
        let sub = path.trim_start_matches("credential-vault");
        let surface = crate::http::policy::VaultSurface::Sidecar;
        return match crate::http::policy::vault_call(
            app.sandboxes.network(),
            id,
            &method,
            sub,
            &body,
            surface,
        )
        .await
        {
            Ok((status, Some(v))) => (status, axum::Json(v)).into_response(),
            Ok((status, None)) => status.into_response(),
            Err(e) => (e.status(), e.public_message()).into_response(),
        };
    }
    match path {
        "healthz" => (StatusCode::OK, "ok").into_response(),
        "policy" => {
            match crate::http::policy::policy_call(&app.sandboxes, id, &method, &body).await {
                Ok(status) => axum::Json(status).into_response(),
                Err(e) => (e.status(), e.public_message()).into_response(),
            }
        }
        other => (
            StatusCode::NOT_FOUND,
            format!("no egress route /{other} (try /policy)"),
        )
            .into_response(),
    }
}

/// OSEP-0009 renew on access: a sandbox created with `extensions["access.renew.extend.seconds"]`
/// has its expiry pushed to that long from now by each request the proxy takes for it, never past
/// `[limits] renew_on_access_max_lifetime_seconds` after its creation. Debounced: the expiry is written only
/// when it would move by more than a tenth of the extension, so a busy endpoint costs a write now
/// and then, not one per request. In the background: the request does not wait for it.
fn renew_on_access(app: &AppState, rec: &warren_store::SandboxRecord) {
    let Some(extend) = rec
        .extensions
        .get(crate::validate::RENEW_ON_ACCESS)
        .and_then(|v| v.parse::<i64>().ok())
    else {
        return;
    };
    let Some(current) = rec.expires_at else {
        return;
    };
    // Never longer than a create may ask for either.
    let lifetime = i64::try_from(app.config.limits.renew_on_access_max_lifetime_seconds)
        .unwrap_or(i64::MAX / 1_000_000)
        .min(
            app.config
                .max_timeout_seconds
                .unwrap_or(i64::MAX / 1_000_000),
        );
    let cap = rec.created_at + chrono::Duration::seconds(lifetime);
    let wanted = (chrono::Utc::now() + chrono::Duration::seconds(extend)).min(cap);
    if wanted <= current + chrono::Duration::seconds(extend / 10) {
        return;
    }
    let (sandboxes, id) = (app.sandboxes.clone(), rec.id.clone());
    tokio::spawn(async move {
        if let Err(e) = sandboxes.extend(&id, wanted).await {
            tracing::debug!(sandbox_id = %id, error = %e, "renew on access");
        }
    });
}

/// The URL a proxied request's caller used, as `X-Forwarded-Host`, `-Proto` and `-Prefix`: the
/// part of the path before the app's own (`/signed/{token}`, `/v1/sandboxes/{id}/proxy/{port}`,
/// or nothing on an endpoint host).
struct Forwarded {
    host: Option<HeaderValue>,
    proto: &'static str,
    prefix: Option<HeaderValue>,
}

impl Forwarded {
    fn of(app: &AppState, req: &Request, rest: &str) -> Self {
        let host = req.headers().get(http::header::HOST).cloned().or_else(|| {
            req.uri()
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        // The path as the caller sent it (a nested router has taken `/v1` off `uri()`).
        let path = req
            .extensions()
            .get::<axum::extract::OriginalUri>()
            .map_or(req.uri().path(), |o| o.0.path());
        // `rest` is the app's path as routed; the prefix is what came before it. A path the
        // router decoded differently has none to give.
        let prefix = path
            .strip_suffix(rest)
            .map(|p| p.trim_end_matches('/'))
            .filter(|p| !p.is_empty())
            .and_then(|p| HeaderValue::from_str(p).ok());
        Forwarded {
            host,
            proto: if app.tls.is_some() { "https" } else { "http" },
            prefix,
        }
    }

    fn insert(self, headers: &mut http::HeaderMap) {
        if let Some(host) = self.host {
            headers.insert(warren_api::desktop::FORWARDED_HOST, host);
        }
        headers.insert(
            warren_api::desktop::FORWARDED_PROTO,
            HeaderValue::from_static(self.proto),
        );
        if let Some(prefix) = self.prefix {
            headers.insert(warren_api::desktop::FORWARDED_PREFIX, prefix);
        }
    }
}

/// Records an upgraded session's end on the timeline when the splice ends (or is dropped).
struct SessionClosed(
    Option<(
        std::sync::Arc<crate::timeline::Timeline>,
        u64,
        std::time::Instant,
    )>,
);

impl Drop for SessionClosed {
    fn drop(&mut self) {
        if let Some((timeline, of, opened)) = self.0.take() {
            timeline.record(
                "session.close",
                serde_json::json!({"of": of, "durationMs": opened.elapsed().as_millis() as u64}),
            );
        }
    }
}

/// A body that keeps its sandbox busy until it has been sent whole (or dropped), and counts the
/// bytes it sends.
struct BusyBody {
    inner: axum::body::Body,
    /// Held, never read: dropped with the body.
    #[allow(dead_code)]
    busy: crate::idle::Busy,
    sent: metrics::Counter,
}

impl http_body::Body for BusyBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.sent.increment(data.len() as u64);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
