//! A sandbox's egress policy: what it may reach on the network (`/sandboxes/{id}/networkpolicy`).
//! Changes are in force, including for open connections, when the call returns.

use serde::{Deserialize, Serialize};

use crate::client::{json, send};
use crate::error::Result;
use crate::sandbox::Sandbox;

/// One rule: `target` is a name (`pypi.org`), a wildcard (`*.github.com`), an address or a CIDR;
/// `ports` limits an address or CIDR rule to those TCP ports, and a rule of ports alone (an empty
/// target) covers every destination on them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkRule {
    /// `allow` or `deny`.
    pub action: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub target: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<u16>>,
}

impl NetworkRule {
    pub fn allow(target: impl Into<String>) -> Self {
        Self {
            action: "allow".into(),
            target: target.into(),
            ports: None,
        }
    }

    pub fn deny(target: impl Into<String>) -> Self {
        Self {
            action: "deny".into(),
            target: target.into(),
            ports: None,
        }
    }

    /// The rule limited to TCP `ports` (`NetworkRule::allow("10.0.0.5").on_ports([443])`).
    pub fn on_ports(mut self, ports: impl IntoIterator<Item = u16>) -> Self {
        self.ports = Some(ports.into_iter().collect());
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    /// `allow` or `deny`: what happens to everything no rule names.
    pub default_action: String,
    #[serde(default)]
    pub egress: Vec<NetworkRule>,
}

/// The policy as the server reports it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    pub status: String,
    /// `deny_all`, `allow_all` or `rules`.
    pub mode: String,
    pub enforcement_mode: String,
    pub policy: NetworkPolicy,
}

impl Sandbox {
    async fn policy_call(
        &self,
        method: reqwest::Method,
        body: Option<serde_json::Value>,
    ) -> Result<PolicyStatus> {
        let client = self.client();
        let (mut r, url) =
            client.lifecycle(method, &format!("/sandboxes/{}/networkpolicy", self.id()));
        if let Some(b) = body {
            r = r.json(&b);
        }
        json(send(r, &url).await?).await
    }

    pub async fn egress_policy(&self) -> Result<PolicyStatus> {
        self.policy_call(reqwest::Method::GET, None).await
    }

    /// Replaces the whole policy.
    pub async fn set_egress_policy(&self, policy: &NetworkPolicy) -> Result<PolicyStatus> {
        self.policy_call(reqwest::Method::PUT, serde_json::to_value(policy).ok())
            .await
    }

    /// Adds or replaces rules (by target); the default action stays.
    pub async fn patch_egress_rules(&self, rules: &[NetworkRule]) -> Result<PolicyStatus> {
        self.policy_call(reqwest::Method::PATCH, serde_json::to_value(rules).ok())
            .await
    }

    /// Removes the rules for these targets (absent ones are fine).
    pub async fn delete_egress_rules(&self, targets: &[&str]) -> Result<PolicyStatus> {
        self.policy_call(reqwest::Method::DELETE, serde_json::to_value(targets).ok())
            .await
    }
}
