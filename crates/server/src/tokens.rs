//! Endpoint tokens: one per (sandbox, port), unforgeable from any other.
//!
//! Every sandbox has a random secret of its own (`SandboxRecord::token`, 24 bytes from the OS
//! generator, kept in the state journal and never handed out). The token for port P is
//! `HMAC-SHA256(secret, "warren-endpoint-v1:" P)`. Whoever holds the token of one port — a preview URL
//! given to an end user — can compute nothing from it: not the secret, not another port's token (execd's
//! 44772, the egress surface's 18080), not another sandbox's. A new sandbox has a new secret, so tokens
//! die with their sandbox. Comparisons are constant-time.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Bytes of a sandbox's secret.
pub const SECRET_BYTES: usize = 24;

/// A fresh random sandbox secret, hex-encoded (as it is stored).
pub fn new_secret() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; SECRET_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    hex::encode(bytes)
}

/// The token that opens `port` of the sandbox whose secret is `secret`.
pub fn endpoint_token(secret: &str, port: u16) -> String {
    // An HMAC takes a key of any length; `new_from_slice` cannot fail for it.
    let mut mac = <Hmac<Sha256>>::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    mac.update(b"warren-endpoint-v1:");
    mac.update(port.to_string().as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// Whether `presented` is the token of `port` (constant-time in the presented bytes).
pub fn opens(secret: &str, port: u16, presented: &[u8]) -> bool {
    bool::from(endpoint_token(secret, port).as_bytes().ct_eq(presented))
}

/// The credential the server sends the sandbox's execd over TCP (`X-EXECD-ACCESS-TOKEN`): of the
/// same secret, under a label of its own, so no endpoint token handed out computes it.
pub fn execd_credential(secret: &str) -> String {
    let mut mac = <Hmac<Sha256>>::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    mac.update(b"warren-execd-v1");
    hex::encode(mac.finalize().into_bytes())
}

/// What execd is given to check the credential by (`--access-token-sha256`): its SHA-256, which
/// the sandbox's processes may read without learning the credential.
pub fn execd_verifier(secret: &str) -> String {
    use sha2::Digest;
    hex::encode(Sha256::digest(execd_credential(secret).as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_opens_only_its_own_port_of_its_own_sandbox() {
        let (a, b) = (new_secret(), new_secret());
        assert_ne!(a, b);
        assert_eq!(a.len(), 2 * SECRET_BYTES);
        let app = endpoint_token(&a, 8000);
        assert!(opens(&a, 8000, app.as_bytes()));
        for other in [44772, 18080, 8001, 80] {
            assert!(!opens(&a, other, app.as_bytes()), "port {other}");
        }
        assert!(!opens(&b, 8000, app.as_bytes()));
        // Deterministic for a (secret, port), so the same endpoint can be asked for twice.
        assert_eq!(app, endpoint_token(&a, 8000));
        // Not the secret itself, nor a prefix of anything that could be.
        assert!(!app.contains(&a));
        assert!(!opens(&a, 8000, a.as_bytes()));
        assert!(!opens(&a, 8000, b""));
        // execd's credential is none of the endpoint tokens, and its verifier is not it.
        let execd = execd_credential(&a);
        for port in [44772, 18080, 8000] {
            assert_ne!(execd, endpoint_token(&a, port));
        }
        assert_ne!(execd, execd_credential(&b));
        assert_ne!(execd_verifier(&a), execd);
        assert_eq!(execd_verifier(&a).len(), 64);
        assert!(!opens(&a, 8000, &app.as_bytes()[..63]));
    }

    #[test]
    fn the_old_derivation_no_longer_opens_the_egress_surface() {
        // Before, the egress token was sha256("warren-egress:" + the application ports' token): a
        // holder of any application endpoint could compute it.
        use sha2::Digest;
        let secret = new_secret();
        let app = endpoint_token(&secret, 8000);
        let derived = hex::encode(Sha256::digest(format!("warren-egress:{app}").as_bytes()));
        assert!(!opens(&secret, warren_api::EGRESS_PORT, derived.as_bytes()));
        let derived_from_secret =
            hex::encode(Sha256::digest(format!("warren-egress:{secret}").as_bytes()));
        assert!(!opens(
            &secret,
            warren_api::EGRESS_PORT,
            derived_from_secret.as_bytes()
        ));
    }
}
