//! A handle on one sandbox: its lifecycle calls, and the base of every execd call (commands, files,
//! code), which go through the server's endpoint proxy with the sandbox's token.

use std::time::Duration;

use warren_api::execd::Metrics;
use warren_api::lifecycle::{Endpoint, Sandbox as SandboxInfo};

use crate::client::{json, send, Client};
use crate::error::Result;

/// A connected sandbox. Clone it freely; clones share the client's connections.
#[derive(Clone, Debug)]
pub struct Sandbox {
    client: Client,
    info: SandboxInfo,
    /// `http://host:port/sandboxes/{id}/proxy/44772`.
    execd_base: String,
    execd_headers: reqwest::header::HeaderMap,
}

impl Sandbox {
    pub(crate) fn new(client: Client, info: SandboxInfo, execd: Endpoint) -> Self {
        let execd_base = if execd.endpoint.starts_with("http") {
            execd.endpoint.trim_end_matches('/').to_string()
        } else {
            format!("http://{}", execd.endpoint.trim_end_matches('/'))
        };
        let mut execd_headers = reqwest::header::HeaderMap::new();
        for (k, v) in &execd.headers {
            if let (Ok(k), Ok(v)) = (
                reqwest::header::HeaderName::from_bytes(k.as_bytes()),
                reqwest::header::HeaderValue::from_str(v),
            ) {
                execd_headers.insert(k, v);
            }
        }
        Self {
            client,
            info,
            execd_base,
            execd_headers,
        }
    }

    pub fn id(&self) -> &str {
        &self.info.id
    }

    /// The sandbox as last seen (at create/connect or the last [`Sandbox::refresh`]).
    pub fn info(&self) -> &SandboxInfo {
        &self.info
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Fetches the sandbox's current state.
    pub async fn refresh(&mut self) -> Result<&SandboxInfo> {
        self.info = self.client.get(&self.info.id).await?;
        Ok(&self.info)
    }

    /// Deletes the sandbox and everything in it.
    pub async fn kill(&self) -> Result<()> {
        self.client.delete(&self.info.id).await
    }

    pub async fn pause(&self) -> Result<()> {
        self.client.pause(&self.info.id).await
    }

    pub async fn resume(&self) -> Result<()> {
        self.client.resume(&self.info.id).await
    }

    /// Moves the expiry to `now + after`.
    pub async fn renew(&self, after: Duration) -> Result<String> {
        self.client.renew(&self.info.id, after).await
    }

    /// How to reach `port` inside the sandbox from outside.
    pub async fn endpoint(&self, port: u16) -> Result<Endpoint> {
        self.client.endpoint(&self.info.id, port).await
    }

    /// CPU and memory of the sandbox's own cgroup.
    pub async fn metrics(&self) -> Result<Metrics> {
        let (r, url) = self.execd(reqwest::Method::GET, "/metrics");
        json(send(r, &url).await?).await
    }

    /// True when execd inside answers.
    pub async fn ping(&self) -> bool {
        let (r, url) = self.execd(reqwest::Method::GET, "/ping");
        send(r.timeout(Duration::from_secs(5)), &url).await.is_ok()
    }

    /// A request to execd's `path` (which may carry a query), with the sandbox's token.
    pub(crate) fn execd(
        &self,
        method: reqwest::Method,
        path: &str,
    ) -> (reqwest::RequestBuilder, String) {
        let url = format!("{}{path}", self.execd_base);
        let r = self
            .client
            .http
            .request(method, &url)
            .headers(self.execd_headers.clone());
        (r, url)
    }

    /// execd's base as a WebSocket URL, and the headers every request carries.
    pub(crate) fn execd_ws_base(&self) -> (String, &reqwest::header::HeaderMap) {
        let ws = if let Some(rest) = self.execd_base.strip_prefix("https://") {
            format!("wss://{rest}")
        } else {
            format!("ws://{}", self.execd_base.trim_start_matches("http://"))
        };
        (ws, &self.execd_headers)
    }

    /// [`Sandbox::execd`] with the client's request timeout, for calls that are not streams.
    pub(crate) fn execd_call(
        &self,
        method: reqwest::Method,
        path: &str,
    ) -> (reqwest::RequestBuilder, String) {
        let (r, url) = self.execd(method, path);
        match self.client.config().request_timeout {
            Some(t) => (r.timeout(t), url),
            None => (r, url),
        }
    }
}
