//! Network policies as the protocol writes them (`{defaultAction, egress: [{action, target?,
//! ports?}]}`) and the decisions they make: for a DNS name (exact names, then `*.wildcard`
//! suffixes, longest first) and for an address (CIDR rules, and rules scoped to TCP ports: an
//! address or network with `ports`, or `ports` alone for every destination).
//!
//! Every field of a rule is enforced or the rule is refused: a rule read with a field dropped is
//! wider than what was asked (a port-scoped allow opening every port of its address).
//!
//! Why one file: ~400 of its lines are tests (unit and proptest). The rest is one policy type and
//! every decision read from it (names, addresses, ports, firewall sets), which must agree on what a
//! rule means and share its target parsing.

use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Allow,
    Deny,
}

/// One rule as it travels on the wire. `target` is empty for a rule of `ports` alone (the reference
/// sidecar writes such a rule back with `"target": ""`; the clients send none).
///
/// Every read of a rule checks it (`try_from`), stored records and a sidecar's state file as much
/// as a request: a rule that cannot hold as written is an error, never a rule that quietly does
/// less or more.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireRule")]
pub struct NetworkRule {
    pub action: Action,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub target: String,
    /// TCP destination ports the rule is limited to (1–65535, at most [`MAX_PORTS`], none twice);
    /// only with an address or network target, or none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<u16>>,
}

/// A rule as read, before [`NetworkRule::checked`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireRule {
    action: Action,
    #[serde(default)]
    target: String,
    #[serde(default)]
    ports: Option<Vec<u16>>,
}

impl TryFrom<WireRule> for NetworkRule {
    type Error = String;

    fn try_from(w: WireRule) -> Result<Self, String> {
        NetworkRule {
            action: w.action,
            target: w.target,
            ports: w.ports,
        }
        .checked()
    }
}

/// The most ports one rule may list (as the clients check).
pub const MAX_PORTS: usize = 256;

impl NetworkRule {
    pub fn new(action: Action, target: impl Into<String>) -> Self {
        Self {
            action,
            target: target.into(),
            ports: None,
        }
    }

    /// The rule limited to TCP `ports`.
    pub fn with_ports(mut self, ports: Vec<u16>) -> Self {
        self.ports = Some(ports);
        self
    }

    /// The network a port-scoped rule covers: its target's, or every IPv4 address for a rule of
    /// ports alone. `None` for a rule without ports (see [`NetworkPolicy::cidr_rules`]).
    fn port_network(&self) -> Option<(IpAddr, u8)> {
        self.ports.as_ref()?;
        if self.target.is_empty() {
            return Some((IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
        }
        match Target::parse(&self.target) {
            Ok(Target::Cidr(ip, len)) => Some((ip, len)),
            _ => None,
        }
    }

    /// What `PATCH` merges on: the target as written, any case or trailing dot, and the set of
    /// ports (different sets for one target are different rules).
    fn key(&self) -> (String, Option<std::collections::BTreeSet<u16>>) {
        (
            normal_target(&self.target),
            self.ports.as_ref().map(|p| p.iter().copied().collect()),
        )
    }

    /// Checks the rule as read from the wire and trims its target.
    fn checked(mut self) -> Result<Self, String> {
        self.target = self.target.trim().to_string();
        if let Some(ports) = &self.ports {
            if ports.is_empty() || ports.len() > MAX_PORTS {
                return Err(format!("ports must list 1 to {MAX_PORTS} TCP ports"));
            }
            let mut seen = std::collections::BTreeSet::new();
            for p in ports {
                if *p == 0 {
                    return Err("port 0 is out of range 1-65535".into());
                }
                if !seen.insert(*p) {
                    return Err(format!("port {p} is listed twice"));
                }
            }
        }
        if self.target.is_empty() {
            return match self.ports {
                Some(_) => Ok(self),
                None => Err("a rule needs a target, ports, or both".into()),
            };
        }
        let target = Target::parse(&self.target)?;
        if self.ports.is_some() && !matches!(target, Target::Cidr(..)) {
            return Err(format!(
                "ports are not supported for domain targets ({:?}): name an IP address or CIDR, \
                 or leave the target out to cover every destination",
                self.target
            ));
        }
        Ok(self)
    }
}

/// A port-scoped rule as enforcers take it: the network (every address for a rule of ports alone),
/// the TCP ports, and the action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRule {
    pub net: IpAddr,
    pub len: u8,
    pub ports: Vec<u16>,
    pub action: Action,
}

impl PortRule {
    /// Whether the rule covers TCP connections to `dst`.
    pub fn covers(&self, dst: std::net::SocketAddr) -> bool {
        in_cidr(dst.ip(), self.net, self.len) && self.ports.contains(&dst.port())
    }
}

/// `networkPolicy`. An omitted `defaultAction` means deny (as the reference does); `{}` means
/// allow-all (no rules and no default given).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    pub default_action: Action,
    #[serde(default)]
    pub egress: Vec<NetworkRule>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("networkPolicy must be a JSON object")]
    NotAnObject,
    #[error("defaultAction must be \"allow\" or \"deny\", not {0}")]
    BadAction(String),
    #[error("rule {index}: {message}")]
    BadRule { index: usize, message: String },
}

/// A parsed rule target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// An exact name, lower-case, no trailing dot.
    Name(String),
    /// `*.example.com`: any name strictly under `example.com`.
    Wildcard(String),
    /// An address or network.
    Cidr(IpAddr, u8),
}

impl Target {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let t = raw.trim().trim_end_matches('.').to_ascii_lowercase();
        if t.is_empty() {
            return Err("empty target".into());
        }
        if let Some((addr, len)) = t.split_once('/') {
            let ip: IpAddr = addr
                .parse()
                .map_err(|_| format!("{raw:?} is not an address/prefix"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let len: u8 = len
                .parse()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("{raw:?} has a bad prefix length"))?;
            return Ok(Self::Cidr(ip, len));
        }
        if let Ok(ip) = t.parse::<IpAddr>() {
            let len = if ip.is_ipv4() { 32 } else { 128 };
            return Ok(Self::Cidr(ip, len));
        }
        let (wild, name) = match t.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, t.clone()),
        };
        let valid = name.len() <= 253
            && name.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            });
        if !valid || name.contains('*') {
            return Err(format!(
                "{raw:?} is not a domain name, *.wildcard, IP address or CIDR"
            ));
        }
        Ok(if wild {
            Self::Wildcard(name)
        } else {
            Self::Name(name)
        })
    }
}

impl NetworkPolicy {
    pub fn allow_all() -> Self {
        Self {
            default_action: Action::Allow,
            egress: Vec::new(),
        }
    }

    pub fn deny_all() -> Self {
        Self {
            default_action: Action::Deny,
            egress: Vec::new(),
        }
    }

    /// Reads the wire form, checking every rule. `null`/absent is `None` (the server's default).
    pub fn from_json(v: &serde_json::Value) -> Result<Option<Self>, PolicyError> {
        let obj = match v {
            serde_json::Value::Null => return Ok(None),
            serde_json::Value::Object(o) => o,
            _ => return Err(PolicyError::NotAnObject),
        };
        if obj.is_empty() {
            return Ok(Some(Self::allow_all()));
        }
        let default_action = match obj.get("defaultAction") {
            None | Some(serde_json::Value::Null) => Action::Deny,
            Some(serde_json::Value::String(s)) if s.eq_ignore_ascii_case("allow") => Action::Allow,
            Some(serde_json::Value::String(s)) if s.eq_ignore_ascii_case("deny") => Action::Deny,
            Some(other) => return Err(PolicyError::BadAction(other.to_string())),
        };
        let rules = match obj.get("egress") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(v) => parse_rules(v)?,
        };
        Ok(Some(Self {
            default_action,
            egress: rules,
        }))
    }

    /// `PATCH /policy`: incoming rules win over existing ones for the same target; the first rule
    /// for a target in the incoming list wins; the default action is kept.
    /// Rules merge on (target, set of ports): the same target with other ports is another rule.
    pub fn merge(&mut self, incoming: Vec<NetworkRule>) {
        let mut merged: Vec<NetworkRule> = Vec::new();
        for r in incoming.into_iter().chain(self.egress.drain(..)) {
            if !merged.iter().any(|m| m.key() == r.key()) {
                merged.push(r);
            }
        }
        self.egress = merged;
    }

    /// `DELETE /policy`: removes the rules for these targets, whatever their ports (absent ones are
    /// fine); `""` removes the rules of ports alone.
    pub fn remove(&mut self, targets: &[String]) {
        self.egress.retain(|r| {
            !targets
                .iter()
                .any(|t| normal_target(t) == normal_target(&r.target))
        });
    }

    /// What a DNS lookup of `name` gets.
    pub fn decide_name(&self, name: &str) -> Action {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let mut best: Option<(usize, Action)> = None;
        // (a rule with ports names an address, never a host)
        for r in self.egress.iter().filter(|r| r.ports.is_none()) {
            match Target::parse(&r.target) {
                Ok(Target::Name(n)) if n == name => return r.action,
                Ok(Target::Wildcard(suffix))
                    if name.len() > suffix.len()
                        && name.ends_with(&suffix)
                        && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
                        && best.is_none_or(|(len, _)| suffix.len() > len) =>
                {
                    best = Some((suffix.len(), r.action));
                }
                _ => {}
            }
        }
        best.map(|(_, a)| a).unwrap_or(self.default_action)
    }

    /// True when an allow rule names `name` itself (not a wildcard, not the default): the only
    /// way a name's internal addresses (see [`INTERNAL_V4`]) become reachable.
    pub fn names_exactly(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        // The first rule for a name decides it, as in `decide_name`.
        self.egress
            .iter()
            .filter(|r| r.ports.is_none())
            .find(|r| matches!(Target::parse(&r.target), Ok(Target::Name(n)) if n == name))
            .is_some_and(|r| r.action == Action::Allow)
    }

    /// The CIDR rules without ports, most specific first: what an address not learned from DNS
    /// gets, on every port and protocol.
    pub fn cidr_rules(&self) -> Vec<(IpAddr, u8, Action)> {
        let mut v: Vec<(IpAddr, u8, Action)> = self
            .egress
            .iter()
            .filter(|r| r.ports.is_none())
            .filter_map(|r| match Target::parse(&r.target) {
                Ok(Target::Cidr(ip, len)) => Some((ip, len, r.action)),
                _ => None,
            })
            .collect();
        v.sort_by_key(|r| std::cmp::Reverse(r.1));
        v
    }

    /// The rules limited to TCP ports, in order. An enforcer applies every deny among them (and
    /// among [`cidr_rules`](Self::cidr_rules)) before any allow: a deny always wins.
    pub fn port_rules(&self) -> Vec<PortRule> {
        self.egress
            .iter()
            .filter_map(|r| {
                let (net, len) = r.port_network()?;
                Some(PortRule {
                    net,
                    len,
                    ports: r.ports.clone()?,
                    action: r.action,
                })
            })
            .collect()
    }

    /// The IPv4 elements of the firewall sets that enforce this policy's address rules, without
    /// overlaps: nftables refuses an interval that overlaps one already in its set (and deleting
    /// one that is not there exactly removes one that overlaps it), so a network inside another
    /// of the same set, for the same port, is left out — the wider one covers it.
    pub fn address_elements(&self) -> AddressElements {
        let mut e = AddressElements::default();
        for (ip, len, action) in self.cidr_rules() {
            let IpAddr::V4(v4) = ip else { continue };
            let set = match (action, names_internal(ip, len)) {
                (Action::Deny, _) => &mut e.cidr_deny,
                (Action::Allow, true) => &mut e.cidr_named,
                (Action::Allow, false) => &mut e.cidr_allow,
            };
            set.push((network_of(v4, len), len));
        }
        for rule in self.port_rules() {
            let IpAddr::V4(v4) = rule.net else { continue };
            let set = match (rule.action, names_internal(rule.net, rule.len)) {
                (Action::Deny, _) => &mut e.port_deny,
                (Action::Allow, true) => &mut e.port_named,
                (Action::Allow, false) => &mut e.port_allow,
            };
            for port in rule.ports {
                set.push((network_of(v4, rule.len), rule.len, port));
            }
        }
        for set in [&mut e.cidr_deny, &mut e.cidr_named, &mut e.cidr_allow] {
            let all = set.drain(..).map(|(n, l)| (n, l, 0)).collect();
            *set = widest(all).into_iter().map(|(n, l, _)| (n, l)).collect();
        }
        for set in [&mut e.port_deny, &mut e.port_named, &mut e.port_allow] {
            *set = widest(std::mem::take(set));
        }
        e
    }

    /// True when anything at all may be reached (a sandbox that can reach nothing needs no link).
    pub fn allows_anything(&self) -> bool {
        self.default_action == Action::Allow
            || self.egress.iter().any(|r| r.action == Action::Allow)
    }

    /// `dns` when only names decide, `dns+nft` when addresses are enforced too (always, here).
    pub fn mode(&self) -> &'static str {
        match (self.default_action, self.egress.is_empty()) {
            (Action::Deny, true) => "deny_all",
            (Action::Allow, true) => "allow_all",
            _ => "rules",
        }
    }
}

/// The elements of the sets an enforcer holds for one policy (see
/// [`NetworkPolicy::address_elements`]): networks as (base, prefix length), and for port-scoped
/// rules one element per TCP port. `named` sets hold allows for networks inside an internal range,
/// checked before internal ranges are refused; `deny` sets are checked before any allow.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AddressElements {
    pub cidr_deny: Vec<(Ipv4Addr, u8)>,
    pub cidr_named: Vec<(Ipv4Addr, u8)>,
    pub cidr_allow: Vec<(Ipv4Addr, u8)>,
    pub port_deny: Vec<(Ipv4Addr, u8, u16)>,
    pub port_named: Vec<(Ipv4Addr, u8, u16)>,
    pub port_allow: Vec<(Ipv4Addr, u8, u16)>,
}

fn network_of(ip: Ipv4Addr, len: u8) -> Ipv4Addr {
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ipv4Addr::from(u32::from(ip) & mask)
}

/// `items` (network, prefix length, port) without those whose network lies inside another's for
/// the same port, and without repeats, widest first.
fn widest(mut items: Vec<(Ipv4Addr, u8, u16)>) -> Vec<(Ipv4Addr, u8, u16)> {
    // widest first, so each item needs checking only against those already kept
    items.sort_by_key(|(net, len, port)| (*len, *net, *port));
    let mut kept: Vec<(Ipv4Addr, u8, u16)> = Vec::new();
    for (net, len, port) in items {
        let inside = kept.iter().any(|(k_net, k_len, k_port)| {
            *k_port == port && *k_len <= len && in_cidr(IpAddr::V4(net), IpAddr::V4(*k_net), *k_len)
        });
        if !inside {
            kept.push((net, len, port));
        }
    }
    kept
}

fn normal_target(t: &str) -> String {
    t.trim().trim_end_matches('.').to_ascii_lowercase()
}

pub fn parse_rules(v: &serde_json::Value) -> Result<Vec<NetworkRule>, PolicyError> {
    let arr = v.as_array().ok_or(PolicyError::BadRule {
        index: 0,
        message: "egress must be a list of {action, target, ports}".into(),
    })?;
    arr.iter()
        .enumerate()
        .map(|(index, r)| {
            let rule: WireRule =
                serde_json::from_value(r.clone()).map_err(|e| PolicyError::BadRule {
                    index,
                    message: format!(
                        "{e} (expected {{\"action\": \"allow\"|\"deny\", \"target\"?: …, \"ports\"?: [TCP ports]}})"
                    ),
                })?;
            NetworkRule::try_from(rule).map_err(|message| PolicyError::BadRule { index, message })
        })
        .collect()
}

/// Networks no allow reaches unless a rule names them: private (RFC 1918), shared/CGNAT
/// (100.64/10), loopback, link-local (cloud metadata), "this network", multicast and the reserved
/// 240/4 (with broadcast). `defaultAction: allow`, `0.0.0.0/0` or a wildcard name opens the
/// internet, not the host's LAN, a cloud's internal resolvers and services, or other sandboxes and
/// containers. (IPv6, ULA included, does not leave a sandbox link at all.)
pub const INTERNAL_V4: [(Ipv4Addr, u8); 9] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// True when `ip` is in one of [`INTERNAL_V4`].
pub fn is_internal(ip: Ipv4Addr) -> bool {
    INTERNAL_V4
        .iter()
        .any(|(n, l)| in_cidr(IpAddr::V4(ip), IpAddr::V4(*n), *l))
}

/// True when the network `net/len` lies wholly inside one internal range: a rule for it names
/// that range (or part of it) explicitly, so it opens what it names. `10.0.0.0/8` or
/// `10.1.2.3/32` names one; `0.0.0.0/0` or `0.0.0.0/1` does not.
pub fn names_internal(net: IpAddr, len: u8) -> bool {
    let IpAddr::V4(v4) = net else {
        return false;
    };
    INTERNAL_V4
        .iter()
        .any(|(n, l)| len >= *l && in_cidr(IpAddr::V4(v4), IpAddr::V4(*n), *l))
}

/// True when `ip` is inside `net/len`.
pub fn in_cidr(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if len == 0 {
                0
            } else {
                u128::MAX << (128 - len)
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(v: serde_json::Value) -> NetworkPolicy {
        NetworkPolicy::from_json(&v).expect("valid").expect("some")
    }

    #[test]
    fn defaults_follow_the_reference() {
        assert_eq!(policy(json!({})), NetworkPolicy::allow_all());
        assert_eq!(policy(json!({"egress": []})).default_action, Action::Deny);
        assert_eq!(NetworkPolicy::from_json(&json!(null)), Ok(None));
        assert!(NetworkPolicy::from_json(&json!({"defaultAction": "maybe"})).is_err());
        let err =
            NetworkPolicy::from_json(&json!({"egress": [{"action": "allow", "target": "a b"}]}))
                .expect_err("bad target");
        assert!(err.to_string().contains("rule 0"), "{err}");
    }

    #[test]
    fn internal_ranges_open_only_when_named() {
        let v4 = |s: &str| s.parse::<Ipv4Addr>().expect("address");
        for a in [
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.254",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.254",
            "169.254.169.254",
            "127.0.0.1",
            "0.1.2.3",
            "224.0.0.251",
            "239.255.255.250",
            "255.255.255.255",
        ] {
            assert!(is_internal(v4(a)), "{a}");
        }
        for a in [
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "198.18.0.2",
            "192.169.0.1",
        ] {
            assert!(!is_internal(v4(a)), "{a}");
        }
        let ip = |s: &str| s.parse::<IpAddr>().expect("address");
        assert!(names_internal(ip("10.0.0.0"), 8));
        assert!(names_internal(ip("10.1.2.3"), 32));
        assert!(names_internal(ip("169.254.169.254"), 32));
        assert!(!names_internal(ip("0.0.0.0"), 0));
        assert!(!names_internal(ip("0.0.0.0"), 1));
        assert!(
            !names_internal(ip("8.0.0.0"), 5),
            "8/5 holds 10/8 but is not inside it"
        );
        assert!(!names_internal(ip("172.0.0.0"), 8));
        assert!(!names_internal(ip("fd00::"), 8), "IPv6 never leaves a link");

        let p = policy(json!({"defaultAction": "allow", "egress": [
            {"action": "allow", "target": "db.internal.example"},
            {"action": "allow", "target": "*.example.com"},
            {"action": "deny", "target": "gone.example"},
            {"action": "allow", "target": "gone.example"},
        ]}));
        assert!(p.names_exactly("db.internal.example."));
        assert!(p.names_exactly("DB.Internal.Example"));
        assert!(
            !p.names_exactly("api.example.com"),
            "a wildcard names no one"
        );
        assert!(!p.names_exactly("other.example"), "nor does the default");
        assert!(
            !p.names_exactly("gone.example"),
            "the first rule for a name decides it"
        );
    }

    #[test]
    fn names_wildcards_and_specificity() {
        let p = policy(json!({"defaultAction": "deny", "egress": [
            {"action": "allow", "target": "*.example.com"},
            {"action": "deny", "target": "*.secret.example.com"},
            {"action": "allow", "target": "open.secret.example.com"},
            {"action": "allow", "target": "pypi.org."},
        ]}));
        assert_eq!(p.decide_name("api.example.com"), Action::Allow);
        assert_eq!(p.decide_name("API.Example.COM."), Action::Allow);
        assert_eq!(
            p.decide_name("example.com"),
            Action::Deny,
            "a wildcard is strictly under"
        );
        assert_eq!(p.decide_name("badexample.com"), Action::Deny);
        assert_eq!(
            p.decide_name("x.secret.example.com"),
            Action::Deny,
            "longer suffix wins"
        );
        assert_eq!(
            p.decide_name("open.secret.example.com"),
            Action::Allow,
            "exact wins"
        );
        assert_eq!(p.decide_name("pypi.org"), Action::Allow);
        assert_eq!(p.decide_name("files.pypi.org"), Action::Deny);
        assert!(p.allows_anything());
        assert!(!NetworkPolicy::deny_all().allows_anything());
    }

    #[test]
    fn cidrs() {
        let p = policy(json!({"defaultAction": "allow", "egress": [
            {"action": "deny", "target": "10.0.0.0/8"},
            {"action": "allow", "target": "10.1.2.3"},
        ]}));
        let rules = p.cidr_rules();
        assert_eq!(rules[0].1, 32, "most specific first");
        assert!(in_cidr(
            "10.9.9.9".parse().expect("ip"),
            "10.0.0.0".parse().expect("ip"),
            8
        ));
        assert!(!in_cidr(
            "11.0.0.1".parse().expect("ip"),
            "10.0.0.0".parse().expect("ip"),
            8
        ));
        assert!(Target::parse("10.0.0.0/33").is_err());
        assert!(matches!(
            Target::parse("2001:db8::/32"),
            Ok(Target::Cidr(_, 32))
        ));
    }

    #[test]
    fn patch_and_delete() {
        let mut p = policy(json!({"defaultAction": "deny", "egress": [
            {"action": "allow", "target": "a.com"}, {"action": "allow", "target": "b.com"}]}));
        p.merge(vec![
            NetworkRule::new(Action::Deny, "a.com"),
            NetworkRule::new(Action::Allow, "a.com"),
            NetworkRule::new(Action::Allow, "c.com"),
        ]);
        assert_eq!(
            p.decide_name("a.com"),
            Action::Deny,
            "incoming wins, first incoming wins"
        );
        assert_eq!(p.decide_name("b.com"), Action::Allow);
        assert_eq!(p.decide_name("c.com"), Action::Allow);
        p.remove(&["A.com".into(), "zzz.com".into()]);
        assert_eq!(p.decide_name("a.com"), Action::Deny, "back to the default");
        assert_eq!(p.egress.len(), 2);
    }

    fn rules_err(v: serde_json::Value) -> String {
        NetworkPolicy::from_json(&json!({"egress": v}))
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn port_scoped_rules_are_read_whole_or_refused() {
        let p = policy(json!({"defaultAction": "deny", "egress": [
            {"action": "allow", "target": " 10.0.0.5 ", "ports": [443, 8443]},
            {"action": "deny", "ports": [25]},
            {"action": "deny", "target": "", "ports": [23]},
            {"action": "allow", "target": "10.0.0.0/8"},
        ]}));
        assert_eq!(p.egress[0].target, "10.0.0.5", "trimmed");
        assert_eq!(
            serde_json::to_value(&p).expect("json")["egress"],
            json!([
                {"action": "allow", "target": "10.0.0.5", "ports": [443, 8443]},
                {"action": "deny", "ports": [25]},
                {"action": "deny", "ports": [23]},
                {"action": "allow", "target": "10.0.0.0/8"},
            ]),
            "read back as sent"
        );
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        assert_eq!(
            p.port_rules(),
            vec![
                PortRule {
                    net: ip("10.0.0.5"),
                    len: 32,
                    ports: vec![443, 8443],
                    action: Action::Allow
                },
                PortRule {
                    net: ip("0.0.0.0"),
                    len: 0,
                    ports: vec![25],
                    action: Action::Deny
                },
                PortRule {
                    net: ip("0.0.0.0"),
                    len: 0,
                    ports: vec![23],
                    action: Action::Deny
                },
            ]
        );
        assert_eq!(
            p.cidr_rules(),
            vec![(ip("10.0.0.0"), 8, Action::Allow)],
            "a port-scoped rule is never an address rule for every port"
        );
        assert!(p.port_rules()[0].covers("10.0.0.5:443".parse().expect("addr")));
        assert!(!p.port_rules()[0].covers("10.0.0.5:80".parse().expect("addr")));
        assert!(!p.port_rules()[0].covers("10.0.0.6:443".parse().expect("addr")));
        assert!(p.port_rules()[1].covers("8.8.8.8:25".parse().expect("addr")));

        for (bad, why) in [
            (
                json!([{"action": "allow", "target": "example.com", "ports": [443]}]),
                "domain",
            ),
            (
                json!([{"action": "allow", "target": "*.example.com", "ports": [443]}]),
                "domain",
            ),
            (
                json!([{"action": "allow", "target": "10.0.0.5", "ports": []}]),
                "1 to 256",
            ),
            (
                json!([{"action": "allow", "target": "10.0.0.5", "ports": [0]}]),
                "port 0",
            ),
            (
                json!([{"action": "allow", "target": "10.0.0.5", "ports": [65536]}]),
                "65536",
            ),
            (
                json!([{"action": "allow", "target": "10.0.0.5", "ports": [443, 443]}]),
                "twice",
            ),
            (
                json!([{"action": "allow", "target": "10.0.0.5", "ports": (1..=257).collect::<Vec<u32>>()}]),
                "1 to 256",
            ),
            (json!([{"action": "allow"}]), "target, ports"),
            (
                json!([{"action": "allow", "target": "  "}]),
                "target, ports",
            ),
            (
                json!([{"action": "allow", "target": "10.0.0.5", "protocol": "udp"}]),
                "unknown field",
            ),
            (
                json!([{"action": "allow", "target": "10.0.0.5", "ports": ["443"]}]),
                "ports",
            ),
        ] {
            let err = rules_err(bad.clone());
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn a_stored_rule_is_checked_as_a_request_is() {
        let bad = json!({"defaultAction": "deny", "egress": [
            {"action": "deny", "target": "example.com", "ports": [443]}]});
        assert!(serde_json::from_value::<NetworkPolicy>(bad).is_err());
        let good = json!({"defaultAction": "deny", "egress": [
            {"action": "deny", "target": " 10.0.0.5 ", "ports": [443]}]});
        let p: NetworkPolicy = serde_json::from_value(good).expect("a good rule");
        assert_eq!(p.egress[0].target, "10.0.0.5");
    }

    #[test]
    fn port_scoped_rules_merge_on_target_and_port_set() {
        let mut p = policy(json!({"defaultAction": "deny", "egress": [
            {"action": "allow", "target": "10.0.0.5", "ports": [443]},
            {"action": "allow", "target": "10.0.0.5"},
            {"action": "deny", "ports": [25]},
        ]}));
        p.merge(vec![
            NetworkRule::new(Action::Deny, "10.0.0.5").with_ports(vec![443]),
            NetworkRule::new(Action::Allow, "10.0.0.5").with_ports(vec![80, 443]),
            NetworkRule::new(Action::Allow, "10.0.0.5").with_ports(vec![443, 80]),
        ]);
        let got: Vec<(Action, &str, Option<Vec<u16>>)> = p
            .egress
            .iter()
            .map(|r| (r.action, r.target.as_str(), r.ports.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (Action::Deny, "10.0.0.5", Some(vec![443])),
                (Action::Allow, "10.0.0.5", Some(vec![80, 443])),
                (Action::Allow, "10.0.0.5", None),
                (Action::Deny, "", Some(vec![25])),
            ],
            "the same set of ports is one rule, the first incoming wins; other sets coexist"
        );
        p.remove(&["".into()]);
        assert!(
            p.egress.iter().all(|r| !r.target.is_empty()),
            "\"\" removes the rules of ports alone"
        );
        p.remove(&["10.0.0.5".into()]);
        assert!(p.egress.is_empty(), "a target goes with every port set");
    }

    #[test]
    fn firewall_elements_never_overlap_within_a_set() {
        let p = policy(json!({"defaultAction": "deny", "egress": [
            {"action": "allow", "target": "10.0.0.5"},
            {"action": "allow", "target": "10.0.0.0/8"},
            {"action": "allow", "target": "10.1.2.3/8"},
            {"action": "deny", "target": "8.8.8.8"},
            {"action": "allow", "target": "10.0.0.5", "ports": [443, 80]},
            {"action": "allow", "target": "10.0.0.0/24", "ports": [443]},
            {"action": "allow", "target": "1.2.3.4", "ports": [443]},
            {"action": "allow", "ports": [443]},
            {"action": "deny", "ports": [25]},
            {"action": "deny", "target": "9.9.9.9", "ports": [25, 26]},
        ]}));
        let v4 = |s: &str| s.parse::<Ipv4Addr>().expect("ip");
        let e = p.address_elements();
        assert_eq!(e.cidr_named, vec![(v4("10.0.0.0"), 8)]);
        assert_eq!(e.cidr_deny, vec![(v4("8.8.8.8"), 32)]);
        assert!(e.cidr_allow.is_empty());
        assert_eq!(
            e.port_named,
            vec![(v4("10.0.0.0"), 24, 443), (v4("10.0.0.5"), 32, 80)]
        );
        assert_eq!(e.port_allow, vec![(v4("0.0.0.0"), 0, 443)]);
        assert_eq!(
            e.port_deny,
            vec![(v4("0.0.0.0"), 0, 25), (v4("9.9.9.9"), 32, 26)]
        );
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    fn label() -> impl Strategy<Value = String> {
        "[a-z0-9][a-z0-9-]{0,10}"
    }

    fn policy(default_action: Action, rules: Vec<(Action, String)>) -> NetworkPolicy {
        NetworkPolicy {
            default_action,
            egress: rules
                .into_iter()
                .map(|(a, t)| NetworkRule::new(a, t))
                .collect(),
        }
    }

    proptest! {
        /// `*.S` takes any name strictly under S, never S itself nor a name that merely ends in
        /// S's text; case and a trailing dot change nothing.
        #[test]
        fn a_wildcard_takes_names_strictly_under_it(sub in label(), a in label(), b in label()) {
            let suffix = format!("{a}.{b}");
            let p = policy(Action::Deny, vec![(Action::Allow, format!("*.{suffix}"))]);
            let under = format!("{sub}.{suffix}");
            prop_assert_eq!(p.decide_name(&under), Action::Allow);
            prop_assert_eq!(p.decide_name(&format!("{}.", under.to_uppercase())), Action::Allow);
            prop_assert_eq!(p.decide_name(&suffix), Action::Deny);
            prop_assert_eq!(p.decide_name(&format!("{sub}{suffix}")), Action::Deny);
        }

        /// An exact name beats any wildcard over it, and a longer wildcard beats a shorter one,
        /// whatever order the rules come in.
        #[test]
        fn the_most_specific_rule_decides_in_any_order(
            host in label(), mid in label(), other in label(), top in label(), order in 0u8..8,
        ) {
            prop_assume!(host != other);
            let top = format!("{top}.test");
            let mut rules = vec![
                (Action::Deny, format!("*.{top}")),
                (Action::Allow, format!("*.{mid}.{top}")),
                (Action::Deny, format!("{host}.{mid}.{top}")),
            ];
            rules.rotate_left(usize::from(order) % 3);
            if order & 4 != 0 {
                rules.reverse();
            }
            let p = policy(Action::Allow, rules);
            prop_assert_eq!(p.decide_name(&format!("{host}.{mid}.{top}")), Action::Deny);
            prop_assert_eq!(p.decide_name(&format!("{other}.{mid}.{top}")), Action::Allow);
            prop_assert_eq!(p.decide_name(&format!("{other}.{top}")), Action::Deny);
            prop_assert_eq!(p.decide_name("unrelated.example"), Action::Allow);
        }
    }
}
