//! The registry side of a pull (OCI distribution API v2): HTTP clients per host, the Basic and
//! Bearer-token challenges, manifests and blobs with their digests checked, and blob streams that
//! resume with `Range` after a dropped connection.
//!
//! Why one file: one conversation with a registry. Every request of a `Session` (manifests, blobs,
//! resumed blob streams) goes through its `get`, which answers auth challenges, and all of them
//! report failures through the same private error constructors.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt;
use reqwest::header::{self, HeaderValue};
use reqwest::{Response, StatusCode};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use warren_image::oci;

use crate::config::{Credentials, Endpoint, RegistriesConfig};
use crate::error::{describe_http, one_line, PullError};

/// Manifests and configs are small; refuse to buffer anything absurd.
const MAX_DOCUMENT: usize = 8 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest silence on a connection before it counts as dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts per blob after the first, each resuming where the last stopped.
const BLOB_RETRIES: u32 = 2;
const USER_AGENT: &str = concat!("warren/", env!("CARGO_PKG_VERSION"));

const MANIFEST_ACCEPT: &str = concat!(
    "application/vnd.oci.image.index.v1+json, ",
    "application/vnd.docker.distribution.manifest.list.v2+json, ",
    "application/vnd.oci.image.manifest.v1+json, ",
    "application/vnd.docker.distribution.manifest.v2+json"
);

/// HTTP clients, one per registry host (each with that host's extra CA), shared by all pulls.
pub struct Client {
    config: RegistriesConfig,
    http: Mutex<HashMap<String, reqwest::Client>>,
}

impl Client {
    pub fn new(config: RegistriesConfig) -> Self {
        Client {
            config,
            http: Mutex::new(HashMap::new()),
        }
    }

    pub fn config(&self) -> &RegistriesConfig {
        &self.config
    }

    /// Whether the operator configured `endpoint` (see `guard`): a host with settings of its own,
    /// or a mirror named in them.
    fn trusted(&self, endpoint: &Endpoint) -> bool {
        endpoint.mirror || self.config.host(&endpoint.host).is_some()
    }

    fn http_for(&self, host: &str, trusted: bool) -> Result<reqwest::Client, String> {
        let key = format!("{host} {trusted}");
        let mut clients = self.http.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(&key) {
            return Ok(c.clone());
        }
        let redirects = if trusted {
            reqwest::redirect::Policy::limited(10)
        } else {
            // every hop of an unconfigured registry's redirects is checked as its first was
            reqwest::redirect::Policy::custom(|attempt| {
                if attempt.previous().len() >= 10 {
                    attempt.error("too many redirects")
                } else if crate::guard::url_allowed(attempt.url()) {
                    attempt.follow()
                } else {
                    attempt.error("a redirect to an internal address")
                }
            })
        };
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(READ_TIMEOUT)
            .tcp_nodelay(true)
            .user_agent(USER_AGENT)
            .redirect(redirects);
        if !trusted {
            builder = builder.dns_resolver(Arc::new(crate::guard::PublicOnly));
        }
        if let Some(ca) = self.config.host(host).and_then(|h| h.ca_file.as_ref()) {
            let pem = std::fs::read(ca)
                .map_err(|e| format!("reading ca_file {} for {host}: {e}", ca.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("ca_file {} for {host}: {e}", ca.display()))?;
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let client = builder
            .build()
            .map_err(|e| format!("HTTP client for {host}: {}", describe_http(&e)))?;
        clients.insert(key, client.clone());
        Ok(client)
    }

    /// A conversation with one endpoint about one repository.
    pub(crate) fn session(
        &self,
        image: &str,
        endpoint: &Endpoint,
        repository: &str,
        auth: Option<&Credentials>,
    ) -> Result<Session, PullError> {
        let trusted = self.trusted(endpoint);
        if !trusted && !crate::guard::text_allowed(&endpoint.base) {
            return Err(PullError::Unreachable {
                image: image.to_owned(),
                registry: endpoint.host.clone(),
                detail: format!(
                    "{} is an internal address, reached only by a registry configured under [registries.\"{}\"]",
                    endpoint.base, endpoint.host
                ),
            });
        }
        let http =
            self.http_for(&endpoint.host, trusted)
                .map_err(|detail| PullError::Unreachable {
                    image: image.to_owned(),
                    registry: endpoint.host.clone(),
                    detail,
                })?;
        let credentials = auth
            .cloned()
            .or_else(|| self.config.credentials(&endpoint.host));
        Ok(Session {
            http,
            trusted,
            image: image.to_owned(),
            endpoint: endpoint.clone(),
            repository: repository.to_owned(),
            credentials,
            authorization: Arc::new(Mutex::new(None)),
        })
    }
}

/// One image's requests to one endpoint; remembers the `Authorization` that worked so that only
/// the first request of a pull meets the challenge.
#[derive(Clone)]
pub(crate) struct Session {
    http: reqwest::Client,
    /// Configured by the operator (see `guard`); otherwise errors do not say how a connection
    /// failed, and the token realm must be public too.
    trusted: bool,
    image: String,
    endpoint: Endpoint,
    repository: String,
    credentials: Option<Credentials>,
    authorization: Arc<Mutex<Option<HeaderValue>>>,
}

/// A manifest or index as fetched: its bytes, media type and digest (checked).
pub(crate) struct Fetched {
    pub body: Bytes,
    pub media_type: String,
    pub digest: String,
}

impl Session {
    pub fn registry(&self) -> &str {
        &self.endpoint.host
    }

    fn unreachable(&self, detail: String) -> PullError {
        if !self.trusted {
            // Refused, timed out, reset, a TLS failure: all one answer, or the error would tell a
            // caller which ports are open behind whatever the name resolves to.
            return PullError::Unreachable {
                image: self.image.clone(),
                registry: self.endpoint.host.clone(),
                detail: format!(
                    "{} could not be reached (a registry that is not configured must be on a public address)",
                    self.endpoint.base
                ),
            };
        }
        let hint = if self.endpoint.base.starts_with("https://") {
            format!(
                "; if it serves plain HTTP, set `insecure = true` under [registries.\"{}\"]",
                self.endpoint.host
            )
        } else {
            String::new()
        };
        PullError::Unreachable {
            image: self.image.clone(),
            registry: self.endpoint.host.clone(),
            detail: one_line(&format!("{} ({detail}){hint}", self.endpoint.base)),
        }
    }

    fn bad(&self, detail: impl Into<String>) -> PullError {
        PullError::Registry {
            image: self.image.clone(),
            registry: self.endpoint.host.clone(),
            detail: one_line(&detail.into()),
        }
    }

    fn denied(&self, detail: impl Into<String>) -> PullError {
        PullError::Denied {
            image: self.image.clone(),
            registry: self.endpoint.host.clone(),
            detail: one_line(&detail.into()),
        }
    }

    fn not_found(&self) -> PullError {
        PullError::NotFound {
            image: self.image.clone(),
            registry: self.endpoint.host.clone(),
        }
    }

    /// GET `/v2/<repo>/<path>`, answering an auth challenge once.
    async fn get(
        &self,
        path: &str,
        accept: Option<&str>,
        from: u64,
    ) -> Result<Response, PullError> {
        let url = format!("{}/v2/{}/{path}", self.endpoint.base, self.repository);
        let send = |authorization: Option<HeaderValue>| {
            let mut req = self.http.get(&url);
            if let Some(a) = accept {
                req = req.header(header::ACCEPT, a);
            }
            if from > 0 {
                req = req.header(header::RANGE, format!("bytes={from}-"));
            }
            if let Some(a) = authorization {
                req = req.header(header::AUTHORIZATION, a);
            }
            req.send()
        };
        let current = self.current_authorization();
        let resp = send(current.clone())
            .await
            .map_err(|e| self.unreachable(describe_http(&e)))?;
        if resp.status() != StatusCode::UNAUTHORIZED {
            return Ok(resp);
        }
        let challenge = resp
            .headers()
            .get(header::WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or_else(|| self.denied("401 without a WWW-Authenticate challenge"))?;
        let authorization = self.answer(&challenge, current.is_some()).await?;
        *self.authorization.lock().unwrap_or_else(|p| p.into_inner()) = Some(authorization.clone());
        let resp = send(Some(authorization))
            .await
            .map_err(|e| self.unreachable(describe_http(&e)))?;
        if resp.status() == StatusCode::UNAUTHORIZED {
            return Err(self.denied(if self.credentials.is_some() {
                "the credentials were refused"
            } else {
                "anonymous access refused"
            }));
        }
        Ok(resp)
    }

    fn current_authorization(&self) -> Option<HeaderValue> {
        self.authorization
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The `Authorization` value that answers `challenge` (Basic, or a Bearer token fetched from the
    /// realm).
    async fn answer(&self, challenge: &str, had_auth: bool) -> Result<HeaderValue, PullError> {
        let (scheme, params) = parse_challenge(challenge);
        match scheme.to_ascii_lowercase().as_str() {
            "basic" => {
                let Some(c) = &self.credentials else {
                    return Err(self.denied("credentials required"));
                };
                if had_auth {
                    return Err(self.denied("the credentials were refused"));
                }
                header_value(&basic(c)).map_err(|e| self.bad(e))
            }
            "bearer" => {
                let realm = params
                    .get("realm")
                    .ok_or_else(|| self.bad("Bearer challenge without realm"))?;
                if !(realm.starts_with("https://") || realm.starts_with("http://")) {
                    return Err(self.bad(format!("token realm {realm:?} is not an http(s) URL")));
                }
                if !self.trusted && !crate::guard::text_allowed(realm) {
                    return Err(self.bad("the token realm is an internal address"));
                }
                let scope = params
                    .get("scope")
                    .cloned()
                    .unwrap_or_else(|| format!("repository:{}:pull", self.repository));
                let mut query: Vec<(&str, &str)> = vec![("scope", scope.as_str())];
                if let Some(service) = params.get("service") {
                    query.push(("service", service.as_str()));
                }
                let mut req = self.http.get(realm.as_str()).query(&query);
                if let Some(c) = &self.credentials {
                    req = req.basic_auth(&c.username, Some(&c.password));
                }
                let resp = req.send().await.map_err(|e| {
                    self.unreachable(format!("token service: {}", describe_http(&e)))
                })?;
                match resp.status() {
                    s if s.is_success() => {}
                    StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                        return Err(self
                            .denied(format!("token service answered {}", resp.status().as_u16())))
                    }
                    s => return Err(self.bad(format!("token service answered {}", s.as_u16()))),
                }
                let body = read_limited(resp, MAX_DOCUMENT)
                    .await
                    .map_err(|e| self.bad(format!("token service: {e}")))?;
                #[derive(serde::Deserialize)]
                struct Token {
                    token: Option<String>,
                    access_token: Option<String>,
                }
                let token: Token = serde_json::from_slice(&body)
                    .map_err(|e| self.bad(format!("token service: bad JSON: {e}")))?;
                let token = token
                    .token
                    .or(token.access_token)
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| self.bad("token service returned no token"))?;
                header_value(&format!("Bearer {token}")).map_err(|e| self.bad(e))
            }
            other => Err(self.bad(format!("unsupported auth scheme {other:?}"))),
        }
    }

    /// Fetches a manifest or index by tag or digest and checks its digest (against the reference
    /// when it is one, else against `Docker-Content-Digest` when the registry sends it).
    pub async fn manifest(&self, reference: &str) -> Result<Fetched, PullError> {
        let resp = self
            .get(&format!("manifests/{reference}"), Some(MANIFEST_ACCEPT), 0)
            .await?;
        let resp = self.check_status(resp).await?;
        let header_digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or("").trim().to_owned())
            .unwrap_or_default();
        let body = read_limited(resp, MAX_DOCUMENT)
            .await
            .map_err(|e| self.bad(format!("manifest {reference}: {e}")))?;
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&body)));
        let expected = if reference.contains(':') {
            Some(reference.to_owned())
        } else {
            header_digest.filter(|d| d.starts_with("sha256:"))
        };
        if let Some(expected) = expected {
            if expected != digest {
                return Err(self.bad(format!(
                    "manifest {reference} has digest {digest}, expected {expected}"
                )));
            }
        }
        Ok(Fetched {
            body,
            media_type: content_type,
            digest,
        })
    }

    /// Fetches a small blob (an image config) whole and checks its digest.
    pub async fn small_blob(&self, digest: &str) -> Result<Bytes, PullError> {
        let resp = self.get(&format!("blobs/{digest}"), None, 0).await?;
        let resp = self.check_status(resp).await?;
        let body = read_limited(resp, MAX_DOCUMENT)
            .await
            .map_err(|e| self.bad(format!("blob {digest}: {e}")))?;
        let actual = format!("sha256:{}", hex::encode(Sha256::digest(&body)));
        if actual != digest {
            return Err(self.bad(format!("blob {digest} has digest {actual}")));
        }
        Ok(body)
    }

    /// Streams a layer blob into `sink`, resuming with `Range` after a dropped connection (up to
    /// [`BLOB_RETRIES`] times). Digests are checked by the consumer, which hashes what it reads.
    pub async fn stream_blob(
        &self,
        digest: &str,
        size: u64,
        sink: &mpsc::Sender<Chunk>,
        on_bytes: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<u64, PullError> {
        let mut received: u64 = 0;
        let mut attempt = 0;
        loop {
            let outcome = self
                .stream_from(digest, received, size, sink, on_bytes)
                .await;
            match outcome {
                Ok(Streamed::Done(n)) if received + n != size => {
                    return Err(self.bad(format!(
                        "blob {digest}: the registry sent {} bytes where the manifest says {size}",
                        received + n
                    )))
                }
                Ok(Streamed::Done(n)) => return Ok(received + n),
                Ok(Streamed::Stopped) => return Ok(received),
                Err((n, e)) => {
                    received += n;
                    attempt += 1;
                    if attempt > BLOB_RETRIES || !e.resumable {
                        return Err(e.error);
                    }
                    tracing::debug!(digest, received, "blob stream broke, resuming: {}", e.error);
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
                }
            }
        }
    }

    async fn stream_from(
        &self,
        digest: &str,
        from: u64,
        size: u64,
        sink: &mpsc::Sender<Chunk>,
        on_bytes: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<Streamed, (u64, StreamFailure)> {
        let fail =
            |n: u64, error: PullError, resumable: bool| (n, StreamFailure { error, resumable });
        let resp = match self.get(&format!("blobs/{digest}"), None, from).await {
            Ok(r) => r,
            Err(e @ PullError::Unreachable { .. }) => return Err(fail(0, e, true)),
            Err(e) => return Err(fail(0, e, false)),
        };
        if from > 0 {
            let start = resp
                .headers()
                .get(header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("bytes "))
                .and_then(|v| v.split('-').next())
                .and_then(|v| v.parse::<u64>().ok());
            if resp.status() != StatusCode::PARTIAL_CONTENT || start != Some(from) {
                let detail = format!(
                    "blob {digest}: connection lost after {from} bytes and the registry cannot resume (answered {})",
                    resp.status().as_u16()
                );
                return Err(fail(0, self.bad(detail), false));
            }
        } else {
            match self.check_status(resp).await {
                Ok(r) => return self.pump(r, digest, size, sink, on_bytes).await,
                Err(e) => return Err(fail(0, e, false)),
            }
        }
        self.pump(resp, digest, size - from.min(size), sink, on_bytes)
            .await
    }

    /// Feeds the body to `sink`, refusing past `left` bytes (what the manifest's size leaves).
    async fn pump(
        &self,
        resp: Response,
        digest: &str,
        left: u64,
        sink: &mpsc::Sender<Chunk>,
        on_bytes: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<Streamed, (u64, StreamFailure)> {
        let mut n: u64 = 0;
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(bytes) => {
                    n += bytes.len() as u64;
                    if n > left {
                        let error = self.bad(format!(
                            "blob {digest}: the registry sends more bytes than the manifest says"
                        ));
                        return Err((
                            n,
                            StreamFailure {
                                error,
                                resumable: false,
                            },
                        ));
                    }
                    on_bytes(bytes.len() as u64);
                    if sink.send(Chunk::Data(bytes)).await.is_err() {
                        return Ok(Streamed::Stopped);
                    }
                }
                Err(e) => {
                    let error = self.bad(format!(
                        "blob {digest}: connection lost ({})",
                        describe_http(&e)
                    ));
                    return Err((
                        n,
                        StreamFailure {
                            error,
                            resumable: true,
                        },
                    ));
                }
            }
        }
        Ok(Streamed::Done(n))
    }

    /// Turns an error status into the matching [`PullError`].
    async fn check_status(&self, resp: Response) -> Result<Response, PullError> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = read_limited(resp, 4096).await.unwrap_or_default();
        let detail = registry_error_text(&body);
        Err(match status {
            StatusCode::NOT_FOUND => self.not_found(),
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                self.denied(detail.unwrap_or_else(|| format!("{}", status.as_u16())))
            }
            _ => self.bad(format!(
                "answered {}{}",
                status.as_u16(),
                detail.map(|d| format!(" ({d})")).unwrap_or_default()
            )),
        })
    }
}

/// What flows from a blob download to its unpacker.
pub(crate) enum Chunk {
    Data(Bytes),
    /// The body ended cleanly.
    End,
    /// The download failed; a cut stream must not pass for a complete one.
    Failed(String),
}

enum Streamed {
    /// The body ended; this many bytes came in this attempt.
    Done(u64),
    /// The sink wanted no more.
    Stopped,
}

struct StreamFailure {
    error: PullError,
    resumable: bool,
}

/// Reads a body whole, refusing more than `limit` bytes.
async fn read_limited(resp: Response, limit: usize) -> Result<Bytes, String> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(format!("larger than {limit} bytes"));
    }
    let mut out = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| describe_http(&e))?;
        if out.len() + chunk.len() > limit {
            return Err(format!("larger than {limit} bytes"));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(out))
}

/// `{"errors":[{"code":"MANIFEST_UNKNOWN","message":"..."}]}` → `MANIFEST_UNKNOWN: ...`.
fn registry_error_text(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<Item>,
    }
    #[derive(serde::Deserialize)]
    struct Item {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    let parsed: Errors = serde_json::from_slice(body).ok()?;
    let first = parsed.errors.into_iter().next()?;
    let text = format!("{}: {}", first.code, first.message);
    Some(text.chars().take(200).collect())
}

fn basic(c: &Credentials) -> String {
    let raw = format!("{}:{}", c.username, c.password);
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    )
}

fn header_value(s: &str) -> Result<HeaderValue, String> {
    let mut v = HeaderValue::from_str(s)
        .map_err(|_| "credentials contain bytes not allowed in a header".to_owned())?;
    v.set_sensitive(true);
    Ok(v)
}

/// `Bearer realm="https://x/token",service="s",scope="repository:a/b:pull"` → ("Bearer", params).
pub(crate) fn parse_challenge(header: &str) -> (String, HashMap<String, String>) {
    let header = header.trim();
    let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
    let mut params = HashMap::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String =
            std::iter::from_fn(|| chars.next_if(|c| *c != '=' && *c != ',')).collect();
        if key.is_empty() {
            break;
        }
        if chars.next() != Some('=') {
            continue;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => {
                        if let Some(n) = chars.next() {
                            value.push(n);
                        }
                    }
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            value = std::iter::from_fn(|| chars.next_if(|c| *c != ',')).collect();
        }
        params.insert(key.trim().to_ascii_lowercase(), value.trim().to_owned());
    }
    (scheme.to_owned(), params)
}

/// Parses an index or manifest document.
pub(crate) fn parse_document(body: &[u8]) -> Result<oci::Document, String> {
    serde_json::from_slice(body).map_err(|e| format!("bad manifest JSON: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bearer_challenges() {
        let (scheme, p) = parse_challenge(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/python:pull,push""#,
        );
        assert_eq!(scheme, "Bearer");
        assert_eq!(p["realm"], "https://auth.docker.io/token");
        assert_eq!(p["service"], "registry.docker.io");
        assert_eq!(p["scope"], "repository:library/python:pull,push");
        let (scheme, p) = parse_challenge(r#"Basic realm="Registry Realm""#);
        assert_eq!(scheme, "Basic");
        assert_eq!(p["realm"], "Registry Realm");
        let (_, p) = parse_challenge(r#"Bearer realm=http://x/t, error="invalid_token""#);
        assert_eq!(p["realm"], "http://x/t");
        assert_eq!(p["error"], "invalid_token");
    }

    #[test]
    fn registry_errors_are_summarised() {
        let body =
            br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown","detail":{}}]}"#;
        assert_eq!(
            registry_error_text(body).as_deref(),
            Some("MANIFEST_UNKNOWN: manifest unknown")
        );
        assert_eq!(registry_error_text(b"<html>"), None);
    }
}
