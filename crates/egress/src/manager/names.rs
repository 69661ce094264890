//! The DNS filter every sandbox query goes to, and what its answers teach the firewall: a denied
//! name gets NXDOMAIN and never leaves the host; an allowed one is forwarded upstream, and the
//! addresses in its answer are let through before the answer goes back.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;

use super::normal_name;
use super::MAX_NAMES_PER_ADDRESS;

use crate::{
    dns,
    nft::Batch,
    policy::{is_internal, Action},
    Egress,
};

/// Answers every sandbox query: denied names get NXDOMAIN and never leave the host; allowed ones are
/// forwarded upstream and the addresses in the answer are let through the firewall before the answer
/// goes back. AAAA queries get an empty answer (sandbox links are IPv4-only).
pub(super) async fn dns_loop(egress: Arc<Egress>, socket: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, from) = match socket.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "egress: DNS receive");
                continue;
            }
        };
        let Ok(permit) = egress.dns_slots.clone().try_acquire_owned() else {
            continue; // too many in flight: dropped, the client retries
        };
        let query = buf[..n].to_vec();
        let egress = egress.clone();
        let socket = socket.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Some(reply) = answer(&egress, from, &query).await {
                let _ = socket.send_to(&reply, from).await;
            }
        });
    }
}

async fn answer(egress: &Arc<Egress>, from: SocketAddr, query: &[u8]) -> Option<Vec<u8>> {
    let q = dns::parse_query(query)?;
    let IpAddr::V4(src) = from.ip() else {
        return Some(dns::reply_empty(query, &q, dns::RCODE_REFUSED));
    };
    let Some((sandbox, action)) = egress.decide(src, &q.name) else {
        return Some(dns::reply_empty(query, &q, dns::RCODE_REFUSED));
    };
    crate::metrics::name_decided(action == Action::Allow);
    if let Some(o) = egress.observer() {
        o.name(&sandbox, &q.name, action == Action::Allow);
    }
    if action == Action::Deny {
        tracing::debug!(%src, name = %q.name, "egress: denied name");
        return Some(dns::reply_empty(query, &q, dns::RCODE_NXDOMAIN));
    }
    if q.qtype == dns::TYPE_AAAA {
        return Some(dns::reply_empty(query, &q, dns::RCODE_NOERROR));
    }
    let upstream = UdpSocket::bind(("0.0.0.0", 0)).await.ok()?;
    upstream.connect(egress.cfg.upstream).await.ok()?;
    let reply = dns::ask(&upstream, query, &q).await;
    let addrs = dns::ipv4_answers(&reply);
    if !addrs.is_empty() {
        let (eg, name) = (egress.clone(), q.name.clone());
        let learned = tokio::task::spawn_blocking(move || eg.learn(src, &name, &addrs))
            .await
            .unwrap_or(false);
        if !learned {
            // The policy changed (or the sandbox went) while upstream answered.
            return Some(dns::reply_empty(query, &q, dns::RCODE_NXDOMAIN));
        }
    }
    Some(reply)
}

impl Egress {
    /// The sandbox a query from `src` is of, and the DNS decision for it; `None` when `src` is no
    /// sandbox of ours.
    pub(super) fn decide(&self, src: Ipv4Addr, name: &str) -> Option<(String, Action)> {
        let st = self.lock();
        let id = st.by_addr.get(&src)?;
        Some((id.clone(), st.by_id.get(id)?.policy.decide_name(name)))
    }

    /// Lets `src` reach the addresses of an allowed answer for as long as the answer lives. Checks
    /// again that `name` is still allowed (the policy may have changed while upstream answered);
    /// false when it is not, or when `src` is no sandbox any more.
    pub(super) fn learn(&self, src: Ipv4Addr, name: &str, addrs: &[(Ipv4Addr, u32)]) -> bool {
        let _changes = self.serialize();
        let mut b = Batch::new();
        {
            let mut st = self.lock();
            let Some(id) = st.by_addr.get(&src).cloned() else {
                return false;
            };
            let Some(net) = st.by_id.get_mut(&id) else {
                return false;
            };
            if net.policy.decide_name(name) != Action::Allow {
                return false;
            }
            // An internal address (the host's networks, a cloud's metadata, other sandboxes)
            // opens only for a name a rule names itself: a wildcard or an allow default says
            // "the internet", and an answer pointing inside (DNS rebinding) must not widen it.
            let named = net.policy.names_exactly(name);
            let now = Instant::now();
            for (dest, ttl) in addrs.iter().filter(|(d, _)| named || !is_internal(*d)) {
                // At least a minute: clients cache longer than TTLs say, and a connection opened
                // just before expiry must not die mid-handshake.
                let ttl = (*ttl).clamp(60, 86_400);
                let wanted = now + Duration::from_secs(u64::from(ttl));
                let names = net.answered.entry(*dest).or_default();
                names.retain(|_, exp| *exp > now);
                let key = normal_name(name);
                // A name already kept is renewed even at the cap (only new names wait).
                if names.len() < MAX_NAMES_PER_ADDRESS || names.contains_key(&key) {
                    let exp = names.entry(key).or_insert(wanted);
                    *exp = (*exp).max(wanted);
                }
                if let Some((_, exp)) = net.learned.get(dest) {
                    // Still good for more than half the new lifetime: leave the firewall alone (an
                    // nft run costs milliseconds; lookups repeat far more often than that).
                    if *exp > now + Duration::from_secs(u64::from(ttl / 2)) {
                        continue;
                    }
                    if *exp > now {
                        self.fw.learned(&mut b, src, *dest, None);
                    }
                }
                self.fw.learned(&mut b, src, *dest, Some(ttl));
                net.learned.insert(*dest, (name.to_string(), wanted));
            }
        }
        if let Err(e) = b.apply() {
            tracing::warn!(%src, error = %e, "egress: adding learned addresses");
            return false;
        }
        true
    }
}
