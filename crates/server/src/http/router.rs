//! The one router: every route of the API (under `/v1` and unprefixed), the path proxy, signed
//! and host endpoints, and their layers: every request gets an id, a panic's answer and an audit
//! line; the API's routes and the path proxy also pass CORS and the key check, which signed paths
//! and sandboxes' own hosts (their token is the credential) do not.

use axum::extract::{DefaultBodyLimit, Request};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{any, get, patch, post};
use axum::Router;
use warren_api::REQUEST_ID_HEADER;

use crate::config;
use crate::error;
use crate::http::state::AppState;
use crate::http::{admin, audit, auth, diagnostics, docs, metrics, openapi, proxy, routes, signed};

/// Lifecycle request bodies are small JSON documents; anything larger is refused with a 413.
const MAX_JSON_BODY: usize = 1 << 20;

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/health", get(routes::health))
        .route("/openapi.json", get(openapi::document))
        .route("/docs", get(docs::swagger))
        .route("/redoc", get(docs::redoc))
        .route("/sandboxes", post(routes::create).get(routes::list))
        .route("/sandboxes/{id}", get(routes::get).delete(routes::delete))
        .route("/sandboxes/{id}/pause", post(routes::pause))
        .route("/sandboxes/{id}/resume", post(routes::resume))
        .route("/sandboxes/{id}/renew-expiration", post(routes::renew))
        .route("/sandboxes/{id}/metadata", patch(routes::patch_metadata))
        .route("/sandboxes/{id}/endpoints/{port}", get(routes::endpoint))
        .route(
            "/sandboxes/{id}/networkpolicy",
            get(routes::network_policy)
                .put(routes::network_policy)
                .patch(routes::network_policy)
                .delete(routes::network_policy),
        )
        .route("/sandboxes/{id}/timeline", get(routes::timeline))
        .route("/sandboxes/{id}/diagnostics/logs", get(diagnostics::logs))
        .route(
            "/sandboxes/{id}/diagnostics/events",
            get(diagnostics::events),
        )
        .route(
            "/sandboxes/{id}/diagnostics/inspect",
            get(diagnostics::inspect),
        )
        .route(
            "/sandboxes/{id}/diagnostics/summary",
            get(diagnostics::summary),
        )
        .route(
            "/sandboxes/{id}/diagnostics/context",
            get(diagnostics::context),
        )
        .route(
            "/sandboxes/{id}/credential-vault",
            get(routes::credential_vault)
                .post(routes::credential_vault)
                .patch(routes::credential_vault)
                .delete(routes::credential_vault),
        )
        .route(
            "/sandboxes/{id}/credential-vault/{kind}",
            get(routes::credential_vault),
        )
        .route(
            "/sandboxes/{id}/credential-vault/{kind}/{name}",
            get(routes::credential_vault),
        )
        .route("/metrics", get(metrics::scrape))
        .route("/metrics/events", post(routes::metrics_event))
        .route("/usage", get(admin::usage))
        .route("/admin/keys", post(admin::create_key).get(admin::list_keys))
        .route("/admin/keys/{id}", axum::routing::delete(admin::revoke_key))
        .route("/admin/keys/{id}/rotate", post(admin::rotate_key))
        .route("/sandboxes/{id}/snapshots", post(routes::create_snapshot))
        .route("/snapshots", get(routes::list_snapshots))
        .route("/pools", post(routes::create_pool).get(routes::list_pools))
        .route(
            "/templates",
            post(routes::create_template).get(routes::list_templates),
        )
        .route(
            "/templates/{id}",
            get(routes::get_template).delete(routes::delete_template),
        )
        .route(
            "/pools/{name}",
            get(routes::get_pool)
                .put(routes::update_pool)
                .delete(routes::delete_pool),
        )
        .route(
            "/snapshots/{id}",
            get(routes::get_snapshot).delete(routes::delete_snapshot),
        )
        .layer(DefaultBodyLimit::max(MAX_JSON_BODY));
    // The proxy streams bodies of any size (file uploads), so it has no body limit.
    let proxy = Router::new()
        .route("/sandboxes/{id}/proxy/{port}", any(proxy::proxy_root))
        .route("/sandboxes/{id}/proxy/{port}/", any(proxy::proxy_root))
        .route(
            "/sandboxes/{id}/proxy/{port}/{*rest}",
            any(proxy::proxy_path),
        )
        .layer(DefaultBodyLimit::disable());
    let both = api.merge(proxy);
    let keyed = Router::new()
        .nest("/v1", both.clone())
        .merge(both)
        .fallback(routes::not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ))
        // Preflights carry no key: answered before `auth`, and only for the API and the path proxy.
        .layer(tower::util::option_layer(cors(&state.config.http)));
    // Signed paths carry their own credential: routed beside the key check, not behind it.
    let own_host = keyed.merge(signed::path_router()).with_state(state.clone());
    // A sandbox's own host (`[endpoints] domain`) is its app's at every path.
    signed::ByHost::around(&state, own_host)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            audit::middleware,
        ))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(panicked))
        .layer(axum::middleware::from_fn(request_id))
        .layer(axum::middleware::from_fn(close_after_refused_body))
}

/// A request refused before its body was read (a 404 for a sandbox the caller does not see, a
/// 401) leaves that body unread on the connection, and hyper then closes it after the answer: a
/// client that sent its next request on it meanwhile ("Server disconnected without sending a
/// response") loses that one. `Connection: close` on such an answer tells the client not to
/// reuse the connection. HTTP/1 only (HTTP/2 has no such header, and streams end on their own).
async fn close_after_refused_body(req: Request, next: Next) -> Response {
    let has_body = req.version() < ::http::Version::HTTP_2
        && (req
            .headers()
            .contains_key(::http::header::TRANSFER_ENCODING)
            || req
                .headers()
                .get(::http::header::CONTENT_LENGTH)
                .is_some_and(|v| v.as_bytes() != b"0"));
    let mut resp = next.run(req).await;
    if has_body && (resp.status().is_client_error() || resp.status().is_server_error()) {
        resp.headers_mut().insert(
            ::http::header::CONNECTION,
            HeaderValue::from_static("close"),
        );
    }
    resp
}

/// `[http] cors_allowed_origins`: browsers at these origins may call the API and the path proxy
/// (with a key or an endpoint token in a header: no cookie is ever a credential here).
fn cors(http: &config::HttpSection) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, CorsLayer};
    let origins = &http.cors_allowed_origins;
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o.trim_end_matches('/')).ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods(AllowMethods::mirror_request())
            .allow_headers(AllowHeaders::mirror_request())
            .expose_headers([
                ::http::HeaderName::from_static("x-request-id"),
                ::http::header::RETRY_AFTER,
                ::http::header::LOCATION,
            ])
            .max_age(std::time::Duration::from_secs(600)),
    )
}

/// The answer to a request whose handler panicked (a bug): an internal error naming the request,
/// instead of a connection closed without a word. The panic itself is logged by the hook that
/// `supervise::log_panics` installs.
fn panicked(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    axum::response::IntoResponse::into_response(error::SandboxError::internal(
        "answering the request",
        &std::io::Error::other("the handler panicked"),
    ))
}

/// Echoes the client's `X-Request-ID` or assigns one, on every response; what the server logs
/// while answering carries it (a span), and an internal error's answer names it.
async fn request_id(mut req: Request, next: Next) -> Response {
    use tracing::Instrument;
    let id = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::new_v4().to_string())
                .unwrap_or(HeaderValue::from_static("-"))
        });
    let shown = String::from_utf8_lossy(id.as_bytes()).into_owned();
    // Every log line and trace span of the request is inside this one: its `id` is the answer's
    // `X-Request-Id` (error level, so that it is there whatever the log filter).
    let span = tracing::error_span!(
        "request",
        id = %shown,
        method = %req.method(),
        path = tracing::field::Empty,
        status = tracing::field::Empty
    );
    let path = req.uri().path().to_string();
    // Inner layers (the audit log) read it from the request.
    req.headers_mut().insert(REQUEST_ID_HEADER, id.clone());
    let mut resp = next.run(req).instrument(span.clone()).await;
    // Known once answered: a request that host routing took to a sandbox had the app's own path.
    let routed = resp
        .extensions()
        .get::<crate::http::audit::Routed>()
        .is_some();
    let traced_path = match shown_path(&path) {
        // An endpoint host's path is all the app's (a signed path was cut already).
        std::borrow::Cow::Borrowed(_) if routed => "(a sandbox's app)".into(),
        cut => cut,
    };
    span.record("path", traced_path.as_ref());
    span.record("status", resp.status().as_u16());
    if let Some(crate::http::error::InternalError(code)) = resp.extensions().get().cloned() {
        let (parts, _) = resp.into_parts();
        let body = warren_api::ErrorBody {
            code,
            message: error::internal_message(&shown),
        };
        let json = serde_json::to_vec(&body).unwrap_or_default();
        resp = Response::from_parts(parts, axum::body::Body::from(json));
        resp.headers_mut().remove(::http::header::CONTENT_LENGTH);
    }
    resp.headers_mut().insert(REQUEST_ID_HEADER, id);
    resp
}

/// A request's path as traces show it: a signed URL's token (`/signed/{token}/…`), which opens a
/// sandbox's port, and what follows it or a path proxy's port (the app's own path, which may
/// carry what the app keeps secret) are left out; execd's routes stay (`/proxy/44772/command`).
fn shown_path(path: &str) -> std::borrow::Cow<'_, str> {
    let rest = path.strip_prefix("/v1").unwrap_or(path);
    let prefix = &path[..path.len() - rest.len()];
    if rest.starts_with("/signed/") || rest == "/signed" {
        return format!("{prefix}/signed/-").into();
    }
    let segs: Vec<&str> = rest.split('/').collect();
    if let ["", "sandboxes", _, "proxy", port, ..] = segs.as_slice() {
        if *port != warren_api::EXECD_PORT.to_string() && segs.len() > 5 {
            return format!("{prefix}{}/…", segs[..5].join("/")).into();
        }
    }
    path.into()
}

#[cfg(test)]
mod tests {
    #[test]
    fn signed_tokens_stay_out_of_logs_and_traces() {
        use super::shown_path;
        assert_eq!(shown_path("/signed/tok123/app/x"), "/signed/-");
        assert_eq!(shown_path("/v1/signed/tok123"), "/v1/signed/-");
        assert_eq!(shown_path("/signed/"), "/signed/-");
        assert_eq!(shown_path("/v1/sandboxes/abc"), "/v1/sandboxes/abc");
        assert_eq!(
            shown_path("/v1/sandboxes/abc/proxy/8080/reset?token=s3cret/x"),
            "/v1/sandboxes/abc/proxy/8080/…"
        );
        assert_eq!(
            shown_path("/sandboxes/abc/proxy/44772/command"),
            "/sandboxes/abc/proxy/44772/command"
        );
    }

    use super::*;
    use tower::ServiceExt;

    #[tokio::test]
    async fn an_internal_error_or_a_panic_answers_with_its_request_id_and_no_cause() {
        async fn fails() -> Result<(), error::SandboxError> {
            let cause = std::io::Error::other("open /var/lib/warren/secret/path: EACCES");
            Err(error::SandboxError::internal("making the sandbox", &cause))
        }
        async fn panics() -> Result<(), error::SandboxError> {
            panic!("a bug in a handler")
        }
        let app: axum::Router = axum::Router::new()
            .route("/x", axum::routing::get(fails))
            .route("/panic", axum::routing::get(panics))
            .layer(tower_http::catch_panic::CatchPanicLayer::custom(panicked))
            .layer(axum::middleware::from_fn(request_id));
        let req = axum::http::Request::builder()
            .uri("/panic")
            .body(axum::body::Body::empty())
            .expect("request");
        let resp = app
            .clone()
            .oneshot(req)
            .await
            .expect("an answer, not a dropped connection");
        assert_eq!(resp.status(), 500);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("body")
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("internal error (request id")),
            "{body}"
        );
        let req = axum::http::Request::builder()
            .uri("/x")
            .header(REQUEST_ID_HEADER, "req-42")
            .body(axum::body::Body::empty())
            .expect("request");
        let resp = app.oneshot(req).await.expect("answer");
        assert_eq!(resp.status(), 500);
        assert_eq!(resp.headers()[REQUEST_ID_HEADER], "req-42");
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("body")
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(body["code"], "GENERAL::UNKNOWN_ERROR");
        let message = body["message"].as_str().expect("message");
        assert!(
            message.contains("internal error") && message.contains("req-42"),
            "{message}"
        );
        assert!(
            !message.contains("/var/lib") && !message.contains("EACCES"),
            "{message}"
        );
    }
}
