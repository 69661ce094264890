//! Sandbox networking on the server side: the configured default policy, the egress controller
//! (started on first need, so servers whose sandboxes never get a link never touch the firewall),
//! and the policy API — the lifecycle `/networkpolicy` routes and the egress surface that endpoint
//! port 18080 reaches (`/policy`, `/healthz`), which Warren serves itself: no sidecar, and nothing of
//! it runs inside the sandbox.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::http::StatusCode;
use serde::Serialize;
use warren_egress::{Egress, EgressConfig, NetworkPolicy, NetworkRule};

use crate::config::NetworkSection;
use crate::error::ApiError;
use warren_api::ErrorCode;

pub struct Network {
    default: NetworkPolicy,
    cfg: Option<EgressConfig>,
    /// Why networking cannot work on this server, if it cannot.
    broken: Option<String>,
    egress: tokio::sync::OnceCell<Result<Arc<Egress>, String>>,
}

/// `GET /policy` and the lifecycle `networkpolicy` routes answer this.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    pub status: &'static str,
    pub mode: &'static str,
    pub enforcement_mode: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub policy: NetworkPolicy,
}

impl PolicyStatus {
    pub fn of(policy: NetworkPolicy) -> Self {
        Self {
            status: "ok",
            mode: policy.mode(),
            enforcement_mode: "dns+nft",
            reason: None,
            policy,
        }
    }
}

fn upstream_from_resolv_conf() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .find_map(|ip| ip.trim().parse::<std::net::IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
}

fn parse_subnet(s: &str) -> Result<(Ipv4Addr, u8), String> {
    let (ip, len) = s
        .split_once('/')
        .ok_or_else(|| format!("[network] subnet {s:?} is not a.b.c.d/len"))?;
    let ip: Ipv4Addr = ip
        .parse()
        .map_err(|_| format!("[network] subnet {s:?}: bad address"))?;
    let len: u8 = len
        .parse()
        .ok()
        .filter(|l| (8..=28).contains(l))
        .ok_or_else(|| format!("[network] subnet {s:?}: the prefix must be /8../28"))?;
    let mask = u32::MAX << (32 - len);
    Ok((Ipv4Addr::from(u32::from(ip) & mask), len))
}

impl Network {
    pub fn new(section: &NetworkSection, data_dir: &std::path::Path) -> anyhow::Result<Self> {
        let default = match section.default_action.as_str() {
            "deny" => NetworkPolicy::deny_all(),
            "allow" => NetworkPolicy::allow_all(),
            other => anyhow::bail!(
                "[network] default_action must be \"deny\" or \"allow\", not {other:?}"
            ),
        };
        let subnet = parse_subnet(&section.subnet).map_err(anyhow::Error::msg)?;
        let upstream = match &section.dns_upstream {
            Some(u) => Some(
                u.parse::<SocketAddr>()
                    .map_err(|_| anyhow::anyhow!("[network] dns_upstream {u:?} is not ip:port"))?,
            ),
            None => upstream_from_resolv_conf(),
        };
        // One table per data dir, so two servers on a host keep out of each other's rules.
        let tag: u32 = data_dir
            .to_string_lossy()
            .bytes()
            .fold(2166136261u32, |h, b| {
                (h ^ u32::from(b)).wrapping_mul(16777619)
            });
        let (cfg, broken) = match upstream {
            Some(upstream) => (
                Some(EgressConfig {
                    subnet,
                    upstream,
                    table: format!("warren_{:08x}", tag),
                    link_prefix: format!("w{:04x}-", tag & 0xffff),
                }),
                None,
            ),
            None => (
                None,
                Some("no DNS upstream: set [network] dns_upstream or a nameserver in /etc/resolv.conf".to_string()),
            ),
        };
        Ok(Self {
            default,
            cfg,
            broken,
            egress: tokio::sync::OnceCell::new(),
        })
    }

    pub fn default_policy(&self) -> NetworkPolicy {
        self.default.clone()
    }

    /// The egress controller, started on first use.
    pub async fn egress(&self) -> Result<Arc<Egress>, ApiError> {
        if let Some(why) = &self.broken {
            return Err(unavailable(why));
        }
        let cfg = self.cfg.clone();
        let r = self
            .egress
            .get_or_init(|| async move {
                match cfg {
                    Some(cfg) => Egress::start(cfg).await.map_err(|e| e.to_string()),
                    None => Err("networking is not configured".to_string()),
                }
            })
            .await;
        r.clone().map_err(|e| unavailable(&e))
    }

    /// The controller if it was started (for teardown paths, which must not start it).
    pub fn started(&self) -> Option<Arc<Egress>> {
        self.egress.get().and_then(|r| r.as_ref().ok().cloned())
    }

    /// The server is stopping: with no linked sandbox left, its firewall table goes too (with linked
    /// sandboxes it stays, so they keep their rules until the next start re-adopts them).
    pub fn shutdown(&self) {
        if let Some(e) = self.started() {
            if e.sandbox_ids().is_empty() {
                e.shutdown();
            }
        }
    }
}

fn unavailable(why: &str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::RuntimeUnavailable,
        format!("sandbox networking is unavailable on this server: {why}"),
    )
}

/// Reads a `networkPolicy` body, or a 400 saying what is wrong with it.
pub fn parse_policy(v: &serde_json::Value) -> Result<Option<NetworkPolicy>, ApiError> {
    NetworkPolicy::from_json(v).map_err(|e| ApiError::invalid(format!("networkPolicy: {e}")))
}

pub fn parse_rules(v: &serde_json::Value) -> Result<Vec<NetworkRule>, ApiError> {
    warren_egress::policy::parse_rules(v)
        .map_err(|e| ApiError::invalid(format!("egress rules: {e}")))
}

pub fn parse_targets(v: &serde_json::Value) -> Result<Vec<String>, ApiError> {
    serde_json::from_value::<Vec<String>>(v.clone())
        .map_err(|_| ApiError::invalid("expected a JSON list of targets, e.g. [\"example.com\"]"))
}

/// A policy is worth a link only if it lets something through.
pub fn needs_link(p: &NetworkPolicy) -> bool {
    p.allows_anything()
}

/// The header the reference egress sidecar checks; Warren accepts it (with the sandbox's token) on
/// the 18080 surface too.
pub const EGRESS_AUTH_HEADER: &str = "OPENSANDBOX-EGRESS-AUTH";

/// A JSON body that may be empty.
fn body_json(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(serde_json::Value::Null);
    }
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

/// One call on a sandbox's policy: `GET`, `PUT`/`POST` (replace; an empty body or `null` goes back
/// to the server's default), `PATCH` (merge rules), `DELETE` (remove rules by target).
pub async fn policy_call(
    sandboxes: &crate::sandboxes::Sandboxes,
    id: &str,
    method: &http::Method,
    body: &[u8],
) -> Result<PolicyStatus, ApiError> {
    let policy = match *method {
        http::Method::GET => sandboxes.network_policy(id)?,
        http::Method::PUT | http::Method::POST => {
            let new = parse_policy(&body_json(body)?)?;
            let fallback = sandboxes.default_network_policy();
            sandboxes
                .update_network_policy(id, |p| *p = new.unwrap_or(fallback))
                .await?
        }
        http::Method::PATCH => {
            let rules = parse_rules(&body_json(body)?)?;
            sandboxes
                .update_network_policy(id, |p| p.merge(rules))
                .await?
        }
        http::Method::DELETE => {
            let targets = parse_targets(&body_json(body)?)?;
            sandboxes
                .update_network_policy(id, |p| p.remove(&targets))
                .await?
        }
        _ => {
            return Err(ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorCode::InvalidParameter,
                "use GET, PUT, POST, PATCH or DELETE",
            ))
        }
    };
    Ok(PolicyStatus::of(policy))
}
