//! Egress enforcement from beside one sandbox, inside the network namespace it shares with it (a
//! Kubernetes Pod's): where no host firewall sits in front of the sandbox, a container of Warren's
//! in the same Pod holds the rules. It runs before the sandbox's container starts (a native
//! sidecar whose start-up probe is its control port, bound only once the rules are in), and is the
//! only container of the Pod with `NET_ADMIN`; the sandbox's container has neither it nor
//! `NET_RAW`, so it can neither change the rules nor put the enforcer's mark on its own sockets.
//!
//! The rules, in the Pod's namespace (one table, `output` hook, since every packet of the sandbox
//! is made there): the enforcer's own sockets carry a mark and pass; traffic to the Pod's own
//! addresses (loopback, its IP: where the DNS redirect leads too) passes; answers to connections made *to* the Pod pass only from the ports Warren reaches
//! (execd's, the control port); DNS over UDP, to any server, is redirected to the enforcer's DNS
//! filter, which answers denied names NXDOMAIN and forwards the others upstream (with its mark);
//! IPv6 is dropped; then, packet by packet, as on a host link (see `nft`): explicit CIDR denies,
//! addresses learned from allowed answers (internal ones only for names a rule names exactly),
//! allowed CIDRs inside internal ranges, the internal ranges refused, other allowed CIDRs, and the
//! default. So rules that name hosts work where a NetworkPolicy (addresses only) cannot say them.
//!
//! The control port answers `PUT /policy` (the whole policy, in force when it answers) to callers
//! that present the sandbox's execd credential, of which the enforcer, like execd, holds only the
//! SHA-256: the sandbox may read that and still open nothing. Its listening socket carries the mark
//! too, so its answers pass as the enforcer's own: were the sandbox to bind that port while the
//! enforcer is down, nothing it answered would leave the Pod (no credential reaches it). It takes a
//! few connections at once, each with a bounded header and time.
//!
//! What it enforces and where its DNS goes are kept in a file of its own ([`Kept`]), written
//! before a change is put in force and renamed after: a restarted sidecar (the kubelet restarts it)
//! resumes the latest policy, never an older, wider one, and never reads the Pod's resolv.conf again
//! (a file the sandbox may write).
//!
//! Why one file: one enforcer process. Its nftables table, the control port that changes the policy
//! and the DNS filter that learns addresses act on the same sets and mark under the same two locks;
//! the table is one text so that the ruleset reads whole.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;

use crate::dns;
use crate::nft::apply;
use crate::policy::{is_internal, Action, NetworkPolicy, INTERNAL_V4};

/// The table the enforcer owns in the Pod's namespace.
pub const TABLE: &str = "warren_egress";
/// The mark on the enforcer's own sockets ("WRN"). Setting it takes `NET_ADMIN` or `NET_RAW`,
/// neither of which the sandbox's container has.
pub const MARK: u32 = 0x0057_524e;
/// The header carrying the credential (execd's own).
pub const TOKEN_HEADER: &str = "x-execd-access-token";

#[derive(Debug, Clone)]
pub struct SidecarConfig {
    /// The control port's address (the Pod's, so Warren reaches it).
    pub listen: SocketAddr,
    /// SHA-256 of the credential the control port accepts.
    pub verifier: [u8; 32],
    /// Where allowed queries go (the cluster's DNS, from the Pod's resolv.conf unless given).
    pub upstream: SocketAddr,
    /// Ports whose answers to connections made to the Pod may leave (execd's; the control port is
    /// added).
    pub inbound_ports: Vec<u16>,
    pub policy: NetworkPolicy,
    /// Where the policy in force and the upstream are kept (a restarted sidecar starts from it).
    pub state_file: Option<std::path::PathBuf>,
}

/// What the state file holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Kept {
    pub policy: NetworkPolicy,
    pub upstream: SocketAddr,
}

impl Kept {
    /// Writes `self` beside `file` (synced); the caller renames it over `file` once in force.
    fn stage(&self, file: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
        use std::io::Write;
        let tmp = file.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec(self).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        Ok(tmp)
    }

    /// Writes `self` as the state file now.
    pub fn save(&self, file: &std::path::Path) -> std::io::Result<()> {
        let tmp = self.stage(file)?;
        std::fs::rename(tmp, file)
    }

    pub fn load(file: &std::path::Path) -> std::io::Result<Option<Self>> {
        match std::fs::read(file) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Control connections served at once (more wait in the listen queue); each may take this long.
const CONTROL_CONNECTIONS: usize = 16;
const CONTROL_CONNECTION_TIME: Duration = Duration::from_secs(30);
/// Learned addresses kept at most (the set's size too).
const MAX_LEARNED: usize = 65_536;

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("{0}")]
    Setup(String),
}

struct State {
    policy: NetworkPolicy,
    /// Destinations learned from allowed answers: address → (name, expiry).
    learned: HashMap<Ipv4Addr, (String, Instant)>,
}

pub struct Sidecar {
    cfg: SidecarConfig,
    state: Mutex<State>,
    /// Held from deciding a change to applying it, so a late DNS answer cannot re-add what a
    /// policy change just removed.
    changes: Mutex<()>,
    dns_slots: Arc<tokio::sync::Semaphore>,
}

fn setup(what: &str) -> impl Fn(std::io::Error) -> SidecarError + '_ {
    move |e| SidecarError::Setup(format!("{what}: {e}"))
}

/// The first `nameserver` of `/etc/resolv.conf`, port 53.
pub fn resolv_conf_upstream() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .find_map(|ip| ip.trim().parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
}

/// A UDP socket whose packets carry [`MARK`] (and so pass the rules).
/// Puts [`MARK`] on a socket: what it sends passes the rules.
fn mark(socket: &impl std::os::fd::AsRawFd) -> std::io::Result<()> {
    let mark = MARK;
    // SAFETY: setsockopt on a socket the caller owns, with a pointer to a live u32 of the size
    // given.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MARK,
            (&mark as *const u32).cast(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A UDP socket of `to`'s family whose packets carry [`MARK`].
fn marked_udp(to: SocketAddr) -> std::io::Result<UdpSocket> {
    let any: SocketAddr = if to.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = std::net::UdpSocket::bind(any)?;
    mark(&socket)?;
    socket.set_nonblocking(true)?;
    UdpSocket::from_std(socket)
}

/// The control port's listener, marked: its answers (SYN-ACKs and all) carry the mark.
fn marked_listener(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    mark(&socket)?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(64)
}

/// The table, its sets empty but the internal ranges: nothing leaves until a policy is applied.
fn table(dns_port: u16, inbound: &[u16]) -> String {
    let internal = INTERNAL_V4
        .iter()
        .map(|(n, l)| format!("{n}/{l}"))
        .collect::<Vec<_>>()
        .join(", ");
    let ports = inbound
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"table inet {TABLE} {{
  set learned4 {{ type ipv4_addr; flags timeout; size {MAX_LEARNED}; }}
  set cidr_allow4 {{ type ipv4_addr; flags interval; auto-merge; }}
  set cidr_deny4 {{ type ipv4_addr; flags interval; auto-merge; }}
  set cidr_named4 {{ type ipv4_addr; flags interval; auto-merge; }}
  set port_deny4 {{ type ipv4_addr . inet_service; flags interval; }}
  set port_named4 {{ type ipv4_addr . inet_service; flags interval; }}
  set port_allow4 {{ type ipv4_addr . inet_service; flags interval; }}
  set default4 {{ type ipv4_addr; flags interval; }}
  set internal4 {{ type ipv4_addr; flags interval; elements = {{ {internal} }} }}
  chain dns {{
    type nat hook output priority -100; policy accept;
    meta mark {MARK} return
    udp dport 53 redirect to :{dns_port}
  }}
  chain output {{
    type filter hook output priority filter; policy accept;
    meta mark {MARK} accept
    fib daddr type local accept
    ct direction reply tcp sport {{ {ports} }} accept
    meta nfproto ipv6 drop
    udp dport 53 drop
    ip daddr @cidr_deny4 reject with icmpx type admin-prohibited
    meta l4proto {{ tcp, udp, sctp, udplite }} ip daddr . th dport @port_deny4 reject with icmpx type admin-prohibited
    ip daddr @learned4 accept
    ip daddr @cidr_named4 accept
    ip daddr . tcp dport @port_named4 accept
    ip daddr @internal4 reject with icmpx type admin-prohibited
    ip daddr @cidr_allow4 accept
    ip daddr . tcp dport @port_allow4 accept
    ip daddr @default4 accept
    reject with icmpx type admin-prohibited
  }}
}}
"#
    )
}

/// The batch that makes `policy`'s address rules and default what the sets hold (atomically).
fn policy_batch(policy: &NetworkPolicy) -> String {
    let e = policy.address_elements();
    let cidrs = |v: &[(Ipv4Addr, u8)]| v.iter().map(|(n, l)| format!("{n}/{l}")).collect();
    let ports =
        |v: &[(Ipv4Addr, u8, u16)]| v.iter().map(|(n, l, p)| format!("{n}/{l} . {p}")).collect();
    let default: Vec<String> = if policy.default_action == Action::Allow {
        vec!["0.0.0.0/0".into()]
    } else {
        Vec::new()
    };
    let sets: [(&str, Vec<String>); 7] = [
        ("cidr_allow4", cidrs(&e.cidr_allow)),
        ("cidr_deny4", cidrs(&e.cidr_deny)),
        ("cidr_named4", cidrs(&e.cidr_named)),
        ("port_deny4", ports(&e.port_deny)),
        ("port_named4", ports(&e.port_named)),
        ("port_allow4", ports(&e.port_allow)),
        ("default4", default),
    ];
    let mut out = String::new();
    for (set, elements) in sets {
        out.push_str(&format!("flush set inet {TABLE} {set}\n"));
        if !elements.is_empty() {
            out.push_str(&format!(
                "add element inet {TABLE} {set} {{ {} }}\n",
                elements.join(", ")
            ));
        }
    }
    out
}

impl Sidecar {
    /// Installs the rules with `cfg.policy` in force, starts the DNS filter, and binds the control
    /// port last (the Pod's start-up probe: the sandbox's container starts once it answers).
    /// Serves until the process ends.
    pub async fn run(cfg: SidecarConfig) -> Result<(), SidecarError> {
        // The control port's own answers carry the mark; only execd's leave by the exemption.
        let inbound: Vec<u16> = cfg
            .inbound_ports
            .iter()
            .copied()
            .filter(|p| *p != cfg.listen.port())
            .collect();
        let dns_socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(setup("binding the DNS filter"))?;
        let dns_port = dns_socket
            .local_addr()
            .map_err(setup("the DNS filter's port"))?
            .port();
        // One transaction: a restarted sidecar replaces the rules its predecessor left with no
        // moment between them (`add` makes the table if there is none, so `delete` cannot fail).
        let mut batch = format!("add table inet {TABLE}\ndelete table inet {TABLE}\n");
        batch.push_str(&table(dns_port, &inbound));
        batch.push_str(&policy_batch(&cfg.policy));
        apply(&batch).map_err(setup("installing the nftables rules"))?;
        let this = Arc::new(Self {
            state: Mutex::new(State {
                policy: cfg.policy.clone(),
                learned: HashMap::new(),
            }),
            cfg,
            changes: Mutex::new(()),
            dns_slots: Arc::new(tokio::sync::Semaphore::new(256)),
        });
        tokio::spawn(dns_loop(this.clone(), Arc::new(dns_socket)));
        let listener =
            marked_listener(this.cfg.listen).map_err(setup("binding the control port"))?;
        tracing::info!(listen = %this.cfg.listen, dns_port, upstream = %this.cfg.upstream, "egress sidecar: rules in, serving");
        let slots = Arc::new(tokio::sync::Semaphore::new(CONTROL_CONNECTIONS));
        loop {
            // A slot first: past the limit, connections wait in the listen queue.
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return Ok(());
            };
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, say: not a reason to spin.
                    tracing::warn!(error = %e, "egress sidecar: accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let this = this.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let service = hyper::service::service_fn(move |req| {
                    let this = this.clone();
                    async move { Ok::<_, std::convert::Infallible>(this.control(req).await) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(5))
                    .max_buf_size(16 * 1024)
                    .serve_connection(io, service);
                let _ = tokio::time::timeout(CONTROL_CONNECTION_TIME, conn).await;
            });
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn serialize(&self) -> MutexGuard<'_, ()> {
        self.changes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `presented` is the credential (its digest compared in constant time).
    fn accepts(&self, presented: &[u8]) -> bool {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(presented);
        digest
            .iter()
            .zip(self.cfg.verifier.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    async fn control(
        self: &Arc<Self>,
        req: hyper::Request<hyper::body::Incoming>,
    ) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
        use http_body_util::BodyExt;
        let reply = |status: u16, code: &str, message: String| {
            let body = serde_json::json!({"code": code, "message": message}).to_string();
            hyper::Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .unwrap_or_default()
        };
        let authorized = req
            .headers()
            .get(TOKEN_HEADER)
            .is_some_and(|v| self.accepts(v.as_bytes()));
        if !authorized {
            return reply(
                401,
                "UNAUTHORIZED",
                format!("missing or wrong {TOKEN_HEADER}"),
            );
        }
        if req.uri().path() != "/policy" || req.method() != hyper::Method::PUT {
            return reply(404, "NOT_FOUND", "only PUT /policy is served here".into());
        }
        let body = match http_body_util::Limited::new(req.into_body(), 1 << 20)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(e) => return reply(400, "INVALID_PARAMETER", format!("reading the body: {e}")),
        };
        let policy = match serde_json::from_slice::<serde_json::Value>(&body)
            .map_err(|e| e.to_string())
            .and_then(|v| NetworkPolicy::from_json(&v).map_err(|e| e.to_string()))
        {
            Ok(Some(p)) => p,
            Ok(None) => NetworkPolicy::deny_all(),
            Err(e) => return reply(400, "INVALID_PARAMETER", format!("networkPolicy: {e}")),
        };
        let this = self.clone();
        match tokio::task::spawn_blocking(move || this.set_policy(policy)).await {
            Ok(Ok(())) => reply(200, "OK", "in force".into()),
            Ok(Err(e)) => reply(500, "INTERNAL_ERROR", e.to_string()),
            Err(e) => reply(500, "INTERNAL_ERROR", e.to_string()),
        }
    }

    /// Makes `policy` the one in force: its rules, and learned addresses it no longer allows gone
    /// (open connections to them are cut at once: there is no "established" shortcut). Kept first
    /// (staged beside the state file, renamed once in force), so what a restart resumes is never
    /// behind what was in force.
    pub fn set_policy(&self, policy: NetworkPolicy) -> std::io::Result<()> {
        let _changes = self.serialize();
        let mut st = self.lock();
        let staged = match &self.cfg.state_file {
            Some(file) => Some((
                file,
                Kept {
                    policy: policy.clone(),
                    upstream: self.cfg.upstream,
                }
                .stage(file)?,
            )),
            None => None,
        };
        if let Err(e) = apply(&policy_batch(&policy)) {
            if let Some((_, tmp)) = staged {
                let _ = std::fs::remove_file(tmp);
            }
            return Err(e);
        }
        if let Some((file, tmp)) = staged {
            std::fs::rename(tmp, file)?;
        }
        let now = Instant::now();
        let dropped: Vec<Ipv4Addr> = st
            .learned
            .iter()
            .filter(|(dest, (name, exp))| {
                *exp > now
                    && (policy.decide_name(name) == Action::Deny
                        || (is_internal(**dest) && !policy.names_exactly(name)))
            })
            .map(|(d, _)| *d)
            .collect();
        // One by one: an element the kernel already let expire must not stop the others.
        for d in dropped {
            let _ = apply(&format!("delete element inet {TABLE} learned4 {{ {d} }}\n"));
            st.learned.remove(&d);
        }
        st.policy = policy;
        Ok(())
    }

    fn decide(&self, name: &str) -> Action {
        self.lock().policy.decide_name(name)
    }

    /// Lets the sandbox reach an allowed answer's addresses for as long as the answer lives; false
    /// when the policy no longer allows `name` (it changed while upstream answered).
    fn learn(&self, name: &str, addrs: &[(Ipv4Addr, u32)]) -> bool {
        let _changes = self.serialize();
        let mut batch = String::new();
        {
            let mut st = self.lock();
            if st.policy.decide_name(name) != Action::Allow {
                return false;
            }
            // An internal address opens only for a name a rule names itself (as on a host link).
            let named = st.policy.names_exactly(name);
            let now = Instant::now();
            st.learned.retain(|_, (_, exp)| *exp > now);
            for (dest, ttl) in addrs.iter().filter(|(d, _)| named || !is_internal(*d)) {
                // At least a minute: clients cache longer than TTLs say.
                let ttl = (*ttl).clamp(60, 86_400);
                match st.learned.get(dest) {
                    Some((_, exp)) if *exp > now + Duration::from_secs(u64::from(ttl / 2)) => {
                        continue
                    }
                    None if st.learned.len() >= MAX_LEARNED => {
                        tracing::warn!("egress sidecar: {MAX_LEARNED} addresses learned; no more until some expire");
                        continue;
                    }
                    _ => {}
                }
                // One transaction per address, whether the kernel still has it or not: made
                // (`add`, a no-op when there), removed, made again with the new timeout (`add`
                // alone would keep an older, shorter one). No moment without it.
                batch.push_str(&format!(
                    "add element inet {TABLE} learned4 {{ {dest} timeout 1s }}\n\
                     delete element inet {TABLE} learned4 {{ {dest} }}\n\
                     add element inet {TABLE} learned4 {{ {dest} timeout {ttl}s }}\n"
                ));
                st.learned.insert(
                    *dest,
                    (name.to_string(), now + Duration::from_secs(u64::from(ttl))),
                );
            }
        }
        if batch.is_empty() {
            return true;
        }
        match apply(&batch) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "egress sidecar: adding learned addresses");
                // Memory follows the kernel: what was not added is not learned.
                let mut st = self.lock();
                for (dest, _) in addrs {
                    if st.learned.get(dest).is_some_and(|(n, _)| n == name) {
                        st.learned.remove(dest);
                    }
                }
                false
            }
        }
    }
}

async fn dns_loop(sidecar: Arc<Sidecar>, socket: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, from) = match socket.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "egress sidecar: DNS receive");
                continue;
            }
        };
        let Ok(permit) = sidecar.dns_slots.clone().try_acquire_owned() else {
            continue; // too many in flight: dropped, the client retries
        };
        let query = buf[..n].to_vec();
        let (sidecar, socket) = (sidecar.clone(), socket.clone());
        tokio::spawn(async move {
            let _permit = permit;
            if let Some(reply) = answer(&sidecar, &query).await {
                let _ = socket.send_to(&reply, from).await;
            }
        });
    }
}

async fn answer(sidecar: &Arc<Sidecar>, query: &[u8]) -> Option<Vec<u8>> {
    let q = dns::parse_query(query)?;
    if sidecar.decide(&q.name) == Action::Deny {
        return Some(dns::reply_empty(query, &q, dns::RCODE_NXDOMAIN));
    }
    if q.qtype == dns::TYPE_AAAA {
        return Some(dns::reply_empty(query, &q, dns::RCODE_NOERROR));
    }
    let upstream = marked_udp(sidecar.cfg.upstream).ok()?;
    upstream.connect(sidecar.cfg.upstream).await.ok()?;
    let reply = dns::ask(&upstream, query, &q).await;
    let addrs = dns::ipv4_answers(&reply);
    if !addrs.is_empty() {
        let (sc, name) = (sidecar.clone(), q.name.clone());
        let learned = tokio::task::spawn_blocking(move || sc.learn(&name, &addrs))
            .await
            .unwrap_or(false);
        if !learned {
            return Some(dns::reply_empty(query, &q, dns::RCODE_NXDOMAIN));
        }
    }
    Some(reply)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::NetworkRule;

    fn rule(action: Action, target: &str) -> NetworkRule {
        NetworkRule::new(action, target)
    }

    #[test]
    fn a_policy_fills_exactly_its_sets_and_empties_the_others() {
        let policy = NetworkPolicy {
            default_action: Action::Deny,
            egress: vec![
                rule(Action::Allow, "pypi.org"),
                rule(Action::Deny, "203.0.113.7"),
                rule(Action::Allow, "203.0.113.0/24"),
                rule(Action::Allow, "10.1.2.0/24"),
                rule(Action::Allow, "2001:db8::/32"),
                rule(Action::Allow, "198.51.100.9").with_ports(vec![443, 8443]),
                rule(Action::Deny, "").with_ports(vec![25]),
            ],
        };
        let batch = policy_batch(&policy);
        for set in [
            "cidr_allow4",
            "cidr_deny4",
            "cidr_named4",
            "port_deny4",
            "port_named4",
            "port_allow4",
            "default4",
        ] {
            assert!(
                batch.contains(&format!("flush set inet {TABLE} {set}\n")),
                "{set}"
            );
        }
        assert!(batch.contains("cidr_deny4 { 203.0.113.7/32 }"), "{batch}");
        assert!(batch.contains("cidr_allow4 { 203.0.113.0/24 }"), "{batch}");
        assert!(batch.contains("cidr_named4 { 10.1.2.0/24 }"), "{batch}");
        assert!(
            batch.contains("port_allow4 { 198.51.100.9/32 . 443, 198.51.100.9/32 . 8443 }"),
            "{batch}"
        );
        assert!(batch.contains("port_deny4 { 0.0.0.0/0 . 25 }"), "{batch}");
        assert!(
            !batch.contains("cidr_allow4 { 198.51.100.9"),
            "a port-scoped allow opens only its ports: {batch}"
        );
        assert!(
            !batch.contains("add element inet warren_egress default4"),
            "{batch}"
        );
        assert!(
            !batch.contains("2001:db8"),
            "IPv6 rules have no set: IPv6 is dropped"
        );
        let open = policy_batch(&NetworkPolicy::allow_all());
        assert!(open.contains("default4 { 0.0.0.0/0 }"), "{open}");
    }

    #[test]
    fn the_table_exempts_only_the_mark_the_pod_and_answers_from_warren_s_ports() {
        let t = table(40000, &[44772]);
        assert!(t.contains("udp dport 53 redirect to :40000"));
        assert!(t.contains(&format!("meta mark {MARK} return")));
        assert!(t.contains("ct direction reply tcp sport { 44772 } accept"));
        // The last word is a refusal, and nothing accepts by state alone.
        assert!(t.contains("    reject with icmpx type admin-prohibited\n  }"));
        assert!(!t.contains("ct state established"));
    }
}
