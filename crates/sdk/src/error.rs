//! What can go wrong talking to a server, told apart so callers can act on it: the server said no
//! (with its `{code, message}`), it could not be reached, it did not answer in time, or a stream broke.

/// The SDK's error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server (or execd) answered with an error status and, usually, a `{code, message}` body.
    #[error("{message} (HTTP {status}{})", code_suffix(code))]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    /// No connection could be made: nothing listens at `url`, or the name does not resolve.
    #[error("cannot reach {url}: {source}")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server took longer than the configured timeout.
    #[error("{url} did not answer in time")]
    Timeout { url: String },
    /// The connection dropped after the request started (mid-upload, mid-stream): the sandbox may have
    /// ended or expired meanwhile.
    #[error("the connection broke off: {0}")]
    Broken(#[source] reqwest::Error),
    /// The answer was not what the protocol says (bad JSON, a stream that ended without a result).
    #[error("unexpected answer: {0}")]
    Protocol(String),
    /// A WebSocket (terminal) failed after it was open.
    #[error("terminal connection: {0}")]
    WebSocket(String),
    /// A local file could not be read or written.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

fn code_suffix(code: &str) -> String {
    if code.is_empty() {
        String::new()
    } else {
        format!(", {code}")
    }
}

impl Error {
    /// The HTTP status of an [`Error::Api`].
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The server's error code (`SANDBOX::NOT_FOUND`, `IMAGE_NOT_FOUND`, …) of an [`Error::Api`].
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// True for a 404: the sandbox, file, command or context does not exist (or no longer does).
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }

    /// True when the request was refused for its credentials (401/403).
    pub fn is_unauthorized(&self) -> bool {
        matches!(self.status(), Some(401 | 403))
    }

    /// Classifies a transport error of a request to `url` that got no answer.
    pub(crate) fn transport(url: &str, e: reqwest::Error) -> Self {
        if e.is_connect() {
            Self::Unreachable {
                url: url.to_string(),
                source: e,
            }
        } else if e.is_timeout() {
            Self::Timeout {
                url: url.to_string(),
            }
        } else {
            Self::Broken(e)
        }
    }
}

/// The SDK's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
