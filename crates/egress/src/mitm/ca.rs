//! A sandbox's certificate authority, and the certificate it signs for the one host a terminated
//! connection named.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rustls::pki_types::PrivateKeyDer;
use rustls::sign::CertifiedKey;

/// A sandbox's certificate authority: its certificate goes into the sandbox's trust store; its key
/// never leaves the server.
pub struct SandboxCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    leaves: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl SandboxCa {
    pub fn new(sandbox_id: &str) -> Result<Self, String> {
        let mut params =
            rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!(
                "Warren credential vault CA ({})",
                &sandbox_id[..sandbox_id.len().min(8)]
            ),
        );
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
        let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
        Ok(Self {
            cert,
            key,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    pub(super) fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>, String> {
        if let Some(k) = self
            .leaves
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(host)
        {
            return Ok(k.clone());
        }
        let mut params =
            rcgen::CertificateParams::new(vec![host.to_string()]).map_err(|e| e.to_string())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, host);
        let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .map_err(|e| e.to_string())?;
        let der = PrivateKeyDer::Pkcs8(key.serialize_der().into());
        let signing =
            rustls::crypto::ring::sign::any_supported_type(&der).map_err(|e| e.to_string())?;
        let ck = Arc::new(CertifiedKey::new(
            vec![cert.der().clone(), self.cert.der().clone()],
            signing,
        ));
        self.leaves
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(host.to_string(), ck.clone());
        Ok(ck)
    }
}

pub(super) struct Fixed(pub(super) Arc<CertifiedKey>);

impl std::fmt::Debug for Fixed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fixed")
    }
}

impl rustls::server::ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}
