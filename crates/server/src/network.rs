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
use crate::error::{ErrorKind, SandboxError};
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

/// A JSON body that may be empty.
fn body_json(body: &[u8]) -> Result<serde_json::Value, SandboxError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(serde_json::Value::Null);
    }
    serde_json::from_slice(body)
        .map_err(|e| SandboxError::invalid(format!("invalid JSON body: {e}")))
}

/// One call on a sandbox's policy: `GET`, `PUT`/`POST` (replace; an empty body or `null` goes back
/// to the server's default), `PATCH` (merge rules), `DELETE` (remove rules by target).
pub async fn policy_call(
    sandboxes: &crate::sandboxes::Sandboxes,
    id: &str,
    method: &http::Method,
    body: &[u8],
) -> Result<PolicyStatus, SandboxError> {
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
            return Err(SandboxError::new(
                ErrorKind::MethodNotAllowed,
                ErrorCode::InvalidParameter,
                "use GET, PUT, POST, PATCH or DELETE",
            ))
        }
    };
    Ok(PolicyStatus::of(policy))
}

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

/// Which API a vault call came through: the two agree on what the vault holds and differ in codes,
/// as the protocol's two specs do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VaultSurface {
    /// Port 18080, the reference sidecar's API: `POST` replaces a vault, a stale revision is 409,
    /// a sandbox without the credential proxy is 412, errors are plain text.
    Sidecar,
    /// `/sandboxes/{id}/credential-vault` on the lifecycle API: `POST` only creates (409 over an
    /// existing vault), a stale revision is 412, reading a sandbox without a vault shows an empty
    /// one, and the first create starts the credential proxy (see
    /// `Sandboxes::enable_credential_proxy`).
    Lifecycle,
}

/// The credential vault API: `/credential-vault` (POST creates, GET, PATCH, DELETE) and
/// `/credential-vault/credentials[/{name}]`, `/credential-vault/bindings[/{name}]`, on either
/// [`VaultSurface`]. Answers only sanitized state.
pub async fn vault_call(
    network: &Network,
    id: &str,
    method: &http::Method,
    sub: &str,
    body: &[u8],
    surface: VaultSurface,
) -> Result<(StatusCode, Option<serde_json::Value>), SandboxError> {
    use warren_egress::vault::{Vault, VaultError};
    let lifecycle = surface == VaultSurface::Lifecycle;
    let parts: Vec<&str> = sub.split('/').filter(|p| !p.is_empty()).collect();
    let proxy_on = network
        .started()
        .is_some_and(|e| e.has_credential_proxy(id));
    if lifecycle && !proxy_on && parts.is_empty() {
        // No vault was ever possible here: reads show an empty one, a delete has nothing to do.
        match *method {
            http::Method::GET => return Ok((StatusCode::OK, Some(Vault::default().state_json()))),
            http::Method::DELETE => return Ok((StatusCode::NO_CONTENT, None)),
            _ => {}
        }
    }
    let not_enabled = |message: String| {
        SandboxError::new(
            ErrorKind::PreconditionFailed,
            ErrorCode::VaultNotEnabled,
            message,
        )
    };
    let Some(egress) = network.started() else {
        return Err(not_enabled(
            "the credential proxy is not running for this sandbox".to_string(),
        ));
    };
    let json = || -> Result<serde_json::Value, SandboxError> { body_json(body) };
    let result = match (method.clone(), parts.as_slice()) {
        (http::Method::POST, []) | (http::Method::PUT, []) => {
            let v = Vault::create(&json()?);
            egress.with_vault(id, move |slot| {
                let v = v?;
                if lifecycle && slot.is_some() {
                    return Err(VaultError::Exists);
                }
                let state = v.state_json();
                *slot = Some(v);
                Ok((StatusCode::CREATED, Some(state)))
            })
        }
        (http::Method::PATCH, []) if lifecycle => {
            let b = json()?;
            egress.with_vault(id, move |slot| match slot {
                Some(v) => {
                    v.patch(&b)?;
                    Ok((StatusCode::OK, Some(v.state_json())))
                }
                None => Err(VaultError::NotFound("credential vault".into())),
            })
        }
        (http::Method::GET, []) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(
                    slot.as_ref()
                        .map(|v| v.state_json())
                        .unwrap_or_else(|| Vault::default().state_json()),
                ),
            ))
        }),
        (http::Method::PATCH, []) => {
            let b = json()?;
            egress.with_vault(id, move |slot| {
                let v = slot.get_or_insert_with(Vault::default);
                v.patch(&b)?;
                Ok((StatusCode::OK, Some(v.state_json())))
            })
        }
        (http::Method::DELETE, []) => egress.with_vault(id, |slot| {
            *slot = None;
            Ok((StatusCode::NO_CONTENT, None))
        }),
        (http::Method::GET, ["credentials"]) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(slot.clone().unwrap_or_default().credentials_json()),
            ))
        }),
        (http::Method::GET, ["bindings"]) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(slot.clone().unwrap_or_default().bindings_json()),
            ))
        }),
        (http::Method::GET, ["credentials", name]) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(slot.clone().unwrap_or_default().credential_json(name)?),
            ))
        }),
        (http::Method::GET, ["bindings", name]) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(slot.clone().unwrap_or_default().binding_json(name)?),
            ))
        }),
        _ => {
            return Err(SandboxError::new(
                ErrorKind::NotFound,
                ErrorCode::VaultNotFound,
                format!("no credential-vault route {method} /{sub}"),
            ))
        }
    };
    result.map_err(|e| {
        let (kind, code) = match &e {
            warren_egress::EgressError::Vault(VaultError::Exists) => {
                (ErrorKind::Conflict, ErrorCode::VaultExists)
            }
            // The lifecycle spec's code for a stale revision; the sidecar's is 409.
            warren_egress::EgressError::Vault(VaultError::Conflict { .. }) if lifecycle => (
                ErrorKind::PreconditionFailed,
                ErrorCode::VaultRevisionMismatch,
            ),
            warren_egress::EgressError::Vault(VaultError::Conflict { .. }) => {
                (ErrorKind::Conflict, ErrorCode::VaultRevisionMismatch)
            }
            warren_egress::EgressError::Vault(VaultError::NotFound(_)) => {
                (ErrorKind::NotFound, ErrorCode::VaultNotFound)
            }
            warren_egress::EgressError::Vault(VaultError::Invalid(_)) => {
                (ErrorKind::Invalid, ErrorCode::InvalidParameter)
            }
            warren_egress::EgressError::NoCredentialProxy(_) => {
                return not_enabled(e.to_string());
            }
            other => {
                tracing::error!(sandbox_id = id, error = %warren_core::error_chain(other), "credential vault");
                return SandboxError::new(
                    ErrorKind::Failed,
                    ErrorCode::Unknown,
                    "internal error; the server's log has the cause",
                );
            }
        };
        SandboxError::new(kind, code, e.to_string())
    })
}
