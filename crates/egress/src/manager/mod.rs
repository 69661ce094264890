//! Sandbox links and their policies on this host: address allocation, the veth pair into the
//! sandbox's network namespace, the DNS filter every sandbox query goes to, and keeping the
//! firewall's sets in step with each sandbox's policy.

use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use credentials::Lookup;
use names::dns_loop;
use tokio::net::UdpSocket;

use crate::{
    dns,
    forwarding::Forwarding,
    nft::{Batch, Firewall},
    policy::{is_internal, Action, NetworkPolicy},
};

mod credentials;
mod names;

#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// Sandbox links are /30s carved from this (host end .1, sandbox .2 of each).
    pub subnet: (Ipv4Addr, u8),
    /// Where allowed queries are forwarded.
    pub upstream: SocketAddr,
    /// nftables table name (unique per server).
    pub table: String,
    /// Name prefix of this server's link interfaces (unique per server, ≤ 9 characters).
    pub link_prefix: String,
    /// Extra CAs the vault proxy trusts for real servers (besides the public web roots).
    pub upstream_ca_files: Vec<std::path::PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("no sandbox addresses left in {0}")]
    Exhausted(String),
    #[error("{0}")]
    Setup(String),
    #[error("{0}")]
    Vault(#[from] crate::vault::VaultError),
    #[error("the credential proxy is not enabled for sandbox {0} (create it with credentialProxy.enabled and a networkPolicy)")]
    NoCredentialProxy(String),
}

/// Names kept per answered address (a wildcard zone can point any number at one address; past
/// this, later names get no plain-HTTP credentials there until earlier answers expire).
const MAX_NAMES_PER_ADDRESS: usize = 64;

/// A DNS name as compared: lower case, no trailing dot.
fn normal_name(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// One sandbox's link and policy.
struct SandboxNet {
    id: String,
    index: u32,
    addr: Ipv4Addr,
    policy: NetworkPolicy,
    /// Destinations learned from allowed answers: address → (name, expiry).
    learned: HashMap<Ipv4Addr, (String, Instant)>,
    /// Every name whose allowed answer held an address, with its expiry: plain HTTP names its host
    /// only in a header the sandbox writes, so the vault injects there only for a host whose
    /// answer led the sandbox to that address (no fronting a credential to another server).
    answered: HashMap<Ipv4Addr, HashMap<String, Instant>>,
    /// The credential proxy, when enabled: the sandbox's CA and its vault (if one was sent).
    ca: Option<Arc<crate::mitm::SandboxCa>>,
    vault: Option<crate::vault::Vault>,
}

#[derive(Default)]
struct State {
    by_id: HashMap<String, SandboxNet>,
    by_addr: HashMap<Ipv4Addr, String>,
    used: BTreeSet<u32>,
}

pub struct Egress {
    cfg: EgressConfig,
    fw: Firewall,
    /// This server's hold on IPv4 forwarding, let go with the firewall table.
    forwarding: Forwarding,
    state: Mutex<State>,
    /// Held from deciding a change to applying it to the firewall, so a late DNS answer cannot
    /// re-add what a policy change or a detach just removed (nor hand it to the next sandbox that
    /// gets the same address).
    changes: Mutex<()>,
    /// Bounds DNS queries in flight (each holds a task and a socket).
    dns_slots: Arc<tokio::sync::Semaphore>,
    /// Told of each decision, for sandboxes' timelines (see [`Egress::observe`]).
    observer: std::sync::OnceLock<Arc<dyn crate::Observer>>,
}

/// What a sandbox's link is, for records and for the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub sandbox: Ipv4Addr,
    pub gateway: Ipv4Addr,
}

fn run(cmd: &mut Command) -> Result<(), EgressError> {
    let out = cmd
        .output()
        .map_err(|e| EgressError::Setup(format!("running {:?}: {e}", cmd.get_program())))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(EgressError::Setup(format!(
            "{:?} failed: {}",
            cmd.get_args().collect::<Vec<_>>(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

impl Egress {
    /// Installs the firewall table and starts the DNS filter. Needs root, `nft` and `ip`.
    pub async fn start(cfg: EgressConfig) -> Result<Arc<Self>, EgressError> {
        let forwarding = Forwarding::new(&cfg.table);
        forwarding
            .acquire()
            .map_err(|e| EgressError::Setup(format!("enabling IPv4 forwarding: {e}")))?;
        let started = Self::start_held(cfg, forwarding.clone()).await;
        if started.is_err() {
            let _ = forwarding.release();
        }
        started
    }

    async fn start_held(
        cfg: EgressConfig,
        forwarding: Forwarding,
    ) -> Result<Arc<Self>, EgressError> {
        // The DNS filter and the vault proxy listen on the service address only (on the host's
        // loopback interface, so no link has to exist): the firewall sends sandbox traffic there,
        // and nothing on the host's other addresses answers.
        let service = service_address(cfg.subnet);
        run(Command::new("ip").args(["addr", "replace", &format!("{service}/32"), "dev", "lo"]))?;
        let socket = UdpSocket::bind((service, 0))
            .await
            .map_err(|e| EgressError::Setup(format!("binding the DNS filter: {e}")))?;
        let port = socket
            .local_addr()
            .map_err(|e| EgressError::Setup(e.to_string()))?
            .port();
        let vault_listener = tokio::net::TcpListener::bind((service, 0))
            .await
            .map_err(|e| EgressError::Setup(format!("binding the vault proxy: {e}")))?;
        let vault_port = vault_listener
            .local_addr()
            .map_err(|e| EgressError::Setup(e.to_string()))?
            .port();
        let upstream_tls =
            crate::mitm::upstream_config(&cfg.upstream_ca_files).map_err(EgressError::Setup)?;
        let fw = Firewall {
            table: cfg.table.clone(),
            prefix: cfg.link_prefix.clone(),
            subnet: cfg.subnet,
            service,
            dns_port: port,
            vault_port,
        };
        fw.install()
            .map_err(|e| EgressError::Setup(format!("installing nftables rules: {e}")))?;
        let this = Arc::new(Self {
            cfg,
            fw,
            forwarding,
            state: Mutex::new(State::default()),
            changes: Mutex::new(()),
            dns_slots: Arc::new(tokio::sync::Semaphore::new(256)),
            observer: std::sync::OnceLock::new(),
        });
        tokio::spawn(dns_loop(this.clone(), Arc::new(socket)));
        let mitm = Arc::new(crate::mitm::Mitm::new(
            Arc::new(Lookup(Arc::downgrade(&this))),
            upstream_tls,
        ));
        tokio::spawn(mitm.serve(vault_listener));
        tracing::info!(port, table = %this.fw.table, "egress: DNS filter and firewall ready");
        Ok(this)
    }

    /// Tells `observer` of every decision from now on (the first one set stays).
    pub fn observe(&self, observer: Arc<dyn crate::Observer>) {
        let _ = self.observer.set(observer);
    }

    pub(crate) fn observer(&self) -> Option<&Arc<dyn crate::Observer>> {
        self.observer.get()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn serialize(&self) -> MutexGuard<'_, ()> {
        self.changes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn link_of(&self, index: u32) -> Link {
        let base = u32::from(self.cfg.subnet.0);
        Link {
            index,
            gateway: Ipv4Addr::from(base + index * 4 + 1),
            sandbox: Ipv4Addr::from(base + index * 4 + 2),
        }
    }

    fn capacity(&self) -> u32 {
        (1u32 << (32 - u32::from(self.cfg.subnet.1))) / 4
    }

    /// Gives sandbox `id` (whose init is `pid`) a link, with `policy`. `index` re-adopts a link
    /// that exists already (after a restart of the server).
    pub fn attach(
        &self,
        id: &str,
        pid: i32,
        policy: NetworkPolicy,
        index: Option<u32>,
    ) -> Result<Link, EgressError> {
        let _changes = self.serialize();
        let readopt = index.is_some();
        let index = {
            let mut st = self.lock();
            // A link left by a sandbox we no longer know (its record lost) still belongs to a live
            // namespace: its index is skipped, never reused.
            let index = match index {
                Some(i) => i,
                None => (1..self.capacity())
                    .find(|i| {
                        !st.used.contains(i)
                            && !index_link_exists(&format!("{}{i}", self.cfg.link_prefix))
                    })
                    .ok_or_else(|| {
                        EgressError::Exhausted(format!(
                            "{}/{}",
                            self.cfg.subnet.0, self.cfg.subnet.1
                        ))
                    })?,
            };
            st.used.insert(index);
            index
        };
        let link = self.link_of(index);
        let host_if = format!("{}{index}", self.cfg.link_prefix);
        let adopting = readopt && index_link_exists(&host_if);
        let made = if adopting {
            Ok(())
        } else {
            self.make_link(&host_if, pid, &link)
        };
        if let Err(e) = made {
            let _ = run(Command::new("ip").args(["link", "del", &host_if]));
            self.lock().used.remove(&index);
            return Err(e);
        }
        let net = SandboxNet {
            id: id.to_string(),
            index,
            addr: link.sandbox,
            policy,
            learned: HashMap::new(),
            answered: HashMap::new(),
            ca: None,
            vault: None,
        };
        let mut b = Batch::new();
        self.policy_elements(&mut b, &net, true);
        if let Err(e) = b.apply() {
            let _ = run(Command::new("ip").args(["link", "del", &host_if]));
            self.lock().used.remove(&index);
            return Err(EgressError::Setup(format!("firewall: {e}")));
        }
        let mut st = self.lock();
        st.by_addr.insert(link.sandbox, id.to_string());
        st.by_id.insert(id.to_string(), net);
        Ok(link)
    }

    fn make_link(&self, host_if: &str, pid: i32, link: &Link) -> Result<(), EgressError> {
        let len = 30;
        run(Command::new("ip").args([
            "link",
            "add",
            host_if,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &pid.to_string(),
        ]))?;
        run(Command::new("ip").args([
            "addr",
            "add",
            &format!("{}/{len}", link.gateway),
            "dev",
            host_if,
        ]))?;
        run(Command::new("ip").args(["link", "set", host_if, "up"]))?;
        // Inside: the address, the route, and no IPv6 at all.
        run(Command::new("nsenter")
            .args(["-t", &pid.to_string(), "-n", "sh", "-c"])
            .arg(format!(
                "ip addr add {}/{len} dev eth0 && ip link set eth0 up && ip route add default via {} && \
                 (echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6) 2>/dev/null; true",
                link.sandbox, link.gateway
            )))
    }

    /// Adds (or removes) the set elements a policy implies (not the learned ones).
    fn policy_elements(&self, b: &mut Batch, net: &SandboxNet, add: bool) {
        if net.policy.default_action == Action::Allow {
            self.fw.open(b, net.addr, add);
        }
        self.fw
            .address_rules(b, net.addr, &net.policy.address_elements(), add);
    }

    /// Removes a sandbox's link, its set elements and its address.
    pub fn detach(&self, id: &str) {
        let _changes = self.serialize();
        let Some(net) = ({
            let mut st = self.lock();
            let net = st.by_id.remove(id);
            if let Some(n) = &net {
                st.by_addr.remove(&n.addr);
            }
            net
        }) else {
            return;
        };
        let mut b = Batch::new();
        self.policy_elements(&mut b, &net, false);
        if net.ca.is_some() {
            self.fw.vault(&mut b, net.addr, false);
        }
        let now = Instant::now();
        for (dest, (_, exp)) in &net.learned {
            if *exp > now {
                self.fw.learned(&mut b, net.addr, *dest, None);
            }
        }
        if let Err(e) = b.apply() {
            tracing::warn!(sandbox_id = %id, error = %e, "egress: removing firewall elements");
        }
        let _ = run(Command::new("ip").args([
            "link",
            "del",
            &format!("{}{}", self.cfg.link_prefix, net.index),
        ]));
        self.lock().used.remove(&net.index);
    }

    pub fn policy(&self, id: &str) -> Option<NetworkPolicy> {
        self.lock().by_id.get(id).map(|n| n.policy.clone())
    }

    pub fn has(&self, id: &str) -> bool {
        self.lock().by_id.contains_key(id)
    }

    /// Replaces a live sandbox's policy; takes effect before it returns, including for open
    /// connections to destinations the new policy denies.
    pub fn set_policy(&self, id: &str, policy: NetworkPolicy) -> Result<(), EgressError> {
        let _changes = self.serialize();
        let mut st = self.lock();
        let Some(net) = st.by_id.get_mut(id) else {
            return Err(EgressError::Setup(format!(
                "sandbox {id} has no network link"
            )));
        };
        let mut b = Batch::new();
        self.policy_elements(&mut b, net, false);
        let old = std::mem::replace(&mut net.policy, policy);
        self.policy_elements(&mut b, net, true);
        let now = Instant::now();
        let dropped: Vec<Ipv4Addr> = net
            .learned
            .iter()
            .filter(|(dest, (name, exp))| {
                // Denied now, or internal and no longer named exactly (see `learn`).
                *exp > now
                    && (net.policy.decide_name(name) == Action::Deny
                        || (is_internal(**dest) && !net.policy.names_exactly(name)))
            })
            .map(|(d, _)| *d)
            .collect();
        for d in &dropped {
            self.fw.learned(&mut b, net.addr, *d, None);
        }
        if let Err(e) = b.apply() {
            // Memory follows the firewall: keep the old policy (its elements were not all removed).
            net.policy = old;
            return Err(EgressError::Setup(format!("firewall: {e}")));
        }
        for d in dropped {
            net.learned.remove(&d);
            net.answered.remove(&d);
        }
        Ok(())
    }

    /// Whether an allowed answer to `src` for `name` held `dst`, and `src` may still reach it under
    /// the policy as it is now (a rule removed since the answer no longer vouches for the name; an
    /// internal address only for a name a rule names itself, as when it was learned).
    pub(crate) fn answered(&self, src: Ipv4Addr, to: SocketAddrV4, name: &str) -> bool {
        let dst = *to.ip();
        let st = self.lock();
        let Some(net) = st.by_addr.get(&src).and_then(|id| st.by_id.get(id)) else {
            return false;
        };
        let now = Instant::now();
        net.answered
            .get(&dst)
            .and_then(|names| names.get(&normal_name(name)))
            .is_some_and(|exp| *exp > now)
            && net.policy.decide_name(name) == Action::Allow
            && (!is_internal(dst) || net.policy.names_exactly(name))
            && self.allows(net, to)
    }

    /// Asks the upstream resolver for `name` on behalf of the sandbox at `src`, which reached `dst`
    /// without asking itself: when the policy allows `name` and the answer holds `dst`'s address,
    /// the answer is learned as if the sandbox had asked (see `learn`), and `answered` decides.
    pub(crate) async fn resolve_for(
        self: &Arc<Self>,
        src: Ipv4Addr,
        dst: SocketAddrV4,
        name: &str,
    ) -> bool {
        if self.decide(src, name).map(|(_, a)| a) != Some(Action::Allow) {
            return false;
        }
        let query = dns::build_query(rand_id(), name, dns::TYPE_A);
        let Some(q) = dns::parse_query(&query) else {
            return false;
        };
        let Ok(upstream) = UdpSocket::bind(("0.0.0.0", 0)).await else {
            return false;
        };
        if upstream.connect(self.cfg.upstream).await.is_err() {
            return false;
        }
        let reply = dns::ask(&upstream, &query, &q).await;
        let addrs = dns::ipv4_answers(&reply);
        if !addrs.iter().any(|(a, _)| a == dst.ip()) {
            return false;
        }
        let (eg, n) = (self.clone(), name.to_string());
        let learned = tokio::task::spawn_blocking(move || eg.learn(src, &n, &addrs))
            .await
            .unwrap_or(false);
        learned && self.answered(src, dst, name)
    }

    /// The current vault of the sandbox at `src`, if `src` may still reach `dst` (checked per
    /// request, so revocations reach kept connections).
    pub(crate) fn vault_for(
        &self,
        src: Ipv4Addr,
        dst: SocketAddrV4,
    ) -> Option<crate::vault::Vault> {
        let st = self.lock();
        let net = st.by_id.get(st.by_addr.get(&src)?)?;
        if !self.allows(net, dst) {
            return None;
        }
        net.vault.clone()
    }

    /// Removes the firewall table, the service address and this server's hold on forwarding (the
    /// last server's release puts forwarding back as it found it).
    pub fn shutdown(&self) {
        self.fw.uninstall();
        let _ = run(Command::new("ip").args([
            "addr",
            "del",
            &format!("{}/32", self.fw.service),
            "dev",
            "lo",
        ]));
        if let Err(e) = self.forwarding.release() {
            tracing::warn!(error = %e, "egress: putting IPv4 forwarding back");
        }
    }

    pub fn sandbox_ids(&self) -> Vec<String> {
        self.lock().by_id.values().map(|n| n.id.clone()).collect()
    }
}

/// The DNS filter's and vault proxy's address: the first host address of the sandbox subnet, in
/// the block of link index 0, which no link uses.
fn service_address(subnet: (Ipv4Addr, u8)) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(subnet.0) + 1)
}

fn index_link_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

/// Every IPv4 address of this host (any interface), so proxied connections cannot reach the host.
fn host_addresses() -> Vec<Ipv4Addr> {
    let mut out = Vec::new();
    // SAFETY: getifaddrs allocates a list we walk read-only and free with freeifaddrs.
    unsafe {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut cur = head;
        while !cur.is_null() {
            let addr = (*cur).ifa_addr;
            if !addr.is_null() && i32::from((*addr).sa_family) == libc::AF_INET {
                let sin = addr.cast::<libc::sockaddr_in>();
                out.push(Ipv4Addr::from(u32::from_be((*sin).sin_addr.s_addr)));
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(head);
    }
    out
}

/// A DNS query id nobody can guess (the answer is matched on it, and on the question).
fn rand_id() -> u16 {
    let mut b = [0u8; 2];
    // SAFETY: getrandom(2) fills the two bytes it is given.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), 2, 0) };
    u16::from_ne_bytes(b)
}
