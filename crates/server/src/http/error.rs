//! The edge: a [`SandboxError`] leaves as `{code, message}` with the status its kind maps to,
//! here and nowhere else. Internal errors are logged in full and answered with a generic message.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::{ErrorBody, ErrorCode};

use crate::error::{ErrorKind, SandboxError};

impl ErrorKind {
    /// The one HTTP status of each kind.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::Invalid => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthenticated => StatusCode::UNAUTHORIZED,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            ErrorKind::PreconditionFailed => StatusCode::PRECONDITION_FAILED,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorKind::Busy => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Failed => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::Unsupported => StatusCode::NOT_IMPLEMENTED,
            ErrorKind::Upstream => StatusCode::BAD_GATEWAY,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::NoSpace => StatusCode::INSUFFICIENT_STORAGE,
        }
    }
}

impl SandboxError {
    /// The status this error is answered with.
    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }
}

/// Marks a response that answers an internal error: the request-id middleware (`request_id` in
/// `http::router`) writes its message, naming the request so its log lines can be found. It holds
/// the error's code.
#[derive(Debug, Clone)]
pub struct InternalError(pub String);

impl IntoResponse for SandboxError {
    fn into_response(self) -> Response {
        let status = self.status();
        let retry = (self.kind == ErrorKind::Busy).then(|| self.retry_after.unwrap_or(1).max(1));
        let internal = self.hidden;
        // (inside the request's span: an internal error's log line carries its id)
        let message = self.public_message();
        let marker = internal.then(|| InternalError(self.code.clone()));
        let mut resp = (
            status,
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

impl From<axum::extract::rejection::JsonRejection> for SandboxError {
    fn from(r: axum::extract::rejection::JsonRejection) -> Self {
        let status = r.status();
        // Syntax and type errors alike are the client's malformed body: 400 (axum would say 422).
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            return Self::new(
                ErrorKind::TooLarge,
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
    type Rejection = SandboxError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(v) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Self(v))
    }
}

#[cfg(test)]
mod snapshot {
    use super::*;
    use warren_core::RuntimeError;

    /// What clients read of an error, one of each kind: status, Retry-After and body. The official
    /// SDKs parse these bodies, so a change shows up in review as a change to this snapshot.
    #[tokio::test]
    async fn error_bodies_match_their_snapshot() {
        let failure = std::io::Error::other("disk on fire at /var/lib/warren/secret");
        let errors = [
            SandboxError::not_found("sbx-1"),
            SandboxError::invalid("resourceLimits.memory: invalid memory quantity \"lots\""),
            SandboxError::conflict(ErrorCode::SandboxNotRunning, "sandbox sbx-1 is Paused"),
            {
                let mut busy =
                    SandboxError::new(ErrorKind::Busy, ErrorCode::LimitReached, "pool p is empty");
                busy.retry_after = Some(3);
                busy
            },
            SandboxError::from_runtime(
                "pausing the sandbox",
                RuntimeError::Unavailable("the daemon is down".into()),
            ),
            crate::disk_space::insufficient("no room for a sandbox".into()),
            // a failure of the server's own: its text stays in the log
            SandboxError::internal("reading the sandbox's image", &failure),
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
        let internal = SandboxError::internal("reading the sandbox's image", &failure);
        assert!(!internal.public_message().contains("on fire"));
        assert!(internal.to_string().contains("on fire"));
        let plain = SandboxError::invalid("resourceLimits.memory: too small");
        assert_eq!(plain.public_message(), plain.to_string());
        insta::with_settings!({ prepend_module_to_snapshot => false, omit_expression => true }, {
            insta::assert_snapshot!("error-bodies", text);
        });
    }
}
