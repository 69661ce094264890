//! A small Docker Engine API client: JSON requests over the daemon's Unix socket, plain TCP, or TCP
//! with TLS and a client certificate (Docker's `--tlsverify` daemons), with
//! the API version negotiated once (the daemon's, capped at the newest one this code was written
//! against) and two kinds of failure the runtime treats differently: the daemon cannot be reached
//! (`Unavailable`: try later) and the daemon said no (`Api`, with its status and message).

#[cfg(test)]
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::OnceCell;

/// The newest Engine API this client speaks; older daemons are addressed with their own version.
pub const MAX_API_VERSION: (u32, u32) = (1, 45);
/// The oldest it accepts: 1.41 is Docker 20.10 (Debian bookworm's `docker.io`).
pub const MIN_API_VERSION: (u32, u32) = (1, 40);
/// Time allowed to connect and get response headers for ordinary calls.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    #[error("the Docker daemon at {endpoint} cannot be reached: {reason}")]
    Unavailable { endpoint: String, reason: String },
    #[error("Docker: {message} (HTTP {status})")]
    Api { status: u16, message: String },
    #[error("Docker: {0}")]
    Protocol(String),
}

impl DockerError {
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Api { status: 404, .. })
    }
}

#[derive(Debug, Clone)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
    /// TCP with TLS: the daemon's certificate checked against a CA, Warren's client certificate
    /// presented (what a daemon with `--tlsverify` asks for).
    Tls(String, TlsClient),
}

/// A TLS client for one daemon: its name (or address) as the certificate must show it.
#[derive(Clone)]
pub struct TlsClient {
    connector: tokio_rustls::TlsConnector,
    server_name: rustls::pki_types::ServerName<'static>,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsClient({:?})", self.server_name)
    }
}

/// The files a TLS connection to a daemon takes, as Docker names them in `DOCKER_CERT_PATH`.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA that signed the daemon's certificate.
    pub ca: PathBuf,
    /// Warren's client certificate and its key.
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// `ca.pem`, `cert.pem` and `key.pem` in `dir` (Docker's `DOCKER_CERT_PATH` layout).
    pub fn in_dir(dir: &std::path::Path) -> Self {
        Self {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }
    }
}

impl Endpoint {
    /// `DOCKER_HOST` syntax: `unix:///path`, `tcp://host:port` (plain HTTP, or TLS once
    /// [`Endpoint::with_tls`] is applied), `https://host:port` (TLS; needs the files too).
    pub fn parse(host: &str) -> Result<Self, String> {
        if let Some(p) = host.strip_prefix("unix://") {
            Ok(Self::Unix(PathBuf::from(p)))
        } else if let Some(a) = host
            .strip_prefix("tcp://")
            .or_else(|| host.strip_prefix("http://"))
            .or_else(|| host.strip_prefix("https://"))
        {
            Ok(Self::Tcp(a.trim_end_matches('/').to_string()))
        } else if host.starts_with('/') {
            Ok(Self::Unix(PathBuf::from(host)))
        } else {
            Err(format!(
                "unsupported Docker host {host:?} (use unix:///path or tcp://host:port)"
            ))
        }
    }

    /// The same TCP endpoint over TLS with `files`; a Unix socket takes no TLS.
    pub fn with_tls(self, files: &TlsFiles) -> Result<Self, String> {
        let Self::Tcp(addr) = self else {
            return Err("TLS is for tcp:// Docker hosts, not Unix sockets".into());
        };
        let read =
            |p: &PathBuf| std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()));
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut read(&files.ca)?.as_slice()) {
            let cert = cert.map_err(|e| format!("{}: {e}", files.ca.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("{}: {e}", files.ca.display()))?;
        }
        if roots.is_empty() {
            return Err(format!("{}: no certificate in it", files.ca.display()));
        }
        let chain: Vec<_> = rustls_pemfile::certs(&mut read(&files.cert)?.as_slice())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", files.cert.display()))?;
        let key = rustls_pemfile::private_key(&mut read(&files.key)?.as_slice())
            .map_err(|e| format!("{}: {e}", files.key.display()))?
            .ok_or_else(|| format!("{}: no private key in it", files.key.display()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("{}: {e}", files.cert.display()))?;
        let host = host_of(&addr);
        let server_name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| format!("{host:?} as a TLS server name: {e}"))?;
        Ok(Self::Tls(
            addr,
            TlsClient {
                connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
                server_name,
            },
        ))
    }

    /// The host (name or address) a TCP endpoint names, without its port or brackets.
    pub fn host(&self) -> Option<&str> {
        match self {
            Self::Unix(_) => None,
            Self::Tcp(a) | Self::Tls(a, _) => Some(host_of(a)),
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Unix(p) => format!("unix://{}", p.display()),
            Self::Tcp(a) => format!("tcp://{a}"),
            Self::Tls(a, _) => format!("tcp://{a} (TLS)"),
        }
    }
}

/// `host:port` → `host`; `[v6]:port` → `v6`.
fn host_of(addr: &str) -> &str {
    let host = match addr.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => addr,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A request's body.
enum Payload<'a> {
    Json(&'a Value),
    Tar(&'a Bytes),
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

#[derive(Debug)]
pub struct Client {
    endpoint: Endpoint,
    version: OnceCell<String>,
}

/// A response whose body is read as a stream (pull progress, waits).
pub type Body = hyper::body::Incoming;

impl Client {
    pub fn new(endpoint: Endpoint) -> Self {
        Self {
            endpoint,
            version: OnceCell::new(),
        }
    }

    pub fn endpoint(&self) -> String {
        self.endpoint.describe()
    }

    fn unavailable(&self, reason: impl std::fmt::Display) -> DockerError {
        DockerError::Unavailable {
            endpoint: self.endpoint.describe(),
            reason: reason.to_string(),
        }
    }

    async fn connect(&self) -> Result<Box<dyn Io>, DockerError> {
        let io: Box<dyn Io> = match &self.endpoint {
            Endpoint::Unix(p) => Box::new(
                tokio::net::UnixStream::connect(p)
                    .await
                    .map_err(|e| self.unavailable(e))?,
            ),
            Endpoint::Tcp(a) => {
                let s = tokio::net::TcpStream::connect(a)
                    .await
                    .map_err(|e| self.unavailable(e))?;
                let _ = s.set_nodelay(true);
                Box::new(s)
            }
            Endpoint::Tls(a, tls) => {
                let s = tokio::net::TcpStream::connect(a)
                    .await
                    .map_err(|e| self.unavailable(e))?;
                let _ = s.set_nodelay(true);
                let s = tls
                    .connector
                    .connect(tls.server_name.clone(), s)
                    .await
                    .map_err(|e| self.unavailable(format!("TLS: {e}")))?;
                Box::new(s)
            }
        };
        Ok(io)
    }

    /// The API version to address: the daemon's own, capped at [`MAX_API_VERSION`].
    async fn version(&self) -> Result<&str, DockerError> {
        self.version
            .get_or_try_init(|| async {
                let (status, body) = self.request(Method::GET, "/version", None, &[]).await?;
                let bytes = self.read_ok(status, body).await?;
                let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
                    DockerError::Protocol(format!("unexpected /version answer: {e}"))
                })?;
                let daemon = v["ApiVersion"].as_str().unwrap_or("1.41");
                let parsed = parse_version(daemon)
                    .ok_or_else(|| DockerError::Protocol(format!("bad ApiVersion {daemon:?}")))?;
                if parsed < MIN_API_VERSION {
                    return Err(DockerError::Protocol(format!(
                        "the daemon speaks API {daemon}; Warren needs {}.{} or newer",
                        MIN_API_VERSION.0, MIN_API_VERSION.1
                    )));
                }
                let (maj, min) = parsed.min(MAX_API_VERSION);
                Ok(format!("v{maj}.{min}"))
            })
            .await
            .map(String::as_str)
    }

    /// The whole body of a successful answer; a failed one becomes its `Api` error.
    async fn read_ok(&self, status: StatusCode, body: Body) -> Result<Bytes, DockerError> {
        let bytes = body
            .collect()
            .await
            .map_err(|e| self.unavailable(e))?
            .to_bytes();
        if !status.is_success() {
            return Err(api_error(status, &bytes));
        }
        Ok(bytes)
    }

    /// One versioned request on a fresh connection; returns the status and the streaming body.
    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<&Value>,
        headers: &[(&str, String)],
    ) -> Result<(StatusCode, Body), DockerError> {
        self.send_payload(method, path_and_query, body.map(Payload::Json), headers)
            .await
    }

    async fn send_payload(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<Payload<'_>>,
        headers: &[(&str, String)],
    ) -> Result<(StatusCode, Body), DockerError> {
        let path = format!("/{}{path_and_query}", self.version().await?);
        self.request(method, &path, body, headers).await
    }

    /// `call` within [`CALL_TIMEOUT`]; past it the daemon counts as unreachable.
    async fn in_time<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, DockerError>>,
    ) -> Result<T, DockerError> {
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .map_err(|_| self.unavailable(format!("no answer to {what} within {CALL_TIMEOUT:?}")))?
    }

    /// Makes image `repo:tag` of a tar archive of a root file system (`POST /images/create` with
    /// `fromSrc=-`), as `docker import` does.
    pub async fn import_image(&self, repo: &str, tag: &str, tar: Bytes) -> Result<(), DockerError> {
        let path = format!(
            "/images/create?fromSrc=-&repo={}&tag={}",
            encode(repo),
            encode(tag)
        );
        self.in_time("an image import", async {
            let (status, body) = self
                .send_payload(Method::POST, &path, Some(Payload::Tar(&tar)), &[])
                .await?;
            let bytes = self.read_ok(status, body).await?;
            match progress_error(&bytes) {
                Some(e) => Err(DockerError::Protocol(format!(
                    "importing {repo}:{tag}: {e}"
                ))),
                None => Ok(()),
            }
        })
        .await
    }

    /// Unpacks a tar archive at `path` in a container (`PUT /containers/{id}/archive`): the daemon
    /// writes it into the container's filesystem, or into a volume mounted there.
    pub async fn put_archive(
        &self,
        container: &str,
        path: &str,
        tar: Bytes,
    ) -> Result<(), DockerError> {
        let url = format!("/containers/{container}/archive?path={}", encode(path));
        self.in_time("an archive upload", async {
            let (status, body) = self
                .send_payload(Method::PUT, &url, Some(Payload::Tar(&tar)), &[])
                .await?;
            self.read_ok(status, body).await.map(drop)
        })
        .await
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Payload<'_>>,
        headers: &[(&str, String)],
    ) -> Result<(StatusCode, Body), DockerError> {
        let io = self.connect().await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| self.unavailable(e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, "docker");
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let bytes = match body {
            Some(Payload::Json(v)) => {
                req = req.header(hyper::header::CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(v).unwrap_or_default())
            }
            Some(Payload::Tar(b)) => {
                req = req.header(hyper::header::CONTENT_TYPE, "application/x-tar");
                b.clone()
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(bytes))
            .map_err(|e| DockerError::Protocol(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| self.unavailable(e))?;
        Ok((resp.status(), resp.into_body()))
    }

    async fn raw_json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, String)],
    ) -> Result<T, DockerError> {
        self.in_time(path, async {
            let (status, body) = self.send(method, path, body, headers).await?;
            let bytes = self.read_ok(status, body).await?;
            let text: &[u8] = if bytes.is_empty() { b"null" } else { &bytes };
            serde_json::from_slice(text)
                .map_err(|e| DockerError::Protocol(format!("unexpected answer to {path}: {e}")))
        })
        .await
    }

    /// A JSON call; `null` for empty bodies (204s).
    pub async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<T, DockerError> {
        self.raw_json(method, path, body, &[]).await
    }

    pub async fn call_with_headers<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, String)],
    ) -> Result<T, DockerError> {
        self.raw_json(method, path, None, headers).await
    }

    /// Pulls `image` (`POST /images/create`), reading the progress stream to its end; an `error` in
    /// it (unknown image, bad credentials) becomes the error.
    pub async fn pull(
        &self,
        image: &str,
        registry_auth: Option<String>,
    ) -> Result<(), DockerError> {
        let (name, tag) = split_tag(image);
        let path = format!(
            "/images/create?fromImage={}&tag={}",
            encode(name),
            encode(tag)
        );
        let headers: Vec<(&str, String)> = registry_auth
            .map(|a| vec![("X-Registry-Auth", a)])
            .unwrap_or_default();
        let (status, body) = self.send(Method::POST, &path, None, &headers).await?;
        let bytes = self.read_ok(status, body).await?;
        match progress_error(&bytes) {
            Some(message) => Err(DockerError::Api {
                status: 404,
                message,
            }),
            None => Ok(()),
        }
    }
}

/// The `error` of a progress stream (one JSON object per line, as pulls and imports answer), if
/// one of its lines has one.
fn progress_error(bytes: &[u8]) -> Option<String> {
    bytes.split(|b| *b == b'\n').find_map(|line| {
        serde_json::from_slice::<Value>(line)
            .ok()?
            .get("error")?
            .as_str()
            .map(str::to_string)
    })
}

fn api_error(status: StatusCode, body: &[u8]) -> DockerError {
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    DockerError::Api {
        status: status.as_u16(),
        message,
    }
}

fn parse_version(v: &str) -> Option<(u32, u32)> {
    let (a, b) = v.split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// `name[:tag][@digest]` → (`name`, `tag`), with `latest` when no tag; a digest stays in the name.
pub fn split_tag(image: &str) -> (&str, &str) {
    if image.contains('@') {
        return (image, "");
    }
    match image.rsplit_once(':') {
        // a colon before the last slash belongs to a registry's port
        Some((name, tag)) if !tag.contains('/') => (name, tag),
        _ => (image, "latest"),
    }
}

/// Percent-encodes a query value or path segment.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert!(
            matches!(Endpoint::parse("unix:///var/run/docker.sock"), Ok(Endpoint::Unix(p)) if p == Path::new("/var/run/docker.sock"))
        );
        assert!(
            matches!(Endpoint::parse("tcp://127.0.0.1:2375"), Ok(Endpoint::Tcp(a)) if a == "127.0.0.1:2375")
        );
        assert!(Endpoint::parse("ssh://host").is_err());
        assert_eq!(host_of("10.0.0.2:2376"), "10.0.0.2");
        assert_eq!(host_of("[fd00::2]:2376"), "fd00::2");
        assert_eq!(host_of("docker.internal:2376"), "docker.internal");
        let e = Endpoint::parse("unix:///x").expect("unix");
        assert!(e
            .with_tls(&TlsFiles::in_dir(Path::new("/nonexistent")))
            .is_err());
        let e = Endpoint::parse("tcp://127.0.0.1:2376").expect("tcp");
        let why = e
            .with_tls(&TlsFiles::in_dir(Path::new("/nonexistent")))
            .expect_err("no files");
        assert!(why.contains("/nonexistent/ca.pem"), "{why}");
    }

    #[test]
    fn progress_errors() {
        let ok = b"{\"status\":\"Pulling\"}\n{\"status\":\"Done\"}\n";
        assert_eq!(progress_error(ok), None);
        let bad = b"{\"status\":\"Pulling\"}\n{\"error\":\"manifest unknown\"}\n";
        assert_eq!(progress_error(bad).as_deref(), Some("manifest unknown"));
    }

    #[test]
    fn tags() {
        assert_eq!(split_tag("python:3.12"), ("python", "3.12"));
        assert_eq!(split_tag("python"), ("python", "latest"));
        assert_eq!(
            split_tag("localhost:5000/a/b"),
            ("localhost:5000/a/b", "latest")
        );
        assert_eq!(
            split_tag("localhost:5000/a/b:v1"),
            ("localhost:5000/a/b", "v1")
        );
        assert_eq!(split_tag("a@sha256:00"), ("a@sha256:00", ""));
    }

    #[test]
    fn versions() {
        assert_eq!(parse_version("1.41"), Some((1, 41)));
        assert!(parse_version("1.41").expect("v") < MAX_API_VERSION);
        assert_eq!(encode("a b/c:d"), "a%20b%2Fc%3Ad");
    }

    #[tokio::test]
    async fn unreachable_daemon_is_unavailable() {
        let c = Client::new(Endpoint::Unix("/nonexistent/docker.sock".into()));
        let e = c
            .call::<Value>(Method::GET, "/_ping", None)
            .await
            .expect_err("no daemon");
        assert!(matches!(e, DockerError::Unavailable { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/docker.sock"));
    }
}
