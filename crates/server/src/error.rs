//! The one error type of the HTTP boundary: every failure leaves as `{code, message}` with the right
//! status. Internal errors are logged in full and answered with a generic message.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::{ErrorBody, ErrorCode};
use warren_core::RuntimeError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    /// What the client reads, unless `hidden`. Private: a caller that passes an error on to a
    /// client (another surface, a record others read) takes [`ApiError::public_message`], so an
    /// internal error's text cannot leave by a path that forgot to check.
    message: String,
    /// A failure of the server's own (`internal`): the message goes to the log, not the client.
    pub hidden: bool,
    /// With a 429: how many seconds to wait (`Retry-After`; 1 when not given).
    pub retry_after: Option<u64>,
}

impl std::fmt::Display for ApiError {
    /// The whole message, for the server's own log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl ApiError {
    /// What a client may read of this error: its message, or for a failure of the server's own a
    /// generic line (the cause is logged here, once).
    pub fn public_message(&self) -> String {
        if self.hidden {
            tracing::error!(code = %self.code, "{}", self.message);
            internal_message("-")
        } else {
            self.message.clone()
        }
    }

    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code: code.as_str().to_string(),
            message: message.into(),
            hidden: false,
            retry_after: None,
        }
    }

    pub fn bad_request(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::bad_request(ErrorCode::InvalidParameter, message)
    }

    pub fn not_found(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorCode::SandboxNotFound,
            format!("sandbox {id} not found"),
        )
    }

    pub fn conflict(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }

    /// A failure of the server's own: the whole cause chain goes to the server's log (see
    /// `into_response`), the client gets "internal error" and the request's id.
    pub fn internal(context: &str, err: &(dyn std::error::Error + 'static)) -> Self {
        let chain = warren_core::error_chain(err);
        Self {
            hidden: true,
            ..Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::Unknown,
                format!("{context}: {chain}"),
            )
        }
    }

    pub fn from_runtime(context: &str, err: RuntimeError) -> Self {
        match err {
            RuntimeError::NotFound(m) => {
                Self::new(StatusCode::NOT_FOUND, ErrorCode::SandboxNotFound, m)
            }
            RuntimeError::Conflict(m) => Self::conflict(ErrorCode::InvalidState, m),
            RuntimeError::Unsupported(m) => {
                Self::new(StatusCode::NOT_IMPLEMENTED, ErrorCode::ApiNotSupported, m)
            }
            RuntimeError::Exhausted(m) => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, ErrorCode::Unknown, m)
            }
            RuntimeError::Invalid(m) => Self::invalid(m),
            RuntimeError::ImageNotFound(m) => {
                Self::new(StatusCode::NOT_FOUND, ErrorCode::ImageNotFound, m)
            }
            RuntimeError::StartFailed(m) => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::SandboxStartFailed,
                m,
            ),
            RuntimeError::Unavailable(m) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::RuntimeUnavailable,
                format!("{context}: {m}"),
            ),
            e @ RuntimeError::Backend { .. } => Self::internal(context, &e),
        }
    }
}

/// Marks a response that answers an internal error: the request-id middleware (`request_id` in
/// the crate root) writes its message, naming the request so its log lines can be found. It holds
/// the error's code.
#[derive(Debug, Clone)]
pub struct InternalError(pub String);

/// What a client is told of an internal error: paths, errnos and the rest of the cause chain stay
/// in the server's log, under the request's id.
pub fn internal_message(request_id: &str) -> String {
    format!("internal error (request id {request_id}); the server's log has the cause")
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry = (self.status == StatusCode::TOO_MANY_REQUESTS)
            .then(|| self.retry_after.unwrap_or(1).max(1));
        let internal = self.hidden;
        // (inside the request's span: an internal error's log line carries its id)
        let message = self.public_message();
        let marker = internal.then(|| InternalError(self.code.clone()));
        let mut resp = (
            self.status,
            Json(ErrorBody {
                code: self.code,
                message,
            }),
        )
            .into_response();
        if let Some(marker) = marker {
            resp.extensions_mut().insert(marker);
        }
        if let Some(seconds) = retry {
            // By default 1: a pool refills in well under a second per sandbox.
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds),
            );
        }
        resp
    }
}

impl From<axum::extract::rejection::JsonRejection> for ApiError {
    fn from(r: axum::extract::rejection::JsonRejection) -> Self {
        let status = r.status();
        // Syntax and type errors alike are the client's malformed body: 400 (axum would say 422).
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            return Self::new(
                status,
                ErrorCode::BodyTooLarge,
                "request body too large (limit 1 MiB)",
            );
        }
        Self::bad_request(ErrorCode::InvalidRequestBody, r.body_text())
    }
}

/// `Json<T>` whose rejections use the `{code, message}` body.
pub struct ApiJson<T>(pub T);

impl<T, S> axum::extract::FromRequest<S> for ApiJson<T>
where
    axum::Json<T>:
        axum::extract::FromRequest<S, Rejection = axum::extract::rejection::JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(v) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Self(v))
    }
}

#[cfg(test)]
mod snapshot {
    use super::*;

    /// What clients read of an error, one of each kind: status, Retry-After and body. The official
    /// SDKs parse these bodies, so a change shows up in review as a change to this snapshot.
    #[tokio::test]
    async fn error_bodies_match_their_snapshot() {
        let failure = std::io::Error::other("disk on fire at /var/lib/warren/secret");
        let errors = [
            ApiError::not_found("sbx-1"),
            ApiError::invalid("resourceLimits.memory: invalid memory quantity \"lots\""),
            ApiError::conflict(ErrorCode::SandboxNotRunning, "sandbox sbx-1 is Paused"),
            ApiError {
                retry_after: Some(3),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    ErrorCode::LimitReached,
                    "pool p is empty",
                )
            },
            ApiError::from_runtime(
                "pausing the sandbox",
                RuntimeError::Unavailable("the daemon is down".into()),
            ),
            crate::disk_space::insufficient("no room for a sandbox".into()),
            // a failure of the server's own: its text stays in the log
            ApiError::internal("reading the sandbox's image", &failure),
        ];
        let mut text = String::new();
        for e in errors {
            let resp = e.into_response();
            let status = resp.status();
            let retry = resp
                .headers()
                .get(axum::http::header::RETRY_AFTER)
                .map(|v| format!(" Retry-After: {}", v.to_str().unwrap_or("?")))
                .unwrap_or_default();
            let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
                .await
                .expect("body");
            text += &format!("{status}{retry}\n{}\n\n", String::from_utf8_lossy(&body));
        }
        assert!(!text.contains("on fire"), "an internal error's text leaked");
        // Passed on to another surface (the egress sidecar's, a template's or a snapshot's
        // record): the same generic line; the full text only where the server logs it.
        let internal = ApiError::internal("reading the sandbox's image", &failure);
        assert!(!internal.public_message().contains("on fire"));
        assert!(internal.to_string().contains("on fire"));
        let plain = ApiError::invalid("resourceLimits.memory: too small");
        assert_eq!(plain.public_message(), plain.to_string());
        insta::with_settings!({ prepend_module_to_snapshot => false, omit_expression => true }, {
            insta::assert_snapshot!("error-bodies", text);
        });
    }
}
