//! The keys endpoint URLs are signed with, and the route tokens they sign: a token is
//! `{id}-{port}-{expires}-{signature}`, the sandbox id as 32 hex digits (no dashes) and the expiry
//! in base 36, so that the whole token fits one DNS label (63 bytes) and also serves as a host
//! name. The signature is an HMAC-SHA256, under the server's signing key, of the id, port and
//! expiry, cut to 80 bits (16 base-32 digits): it can only be guessed online, one request at a
//! time. How a token opens its port is the HTTP layer's (`http::signed`).

use std::path::{Path, PathBuf};
use std::sync::RwLock;

use anyhow::Context;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::config::EndpointsSection;

/// Whether `b` may stand in a DNS label.
pub fn label_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-'
}

/// The signing keys, read at start and on SIGHUP.
pub struct SigningKeys {
    source: KeySource,
    keys: RwLock<Vec<Vec<u8>>>,
}

enum KeySource {
    /// `signing_keys_file`, or the data dir's.
    File(PathBuf),
    /// Replicas without a file of their own: the key the shared records give every one of them
    /// alike ([`warren_core::SharedRecords::endpoint_signing_key`]), so that a URL one signed
    /// opens on every one.
    Shared(Vec<u8>),
}

const KEY_FILE: &str = "endpoint-signing-keys";
/// Bytes of a signature kept (80 bits; 16 base-32 digits).
const SIGNATURE_BYTES: usize = 10;

impl SigningKeys {
    /// `replicas_key`: the key replicas share, if this server is one.
    pub fn open(
        section: &EndpointsSection,
        data_dir: &Path,
        replicas_key: Option<Vec<u8>>,
    ) -> anyhow::Result<Self> {
        let source = match (&section.signing_keys_file, replicas_key) {
            (Some(f), _) => KeySource::File(f.clone()),
            (None, Some(shared)) => KeySource::Shared(shared),
            (None, None) => {
                let file = data_dir.join(KEY_FILE);
                if !file.exists() {
                    let key = crate::tokens::new_secret();
                    write_new_private(&file, &format!("{key}\n"))?;
                }
                KeySource::File(file)
            }
        };
        let keys = source.read()?;
        Ok(Self {
            source,
            keys: RwLock::new(keys),
        })
    }

    /// Reads the file again; on an error the keys in use stay.
    /// `false`: there is no file to read (the replicas' shared key, held by the runtime, changes
    /// with a restart).
    pub fn reload(&self) -> anyhow::Result<bool> {
        if matches!(self.source, KeySource::Shared(_)) {
            return Ok(false);
        }
        let keys = self.source.read()?;
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = keys;
        Ok(true)
    }

    /// The route token for `port` of sandbox `id` until `expires` (Unix seconds).
    pub fn token(&self, id: &str, port: u16, expires: u64) -> Option<String> {
        let compact = compact_id(id)?;
        let exp = base36(expires);
        let keys = self.keys.read().unwrap_or_else(|e| e.into_inner());
        let sig = signature(keys.first()?, &compact, port, &exp);
        Some(format!("{compact}-{port}-{exp}-{sig}"))
    }

    /// What a route token opens, if it is one of ours and not expired: (sandbox id, port).
    pub fn verify(&self, token: &str, now: u64) -> Result<(String, u16), &'static str> {
        let mut parts = token.split('-');
        let (Some(compact), Some(port), Some(exp), Some(sig), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err("not a route token");
        };
        let id = full_id(compact).ok_or("not a route token")?;
        let port_n: u16 = port
            .parse()
            .ok()
            // Canonical only (no sign, no leading zero): one URL per (sandbox, port, expiry).
            .filter(|p: &u16| *p > 0 && p.to_string() == port)
            .ok_or("not a route token")?;
        let expires = from_base36(exp).ok_or("not a route token")?;
        let keys = self.keys.read().unwrap_or_else(|e| e.into_inner());
        // Every key is tried (no early exit), so timing does not tell which one matched.
        let mut ok = false;
        for key in keys.iter() {
            ok |= bool::from(
                signature(key, compact, port_n, exp)
                    .as_bytes()
                    .ct_eq(sig.as_bytes()),
            );
        }
        if !ok {
            return Err("this URL's signature is not valid");
        }
        if expires <= now {
            return Err("this URL has expired");
        }
        Ok((id, port_n))
    }
}

fn signature(key: &[u8], compact_id: &str, port: u16, exp: &str) -> String {
    let mut mac = <Hmac<Sha256>>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    mac.update(format!("warren-endpoint-url-v1\n{compact_id}\n{port}\n{exp}\n").as_bytes());
    base32(&mac.finalize().into_bytes()[..SIGNATURE_BYTES])
}

impl KeySource {
    fn read(&self) -> anyhow::Result<Vec<Vec<u8>>> {
        match self {
            KeySource::File(f) => read_keys(f),
            KeySource::Shared(key) => Ok(vec![key.clone()]),
        }
    }
}

fn read_keys(file: &Path) -> anyhow::Result<Vec<Vec<u8>>> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let keys: Vec<Vec<u8>> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.as_bytes().to_vec())
        .collect();
    anyhow::ensure!(!keys.is_empty(), "{} holds no key", file.display());
    if let Some(short) = keys.iter().find(|k| k.len() < 32) {
        anyhow::bail!(
            "{}: a key of {} bytes is too short to sign with (at least 32)",
            file.display(),
            short.len()
        );
    }
    Ok(keys)
}

fn write_new_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// A sandbox id (a UUID) as 32 lower-case hex digits.
fn compact_id(id: &str) -> Option<String> {
    uuid::Uuid::parse_str(id)
        .ok()
        .map(|u| u.simple().to_string())
}

fn full_id(compact: &str) -> Option<String> {
    (compact.len() == 32
        && compact
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
    .then(|| uuid::Uuid::parse_str(compact).ok())
    .flatten()
    .map(|u| u.hyphenated().to_string())
}

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

/// Lower-case base 36, as `base36` writes it (no sign, no leading zero), at most 12 digits (past
/// any expiry a URL may have).
fn from_base36(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 12 || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.bytes().try_fold(0u64, |n, b| {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'z' => b - b'a' + 10,
            _ => return None,
        };
        n.checked_mul(36)?.checked_add(u64::from(d))
    })
}

/// RFC 4648 base 32, lower case, without padding (DNS labels are case-insensitive).
fn base32(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut out = String::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for &b in bytes {
        acc = (acc << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(DIGITS[((acc >> bits) & 31) as usize]));
        }
    }
    if bits > 0 {
        out.push(char::from(DIGITS[((acc << (5 - bits)) & 31) as usize]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(lines: &str) -> (tempfile::TempDir, SigningKeys) {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("keys");
        std::fs::write(&file, lines).expect("write");
        let section = EndpointsSection {
            signing_keys_file: Some(file),
            ..EndpointsSection::default()
        };
        let keys = SigningKeys::open(&section, dir.path(), None).expect("open");
        (dir, keys)
    }

    const ID: &str = "0f6c2a3e-1b2d-4c5e-8f90-a1b2c3d4e5f6";
    const K1: &str = "k1-0123456789abcdef0123456789abcdef";
    const K2: &str = "k2-0123456789abcdef0123456789abcdef";

    #[test]
    fn a_token_opens_its_port_of_its_sandbox_until_it_expires() {
        let (_d, keys) = keys(&format!("{K1}\n"));
        let exp = 1_900_000_000;
        let token = keys.token(ID, 8080, exp).expect("token");
        assert!(token.len() <= 63, "{token} must fit a DNS label");
        assert!(token.bytes().all(label_byte), "{token}");
        assert_eq!(
            keys.verify(&token, exp - 1),
            Ok((ID.to_string(), 8080)),
            "{token}"
        );
        assert_eq!(keys.verify(&token, exp), Err("this URL has expired"));
        // Any other port, sandbox or expiry with the same signature is refused.
        let sig = token.rsplit('-').next().expect("sig");
        let other = "1f6c2a3ea1b24c5e8f90a1b2c3d4e5f6";
        for forged in [
            format!(
                "{}-8081-{}-{sig}",
                compact_id(ID).expect("a uuid"),
                base36(exp)
            ),
            format!("{other}-8080-{}-{sig}", base36(exp)),
            format!(
                "{}-8080-{}-{sig}",
                compact_id(ID).expect("a uuid"),
                base36(exp + 1)
            ),
            format!(
                "{}-08080-{}-{sig}",
                compact_id(ID).expect("a uuid"),
                base36(exp)
            ),
            token.to_uppercase(),
            format!("{token}-x"),
            token[..token.len() - 1].to_string(),
            String::new(),
        ] {
            assert!(keys.verify(&forged, 0).is_err(), "{forged}");
        }
    }

    #[test]
    fn keys_rotate_the_first_signs_all_verify_and_a_dropped_key_opens_nothing() {
        let (dir, keys) = keys(&format!("{K1}\n"));
        let old = keys.token(ID, 80, 1_900_000_000).expect("token");
        std::fs::write(dir.path().join("keys"), format!("{K2}\n{K1}\n")).expect("write");
        keys.reload().expect("reload");
        let new = keys.token(ID, 80, 1_900_000_000).expect("token");
        assert_ne!(old, new);
        assert!(keys.verify(&old, 0).is_ok() && keys.verify(&new, 0).is_ok());
        std::fs::write(dir.path().join("keys"), format!("{K2}\n")).expect("write");
        keys.reload().expect("reload");
        assert!(keys.verify(&old, 0).is_err());
        assert!(keys.verify(&new, 0).is_ok());
        // A file that would leave no usable key is refused and the keys in use stay.
        std::fs::write(dir.path().join("keys"), "short\n").expect("write");
        assert!(keys.reload().is_err());
        assert!(keys.verify(&new, 0).is_ok());
    }

    #[test]
    fn a_missing_default_key_file_is_made_private_and_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let section = EndpointsSection::default();
        let a = SigningKeys::open(&section, dir.path(), None).expect("open");
        let file = dir.path().join(KEY_FILE);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&file).expect("file").permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        let b = SigningKeys::open(&section, dir.path(), None).expect("again");
        assert_eq!(a.token(ID, 1, 5), b.token(ID, 1, 5));
        // A named file that is missing is an error, never a fresh key.
        let named = EndpointsSection {
            signing_keys_file: Some(dir.path().join("nope")),
            ..EndpointsSection::default()
        };
        assert!(SigningKeys::open(&named, dir.path(), None).is_err());
        // Replicas without a file: every one signs with the key their shared records give
        // alike (its derivation is the Kubernetes runtime's, tested there).
        let shared = b"f6cae3fa8ac392b068c28b824710359dafb7a9218a6e4677cd316da92b14fac2".to_vec();
        let (r1, r2) = (
            tempfile::tempdir().expect("r1"),
            tempfile::tempdir().expect("r2"),
        );
        let one = SigningKeys::open(&section, r1.path(), Some(shared.clone())).expect("one");
        let two = SigningKeys::open(&section, r2.path(), Some(shared)).expect("two");
        let token = one.token(ID, 8080, 1_900_000_000).expect("token");
        assert!(two.verify(&token, 0).is_ok());
        assert!(a.verify(&token, 0).is_err());
        assert!(!r1.path().join(KEY_FILE).exists());
    }

    #[test]
    fn encodings_round_trip() {
        for n in [0, 1, 35, 36, 1_900_000_000, u64::from(u32::MAX)] {
            assert_eq!(from_base36(&base36(n)), Some(n));
        }
        assert_eq!(from_base36("00"), None);
        assert_eq!(from_base36("A"), None);
        assert_eq!(base32(b"foobar"), "mzxw6ytboi");
        assert_eq!(
            full_id(&compact_id(ID).expect("a uuid")).as_deref(),
            Some(ID)
        );
        assert_eq!(full_id("0F6C2A3E1B2D4C5E8F90A1B2C3D4E5F6"), None);
    }
}
