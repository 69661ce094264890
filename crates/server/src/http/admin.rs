//! Warren's own routes: the admin API, tenants' keys (`/v1/admin/keys`; `auth` lets only admin
//! keys in), and a tenant's usage and quotas (`/v1/usage`).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::admin::{CreateKeyRequest, IssuedKey, ListKeysResponse};
use warren_api::ErrorCode;

use crate::error::{ErrorKind, SandboxError};
use crate::http::error::ApiJson;
use crate::http::AppState;
use crate::keys::{KeyError, Role};

fn from_key_error(e: KeyError) -> SandboxError {
    match e {
        KeyError::Invalid(m) => SandboxError::invalid(m),
        KeyError::NotFound(id) => SandboxError::new(
            ErrorKind::NotFound,
            ErrorCode::InvalidParameter,
            format!("no live key {id}"),
        ),
        KeyError::Io { .. } => SandboxError::internal("the key store", &e),
    }
}

/// Runs a store change off the async workers (it locks and writes a file).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, KeyError> + Send + 'static,
) -> Result<T, SandboxError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| SandboxError::internal("the key store", &e))?
        .map_err(from_key_error)
}

pub async fn create_key(
    State(app): State<AppState>,
    ApiJson(req): ApiJson<CreateKeyRequest>,
) -> Result<Response, SandboxError> {
    let role = Role::parse(&req.role).map_err(SandboxError::invalid)?;
    let keys = app.keys.clone();
    let (entry, key) = blocking(move || keys.create(&req.tenant, role, req.name)).await?;
    tracing::info!(key_id = %entry.id, tenant = %entry.tenant, role = role.as_str(), "key created");
    Ok((StatusCode::CREATED, Json(entry.issued(key))).into_response())
}

pub async fn list_keys(State(app): State<AppState>) -> Json<ListKeysResponse> {
    Json(ListKeysResponse {
        items: app.keys.list().iter().map(|k| k.to_wire()).collect(),
    })
}

pub async fn revoke_key(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<warren_api::admin::KeyInfo>, SandboxError> {
    let keys = app.keys.clone();
    let entry = blocking(move || keys.revoke(&id)).await?;
    tracing::info!(key_id = %entry.id, tenant = %entry.tenant, "key revoked");
    Ok(Json(entry.to_wire()))
}

pub async fn rotate_key(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<IssuedKey>, SandboxError> {
    let keys = app.keys.clone();
    let (entry, key) = blocking(move || keys.rotate(&id)).await?;
    tracing::info!(key_id = %entry.id, tenant = %entry.tenant, "key rotated");
    Ok(Json(entry.issued(key)))
}

/// The caller's tenant's usage and quotas (an admin acting for no tenant: the default tenant's).
pub async fn usage(
    State(app): State<AppState>,
    axum::Extension(caller): axum::Extension<crate::http::auth::Caller>,
) -> Json<warren_api::admin::Usage> {
    let live = app.sandboxes.live_of(&caller.tenant);
    let snapshot_bytes = app.snapshots.bytes_of(&caller.tenant, None);
    Json(app.quotas.usage(&caller.tenant, &live, snapshot_bytes))
}
