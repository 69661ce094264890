//! A small HTTP client for the lifecycle API and execd, enough for `warren run` and `warren code`. (The full Rust SDK is
//! a separate crate to come.)

use std::collections::BTreeMap;

use anyhow::{bail, Context};
use futures::StreamExt;
use warren_api::execd::{EventKind, RunCommandRequest, StreamEvent};
use warren_api::lifecycle::{CreateSandboxRequest, Endpoint, Sandbox};
use warren_api::{ErrorBody, API_KEY_HEADER, EXECD_PORT};

pub struct Client {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
}

async fn check(resp: reqwest::Response, what: &str) -> anyhow::Result<reqwest::Response> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    let hint = match status.as_u16() {
        401 | 403 => {
            " (hint: pass the server's key with --api-key or OPEN_SANDBOX_API_KEY; a local server \
             started without one keeps it in <data dir>/api-key)"
        }
        503 => " (hint: the server's runtime is unavailable; try again once it is back)",
        _ => "",
    };
    match serde_json::from_str::<ErrorBody>(&text) {
        Ok(e) => bail!("{what}: {}{hint}", e.message),
        Err(_) => bail!("{what}: HTTP {}: {}{hint}", status.as_u16(), text.trim()),
    }
}

/// One line for a request that got no answer at all, with what to do about it.
fn unreachable(base: &str, what: &str, e: reqwest::Error) -> anyhow::Error {
    if e.is_connect() {
        anyhow::anyhow!(
            "{what}: cannot reach the Warren server at {base} (hint: is `warren serve` running \
             there? set --domain or OPEN_SANDBOX_DOMAIN)"
        )
    } else if e.is_timeout() {
        anyhow::anyhow!("{what}: the Warren server at {base} did not answer in time")
    } else {
        anyhow::anyhow!("{what}: the connection to {base} failed: {e}")
    }
}

impl Client {
    pub fn new(domain: &str, api_key: Option<String>) -> Self {
        let base = if domain.starts_with("http://") || domain.starts_with("https://") {
            domain.trim_end_matches('/').to_string()
        } else {
            format!("http://{}", domain.trim_end_matches('/'))
        };
        Self {
            http: reqwest::Client::new(),
            base,
            api_key,
        }
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut r = self.http.request(method, format!("{}/v1{path}", self.base));
        if let Some(k) = &self.api_key {
            r = r.header(API_KEY_HEADER, k);
        }
        r
    }

    pub async fn health(&self) -> bool {
        matches!(self.http.get(format!("{}/health", self.base)).send().await, Ok(r) if r.status().is_success())
    }

    pub async fn create(&self, req: &CreateSandboxRequest) -> anyhow::Result<Sandbox> {
        let resp = self
            .req(reqwest::Method::POST, "/sandboxes")
            .json(req)
            .send()
            .await
            .map_err(|e| unreachable(&self.base, "creating the sandbox", e))?;
        Ok(check(resp, "creating the sandbox").await?.json().await?)
    }

    pub async fn delete(&self, id: &str) -> anyhow::Result<()> {
        let resp = self
            .req(reqwest::Method::DELETE, &format!("/sandboxes/{id}"))
            .send()
            .await
            .map_err(|e| unreachable(&self.base, "deleting the sandbox", e))?;
        check(resp, "deleting the sandbox").await?;
        Ok(())
    }

    pub async fn endpoint(&self, id: &str, port: u16) -> anyhow::Result<Endpoint> {
        let resp = self
            .req(
                reqwest::Method::GET,
                &format!("/sandboxes/{id}/endpoints/{port}"),
            )
            .send()
            .await
            .map_err(|e| unreachable(&self.base, &format!("sandbox {id}"), e))?;
        Ok(check(resp, &format!("sandbox {id}")).await?.json().await?)
    }

    /// Runs a foreground command, calling `on_event` for each event; returns the exit code.
    pub async fn run_command(
        &self,
        id: &str,
        cmd: RunCommandRequest,
        mut on_event: impl FnMut(&StreamEvent),
    ) -> anyhow::Result<i32> {
        let mut code = None;
        self.execd_stream(id, "/command", &cmd, "running the command", |ev| {
            match ev.kind {
                EventKind::ExecutionComplete => code = Some(0),
                EventKind::Error => {
                    code = Some(
                        ev.error
                            .as_ref()
                            .and_then(|e| e.evalue.parse().ok())
                            .unwrap_or(1),
                    );
                }
                _ => {}
            }
            on_event(ev);
        })
        .await?;
        code.context("the command's output ended without a result")
    }

    /// POSTs `body` to execd's `path` in sandbox `id` and calls `on_event` for every event of the
    /// stream until it ends.
    pub async fn execd_stream<B: serde::Serialize>(
        &self,
        id: &str,
        path: &str,
        body: &B,
        what: &str,
        mut on_event: impl FnMut(&StreamEvent),
    ) -> anyhow::Result<()> {
        let ep = self.endpoint(id, EXECD_PORT).await?;
        let mut r = self
            .http
            .post(format!("http://{}{path}", ep.endpoint))
            .json(body);
        for (k, v) in &ep.headers {
            r = r.header(k, v);
        }
        let resp = check(
            r.send()
                .await
                .map_err(|e| unreachable(&self.base, what, e))?,
            what,
        )
        .await?;
        let mut stream = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk.map_err(|e| {
                anyhow::anyhow!(
                    "{what}: the output stream broke off ({e}); the sandbox may have ended or \
                     expired meanwhile"
                )
            })?);
            while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let line = String::from_utf8_lossy(&line);
                let line = line.trim().trim_start_matches("data:").trim();
                if line.is_empty() {
                    continue;
                }
                if let Ok(ev) = serde_json::from_str::<StreamEvent>(line) {
                    on_event(&ev);
                }
            }
        }
        Ok(())
    }
}

/// The API key stored by a server started on `data_dir` without one configured.
pub fn stored_key(data_dir: &std::path::Path) -> Option<String> {
    std::fs::read_to_string(warren_server::auth::key_file(data_dir))
        .ok()
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
}

/// Where a running server is: `--domain`/`OPEN_SANDBOX_DOMAIN`, else the default address; the key from
/// `--api-key`, `OPEN_SANDBOX_API_KEY`, `WARREN_API_KEY`, else the one a local server generated.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// Server address (host:port) [env: OPEN_SANDBOX_DOMAIN] [default: 127.0.0.1:8080]
    #[arg(long)]
    pub domain: Option<String>,
    /// API key [env: OPEN_SANDBOX_API_KEY, WARREN_API_KEY; else the key a local server generated]
    #[arg(long)]
    pub api_key: Option<String>,
    /// Data dir of a local server, to find its generated key [env: WARREN_DATA_DIR]
    #[arg(long)]
    pub data_dir: Option<std::path::PathBuf>,
}

impl ServerArgs {
    pub fn client(&self) -> Client {
        use warren_server::config::{self, EnvSource, ProcessEnv};
        let env = ProcessEnv;
        let data_dir = self
            .data_dir
            .clone()
            .or_else(|| env.get(config::env::DATA_DIR).map(Into::into))
            .unwrap_or_else(|| config::default_data_dir(&env));
        let key = self
            .api_key
            .clone()
            .or_else(|| env.get("OPEN_SANDBOX_API_KEY"))
            .or_else(|| env.get(config::env::API_KEY))
            .or_else(|| stored_key(&data_dir));
        let domain = self
            .domain
            .clone()
            .or_else(|| env.get("OPEN_SANDBOX_DOMAIN"))
            .unwrap_or_else(|| config::DEFAULT_LISTEN.to_string());
        Client::new(&domain, key)
    }
}

pub fn env_map(pairs: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    pairs
        .iter()
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("--env {p:?} is not KEY=VALUE"))
        })
        .collect()
}
