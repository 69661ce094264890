//! The combined output of a background command, kept as the bytes the command wrote and addressed
//! by byte offset, as the reference execd does: `GET /command/{id}/logs?cursor=N` returns what came
//! after byte `N` and the offset to pass next. Memory is bounded: the oldest bytes are dropped (their
//! offsets stay reserved, so cursors remain valid; a cursor into the dropped part reads from the
//! oldest byte kept).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

/// Bytes kept per command.
pub const MAX_LOG_BYTES: usize = 16 * 1024 * 1024;

#[derive(Default)]
pub struct LogBuffer {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    bytes: VecDeque<u8>,
    /// Bytes dropped from the front to respect the cap: the offset of `bytes[0]`.
    dropped: usize,
    /// The command ended: nothing more will be appended.
    closed: bool,
}

impl LogBuffer {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn append(&self, bytes: &[u8]) {
        let mut inner = self.lock();
        inner.bytes.extend(bytes);
        let over = inner.bytes.len().saturating_sub(MAX_LOG_BYTES);
        if over > 0 {
            inner.bytes.drain(..over);
            inner.dropped += over;
        }
    }

    /// The process ended: a character cut off at the end is returned as it is (replaced).
    pub fn close(&self) {
        self.lock().closed = true;
    }

    /// The output after byte `cursor` (from the start with 0) and the offset to read from next.
    /// While the command runs, a UTF-8 character whose last bytes have not arrived is held back, so
    /// a reader never sees it split into replacement characters.
    pub fn tail(&self, cursor: usize) -> (String, usize) {
        let inner = self.lock();
        let end = inner.dropped + inner.bytes.len();
        let start = cursor.clamp(inner.dropped, end);
        let (front, back) = inner.bytes.as_slices();
        let mut out: Vec<u8> = Vec::with_capacity(end - start);
        let skip = start - inner.dropped;
        if skip < front.len() {
            out.extend_from_slice(&front[skip..]);
            out.extend_from_slice(back);
        } else {
            out.extend_from_slice(&back[skip - front.len()..]);
        }
        if !inner.closed {
            out.truncate(out.len() - incomplete_tail(&out));
        }
        let next = start + out.len();
        (String::from_utf8_lossy(&out).into_owned(), next)
    }
}

/// How many bytes at the end of `bytes` begin a UTF-8 character that is not complete yet.
fn incomplete_tail(bytes: &[u8]) -> usize {
    for back in 1..=bytes.len().min(3) {
        let b = bytes[bytes.len() - back];
        if b & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back for the lead
        }
        let needed = match b {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => return 0,
        };
        return if needed > back { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_walks_bytes_as_written() {
        let log = LogBuffer::default();
        log.append(b"a\nb");
        assert_eq!(log.tail(0), ("a\nb".to_string(), 3));
        log.append(b"c\r\nd\n");
        assert_eq!(log.tail(3), ("c\r\nd\n".to_string(), 8));
        assert_eq!(log.tail(8), (String::new(), 8));
        log.append(b"tail");
        log.close();
        assert_eq!(log.tail(8), ("tail".to_string(), 12));
        assert_eq!(
            log.tail(99),
            (String::new(), 12),
            "a cursor past the end is clamped"
        );
    }

    #[test]
    fn a_character_cut_by_the_pipe_waits_for_its_last_bytes() {
        let log = LogBuffer::default();
        log.append("x é".as_bytes());
        log.append(&"✓".as_bytes()[..2]);
        assert_eq!(log.tail(0), ("x é".to_string(), 4));
        log.append(&"✓".as_bytes()[2..]);
        assert_eq!(log.tail(4), ("✓".to_string(), 7));
        log.append(&[0xE2, 0x9C]);
        log.close();
        assert_eq!(
            log.tail(7),
            ("\u{FFFD}".to_string(), 9),
            "an ended command's last bytes are all given"
        );
    }

    #[test]
    fn the_oldest_bytes_are_dropped_and_offsets_kept() {
        let log = LogBuffer::default();
        log.append(&vec![b'a'; MAX_LOG_BYTES]);
        log.append(b"bcd");
        let (text, next) = log.tail(0);
        assert_eq!(text.len(), MAX_LOG_BYTES);
        assert!(text.ends_with("abcd"));
        assert_eq!(next, MAX_LOG_BYTES + 3);
        assert_eq!(
            log.tail(MAX_LOG_BYTES + 1),
            ("cd".to_string(), MAX_LOG_BYTES + 3)
        );
    }
}
