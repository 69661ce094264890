//! Just enough ZMTP 3.0 (the ZeroMQ wire protocol, rfc.zeromq.org/spec/23) for a Jupyter client: the
//! client ends of DEALER and SUB sockets over one TCP connection each, NULL security; and ZMTP/2.0
//! (rfc 15) for kernels whose ZeroMQ predates 3.0.
//!
//! Why not a ZeroMQ crate: a Jupyter client needs one connection per channel, no reconnection logic
//! (the kernel is our child; if it goes, the context is dead) and no routing, so the protocol is a
//! 64-byte greeting, a READY command and length-prefixed frames. That is less code than adapting a
//! general library, adds no dependency to the static execd, and is tested against real pyzmq kernels.

use std::io;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// Frames larger than this are refused: a kernel's PNG is a few hundred KiB, a runaway one is a bug.
const MAX_FRAME: u64 = 256 * 1024 * 1024;

/// The socket type announced in READY; the peer checks it against its own (ROUTER/XPUB for a kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    Dealer,
    Sub,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            Self::Dealer => b"DEALER",
            Self::Sub => b"SUB",
        }
    }
}

/// A multipart message: its frames in order.
pub type Multipart = Vec<Bytes>;

/// The receiving half of a connection.
pub struct Receiver {
    rd: BufReader<OwnedReadHalf>,
}

/// The sending half of a connection.
pub struct Sender {
    wr: OwnedWriteHalf,
}

/// Connects to `addr`, exchanges greetings (and READY on ZMTP 3); for SUB also subscribes to every
/// topic.
///
/// The greeting goes in two steps, as libzmq sends it: the signature and major version first, the
/// rest once the peer's major version is known. A ZMTP/2.0 peer (rfc 15: jeromq 0.3, in the JVM
/// kernels) answers with revision 1 and gets a ZMTP/2.0 handshake instead: no mechanism, no
/// commands, the same frames.
pub async fn connect(addr: &str, kind: SocketType) -> io::Result<(Sender, Receiver)> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (rd, wr) = stream.into_split();
    let mut tx = Sender { wr };
    let mut rx = Receiver {
        rd: BufReader::new(rd),
    };
    let ours = greeting();
    tx.wr.write_all(&ours[..11]).await?;
    let mut peer = [0u8; 64];
    // A peer that waits for our whole greeting before it sends its own is served after a pause.
    match tokio::time::timeout(PEER_MAJOR_WAIT, rx.rd.read_exact(&mut peer[..11])).await {
        Ok(read) => {
            read?;
            check_signature(&peer)?;
            if peer[10] == ZMTP2_REVISION {
                return zmtp2_handshake(tx, rx, kind).await;
            }
            tx.wr.write_all(&ours[11..]).await?;
        }
        Err(_) => {
            tx.wr.write_all(&ours[11..]).await?;
            rx.rd.read_exact(&mut peer[..11]).await?;
            check_signature(&peer)?;
        }
    }
    rx.rd.read_exact(&mut peer[11..]).await?;
    check_greeting(&peer)?;
    tx.write_frame(&ready(kind), FLAG_COMMAND).await?;
    // The peer's READY (or ERROR) is the first command it sends.
    loop {
        let (flags, body) = rx.read_frame().await?;
        if flags & FLAG_COMMAND == 0 {
            return Err(protocol("a message arrived before the handshake finished"));
        }
        match command_name(&body) {
            Some(b"READY") => break,
            Some(b"ERROR") => {
                return Err(protocol(&format!(
                    "peer refused the connection: {}",
                    String::from_utf8_lossy(body.get(7..).unwrap_or_default())
                )))
            }
            _ => continue,
        }
    }
    subscribe_all(&mut tx, kind).await?;
    Ok((tx, rx))
}

/// How long the peer's signature and major version may take before our whole greeting goes out.
const PEER_MAJOR_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// The revision byte of a ZMTP/2.0 greeting.
const ZMTP2_REVISION: u8 = 1;

/// ZMTP/2.0 after the signatures: revision (sent), our socket type and an empty identity; the
/// peer's the same way.
async fn zmtp2_handshake(
    mut tx: Sender,
    mut rx: Receiver,
    kind: SocketType,
) -> io::Result<(Sender, Receiver)> {
    let socket_type = match kind {
        SocketType::Dealer => 5,
        SocketType::Sub => 2,
    };
    tx.wr.write_all(&[socket_type, 0, 0]).await?;
    let _peer_type = rx.rd.read_u8().await?;
    let (flags, _identity) = rx.read_frame().await?;
    if flags & FLAG_MORE != 0 {
        return Err(protocol("a ZMTP/2.0 identity of more than one frame"));
    }
    subscribe_all(&mut tx, kind).await?;
    Ok((tx, rx))
}

/// SUB sockets subscribe to every topic: a message whose first byte is 1 (an empty topic matches
/// everything), in ZMTP 2.0 and 3.0 alike.
async fn subscribe_all(tx: &mut Sender, kind: SocketType) -> io::Result<()> {
    if kind == SocketType::Sub {
        tx.send(&[Bytes::from_static(&[1])]).await?;
    }
    Ok(())
}

impl Sender {
    pub async fn send(&mut self, parts: &[Bytes]) -> io::Result<()> {
        let mut buf = Vec::with_capacity(parts.iter().map(|p| p.len() + 9).sum());
        for (i, part) in parts.iter().enumerate() {
            let more = if i + 1 < parts.len() { FLAG_MORE } else { 0 };
            encode_frame(&mut buf, part, more);
        }
        self.wr.write_all(&buf).await
    }

    async fn write_frame(&mut self, body: &[u8], flags: u8) -> io::Result<()> {
        let mut buf = Vec::with_capacity(body.len() + 9);
        encode_frame(&mut buf, body, flags);
        self.wr.write_all(&buf).await
    }
}

impl Receiver {
    /// The next message; ZMTP commands in between (PING) are skipped. EOF is `UnexpectedEof`.
    pub async fn recv(&mut self) -> io::Result<Multipart> {
        let mut parts = Vec::new();
        loop {
            let (flags, body) = self.read_frame().await?;
            if flags & FLAG_COMMAND != 0 {
                continue;
            }
            parts.push(body);
            if flags & FLAG_MORE == 0 {
                return Ok(parts);
            }
        }
    }

    async fn read_frame(&mut self) -> io::Result<(u8, Bytes)> {
        let flags = self.rd.read_u8().await?;
        let len = if flags & FLAG_LONG != 0 {
            self.rd.read_u64().await?
        } else {
            u64::from(self.rd.read_u8().await?)
        };
        if len > MAX_FRAME {
            return Err(protocol(&format!("frame of {len} bytes is too large")));
        }
        let mut body = vec![0u8; len as usize];
        self.rd.read_exact(&mut body).await?;
        Ok((flags, Bytes::from(body)))
    }
}

fn encode_frame(buf: &mut Vec<u8>, body: &[u8], flags: u8) {
    if body.len() > 255 {
        buf.push(flags | FLAG_LONG);
        buf.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        buf.push(flags);
        buf.push(body.len() as u8);
    }
    buf.extend_from_slice(body);
}

/// Signature, version 3.0, mechanism NULL, as-server 0.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn check_signature(g: &[u8]) -> io::Result<()> {
    if g[0] != 0xff || g[9] & 0x01 != 0x01 {
        return Err(protocol("peer is not a ZeroMQ socket"));
    }
    Ok(())
}

fn check_greeting(g: &[u8; 64]) -> io::Result<()> {
    check_signature(g)?;
    if g[10] < 3 {
        return Err(protocol(&format!(
            "peer speaks ZMTP {}.x; 3.0 or later is needed",
            g[10]
        )));
    }
    if &g[12..16] != b"NULL" {
        return Err(protocol("peer wants a security mechanism other than NULL"));
    }
    Ok(())
}

fn ready(kind: SocketType) -> Vec<u8> {
    let mut body = Vec::new();
    body.push(5);
    body.extend_from_slice(b"READY");
    let name = b"Socket-Type";
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(&(kind.name().len() as u32).to_be_bytes());
    body.extend_from_slice(kind.name());
    body
}

fn command_name(body: &[u8]) -> Option<&[u8]> {
    let len = usize::from(*body.first()?);
    body.get(1..1 + len)
}

fn protocol(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("ZMTP: {msg}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_short_and_long() {
        let mut buf = Vec::new();
        encode_frame(&mut buf, b"abc", FLAG_MORE);
        assert_eq!(buf, [FLAG_MORE, 3, b'a', b'b', b'c']);
        let big = vec![7u8; 300];
        let mut buf = Vec::new();
        encode_frame(&mut buf, &big, 0);
        assert_eq!(buf[0], FLAG_LONG);
        assert_eq!(
            u64::from_be_bytes(buf[1..9].try_into().expect("8 bytes")),
            300
        );
        assert_eq!(buf.len(), 9 + 300);
    }

    #[test]
    fn ready_command_layout() {
        let r = ready(SocketType::Dealer);
        assert_eq!(command_name(&r), Some(&b"READY"[..]));
        assert_eq!(&r[6..7], &[11]);
        assert_eq!(&r[7..18], b"Socket-Type");
        assert_eq!(&r[18..22], &6u32.to_be_bytes());
        assert_eq!(&r[22..], b"DEALER");
    }

    #[test]
    fn greeting_round_trips_its_own_check() {
        check_greeting(&greeting()).expect("valid");
        let mut g = greeting();
        g[10] = 2;
        assert!(check_greeting(&g).is_err());
    }

    /// Where a hand-made peer listens, and its address.
    async fn peer_listener() -> (tokio::net::TcpListener, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        (listener, addr)
    }

    /// A hand-made peer: reads our greeting and READY, answers with its own, then sends a 2-part message.
    #[tokio::test]
    async fn talks_to_a_peer() {
        let (listener, addr) = peer_listener().await;
        let peer = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut g = [0u8; 64];
            s.read_exact(&mut g).await.expect("greeting");
            s.write_all(&greeting()).await.expect("greet");
            let mut hdr = [0u8; 2];
            s.read_exact(&mut hdr).await.expect("ready hdr");
            let mut body = vec![0u8; usize::from(hdr[1])];
            s.read_exact(&mut body).await.expect("ready body");
            assert_eq!(hdr[0], FLAG_COMMAND);
            let mut buf = Vec::new();
            encode_frame(&mut buf, &ready(SocketType::Dealer), FLAG_COMMAND);
            encode_frame(&mut buf, b"PING\0", FLAG_COMMAND);
            encode_frame(&mut buf, b"one", FLAG_MORE);
            encode_frame(&mut buf, &[9u8; 1000], 0);
            s.write_all(&buf).await.expect("send");
            // what the client sends next
            let mut hdr = [0u8; 2];
            s.read_exact(&mut hdr).await.expect("frame");
            let mut body = vec![0u8; usize::from(hdr[1])];
            s.read_exact(&mut body).await.expect("body");
            body
        });
        let (mut tx, mut rx) = connect(&addr, SocketType::Dealer).await.expect("connect");
        let msg = rx.recv().await.expect("recv");
        assert_eq!(msg.len(), 2);
        assert_eq!(&msg[0][..], b"one");
        assert_eq!(msg[1].len(), 1000);
        tx.send(&[Bytes::from_static(b"hello")])
            .await
            .expect("send");
        assert_eq!(peer.await.expect("peer"), b"hello");
    }

    /// A ZMTP/2.0 peer as jeromq 0.3.5 (BeakerX's Java kernel) answers: its signature (padding
    /// byte 8 set) and revision 1 right after ours, then socket type and identity; frames as in 3.0.
    #[tokio::test]
    async fn talks_to_a_zmtp2_peer() {
        let (listener, addr) = peer_listener().await;
        let peer = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut sig = [0u8; 10];
            s.read_exact(&mut sig).await.expect("signature");
            assert_eq!((sig[0], sig[9]), (0xff, 0x7f));
            s.write_all(&[0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 1, 6])
                .await
                .expect("greet");
            // their major version, then the ZMTP/2.0 socket type (SUB) and an empty identity
            let mut rest = [0u8; 4];
            s.read_exact(&mut rest).await.expect("rest");
            assert_eq!(rest, [3, 2, 0, 0]);
            s.write_all(&[0, 0]).await.expect("identity");
            // the subscription to everything
            let mut sub = [0u8; 3];
            s.read_exact(&mut sub).await.expect("subscription");
            assert_eq!(sub, [0, 1, 1]);
            let mut buf = Vec::new();
            encode_frame(&mut buf, b"topic", FLAG_MORE);
            encode_frame(&mut buf, &[7u8; 400], 0);
            s.write_all(&buf).await.expect("send");
        });
        let started = std::time::Instant::now();
        let (_tx, mut rx) = connect(&addr, SocketType::Sub).await.expect("connect");
        assert!(
            started.elapsed() < PEER_MAJOR_WAIT,
            "an eager peer is not waited for"
        );
        let msg = rx.recv().await.expect("recv");
        assert_eq!(&msg[0][..], b"topic");
        assert_eq!(msg[1].len(), 400);
        peer.await.expect("peer");
    }
}
