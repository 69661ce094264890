//! The `{code, message}` error body shared by the lifecycle server and execd.

use serde::{Deserialize, Serialize};

/// Every non-2xx response carries this body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// Error codes Warren's lifecycle server emits. Strings follow the reference server's `AREA::NAME` form
/// where the SDKs or users may match on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    MissingApiKey,
    InvalidApiKey,
    /// The key may not do this (a read-only key's change, a tenant's key on the admin API).
    Forbidden,
    /// A tenant's quota (403, or 429 with `Retry-After` for a rate); the message names it.
    QuotaExceeded,
    InvalidParameter,
    InvalidMetadataLabel,
    InvalidMetadataFormat,
    InvalidExpiration,
    ImageNotFound,
    ImagePullDenied,
    ImagePullFailed,
    ImageInvalid,
    SnapshotNotFound,
    SnapshotInvalidSourceState,
    SnapshotInvalidState,
    PoolNotFound,
    PoolExhausted,
    SandboxNotFound,
    SandboxNotRunning,
    SandboxNotPaused,
    InvalidState,
    ApiNotSupported,
    BodyTooLarge,
    InvalidRequestBody,
    ProxyUnavailable,
    InvalidAccessToken,
    HostPathNotAllowed,
    RuntimeUnavailable,
    InsufficientStorage,
    /// The sandbox did not come up (it exited, or missed the start timeout); the message says why.
    SandboxStartFailed,
    /// The server runs or creates as many sandboxes as it is configured to (429, `Retry-After`).
    LimitReached,
    /// A diagnostics scope this server does not have (400).
    DiagnosticsScopeUnsupported,
    /// The sandbox has no credential vault, or it holds no such credential or binding (404).
    VaultNotFound,
    /// A create over an existing credential vault (409).
    VaultExists,
    /// `expectedRevision` is not the vault's revision (412).
    VaultRevisionMismatch,
    /// The sandbox's credential proxy is not running (412).
    VaultNotEnabled,
    Unknown,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MissingApiKey => "MISSING_API_KEY",
            Self::InvalidApiKey => "INVALID_API_KEY",
            Self::Forbidden => "FORBIDDEN",
            Self::QuotaExceeded => "QUOTA_EXCEEDED",
            Self::InvalidParameter => "SANDBOX::INVALID_PARAMETER",
            Self::InvalidMetadataLabel => "SANDBOX::INVALID_METADATA_LABEL",
            Self::InvalidMetadataFormat => "INVALID_METADATA_FORMAT",
            Self::InvalidExpiration => "SANDBOX::INVALID_EXPIRATION",
            Self::ImageNotFound => "SANDBOX::IMAGE_NOT_FOUND",
            Self::ImagePullDenied => "SANDBOX::IMAGE_PULL_DENIED",
            Self::ImagePullFailed => "SANDBOX::IMAGE_PULL_FAILED",
            Self::ImageInvalid => "SANDBOX::IMAGE_INVALID",
            Self::SnapshotNotFound => "SNAPSHOT::NOT_FOUND",
            Self::SnapshotInvalidSourceState => "SNAPSHOT::INVALID_SOURCE_STATE",
            Self::SnapshotInvalidState => "SNAPSHOT::INVALID_STATE",
            Self::PoolNotFound => "POOL::NOT_FOUND",
            Self::PoolExhausted => "POOL::EXHAUSTED",
            Self::SandboxNotFound => "SANDBOX::NOT_FOUND",
            Self::SandboxNotRunning => "SANDBOX::NOT_RUNNING",
            Self::SandboxNotPaused => "SANDBOX::NOT_PAUSED",
            Self::InvalidState => "SANDBOX::INVALID_STATE",
            Self::ApiNotSupported => "SANDBOX::API_NOT_SUPPORTED",
            Self::BodyTooLarge => "REQUEST::BODY_TOO_LARGE",
            Self::InvalidRequestBody => "REQUEST::INVALID_BODY",
            Self::ProxyUnavailable => "PROXY::UPSTREAM_UNAVAILABLE",
            Self::InvalidAccessToken => "PROXY::INVALID_ACCESS_TOKEN",
            Self::HostPathNotAllowed => "VOLUME::HOST_PATH_NOT_ALLOWED",
            Self::RuntimeUnavailable => "RUNTIME::UNAVAILABLE",
            Self::InsufficientStorage => "SANDBOX::INSUFFICIENT_STORAGE",
            Self::SandboxStartFailed => "SANDBOX::START_FAILED",
            Self::LimitReached => "SANDBOX::LIMIT_REACHED",
            Self::DiagnosticsScopeUnsupported => "DIAGNOSTICS_SCOPE_UNSUPPORTED",
            Self::VaultNotFound => "CREDENTIAL_VAULT::NOT_FOUND",
            Self::VaultExists => "CREDENTIAL_VAULT::ALREADY_EXISTS",
            Self::VaultRevisionMismatch => "CREDENTIAL_VAULT::REVISION_MISMATCH",
            Self::VaultNotEnabled => "CREDENTIAL_VAULT::NOT_ENABLED",
            Self::Unknown => "GENERAL::UNKNOWN_ERROR",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
