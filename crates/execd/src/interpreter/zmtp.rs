//! Just enough ZMTP 3.0 (the ZeroMQ wire protocol, rfc.zeromq.org/spec/23) for a Jupyter client: the
//! client ends of DEALER and SUB sockets over one TCP connection each, NULL security.
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

/// Connects to `addr`, exchanges greetings and READY; for SUB also subscribes to every topic.
pub async fn connect(addr: &str, kind: SocketType) -> io::Result<(Sender, Receiver)> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (rd, wr) = stream.into_split();
    let mut tx = Sender { wr };
    let mut rx = Receiver {
        rd: BufReader::new(rd),
    };
    tx.wr.write_all(&greeting()).await?;
    let mut peer = [0u8; 64];
    rx.rd.read_exact(&mut peer).await?;
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
    if kind == SocketType::Sub {
        // ZMTP 3.0 subscriptions are messages whose first byte is 1; an empty topic matches everything.
        tx.send(&[Bytes::from_static(&[1])]).await?;
    }
    Ok((tx, rx))
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

fn check_greeting(g: &[u8; 64]) -> io::Result<()> {
    if g[0] != 0xff || g[9] & 0x01 != 0x01 {
        return Err(protocol("peer is not a ZeroMQ socket"));
    }
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

    /// A hand-made peer: reads our greeting and READY, answers with its own, then sends a 2-part message.
    #[tokio::test]
    async fn talks_to_a_peer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
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
}
