//! `POST /files/upload`: a multipart body of repeated `metadata` (JSON `{path, owner, group, mode}`) and
//! `file` parts. Parts are streamed to disk as they arrive — uploads of any size, chunked or not, never sit
//! in memory whole.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use futures::{StreamExt, TryStreamExt};
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
    let body = SharedBody::new(req.into_body().into_data_stream());
    let result = receive(&app, &body, boundary).await;
    // multer stops at the closing boundary (or at an error); the body's own end (an epilogue, the
    // chunked terminator) may still be unread. Answering before it is read makes hyper close the
    // connection while the client is still sending that last bit, and the client (the server's
    // proxy) then reports a failed request instead of this answer.
    body.drain().await;
    result
}

/// Writes every file of the multipart body; returns once the closing boundary is read.
async fn receive(app: &AppState, body: &SharedBody, boundary: String) -> ApiResult<StatusCode> {
    let mut multipart = multer::Multipart::new(body.clone(), boundary);
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
                let file = crate::files::blocking({
                    let (path, shown) = (path.clone(), meta.path.clone());
                    move || create_for_upload(&path).map_err(|e| ApiError::io(&shown, e))
                })
                .await?;
                let mut file = tokio::fs::File::from_std(file);
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

/// Creates (or truncates) the file at `path` and any missing folders above it, never through a /proc
/// magic link (see `safe_path`): an upload to `/proc/1/fd/1` would otherwise write to whatever PID 1's
/// output is.
fn create_for_upload(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        crate::safe_path::create_dir_all(parent)?;
    }
    crate::safe_path::open(path, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, 0o644)
}

/// The request body, shared between multer (which reads it up to the closing boundary) and the
/// handler (which reads what is left).
#[derive(Clone)]
struct SharedBody(Arc<std::sync::Mutex<axum::body::BodyDataStream>>);

impl SharedBody {
    fn new(stream: axum::body::BodyDataStream) -> Self {
        Self(Arc::new(std::sync::Mutex::new(stream)))
    }

    /// Reads and discards the rest of the body, bounded: an upload's epilogue is tiny, but after
    /// a refusal (a path execd will not write) the rest of the refused file is unread too. Up to
    /// 8 MiB is read so that the client gets the answer; a client that sends more than that is
    /// cut off (and may see a failed request instead).
    async fn drain(&self) {
        let mut left = 8usize << 20;
        while let Some(Ok(chunk)) = self.clone().next().await {
            left = left.saturating_sub(chunk.len());
            if left == 0 {
                break;
            }
        }
    }
}

impl futures::Stream for SharedBody {
    type Item = Result<bytes::Bytes, axum::Error>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.0.lock() {
            Ok(mut inner) => std::pin::Pin::new(&mut *inner).poll_next(cx),
            Err(_) => std::task::Poll::Ready(None),
        }
    }
}
