//! The setup helper's reply protocol: the lines it writes on its pipe as the sandbox comes up,
//! read with a deadline.

use std::fs;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::time::Instant;

use crate::JOINED_LINE;

/// Reads the setup helper's stdout up to its reply line (a complete line other than
/// `JOINED_LINE`), or to EOF; returns that line, empty if none came. Reads no further: the pipe
/// stays open while execd starts.
pub(crate) fn read_reply(pipe: &mut fs::File, deadline: Instant) -> std::io::Result<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        if !wait_readable(pipe, deadline)? {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer before the start timeout",
            ));
        }
        let n = match pipe.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf);
        // Until EOF, only whole lines count (the reply may arrive in pieces).
        let complete = match (n, text.rsplit_once('\n')) {
            (0, _) => &*text,
            (_, Some((done, _))) => done,
            (_, None) => "",
        };
        let reply = complete
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty() && *l != JOINED_LINE);
        if reply.is_some() || n == 0 {
            return Ok(reply.unwrap_or_default().to_owned());
        }
    }
}

/// Waits until `pipe` can be read (data or EOF); `false` once `deadline` passed first.
pub(crate) fn wait_readable(pipe: &fs::File, deadline: Instant) -> std::io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Rounded up: a deadline less than a millisecond away must not become a busy zero wait.
        let ms = i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        let mut p = libc::pollfd {
            fd: pipe.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        match n {
            n if n > 0 => return Ok(true),
            0 => return Ok(false),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Waits until every writer of `pipe` has closed it, or `deadline`.
pub(crate) fn wait_closed(mut pipe: fs::File, deadline: Instant) {
    let mut scratch = [0u8; 64];
    loop {
        if !matches!(wait_readable(&pipe, deadline), Ok(true)) {
            return; // timed out (or poll failed): the caller's own checks decide
        }
        match pipe.read(&mut scratch) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// One line from a pipe, read byte by byte so nothing after it is consumed.
pub(crate) fn read_line(pipe: Option<&mut fs::File>) -> Option<String> {
    let pipe = pipe?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while pipe.read(&mut byte).ok()? == 1 {
        if byte[0] == b'\n' {
            return String::from_utf8(line).ok();
        }
        line.push(byte[0]);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::OwnedFd;
    use std::time::Duration;

    fn pipe() -> (fs::File, fs::File) {
        let (r, w) = std::io::pipe().expect("pipe");
        (
            fs::File::from(OwnedFd::from(r)),
            fs::File::from(OwnedFd::from(w)),
        )
    }

    #[test]
    fn a_reply_is_read_whole_even_in_pieces() {
        let (mut r, mut w) = pipe();
        let writer = std::thread::spawn(move || {
            w.write_all(b"{\"started\":").expect("write");
            std::thread::sleep(Duration::from_millis(20));
            w.write_all(b"1}\n").expect("write");
            w
        });
        let line = read_reply(&mut r, Instant::now() + Duration::from_secs(5)).expect("reply");
        assert_eq!(line, "{\"started\":1}");
        drop(writer.join());
    }

    #[test]
    fn a_setup_that_never_answers_times_out_at_the_deadline() {
        let (mut r, _w) = pipe(); // the writer stays open and silent
        let started = Instant::now();
        let err = read_reply(&mut r, started + Duration::from_millis(100)).expect_err("a timeout");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(100),
            "returned early: {took:?}"
        );
        assert!(
            took < Duration::from_secs(5),
            "did not honour the deadline: {took:?}"
        );
    }

    #[test]
    fn a_partial_line_then_silence_also_times_out() {
        let (mut r, mut w) = pipe();
        w.write_all(b"{\"started\"").expect("write");
        let err =
            read_reply(&mut r, Instant::now() + Duration::from_millis(50)).expect_err("a timeout");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    }
}
