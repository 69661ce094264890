//! The one error type of the image store. Messages are short and lowercase and name the image, holder or
//! path involved; the underlying cause is carried in `#[source]` and never repeated in the text.

use std::io;
use std::path::PathBuf;

/// Boxed cause for errors whose source is not an `io::Error` (JSON, tar parsing, ...).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// No image of that name (or id) in the store.
    #[error("image not found: {name}")]
    NotFound { name: String },

    /// The name is not a valid image reference, or it is reserved (`host`).
    #[error("invalid image name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },

    /// A lease holder name that cannot be used as a file name.
    #[error("invalid lease holder {holder:?}")]
    InvalidHolder { holder: String },

    /// The import source is not something we can read as an image, or it is inconsistent
    /// (missing blobs, digest mismatch, unsupported compression, ...).
    #[error("invalid image source {path}: {reason}")]
    InvalidSource {
        path: PathBuf,
        reason: String,
        #[source]
        source: Option<BoxError>,
    },

    /// Content whose sha256 is not the one its manifest or config names: corrupted in the source or
    /// in transit. Nothing of it is kept.
    #[error("{what} of {path} has digest {actual}, expected {expected}")]
    DigestMismatch {
        path: PathBuf,
        what: &'static str,
        expected: String,
        actual: String,
    },

    /// A layer entry that would write outside the layer, through a symlink, or link to a file
    /// outside the layer. The import is refused as a whole.
    #[error("unsafe entry {entry:?} in {path}: {reason}")]
    UnsafeEntry {
        path: PathBuf,
        entry: String,
        reason: &'static str,
    },

    /// The lease holder already holds a different image.
    #[error("lease holder {holder} already holds another image")]
    InUse { holder: String },

    /// The store's own metadata could not be parsed.
    #[error("corrupt image store metadata {path}")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    /// An I/O operation on the store (or on the source) failed.
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl ImageError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| ImageError::Io { op, path, source }
    }

    pub(crate) fn source(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        ImageError::InvalidSource {
            path: path.into(),
            reason: reason.into(),
            source: None,
        }
    }

    pub(crate) fn source_with(
        path: impl Into<PathBuf>,
        reason: impl Into<String>,
        cause: impl Into<BoxError>,
    ) -> Self {
        ImageError::InvalidSource {
            path: path.into(),
            reason: reason.into(),
            source: Some(cause.into()),
        }
    }
}
