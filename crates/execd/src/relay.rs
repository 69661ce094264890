//! `warren-execd relay`: the one way into sandboxes on a network that has no other.
//!
//! Sandboxes on a Docker daemon of another host sit on an internal network (no route out, no
//! traffic between containers), where nothing can be published. One relay per daemon runs in that
//! host's network namespace, which reaches the network's containers: a connection to it names, in
//! its first line (`WARREN-RELAY <address>\n`), the sandbox it is for, and from then on carries
//! execd's own HTTP, credential and all. The relay reaches only execd's port, only at addresses of
//! the sandboxes' network, and takes no connection from that network; it authenticates no one
//! itself, since execd checks every request.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

/// The first argument that makes `warren-execd` a relay.
pub const RELAY_ARG: &str = "relay";
/// What a connection's first line starts with.
pub const PREAMBLE: &str = warren_api::RELAY_PREAMBLE;
/// Longest first line accepted.
const MAX_PREAMBLE: usize = 64;
/// Time a connection gets to name its sandbox, and the relay to reach it.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// Which addresses the relay may reach: one IPv4 or IPv6 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    base: IpAddr,
    prefix: u8,
}

impl Network {
    /// `a.b.c.d/n` or `x::y/n`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (ip, prefix) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: a network is ADDRESS/PREFIX"))?;
        let base: IpAddr = ip.parse().map_err(|e| format!("{s:?}: {e}"))?;
        let prefix: u8 = prefix.parse().map_err(|e| format!("{s:?}: {e}"))?;
        let bits = if base.is_ipv4() { 32 } else { 128 };
        if prefix > bits {
            return Err(format!("{s:?}: the prefix is at most {bits}"));
        }
        Ok(Self { base, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let mask = |bits: u32| -> u128 {
            if self.prefix == 0 {
                0
            } else {
                (u128::MAX << (bits - u32::from(self.prefix))) & (u128::MAX >> (128 - bits))
            }
        };
        match (self.base, ip) {
            (IpAddr::V4(b), IpAddr::V4(i)) => {
                let m = mask(32);
                u128::from(u32::from(b)) & m == u128::from(u32::from(i)) & m
            }
            (IpAddr::V6(b), IpAddr::V6(i)) => {
                let m = mask(128);
                u128::from(b) & m == u128::from(i) & m
            }
            _ => false,
        }
    }
}

/// The relay's command line after [`RELAY_ARG`]: `--listen ADDR --to NETWORK --port N`.
pub fn run(args: &[std::ffi::OsString]) -> i32 {
    let mut listen = None;
    let mut network = None;
    let mut port = None;
    let mut it = args.iter().map(|a| a.to_string_lossy().to_string());
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--listen" => listen = value.parse::<SocketAddr>().ok(),
            "--to" => network = Network::parse(&value).ok(),
            "--port" => port = value.parse::<u16>().ok(),
            _ => {
                eprintln!("warren-execd relay: unknown argument {flag:?}");
                return 2;
            }
        }
    }
    let (Some(listen), Some(network), Some(port)) = (listen, network, port) else {
        eprintln!("warren-execd relay: needs --listen ADDR --to NETWORK --port N");
        return 2;
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren-execd relay: {e}");
            return 1;
        }
    };
    rt.block_on(async move {
        let listener = match TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("warren-execd relay: listening on {listen}: {e}");
                return 1;
            }
        };
        eprintln!("warren-execd relay: on {listen}, to port {port} in {network:?}");
        serve(listener, network, port).await;
        0
    })
}

/// Accepts connections for ever.
pub async fn serve(listener: TcpListener, network: Network, port: u16) {
    loop {
        let Ok((conn, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        // The sandboxes themselves reach it (through their network's gateway) but have no
        // business with it.
        if network.contains(peer.ip()) {
            continue;
        }
        tokio::spawn(async move {
            if let Err(why) = relay(conn, network, port).await {
                eprintln!("warren-execd relay: {why}");
            }
        });
    }
}

async fn relay(mut conn: TcpStream, network: Network, port: u16) -> Result<(), String> {
    let _ = conn.set_nodelay(true);
    let target = tokio::time::timeout(STEP_TIMEOUT, first_line(&mut conn))
        .await
        .map_err(|_| "no first line in time".to_string())??;
    let ip: IpAddr = target
        .strip_prefix(PREAMBLE)
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("not a relay request: {target:?}"))?;
    if !network.contains(ip) {
        return Err(format!("{ip} is not on the sandboxes' network"));
    }
    let mut upstream = tokio::time::timeout(STEP_TIMEOUT, TcpStream::connect((ip, port)))
        .await
        .map_err(|_| format!("{ip}:{port} did not answer in time"))?
        .map_err(|e| format!("{ip}:{port}: {e}"))?;
    let _ = upstream.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
    Ok(())
}

/// The first line, read a byte at a time so that nothing after it is consumed.
async fn first_line(conn: &mut TcpStream) -> Result<String, String> {
    let mut line = Vec::with_capacity(MAX_PREAMBLE);
    loop {
        let b = conn.read_u8().await.map_err(|e| e.to_string())?;
        if b == b'\n' {
            return String::from_utf8(line).map_err(|_| "a first line that is not text".into());
        }
        if line.len() == MAX_PREAMBLE {
            return Err("a first line too long".into());
        }
        line.push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn networks() {
        let n = Network::parse("172.30.0.0/16").expect("net");
        assert!(n.contains("172.30.4.5".parse().expect("ip")));
        assert!(!n.contains("172.31.0.1".parse().expect("ip")));
        assert!(!n.contains("::1".parse().expect("ip")));
        assert!(Network::parse("0.0.0.0/0")
            .expect("all")
            .contains("8.8.8.8".parse().expect("ip")));
        let v6 = Network::parse("fd00:1::/64").expect("v6");
        assert!(v6.contains("fd00:1::9".parse().expect("ip")));
        assert!(!v6.contains("fd00:2::9".parse().expect("ip")));
        assert!(Network::parse("10.0.0.0/33").is_err());
        assert!(Network::parse("10.0.0.0").is_err());
    }

    #[tokio::test]
    async fn relays_only_to_its_network_and_port() {
        // the sandboxes' network is 127.0.0.2/32 here; callers come from 127.0.0.1
        let upstream = TcpListener::bind("127.0.0.2:0").await.expect("bind");
        let port = upstream.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = upstream.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 5];
                    if c.read_exact(&mut buf).await.is_ok() {
                        let _ = c.write_all(&buf).await; // echo
                    }
                });
            }
        });
        let relay = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = relay.local_addr().expect("addr");
        tokio::spawn(serve(
            relay,
            Network::parse("127.0.0.2/32").expect("net"),
            port,
        ));

        let mut c = TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"WARREN-RELAY 127.0.0.2\nhello")
            .await
            .expect("write");
        let mut got = [0u8; 5];
        c.read_exact(&mut got).await.expect("echo");
        assert_eq!(&got, b"hello");

        // a caller on the sandboxes' network itself is turned away
        let s = tokio::net::TcpSocket::new_v4().expect("socket");
        s.bind("127.0.0.2:0".parse().expect("addr")).expect("bind");
        let mut c = s.connect(addr).await.expect("connect");
        let _ = c.write_all(b"WARREN-RELAY 127.0.0.2\nhello").await;
        let mut rest = Vec::new();
        let _ = c.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "{rest:?}");

        for bad in [
            &b"WARREN-RELAY 127.0.0.1\nhello"[..],
            &b"WARREN-RELAY 10.0.0.1\nhello"[..],
            b"GET / HTTP/1.1\r\n\r\n",
            b"WARREN-RELAY 127.0.0.2:22\nhello",
            &[b'x'; 100],
        ] {
            let mut c = TcpStream::connect(addr).await.expect("connect");
            c.write_all(bad).await.expect("write");
            let mut rest = Vec::new();
            let _ = c.read_to_end(&mut rest).await;
            assert!(
                rest.is_empty(),
                "{:?} got {:?}",
                String::from_utf8_lossy(bad),
                rest
            );
        }
    }
}
