//! `POST /files/upload`: a multipart body of repeated `metadata` (JSON `{path, owner, group, mode}`) and
//! `file` parts. Parts are streamed to disk as they arrive — uploads of any size, chunked or not, never sit
//! in memory whole.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use futures::TryStreamExt;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

use crate::error::{code, ApiError, ApiResult};
use crate::files::{apply_ownership, Ownership};
use crate::ids::Ids;
use crate::AppState;

#[derive(Debug, Deserialize)]
struct Metadata {
    path: String,
    #[serde(flatten)]
    ownership: Ownership,
}

fn bad_metadata(msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, code::INVALID_FILE_METADATA, msg)
}

fn multipart_error(e: multer::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        code::INVALID_FILE,
        format!("invalid multipart body: {e}"),
    )
}

pub async fn upload(State(app): State<Arc<AppState>>, req: Request) -> ApiResult<StatusCode> {
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| ApiError::bad_body("missing Content-Type"))?;
    let boundary = multer::parse_boundary(content_type).map_err(multipart_error)?;
    let stream = req.into_body().into_data_stream();
    let mut multipart = multer::Multipart::new(stream, boundary);
    let ids = Ids::load();
    let mut pending: Option<Metadata> = None;
    let mut written = 0usize;
    while let Some(mut field) = multipart.next_field().await.map_err(multipart_error)? {
        match field.name() {
            Some("metadata") => {
                let bytes = field.bytes().await.map_err(multipart_error)?;
                let meta: Metadata = serde_json::from_slice(&bytes)
                    .map_err(|e| bad_metadata(format!("invalid metadata JSON: {e}")))?;
                if meta.path.is_empty() {
                    return Err(bad_metadata("metadata.path must not be empty"));
                }
                pending = Some(meta);
            }
            Some("file") => {
                let meta = pending
                    .take()
                    .ok_or_else(|| bad_metadata("file part without a preceding metadata part"))?;
                let path = app.resolve(&meta.path);
                if let Some(parent) = path.parent() {
                    tokio::fs::create_dir_all(parent)
                        .await
                        .map_err(|e| ApiError::io(&meta.path, e))?;
                }
                let mut file = tokio::fs::File::create(&path)
                    .await
                    .map_err(|e| ApiError::io(&meta.path, e))?;
                while let Some(chunk) = field.try_next().await.map_err(multipart_error)? {
                    file.write_all(&chunk)
                        .await
                        .map_err(|e| ApiError::io(&meta.path, e))?;
                }
                file.flush()
                    .await
                    .map_err(|e| ApiError::io(&meta.path, e))?;
                drop(file);
                apply_ownership(&path, &meta.path, &meta.ownership, &ids)?;
                tracing::debug!(path = %path.display(), "uploaded file");
                written += 1;
            }
            other => tracing::debug!(name = ?other, "ignoring unknown multipart field"),
        }
    }
    if written == 0 {
        return Err(ApiError::invalid_file("no file part in upload"));
    }
    Ok(StatusCode::OK)
}
