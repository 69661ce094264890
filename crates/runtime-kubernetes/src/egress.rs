//! A sandbox's egress policy as a NetworkPolicy of its own. The instance's NetworkPolicy lets its
//! sandboxes reach nothing; NetworkPolicies add up, so a sandbox whose policy lets addresses out
//! gets one more, selecting its Pod alone, whose `ipBlock`s are exactly what its rules allow.
//!
//! Warren's rules are ordered (the first that matches decides); a NetworkPolicy is a union of
//! blocks, each a network less some of its parts. Networks nest or are apart, so an allow rule
//! becomes its network less the deny rules before it that lie inside it (or nothing, when one
//! before it holds it), and a default of allow becomes every address less every deny rule: an
//! address a deny rule holds is still let out by an allow rule before that deny, whose own block
//! holds it. `tests` checks this against the rules' own reading, address by address.

use serde_json::{json, Value};
use warren_core::{AddressPolicy, Net};

use crate::pod::{LABEL_OWNER, LABEL_SANDBOX};

/// Puts `rules` (the whole policy, as the protocol writes it) in force in the egress sidecar of the
/// Pod at `ip`; in force when this returns.
pub async fn push_to_sidecar(
    ip: &str,
    credential: &str,
    rules: &Value,
) -> Result<(), warren_core::RuntimeError> {
    let fail = |e: String| {
        warren_core::RuntimeError::backend(format!("the sandbox's egress sidecar: {e}"))
    };
    let host: std::net::IpAddr = ip.parse().map_err(|_| fail(format!("bad Pod IP {ip:?}")))?;
    let url = format!(
        "http://{}/policy",
        std::net::SocketAddr::new(host, warren_api::EGRESS_SIDECAR_PORT)
    );
    let client = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(std::time::Duration::from_secs(3))
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .map_err(|e| fail(e.to_string()))?;
    let resp = client
        .put(&url)
        .header(warren_api::EXECD_TOKEN_HEADER, credential)
        .json(rules)
        .send()
        .await
        .map_err(|e| fail(e.to_string()))?;
    if resp.status().is_success() {
        return Ok(());
    }
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    Err(fail(format!(
        "{status}: {}",
        body.chars().take(300).collect::<String>()
    )))
}

/// The name of sandbox `id`'s own NetworkPolicy.
pub fn policy_name(id: &str) -> String {
    format!("warren-{id}-egress")
}

/// What `policy` lets out, as blocks: a network, less the networks listed with it.
pub fn ip_blocks(policy: &AddressPolicy) -> Vec<(Net, Vec<Net>)> {
    let mut blocks: Vec<(Net, Vec<Net>)> = Vec::new();
    for (i, (allow, net)) in policy.rules.iter().enumerate() {
        if !allow {
            continue;
        }
        let denied_before = policy.rules[..i].iter().filter(|(a, _)| !a).map(|(_, n)| n);
        let mut except = Vec::new();
        let mut shadowed = false;
        for d in denied_before {
            if d.covers(net) {
                shadowed = true;
                break;
            }
            if net.covers(d) && !except.contains(d) {
                except.push(*d);
            }
        }
        if !shadowed {
            blocks.push((*net, except));
        }
    }
    if policy.default_allow {
        for any in [
            Net {
                addr: std::net::Ipv4Addr::UNSPECIFIED.into(),
                len: 0,
            },
            Net {
                addr: std::net::Ipv6Addr::UNSPECIFIED.into(),
                len: 0,
            },
        ] {
            let mut except = Vec::new();
            let mut shadowed = false;
            for (_, d) in policy.rules.iter().filter(|(a, _)| !a) {
                if d.addr.is_ipv4() != any.addr.is_ipv4() {
                    continue;
                }
                if d.len == 0 {
                    shadowed = true;
                    break;
                }
                if !except.contains(d) {
                    except.push(*d);
                }
            }
            if !shadowed {
                blocks.push((any, except));
            }
        }
    }
    blocks
}

/// Sandbox `id`'s NetworkPolicy, owned by its Pod (`pod`, `uid`) so the cluster removes it with
/// the Pod; `None` when the policy lets nothing out (the instance's policy says all).
pub fn network_policy(
    id: &str,
    instance: &str,
    pod: &str,
    uid: &str,
    policy: &AddressPolicy,
) -> Option<Value> {
    let blocks = ip_blocks(policy);
    if blocks.is_empty() {
        return None;
    }
    let to: Vec<Value> = blocks
        .iter()
        .map(|(net, except)| {
            let mut block = json!({"cidr": net.cidr()});
            if !except.is_empty() {
                block["except"] = json!(except.iter().map(Net::cidr).collect::<Vec<_>>());
            }
            json!({"ipBlock": block})
        })
        .collect();
    Some(json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": policy_name(id),
            "labels": {LABEL_SANDBOX: id, LABEL_OWNER: instance, "app.kubernetes.io/managed-by": "warren"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}],
        },
        "spec": {
            "podSelector": {"matchLabels": {LABEL_SANDBOX: id, LABEL_OWNER: instance}},
            "policyTypes": ["Egress"],
            "egress": [{"to": to}],
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    fn net(s: &str) -> Net {
        let (a, l) = s
            .split_once('/')
            .unwrap_or((s, if s.contains(':') { "128" } else { "32" }));
        Net {
            addr: a.parse().expect("an address"),
            len: l.parse().expect("a length"),
        }
    }

    /// Whether the blocks let `ip` out, as a network plugin reads them.
    fn blocks_allow(blocks: &[(Net, Vec<Net>)], ip: IpAddr) -> bool {
        blocks
            .iter()
            .any(|(n, except)| n.contains(ip) && !except.iter().any(|e| e.contains(ip)))
    }

    /// A small deterministic generator (no dependency for one test).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 33
        }
    }

    #[test]
    fn the_blocks_let_out_exactly_what_the_rules_allow() {
        // Rules over a few nested and disjoint networks of 10.0.0.0/8 (and one IPv6 one), in
        // every order the generator makes, checked at addresses inside and around each of them.
        let nets: Vec<Net> = [
            "10.0.0.0/8",
            "10.1.0.0/16",
            "10.1.2.0/24",
            "10.1.2.3",
            "10.2.0.0/16",
            "192.168.0.0/16",
            "0.0.0.0/0",
            "fd00::/8",
        ]
        .iter()
        .map(|s| net(s))
        .collect();
        let probes: Vec<IpAddr> = [
            "10.0.0.1",
            "10.1.0.1",
            "10.1.2.1",
            "10.1.2.3",
            "10.2.0.9",
            "10.3.0.1",
            "192.168.1.1",
            "8.8.8.8",
            "fd00::1",
            "2001:db8::1",
        ]
        .iter()
        .map(|s| s.parse().expect("an address"))
        .collect();
        let mut rng = Lcg(7);
        for _ in 0..5000 {
            let n = (rng.next() % 5) as usize;
            let policy = AddressPolicy {
                default_allow: rng.next().is_multiple_of(2),
                rules: (0..n)
                    .map(|_| {
                        (
                            rng.next().is_multiple_of(2),
                            nets[(rng.next() as usize) % nets.len()],
                        )
                    })
                    .collect(),
            };
            let blocks = ip_blocks(&policy);
            for ip in &probes {
                assert_eq!(
                    blocks_allow(&blocks, *ip),
                    policy.allows(*ip),
                    "{ip} under {policy:?}: blocks {blocks:?}"
                );
            }
            // Every exception lies strictly inside its block, as the API server demands.
            for (n, except) in &blocks {
                assert!(
                    except.iter().all(|e| n.covers(e) && e.len > n.len),
                    "{blocks:?}"
                );
            }
        }
    }

    #[test]
    fn a_policy_that_lets_nothing_out_has_no_network_policy() {
        let deny = AddressPolicy {
            default_allow: false,
            rules: vec![(false, net("10.0.0.0/8")), (true, net("10.1.0.0/16"))],
        };
        assert!(network_policy("s", "w", "warren-s", "u", &deny).is_none());
        let some = AddressPolicy {
            default_allow: false,
            rules: vec![(false, net("10.1.2.0/24")), (true, net("10.1.0.0/16"))],
        };
        let np = network_policy("s", "w", "warren-s", "u", &some).expect("a policy");
        assert_eq!(
            np["spec"]["egress"][0]["to"],
            json!([{"ipBlock": {"cidr": "10.1.0.0/16", "except": ["10.1.2.0/24"]}}])
        );
        assert_eq!(np["spec"]["podSelector"]["matchLabels"][LABEL_SANDBOX], "s");
        assert_eq!(np["metadata"]["ownerReferences"][0]["uid"], "u");
    }
}
