//! Handlers of `/v1/templates…`.

use std::collections::BTreeMap;

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use warren_api::ErrorBody;

use super::{parse_metadata_filter, to_completion, Paging};
use crate::error::SandboxError;
use crate::http::auth::Caller;
use crate::http::error::ApiJson;
use crate::http::AppState;

#[utoipa::path(post, path = "/v1/templates", tag = "templates", request_body = warren_api::lifecycle::CreateTemplateRequest,
    responses((status = 201, description = "Pending: built in the background", body = warren_api::lifecycle::Template), (status = 400, body = ErrorBody)))]
pub async fn create_template(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<warren_api::lifecycle::CreateTemplateRequest>,
) -> Result<Response, SandboxError> {
    // Its build is a sandbox of the tenant's, admitted as any create.
    let limits =
        crate::validate::resource_limits(req.resource_limits.as_ref(), &app.config.limits)?;
    let live = app.sandboxes.live_of(&caller.tenant);
    let admission = app
        .quotas
        .admit(&caller.tenant, &limits, &live, true, true)?;
    let template = app.templates.create(req, &caller.tenant, admission)?;
    Ok((StatusCode::CREATED, Json(template)).into_response())
}

#[utoipa::path(get, path = "/v1/templates", tag = "templates",
    params(("metadata" = Option<String>, Query), ("page" = Option<u32>, Query), ("pageSize" = Option<u32>, Query)),
    responses((status = 200, body = warren_api::lifecycle::ListTemplatesResponse), (status = 400, body = ErrorBody)))]
pub async fn list_templates(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(query): RawQuery,
) -> Result<Json<warren_api::lifecycle::ListTemplatesResponse>, SandboxError> {
    let mut metadata = BTreeMap::new();
    let mut paging = Paging::default();
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "metadata" => metadata.extend(parse_metadata_filter(&v)?),
            "page" | "pageSize" | "page_size" => paging.set(&k, &v)?,
            _ => {}
        }
    }
    let all = app.templates.list(&caller, &metadata);
    let (items, pagination) = paging.apply(&all);
    Ok(Json(warren_api::lifecycle::ListTemplatesResponse {
        items: items.to_vec(),
        pagination,
    }))
}

#[utoipa::path(get, path = "/v1/templates/{id}", tag = "templates", params(("id" = String, Path)),
    responses((status = 200, body = warren_api::lifecycle::Template), (status = 404, body = ErrorBody)))]
pub async fn get_template(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<warren_api::lifecycle::Template>, SandboxError> {
    app.templates.get(&caller, &id).map(Json)
}

#[utoipa::path(delete, path = "/v1/templates/{id}", tag = "templates", params(("id" = String, Path)),
    responses((status = 204, description = "deleted, with its golden image"), (status = 404, body = ErrorBody)))]
pub async fn delete_template(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, SandboxError> {
    let templates = app.templates.clone();
    to_completion(async move { templates.delete(&caller, &id).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}
