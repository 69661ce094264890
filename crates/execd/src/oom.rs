//! Making the out-of-memory killer pick a sandbox's workload before execd.
//!
//! execd holds the sandbox together (PID 1 on the native runtime: when it dies, every process of the
//! sandbox goes with it), and to the OOM killer it looks big: on the embedded runtime its code sits
//! in huge pages copied from the zygote, ~23 MB counted as its own. A sandbox at its memory limit
//! with a dozen 15 MB workers lost execd, and so everything, instead of one worker.
//!
//! So what execd starts gets an `oom_score_adj` [`CHILD_BOOST`] above execd's own: at a memory limit
//! that adds half the limit to a worker's badness, so execd is chosen only if it alone outweighs
//! a worker by that much; in a host-wide shortage a sandbox's workload goes before the host's
//! processes and before any execd. Raising a score needs no privilege (lowering one needs
//! CAP_SYS_RESOURCE, which root in a container often lacks), so this works under every runtime. A
//! child's score is execd's at the moment it is spawned: execd raises its own for the spawn and
//! goes back after, which the kernel allows down to where it started (`oom_score_adj_min`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

/// How much higher the processes execd starts score than execd.
pub const CHILD_BOOST: i32 = 500;

/// `/proc/self/oom_score_adj`, open, with execd's own value and its children's.
static OWN: OnceLock<Option<(File, String, String)>> = OnceLock::new();

/// The descriptor [`remember`] keeps open, if it did: a PID 1 that opens it before it joins a user
/// namespace (where its own `/proc` files, not dumpable, are no longer its to open) keeps it
/// across the closing of inherited descriptors.
pub fn descriptor() -> Option<std::os::fd::RawFd> {
    use std::os::fd::AsRawFd;
    OWN.get()?.as_ref().map(|(f, _, _)| f.as_raw_fd())
}

/// Reads execd's own score; call once at start. Without it (or without `/proc`), children get
/// execd's score as before.
pub fn remember() {
    OWN.get_or_init(|| {
        let file = File::options()
            .read(true)
            .write(true)
            .open("/proc/self/oom_score_adj")
            .ok()?;
        let mut buf = [0u8; 16];
        let n = file.read_at(&mut buf, 0).ok()?;
        let own: i32 = std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()?;
        let child = (own + CHILD_BOOST).min(1000);
        Some((file, own.to_string(), child.to_string()))
    });
}

/// Runs `spawn` (which starts a child) with execd's score raised to the children's. Spawns must not
/// run concurrently: the reaper's table lock serialises them.
pub fn for_child<T>(spawn: impl FnOnce() -> T) -> T {
    let Some(Some((file, own, child))) = OWN.get() else {
        return spawn();
    };
    let _ = file.write_at(child.as_bytes(), 0);
    let out = spawn();
    let _ = file.write_at(own.as_bytes(), 0);
    out
}
