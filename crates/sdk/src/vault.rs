//! The credential vault of a sandbox with the credential proxy on (`credentialProxy.enabled`):
//! secrets and the bindings that put them into matching HTTPS requests on the wire. Reached through
//! the sandbox's egress endpoint (port 18080). Answers are sanitized: names, types, revisions — never
//! a secret's value.

use serde::Deserialize;
use serde_json::Value;

use crate::client::{json, send};
use crate::error::Result;
use crate::sandbox::Sandbox;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CredentialMeta {
    pub name: String,
    pub source_type: String,
    pub revision: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BindingMeta {
    pub name: String,
    pub revision: u64,
    #[serde(rename = "match")]
    pub matcher: Value,
    pub auth: Value,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct VaultState {
    pub revision: u64,
    pub credentials: Vec<CredentialMeta>,
    pub bindings: Vec<BindingMeta>,
}

impl Sandbox {
    async fn vault_request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<reqwest::Response> {
        let ep = self.endpoint(warren_api::EGRESS_PORT).await?;
        let base = if ep.endpoint.starts_with("http") {
            ep.endpoint.clone()
        } else {
            format!("http://{}", ep.endpoint)
        };
        let url = format!("{base}/credential-vault{path}");
        let mut r = self.client().http.request(method, &url);
        for (k, v) in &ep.headers {
            r = r.header(k, v);
        }
        if let Some(b) = body {
            r = r.json(b);
        }
        send(r, &url).await
    }

    /// Creates (or replaces) the vault: `{"credentials": [{name, source: {type: "inline", value}}],
    /// "bindings": [{name, match: {hosts, …}, auth: {type, …}}]}`.
    pub async fn create_vault(&self, body: &Value) -> Result<VaultState> {
        json(
            self.vault_request(reqwest::Method::POST, "", Some(body))
                .await?,
        )
        .await
    }

    pub async fn vault(&self) -> Result<VaultState> {
        json(self.vault_request(reqwest::Method::GET, "", None).await?).await
    }

    /// `{"expectedRevision"?, "credentials": {add, replace, delete}, "bindings": {…}}`, all or nothing.
    pub async fn patch_vault(&self, body: &Value) -> Result<VaultState> {
        json(
            self.vault_request(reqwest::Method::PATCH, "", Some(body))
                .await?,
        )
        .await
    }

    pub async fn delete_vault(&self) -> Result<()> {
        self.vault_request(reqwest::Method::DELETE, "", None)
            .await?;
        Ok(())
    }

    pub async fn vault_credential(&self, name: &str) -> Result<CredentialMeta> {
        json(
            self.vault_request(reqwest::Method::GET, &format!("/credentials/{name}"), None)
                .await?,
        )
        .await
    }

    pub async fn vault_binding(&self, name: &str) -> Result<BindingMeta> {
        json(
            self.vault_request(reqwest::Method::GET, &format!("/bindings/{name}"), None)
                .await?,
        )
        .await
    }
}
