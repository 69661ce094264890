//! Network policies as the protocol writes them (`{defaultAction, egress: [{action, target}]}`) and
//! the decisions they make: for a DNS name (exact names, then `*.wildcard` suffixes, longest first)
//! and for an address (CIDR rules, most specific first).

use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Allow,
    Deny,
}

/// One rule as it travels on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkRule {
    pub action: Action,
    pub target: String,
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
    pub fn merge(&mut self, incoming: Vec<NetworkRule>) {
        let mut merged: Vec<NetworkRule> = Vec::new();
        for r in incoming.into_iter().chain(self.egress.drain(..)) {
            if !merged.iter().any(|m| same_target(&m.target, &r.target)) {
                merged.push(r);
            }
        }
        self.egress = merged;
    }

    /// `DELETE /policy`: removes the rules for these targets (absent ones are fine).
    pub fn remove(&mut self, targets: &[String]) {
        self.egress
            .retain(|r| !targets.iter().any(|t| same_target(t, &r.target)));
    }

    /// What a DNS lookup of `name` gets.
    pub fn decide_name(&self, name: &str) -> Action {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let mut best: Option<(usize, Action)> = None;
        for r in &self.egress {
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
            .find(|r| matches!(Target::parse(&r.target), Ok(Target::Name(n)) if n == name))
            .is_some_and(|r| r.action == Action::Allow)
    }

    /// The CIDR rules, most specific first: what an address not learned from DNS gets.
    pub fn cidr_rules(&self) -> Vec<(IpAddr, u8, Action)> {
        let mut v: Vec<(IpAddr, u8, Action)> = self
            .egress
            .iter()
            .filter_map(|r| match Target::parse(&r.target) {
                Ok(Target::Cidr(ip, len)) => Some((ip, len, r.action)),
                _ => None,
            })
            .collect();
        v.sort_by_key(|r| std::cmp::Reverse(r.1));
        v
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

fn same_target(a: &str, b: &str) -> bool {
    a.trim()
        .trim_end_matches('.')
        .eq_ignore_ascii_case(b.trim().trim_end_matches('.'))
}

pub fn parse_rules(v: &serde_json::Value) -> Result<Vec<NetworkRule>, PolicyError> {
    let arr = v.as_array().ok_or(PolicyError::BadRule {
        index: 0,
        message: "egress must be a list of {action, target}".into(),
    })?;
    arr.iter()
        .enumerate()
        .map(|(index, r)| {
            let rule: NetworkRule =
                serde_json::from_value(r.clone()).map_err(|e| PolicyError::BadRule {
                    index,
                    message: format!(
                        "{e} (expected {{\"action\": \"allow\"|\"deny\", \"target\": …}})"
                    ),
                })?;
            Target::parse(&rule.target)
                .map_err(|message| PolicyError::BadRule { index, message })?;
            Ok(rule)
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
            NetworkRule {
                action: Action::Deny,
                target: "a.com".into(),
            },
            NetworkRule {
                action: Action::Allow,
                target: "a.com".into(),
            },
            NetworkRule {
                action: Action::Allow,
                target: "c.com".into(),
            },
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
}
