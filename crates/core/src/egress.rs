//! What a runtime that enforces egress policies itself is handed: the policy as the protocol writes
//! it (for an enforcer beside the sandbox that answers its DNS, so rules may name hosts), and its
//! address-only form when no rule names a host (what a NetworkPolicy per sandbox can say).

use std::net::IpAddr;

/// A network: an address and a prefix length (a host is /32 or /128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Net {
    pub addr: IpAddr,
    pub len: u8,
}

impl Net {
    /// The network's first address, `addr` with its host bits cleared.
    pub fn base(&self) -> IpAddr {
        match self.addr {
            IpAddr::V4(a) => {
                let bits = u32::from(a);
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                IpAddr::V4((bits & mask).into())
            }
            IpAddr::V6(a) => {
                let bits = u128::from(a);
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                IpAddr::V6((bits & mask).into())
            }
        }
    }

    /// Whether `ip` is in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let other = Net {
            addr: ip,
            len: self.len,
        };
        self.addr.is_ipv4() == ip.is_ipv4() && other.base() == self.base()
    }

    /// Whether `other` lies inside this network (or is it).
    pub fn covers(&self, other: &Net) -> bool {
        other.len >= self.len && self.contains(other.addr)
    }

    /// The CIDR text: `10.0.0.0/8`.
    pub fn cidr(&self) -> String {
        format!("{}/{}", self.base(), self.len)
    }
}

/// Rules in order, the first that matches deciding; `default_allow` when none does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressPolicy {
    pub default_allow: bool,
    /// `(allow, network)`.
    pub rules: Vec<(bool, Net)>,
}

impl AddressPolicy {
    /// Whether traffic to `ip` may leave.
    pub fn allows(&self, ip: IpAddr) -> bool {
        self.rules
            .iter()
            .find(|(_, net)| net.contains(ip))
            .map_or(self.default_allow, |(allow, _)| *allow)
    }
}

/// A sandbox's egress policy, for a runtime with
/// [`RuntimeCapabilities::egress_addresses`](warren_api::lifecycle::RuntimeCapabilities).
#[derive(Debug, Clone, PartialEq)]
pub struct EgressPolicy {
    /// `{defaultAction, egress: [{action, target}]}` as the protocol writes it, host rules and all:
    /// what an enforcer beside the sandbox takes (`egress_names`).
    pub rules: serde_json::Value,
    /// The same rules when none names a host; `None` when one does.
    pub addresses: Option<AddressPolicy>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Net {
        let (a, l) = s.split_once('/').expect("a CIDR");
        Net {
            addr: a.parse().expect("an address"),
            len: l.parse().expect("a length"),
        }
    }

    #[test]
    fn networks_contain_and_cover_by_prefix() {
        assert_eq!(net("10.1.2.3/8").cidr(), "10.0.0.0/8");
        assert_eq!(net("0.0.0.0/0").cidr(), "0.0.0.0/0");
        assert_eq!(net("fd00::1/8").cidr(), "fd00::/8");
        assert!(net("10.0.0.0/8").contains("10.9.9.9".parse().expect("ip")));
        assert!(!net("10.0.0.0/8").contains("11.0.0.1".parse().expect("ip")));
        assert!(!net("0.0.0.0/0").contains("::1".parse().expect("ip")));
        assert!(net("10.0.0.0/8").covers(&net("10.1.0.0/16")));
        assert!(!net("10.1.0.0/16").covers(&net("10.0.0.0/8")));
        let p = AddressPolicy {
            default_allow: false,
            rules: vec![(false, net("10.1.0.0/16")), (true, net("10.0.0.0/8"))],
        };
        assert!(p.allows("10.2.0.1".parse().expect("ip")));
        assert!(!p.allows("10.1.0.1".parse().expect("ip")));
        assert!(!p.allows("8.8.8.8".parse().expect("ip")));
    }
}
