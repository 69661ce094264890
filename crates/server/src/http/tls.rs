//! TLS for the API and the endpoint proxy (`[tls]`): a certificate chain and key from files, read
//! again on SIGHUP (a renewed certificate is served to the next connection; a reload that fails
//! keeps the one being served), or a development certificate Warren makes itself.
//!
//! The development certificate is signed by a CA of its own (`<data dir>/tls/ca.pem`), which is
//! what clients are told to trust: webpki and OpenSSL in strict mode refuse a self-signed leaf
//! used as its own anchor. Both are made again when the names they must cover change.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Context;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

pub use crate::config::TlsSection;

/// Where the development certificate's files are.
pub fn dev_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("tls")
}

/// The development CA clients trust (`SSL_CERT_FILE`, the SDK's `verify`, `curl --cacert`).
pub fn dev_ca_file(data_dir: &Path) -> PathBuf {
    dev_dir(data_dir).join("ca.pem")
}

/// The certificate being served, swapped whole by a reload.
pub struct Tls {
    files: (PathBuf, PathBuf),
    current: RwLock<Arc<CertifiedKey>>,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl Tls {
    /// `None` when `[tls]` asks for nothing. `names` are what a development certificate covers.
    pub fn open(
        section: &TlsSection,
        data_dir: &Path,
        names: &[String],
    ) -> anyhow::Result<Option<Arc<Self>>> {
        let files = match (&section.cert_file, &section.key_file, section.self_signed) {
            (None, None, false) => return Ok(None),
            (Some(cert), Some(key), false) => (cert.clone(), key.clone()),
            (None, None, true) => make_dev_certificate(data_dir, names)?,
            (_, _, true) => anyhow::bail!("self_signed excludes cert_file and key_file"),
            _ => anyhow::bail!("cert_file and key_file go together"),
        };
        let certified = read_certified_key(&files.0, &files.1)?;
        Ok(Some(Arc::new_cyclic(|me: &std::sync::Weak<Self>| {
            let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap_or_else(|_| unreachable!("ring supports the default versions"))
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Resolver(me.clone())));
            config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
            Self {
                files,
                current: RwLock::new(certified),
                acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            }
        })))
    }

    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        self.acceptor.clone()
    }

    /// Reads the files again; on an error the certificate being served stays.
    pub fn reload(&self) -> anyhow::Result<()> {
        let fresh = read_certified_key(&self.files.0, &self.files.1)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        Ok(())
    }

    fn current(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// rustls asks it per handshake; it holds a weak reference so that `Tls` owns the config and not
/// the other way round.
struct Resolver(std::sync::Weak<Tls>);

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolver")
    }
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.upgrade().map(|tls| tls.current())
    }
}

fn read_certified_key(cert: &Path, key: &Path) -> anyhow::Result<Arc<CertifiedKey>> {
    let chain = rustls_pemfile::certs(&mut std::io::BufReader::new(
        std::fs::File::open(cert).with_context(|| format!("opening {}", cert.display()))?,
    ))
    .collect::<Result<Vec<_>, _>>()
    .with_context(|| format!("reading {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "{} holds no certificate", cert.display());
    let der = rustls_pemfile::private_key(&mut std::io::BufReader::new(
        std::fs::File::open(key).with_context(|| format!("opening {}", key.display()))?,
    ))
    .with_context(|| format!("reading {}", key.display()))?
    .ok_or_else(|| anyhow::anyhow!("{} holds no private key", key.display()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&der)
        .map_err(|e| anyhow::anyhow!("{}: {e}", key.display()))?;
    let certified = CertifiedKey::new(chain, signing);
    // A key that does not match the certificate would fail every handshake; say so now.
    certified
        .keys_match()
        .map_err(|e| anyhow::anyhow!("{} is not {}'s key: {e}", key.display(), cert.display()))?;
    Ok(Arc::new(certified))
}

/// Makes (or keeps, when it already covers `names`) the development CA and a certificate it
/// signed; answers the certificate's and the key's files.
fn make_dev_certificate(data_dir: &Path, names: &[String]) -> anyhow::Result<(PathBuf, PathBuf)> {
    let dir = dev_dir(data_dir);
    let (cert_file, key_file, names_file) =
        (dir.join("cert.pem"), dir.join("key.pem"), dir.join("names"));
    let wanted = names.join("\n");
    let kept = std::fs::read_to_string(&names_file).ok();
    if kept.as_deref() == Some(wanted.as_str()) && cert_file.is_file() && key_file.is_file() {
        return Ok((cert_file, key_file));
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let made = (|| -> Result<(String, String, String), rcgen::Error> {
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "Warren development CA");
        ca.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = rcgen::KeyPair::generate()?;
        let ca = ca.self_signed(&ca_key)?;
        let mut leaf = rcgen::CertificateParams::new(names.to_vec())?;
        leaf.distinguished_name
            .push(rcgen::DnType::CommonName, "Warren (development)");
        leaf.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        leaf.use_authority_key_identifier_extension = true;
        let key = rcgen::KeyPair::generate()?;
        let leaf = leaf.signed_by(&key, &ca, &ca_key)?;
        Ok((
            ca.pem(),
            format!("{}{}", leaf.pem(), ca.pem()),
            key.serialize_pem(),
        ))
    })()
    .context("making the development certificate")?;
    let (ca_pem, chain_pem, key_pem) = made;
    write_private(&key_file, &key_pem)?;
    std::fs::write(&cert_file, chain_pem)
        .with_context(|| format!("writing {}", cert_file.display()))?;
    std::fs::write(dev_ca_file(data_dir), ca_pem).context("writing the development CA")?;
    std::fs::write(&names_file, wanted).context("writing the certificate's names")?;
    Ok((cert_file, key_file))
}

fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    // `mode` applies to a file it creates; one already there (looser) is narrowed too.
    f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .with_context(|| format!("narrowing {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_development_certificate_is_kept_until_its_names_change_and_reloads_swap_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        let section = TlsSection {
            self_signed: true,
            ..TlsSection::default()
        };
        let tls = Tls::open(&section, dir.path(), &names)
            .expect("tls")
            .expect("some");
        let first = std::fs::read(dir.path().join("tls/cert.pem")).expect("cert");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dir.path().join("tls/key.pem"))
                .expect("key")
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        Tls::open(&section, dir.path(), &names).expect("again");
        assert_eq!(
            first,
            std::fs::read(dir.path().join("tls/cert.pem")).expect("cert")
        );
        let more = vec!["localhost".to_string(), "warren.test".to_string()];
        Tls::open(&section, dir.path(), &more).expect("new names");
        assert_ne!(
            first,
            std::fs::read(dir.path().join("tls/cert.pem")).expect("cert")
        );
        // The first server reads its (now replaced) files again and serves the new certificate.
        let before = tls.current();
        tls.reload().expect("reload");
        assert_ne!(before.cert[0], tls.current().cert[0]);
        // A broken file is refused and the certificate being served stays.
        std::fs::write(dir.path().join("tls/key.pem"), "not a key").expect("write");
        let serving = tls.current();
        assert!(tls.reload().is_err());
        assert_eq!(serving.cert[0], tls.current().cert[0]);
    }

    #[test]
    fn half_a_configuration_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        for section in [
            TlsSection {
                cert_file: Some("/x".into()),
                ..TlsSection::default()
            },
            TlsSection {
                cert_file: Some("/x".into()),
                key_file: Some("/y".into()),
                self_signed: true,
            },
        ] {
            assert!(Tls::open(&section, dir.path(), &[]).is_err(), "{section:?}");
        }
        assert!(Tls::open(&TlsSection::default(), dir.path(), &[])
            .expect("plain")
            .is_none());
    }
}
