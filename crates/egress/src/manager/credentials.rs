//! The credential proxy of a sandbox with a vault: its ports 443 and 80 redirected to the
//! interception (`mitm`), which asks back here what the sandbox's vault and policy allow.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Instant;

use super::host_addresses;
use super::SandboxNet;

use crate::{
    nft::Batch,
    policy::{in_cidr, is_internal, names_internal, Action},
    Egress, EgressError,
};

/// The vault proxy's view of the sandboxes.
pub(super) struct Lookup(pub(super) std::sync::Weak<Egress>);

impl crate::mitm::Lookup for Lookup {
    fn vault(&self, src: Ipv4Addr, dst: SocketAddrV4) -> Option<crate::vault::Vault> {
        self.0.upgrade()?.vault_for(src, dst)
    }

    fn injected(&self, src: Ipv4Addr, binding: &str, host: &str) {
        let Some(egress) = self.0.upgrade() else {
            return;
        };
        let Some(o) = egress.observer().cloned() else {
            return;
        };
        let id = egress.lock().by_addr.get(&src).cloned();
        if let Some(id) = id {
            o.injection(&id, binding, host);
        }
    }

    fn answered(&self, src: Ipv4Addr, dst: SocketAddrV4, name: &str) -> bool {
        self.0.upgrade().is_some_and(|e| e.answered(src, dst, name))
    }

    fn resolve(
        &self,
        src: Ipv4Addr,
        dst: SocketAddrV4,
        name: &str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> {
        let (egress, name) = (self.0.upgrade(), name.to_string());
        Box::pin(async move {
            match egress {
                Some(e) => e.resolve_for(src, dst, &name).await,
                None => false,
            }
        })
    }

    fn decide(&self, src: Ipv4Addr, dst: SocketAddrV4) -> Option<crate::mitm::Decision> {
        let egress = self.0.upgrade()?;
        let (id, decision) = {
            let st = egress.lock();
            let id = st.by_addr.get(&src)?;
            let net = st.by_id.get(id)?;
            let allowed = egress.allows(net, dst);
            let decision = crate::mitm::Decision {
                vault: net.vault.clone(),
                ca: net.ca.clone(),
                allowed,
            };
            (id.clone(), decision)
        };
        crate::metrics::connection_decided(decision.allowed);
        // Told outside the lock: the observer does its own work (a timeline's write).
        if let Some(o) = egress.observer() {
            o.connection(&id, dst, decision.allowed);
        }
        Some(decision)
    }
}

impl Egress {
    /// Turns the credential proxy on for a linked sandbox; returns its CA certificate (PEM), for the
    /// sandbox's trust store.
    pub fn enable_credential_proxy(&self, id: &str) -> Result<String, EgressError> {
        let _changes = self.serialize();
        let (addr, pem, fresh) = {
            let mut st = self.lock();
            let net = st
                .by_id
                .get_mut(id)
                .ok_or_else(|| EgressError::NoCredentialProxy(id.to_string()))?;
            let fresh = net.ca.is_none();
            if fresh {
                net.ca = Some(Arc::new(
                    crate::mitm::SandboxCa::new(id).map_err(EgressError::Setup)?,
                ));
            }
            (
                net.addr,
                net.ca.as_ref().map(|c| c.pem()).unwrap_or_default(),
                fresh,
            )
        };
        if fresh {
            let mut b = Batch::new();
            self.fw.vault(&mut b, addr, true);
            b.apply()
                .map_err(|e| EgressError::Setup(format!("firewall: {e}")))?;
        }
        Ok(pem)
    }

    /// Whether the sandbox's credential proxy is on.
    pub fn has_credential_proxy(&self, id: &str) -> bool {
        self.lock().by_id.get(id).is_some_and(|n| n.ca.is_some())
    }

    /// Runs `f` on a sandbox's vault slot (the credential proxy must be on).
    pub fn with_vault<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut Option<crate::vault::Vault>) -> Result<T, crate::vault::VaultError>,
    ) -> Result<T, EgressError> {
        let mut st = self.lock();
        let net = st
            .by_id
            .get_mut(id)
            .filter(|n| n.ca.is_some())
            .ok_or_else(|| EgressError::NoCredentialProxy(id.to_string()))?;
        Ok(f(&mut net.vault)?)
    }

    /// May `src` open a TCP connection to `to` (for connections the firewall handed to a proxy,
    /// which therefore never meet the forward chain)? The same answer the firewall would give:
    /// never the host or another sandbox of this server; a CIDR or port-scoped deny wins; then
    /// learned addresses (internal ones only ever learned for names a rule names), allowed CIDRs
    /// (on every port, or on `to`'s) inside an internal range; nothing else internal; then other
    /// allowed CIDRs and port-scoped allows, and an allow default.
    pub(super) fn allows(&self, net: &SandboxNet, to: SocketAddrV4) -> bool {
        let dst = *to.ip();
        let (base, len) = self.cfg.subnet;
        if dst.is_loopback()
            || dst.is_unspecified()
            || dst.is_broadcast()
            || in_cidr(IpAddr::V4(dst), IpAddr::V4(base), len)
            || host_addresses().contains(&dst)
        {
            return false;
        }
        // (does the rule name an internal range, its action)
        let port_hits = net
            .policy
            .port_rules()
            .into_iter()
            .filter(|r| r.covers(SocketAddr::V4(to)))
            .map(|r| (names_internal(r.net, r.len), r.action));
        let hits: Vec<(bool, Action)> = net
            .policy
            .cidr_rules()
            .into_iter()
            .filter(|(n, l, _)| in_cidr(IpAddr::V4(dst), *n, *l))
            .map(|(n, l, a)| (names_internal(n, l), a))
            .chain(port_hits)
            .collect();
        if hits.iter().any(|(_, a)| *a == Action::Deny) {
            return false;
        }
        if net
            .learned
            .get(&dst)
            .is_some_and(|(_, exp)| *exp > Instant::now())
            || hits.contains(&(true, Action::Allow))
        {
            return true;
        }
        !is_internal(dst)
            && (hits.contains(&(false, Action::Allow))
                || net.policy.default_action == Action::Allow)
    }
}
