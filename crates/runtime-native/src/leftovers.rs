//! What a deleted sandbox left behind because it could not die yet, cleared later: its cgroup, and
//! its PID 1 to reap.
//!
//! A sandbox's cgroup can only go once its last process has died, and a process cannot die while it
//! sits in uninterruptible sleep (a read from a hung NFS or FUSE mount) or frozen in a cgroup nested
//! inside the sandbox's; nor can its PID 1, which waits for every process of its PID namespace. The
//! delete does not wait for that: it gives up after a few seconds and the sandbox lands here. A
//! background thread retries with growing pauses until everything is gone. Each cgroup is also
//! recorded as an empty file under the data dir, so a server restarted meanwhile carries on where
//! the last one stopped (a PID 1 is only ours to reap in the server that started it). Only
//! sandboxes this data dir's server tore down are ever recorded: the cgroup parent is shared with
//! other servers on the host, whose sandboxes must not be touched.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::cgroup::{Cgroup, Layout};
use crate::children::{pidfd_exited, reap_pidfd_with};

/// First pause between retries; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_secs(1);
const MAX_PAUSE: Duration = Duration::from_secs(60);
/// How long one retry kills and waits for a cgroup's processes.
const ATTEMPT: Duration = Duration::from_millis(200);

pub(crate) struct Leftovers {
    /// One empty file per sandbox id.
    dir: PathBuf,
    layout: Layout,
    parent: String,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Sandbox id → its PID 1 while that is still to be reaped.
    pending: BTreeMap<String, Option<OwnedFd>>,
    /// A retry thread is running; it ends when nothing is pending.
    retrying: bool,
}

impl Leftovers {
    /// Picks up the leftovers a previous server on this data dir recorded, and starts retrying them.
    pub fn open(dir: PathBuf, layout: Layout, parent: String) -> Arc<Self> {
        let ids: BTreeSet<String> = fs::read_dir(&dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    // Sandbox ids only (UUIDs): a name is joined onto cgroup paths.
                    .filter(|name| {
                        !name.is_empty() && name.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
                    })
                    .collect()
            })
            .unwrap_or_default();
        let this = Arc::new(Self {
            dir,
            layout,
            parent,
            state: Mutex::new(State::default()),
        });
        for id in ids {
            this.add(&id, None);
        }
        this
    }

    /// Records sandbox `id` for its cgroup's removal later, and its PID 1 (a pidfd, when the
    /// server is its parent) for reaping.
    pub fn add(self: &Arc<Self>, id: &str, pid1: Option<OwnedFd>) {
        if let Err(e) =
            fs::create_dir_all(&self.dir).and_then(|()| fs::write(self.dir.join(id), b""))
        {
            // Retried by this server all the same; only a restart would forget it.
            tracing::warn!(sandbox_id = id, error = %e, "recording a cgroup left behind");
        }
        let mut state = self.lock();
        state.pending.insert(id.to_string(), pid1);
        if !state.retrying {
            state.retrying = true;
            let this = Arc::clone(self);
            std::thread::spawn(move || this.retry());
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn retry(self: Arc<Self>) {
        let since = Instant::now();
        let mut pause = FIRST_PAUSE;
        loop {
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_PAUSE);
            let ids: Vec<String> = self.lock().pending.keys().cloned().collect();
            let mut cleared = BTreeSet::new();
            for id in ids {
                if Cgroup::at(&self.layout, &self.parent, &id)
                    .remove(ATTEMPT)
                    .is_err()
                {
                    continue;
                }
                let _ = fs::remove_file(self.dir.join(&id));
                let mut state = self.lock();
                let reaped = match state.pending.get(&id) {
                    Some(Some(fd)) if pidfd_exited(fd, 0) => {
                        let _ = reap_pidfd_with(fd, libc::WEXITED | libc::WNOHANG);
                        true
                    }
                    Some(Some(_)) => false,
                    _ => true,
                };
                if reaped {
                    state.pending.remove(&id);
                    cleared.insert(id);
                }
            }
            for id in cleared {
                tracing::info!(
                    sandbox_id = %id,
                    after_seconds = since.elapsed().as_secs(),
                    "what a deleted sandbox left behind is gone"
                );
            }
            let mut state = self.lock();
            if state.pending.is_empty() {
                state.retrying = false;
                return;
            }
        }
    }
}
