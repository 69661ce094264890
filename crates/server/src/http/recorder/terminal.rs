//! What a terminal is typed, on the timeline: the proxy splices a PTY WebSocket (`/pty/{id}/ws`)
//! itself, reads the client's frames as they pass (RFC 6455: masked, possibly fragmented), and
//! records each line of standard input (channel `0x00` of execd's PTY protocol) as `terminal.input`
//! when Enter is pressed. Keystrokes are recorded as typed: an edited line shows its editing keys
//! (escaped in JSON), and a program's password prompt is typed into the record too, unless
//! `[timeline] commands = "hash"`. Output is never read.

use std::sync::Arc;

use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::timeline::{Timeline, MAX_TEXT};

/// Whether an upgraded request to execd's `path` is a terminal whose input is recorded.
pub(crate) fn is_terminal(path: &str) -> bool {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    matches!(segs.as_slice(), ["pty", _, "ws"])
}

/// Splices `client` and `upstream` as `copy_bidirectional` does (each direction to its end, the
/// other side's writer shut when one side ends), recording the client's typed lines on
/// `timeline` (session `of`).
pub(crate) async fn splice<C, U>(client: C, upstream: U, timeline: Arc<Timeline>, of: u64)
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut ur, mut uw) = tokio::io::split(upstream);
    let down = async {
        let _ = tokio::io::copy(&mut ur, &mut cw).await;
        let _ = cw.shutdown().await;
    };
    let up = async {
        let mut frames = Frames::default();
        // Flushed when dropped too: a line typed before the connection went is kept.
        let mut lines = Lines::new(timeline, of);
        let mut buf = vec![0u8; 16 << 10];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // Relayed first: the record never holds the terminal back.
            if uw.write_all(&buf[..n]).await.is_err() || uw.flush().await.is_err() {
                break;
            }
            frames.feed(&buf[..n], &mut |stdin| lines.typed(stdin));
        }
        let _ = uw.shutdown().await;
    };
    tokio::join!(down, up);
}

/// A client's WebSocket frames, read from the byte stream as it comes: the standard input bytes
/// of binary messages on channel 0 are handed on.
#[derive(Default)]
struct Frames {
    /// Header bytes of the frame being read (at most 14).
    head: Vec<u8>,
    /// Payload bytes left in the current frame, its mask, and how many were unmasked.
    left: u64,
    mask: Option<[u8; 4]>,
    at: usize,
    /// The current message: binary on channel 0 (so far), and whether its channel byte was seen.
    stdin: bool,
    channel_seen: bool,
    /// A compressed frame (RSV1): not readable here, skipped.
    skip: bool,
    /// The message's state while a control frame between its fragments is skipped.
    saved: Option<(bool, bool)>,
}

const OP_CONTINUATION: u8 = 0;
const OP_BINARY: u8 = 2;
const CH_STDIN: u8 = 0;

impl Frames {
    fn feed(&mut self, mut data: &[u8], out: &mut impl FnMut(&[u8])) {
        while !data.is_empty() {
            if self.left == 0 && !self.header(&mut data) {
                return;
            }
            let take = data.len().min(self.left as usize);
            let (chunk, rest) = data.split_at(take);
            data = rest;
            self.left -= take as u64;
            if self.skip || !self.stdin {
                self.at += take;
                if self.left == 0 {
                    self.after_control();
                }
                continue;
            }
            let mut bytes: Vec<u8> = chunk.to_vec();
            if let Some(mask) = self.mask {
                for b in bytes.iter_mut() {
                    *b ^= mask[self.at % 4];
                    self.at += 1;
                }
            }
            let mut payload = &bytes[..];
            if !self.channel_seen {
                if let Some((&ch, rest)) = payload.split_first() {
                    self.channel_seen = true;
                    self.stdin = ch == CH_STDIN;
                    payload = rest;
                }
            }
            if self.stdin && !payload.is_empty() {
                out(payload);
            }
        }
    }

    /// Reads a frame header from `data` (across calls); true once it is whole.
    fn header(&mut self, data: &mut &[u8]) -> bool {
        loop {
            let need = match self.head.len() {
                0 | 1 => 2,
                _ => {
                    let len7 = self.head[1] & 0x7f;
                    let ext = match len7 {
                        126 => 2,
                        127 => 8,
                        _ => 0,
                    };
                    let masked = self.head[1] & 0x80 != 0;
                    2 + ext + if masked { 4 } else { 0 }
                }
            };
            if self.head.len() >= need && self.head.len() >= 2 {
                break;
            }
            let Some((&b, rest)) = data.split_first() else {
                return false;
            };
            self.head.push(b);
            *data = rest;
        }
        let head = std::mem::take(&mut self.head);
        let opcode = head[0] & 0x0f;
        let len7 = head[1] & 0x7f;
        let (len, mut i) = match len7 {
            126 => (u64::from(u16::from_be_bytes([head[2], head[3]])), 4),
            127 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&head[2..10]);
                (u64::from_be_bytes(b), 10)
            }
            n => (u64::from(n), 2),
        };
        self.mask = (head[1] & 0x80 != 0).then(|| {
            let m = [head[i], head[i + 1], head[i + 2], head[i + 3]];
            i += 4;
            m
        });
        let _ = i;
        self.left = len;
        self.at = 0;
        match opcode {
            OP_BINARY => {
                self.stdin = true;
                self.channel_seen = false;
                self.skip = head[0] & 0x40 != 0;
            }
            OP_CONTINUATION => {}
            // Text (control frames such as resize) and control opcodes: not input. A control frame
            // may sit between a message's fragments; it ends no message.
            op if op >= 8 => self.skip_frame_keeping_message(),
            _ => {
                self.stdin = false;
            }
        }
        if len == 0 {
            self.after_control();
        }
        true
    }

    /// A control frame's payload is skipped; the message around it goes on after it.
    fn skip_frame_keeping_message(&mut self) {
        self.saved = Some((self.stdin, self.skip));
        self.stdin = false;
    }

    fn after_control(&mut self) {
        if let Some((stdin, skip)) = self.saved.take() {
            self.stdin = stdin;
            self.skip = skip;
        }
    }
}

/// Typed bytes gathered into lines, each recorded when Enter (CR or LF) ends it; a line past
/// [`MAX_TEXT`] bytes is recorded there and goes on in the next event.
struct Lines {
    timeline: Arc<Timeline>,
    of: u64,
    line: Vec<u8>,
}

impl Lines {
    fn new(timeline: Arc<Timeline>, of: u64) -> Self {
        Self {
            timeline,
            of,
            line: Vec::new(),
        }
    }

    fn typed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b == b'\r' || b == b'\n' {
                self.flush();
            } else {
                self.line.push(b);
                if self.line.len() >= MAX_TEXT {
                    self.flush();
                }
            }
        }
    }

    /// Records the line typed so far, if any.
    fn flush(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let text = String::from_utf8_lossy(&std::mem::take(&mut self.line)).into_owned();
        let mut detail = self.timeline.text_fields(&text);
        detail.insert("of".into(), self.of.into());
        self.timeline
            .record("terminal.input", Value::Object(detail));
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::Settings;

    /// A client frame: FIN, `opcode`, masked with `mask`.
    fn frame(fin: bool, opcode: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
        let mut f = vec![(if fin { 0x80 } else { 0 }) | opcode];
        match payload.len() {
            n if n < 126 => f.push(0x80 | n as u8),
            n if n < 65536 => {
                f.push(0x80 | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                f.push(0x80 | 127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        f
    }

    fn typed_lines(stream: &[u8], chunk: usize) -> Vec<String> {
        let t = Arc::new(Timeline::new(Arc::new(Settings::default())));
        let mut frames = Frames::default();
        let mut lines = Lines::new(t.clone(), 7);
        for c in stream.chunks(chunk) {
            frames.feed(c, &mut |stdin| lines.typed(stdin));
        }
        lines.flush();
        t.read(0)
            .lines
            .iter()
            .map(|l| {
                let v: Value = serde_json::from_str(l).expect("a JSON line");
                assert_eq!(v["of"], 7);
                v["text"].as_str().expect("text").to_string()
            })
            .collect()
    }

    #[test]
    fn typed_lines_are_read_across_frames_fragments_and_chunks() {
        let m = [0x12, 0x34, 0x56, 0x78];
        let mut s = Vec::new();
        s.extend(frame(
            true,
            1,
            br#"{"type":"resize","cols":80,"rows":24}"#,
            m,
        ));
        s.extend(frame(true, 2, b"\x00ec", m));
        s.extend(frame(true, 2, b"\x00ho hi\r", m));
        // Output a client echoes on another channel is not input.
        s.extend(frame(true, 2, b"\x01not typed\r", m));
        // A fragmented message with a ping between its fragments.
        s.extend(frame(false, 2, b"\x00ls ", m));
        s.extend(frame(true, 9, b"ping", m));
        s.extend(frame(true, 0, b"/tmp\n", m));
        // A long paste: a 16-bit length.
        let long = [b"\x00".as_slice(), &b"x".repeat(300), b"\r"].concat();
        s.extend(frame(true, 2, &long, m));
        s.extend(frame(true, 2, b"\x00exit", m));
        for chunk in [1, 3, 7, 1000] {
            assert_eq!(
                typed_lines(&s, chunk),
                ["echo hi", "ls /tmp", &"x".repeat(300), "exit"],
                "chunk {chunk}"
            );
        }
    }

    #[test]
    fn compressed_frames_are_skipped_not_misread() {
        let m = [1, 2, 3, 4];
        let mut s = frame(true, 2, b"\x00zzzz\r", m);
        s[0] |= 0x40; // RSV1: permessage-deflate
        s.extend(frame(true, 2, b"\x00ok\r", m));
        assert_eq!(typed_lines(&s, 5), ["ok"]);
    }

    #[test]
    fn terminals_are_told_by_path() {
        assert!(is_terminal("pty/abc/ws"));
        assert!(!is_terminal("pty/abc"));
        assert!(!is_terminal("proxy/8080/pty/abc/ws"));
    }
}
