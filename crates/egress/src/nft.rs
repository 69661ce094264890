//! The nftables side: one table of Warren's (per data dir) holding the rules every sandbox link goes
//! through, and sets whose elements say, per sandbox address, what it may reach. Changes are atomic
//! `nft -f -` batches.
//!
//! From a sandbox link (`w<tag>-*`): a source address that does not belong to the link it came in on
//! is dropped (no spoofing a neighbour's policy); DNS (any server, UDP port 53) is redirected to
//! Warren's DNS filter (TCP port 53 is just traffic, judged like any other), and a UDP/53 packet that
//! reaches the forward chain anyway (a flow the redirect missed) is dropped, never sent on; the host
//! itself is unreachable (its API, its services, its other addresses); other sandboxes are
//! unreachable; IPv6 is dropped (sandbox links carry IPv4 only, and the DNS filter answers AAAA
//! queries with no records). Everything else is checked packet by packet — no "established"
//! shortcut for outgoing packets, so removing an address cuts the open connections to it at once:
//! explicit CIDR denies and port-scoped denies (a deny always wins; a port-scoped one covers its
//! ports on every transport, UDP — QUIC — included, though allows open TCP only), then addresses learned from
//! allowed DNS answers (with the answer's TTL; internal ones only for names a rule names exactly),
//! allowed CIDRs (on every port, or on their TCP ports) that lie inside an internal range, then the
//! internal ranges themselves (private, CGNAT, link-local, loopback, multicast, reserved:
//! `policy::INTERNAL_V4`) are refused, and only then come other allowed CIDRs, port-scoped allows
//! (a rule of ports alone is `0.0.0.0/0` on those ports) and sandboxes whose default is allow. So
//! an allow reaches the internet, never the host's networks, unless a rule names the range or the
//! name.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

#[derive(Debug, Clone)]
pub struct Firewall {
    pub table: String,
    /// Name prefix of this server's links (host ends); other servers' links are not ours to judge.
    pub prefix: String,
    pub subnet: (Ipv4Addr, u8),
    /// The host address the DNS filter and the vault proxy listen on (on `lo`).
    pub service: Ipv4Addr,
    pub dns_port: u16,
    /// The credential vault's proxy: port-80 and port-443 traffic of sandboxes in `vault4` goes there.
    pub vault_port: u16,
}

/// Runs one nft batch.
pub fn apply(batch: &str) -> std::io::Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("running nft (is nftables installed?): {e}"),
            )
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(batch.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "nft: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

impl Firewall {
    /// Replaces the table with a fresh one (sets empty).
    pub fn install(&self) -> std::io::Result<()> {
        let t = &self.table;
        let (net, len) = self.subnet;
        let p = &self.prefix;
        let port = self.dns_port;
        let vport = self.vault_port;
        let svc = self.service;
        let internal = crate::policy::INTERNAL_V4
            .iter()
            .map(|(n, l)| format!("{n}/{l}"))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = apply(&format!("delete table inet {t}\n"));
        apply(&format!(
            r#"table inet {t} {{
  set open4 {{ type ipv4_addr; }}
  set learned4 {{ type ipv4_addr . ipv4_addr; flags timeout; }}
  set cidr_allow4 {{ type ipv4_addr . ipv4_addr; flags interval; }}
  set cidr_deny4 {{ type ipv4_addr . ipv4_addr; flags interval; }}
  set cidr_named4 {{ type ipv4_addr . ipv4_addr; flags interval; }}
  set port_deny4 {{ type ipv4_addr . ipv4_addr . inet_service; flags interval; }}
  set port_named4 {{ type ipv4_addr . ipv4_addr . inet_service; flags interval; }}
  set port_allow4 {{ type ipv4_addr . ipv4_addr . inet_service; flags interval; }}
  set internal4 {{ type ipv4_addr; flags interval; elements = {{ {internal} }} }}
  set vault4 {{ type ipv4_addr; }}
  chain antispoof {{
    type filter hook prerouting priority raw; policy accept;
    iifname "{p}*" fib saddr . iif oif missing drop
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{p}*" udp dport 53 dnat ip to {svc}:{port}
    iifname "{p}*" ip saddr @vault4 tcp dport {{ 80, 443 }} dnat ip to {svc}:{vport}
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{p}*" ip daddr {svc} udp dport {port} accept
    iifname "{p}*" ip saddr @vault4 ip daddr {svc} tcp dport {vport} accept
    iifname "{p}*" drop
    udp dport {port} drop
    tcp dport {vport} drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{p}*" oifname "{p}*" drop
    oifname "{p}*" ct state established,related accept
    oifname "{p}*" drop
    iifname "{p}*" meta nfproto ipv6 drop
    iifname "{p}*" udp dport 53 drop
    iifname "{p}*" ip saddr . ip daddr @cidr_deny4 reject with icmpx type admin-prohibited
    iifname "{p}*" meta l4proto {{ tcp, udp, sctp, udplite }} ip saddr . ip daddr . th dport @port_deny4 reject with icmpx type admin-prohibited
    iifname "{p}*" ip saddr . ip daddr @learned4 accept
    iifname "{p}*" ip saddr . ip daddr @cidr_named4 accept
    iifname "{p}*" ip saddr . ip daddr . tcp dport @port_named4 accept
    iifname "{p}*" ip daddr @internal4 reject with icmpx type admin-prohibited
    iifname "{p}*" ip saddr . ip daddr @cidr_allow4 accept
    iifname "{p}*" ip saddr . ip daddr . tcp dport @port_allow4 accept
    iifname "{p}*" ip saddr @open4 accept
    iifname "{p}*" reject with icmpx type admin-prohibited
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {net}/{len} oifname != "{p}*" masquerade
  }}
}}
"#
        ))
    }

    pub fn uninstall(&self) {
        let _ = apply(&format!("delete table inet {}\n", self.table));
    }
}

/// A batch of set changes being built: duplicates are dropped, and additions go in one atomic
/// `nft` run while deletions are applied leniently (an element already gone — expired, or removed
/// twice — must not abort the rest).
#[derive(Default)]
pub struct Batch {
    adds: std::collections::BTreeSet<String>,
    deletes: std::collections::BTreeSet<String>,
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn line(&mut self, l: String) {
        if l.starts_with("delete ") {
            self.deletes.insert(l);
        } else {
            self.adds.insert(l);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.adds.is_empty() && self.deletes.is_empty()
    }

    /// Deletions first (leniently: one by one if the batch fails), then the additions, atomically.
    pub fn apply(self) -> std::io::Result<()> {
        if !self.deletes.is_empty() {
            let all: String = self.deletes.iter().map(|l| format!("{l}\n")).collect();
            if apply(&all).is_err() {
                for l in &self.deletes {
                    let _ = apply(&format!("{l}\n"));
                }
            }
        }
        if self.adds.is_empty() {
            return Ok(());
        }
        let all: String = self.adds.iter().map(|l| format!("{l}\n")).collect();
        apply(&all)
    }
}

impl Firewall {
    pub fn open(&self, b: &mut Batch, sandbox: Ipv4Addr, open: bool) {
        let verb = if open { "add" } else { "delete" };
        b.line(format!(
            "{verb} element inet {} open4 {{ {sandbox} }}",
            self.table
        ));
    }

    pub fn vault(&self, b: &mut Batch, sandbox: Ipv4Addr, on: bool) {
        let verb = if on { "add" } else { "delete" };
        b.line(format!(
            "{verb} element inet {} vault4 {{ {sandbox} }}",
            self.table
        ));
    }

    pub fn learned(&self, b: &mut Batch, sandbox: Ipv4Addr, dest: Ipv4Addr, ttl_s: Option<u32>) {
        match ttl_s {
            // `add` would keep an older, shorter timeout: delete first (ignored when absent is not
            // possible in a batch, so the caller tracks what exists).
            Some(ttl) => b.line(format!(
                "add element inet {} learned4 {{ {sandbox} . {dest} timeout {}s }}",
                self.table,
                ttl.max(1)
            )),
            None => b.line(format!(
                "delete element inet {} learned4 {{ {sandbox} . {dest} }}",
                self.table
            )),
        }
    }

    /// Adds (or removes) the elements of `sandbox`'s address rules.
    pub fn address_rules(
        &self,
        b: &mut Batch,
        sandbox: Ipv4Addr,
        e: &crate::policy::AddressElements,
        add: bool,
    ) {
        let verb = if add { "add" } else { "delete" };
        let t = &self.table;
        for (set, nets) in [
            ("cidr_deny4", &e.cidr_deny),
            ("cidr_named4", &e.cidr_named),
            ("cidr_allow4", &e.cidr_allow),
        ] {
            for (net, len) in nets {
                b.line(format!(
                    "{verb} element inet {t} {set} {{ {sandbox} . {net}/{len} }}"
                ));
            }
        }
        for (set, nets) in [
            ("port_deny4", &e.port_deny),
            ("port_named4", &e.port_named),
            ("port_allow4", &e.port_allow),
        ] {
            for (net, len, port) in nets {
                b.line(format!(
                    "{verb} element inet {t} {set} {{ {sandbox} . {net}/{len} . {port} }}"
                ));
            }
        }
    }
}
