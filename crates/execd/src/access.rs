//! execd's credential, for the transports anyone on a network may reach (TCP: a pod network, a
//! Docker host's published port, a loopback port). Started with `--access-token-sha256 HEX`, execd
//! answers only requests whose `X-EXECD-ACCESS-TOKEN` header hashes to that value, on every
//! listener; without it (a Unix socket only the host's root can connect to) it checks nothing.
//!
//! execd holds the credential's SHA-256, never the credential: its command line and environment
//! are readable by the sandbox's own processes (`/proc/1/cmdline`), and a verifier they read opens
//! nothing. The credential travels only from the server to execd, and execd's port proxy drops
//! the header before it forwards a request to a program in the sandbox.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use warren_api::EXECD_TOKEN_HEADER;

use crate::error::{code, ApiError};

/// The SHA-256 of the credential execd accepts.
#[derive(Clone)]
pub struct Verifier([u8; 32]);

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Verifier(…)")
    }
}

impl Verifier {
    /// From 64 hex digits.
    pub fn from_hex(hex_digest: &str) -> Result<Self, String> {
        let bytes = hex::decode(hex_digest.trim())
            .map_err(|e| format!("--access-token-sha256 is not hex: {e}"))?;
        let digest: [u8; 32] = bytes
            .try_into()
            .map_err(|_| "--access-token-sha256 is not 32 bytes (64 hex digits)".to_string())?;
        Ok(Self(digest))
    }

    /// Whether `presented` is the credential: its digest compared in constant time (a digest of
    /// the presented bytes, so timing tells nothing about the credential itself).
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let digest = Sha256::digest(presented);
        digest
            .iter()
            .zip(self.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// The middleware: 401 `{code, message}` for a request without the credential.
pub async fn check(State(verifier): State<Arc<Verifier>>, req: Request, next: Next) -> Response {
    let ok = req
        .headers()
        .get(EXECD_TOKEN_HEADER)
        .is_some_and(|v| verifier.accepts(v.as_bytes()));
    if !ok {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            code::UNAUTHORIZED,
            format!("missing or wrong {EXECD_TOKEN_HEADER}"),
        )
        .into_response();
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a runtime passes as `--access-token-sha256` for `credential` (the server computes it
    /// in `tokens::execd_verifier`).
    fn verifier_hex(credential: &str) -> String {
        hex::encode(Sha256::digest(credential.as_bytes()))
    }

    #[test]
    fn only_the_credential_is_accepted_never_its_verifier() {
        let verifier = Verifier::from_hex(&verifier_hex("s3cret")).expect("hex");
        assert!(verifier.accepts(b"s3cret"));
        for wrong in [&b""[..], b"s3cre", b"s3cret ", b"S3CRET"] {
            assert!(!verifier.accepts(wrong), "{wrong:?}");
        }
        // What the sandbox can read (the verifier itself) opens nothing.
        assert!(!verifier.accepts(verifier_hex("s3cret").as_bytes()));
        assert!(Verifier::from_hex("abc").is_err());
        assert!(Verifier::from_hex(&"0".repeat(62)).is_err());
        assert!(Verifier::from_hex(&"g".repeat(64)).is_err());
        assert_eq!(format!("{verifier:?}"), "Verifier(…)");
    }
}
