//! Sandbox networking on the server side: the configured default policy, the egress controller
//! (started on first need, so servers whose sandboxes never get a link never touch the firewall),
//! and the policy API — the lifecycle `/networkpolicy` routes and the egress surface that endpoint
//! port 18080 reaches (`/policy`, `/healthz`), which Warren serves itself: no sidecar, and nothing of
//! it runs inside the sandbox.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use serde::Serialize;
use warren_egress::{Egress, EgressConfig, NetworkPolicy, NetworkRule};

use crate::config::NetworkSection;
use crate::error::{ErrorKind, SandboxError};
use warren_api::ErrorCode;

pub struct Network {
    default: NetworkPolicy,
    cfg: Option<EgressConfig>,
    /// Why networking cannot work on this server, if it cannot.
    broken: Option<String>,
    egress: tokio::sync::OnceCell<Result<Arc<Egress>, String>>,
    /// Handed to the egress controller when it starts (sandboxes' timelines).
    observer: std::sync::OnceLock<Arc<dyn warren_egress::Observer>>,
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
                    upstream_ca_files: section.upstream_ca_files.clone(),
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
            observer: std::sync::OnceLock::new(),
        })
    }

    pub fn default_policy(&self) -> NetworkPolicy {
        self.default.clone()
    }

    /// The egress controller, started on first use.
    pub async fn egress(&self) -> Result<Arc<Egress>, SandboxError> {
        if let Some(why) = &self.broken {
            return Err(unavailable(why));
        }
        let cfg = self.cfg.clone();
        let observer = self.observer.get().cloned();
        let r = self
            .egress
            .get_or_init(|| async move {
                let egress = match cfg {
                    Some(cfg) => Egress::start(cfg).await.map_err(|e| e.to_string())?,
                    None => return Err("networking is not configured".to_string()),
                };
                if let Some(o) = observer {
                    egress.observe(o);
                }
                Ok(egress)
            })
            .await;
        r.clone().map_err(|e| unavailable(&e))
    }

    /// Tells the egress controller's decisions to `observer` once it starts (the first one set
    /// stays).
    pub fn observe(&self, observer: Arc<dyn warren_egress::Observer>) {
        let _ = self.observer.set(observer);
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

fn unavailable(why: &str) -> SandboxError {
    SandboxError::new(
        ErrorKind::Unavailable,
        ErrorCode::RuntimeUnavailable,
        format!("sandbox networking is unavailable on this server: {why}"),
    )
}

/// Reads a `networkPolicy` body, or a 400 saying what is wrong with it.
pub fn parse_policy(v: &serde_json::Value) -> Result<Option<NetworkPolicy>, SandboxError> {
    NetworkPolicy::from_json(v).map_err(|e| SandboxError::invalid(format!("networkPolicy: {e}")))
}

pub fn parse_rules(v: &serde_json::Value) -> Result<Vec<NetworkRule>, SandboxError> {
    warren_egress::policy::parse_rules(v)
        .map_err(|e| SandboxError::invalid(format!("egress rules: {e}")))
}

pub fn parse_targets(v: &serde_json::Value) -> Result<Vec<String>, SandboxError> {
    serde_json::from_value::<Vec<String>>(v.clone()).map_err(|_| {
        SandboxError::invalid("expected a JSON list of targets, e.g. [\"example.com\"]")
    })
}

/// A policy is worth a link only if it lets something through.
pub fn needs_link(p: &NetworkPolicy) -> bool {
    p.allows_anything()
}

/// `policy` as a runtime that enforces policies itself takes it (see [`warren_core::EgressPolicy`]),
/// or a 400 naming the first rule that names a host when the runtime enforces addresses only
/// (`names`: it has a proxy beside the sandbox that answers its DNS).
pub fn runtime_policy(
    policy: &NetworkPolicy,
    runtime: &str,
    names: bool,
) -> Result<warren_core::EgressPolicy, SandboxError> {
    use warren_egress::policy::{Action, Target};
    let mut rules = Vec::with_capacity(policy.egress.len());
    // (index, what the address-only enforcer cannot take)
    let mut beyond = None;
    for (i, rule) in policy.egress.iter().enumerate() {
        match (Target::parse(&rule.target), &rule.ports) {
            (Ok(Target::Cidr(addr, len)), None) => {
                rules.push((rule.action == Action::Allow, warren_core::Net { addr, len }))
            }
            // Never an address rule for every port: that would widen it.
            (_, Some(ports)) => {
                beyond.get_or_insert((i, format!("limited to TCP ports {ports:?}")));
            }
            _ => {
                beyond.get_or_insert((i, format!("naming the host {:?}", rule.target)));
            }
        }
    }
    if let (Some((i, what)), false) = (&beyond, names) {
        return Err(SandboxError::new(
            ErrorKind::Invalid,
            ErrorCode::ApiNotSupported,
            format!(
                "networkPolicy rule {i} ({what}): the {runtime} runtime enforces rules that name addresses or networks (CIDR), on every port, here; rules naming hosts or limited to ports need the egress proxy beside the sandbox (on Kubernetes: [kubernetes] egress_sidecar = true)"
            ),
        ));
    }
    Ok(warren_core::EgressPolicy {
        rules: serde_json::to_value(policy).unwrap_or_default(),
        addresses: beyond.is_none().then(|| warren_core::AddressPolicy {
            default_allow: policy.default_action == Action::Allow,
            rules,
        }),
    })
}

/// The header the reference egress sidecar checks; Warren accepts it (with the sandbox's token) on
/// the 18080 surface too.
pub const EGRESS_AUTH_HEADER: &str = "OPENSANDBOX-EGRESS-AUTH";

/// Where a sandbox's programs look for trusted CAs, and the variables that point the common ones
/// (OpenSSL, Python requests, curl, Node) at it.
pub const TRUST_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// A bundle of Warren's own (the image's CAs plus the vault's), writable even when the image's
/// trust store is not (the `host` image).
pub const VAULT_BUNDLE: &str = "/opt/opensandbox/ca-bundle.crt";
const ENV_FILE: &str = "/opt/opensandbox/.env";

/// Adds the vault's CA to the sandbox's trust: a bundle of Warren's own that the usual variables
/// point at for every command execd starts from now on, and the image's system bundle too when it
/// is writable (for programs that ignore those variables).
pub async fn install_ca(
    endpoint: &crate::execd_conns::ExecdEndpoint,
    pem: &str,
) -> Result<(), String> {
    use crate::sandbox_files::{read, write};
    let mut bundle = read(endpoint, TRUST_BUNDLE)
        .await
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    if !bundle.is_empty() && !bundle.ends_with(b"\n") {
        bundle.push(b'\n');
    }
    bundle.extend_from_slice(pem.as_bytes());
    write(endpoint, VAULT_BUNDLE, &bundle)
        .await
        .map_err(|e| format!("the vault's CA bundle: {e}"))?;
    if let Err(e) = write(endpoint, TRUST_BUNDLE, &bundle).await {
        tracing::debug!(error = %e, "the image's trust store is read-only; the variables point at Warren's bundle");
    }
    let mut env = read(endpoint, ENV_FILE)
        .await
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    for var in [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
    ] {
        env.extend_from_slice(format!("{var}={VAULT_BUNDLE}\n").as_bytes());
    }
    write(endpoint, ENV_FILE, &env)
        .await
        .map_err(|e| format!("execd's environment file: {e}"))
}
