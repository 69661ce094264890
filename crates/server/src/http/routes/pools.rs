//! Handlers of `/v1/pools…`.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use warren_api::ErrorBody;

use super::to_completion;
use crate::error::SandboxError;
use crate::http::auth::Caller;
use crate::http::error::ApiJson;
use crate::http::AppState;

#[utoipa::path(post, path = "/v1/pools", tag = "pools", request_body = warren_api::lifecycle::PoolSpec,
    responses((status = 201, body = warren_api::lifecycle::Pool), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create_pool(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(spec): ApiJson<warren_api::lifecycle::PoolSpec>,
) -> Result<Response, SandboxError> {
    let pool = app.pools.create(spec, &caller.tenant)?;
    Ok((StatusCode::CREATED, Json(pool)).into_response())
}

#[utoipa::path(get, path = "/v1/pools", tag = "pools",
    responses((status = 200, body = warren_api::lifecycle::ListPoolsResponse)))]
pub async fn list_pools(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Json<warren_api::lifecycle::ListPoolsResponse> {
    Json(warren_api::lifecycle::ListPoolsResponse {
        items: app.pools.list(&caller),
    })
}

#[utoipa::path(get, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path)),
    responses((status = 200, body = warren_api::lifecycle::Pool), (status = 404, body = ErrorBody)))]
pub async fn get_pool(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<warren_api::lifecycle::Pool>, SandboxError> {
    app.pools.get(&caller.tenant, &name).map(Json)
}

#[utoipa::path(put, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path)),
    request_body = warren_api::lifecycle::PoolUpdate,
    responses((status = 200, body = warren_api::lifecycle::Pool), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn update_pool(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    ApiJson(update): ApiJson<warren_api::lifecycle::PoolUpdate>,
) -> Result<Json<warren_api::lifecycle::Pool>, SandboxError> {
    let pools = app.pools.clone();
    to_completion(async move { pools.update(&caller.tenant, &name, update).await })
        .await
        .map(Json)
}

#[utoipa::path(delete, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path)),
    responses((status = 204, description = "deleted, with its warm sandboxes"), (status = 404, body = ErrorBody)))]
pub async fn delete_pool(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<StatusCode, SandboxError> {
    let pools = app.pools.clone();
    to_completion(async move { pools.delete(&caller.tenant, &name).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- templates ----
