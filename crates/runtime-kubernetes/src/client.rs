//! A small Kubernetes API client for the objects Warren writes (Pods, NetworkPolicies) in one
//! namespace: JSON over HTTPS with the service account's bearer token and CA in a cluster, or over
//! whatever `[kubernetes] api_server` names outside one. Lists and watches take label selectors;
//! a watch is a stream of JSON lines (`{"type", "object"}`), as the API server sends it.
//!
//! Warren's own client rather than kube-rs, as for Docker: the calls are few (create, get, list,
//! watch, delete) and `reqwest` with rustls is in Warren's build already.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;
use warren_env::EnvVars;

/// Time allowed for an ordinary call (a watch has its own, longer, bound).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Where a pod finds its service account's credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("the Kubernetes API server at {endpoint} cannot be reached: {reason}")]
    Unavailable { endpoint: String, reason: String },
    #[error("Kubernetes: {message} (HTTP {status}{})", reason.as_deref().map(|r| format!(", {r}")).unwrap_or_default())]
    Api {
        status: u16,
        reason: Option<String>,
        message: String,
    },
    #[error("Kubernetes: {0}")]
    Protocol(String),
}

impl KubeError {
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Where the API server is and how to authenticate to it.
#[derive(Debug, Clone)]
pub struct Connection {
    /// `https://host:port` (or `http://` for a local test server).
    pub server: String,
    pub token: Option<String>,
    /// PEM bundle of the CA the server's certificate is checked against.
    pub ca_pem: Option<Vec<u8>>,
}

impl Connection {
    /// In a pod: `KUBERNETES_SERVICE_HOST`/`_PORT` and the service account's token and CA.
    /// `None` outside a cluster.
    pub fn in_cluster() -> Option<Self> {
        Self::in_cluster_from(warren_env::var, Path::new(SERVICE_ACCOUNT_DIR))
    }

    fn in_cluster_from(env: impl Fn(&str) -> Option<String>, dir: &Path) -> Option<Self> {
        let host = env(EnvVars::KUBERNETES_SERVICE_HOST).filter(|h| !h.is_empty())?;
        let port = env(EnvVars::KUBERNETES_SERVICE_PORT)
            .unwrap_or_else(|| warren_env::DEFAULT_KUBERNETES_SERVICE_PORT.into());
        let token = std::fs::read_to_string(dir.join("token")).ok()?;
        let ca_pem = std::fs::read(dir.join("ca.crt")).ok();
        // An IPv6 service address needs brackets in a URL.
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        Some(Self {
            server: format!("https://{host}:{port}"),
            token: Some(token.trim().to_string()),
            ca_pem,
        })
    }

    /// The namespace of the pod this process runs in, when it runs in one.
    pub fn in_cluster_namespace() -> Option<String> {
        std::fs::read_to_string(PathBuf::from(SERVICE_ACCOUNT_DIR).join("namespace"))
            .ok()
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
    }
}

/// One watch event.
#[derive(Debug, Clone)]
pub struct WatchEvent {
    /// `ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK` or `ERROR`.
    pub kind: String,
    pub object: Value,
}

pub struct Client {
    http: reqwest::Client,
    connection: Connection,
}

impl Client {
    pub fn new(connection: Connection) -> Result<Self, KubeError> {
        let mut builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(10));
        if let Some(pem) = &connection.ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| KubeError::Protocol(format!("the cluster's CA: {e}")))?;
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http = builder
            .build()
            .map_err(|e| KubeError::Protocol(format!("building the HTTP client: {e}")))?;
        Ok(Self { http, connection })
    }

    pub fn server(&self) -> &str {
        &self.connection.server
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.connection.server));
        if let Some(token) = &self.connection.token {
            req = req.bearer_auth(token);
        }
        req
    }

    fn unavailable(&self, e: impl std::fmt::Display) -> KubeError {
        KubeError::Unavailable {
            endpoint: self.connection.server.clone(),
            reason: e.to_string(),
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<Value, KubeError> {
        let resp = req
            .timeout(CALL_TIMEOUT)
            .send()
            .await
            .map_err(|e| self.unavailable(e))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| self.unavailable(e))?;
        let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(value);
        }
        Err(status_error(status.as_u16(), &value))
    }

    pub async fn get(&self, path: &str) -> Result<Value, KubeError> {
        self.send(self.request(reqwest::Method::GET, path)).await
    }

    /// The objects under `path` whose labels match `selector`, as one `…List` (its
    /// `metadata.resourceVersion` is where a watch picks up). Read in pages of [`LIST_PAGE`], as
    /// client-go's reflectors do, so that a namespace of 100,000 Pods is not one answer the API
    /// server must build and hold at once; the pages are one consistent snapshot (the first
    /// page's version). A continue token that expired meanwhile (410) starts the list over.
    pub async fn list(&self, path: &str, selector: &str) -> Result<Value, KubeError> {
        let mut attempts = 0;
        'over: loop {
            attempts += 1;
            let mut items: Vec<Value> = Vec::new();
            let mut first: Option<Value> = None;
            let mut token = String::new();
            loop {
                let limit = LIST_PAGE.to_string();
                let mut query = vec![("labelSelector", selector), ("limit", limit.as_str())];
                if !token.is_empty() {
                    query.push(("continue", token.as_str()));
                }
                let page = match self
                    .send(self.request(reqwest::Method::GET, path).query(&query))
                    .await
                {
                    Ok(p) => p,
                    Err(e) if e.status() == Some(410) && attempts < 3 => continue 'over,
                    Err(e) => return Err(e),
                };
                items.extend(page["items"].as_array().into_iter().flatten().cloned());
                token = page["metadata"]["continue"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let page_meta = first.get_or_insert(page);
                if token.is_empty() {
                    let mut list = page_meta.clone();
                    list["items"] = Value::Array(items);
                    if let Some(m) = list["metadata"].as_object_mut() {
                        m.remove("continue");
                    }
                    return Ok(list);
                }
            }
        }
    }

    pub async fn create(&self, path: &str, object: &Value) -> Result<Value, KubeError> {
        self.send(self.request(reqwest::Method::POST, path).json(object))
            .await
    }

    /// A JSON merge patch (RFC 7386) of the object at `path`.
    pub async fn merge_patch(&self, path: &str, patch: &Value) -> Result<Value, KubeError> {
        self.send(
            self.request(reqwest::Method::PATCH, path)
                .header(
                    reqwest::header::CONTENT_TYPE,
                    "application/merge-patch+json",
                )
                .body(patch.to_string()),
        )
        .await
    }

    /// Deletes the object; one already gone is fine.
    pub async fn delete(&self, path: &str, grace_seconds: u32) -> Result<(), KubeError> {
        let body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": grace_seconds,
            "propagationPolicy": "Background",
        });
        match self
            .send(self.request(reqwest::Method::DELETE, path).json(&body))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.status() == Some(404) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Events from `resource_version` on, for objects under `path` matching `selector`, until the
    /// server ends the watch (after `timeout`) or `on_event` returns false.
    pub async fn watch(
        &self,
        path: &str,
        selector: &str,
        resource_version: &str,
        timeout: Duration,
        mut on_event: impl FnMut(WatchEvent) -> bool,
    ) -> Result<(), KubeError> {
        let query = [
            ("watch", "1"),
            ("labelSelector", selector),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", &timeout.as_secs().to_string()),
        ];
        let resp = self
            .request(reqwest::Method::GET, path)
            .query(&query)
            // The server closes the watch at `timeoutSeconds`; a little longer than that here.
            .timeout(timeout + Duration::from_secs(15))
            .send()
            .await
            .map_err(|e| self.unavailable(e))?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.bytes().await.unwrap_or_default();
            let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            return Err(status_error(status.as_u16(), &value));
        }
        let mut stream = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.unavailable(e))?;
            buf.extend_from_slice(&chunk);
            while let Some(end) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=end).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let event: Value = serde_json::from_slice(&line)
                    .map_err(|e| KubeError::Protocol(format!("a watch event: {e}")))?;
                let event = WatchEvent {
                    kind: event["type"].as_str().unwrap_or_default().to_string(),
                    object: event["object"].clone(),
                };
                if !on_event(event) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// Objects per page of a list.
pub const LIST_PAGE: usize = 500;

/// The API server's `Status` body as an error.
fn status_error(status: u16, body: &Value) -> KubeError {
    KubeError::Api {
        status,
        reason: body["reason"].as_str().map(str::to_string),
        message: body["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("HTTP {status}")),
    }
}

/// Encodes a label selector value set (`k=v,k2=v2`).
pub fn selector(labels: &[(&str, &str)]) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_cluster_configuration_is_found_from_the_pod_s_environment() {
        let dir = std::env::temp_dir().join(format!("warren-k8s-sa-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("token"), "tok\n").expect("token");
        std::fs::write(dir.join("ca.crt"), "pem").expect("ca");
        let env = |k: &str| match k {
            "KUBERNETES_SERVICE_HOST" => Some("10.0.0.1".to_string()),
            "KUBERNETES_SERVICE_PORT" => Some("6443".to_string()),
            _ => None,
        };
        let c = Connection::in_cluster_from(env, &dir).expect("in cluster");
        assert_eq!(c.server, "https://10.0.0.1:6443");
        assert_eq!(c.token.as_deref(), Some("tok"));
        assert_eq!(c.ca_pem.as_deref(), Some(&b"pem"[..]));
        let v6 = |k: &str| (k == "KUBERNETES_SERVICE_HOST").then(|| "fd00::1".to_string());
        assert_eq!(
            Connection::in_cluster_from(v6, &dir).expect("v6").server,
            "https://[fd00::1]:443"
        );
        assert!(Connection::in_cluster_from(|_| None, &dir).is_none());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
