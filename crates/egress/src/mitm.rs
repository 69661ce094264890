//! The credential vault's interception: traffic from a sandbox with a vault to ports 443 and 80 is
//! redirected here by the firewall. HTTPS is read up to the TLS ClientHello. When a binding of the
//! sandbox's vault could apply to that host, the connection is terminated with a certificate from the
//! sandbox's own CA (installed in the sandbox's trust store), each request gets the headers of the
//! one binding that matches it (none when zero or several match), it goes on to the real server over
//! verified TLS, and the answer comes back with any secret value redacted. Plain HTTP, when a
//! binding takes `http` on that port, is served request by request the same way, the host taken
//! from the `Host` header — and believed only when an allowed DNS answer for that host led the
//! sandbox to this address, since nothing else proves where a plain request goes. Every other
//! connection is tunnelled untouched. Policy is enforced here too: the redirect bypasses the
//! firewall's checks.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::vault::{Redactor, Vault};

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

    fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>, String> {
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

/// What the proxy needs to know about a connection's sandbox.
pub struct Decision {
    pub vault: Option<Vault>,
    pub ca: Option<Arc<SandboxCa>>,
    /// The firewall's answer for the destination as it stands: a plain request to one it does not
    /// allow (yet) may still prove its `Host` (see [`Lookup::resolve`]).
    pub allowed: bool,
}

/// Asked per connection: may `src` reach `dst` (address and TCP port) at all, and with which
/// vault; and per request, the vault as it is now (`None` once `dst` is no longer allowed).
pub trait Lookup: Send + Sync + 'static {
    fn decide(&self, src: Ipv4Addr, dst: SocketAddrV4) -> Option<Decision>;
    fn vault(&self, src: Ipv4Addr, dst: SocketAddrV4) -> Option<Vault>;
    /// Whether an allowed DNS answer to `src` for `name` held `dst`'s address (and `src` may reach
    /// `dst`).
    fn answered(&self, src: Ipv4Addr, dst: SocketAddrV4, name: &str) -> bool;
    /// For a sandbox that reached `dst` without asking for `name` (`curl --resolve`, /etc/hosts):
    /// whether Warren's own resolver, asked now, puts `dst`'s address among `name`'s, with the
    /// policy allowing `name` — which then counts as answered.
    fn resolve(
        &self,
        src: Ipv4Addr,
        dst: SocketAddrV4,
        name: &str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>>;
}

/// How long a sandbox may take to send its ClientHello, and the proxy to reach a server.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The original destination of a redirected connection (`SO_ORIGINAL_DST`).
fn original_dst(stream: &TcpStream) -> std::io::Result<SocketAddrV4> {
    // SAFETY: all-zero is a valid `sockaddr_in`.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `addr`, which lives for the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}

/// The server name of a TLS ClientHello record, if it has one.
pub fn sni(record: &[u8]) -> Option<String> {
    let body = record.get(5..)?;
    if record.first()? != &0x16 || body.first()? != &0x01 {
        return None;
    }
    let mut p = 4 + 2 + 32; // handshake header, version, random
    let sid = *body.get(p)? as usize;
    p += 1 + sid;
    let suites = u16::from_be_bytes([*body.get(p)?, *body.get(p + 1)?]) as usize;
    p += 2 + suites;
    let comp = *body.get(p)? as usize;
    p += 1 + comp;
    let ext_len = u16::from_be_bytes([*body.get(p)?, *body.get(p + 1)?]) as usize;
    p += 2;
    let end = (p + ext_len).min(body.len());
    while p + 4 <= end {
        let ty = u16::from_be_bytes([body[p], body[p + 1]]);
        let len = u16::from_be_bytes([body[p + 2], body[p + 3]]) as usize;
        let data = body.get(p + 4..p + 4 + len)?;
        if ty == 0 && data.len() >= 5 && data[2] == 0 {
            let n = u16::from_be_bytes([data[3], data[4]]) as usize;
            return std::str::from_utf8(data.get(5..5 + n)?)
                .ok()
                .map(|s| s.to_ascii_lowercase());
        }
        p += 4 + len;
    }
    None
}

/// A stream that first yields bytes already read from it.
struct Prefixed<S> {
    prefix: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = (self.prefix.len() - self.pos).min(buf.remaining());
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        b: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, b)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

pub struct Mitm {
    lookup: Arc<dyn Lookup>,
    upstream_tls: Arc<rustls::ClientConfig>,
}

/// Trust for the real servers: the public web roots plus any extra CA files configured.
pub fn upstream_config(
    extra_ca_files: &[std::path::PathBuf],
) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    for f in extra_ca_files {
        let pem = std::fs::read(f).map_err(|e| format!("reading {}: {e}", f.display()))?;
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            let cert: CertificateDer<'static> =
                cert.map_err(|e| format!("{}: {e}", f.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("{}: {e}", f.display()))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

impl Mitm {
    pub fn new(lookup: Arc<dyn Lookup>, upstream_tls: rustls::ClientConfig) -> Self {
        Self {
            lookup,
            upstream_tls: Arc::new(upstream_tls),
        }
    }

    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            let Ok((stream, peer)) = listener.accept().await else {
                continue;
            };
            let this = self.clone();
            tokio::spawn(async move {
                if let Err(e) = this.handle(stream, peer).await {
                    tracing::debug!(%peer, error = %e, "vault proxy connection");
                }
            });
        }
    }

    async fn handle(
        self: Arc<Self>,
        mut client: TcpStream,
        peer: SocketAddr,
    ) -> Result<(), String> {
        let _ = client.set_nodelay(true);
        let dst = original_dst(&client).map_err(|e| format!("original destination: {e}"))?;
        let SocketAddr::V4(src) = peer else {
            return Err("not IPv4".into());
        };
        let decision = self
            .lookup
            .decide(*src.ip(), dst)
            .ok_or_else(|| format!("{} may not reach {dst}", src.ip()))?;
        // A TLS record header, or the start of a plain HTTP request line.
        let mut hello = vec![0u8; 5];
        tokio::time::timeout(HANDSHAKE_TIMEOUT, client.read_exact(&mut hello))
            .await
            .map_err(|_| "nothing sent in time".to_string())?
            .map_err(|e| e.to_string())?;
        if hello[0] != 0x16 {
            let plain = decision
                .vault
                .as_ref()
                .is_some_and(|v| v.takes_scheme_on("http", dst.port()));
            let client = Prefixed {
                prefix: hello,
                pos: 0,
                inner: client,
            };
            // A destination the policy does not allow (yet) is served only where a binding may
            // prove it, request by request; nothing is ever sent on to it unproven.
            return match (plain, decision.allowed) {
                (true, _) => {
                    let bound = decision.vault.map(Arc::new);
                    serve_plain(self.lookup.clone(), *src.ip(), client, dst, bound).await
                }
                (false, true) => tunnel(client, dst).await,
                (false, false) => Err(format!("{} may not reach {dst}", src.ip())),
            };
        }
        if !decision.allowed {
            return Err(format!("{} may not reach {dst}", src.ip()));
        }
        // The ClientHello: one TLS record (enough for any SNI).
        let len = u16::from_be_bytes([hello[3], hello[4]]) as usize;
        hello.resize(5 + len.min(16 * 1024 + 256), 0);
        tokio::time::timeout(HANDSHAKE_TIMEOUT, client.read_exact(&mut hello[5..]))
            .await
            .map_err(|_| "no ClientHello in time".to_string())?
            .map_err(|e| e.to_string())?;
        let host = sni(&hello);
        let interception = match (&host, &decision.vault, &decision.ca) {
            (Some(h), Some(v), Some(ca)) if v.wants("https", h, dst.port()) => {
                Some((h.clone(), v.clone(), ca.clone()))
            }
            _ => None,
        };
        let client = Prefixed {
            prefix: hello,
            pos: 0,
            inner: client,
        };
        match interception {
            None => tunnel(client, dst).await,
            Some((host, _, ca)) => {
                let lookup = self.lookup.clone();
                intercept(
                    self.upstream_tls.clone(),
                    lookup,
                    *src.ip(),
                    client,
                    dst,
                    host,
                    ca,
                )
                .await
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn intercept(
    upstream_tls: Arc<rustls::ClientConfig>,
    lookup: Arc<dyn Lookup>,
    src: Ipv4Addr,
    client: Prefixed<TcpStream>,
    dst: SocketAddrV4,
    host: String,
    ca: Arc<SandboxCa>,
) -> Result<(), String> {
    let leaf = ca.leaf(&host)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(Fixed(leaf)));
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tls = tokio_rustls::TlsAcceptor::from(Arc::new(cfg))
        .accept(client)
        .await
        .map_err(|e| format!("TLS with the sandbox: {e}"))?;
    let upstream = Arc::new(tokio::sync::Mutex::new(
        None::<hyper::client::conn::http1::SendRequest<RedactBody>>,
    ));
    let tls_cfg = upstream_tls;
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let (upstream, tls_cfg, host) = (upstream.clone(), tls_cfg.clone(), host.clone());
        // The vault as it is now: a revoked credential or a narrowed policy applies to kept
        // connections from their next request.
        let vault = lookup.vault(src, dst).map(Arc::new);
        forward(req, vault, upstream, Target::Tls(tls_cfg, host), dst)
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
        .await
        .map_err(|e| e.to_string())
}

/// Plain HTTP from a sandbox whose vault takes `http` on this port: each request is forwarded to
/// the address the sandbox dialled, with credentials only where its `Host` is proven (see
/// [`Lookup::answered`]). A request with more than one `Host` is refused: the upstream might route
/// by the other one.
async fn serve_plain(
    lookup: Arc<dyn Lookup>,
    src: Ipv4Addr,
    client: Prefixed<TcpStream>,
    dst: SocketAddrV4,
    bound: Option<Arc<Vault>>,
) -> Result<(), String> {
    let upstream = Arc::new(tokio::sync::Mutex::new(
        None::<hyper::client::conn::http1::SendRequest<RedactBody>>,
    ));
    let sent_secret = Arc::new(AtomicBool::new(false));
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let (lookup, upstream, sent_secret) =
            (lookup.clone(), upstream.clone(), sent_secret.clone());
        // Whether a binding wants a host: the sandbox's vault as it was when the connection came,
        // reachable or not; what is injected is the vault as it is now, for a reachable
        // destination (`Lookup::vault`), looked up once the host is proven.
        let mut vault = lookup.vault(src, dst).map(Arc::new);
        let bound = vault.clone().or_else(|| bound.clone());
        async move {
            // (one future type for every outcome: `forward` answers a refusal itself)
            let target = match plain_host(&req) {
                Err(why) => Target::Refused(why),
                Ok(host) => {
                    let mut proven = host
                        .as_deref()
                        .is_some_and(|h| lookup.answered(src, dst, h));
                    let wanted = host
                        .as_deref()
                        .zip(bound.as_deref())
                        .is_some_and(|(h, v)| v.wants("http", h, dst.port()));
                    if !proven && wanted {
                        // No answer of ours led here: Warren asks its own resolver, whose answer
                        // may make the destination reachable (so the vault as it is now).
                        proven = lookup
                            .resolve(src, dst, host.as_deref().unwrap_or_default())
                            .await;
                        vault = lookup.vault(src, dst).map(Arc::new);
                    }
                    if !proven && wanted {
                        Target::Misdirected(format!(
                            "the credential vault binds {:?}, but {} is not among the addresses Warren's resolver gives for it (or the policy does not allow the name): no credential is sent where the Host header cannot be proven",
                            host.unwrap_or_default(),
                            dst.ip()
                        ))
                    } else {
                        Target::Plain {
                            proven,
                            host: host.unwrap_or_default(),
                            sent_secret,
                        }
                    }
                }
            };
            // An error is answered, never a connection closed with no answer.
            Ok::<_, std::convert::Infallible>(
                match forward(req, vault, upstream, target, dst).await {
                    Ok(resp) => resp,
                    Err(e) => refused(
                        hyper::StatusCode::BAD_GATEWAY,
                        format!("the request could not be sent on: {e}"),
                    ),
                },
            )
        }
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(hyper_util::rt::TokioIo::new(client), service)
        .await
        .map_err(|e| e.to_string())
}

/// The DNS name a plain request's `Host` gives (lower case, without its port); `None` when there is
/// none fit to prove (absent, an address, not a name), an error when the request is ambiguous.
fn plain_host<B>(req: &hyper::Request<B>) -> Result<Option<String>, &'static str> {
    let mut hosts = req.headers().get_all(hyper::header::HOST).iter();
    let (Some(first), None) = (hosts.next(), hosts.next()) else {
        return match req.headers().contains_key(hyper::header::HOST) {
            true => Err("more than one Host header"),
            false => Ok(None),
        };
    };
    let Ok(value) = first.to_str() else {
        return Ok(None);
    };
    let name = host_of(value.trim());
    if let Some(authority) = req.uri().authority() {
        // absolute-form: its authority must name the same host
        if !authority.host().eq_ignore_ascii_case(name) {
            return Err("the request target and Host name different hosts");
        }
    }
    let port_ok = value.trim()[name.len()..]
        .strip_prefix(':')
        .is_none_or(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    let is_name = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && name.parse::<Ipv4Addr>().is_err();
    Ok((port_ok && is_name).then(|| name.trim_end_matches('.').to_ascii_lowercase()))
}

/// A 400 answered by the proxy itself.
fn refusal(why: &'static str) -> hyper::Response<ResponseBody> {
    refused(hyper::StatusCode::BAD_REQUEST, why.to_string())
}

/// A 421 answered by the proxy itself, with a `{code, message}` body.
fn misdirected(why: &str) -> hyper::Response<ResponseBody> {
    json_refusal(
        hyper::StatusCode::MISDIRECTED_REQUEST,
        "EGRESS::HOST_NOT_PROVEN",
        why,
    )
}

/// An answer of the proxy's own with a `{code, message}` body.
fn json_refusal(status: hyper::StatusCode, code: &str, why: &str) -> hyper::Response<ResponseBody> {
    let text = serde_json::json!({"code": code, "message": why}).to_string();
    let mut resp = answered(status, text);
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// An answer of the proxy's own, in plain text.
fn refused(status: hyper::StatusCode, why: String) -> hyper::Response<ResponseBody> {
    answered(status, format!("warren egress: {why}\n"))
}

fn answered(status: hyper::StatusCode, text: String) -> hyper::Response<ResponseBody> {
    let frame: Result<Frame<Bytes>, BoxError> = Ok(Frame::data(Bytes::from(text)));
    let body = futures::stream::iter([frame]).boxed();
    let mut resp = hyper::Response::new(StreamBody::new(body));
    *resp.status_mut() = status;
    resp
}

/// The host of a `Host` header value, without its port.
fn host_of(header: &str) -> &str {
    if header.starts_with('[') {
        return header.find(']').map_or(header, |end| &header[..=end]);
    }
    header.split_once(':').map_or(header, |(h, _)| h)
}

/// Where a request goes on: over TLS to the host the sandbox's ClientHello named, or plain to the
/// address it dialled (`proven`: its `Host` is the name an answer gave for that address;
/// `sent_secret`: a credential went up this client connection, so its answers are redacted).
enum Target {
    Tls(Arc<rustls::ClientConfig>, String),
    Plain {
        host: String,
        proven: bool,
        sent_secret: Arc<AtomicBool>,
    },
    /// Nowhere: the request is answered 400 by the proxy itself, for this reason.
    Refused(&'static str),
    /// Nowhere: a binding wants the request's host, which cannot be proven for the address the
    /// sandbox dialled; answered 421 with a JSON `{code, message}` saying so.
    Misdirected(String),
}

struct Fixed(Arc<CertifiedKey>);

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

async fn tunnel(mut client: Prefixed<TcpStream>, dst: SocketAddrV4) -> Result<(), String> {
    let mut upstream = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(dst))
        .await
        .map_err(|_| format!("connecting {dst}: timed out"))?
        .map_err(|e| format!("connecting {dst}: {e}"))?;
    let _ = upstream.set_nodelay(true);
    tokio::io::copy_bidirectional(&mut client, &mut upstream)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

type RedactBody = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

/// An HTTP/1.1 client connection to the server over `io`, driven by a task of its own.
async fn handshake<T>(
    io: T,
) -> Result<hyper::client::conn::http1::SendRequest<RedactBody>, BoxError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
        .await
        .map_err(boxed)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}
type BoxError = Box<dyn std::error::Error + Send + Sync>;

type Upstream =
    Arc<tokio::sync::Mutex<Option<hyper::client::conn::http1::SendRequest<RedactBody>>>>;
type ResponseBody = StreamBody<futures::stream::BoxStream<'static, Result<Frame<Bytes>, BoxError>>>;

fn boxed(e: impl std::error::Error + Send + Sync + 'static) -> BoxError {
    Box::new(e)
}

/// The largest body the vault rewrites for a substitution: a larger one is refused (413), never
/// sent on with the placeholder in place of what the binding promised.
const SUBSTITUTED_BODY_MAX: usize = 1 << 20;

/// Replaces `placeholder` by `secret` in the request's headers (but `Host`) and in its path or
/// query, as `places` says; in the path and the query the secret goes percent-encoded, so that a
/// `/`, `&` or `=` in it cannot change the request's shape.
fn substitute_head(
    headers: &mut hyper::HeaderMap,
    path: &mut String,
    placeholder: &str,
    secret: &str,
    places: &[crate::vault::Place],
) -> Result<(), BoxError> {
    use crate::vault::Place;
    if places.contains(&Place::Header) {
        let names: Vec<hyper::header::HeaderName> = headers
            .iter()
            .filter(|(n, v)| {
                *n != hyper::header::HOST
                    && v.as_bytes()
                        .windows(placeholder.len())
                        .any(|w| w == placeholder.as_bytes())
            })
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let values: Vec<String> = headers
                .get_all(&name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).replace(placeholder, secret))
                .collect();
            headers.remove(&name);
            for v in values {
                headers.append(name.clone(), hyper::header::HeaderValue::from_str(&v)?);
            }
        }
    }
    // RFC 3986's unreserved characters stay as they are; everything else is encoded.
    const ENCODED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    let encoded = percent_encoding::utf8_percent_encode(secret, ENCODED).to_string();
    let (p, q) = match path.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (path.clone(), None),
    };
    let p = if places.contains(&Place::Path) {
        p.replace(placeholder, &encoded)
    } else {
        p
    };
    let q = match q {
        Some(q) if places.contains(&Place::Query) => Some(q.replace(placeholder, &encoded)),
        other => other,
    };
    *path = match q {
        Some(q) => format!("{p}?{q}"),
        None => p,
    };
    Ok(())
}

/// The request body with `placeholder` replaced by `secret`, read whole (up to
/// [`SUBSTITUTED_BODY_MAX`]) and sent with its new length; `Err` says why it cannot be.
async fn substitute_body(
    headers: &mut hyper::HeaderMap,
    body: http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>,
    placeholder: &str,
    secret: &str,
) -> Result<http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>, String> {
    if headers
        .get(hyper::header::CONTENT_ENCODING)
        .is_some_and(|e| e.as_bytes() != b"identity")
    {
        return Err("the credential vault cannot substitute into a compressed request body".into());
    }
    let bytes = http_body_util::Limited::new(body, SUBSTITUTED_BODY_MAX)
        .collect()
        .await
        .map_err(|_| {
            format!(
                "a request body the credential vault substitutes into is at most {} bytes",
                SUBSTITUTED_BODY_MAX
            )
        })?
        .to_bytes();
    let replaced = replace_bytes(&bytes, placeholder.as_bytes(), secret.as_bytes());
    headers.remove(hyper::header::TRANSFER_ENCODING);
    headers.insert(hyper::header::CONTENT_LENGTH, replaced.len().into());
    Ok(http_body_util::Full::new(bytes::Bytes::from(replaced))
        .map_err(|never| match never {})
        .boxed())
}

fn replace_bytes(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut i = 0;
    while i < haystack.len() {
        if haystack[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(haystack[i]);
            i += 1;
        }
    }
    out
}

async fn forward(
    req: hyper::Request<Incoming>,
    vault: Option<Arc<Vault>>,
    upstream: Upstream,
    target: Target,
    dst: SocketAddrV4,
) -> Result<hyper::Response<ResponseBody>, BoxError> {
    // Answered by the proxy itself, whatever the destination.
    match &target {
        Target::Refused(why) => return Ok(refusal(why)),
        Target::Misdirected(why) => return Ok(misdirected(why)),
        _ => {}
    }
    let Some(vault) = vault else {
        return Err(boxed(std::io::Error::other(
            "the destination is no longer allowed",
        )));
    };
    let (mut parts, body) = req.into_parts();
    let mut path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    // Whether the vault takes this request at all: a plain request it does not take (another
    // host, or one whose Host is not proven) goes on as the sandbox wrote it.
    let (scheme, host, taken) = match &target {
        Target::Tls(_, host) => ("https", host.clone(), true),
        Target::Plain { host, proven, .. } => (
            "http",
            host.clone(),
            *proven && vault.wants("http", host, dst.port()),
        ),
        // (answered above; kept so that no arm can panic)
        Target::Refused(why) => return Ok(refusal(why)),
        Target::Misdirected(why) => return Ok(misdirected(why)),
    };
    if taken {
        // The request goes to the host the TLS session named or the answer proved, whatever Host
        // the client wrote (no fronting a credential to another origin behind the same address).
        let default_port = if scheme == "https" { 443 } else { 80 };
        let authority = if dst.port() == default_port {
            host.clone()
        } else {
            format!("{host}:{}", dst.port())
        };
        let authority = hyper::header::HeaderValue::from_str(&authority)?;
        parts.headers.insert(hyper::header::HOST, authority);
    }
    for hop in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    ] {
        parts.headers.remove(hop);
    }
    if taken {
        if let Some(why) =
            vault.refused_path(scheme, &host, dst.port(), parts.method.as_str(), &path)
        {
            return Ok(json_refusal(
                hyper::StatusCode::FORBIDDEN,
                "EGRESS::AMBIGUOUS_PATH",
                &why,
            ));
        }
    }
    let injections = match taken {
        true => vault.injections(scheme, &host, dst.port(), parts.method.as_str(), &path),
        false => None,
    };
    if injections.is_some() {
        // A secret echoed in pieces by ranged answers could not be redacted.
        parts.headers.remove(hyper::header::RANGE);
        parts.headers.remove(hyper::header::IF_RANGE);
    }
    let mut body = body.boxed();
    if let Some(injection) = injections {
        for (k, v) in injection.headers {
            let name = hyper::header::HeaderName::from_bytes(k.as_bytes())?;
            parts
                .headers
                .insert(name, hyper::header::HeaderValue::from_str(&v)?);
        }
        for (placeholder, secret, places) in &injection.substitutions {
            substitute_head(&mut parts.headers, &mut path, placeholder, secret, places)?;
            if places.contains(&crate::vault::Place::Body) {
                body = match substitute_body(&mut parts.headers, body, placeholder, secret).await {
                    Ok(b) => b,
                    Err(why) => return Ok(refused(hyper::StatusCode::PAYLOAD_TOO_LARGE, why)),
                };
            }
        }
        if let Target::Plain { sent_secret, .. } = &target {
            sent_secret.store(true, Ordering::Relaxed);
        }
        tracing::debug!(%host, %path, "vault: credential injected");
    }
    // Answers to be scanned for secrets: every intercepted TLS answer, and on plain HTTP every
    // answer once a credential went up this connection (a server may echo it later).
    let scan = match &target {
        Target::Plain { sent_secret, .. } => sent_secret.load(Ordering::Relaxed),
        _ => true,
    };
    if scan || taken {
        // Compressed answers could not be redacted.
        parts.headers.remove(hyper::header::ACCEPT_ENCODING);
    }
    parts.uri = path.parse().map_err(boxed)?;
    let req = hyper::Request::from_parts(parts, body);
    let mut guard = upstream.lock().await;
    if guard.as_ref().is_none_or(|s| s.is_closed()) {
        let tcp = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(dst))
            .await
            .map_err(boxed)?
            .map_err(boxed)?;
        let _ = tcp.set_nodelay(true);
        let send = match target {
            Target::Tls(tls_cfg, host) => {
                let name = ServerName::try_from(host).map_err(boxed)?;
                let tls = tokio_rustls::TlsConnector::from(tls_cfg)
                    .connect(name, tcp)
                    .await?;
                handshake(tls).await?
            }
            _ => handshake(tcp).await?,
        };
        *guard = Some(send);
    }
    let send = guard
        .as_mut()
        .ok_or_else(|| boxed(std::io::Error::other("no upstream connection")))?;
    let resp = match send.ready().await {
        Ok(()) => send.send_request(req).await,
        Err(e) => Err(e),
    };
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            *guard = None; // a broken connection is not reused
            return Err(boxed(e));
        }
    };
    drop(guard);
    if !scan {
        let (parts, body) = resp.into_parts();
        let frames = body
            .into_data_stream()
            .map(|chunk| -> Result<Frame<Bytes>, BoxError> {
                chunk.map(Frame::data).map_err(|e| Box::new(e) as BoxError)
            })
            .boxed();
        return Ok(hyper::Response::from_parts(parts, StreamBody::new(frames)));
    }
    let secrets = vault.redactions();
    let (mut parts, body) = resp.into_parts();
    let encoded = parts
        .headers
        .get(hyper::header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded && !secrets.is_empty() {
        // Asked for no encoding, sent one anyway: it cannot be scanned for secrets.
        return Err(
            "the server answered with an encoded body, which cannot be checked for secrets".into(),
        );
    }
    for v in parts.headers.values_mut() {
        let bytes = v.as_bytes();
        if secrets
            .iter()
            .any(|s| bytes.windows(s.len()).any(|w| w == s.as_slice()))
        {
            let mut r = Redactor::new(secrets.clone());
            let mut out = r.push(bytes);
            out.extend(r.finish());
            *v = hyper::header::HeaderValue::from_bytes(&out).map_err(boxed)?;
        }
    }
    parts.headers.remove(hyper::header::CONTENT_LENGTH);
    let redactor = Arc::new(Mutex::new(Redactor::new(secrets)));
    let tail = redactor.clone();
    let frames = body
        .into_data_stream()
        .map(move |chunk| -> Result<Frame<Bytes>, BoxError> {
            let chunk = chunk?;
            let out = redactor
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(&chunk);
            Ok(Frame::data(Bytes::from(out)))
        })
        .chain(futures::stream::once(async move {
            let rest = tail.lock().unwrap_or_else(|e| e.into_inner()).finish();
            Ok(Frame::data(Bytes::from(rest)))
        }))
        .boxed();
    Ok(hyper::Response::from_parts(parts, StreamBody::new(frames)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(hosts: &[&str], uri: &str) -> hyper::Request<()> {
        let mut b = hyper::Request::builder().uri(uri);
        for h in hosts {
            b = b.header(hyper::header::HOST, *h);
        }
        b.body(()).expect("request")
    }

    #[test]
    fn a_plain_request_proves_only_one_well_formed_host_name() {
        let host = |hosts: &[&str], uri: &str| plain_host(&request(hosts, uri));
        assert_eq!(host(&["API.test"], "/x"), Ok(Some("api.test".into())));
        assert_eq!(host(&["api.test:8080"], "/x"), Ok(Some("api.test".into())));
        assert_eq!(host(&["api.test."], "/x"), Ok(Some("api.test".into())));
        assert_eq!(
            host(&["api.test"], "http://api.test/x"),
            Ok(Some("api.test".into()))
        );
        // Nothing to prove: the request goes on without credentials.
        assert_eq!(host(&[], "/x"), Ok(None));
        assert_eq!(host(&["10.0.0.1"], "/x"), Ok(None));
        assert_eq!(host(&["api.test:"], "/x"), Ok(None));
        assert_eq!(host(&["api.test:80x"], "/x"), Ok(None));
        assert_eq!(host(&["api_test/x"], "/x"), Ok(None));
        assert_eq!(host(&[""], "/x"), Ok(None));
        // Ambiguous: refused, the upstream might route by the other name.
        assert!(host(&["api.test", "evil.test"], "/x").is_err());
        assert!(host(&["api.test", "api.test"], "/x").is_err());
        assert!(host(&["api.test"], "http://evil.test/x").is_err());
    }

    #[test]
    fn host_header_without_its_port() {
        assert_eq!(host_of("api.test"), "api.test");
        assert_eq!(host_of("api.test:8080"), "api.test");
        assert_eq!(host_of("[::1]:80"), "[::1]");
        assert_eq!(host_of("[::1]"), "[::1]");
    }

    #[test]
    fn sni_of_a_real_client_hello() {
        // A ClientHello built by rustls for "api.example.test".
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let mut conn = rustls::ClientConnection::new(
            Arc::new(cfg),
            ServerName::try_from("API.example.test").expect("name"),
        )
        .expect("conn");
        let mut buf = Vec::new();
        conn.write_tls(&mut buf).expect("hello");
        assert_eq!(sni(&buf).as_deref(), Some("api.example.test"));
        assert_eq!(sni(b"GET / HTTP/1.1\r\n"), None);
    }

    #[test]
    fn ca_issues_leaves() {
        let ca = SandboxCa::new("0123456789").expect("ca");
        assert!(ca.pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let a = ca.leaf("a.test").expect("leaf");
        let b = ca.leaf("a.test").expect("leaf");
        assert!(Arc::ptr_eq(&a, &b), "cached");
    }
}
