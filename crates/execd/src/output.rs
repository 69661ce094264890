//! As the sandbox's init, execd keeps its own output and the entrypoint's in a bounded ring in its
//! memory (`GET /logs`), never in a host file.
//!
//! Before, both went to a per-sandbox log file on the host that the runtime handed over as stdout and
//! stderr: whatever the entrypoint printed grew that file without bound and outside the sandbox's
//! `ephemeral-storage`, and any process that could reopen the entrypoint's `/proc/<pid>/fd/1` wrote
//! to the host's disk. Now the entrypoint writes to a pipe that a thread of execd drains into the
//! ring (the oldest bytes go first past [`MAX_BYTES`], in memory charged to the sandbox's cgroup),
//! and once execd is ready its own stdout and stderr move onto that pipe too. Until then they stay on
//! the runtime's log, which so holds only what execd says while starting (why a start failed).

use std::collections::VecDeque;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};

/// Bytes of output kept.
pub const MAX_BYTES: usize = 1 << 20;

#[derive(Default)]
struct Ring {
    bytes: VecDeque<u8>,
    /// Bytes dropped from the front to stay under the cap.
    dropped: u64,
}

impl Ring {
    fn push(&mut self, data: &[u8]) {
        let skip = data.len().saturating_sub(MAX_BYTES);
        self.dropped += skip as u64;
        let data = &data[skip..];
        let over = (self.bytes.len() + data.len()).saturating_sub(MAX_BYTES);
        self.bytes.drain(..over);
        self.dropped += over as u64;
        self.bytes.extend(data);
    }
}

/// The pipe everything is written to, and the ring it is drained into.
pub struct Output {
    ring: Arc<Mutex<Ring>>,
    write: OwnedFd,
}

static OUTPUT: OnceLock<Output> = OnceLock::new();

/// Starts capturing (once per process): the pipe and the thread that drains it. `None` if it could
/// not be set up, in which case output stays where it was.
pub fn start() -> Option<&'static Output> {
    if let Some(o) = OUTPUT.get() {
        return Some(o);
    }
    let (read, write) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "no pipe for the sandbox's output; it stays on the runtime's log");
            return None;
        }
    };
    let ring = Arc::new(Mutex::new(Ring::default()));
    let drain = {
        let ring = ring.clone();
        move || {
            let mut read = std::fs::File::from(read);
            // On the thread's stack: a heap allocation here would give this thread an allocator
            // arena of its own, ~100 KiB more per idle sandbox, for a sandbox that prints nothing.
            let mut buf = [0u8; 4096];
            // Ends when every write end is closed: never while execd holds its own.
            while let Ok(n @ 1..) = read.read(&mut buf) {
                ring.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(&buf[..n]);
            }
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("output".into())
        // It only copies from a pipe into the ring: a small stack is plenty.
        .stack_size(64 * 1024)
        .spawn(drain)
    {
        tracing::warn!(error = %e, "no thread for the sandbox's output; it stays on the runtime's log");
        return None;
    }
    Some(OUTPUT.get_or_init(|| Output { ring, write }))
}

impl Output {
    /// The pipe's write end, for a child's stdout and stderr.
    pub fn fd(&self) -> RawFd {
        self.write.as_raw_fd()
    }

    /// Another descriptor for the pipe's write end, for a child started with `Command`.
    pub fn file(&self) -> std::io::Result<std::fs::File> {
        Ok(self.write.try_clone()?.into())
    }

    /// Moves execd's own stdout and stderr onto the pipe.
    pub fn take_over_stdio(&self) {
        for target in [1, 2] {
            // SAFETY: dup2 onto stdout/stderr of a descriptor we own; it touches no memory.
            if unsafe { libc::dup2(self.write.as_raw_fd(), target) } < 0 {
                tracing::warn!(fd = target, error = %std::io::Error::last_os_error(), "could not move output onto the ring");
            }
        }
    }

    /// What is kept, oldest first, and how many bytes were dropped before it.
    pub fn contents(&self) -> (Vec<u8>, u64) {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        (ring.bytes.iter().copied().collect(), ring.dropped)
    }
}

/// `GET /logs`: the sandbox's captured output (execd's log and the entrypoint's stdout and stderr),
/// as text; `X-Warren-Dropped-Bytes` says how much older output the cap let go.
pub async fn logs() -> axum::response::Response {
    use axum::response::IntoResponse;
    let (bytes, dropped) = OUTPUT.get().map(Output::contents).unwrap_or_default();
    (
        [
            (
                axum::http::header::CONTENT_TYPE,
                "text/plain; charset=utf-8".to_string(),
            ),
            (
                axum::http::HeaderName::from_static("x-warren-dropped-bytes"),
                dropped.to_string(),
            ),
        ],
        bytes,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_bytes_up_to_the_cap() {
        let mut ring = Ring::default();
        ring.push(b"hello ");
        ring.push(b"world");
        assert_eq!(
            ring.bytes.iter().copied().collect::<Vec<_>>(),
            b"hello world"
        );
        let big = vec![b'x'; MAX_BYTES];
        ring.push(&big);
        assert_eq!(ring.bytes.len(), MAX_BYTES);
        assert_eq!(ring.dropped, 11);
        ring.push(b"tail");
        assert_eq!(ring.bytes.len(), MAX_BYTES);
        assert!(ring.bytes.iter().rev().take(4).eq(b"liat".iter()));
        // One write larger than the cap keeps its end.
        let mut ring = Ring::default();
        let mut huge = vec![b'a'; 2 * MAX_BYTES];
        huge.extend_from_slice(b"end");
        ring.push(&huge);
        assert_eq!(ring.bytes.len(), MAX_BYTES);
        assert!(ring.bytes.iter().rev().take(3).eq(b"dne".iter()));
    }
}
