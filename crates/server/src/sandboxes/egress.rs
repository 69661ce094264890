//! A sandbox's network: its link and egress policy, and the credential vault's proxy.

use std::sync::Arc;

use warren_api::lifecycle::SandboxState;
use warren_api::ErrorCode;
use warren_core::{RuntimeError, RuntimeExt};

use super::{Inner, Sandboxes};
use crate::error::{ErrorKind, SandboxError};
use crate::network::{needs_link, runtime_policy, Network};

impl Sandboxes {
    /// Gives a sandbox its network link (`index` re-adopts an existing one).
    pub(super) async fn link(
        &self,
        egress: &Arc<warren_egress::Egress>,
        id: &str,
        state: &warren_core::RuntimeState,
        policy: warren_egress::NetworkPolicy,
        index: Option<u32>,
    ) -> Result<u32, SandboxError> {
        let links = self.inner.runtime.links().ok_or_else(|| {
            SandboxError::internal(
                "linking the sandbox",
                &std::io::Error::other("the runtime gives sandboxes no link"),
            )
        })?;
        let pid = links.network_pid(state).ok_or_else(|| {
            SandboxError::internal(
                "linking the sandbox",
                &std::io::Error::other("its init process is gone"),
            )
        })?;
        let (eg, id2) = (egress.clone(), id.to_string());
        let link = tokio::task::spawn_blocking(move || eg.attach(&id2, pid, policy, index))
            .await
            .map_err(|e| SandboxError::internal("linking the sandbox", &e))?
            .map_err(|e| match e {
                // Capacity, not a fault: every address of the subnet is some sandbox's; as with
                // other exhausted capacity, 429 and a retry later.
                warren_egress::EgressError::Exhausted(_) => SandboxError::new(
                    ErrorKind::Busy,
                    ErrorCode::Unknown,
                    format!("giving the sandbox its network link: {e}; [network] subnet sets how many sandboxes with a network policy can exist at once"),
                ),
                e => SandboxError::internal("giving the sandbox its network link", &e),
            })?;
        Ok(link.index)
    }

    /// Turns the credential proxy on and puts its CA into the sandbox's trust store.
    pub(super) async fn start_credential_proxy(
        &self,
        egress: &Arc<warren_egress::Egress>,
        id: &str,
    ) -> Result<(), SandboxError> {
        let pem = egress
            .enable_credential_proxy(id)
            .map_err(|e| SandboxError::internal("starting the credential proxy", &e))?;
        let endpoint = self
            .execd_endpoint(id)
            .ok_or_else(|| SandboxError::not_found(id))?;
        crate::network::install_ca(&endpoint, &pem)
            .await
            .map_err(|e| {
                SandboxError::internal(
                    "installing the credential proxy's CA in the sandbox",
                    &std::io::Error::other(e),
                )
            })
    }

    pub fn network(&self) -> &Network {
        &self.inner.network
    }

    /// Removes what the egress controller holds for a sandbox (nothing when it never had a link).
    pub(super) async fn unlink(&self, id: &str) {
        if let Some(eg) = self.inner.network.started() {
            if eg.has(id) {
                let (eg, id) = (eg.clone(), id.to_string());
                let _ = tokio::task::spawn_blocking(move || eg.detach(&id)).await;
            }
        }
    }

    pub fn network_shutdown(&self) {
        self.inner.network.shutdown();
    }

    pub fn default_network_policy(&self) -> warren_egress::NetworkPolicy {
        self.inner.network.default_policy()
    }

    /// The sandbox's egress policy.
    pub fn network_policy(&self, id: &str) -> Result<warren_egress::NetworkPolicy, SandboxError> {
        let rec = self.get(id).ok_or_else(|| SandboxError::not_found(id))?;
        Ok(match rec.network_policy {
            None => self.inner.network.default_policy(),
            // A record this server cannot read (a field of a newer version's, say) fails closed:
            // the default may be allow-all.
            Some(v) => serde_json::from_value(v).unwrap_or_else(|e| {
                tracing::warn!(sandbox_id = %id, error = %e, "unreadable stored network policy; treating it as deny-all");
                warren_egress::NetworkPolicy::deny_all()
            }),
        })
    }

    /// Turns the credential proxy on for a running sandbox that was made without it (a sandbox
    /// from a template, whose first vault create asks for it): the proxy's CA goes into its trust
    /// and the record keeps the choice, so a restarted server starts the proxy again. Needs the
    /// sandbox's network link: a vault for a sandbox that reaches nothing would inject nowhere.
    pub async fn enable_credential_proxy(&self, id: &str) -> Result<(), SandboxError> {
        let held = self.hold(id).await?;
        let (entry, rec) = (&held.entry, held.rec.clone());
        if rec.credential_proxy {
            return Ok(());
        }
        if rec.state != SandboxState::Running {
            return Err(SandboxError::conflict(
                ErrorCode::SandboxNotRunning,
                format!("sandbox {id} is {}", rec.state.as_str()),
            ));
        }
        if rec.network_link.is_none() {
            return Err(SandboxError::conflict(
                ErrorCode::InvalidState,
                format!(
                    "sandbox {id} reaches no network, so a credential vault would inject nowhere: give it a networkPolicy that lets it reach something first (PUT /sandboxes/{id}/networkpolicy)"
                ),
            ));
        }
        let eg = self.inner.network.egress().await?;
        self.start_credential_proxy(&eg, id).await?;
        let mut updated = rec;
        updated.credential_proxy = true;
        if let Err(e) = self.share(&updated).await {
            tracing::warn!(sandbox_id = %id, error = %e, "the credential proxy is on but its record was not shared");
        }
        self.update(entry, |r| r.credential_proxy = true);
        Ok(())
    }

    /// Changes a running sandbox's egress policy; in force when this returns.
    pub async fn update_network_policy(
        &self,
        id: &str,
        change: impl FnOnce(&mut warren_egress::NetworkPolicy),
    ) -> Result<warren_egress::NetworkPolicy, SandboxError> {
        let held = self.hold(id).await?;
        let (entry, rec) = (&held.entry, held.rec.clone());
        if !matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
            return Err(SandboxError::conflict(
                ErrorCode::SandboxNotRunning,
                format!("sandbox {id} is {}", rec.state.as_str()),
            ));
        }
        let mut policy = self.network_policy(id)?;
        change(&mut policy);
        let caps = self.inner.runtime.capabilities();
        if !caps.egress_policy && caps.egress_addresses {
            // The runtime's backend enforces it; the record follows once it is in force.
            let by_address = match needs_link(&policy) {
                true => Some(runtime_policy(
                    &policy,
                    &self.inner.runtime.name(),
                    caps.egress_names,
                )?),
                false => None,
            };
            let credential = crate::tokens::execd_credential(&rec.token);
            let enforcer = self.inner.runtime.enforcer().ok_or_else(|| {
                SandboxError::from_runtime(
                    "updating the policy",
                    RuntimeError::Unsupported(format!(
                        "{} do not enforce network policies themselves",
                        self.inner.runtime.sandboxes_described()
                    )),
                )
            })?;
            enforcer
                .set_egress(id, &rec.runtime_state, by_address.as_ref(), &credential)
                .await
                .map_err(|e| SandboxError::from_runtime("updating the policy", e))?;
            let value = serde_json::to_value(&policy).ok();
            let mut updated = rec.clone();
            updated.network_policy = value.clone();
            if let Err(e) = self.share(&updated).await {
                tracing::warn!(sandbox_id = %id, error = %e, "the new policy is in force but its record was not shared");
            }
            self.update(entry, |r| r.network_policy = value);
            return Ok(policy);
        }
        let link = match rec.network_link {
            Some(index) => {
                let eg = self.inner.network.egress().await?;
                let (p, id2) = (policy.clone(), id.to_string());
                tokio::task::spawn_blocking(move || eg.set_policy(&id2, p))
                    .await
                    .map_err(|e| SandboxError::internal("updating the policy", &e))?
                    .map_err(|e| SandboxError::internal("updating the policy", &e))?;
                Some(index)
            }
            None if needs_link(&policy) => {
                if !self.inner.runtime.capabilities().egress_policy {
                    return Err(SandboxError::new(
                        ErrorKind::Invalid,
                        ErrorCode::ApiNotSupported,
                        format!(
                            "Warren cannot enforce network policies on {}",
                            self.inner.runtime.sandboxes_described()
                        ),
                    ));
                }
                let eg = self.inner.network.egress().await?;
                Some(
                    self.link(&eg, id, &rec.runtime_state, policy.clone(), None)
                        .await?,
                )
            }
            None => None,
        };
        let value = serde_json::to_value(&policy).ok();
        self.update(entry, |r| {
            r.network_policy = value;
            r.network_link = link;
        });
        Ok(policy)
    }
}

/// Writes the egress controller's decisions on each sandbox's timeline. It holds the registry
/// weakly: the registry owns the network, which owns this.
pub(super) struct Recorder(pub(super) std::sync::Weak<Inner>);

impl Recorder {
    fn record(&self, sandbox: &str, kind: &str, detail: serde_json::Value) {
        let Some(inner) = self.0.upgrade() else {
            return;
        };
        if let Some(t) = (Sandboxes { inner }).timeline(sandbox) {
            t.record(kind, detail);
        }
    }
}

fn action(allowed: bool) -> &'static str {
    if allowed {
        "allow"
    } else {
        "deny"
    }
}

impl warren_egress::Observer for Recorder {
    fn name(&self, sandbox: &str, name: &str, allowed: bool) {
        let detail = serde_json::json!({"name": name, "action": action(allowed)});
        self.record(sandbox, "egress.name", detail);
    }

    fn connection(&self, sandbox: &str, dst: std::net::SocketAddrV4, allowed: bool) {
        let detail = serde_json::json!({"address": dst.to_string(), "action": action(allowed)});
        self.record(sandbox, "egress.connection", detail);
    }

    fn injection(&self, sandbox: &str, binding: &str, host: &str) {
        let detail = serde_json::json!({"binding": binding, "host": host});
        self.record(sandbox, "vault.injection", detail);
    }
}
