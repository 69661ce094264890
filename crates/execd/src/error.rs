//! The one HTTP error type of execd: every failure becomes the protocol's `{code, message}` body with a
//! status, and JSON extractor rejections go through the same path (the SDKs parse that body).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use warren_api::ErrorBody;

/// execd error codes (`components/execd/pkg/web/model/error.go` in the reference).
pub mod code {
    pub const INVALID_REQUEST_BODY: &str = "INVALID_REQUEST_BODY";
    pub const DESKTOP_NOT_RUNNING: &str = "DESKTOP_NOT_RUNNING";
    /// Warren's own: a desktop recording runs already, or none was started.
    pub const RECORDING_RUNNING: &str = "RECORDING_RUNNING";
    pub const NO_RECORDING: &str = "NO_RECORDING";
    pub const MISSING_QUERY: &str = "MISSING_QUERY";
    pub const RUNTIME_ERROR: &str = "RUNTIME_ERROR";
    pub const INVALID_FILE: &str = "INVALID_FILE";
    pub const INVALID_FILE_CONTENT: &str = "INVALID_FILE_CONTENT";
    pub const INVALID_FILE_METADATA: &str = "INVALID_FILE_METADATA";
    pub const FILE_NOT_FOUND: &str = "FILE_NOT_FOUND";
    pub const CONTEXT_NOT_FOUND: &str = "CONTEXT_NOT_FOUND";
    pub const SESSION_NOT_FOUND: &str = "SESSION_NOT_FOUND";
    pub const SESSION_BUSY: &str = "SESSION_BUSY";
    pub const NOT_SUPPORTED: &str = "NOT_SUPPORTED";
    pub const SERVICE_UNAVAILABLE: &str = "SERVICE_UNAVAILABLE";
    /// Warren's own: a bounded resource of execd is in use (filesystem workers).
    pub const TOO_MANY_REQUESTS: &str = "TOO_MANY_REQUESTS";
    /// Warren's own: the request lacks execd's credential (see `access`).
    pub const UNAUTHORIZED: &str = "UNAUTHORIZED";
    pub const UNKNOWN: &str = "UNKNOWN";
}

#[derive(Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    pub fn bad_body(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code::INVALID_REQUEST_BODY, message)
    }

    pub fn missing_query(name: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            code::MISSING_QUERY,
            format!("missing query parameter '{name}'"),
        )
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    pub fn invalid_file(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code::INVALID_FILE, message)
    }

    pub fn runtime(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            code::RUNTIME_ERROR,
            message,
        )
    }

    /// Maps a filesystem error on `path` to the status the SDKs expect: missing → 404, denied → 403,
    /// everything else → 500 with the error text (it is the user's own sandbox: no secret to hide).
    pub fn io(path: &str, err: std::io::Error) -> Self {
        use std::io::ErrorKind;
        match err.kind() {
            ErrorKind::NotFound => Self::not_found(
                code::FILE_NOT_FOUND,
                format!("{path}: no such file or directory"),
            ),
            ErrorKind::PermissionDenied => Self::new(
                StatusCode::FORBIDDEN,
                code::RUNTIME_ERROR,
                // A refusal of our own (`safe_path`) says why; the kernel's says only EACCES.
                match err.get_ref() {
                    Some(why) => format!("{path}: {why}"),
                    None => format!("{path}: permission denied"),
                },
            ),
            ErrorKind::AlreadyExists => Self::invalid_file(format!("{path}: already exists")),
            _ => Self::runtime(format!("{path}: {err}")),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(code = self.code, message = %self.message, "request failed");
        }
        (
            self.status,
            axum::Json(ErrorBody::new(self.code, self.message)),
        )
            .into_response()
    }
}

/// JSON body extractor whose rejection is an [`ApiError`] (400 `INVALID_REQUEST_BODY`) instead of axum's
/// plain-text one. The content type is not checked: some clients omit it and the body says what it is.
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = body_bytes(req, state).await?;
        parse_json(&bytes).map(Self)
    }
}

/// Like [`ApiJson`] but an empty body yields `T::default()` (`POST /session` may come without one).
pub struct OptionalJson<T>(pub T);

impl<T, S> FromRequest<S> for OptionalJson<T>
where
    T: DeserializeOwned + Default,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = body_bytes(req, state).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self(T::default()));
        }
        parse_json(&bytes).map(Self)
    }
}

async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> ApiResult<Bytes> {
    Bytes::from_request(req, state)
        .await
        .map_err(|e| ApiError::bad_body(e.body_text()))
}

fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad_body(format!("invalid JSON body: {e}")))
}
