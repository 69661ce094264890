//! Command and session output framed as the reference execd frames it: one event per line, the
//! line's terminator removed.
//!
//! Clients compare `logs.stdout[0].text == "hi"`, so this is wire behaviour, not presentation. A
//! line ends at `\n`, `\r` or `\r\n` (a progress bar's `\r` rewrites come out as lines too); an empty
//! line is sent as `"\n"` (an empty text would read as no output at all); a last line without a
//! terminator is sent when its stream ends, never earlier, so a pause mid-line does not split it. A
//! line longer than [`MAX_LINE`] is sent in pieces rather than held whole (the reference holds it,
//! however long). Bytes that are not UTF-8 become U+FFFD, as a lossy decoding of the line.

/// Bytes of one line held at most; a longer line goes out in pieces of about this size.
pub const MAX_LINE: usize = 256 * 1024;

/// The line framer of one stream.
#[derive(Debug, Default)]
pub struct Lines {
    /// The current line so far.
    pending: Vec<u8>,
    /// The last byte seen was a `\r`: a `\n` right after it ends no further line.
    after_cr: bool,
}

impl Lines {
    /// Takes the next bytes of the stream; returns the lines they completed.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while let Some(i) = rest.iter().position(|b| *b == b'\n' || *b == b'\r') {
            let end = rest[i];
            if i > 0 {
                self.take(&rest[..i], &mut out);
                out.push(self.line());
            } else if self.pending.is_empty() {
                // The `\n` of a `\r\n` whose `\r` already ended the line, or an empty line.
                if !(end == b'\n' && self.after_cr) {
                    out.push("\n".to_owned());
                }
            } else {
                out.push(self.line());
            }
            self.after_cr = end == b'\r';
            rest = &rest[i + 1..];
        }
        if !rest.is_empty() {
            self.after_cr = false;
            self.take(rest, &mut out);
        }
        out
    }

    /// The stream ended: its last line, if it had no terminator.
    pub fn finish(&mut self) -> Option<String> {
        self.after_cr = false;
        (!self.pending.is_empty()).then(|| self.line())
    }

    /// Adds bytes to the current line, sending pieces of it while it is longer than [`MAX_LINE`].
    fn take(&mut self, bytes: &[u8], out: &mut Vec<String>) {
        self.pending.extend_from_slice(bytes);
        while self.pending.len() > MAX_LINE {
            let cut = char_boundary(&self.pending, MAX_LINE);
            let rest = self.pending.split_off(cut);
            let piece = std::mem::replace(&mut self.pending, rest);
            out.push(String::from_utf8_lossy(&piece).into_owned());
        }
    }

    fn line(&mut self) -> String {
        let line = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        line
    }
}

/// `at`, or up to 3 bytes before it where that keeps a UTF-8 character whole.
fn char_boundary(bytes: &[u8], at: usize) -> usize {
    let is_continuation = |i: usize| bytes.get(i).is_some_and(|b| b & 0xC0 == 0x80);
    (at.saturating_sub(3)..=at)
        .rev()
        .find(|&i| !is_continuation(i))
        .filter(|&i| i > 0)
        .unwrap_or(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line of `input` fed whole, then byte by byte: the framing must not depend on how
    /// the pipe cut the stream.
    fn framed(input: &[u8]) -> Vec<String> {
        let mut whole = Lines::default();
        let mut a = whole.feed(input);
        a.extend(whole.finish());
        let mut bytewise = Lines::default();
        let mut b: Vec<String> = input.iter().flat_map(|x| bytewise.feed(&[*x])).collect();
        b.extend(bytewise.finish());
        assert_eq!(a, b, "framing of {input:?} depends on the reads");
        a
    }

    #[test]
    fn lines_lose_their_terminators() {
        assert_eq!(framed(b"hi\n"), ["hi"]);
        assert_eq!(framed(b"a\nb\n"), ["a", "b"]);
        assert_eq!(framed(b"a\r\nb\r\n"), ["a", "b"]);
        assert_eq!(framed(b"10%\r50%\r100%\n"), ["10%", "50%", "100%"]);
    }

    #[test]
    fn empty_lines_are_a_newline() {
        assert_eq!(framed(b"a\n\nb\n"), ["a", "\n", "b"]);
        assert_eq!(framed(b"\n"), ["\n"]);
        assert_eq!(framed(b"\r\n\r\n"), ["\n", "\n"]);
        assert_eq!(framed(b"a\r\r\n"), ["a", "\n"]);
        assert_eq!(framed(b"\n\r"), ["\n", "\n"]);
    }

    #[test]
    fn a_last_line_without_terminator_comes_at_the_end() {
        let mut l = Lines::default();
        assert!(l.feed(b"Name: ").is_empty());
        assert_eq!(l.feed(b"ann\nbye"), ["Name: ann"]);
        assert_eq!(l.finish().as_deref(), Some("bye"));
        assert_eq!(l.finish(), None);
        assert_eq!(framed(b""), Vec::<String>::new());
    }

    #[test]
    fn long_lines_come_in_pieces_that_keep_characters_whole() {
        let mut input = vec![b'x'; MAX_LINE - 1];
        input.extend("€".repeat(4).as_bytes());
        input.push(b'\n');
        let out = framed(&input);
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0].len(),
            MAX_LINE - 1,
            "the piece stops before the cut character"
        );
        assert_eq!(out[1], "€".repeat(4));
        assert!(out.iter().all(|l| !l.contains('\u{FFFD}')));
        let huge = framed(&vec![b'y'; 3 * MAX_LINE + 5]);
        assert_eq!(
            huge.iter().map(String::len).collect::<Vec<_>>(),
            [MAX_LINE, MAX_LINE, MAX_LINE, 5]
        );
    }

    #[test]
    fn bytes_that_are_not_utf8_become_replacement_characters() {
        assert_eq!(
            framed(b"\xff\xfeok\n\x00\n"),
            ["\u{FFFD}\u{FFFD}ok", "\u{0}"]
        );
        // A character cut by the pipe between two reads is decoded whole.
        let mut l = Lines::default();
        assert!(l.feed(&"é".as_bytes()[..1]).is_empty());
        assert_eq!(l.feed(&[&"é".as_bytes()[1..], b"\n"].concat()), ["é"]);
    }
}
