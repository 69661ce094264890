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

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::StreamBody;
use hyper::body::{Frame, Incoming};
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::vault::Vault;
use ca::Fixed;
use forward::{forward, refused};

mod ca;
mod forward;

pub use ca::SandboxCa;

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
    /// A binding's credential went into a request of `src`'s to `host`.
    fn injected(&self, src: Ipv4Addr, binding: &str, host: &str);
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

/// Where a request's injection is reported: the lookup, and the sandbox's address.
pub(super) struct Injected(Arc<dyn Lookup>, Ipv4Addr);

impl Injected {
    pub(super) fn report(&self, binding: &str, host: &str) {
        self.0.injected(self.1, binding, host);
    }
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
        let report = Injected(lookup.clone(), src);
        forward(
            req,
            vault,
            upstream,
            Target::Tls(tls_cfg, host),
            dst,
            report,
        )
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
                match forward(
                    req,
                    vault,
                    upstream,
                    target,
                    dst,
                    Injected(lookup.clone(), src),
                )
                .await
                {
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

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::ServerName;

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
