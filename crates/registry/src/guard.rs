//! Where a pull may connect. A create naming `HOST:PORT/repo:tag` makes the server connect to
//! HOST: without a guard, any caller could have it reach loopback, the host's own services, link-local
//! metadata endpoints and private networks, and read from the error whether a port was open.
//!
//! A registry the operator configured (`[registries."host"]`, or a mirror named there) is trusted
//! as configured, wherever it is. Any other registry, and every redirect and token realm it sends
//! the pull to, must be a public address: names resolve through [`PublicOnly`], which drops
//! internal addresses, IP literals are checked here, and its connection errors say only that the
//! registry could not be reached.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::RegistriesConfig;

/// Whether `ip` is one a pull from an unconfigured registry must not reach: loopback, private,
/// CGNAT, link-local, multicast, reserved and unspecified ranges, and the host's own addresses.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => internal_v4(v4) || own_address(ip),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => internal_v4(v4) || own_address(IpAddr::V4(v4)),
            None => internal_v6(v6) || own_address(ip),
        },
    }
}

fn internal_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || a == 0
        || a >= 240
        || (a == 100 && (64..128).contains(&b)) // CGNAT
        || (a == 192 && b == 0 && ip.octets()[2] == 0) // IETF protocol assignments
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
}

fn internal_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local
        || (first & 0xffc0) == 0xfe80 // link-local
}

/// One of this host's own interface addresses (its public one included: a service listening
/// there is the host's, not the internet's).
fn own_address(ip: IpAddr) -> bool {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return false;
    };
    addrs
        .filter_map(|a| a.address)
        .filter_map(|s| {
            if let Some(v4) = s.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .any(|own| own == ip)
}

/// Whether a URL's host may be reached from an unconfigured registry's pull: a name (resolved
/// through [`PublicOnly`]) or a public IP literal.
pub fn url_allowed(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let literal = host.trim_start_matches('[').trim_end_matches(']');
    match literal.parse::<IpAddr>() {
        Ok(ip) => !is_internal(ip),
        Err(_) => true,
    }
}

/// [`url_allowed`] for a URL as text (an endpoint's base, a token realm): one that does not parse
/// is not allowed.
pub fn text_allowed(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| url_allowed(&u))
}

/// Whether another puller (the Docker daemon) may be asked to pull `image`: yes from a registry
/// configured under `[registries]` and from Docker Hub; from any other only if its host is a public
/// address or a name that resolves to public addresses only. The refusal reads the same whatever
/// the cause (an internal address, a name that does not resolve), so it tells nothing about what
/// listens where. The daemon resolves the name again and follows redirects by its own rules, which
/// this check cannot see: a registry reachable only through such tricks needs the daemon's own
/// network policy.
pub async fn delegated_pull_allowed(config: &RegistriesConfig, image: &str) -> Result<(), String> {
    let Ok(reference) = warren_image::Reference::parse(image) else {
        // A name this check cannot read is not handed on on the chance that the daemon can.
        return Err(format!(
            "{image:?} is not an image reference this server can check before a pull"
        ));
    };
    let (registry, _) = reference.registry();
    if registry == warren_image::DOCKER_HUB || config.host(registry).is_some() {
        return Ok(());
    }
    let refused = || {
        format!(
            "the registry {registry} is not public, or cannot be resolved to a public address; only a registry configured under [registries.\"{registry}\"] can be private"
        )
    };
    let (host, port) = split_host_port(registry).ok_or_else(refused)?;
    let found: Vec<SocketAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::net::lookup_host((host, port))
            .await
            .map_err(|_| refused())?
            .collect(),
    };
    if found.is_empty() || found.iter().any(|a| is_internal(a.ip())) {
        return Err(refused());
    }
    Ok(())
}

/// `host[:port]` or `[v6]:port` of a reference's registry part (443 when none is given).
fn split_host_port(registry: &str) -> Option<(&str, u16)> {
    if let Some(rest) = registry.strip_prefix('[') {
        let (host, tail) = rest.split_once(']')?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None if tail.is_empty() => 443,
            None => return None,
        };
        return Some((host, port));
    }
    match registry.rsplit_once(':') {
        Some((host, port)) => Some((host, port.parse().ok()?)),
        None => Some((registry, 443)),
    }
}

/// A resolver that answers only public addresses.
pub struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found = tokio::net::lookup_host((host.as_str(), 0)).await?;
            let public: Vec<SocketAddr> = found.filter(|a| !is_internal(a.ip())).collect();
            if public.is_empty() {
                return Err(format!("{host} has no public address").into());
            }
            Ok(Box::new(public.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_ranges_are_refused_and_public_ones_are_not() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
        ] {
            assert!(is_internal(ip.parse().expect("ip")), "{ip}");
        }
        for ip in ["1.1.1.1", "8.8.8.8", "100.128.0.1", "2606:4700::1111"] {
            assert!(!is_internal(ip.parse().expect("ip")), "{ip}");
        }
        let url = |s: &str| reqwest::Url::parse(s).expect("url");
        assert!(!url_allowed(&url("http://127.0.0.1:5000/v2/")));
        assert!(!url_allowed(&url("https://[::1]/v2/")));
        assert!(!url_allowed(&url(
            "http://169.254.169.254/latest/meta-data"
        )));
        assert!(url_allowed(&url("https://registry.example.com/v2/")));
        assert!(url_allowed(&url("https://1.1.1.1/v2/")));
    }

    #[tokio::test]
    async fn a_pull_left_to_another_puller_is_checked_the_same_way() {
        let none = RegistriesConfig::default();
        for image in [
            "127.0.0.1:5000/x:1",
            "127.0.0.1:1/x:1",
            "localhost:5000/x:1",
            "[::1]:5000/x:1",
            "169.254.169.254/latest:1",
            "10.0.0.1:443/x:1",
        ] {
            let e = delegated_pull_allowed(&none, image).await.expect_err(image);
            assert!(
                e.contains("is not public") || e.contains("can check"),
                "{e}"
            );
        }
        // one answer for an open and a closed port
        let answer = |image: &'static str, registry: &'static str| {
            let none = none.clone();
            async move {
                delegated_pull_allowed(&none, image)
                    .await
                    .err()
                    .map(|e| e.replace(registry, "R"))
            }
        };
        assert_eq!(
            answer("127.0.0.1:5000/x:1", "127.0.0.1:5000").await,
            answer("127.0.0.1:1/x:1", "127.0.0.1:1").await
        );
        for image in [
            "busybox:1",
            "library/debian:12",
            "docker.io/x/y:1",
            "1.1.1.1/x:1",
        ] {
            delegated_pull_allowed(&none, image).await.expect(image);
        }
        let configured: RegistriesConfig =
            serde_json::from_value(serde_json::json!({"127.0.0.1:5000": {}})).expect("config");
        delegated_pull_allowed(&configured, "127.0.0.1:5000/x:1")
            .await
            .expect("configured, so trusted");
    }
}
