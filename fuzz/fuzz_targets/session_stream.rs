//! execd's output framing in a bash session: a command's stdout bytes end at a per-run marker and
//! its exit code. Whatever pieces the pipe delivers (the input's first byte picks their sizes), the
//! text sent and the exit code found must be those of the whole stream read at once, and the text
//! a lossy UTF-8 decoding of exactly the bytes before the marker.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warren_execd::session::MarkerScan;

const MARKER: &[u8] = b"__WARREN_END_t_";

fn run(stream: &[u8], piece: usize) -> (String, Option<i32>) {
    let mut scan = MarkerScan::new(MARKER.to_vec(), true);
    let mut text = String::new();
    for chunk in stream.chunks(piece.max(1)) {
        let scanned = scan.feed(chunk);
        text.push_str(&scanned.text);
        if scanned.end.is_some() {
            return (text, scanned.end);
        }
    }
    text.push_str(&scan.finish());
    (text, None)
}

fuzz_target!(|data: &[u8]| {
    let Some((&piece, stream)) = data.split_first() else {
        return;
    };
    let whole = run(stream, stream.len());
    let pieces = run(stream, usize::from(piece % 17));
    assert_eq!(pieces, whole);
    let before = stream
        .windows(MARKER.len())
        .position(|w| w == MARKER)
        .unwrap_or(stream.len());
    if whole.1.is_some() || before == stream.len() {
        assert_eq!(whole.0, String::from_utf8_lossy(&stream[..before]));
    }
});
