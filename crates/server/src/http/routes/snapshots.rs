//! Handlers of `/v1/snapshots…` and `POST /v1/sandboxes/{id}/snapshots`.

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use warren_api::{ErrorBody, ErrorCode};

use super::{to_completion, Paging};
use crate::error::SandboxError;
use crate::http::auth::Caller;
use crate::http::AppState;

#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots", params(("id" = String, Path)),
    request_body = Option<warren_api::lifecycle::CreateSnapshotRequest>,
    responses((status = 202, description = "capture started (state Creating)", body = warren_api::lifecycle::Snapshot),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 507, description = "the data dir's filesystem is too full", body = ErrorBody)))]
pub async fn create_snapshot(
    State(app): State<AppState>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, SandboxError> {
    // The body is optional: an empty one means no name.
    let req: warren_api::lifecycle::CreateSnapshotRequest = if body
        .iter()
        .all(u8::is_ascii_whitespace)
    {
        Default::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            SandboxError::bad_request(ErrorCode::InvalidRequestBody, format!("invalid body: {e}"))
        })?
    };
    let snapshots = app.snapshots.clone();
    let timeline = app.sandboxes.timeline(&id);
    let rec = to_completion(async move { snapshots.create(&id, req.name).await }).await?;
    if let Some(t) = timeline {
        t.record(
            "snapshot",
            serde_json::json!({"snapshotId": rec.id, "name": rec.name}),
        );
    }
    Ok((StatusCode::ACCEPTED, Json(rec.to_wire())).into_response())
}

#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    params(("sandboxId" = Option<String>, Query), ("name" = Option<String>, Query),
        ("state" = Option<String>, Query), ("page" = Option<u32>, Query), ("pageSize" = Option<u32>, Query)),
    responses((status = 200, body = warren_api::lifecycle::ListSnapshotsResponse), (status = 400, body = ErrorBody)))]
pub async fn list_snapshots(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(query): RawQuery,
) -> Result<Json<warren_api::lifecycle::ListSnapshotsResponse>, SandboxError> {
    let mut sandbox = None;
    let mut name = None;
    let mut states: Vec<String> = Vec::new();
    let mut paging = Paging::default();
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "sandboxId" | "sandbox_id" => sandbox = Some(v.into_owned()),
            "name" => name = Some(v.into_owned()),
            "state" => states.extend(v.split(',').filter(|s| !s.is_empty()).map(str::to_owned)),
            "page" | "pageSize" | "page_size" => paging.set(&k, &v)?,
            _ => {}
        }
    }
    let matching: Vec<_> = app
        .snapshots
        .all()
        .into_iter()
        .filter(|s| caller.sees(&s.tenant))
        .filter(|s| sandbox.as_ref().is_none_or(|id| &s.sandbox_id == id))
        .filter(|s| name.is_none() || s.name == name)
        .filter(|s| states.is_empty() || states.iter().any(|st| st.eq_ignore_ascii_case(&s.state)))
        .collect();
    let (items, pagination) = paging.apply(&matching);
    Ok(Json(warren_api::lifecycle::ListSnapshotsResponse {
        items: items.iter().map(|s| s.to_wire()).collect(),
        pagination,
    }))
}

#[utoipa::path(get, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path)),
    responses((status = 200, body = warren_api::lifecycle::Snapshot), (status = 404, body = ErrorBody)))]
pub async fn get_snapshot(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<warren_api::lifecycle::Snapshot>, SandboxError> {
    Ok(Json(app.snapshots.lookup_as(&caller, &id)?.to_wire()))
}

#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path)),
    responses((status = 204, description = "deleted"), (status = 404, body = ErrorBody)))]
pub async fn delete_snapshot(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, SandboxError> {
    app.snapshots.lookup_as(&caller, &id)?;
    let snapshots = app.snapshots.clone();
    to_completion(async move { snapshots.delete(&id).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- pools ----
