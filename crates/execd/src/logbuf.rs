//! The combined output of a background command, addressed by line so `GET /command/{id}/logs?cursor=N`
//! can return only what the client has not seen. Memory is bounded: the oldest lines are dropped (their
//! numbers stay reserved, so cursors remain valid).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

/// Bytes of complete lines kept per command.
pub const MAX_LOG_BYTES: usize = 16 * 1024 * 1024;

#[derive(Default)]
pub struct LogBuffer {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    lines: VecDeque<String>,
    /// Lines dropped from the front to respect the cap.
    dropped: usize,
    bytes: usize,
    /// The unterminated last line.
    partial: Vec<u8>,
}

impl LogBuffer {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn append(&self, bytes: &[u8]) {
        let mut inner = self.lock();
        inner.partial.extend_from_slice(bytes);
        while let Some(pos) = inner.partial.iter().position(|b| *b == b'\n') {
            let rest = inner.partial.split_off(pos + 1);
            let mut line = std::mem::replace(&mut inner.partial, rest);
            line.pop();
            inner.push_line(String::from_utf8_lossy(&line).into_owned());
        }
    }

    /// The process ended: an unterminated last line becomes a line of its own.
    pub fn close(&self) {
        let mut inner = self.lock();
        if !inner.partial.is_empty() {
            let line = String::from_utf8_lossy(&std::mem::take(&mut inner.partial)).into_owned();
            inner.push_line(line);
        }
    }

    /// Lines after line `cursor` (1-based: cursor 0 means from the start), each ending in `\n`, and the new
    /// cursor (the number of the last line returned). A running command's unterminated line is held back.
    pub fn tail(&self, cursor: usize) -> (String, usize) {
        let inner = self.lock();
        let total = inner.dropped + inner.lines.len();
        let start = cursor.max(inner.dropped).min(total);
        let mut out = String::new();
        for line in inner.lines.iter().skip(start - inner.dropped) {
            out.push_str(line);
            out.push('\n');
        }
        (out, total.max(cursor.min(total)))
    }
}

impl Inner {
    fn push_line(&mut self, line: String) {
        self.bytes += line.len() + 1;
        self.lines.push_back(line);
        while self.bytes > MAX_LOG_BYTES {
            match self.lines.pop_front() {
                Some(l) => {
                    self.bytes -= l.len() + 1;
                    self.dropped += 1;
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_walks_lines() {
        let log = LogBuffer::default();
        log.append(b"a\nb");
        assert_eq!(log.tail(0), ("a\n".to_string(), 1));
        log.append(b"c\nd\n");
        assert_eq!(log.tail(1), ("bc\nd\n".to_string(), 3));
        assert_eq!(log.tail(3), (String::new(), 3));
        log.append(b"tail");
        log.close();
        assert_eq!(log.tail(3), ("tail\n".to_string(), 4));
        assert_eq!(log.tail(99), (String::new(), 4));
    }
}
