//! Handlers of `/v1/sandboxes…`: create, list, get, delete, pause, resume, renew, metadata,
//! endpoints, and a sandbox's network policy and credential vault.

use std::collections::BTreeMap;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};

use crate::time::rfc3339;
use warren_api::lifecycle::{
    CreateSandboxRequest, Endpoint, ListSandboxesResponse, RenewExpirationRequest,
    RenewExpirationResponse, Sandbox, SandboxState,
};
use warren_api::{ErrorBody, ErrorCode, ACCESS_TOKEN_HEADER};
use warren_store::SandboxRecord;

use super::{parse_metadata_filter, to_completion, to_wire, Paging, STATES_NEVER_SHOWN};
use crate::error::SandboxError;
use crate::http::auth::Caller;
use crate::http::error::ApiJson;
use crate::http::AppState;
use crate::sandboxes::REASON_USER_DELETE;
use crate::validate::{create_plan, validate_metadata};

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    responses((status = 202, description = "Running: execd answers", body = Sandbox), (status = 400, body = ErrorBody),
              (status = 401, body = ErrorBody), (status = 404, description = "unknown image", body = ErrorBody), (status = 500, body = ErrorBody),
              (status = 507, description = "the data dir's filesystem is too full", body = ErrorBody)))]
pub async fn create(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(mut req): ApiJson<CreateSandboxRequest>,
) -> Result<Response, SandboxError> {
    app.templates.apply(&mut req, &caller.tenant)?;
    let mut plan = create_plan(
        req,
        &app.config.limits,
        app.config.max_timeout_seconds,
        &app.storage,
    )?;
    plan.set_tenant(&caller.tenant)?;
    // Before a pool is looked for: a pool's template is resolved the same way, so the two compare.
    app.stored.resolve(&mut plan)?;
    let pool = app.pools.route(&plan)?;
    // Admitted by the tenant's quotas, held until the sandbox's record exists (or the create
    // failed). A claim makes no new sandbox (the warm one is the tenant's already): only the rate.
    let live = || app.sandboxes.live_of(&caller.tenant);
    let mut admitted =
        app.quotas
            .admit(&caller.tenant, &plan.limits, &live(), pool.is_none(), true)?;
    let claimed = match &pool {
        // Waiting for a warm sandbox may be cut off; the hand-over itself is not (see `claim`).
        Some(pool) => app.pools.claim(pool, &plan).await?,
        None => None,
    };
    let rec = match claimed {
        Some(rec) => rec,
        None => {
            if pool.is_some() {
                // The pool went away meanwhile: a sandbox of its own after all.
                admitted = app
                    .quotas
                    .admit(&caller.tenant, &plan.limits, &live(), true, false)?;
            }
            let sandboxes = app.sandboxes.clone();
            // The admission goes with the create, which runs on if its client goes away.
            to_completion(async move {
                let _admitted = admitted;
                sandboxes.create(plan).await
            })
            .await?
        }
    };
    let mut body = to_wire(&rec);
    body.image = None;
    body.snapshot_id = None;
    let mut resp = (StatusCode::ACCEPTED, Json(body)).into_response();
    if let Ok(loc) = HeaderValue::from_str(&format!("/v1/sandboxes/{}", rec.id)) {
        resp.headers_mut().insert(http::header::LOCATION, loc);
    }
    Ok(resp)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, SandboxError> {
    app.sandboxes
        .get(&id)
        .filter(|r| r.warm_pool.is_none())
        .map(|r| Json(to_wire(&r)))
        .ok_or_else(|| SandboxError::not_found(&id))
}

/// `GET /sandboxes?state=A&state=B&metadata=k%3Dv&page=1&pageSize=20`; repeated `state` values are
/// ORed, filters ANDed. Parsed by hand: serde's query extractor cannot take repeated keys.
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    params(("state" = Option<Vec<String>>, Query, description = "repeatable; ORed"),
           ("metadata" = Option<String>, Query, description = "k1=v1&k2=v2, percent-encoded"),
           ("page" = Option<u32>, Query), ("pageSize" = Option<u32>, Query)),
    responses((status = 200, body = ListSandboxesResponse), (status = 400, body = ErrorBody)))]
pub async fn list(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(query): RawQuery,
) -> Result<Json<ListSandboxesResponse>, SandboxError> {
    let mut states = Vec::new();
    // Set by any `state` parameter, even one naming only states no sandbox here is ever in.
    let mut by_state = false;
    let mut metadata: Vec<(String, String)> = Vec::new();
    let mut paging = Paging::default();
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "state" => {
                for s in v.split(',').filter(|s| !s.is_empty()) {
                    by_state = true;
                    match SandboxState::parse(s) {
                        Some(state) => states.push(state),
                        None if STATES_NEVER_SHOWN.iter().any(|n| n.eq_ignore_ascii_case(s)) => {}
                        None => return Err(SandboxError::invalid(format!("unknown state {s:?}"))),
                    }
                }
            }
            "metadata" => metadata.extend(parse_metadata_filter(&v)?),
            "page" | "pageSize" | "page_size" => paging.set(&k, &v)?,
            _ => {}
        }
    }
    let matching: Vec<SandboxRecord> = app
        .sandboxes
        .all()
        .into_iter()
        .filter(|r| r.warm_pool.is_none() && caller.sees(&r.tenant))
        .filter(|r| !by_state || states.contains(&r.state))
        .filter(|r| metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v)))
        .collect();
    let (items, pagination) = paging.apply(&matching);
    Ok(Json(ListSandboxesResponse {
        items: items.iter().map(to_wire).collect(),
        pagination,
    }))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 204, description = "Deleted: get and list no longer know it"), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, SandboxError> {
    let sandboxes = app.sandboxes.clone();
    to_completion(async move { sandboxes.delete(&id, REASON_USER_DELETE).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn pause(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, SandboxError> {
    let sandboxes = app.sandboxes.clone();
    to_completion(async move { sandboxes.pause(&id).await }).await?;
    Ok(StatusCode::ACCEPTED)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn resume(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, SandboxError> {
    let sandboxes = app.sandboxes.clone();
    to_completion(async move { sandboxes.resume(&id).await }).await?;
    Ok(StatusCode::ACCEPTED)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/renew-expiration", tag = "sandboxes", params(("id" = String, Path)),
    request_body = RenewExpirationRequest,
    responses((status = 200, body = RenewExpirationResponse), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn renew(
    State(app): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<RenewExpirationRequest>,
) -> Result<Json<RenewExpirationResponse>, SandboxError> {
    let at = DateTime::parse_from_rfc3339(&req.expires_at)
        .map_err(|e| {
            SandboxError::bad_request(
                ErrorCode::InvalidExpiration,
                format!("expiresAt {:?} is not RFC 3339: {e}", req.expires_at),
            )
        })?
        .with_timezone(&Utc);
    let sandboxes = app.sandboxes.clone();
    let at = to_completion(async move { sandboxes.renew(&id, at).await }).await?;
    Ok(Json(RenewExpirationResponse {
        expires_at: rfc3339(at),
    }))
}

#[utoipa::path(patch, path = "/v1/sandboxes/{id}/metadata", tag = "sandboxes", params(("id" = String, Path)),
    request_body(content = Object, description = "JSON merge patch: {key: value | null}"),
    responses((status = 200, body = Sandbox), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn patch_metadata(
    State(app): State<AppState>,
    Path(id): Path<String>,
    ApiJson(patch): ApiJson<BTreeMap<String, Option<String>>>,
) -> Result<Json<Sandbox>, SandboxError> {
    validate_metadata(patch.iter().map(|(k, v)| (k.as_str(), v.as_deref())))?;
    let sandboxes = app.sandboxes.clone();
    let rec = to_completion(async move {
        sandboxes
            .patch_metadata(&id, patch.into_iter().collect())
            .await
    })
    .await?;
    Ok(Json(to_wire(&rec)))
}

/// `GET|PUT|PATCH|DELETE /sandboxes/{id}/networkpolicy`: the sandbox's egress policy (the same calls
/// as the 18080 surface's `/policy`, on the lifecycle API with the API key).
pub async fn network_policy(
    State(app): State<AppState>,
    Path(id): Path<String>,
    method: http::Method,
    body: axum::body::Bytes,
) -> Result<Json<crate::network::PolicyStatus>, SandboxError> {
    let sandboxes = app.sandboxes.clone();
    Ok(Json(
        to_completion(async move {
            crate::http::policy::policy_call(&sandboxes, &id, &method, &body).await
        })
        .await?,
    ))
}

/// `POST|GET|PATCH|DELETE /sandboxes/{id}/credential-vault` and `GET …/credentials[/{name}]`,
/// `…/bindings[/{name}]`: the sandbox's credential vault on the lifecycle API (the calls of the
/// 18080 surface with the lifecycle spec's codes: `network::VaultSurface::Lifecycle`). A create on
/// a sandbox without the credential proxy (one made from a template) starts the proxy first.
pub async fn credential_vault(
    State(app): State<AppState>,
    Path(params): Path<Vec<(String, String)>>,
    method: http::Method,
    body: axum::body::Bytes,
) -> Result<Response, SandboxError> {
    use crate::http::policy::{vault_call, VaultSurface};
    let mut id = String::new();
    let mut sub = String::new();
    for (key, value) in params {
        match key.as_str() {
            "id" => id = value,
            "kind" => sub = format!("/{value}"),
            "name" => sub = format!("{sub}/{value}"),
            _ => {}
        }
    }
    if method == http::Method::POST && sub.is_empty() {
        // A body that would be refused must not leave a proxy started behind it.
        let parsed = serde_json::from_slice::<serde_json::Value>(&body)
            .map_err(|e| SandboxError::invalid(format!("invalid JSON body: {e}")))?;
        warren_egress::vault::Vault::create(&parsed)
            .map_err(|e| SandboxError::invalid(e.to_string()))?;
        let sandboxes = app.sandboxes.clone();
        let id = id.clone();
        to_completion(async move { sandboxes.enable_credential_proxy(&id).await }).await?;
    }
    let sandboxes = app.sandboxes.clone();
    let (status, state) = to_completion(async move {
        vault_call(
            sandboxes.network(),
            &id,
            &method,
            &sub,
            &body,
            VaultSurface::Lifecycle,
        )
        .await
    })
    .await?;
    Ok(match state {
        Some(v) => (status, Json(v)).into_response(),
        None => status.into_response(),
    })
}

/// Every port is reached through Warren's own listener; the token in `headers` opens only this port
/// of this sandbox (execd's and the egress surface's ports each have their own).
///
/// `use_server_proxy` changes nothing (every endpoint is the server's proxy already). `expires`
/// asks for a signed URL that carries its own credential and needs no header (see `signed`):
/// `{host}/signed/{token}`, or `{token}.{domain}` with `[endpoints] domain`.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/endpoints/{port}", tag = "sandboxes",
    params(("id" = String, Path), ("port" = u16, Path),
           ("use_server_proxy" = Option<bool>, Query, description = "accepted; every endpoint goes through the server"),
           ("expires" = Option<u64>, Query, description = "a signed URL's expiry (Unix seconds, at most [endpoints] max_signed_seconds away): the answer's endpoint then needs no header")),
    responses((status = 200, body = Endpoint), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn endpoint(
    State(app): State<AppState>,
    Path((id, port)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Json<Endpoint>, SandboxError> {
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| SandboxError::invalid(format!("invalid port {port:?}")))?;
    let expires = check_endpoint_query(query.as_deref().unwrap_or_default())?;
    let rec = app
        .sandboxes
        .get(&id)
        .ok_or_else(|| SandboxError::not_found(&id))?;
    if rec.state.is_terminal() || rec.state == SandboxState::Stopping {
        return Err(SandboxError::conflict(
            ErrorCode::SandboxNotRunning,
            format!("sandbox {id} is {}", rec.state.as_str()),
        ));
    }
    let host = app
        .config
        .public_host
        .clone()
        .or_else(|| {
            headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .filter(|h| valid_host(h))
                .map(str::to_string)
        })
        .unwrap_or_else(|| app.local_addr.to_string());
    // On the timeline: who holds a way into which port (never the token or the URL itself).
    if let Some(t) = app.sandboxes.timeline(&id) {
        let mut detail = serde_json::json!({"port": port, "signed": expires.is_some()});
        if let Some((expires, _)) = expires {
            detail["expires"] = expires.into();
        }
        t.record("endpoint", detail);
    }
    if let Some((expires, now)) = expires {
        // A signed URL carries its own credential: no header to send (see `signed`).
        let endpoint = crate::http::signed::signed_endpoint(&app, &host, &id, port, expires, now)?;
        return Ok(Json(Endpoint {
            endpoint,
            headers: BTreeMap::new(),
        }));
    }
    // This port's own token (see `tokens`): it opens this port of this sandbox and nothing else.
    let token = crate::tokens::endpoint_token(&rec.token, port);
    let mut out = BTreeMap::new();
    if port == warren_api::EGRESS_PORT {
        // Also under the name clients of the reference egress sidecar send.
        out.insert(
            crate::network::EGRESS_AUTH_HEADER.to_string(),
            token.clone(),
        );
    }
    out.insert(ACCESS_TOKEN_HEADER.to_string(), token);
    Ok(Json(Endpoint {
        endpoint: crate::http::signed::host_endpoint(&app, &id, port)
            .unwrap_or_else(|| format!("{host}/sandboxes/{id}/proxy/{port}")),
        headers: out,
    }))
}

/// The endpoint route's query: `use_server_proxy` a boolean (every endpoint is the server's
/// proxy); `expires` a future Unix time, for a signed URL: answered with (expires, now).
fn check_endpoint_query(query: &str) -> Result<Option<(u64, u64)>, SandboxError> {
    let mut expires = None;
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "use_server_proxy" | "useServerProxy"
                if !matches!(
                    v.to_ascii_lowercase().as_str(),
                    "true" | "1" | "false" | "0"
                ) =>
            {
                return Err(SandboxError::invalid(format!(
                    "use_server_proxy must be true or false, not {v:?}"
                )));
            }
            "expires" => {
                expires = Some(v.parse::<u64>().map_err(|_| {
                    SandboxError::invalid(format!(
                        "expires must be a non-negative Unix timestamp (uint64), not {v:?}"
                    ))
                })?)
            }
            _ => {}
        }
    }
    let Some(expires) = expires else {
        return Ok(None);
    };
    let now = Utc::now().timestamp().max(0) as u64;
    if expires <= now {
        return Err(SandboxError::invalid(format!(
            "expires ({expires}) must be greater than current time ({now})"
        )));
    }
    Ok(Some((expires, now)))
}

fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 255
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
}
