//! Why a pull failed, in one line that names the image and the cause, and which kind of failure it
//! is (the server maps kinds to HTTP statuses).

use std::error::Error as _;

use warren_image::ImageError;

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("invalid image name {name:?}: {reason}")]
    InvalidName { name: String, reason: String },

    #[error("image {image} not found in registry {registry}")]
    NotFound { image: String, registry: String },

    #[error("pulling {image}: registry {registry} denied access ({detail}); the repository may not exist, or it needs credentials (image.auth, or username/password under [registries.\"{registry}\"])")]
    Denied {
        image: String,
        registry: String,
        detail: String,
    },

    #[error("pulling {image}: cannot reach registry {registry}: {detail}")]
    Unreachable {
        image: String,
        registry: String,
        detail: String,
    },

    /// The registry answered, but not with what the protocol promises (5xx, bad JSON, a digest
    /// that does not match, a body cut short).
    #[error("pulling {image} from {registry}: {detail}")]
    Registry {
        image: String,
        registry: String,
        detail: String,
    },

    /// The image itself is unusable here: unsafe layer entries, unsupported formats or platforms.
    #[error("pulling {image}: {detail}")]
    Invalid { image: String, detail: String },

    /// The local store failed (disk full, permissions...).
    #[error("pulling {image}: image store: {detail}")]
    Store { image: String, detail: String },
}

/// What a failure means to a caller, independent of its wording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullErrorKind {
    /// The name is not a valid reference (400).
    BadName,
    /// No such image in the registry (404).
    NotFound,
    /// The registry refused the credentials, or wants some (403).
    Denied,
    /// The registry could not be reached, or answered badly or with corrupted content (502).
    Upstream,
    /// The image's content cannot be used (422).
    Invalid,
    /// Warren's own side failed (500).
    Internal,
}

impl PullError {
    pub fn kind(&self) -> PullErrorKind {
        match self {
            PullError::InvalidName { .. } => PullErrorKind::BadName,
            PullError::NotFound { .. } => PullErrorKind::NotFound,
            PullError::Denied { .. } => PullErrorKind::Denied,
            PullError::Unreachable { .. } | PullError::Registry { .. } => PullErrorKind::Upstream,
            PullError::Invalid { .. } => PullErrorKind::Invalid,
            PullError::Store { .. } => PullErrorKind::Internal,
        }
    }

    /// Classifies a store error met while unpacking a layer of `image` from `registry`.
    pub(crate) fn from_store(image: &str, registry: &str, e: ImageError) -> Self {
        let detail = chain(&e);
        let image = image.to_owned();
        match e {
            ImageError::DigestMismatch { .. } => PullError::Registry {
                image,
                registry: registry.to_owned(),
                detail,
            },
            ImageError::UnsafeEntry { .. } | ImageError::InvalidSource { .. } => {
                PullError::Invalid { image, detail }
            }
            ImageError::InvalidName { name, reason } => PullError::InvalidName {
                name,
                reason: reason.to_owned(),
            },
            _ => PullError::Store { image, detail },
        }
    }
}

/// Longest cause text kept in a message.
const MAX_DETAIL: usize = 400;

/// An error and its causes on one line: `a: b: c`, without repeating a cause already in the text.
/// Causes may quote bytes from the image (tar headers): control characters become `?` and the text
/// is cut, so the message stays one printable line.
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    one_line(&warren_core::error_chain(e))
}

pub(crate) fn one_line(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .take(MAX_DETAIL)
        .collect();
    if text.chars().count() > MAX_DETAIL {
        out.push('…');
    }
    out
}

/// For a reqwest error, the part a person needs (the cause chain, not the whole URL twice).
pub(crate) fn describe_http(e: &reqwest::Error) -> String {
    let mut parts = Vec::new();
    if e.is_timeout() {
        parts.push("timed out".to_owned());
    }
    let mut cur = e.source();
    while let Some(cause) = cur {
        let text = cause.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = cause.source();
    }
    if parts.is_empty() {
        parts.push(e.to_string());
    }
    parts.join(": ")
}
