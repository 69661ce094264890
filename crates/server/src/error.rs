//! The one error of the registry, pools, snapshots, templates, network and the routes: a kind in
//! the domain's terms, the wire code clients match on, and a message. Its HTTP status is chosen
//! once, at the edge (`http::error`). Internal errors are logged in full and answered with a
//! generic message.

use warren_api::ErrorCode;
use warren_core::RuntimeError;

/// What went wrong, in the domain's terms; `http::error` maps each kind to its one status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed or out of bounds (400).
    Invalid,
    /// No credentials, or credentials that name no key (401).
    Unauthenticated,
    /// The caller may not do this: another tenant's, a policy's refusal, a denied pull (403).
    Forbidden,
    /// It does not exist, or the caller may not know it does (404).
    NotFound,
    /// Not a method this resource answers (405).
    MethodNotAllowed,
    /// The thing's state forbids it now: paused, exists already, a revision moved on (409).
    Conflict,
    /// A condition the caller set does not hold (412).
    PreconditionFailed,
    /// The body is over its limit (413).
    TooLarge,
    /// Well-formed, but nothing can be made of it: an image without a usable config (422).
    Unprocessable,
    /// A limit is reached for now: a quota, an empty pool, too many at once; retry later (429).
    Busy,
    /// A failure (500): the caller's sandbox could not start (its image failed), with its text
    /// shown; or, with `hidden`, a failure of the server's own, whose text stays in the log.
    Failed,
    /// Not something this runtime or build does (501).
    Unsupported,
    /// A registry or another upstream answered badly (502).
    Upstream,
    /// The runtime or another dependency is down for now (503).
    Unavailable,
    /// The host is out of disk for it (507).
    NoSpace,
}

#[derive(Debug)]
pub struct SandboxError {
    pub kind: ErrorKind,
    pub code: String,
    /// What the client reads, unless `hidden`. Private: a caller that passes an error on to a
    /// client (another surface, a record others read) takes [`SandboxError::public_message`], so an
    /// internal error's text cannot leave by a path that forgot to check.
    message: String,
    /// A failure of the server's own (`internal`): the message goes to the log, not the client.
    pub hidden: bool,
    /// With a 429: how many seconds to wait (`Retry-After`; 1 when not given).
    pub retry_after: Option<u64>,
}

impl std::fmt::Display for SandboxError {
    /// The whole message, for the server's own log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl SandboxError {
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

    pub fn new(kind: ErrorKind, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            kind,
            code: code.as_str().to_string(),
            message: message.into(),
            hidden: false,
            retry_after: None,
        }
    }

    pub fn bad_request(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid, code, message)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::bad_request(ErrorCode::InvalidParameter, message)
    }

    pub fn not_found(id: &str) -> Self {
        Self::new(
            ErrorKind::NotFound,
            ErrorCode::SandboxNotFound,
            format!("sandbox {id} not found"),
        )
    }

    pub fn conflict(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, code, message)
    }

    /// A failure of the server's own: the whole cause chain goes to the server's log (see
    /// `into_response`), the client gets "internal error" and the request's id.
    pub fn internal(context: &str, err: &(dyn std::error::Error + 'static)) -> Self {
        let chain = warren_core::error_chain(err);
        Self {
            hidden: true,
            ..Self::new(
                ErrorKind::Failed,
                ErrorCode::Unknown,
                format!("{context}: {chain}"),
            )
        }
    }

    pub fn from_runtime(context: &str, err: RuntimeError) -> Self {
        match err {
            RuntimeError::NotFound(m) => {
                Self::new(ErrorKind::NotFound, ErrorCode::SandboxNotFound, m)
            }
            RuntimeError::Conflict(m) => Self::conflict(ErrorCode::InvalidState, m),
            RuntimeError::Unsupported(m) => {
                Self::new(ErrorKind::Unsupported, ErrorCode::ApiNotSupported, m)
            }
            RuntimeError::Exhausted(m) => Self::new(ErrorKind::Busy, ErrorCode::Unknown, m),
            RuntimeError::Invalid(m) => Self::invalid(m),
            RuntimeError::ImageNotFound(m) => {
                Self::new(ErrorKind::NotFound, ErrorCode::ImageNotFound, m)
            }
            RuntimeError::StartFailed(m) => {
                Self::new(ErrorKind::Failed, ErrorCode::SandboxStartFailed, m)
            }
            RuntimeError::Unavailable(m) => Self::new(
                ErrorKind::Unavailable,
                ErrorCode::RuntimeUnavailable,
                format!("{context}: {m}"),
            ),
            e @ RuntimeError::Backend { .. } => Self::internal(context, &e),
        }
    }
}

/// What a client is told of an internal error: paths, errnos and the rest of the cause chain stay
/// in the server's log, under the request's id.
pub fn internal_message(request_id: &str) -> String {
    format!("internal error (request id {request_id}); the server's log has the cause")
}
