//! User namespaces for sandboxes: root in a sandbox is an unprivileged range of host ids of its own.
//!
//! Each sandbox gets a slot: host ids `base .. base + 65,536` are its ids `0 .. 65,536`, and no two
//! live sandboxes share a slot. Image layers stay as they are on disk (owned by root, shared by every
//! sandbox): the sandbox sees them through idmapped mounts (Linux ≥ 5.19 for overlayfs layers), so
//! a file owned by root on disk is owned by root inside, while what the sandbox writes lands in its
//! upper dir owned by its range — a setuid-root file it makes is a setuid file of an unprivileged
//! host id, and a host file owned by an id outside the range (the `host` image's binds) is owned by
//! nobody inside: root there has no override on it. Volumes are idmapped onto a range of their own
//! ([`VOLUME_BASE`], [`volume_map`]), never onto host accounts.
//!
//! Ranges are unique on the host, not only within one server: every server on a host (a second
//! instance, a test suite's, a blue/green successor on another data dir) claims each range it
//! hands out in a host-wide folder ([`HOST_CLAIMS`]), a file per range that it holds `flock`ed
//! while the range's sandbox lives and that names the sandbox. A server that stops leaves its
//! sandboxes running and so their claims written but unlocked; another server takes such a range
//! only once no process on the host runs in it (their `/proc/<pid>/uid_map`). Without this, two
//! servers gave live sandboxes the same 65,536 ids, and every kernel check that compares ids saw
//! one user.
//!
//! The namespaces themselves are made by a short-lived child: it unshares a user namespace and
//! waits; its parent writes the mapping and keeps a descriptor of the namespace, which outlives the
//! child. The server keeps one per slot, made on the slot's first use: it idmaps the layers of the
//! root overlay it makes, and goes to the setup helper with the spec; the sandbox's PID 1 joins it
//! last, just before it drops capabilities. (A helper whose spec came through a pipe, which carries
//! no descriptors, makes one of its own.)
//!
//! Why one file: ~285 of its lines are tests (some of the private `volume_group`, with claims in a
//! temporary folder). The rest is one scheme of id ranges (slots, host-wide claims, volume maps and
//! the namespaces made for them), whose safety rests on the one argument told above.

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

/// The host ids volumes keep their files under: a range of [`SIZE`] below the first default slot,
/// no host user's and no sandbox's. A sandbox's id `k` is id `VOLUME_BASE + k` on a volume's disk,
/// whatever its own range, so every sandbox sharing a volume sees one owner for each file, and a
/// file the sandbox makes there — setuid or setgid included — belongs to an id no host account has
/// (see [`volume_map`]).
pub const VOLUME_BASE: u32 = 0x7FFF_0000;

/// The idmapping of a volume whose folder belongs to `owner` on disk, for a sandbox in `range`:
/// one `uid_map` (or, given [`volume_group`], `gid_map`) text.
///
/// Never host root, nor any id a host account may have: mapping the sandbox's ids onto the same ids
/// on disk would let its root make setuid-root programs in a host folder, and any of its ids make
/// files setgid to a host group (`shadow`, say) — programs every host user could then run. So the
/// sandbox's ids are [`VOLUME_BASE`]`..` on disk, except its root, which is the folder's owner when
/// that is neither root nor a volume id (any host account, service accounts included: the caller
/// chose to share that account's folder): whoever shares a folder owned by uid 1000 gets the files
/// the sandbox's root makes as uid 1000's, and that root may change their files (it could not make
/// a setuid program uid 1000 could not make). A folder of host root's is the volume range's (root
/// there is `VOLUME_BASE`). Files of any id the map leaves out (host root's, other users') are
/// nobody's inside and not writable at all: the kernel refuses writes to a file whose owner an
/// idmapped mount does not map.
pub fn volume_map(range: IdRange, owner: u32) -> String {
    let volumes = VOLUME_BASE..VOLUME_BASE + SIZE;
    if owner == 0 || volumes.contains(&owner) {
        format!("{VOLUME_BASE} {} {SIZE}", range.base)
    } else {
        format!(
            "{owner} {} 1\n{} {} {}",
            range.base,
            VOLUME_BASE + 1,
            range.base + 1,
            SIZE - 1
        )
    }
}

/// The host-wide folder of range claims (see the module's documentation). Under /run: a reboot
/// ends every sandbox, and so every claim.
pub const HOST_CLAIMS: &str = "/run/warren/id-ranges";

/// The slots one server hands out: `count` ranges from `first` on.
pub struct Slots {
    first: u32,
    count: u32,
    /// Where ranges are claimed host-wide (see [`HOST_CLAIMS`]).
    claims: PathBuf,
    /// Who claims: this server's data dir, written into each claim beside the sandbox's id.
    owner: String,
    inner: Mutex<SlotsInner>,
}

#[derive(Default)]
struct SlotsInner {
    /// slot → sandbox, and the claim file held locked while it lives
    used: BTreeMap<u32, (String, File)>,
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
    /// `count` slots from host id `first`; the last id must stay below 2³² − 1 (`(uid_t) -1`),
    /// and `first` a multiple of [`SIZE`], so that every server on the host names a range by
    /// the same claim file. Claimed in `claims` ([`HOST_CLAIMS`] but in tests) as `owner`.
    pub fn new(first: u32, count: u32, claims: &Path, owner: &str) -> Result<Self, String> {
        let end = u64::from(first) + u64::from(count) * u64::from(SIZE);
        if count == 0 || end > u64::from(u32::MAX) {
            return Err(format!(
                "user namespaces: {count} ranges of {SIZE} ids from {first} do not fit below {}",
                u32::MAX
            ));
        }
        let volumes = u64::from(VOLUME_BASE)..u64::from(VOLUME_BASE) + u64::from(SIZE);
        if u64::from(first) < volumes.end && volumes.start < end {
            return Err(format!(
                "user namespaces: {count} ranges of {SIZE} ids from {first} cover the ids volumes \
                 keep their files under ({VOLUME_BASE} ..= {})",
                volumes.end - 1
            ));
        }
        if !first.is_multiple_of(SIZE) {
            return Err(format!(
                "user namespaces: the first id ({first}) must be a multiple of {SIZE}, so that \
                 servers on one host share ranges out without overlaps"
            ));
        }
        std::fs::create_dir_all(claims)
            .and_then(|()| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(claims, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(|e| format!("the host-wide id range claims in {}: {e}", claims.display()))?;
        Ok(Self {
            first,
            count,
            claims: claims.to_owned(),
            owner: owner.replace(char::is_control, "?"),
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

    /// A free range for sandbox `id` (its own again if it has one): free here, and claimed by no
    /// other server on the host.
    pub fn take(&self, id: &str) -> Option<IdRange> {
        let mut inner = self.lock();
        if let Some((slot, _)) = inner.used.iter().find(|(_, (owner, _))| owner == id) {
            return Some(self.range(*slot));
        }
        for slot in 0..self.count {
            if inner.used.contains_key(&slot) {
                continue;
            }
            if let Some(claim) = self.claim(self.range(slot), id, false) {
                inner.used.insert(slot, (id.to_owned(), claim));
                return Some(self.range(slot));
            }
        }
        None
    }

    /// Records that sandbox `id` holds `range` (a sandbox found running after a restart). False
    /// when another sandbox holds it, another server on the host does, or it is none of ours.
    pub fn adopt(&self, id: &str, range: IdRange) -> bool {
        let Some(slot) = self.slot_of(range) else {
            return false;
        };
        let mut inner = self.lock();
        match inner.used.get(&slot) {
            Some((owner, _)) => owner == id,
            None => match self.claim(range, id, true) {
                Some(claim) => {
                    inner.used.insert(slot, (id.to_owned(), claim));
                    true
                }
                None => false,
            },
        }
    }

    /// Sandbox `id` is gone: its range is free again, here and on the host.
    pub fn release(&self, id: &str) {
        self.lock().used.retain(|_, (owner, claim)| {
            if owner != id {
                return true;
            }
            // Emptied before the lock goes with the file: no one need look for its processes.
            let _ = claim.set_len(0);
            false
        });
    }

    /// Claims `range` host-wide for sandbox `id`: its claim file, locked, naming it. `None` when
    /// another server holds the lock, or (unless `adopting` a sandbox of our own data dir) a
    /// claim left by a server that stopped still has processes on the host.
    fn claim(&self, range: IdRange, id: &str, adopting: bool) -> Option<File> {
        use std::io::{Read, Seek, Write};
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.claims.join(range.base.to_string());
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| tracing::warn!(path = %path.display(), error = %e, "id range claim"))
            .ok()?;
        // SAFETY: flock(2) on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return None; // another server's live sandbox
        }
        let mut before = String::new();
        let _ = file.read_to_string(&mut before);
        let ours = format!("{} {id}\n", self.owner);
        if !(before.is_empty() || adopting && before == ours) && range_has_processes(range) {
            tracing::info!(base = range.base, claim = %before.trim(), "id range skipped: a stopped server's sandbox still runs in it");
            return None;
        }
        file.set_len(0).ok()?;
        file.rewind().ok()?;
        file.write_all(ours.as_bytes()).ok()?;
        Some(file)
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

/// Whether any process on the host runs with ids of `range` mapped (`/proc/<pid>/uid_map`): a
/// sandbox of a server that has stopped. Read only for a claim such a server left.
fn range_has_processes(range: IdRange) -> bool {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return true; // cannot tell: the range stays out of use
    };
    let (lo, hi) = (
        u64::from(range.base),
        u64::from(range.base) + u64::from(SIZE),
    );
    procs.flatten().any(|entry| {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        let Ok(map) = std::fs::read_to_string(entry.path().join("uid_map")) else {
            return false;
        };
        map.lines().any(|line| {
            let f: Vec<u64> = line
                .split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect();
            // (the host's own namespace maps every id to itself: not a sandbox)
            matches!(f[..], [_, outside, count]
                if count < u64::from(u32::MAX) && outside < hi && lo < outside + count)
        })
    })
}

/// What the server hands a sandbox in a range: the range's namespace (PID 1 joins it) and idmapped
/// copies of the root's layers, in `layers`' order. (Volumes have maps of their own:
/// [`volume_namespaces`].)
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
    make_mapped(&range.map_line(), &range.map_line())
}

/// A new user namespace with `uid_map` and `gid_map` (the texts the kernel takes), as [`make`].
pub fn make_mapped(uid_map: &str, gid_map: &str) -> io::Result<OwnedFd> {
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
        std::fs::write(format!("/proc/{pid}/uid_map"), uid_map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), gid_map)?;
        let f = File::open(format!("/proc/{pid}/ns/user"))?;
        Ok(OwnedFd::from(f))
    })();
    drop(go_w); // the child reads EOF and exits
    let mut status = 0;
    // SAFETY: waiting for the child we forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    made
}

/// The namespaces a sandbox in `range` mounts `volumes` through, one each, in order: each
/// volume's [`volume_map`], from the owner its folder has now, for uids, and for gids from
/// [`volume_group`]. (Opened again to mount: a
/// sandbox sharing the folder can change its owner meanwhile only to ids its own map gives, the
/// folder's owner or the volume range's, so no map this makes reaches any other host id.)
pub fn volume_namespaces(
    range: IdRange,
    volumes: &[crate::spec::HostMount],
) -> io::Result<Vec<OwnedFd>> {
    volumes
        .iter()
        .map(|v| {
            let source = v.open_source()?;
            let st = nix::sys::stat::fstat(source.fd.as_raw_fd()).map_err(io::Error::from)?;
            make_mapped(
                &volume_map(range, st.st_uid),
                &volume_map(range, volume_group(st.st_uid, st.st_gid, PASSWD)),
            )
        })
        .collect()
}

/// The host's accounts, read for their primary groups.
const PASSWD: &str = "/etc/passwd";

/// The group a volume's gid map gives the sandbox's root: the folder's group `gid` when it is the
/// primary group of the folder's owner `uid` (as `passwd` says) and that owner is the sandbox's
/// root there, else none (0: every gid is the volume range's).
///
/// A group is shared by design: a setgid program of `docker`, `staff` or `shadow` that a sandbox
/// made would give every host user who runs it what that group's members have. The owner's own
/// primary group gives no more than the owner's uid already does. The kernel refuses writes to
/// a file whose uid or gid an idmapped mount leaves unmapped, so a folder whose group is another
/// is read-only to the sandbox.
fn volume_group(uid: u32, gid: u32, passwd: &str) -> u32 {
    let owner_maps = uid != 0 && !(VOLUME_BASE..VOLUME_BASE + SIZE).contains(&uid);
    if !owner_maps || gid == 0 {
        return 0;
    }
    let primary = std::fs::read_to_string(passwd).ok().and_then(|text| {
        text.lines().find_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            (f.len() >= 4 && f[2].parse() == Ok(uid))
                .then(|| f[3].parse::<u32>().ok())
                .flatten()
        })
    });
    if primary == Some(gid) {
        gid
    } else {
        0
    }
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
    use std::io::Read;

    fn slots(dir: &Path, owner: &str, count: u32) -> Slots {
        Slots::new(1 << 31, count, dir, owner).expect("fits")
    }

    #[test]
    fn slots_are_never_shared_and_come_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = slots(dir.path(), "/data", 3);
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
        let d = dir.path();
        assert!(
            Slots::new(u32::MAX - SIZE + 1, 1, d, "x").is_err(),
            "(uid_t) -1 would be in it"
        );
        assert!(
            Slots::new((1 << 31) + 1, 1, d, "x").is_err(),
            "a first id off the ranges' grid would overlap other servers' ranges"
        );
        assert!(
            Slots::new(1 << 31, 32_767, d, "x").is_ok(),
            "the default: all that fit above 2^31"
        );
    }

    #[test]
    fn two_servers_on_one_host_never_hand_out_one_range() {
        let dir = tempfile::tempdir().expect("tempdir");
        let one = slots(dir.path(), "/data/one", 4);
        let two = slots(dir.path(), "/data/two", 4);
        let a = one.take("a").expect("a");
        let b = two.take("b").expect("b");
        assert_ne!(a, b, "the second server skips the range the first holds");
        assert!(!two.adopt("x", a), "nor adopts it");
        let claim = std::fs::read_to_string(dir.path().join(a.base.to_string())).expect("claim");
        assert_eq!(
            claim, "/data/one a\n",
            "the claim names its server and sandbox"
        );
        one.release("a");
        assert_eq!(
            std::fs::read_to_string(dir.path().join(a.base.to_string())).expect("claim"),
            "",
            "a released claim is empty"
        );
        assert_eq!(two.take("c"), Some(a), "released: free for every server");
    }

    #[test]
    fn a_stopped_servers_claim_holds_while_its_sandbox_runs() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A live process in a range, as a sandbox a stopped server left running.
        let range = IdRange { base: 1 << 31 };
        let ns = make(range).expect("a user namespace");
        let (ready_r, ready_w) = pipe().expect("pipe");
        // SAFETY: the child only joins the namespace, says so and sleeps; it is killed below.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let code = if join(&ns).is_ok() {
                // SAFETY: write(2) of one byte from a live buffer.
                unsafe { libc::write(ready_w.as_raw_fd(), b"j".as_ptr().cast(), 1) };
                0
            } else {
                1
            };
            // SAFETY: pause(2); _exit in a forked child.
            unsafe {
                if code == 0 {
                    libc::pause();
                }
                libc::_exit(code)
            }
        }
        drop(ready_w);
        let mut byte = [0u8; 1];
        let joined = File::from(ready_r).read(&mut byte).unwrap_or(0) == 1;
        let stopped = slots(dir.path(), "/data/old", 2);
        assert_eq!(stopped.take("old"), Some(range));
        drop(stopped); // the server stops; its sandbox (the child) runs on
        let next = slots(dir.path(), "/data/new", 2);
        let got = next.take("new");
        let readopted = slots(dir.path(), "/data/old", 2);
        // SAFETY: kill(2) and waitpid(2) on our own child.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        assert!(joined, "the child joined the range's namespace");
        assert_ne!(
            got,
            Some(range),
            "a range with live processes is not handed out again"
        );
        drop(next);
        assert!(
            readopted.adopt("old", range),
            "its own server, restarted, adopts it"
        );
        drop(readopted);
        let after = slots(dir.path(), "/data/new", 2);
        assert_eq!(
            after.take("new"),
            Some(range),
            "with its processes gone, it is free"
        );
    }

    #[test]
    #[ignore = "needs root: maps host id ranges (scripts/test runs it as root)"]
    fn namespaces_made_at_once_from_many_threads_all_come() {
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

    /// (disk id, sandbox id) pairs of a `volume_map` text for `range`.
    fn volume_pairs(range: IdRange, owner: u32) -> Vec<(u64, u64)> {
        volume_map(range, owner)
            .lines()
            .flat_map(|line| {
                let f: Vec<u64> = line
                    .split(' ')
                    .map(|v| v.parse().expect("a number"))
                    .collect();
                let base = u64::from(range.base);
                (0..f[2]).map(move |i| (f[0] + i, f[1] + i - base))
            })
            .collect()
    }

    #[test]
    fn volumes_never_give_a_sandbox_a_host_account() {
        let range = IdRange { base: 1 << 31 };
        for owner in [
            0,
            1,
            1000,
            65_534,
            65_535,
            65_536,
            VOLUME_BASE,
            VOLUME_BASE + 7,
            1 << 31,
            u32::MAX - 1,
        ] {
            let pairs = volume_pairs(range, owner);
            // every id of the sandbox, each once, and no disk id twice
            let mut inside: Vec<u64> = pairs.iter().map(|p| p.1).collect();
            inside.sort_unstable();
            assert_eq!(
                inside,
                (0..u64::from(SIZE)).collect::<Vec<_>>(),
                "owner {owner}"
            );
            let mut disk: Vec<u64> = pairs.iter().map(|p| p.0).collect();
            disk.sort_unstable();
            disk.dedup();
            assert_eq!(disk.len(), SIZE as usize, "owner {owner}");
            let volumes = u64::from(VOLUME_BASE)..u64::from(VOLUME_BASE + SIZE);
            for (on_disk, id) in &pairs {
                if *id == 0 && owner != 0 && !volumes.contains(&u64::from(owner)) {
                    assert_eq!(
                        *on_disk,
                        u64::from(owner),
                        "the folder's owner is root inside"
                    );
                } else {
                    assert!(
                        volumes.contains(on_disk),
                        "owner {owner}: id {id} is {on_disk} on disk"
                    );
                }
            }
        }
        assert_eq!(
            volume_map(range, 0),
            format!("{VOLUME_BASE} {} {SIZE}", 1u32 << 31)
        );
        assert_eq!(
            volume_map(range, 1000),
            format!(
                "1000 {} 1\n{} {} {}",
                1u32 << 31,
                VOLUME_BASE + 1,
                (1u32 << 31) + 1,
                SIZE - 1
            )
        );
    }

    #[test]
    fn a_volume_maps_only_its_owners_own_group() {
        let d = tempfile::tempdir().expect("tempdir");
        let passwd = d.path().join("passwd");
        std::fs::write(
            &passwd,
            "root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n\
             bob:x:1001:50::/home/bob:/bin/sh\nop:x:1002:0::/:/bin/sh\n",
        )
        .expect("passwd");
        let p = passwd.to_str().expect("utf-8");
        assert_eq!(volume_group(1000, 1000, p), 1000, "alice's own group");
        assert_eq!(
            volume_group(1000, 999, p),
            0,
            "another group of the host's (docker, say)"
        );
        assert_eq!(
            volume_group(1001, 50, p),
            50,
            "bob's primary group, whatever its number"
        );
        assert_eq!(volume_group(1002, 0, p), 0, "never gid 0");
        assert_eq!(volume_group(0, 0, p), 0);
        assert_eq!(
            volume_group(4242, 4242, p),
            0,
            "an owner passwd does not know"
        );
        assert_eq!(volume_group(VOLUME_BASE, VOLUME_BASE, p), 0);
        assert_eq!(volume_group(1000, 1000, "/nonexistent"), 0);
    }

    #[test]
    fn slots_stay_clear_of_the_volumes_ids() {
        let d = tempfile::tempdir().expect("tempdir");
        assert!(Slots::new(VOLUME_BASE, 1, d.path(), "x").is_err());
        assert!(Slots::new(VOLUME_BASE - 4 * SIZE, 5, d.path(), "x").is_err());
        assert!(Slots::new(VOLUME_BASE - 4 * SIZE, 4, d.path(), "x").is_ok());
        assert!(Slots::new(VOLUME_BASE + SIZE, 4, d.path(), "x").is_ok());
    }

    #[test]
    #[ignore = "needs root: writes another process's id map (scripts/test runs it as root)"]
    fn a_namespace_maps_its_range() {
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
