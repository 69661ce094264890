//! User namespaces for sandboxes: root in a sandbox is an unprivileged range of host ids of its own.
//!
//! Each sandbox gets a slot: host ids `base .. base + 65,536` are its ids `0 .. 65,536`, and no two
//! live sandboxes share a slot. Image layers stay as they are on disk (owned by root, shared by every
//! sandbox): the sandbox sees them through idmapped mounts (Linux ≥ 5.19 for overlayfs layers), so
//! a file owned by root on disk is owned by root inside, while what the sandbox writes lands in its
//! upper dir owned by its range — a setuid-root file it makes is a setuid file of an unprivileged
//! host id, and a host file owned by an id outside the range (the `host` image's binds) is owned by
//! nobody inside: root there has no override on it.
//!
//! The namespaces themselves are made by a short-lived child: it unshares a user namespace and
//! waits; its parent writes the mapping and keeps a descriptor of the namespace, which outlives the
//! child. The server keeps one per slot, made on the slot's first use: it idmaps the layers of the
//! root overlay it makes, and goes to the setup helper with the spec; the sandbox's PID 1 joins it
//! last, just before it drops capabilities. (A helper whose spec came through a pipe, which carries
//! no descriptors, makes one of its own.)

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// Ids in a sandbox's range.
pub const SIZE: u32 = 65_536;

/// A sandbox's ids: host ids `base ..` are its `0 ..`, [`SIZE`] of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRange {
    pub base: u32,
}

impl IdRange {
    /// The `uid_map` / `gid_map` line.
    pub fn map_line(&self) -> String {
        format!("0 {} {SIZE}", self.base)
    }

    /// The host id of the sandbox's id `inside`.
    pub fn host(&self, inside: u32) -> u32 {
        self.base + inside
    }
}

/// The slots one server hands out: `count` ranges from `first` on.
pub struct Slots {
    first: u32,
    count: u32,
    inner: Mutex<SlotsInner>,
}

#[derive(Default)]
struct SlotsInner {
    /// slot → sandbox
    used: BTreeMap<u32, String>,
    /// The server's namespace per slot, made on first use and kept: slots are reused.
    namespaces: HashMap<u32, Arc<OwnedFd>>,
    /// Idmapped copies of layer folders per slot, kept too: dropping a detached mount costs the
    /// kernel an RCU grace period under the global mount lock, which at 10 creates in flight
    /// doubled a create's wait (made and dropped per create: first output p50 +40–60 %).
    layers: HashMap<(u32, PathBuf), Arc<OwnedFd>>,
}

/// Idmapped layer copies kept at most (a copy pins only its folder's inode).
const LAYER_COPIES: usize = 1024;

impl Slots {
    /// `count` slots from host id `first`; the last id must stay below 2³² − 1 (`(uid_t) -1`).
    pub fn new(first: u32, count: u32) -> Result<Self, String> {
        let end = u64::from(first) + u64::from(count) * u64::from(SIZE);
        if count == 0 || end > u64::from(u32::MAX) {
            return Err(format!(
                "user namespaces: {count} ranges of {SIZE} ids from {first} do not fit below {}",
                u32::MAX
            ));
        }
        Ok(Self {
            first,
            count,
            inner: Mutex::new(SlotsInner::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotsInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn range(&self, slot: u32) -> IdRange {
        IdRange {
            base: self.first + slot * SIZE,
        }
    }

    fn slot_of(&self, range: IdRange) -> Option<u32> {
        let off = range.base.checked_sub(self.first)?;
        (off % SIZE == 0 && off / SIZE < self.count).then_some(off / SIZE)
    }

    /// A free range for sandbox `id` (its own again if it has one).
    pub fn take(&self, id: &str) -> Option<IdRange> {
        let mut inner = self.lock();
        if let Some((slot, _)) = inner.used.iter().find(|(_, owner)| *owner == id) {
            return Some(self.range(*slot));
        }
        let slot = (0..self.count).find(|s| !inner.used.contains_key(s))?;
        inner.used.insert(slot, id.to_owned());
        Some(self.range(slot))
    }

    /// Records that sandbox `id` holds `range` (a sandbox found running after a restart). False
    /// when another sandbox holds it or it is none of ours.
    pub fn adopt(&self, id: &str, range: IdRange) -> bool {
        let Some(slot) = self.slot_of(range) else {
            return false;
        };
        let mut inner = self.lock();
        match inner.used.get(&slot) {
            Some(owner) => owner == id,
            None => {
                inner.used.insert(slot, id.to_owned());
                true
            }
        }
    }

    /// Sandbox `id` is gone: its range is free again.
    pub fn release(&self, id: &str) {
        self.lock().used.retain(|_, owner| owner != id);
    }

    /// The server's namespace for `range` (made once per slot).
    pub fn namespace(&self, range: IdRange) -> io::Result<Arc<OwnedFd>> {
        let slot = self
            .slot_of(range)
            .ok_or_else(|| io::Error::other(format!("{range:?} is not one of this server's")))?;
        if let Some(ns) = self.lock().namespaces.get(&slot) {
            return Ok(ns.clone());
        }
        let ns = Arc::new(make(range)?);
        Ok(self.lock().namespaces.entry(slot).or_insert(ns).clone())
    }
}

/// What the server hands a sandbox in a range: the range's namespace (PID 1 joins it; volumes are
/// idmapped through it) and idmapped copies of the root's layers, in `layers`' order.
pub struct Idmapped {
    pub ns: Arc<OwnedFd>,
    pub layers: Vec<Arc<OwnedFd>>,
}

impl Idmapped {
    /// The layers as overlayfs takes them, `/proc/self/fd/N`: valid while `self` lives.
    pub fn layer_paths(&self) -> Vec<PathBuf> {
        self.layers.iter().map(crate::rootfs::fd_path).collect()
    }
}

impl Slots {
    /// The namespace and idmapped `layers` for a sandbox in `range`.
    pub fn idmapped(&self, range: IdRange, layers: &[PathBuf]) -> io::Result<Idmapped> {
        Ok(Idmapped {
            ns: self.namespace(range)?,
            layers: self.idmapped_layers(range, layers)?,
        })
    }

    /// Idmapped copies of `layers` for `range` (see `rootfs::lowers`), made once per slot and
    /// layer. A copy whose folder was replaced (an image deleted and pulled again) is made anew.
    pub fn idmapped_layers(
        &self,
        range: IdRange,
        layers: &[PathBuf],
    ) -> io::Result<Vec<Arc<OwnedFd>>> {
        let slot = self
            .slot_of(range)
            .ok_or_else(|| io::Error::other(format!("{range:?} is not one of this server's")))?;
        let ns = self.namespace(range)?;
        let mut out = Vec::with_capacity(layers.len());
        for layer in layers {
            let key = (slot, layer.clone());
            let cached = self.lock().layers.get(&key).cloned();
            if let Some(copy) = cached.filter(|c| same_folder(c, layer)) {
                out.push(copy);
                continue;
            }
            let copy =
                Arc::new(crate::rootfs::mount_api::idmapped(layer, &ns).map_err(io::Error::from)?);
            let mut inner = self.lock();
            if inner.layers.len() >= LAYER_COPIES {
                inner.layers.clear();
            }
            inner.layers.insert(key, copy.clone());
            out.push(copy);
        }
        Ok(out)
    }
}

/// Whether the mount `copy` is a copy of the folder at `path` as it is now.
fn same_folder(copy: &OwnedFd, path: &Path) -> bool {
    let (Ok(held), Ok(now)) = (
        nix::sys::stat::fstat(copy.as_raw_fd()),
        nix::sys::stat::stat(path),
    ) else {
        return false;
    };
    (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
}

/// A new user namespace mapping ids `0 .. SIZE` onto `range`, as a descriptor (`/proc/PID/ns/user`
/// of the child that made it, which has exited). Sound in a multi-threaded process: the child makes
/// only async-signal-safe calls before it exits.
pub fn make(range: IdRange) -> io::Result<OwnedFd> {
    // One at a time in this process: a child forked by one call inherits the pipes of another
    // call in flight, and two such children each held the end the other waited to see closed —
    // neither ever exited, and both calls (and the creates behind them) hung.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (ready_r, ready_w) = pipe()?;
    let (go_r, go_w) = pipe()?;
    // SAFETY: the child runs only unshare, write, read and _exit (async-signal-safe), so forking a
    // multi-threaded process is sound.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: raw syscalls on descriptors this child inherited; it only ever _exits.
        unsafe {
            // Its copy of the parent's ends, or its read would never see the parent close them.
            libc::close(go_w.as_raw_fd());
            libc::close(ready_r.as_raw_fd());
            let ok = libc::unshare(libc::CLONE_NEWUSER) == 0;
            let byte = [u8::from(ok)];
            libc::write(ready_w.as_raw_fd(), byte.as_ptr().cast(), 1);
            let mut b = [0u8; 1];
            libc::read(go_r.as_raw_fd(), b.as_mut_ptr().cast(), 1);
            libc::_exit(0);
        }
    }
    drop(ready_w);
    drop(go_r);
    let made = (|| {
        let mut byte = [0u8; 1];
        let n = {
            use std::io::Read;
            File::from(ready_r).read(&mut byte)?
        };
        if n != 1 || byte[0] != 1 {
            return Err(io::Error::other(
                "unshare(CLONE_NEWUSER) failed in the namespace's child (user namespaces off?)",
            ));
        }
        std::fs::write(format!("/proc/{pid}/uid_map"), range.map_line())?;
        std::fs::write(format!("/proc/{pid}/gid_map"), range.map_line())?;
        let f = File::open(format!("/proc/{pid}/ns/user"))?;
        Ok(OwnedFd::from(f))
    })();
    drop(go_w); // the child reads EOF and exits
    let mut status = 0;
    // SAFETY: waiting for the child we forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    made
}

/// Moves the calling single-threaded process into user namespace `ns` as its root (ids 0, no
/// supplementary groups), with every capability there. Its other namespaces stay owned by the
/// initial user namespace, so those capabilities do not reach mounts, the network or the hostname.
pub fn join(ns: &OwnedFd) -> io::Result<()> {
    // SAFETY: setns(2) on a namespace descriptor we own.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWUSER) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: plain credential syscalls.
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0
            || libc::setresgid(0, 0, 0) != 0
            || libc::setresuid(0, 0, 0) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors, owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_never_shared_and_come_back() {
        let s = Slots::new(1 << 31, 3).expect("fits");
        let a = s.take("a").expect("a");
        let b = s.take("b").expect("b");
        assert_ne!(a, b);
        assert_eq!(s.take("a"), Some(a), "the same sandbox keeps its range");
        assert!(s.take("c").is_some());
        assert_eq!(s.take("d"), None, "three slots");
        assert!(
            !s.adopt("d", a),
            "a live sandbox's range is not adopted by another"
        );
        s.release("a");
        assert_eq!(s.take("d"), Some(a));
        assert!(!s.adopt("e", IdRange { base: 12 }), "not one of ours");
        assert!(
            Slots::new(u32::MAX - SIZE + 1, 1).is_err(),
            "(uid_t) -1 would be in it"
        );
        assert!(
            Slots::new(1 << 31, 32_767).is_ok(),
            "the default: all that fit above 2^31"
        );
    }

    #[test]
    fn namespaces_made_at_once_from_many_threads_all_come() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let threads: Vec<_> = (0..8u32)
            .map(|i| {
                std::thread::spawn(move || {
                    make(IdRange {
                        base: 3_000_000_000 + i * SIZE,
                    })
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread").expect("namespace");
        }
    }

    #[test]
    fn a_namespace_maps_its_range() {
        if !nix::unistd::geteuid().is_root() {
            return; // writing another process's map needs root
        }
        let range = IdRange {
            base: 3_000_000_000,
        };
        let ns = make(range).expect("namespace");
        // A child joins it: ids 0 inside are the range's base outside.
        // SAFETY: the forked child only joins, stats and _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = match join(&ns) {
                Ok(()) if nix::unistd::getuid().as_raw() == 0 => 0,
                _ => 1,
            };
            // SAFETY: leave the forked child without running the test harness's atexit code.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "joined as root of the range"
        );
    }
}
