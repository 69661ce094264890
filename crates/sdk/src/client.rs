//! The lifecycle API (`/v1/sandboxes…`): create, find, list, pause, resume, renew, delete, endpoints.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::DeserializeOwned;
use warren_api::lifecycle::{
    CreateSandboxRequest, Endpoint, ListSandboxesResponse, RenewExpirationRequest,
    RenewExpirationResponse, Sandbox as SandboxInfo, SandboxState,
};
use warren_api::{ErrorBody, API_KEY_HEADER, EXECD_PORT};

use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

/// Where the server is and how to authenticate.
#[derive(Clone)]
pub struct Config {
    /// `http(s)://host:port`, without `/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    /// Per-request timeout for non-streaming calls; streams (commands, downloads) have none.
    pub request_timeout: Option<Duration>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "…"))
            .finish_non_exhaustive()
    }
}

impl Config {
    /// A server at `domain` (`host:port`, or a URL with a scheme), no key.
    pub fn new(domain: &str) -> Self {
        let domain = domain.trim_end_matches('/');
        let base_url = if domain.starts_with("http://") || domain.starts_with("https://") {
            domain.to_string()
        } else {
            format!("http://{domain}")
        };
        Self {
            base_url,
            api_key: None,
            request_timeout: Some(Duration::from_secs(60)),
        }
    }

    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// The settings the official SDKs read, then Warren's own: the server from `OPEN_SANDBOX_DOMAIN`
    /// (default `127.0.0.1:8080`), the key from `OPEN_SANDBOX_API_KEY`, else `WARREN_API_KEY`, else the
    /// key a server on this machine generated in its data dir (`WARREN_DATA_DIR` or the default one).
    pub fn from_env() -> Self {
        Self::from_lookup(warren_env::var)
    }

    /// [`Config::from_env`] with a custom variable lookup (for tests and embedding).
    pub fn from_lookup(env: impl Fn(&str) -> Option<String>) -> Self {
        let domain =
            env("OPEN_SANDBOX_DOMAIN").unwrap_or_else(|| warren_local::DEFAULT_LISTEN.into());
        let data_dir: PathBuf = env("WARREN_DATA_DIR")
            .map(Into::into)
            .unwrap_or_else(|| warren_local::default_data_dir(&env));
        let key = env("OPEN_SANDBOX_API_KEY")
            .or_else(|| env("WARREN_API_KEY"))
            .or_else(|| warren_local::stored_key(&data_dir));
        let mut cfg = Self::new(&domain);
        cfg.api_key = key;
        cfg
    }
}

/// Filters of [`Client::list`]; states are ORed, metadata pairs ANDed.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub states: Vec<SandboxState>,
    pub metadata: BTreeMap<String, String>,
    /// 1-based; 0 means the server's default (1).
    pub page: u32,
    /// 0 means the server's default (20).
    pub page_size: u32,
}

/// A client of one server. Cheap to clone: clones share one connection pool.
#[derive(Clone, Debug)]
pub struct Client {
    pub(crate) http: reqwest::Client,
    config: Config,
}

impl Client {
    pub fn new(config: Config) -> Self {
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .build()
            .unwrap_or_default();
        Self { http, config }
    }

    /// A client configured by [`Config::from_env`].
    pub fn from_env() -> Self {
        Self::new(Config::from_env())
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    fn url(&self, path: &str) -> String {
        format!("{}/v1{path}", self.config.base_url)
    }

    /// A lifecycle API request (`/v1{path}`) with the key and the request timeout.
    pub(crate) fn lifecycle(
        &self,
        method: reqwest::Method,
        path: &str,
    ) -> (reqwest::RequestBuilder, String) {
        self.request(method, path)
    }

    fn request(&self, method: reqwest::Method, path: &str) -> (reqwest::RequestBuilder, String) {
        let url = self.url(path);
        let mut r = self.http.request(method, &url);
        if let Some(k) = &self.config.api_key {
            r = r.header(API_KEY_HEADER, k);
        }
        if let Some(t) = self.config.request_timeout {
            r = r.timeout(t);
        }
        (r, url)
    }

    /// `GET /health`: Ok when the server answers healthy.
    pub async fn health(&self) -> Result<()> {
        let url = format!("{}/health", self.config.base_url);
        send(self.http.get(&url).timeout(Duration::from_secs(10)), &url).await?;
        Ok(())
    }

    /// What the key's tenant uses and may use (`GET /v1/usage`); an admin key names another
    /// tenant with `tenant`.
    pub async fn usage(&self, tenant: Option<&str>) -> Result<warren_api::admin::Usage> {
        let (mut r, url) = self.request(reqwest::Method::GET, "/usage");
        if let Some(t) = tenant {
            r = r.header(warren_api::admin::TENANT_HEADER, t);
        }
        json(send(r, &url).await?).await
    }

    /// Creates a sandbox and connects to it. Warren answers only once execd inside is ready, so
    /// commands can run at once.
    pub async fn create(&self, req: &CreateSandboxRequest) -> Result<Sandbox> {
        let (r, url) = self.request(reqwest::Method::POST, "/sandboxes");
        let info: SandboxInfo = json(send(r.json(req), &url).await?).await?;
        let execd = self.endpoint(&info.id, EXECD_PORT).await?;
        Ok(Sandbox::new(self.clone(), info, execd))
    }

    /// Connects to an existing sandbox.
    pub async fn connect(&self, id: &str) -> Result<Sandbox> {
        let info = self.get(id).await?;
        let execd = self.endpoint(id, EXECD_PORT).await?;
        Ok(Sandbox::new(self.clone(), info, execd))
    }

    pub async fn get(&self, id: &str) -> Result<SandboxInfo> {
        let (r, url) = self.request(reqwest::Method::GET, &format!("/sandboxes/{id}"));
        json(send(r, &url).await?).await
    }

    pub async fn list(&self, q: &ListQuery) -> Result<ListSandboxesResponse> {
        let mut params: Vec<(&str, String)> = Vec::new();
        for s in &q.states {
            params.push(("state", s.as_str().to_string()));
        }
        if !q.metadata.is_empty() {
            let m: Vec<String> = q.metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
            params.push(("metadata", m.join("&")));
        }
        if q.page > 0 {
            params.push(("page", q.page.to_string()));
        }
        if q.page_size > 0 {
            params.push(("pageSize", q.page_size.to_string()));
        }
        let (r, url) = self.request(reqwest::Method::GET, "/sandboxes");
        json(send(r.query(&params), &url).await?).await
    }

    /// Deletes (kills) a sandbox: 204, then it is Terminated.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let (r, url) = self.request(reqwest::Method::DELETE, &format!("/sandboxes/{id}"));
        send(r, &url).await?;
        Ok(())
    }

    /// Asks for a pause (202); poll [`Client::get`] for `Paused`.
    pub async fn pause(&self, id: &str) -> Result<()> {
        let (r, url) = self.request(reqwest::Method::POST, &format!("/sandboxes/{id}/pause"));
        send(r, &url).await?;
        Ok(())
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        let (r, url) = self.request(reqwest::Method::POST, &format!("/sandboxes/{id}/resume"));
        send(r, &url).await?;
        Ok(())
    }

    /// Moves the expiry to `now + after`; returns the new `expiresAt` (RFC 3339).
    pub async fn renew(&self, id: &str, after: Duration) -> Result<String> {
        let at = chrono::Utc::now()
            + chrono::Duration::from_std(after)
                .map_err(|e| Error::Protocol(format!("duration out of range: {e}")))?;
        let body = RenewExpirationRequest {
            expires_at: at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        };
        let (r, url) = self.request(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/renew-expiration"),
        );
        let resp: RenewExpirationResponse = json(send(r.json(&body), &url).await?).await?;
        Ok(resp.expires_at)
    }

    /// Merges metadata: `Some` sets a key, `None` removes it.
    pub async fn patch_metadata(
        &self,
        id: &str,
        patch: &BTreeMap<String, Option<String>>,
    ) -> Result<SandboxInfo> {
        let (r, url) = self.request(reqwest::Method::PATCH, &format!("/sandboxes/{id}/metadata"));
        json(send(r.json(patch), &url).await?).await
    }

    /// How to reach `port` inside the sandbox: a URL on the server's proxy and the headers to send.
    pub async fn endpoint(&self, id: &str, port: u16) -> Result<Endpoint> {
        let (r, url) = self.request(
            reqwest::Method::GET,
            &format!("/sandboxes/{id}/endpoints/{port}"),
        );
        json(send(r, &url).await?).await
    }
}

/// Sends a request; a non-2xx answer becomes [`Error::Api`].
pub(crate) async fn send(r: reqwest::RequestBuilder, url: &str) -> Result<reqwest::Response> {
    let resp = r.send().await.map_err(|e| Error::transport(url, e))?;
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    Err(match serde_json::from_str::<ErrorBody>(&text) {
        Ok(e) => Error::Api {
            status,
            code: e.code,
            message: e.message,
        },
        Err(_) => Error::Api {
            status,
            code: String::new(),
            message: if text.trim().is_empty() {
                format!("HTTP {status}")
            } else {
                text.trim().to_string()
            },
        },
    })
}

/// Reads a JSON body.
pub(crate) async fn json<T: DeserializeOwned>(resp: reqwest::Response) -> Result<T> {
    let bytes = resp.bytes().await.map_err(Error::Broken)?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Protocol(format!("bad JSON answer: {e}")))
}
