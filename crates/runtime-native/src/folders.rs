//! Sandbox folders — `sandboxes/<id>` with the overlay's `upper` and `work`, execd's `run`, an OCI
//! runtime's `rootfs` and `sandbox.log` — made ahead of need and removed out of the way.
//!
//! Both ends of a folder's life can stall a create on the data dir's file system for milliseconds.
//! Measured on this project's machine (an off-CPU profile of 300 create → command → delete cycles
//! at 10 in flight; ext4 without a journal, mounted with `discard`, its idle page cache paged out
//! after a minute):
//! - Making a folder allocates five inodes. `sandboxes/` spreads its children over ext4's block
//!   groups (see [`spread_subdirectories`]), and a group whose inode bitmap is not in memory is
//!   read from disk first: 70 of the 300 creates waited for one, 7 ms on average. Here a
//!   background thread keeps [`SPARE`] folders made, and a create renames one into place, which
//!   allocates nothing.
//! - Removing a folder frees its blocks; under `discard` ext4 discards each one synchronously
//!   (~0.8 ms) from inside the `rmdir` or `unlink`, holding the lock of the folder the removed
//!   entry sat in. For `sandboxes/<id>` that is `sandboxes/`, and creates looking a path up there
//!   waited behind it (12–17 ms at times). Here a deleted sandbox's folder is first renamed into
//!   `trash/` (no block freed, no discard) and removed there, where no create looks.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::lock;

/// How many spare folders are kept made: enough for a burst of creates while the background thread
/// catches up (a folder takes it ~0.1 ms, or a few ms where a bitmap must be read from disk).
const SPARE: usize = 16;
/// The sandbox log's name in its folder.
pub(crate) const LOG_NAME: &str = "sandbox.log";

pub(crate) struct Folders {
    /// `<data>/sandboxes`: one folder per sandbox, named by its id.
    sandboxes: PathBuf,
    /// `<data>/spare-folders`: made, not yet handed out.
    spare: PathBuf,
    /// `<data>/trash`: folders of deleted sandboxes while they are removed, and whatever an
    /// earlier server left there or among its spares.
    trash: PathBuf,
    /// The subfolders every sandbox folder has.
    subs: &'static [&'static str],
    supply: Mutex<Supply>,
    /// Signalled when a spare is taken, and on close.
    wanted: Condvar,
    maker: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Default)]
struct Supply {
    ready: Vec<PathBuf>,
    /// Names spares and trash entries apart.
    next: u64,
    closed: bool,
}

impl Folders {
    /// Prepares the folders under `data_dir` and starts making spares. What an earlier server left
    /// in `trash/` or among its spares is removed in the background.
    pub fn open(data_dir: &Path, subs: &'static [&'static str]) -> io::Result<Arc<Self>> {
        let sandboxes = data_dir.join("sandboxes");
        let spare = data_dir.join("spare-folders");
        let trash = data_dir.join("trash");
        fs::create_dir_all(&sandboxes)?;
        fs::create_dir_all(&trash)?;
        // An earlier server's spares are not known to be complete: they go with the trash.
        if spare.exists() {
            let away = trash.join(format!("spare-folders.{}", std::process::id()));
            if fs::rename(&spare, &away).is_err() {
                warren_fstree::remove_all(&spare)?;
            }
        }
        fs::create_dir(&spare)?;
        // Spares are made in `spare-folders/`, which decides their block group: spread as
        // `sandboxes/` is.
        for dir in [&sandboxes, &spare] {
            if let Err(e) = spread_subdirectories(dir) {
                tracing::debug!(error = %e, dir = %dir.display(), "folders stay in their parent's block group");
            }
        }
        let this = Arc::new(Self {
            sandboxes,
            spare,
            trash,
            subs,
            supply: Mutex::default(),
            wanted: Condvar::new(),
            maker: Mutex::new(None),
        });
        let maker = this.clone();
        let handle = std::thread::Builder::new()
            .name("warren-folders".into())
            .spawn(move || maker.make_spares())?;
        *lock(&this.maker) = Some(handle);
        Ok(this)
    }

    /// The folder of sandbox `id`, whether or not it exists.
    pub fn path(&self, id: &str) -> PathBuf {
        self.sandboxes.join(id)
    }

    /// Makes sandbox `id`'s folder, with its subfolders and an empty log; from a spare where one
    /// is ready. Fails with `AlreadyExists` if the sandbox has a folder.
    pub fn make(&self, id: &str) -> io::Result<PathBuf> {
        let dir = self.path(id);
        let spare = {
            let mut supply = lock(&self.supply);
            let spare = supply.ready.pop();
            self.wanted.notify_one();
            spare
        };
        if let Some(spare) = spare {
            match rename_noreplace(&spare, &dir) {
                Ok(()) => return Ok(dir),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    lock(&self.supply).ready.push(spare);
                    return Err(e);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "a spare folder could not be used; making one");
                    let _ = warren_fstree::remove_all(&spare);
                }
            }
        }
        fs::create_dir(&dir)?;
        if let Err(e) = self.fill(&dir) {
            let _ = warren_fstree::remove_all(&dir);
            return Err(e);
        }
        Ok(dir)
    }

    /// Removes sandbox `id`'s folder and everything in it; nothing if it has none.
    pub fn remove(&self, id: &str) -> io::Result<()> {
        let dir = self.path(id);
        // Its disk (if it has one) first: a removal would descend into the mounted file system.
        crate::disk::remove(&dir);
        let away = {
            let mut supply = lock(&self.supply);
            supply.next += 1;
            self.trash.join(format!("{id}.{}", supply.next))
        };
        match rename_noreplace(&dir, &away) {
            Ok(()) => warren_fstree::remove_all(&away),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            // (A name left in the trash by an earlier server, say: removed where it is.)
            Err(_) => warren_fstree::remove_all(&dir).or_else(|e| match e.kind() {
                io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            }),
        }
    }

    /// Stops making spares and removes those made.
    pub fn close(&self) {
        lock(&self.supply).closed = true;
        self.wanted.notify_all();
        if let Some(maker) = lock(&self.maker).take() {
            let _ = maker.join();
        }
        for spare in std::mem::take(&mut lock(&self.supply).ready) {
            let _ = warren_fstree::remove_all(spare);
        }
    }

    fn fill(&self, dir: &Path) -> io::Result<()> {
        for sub in self.subs {
            fs::create_dir(dir.join(sub))?;
        }
        fs::OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(dir.join(LOG_NAME))?;
        Ok(())
    }

    /// The background thread: empties the trash, then keeps [`SPARE`] folders made until closed.
    fn make_spares(self: Arc<Self>) {
        self.empty_trash();
        // Pauses after a failure (a full disk, say), doubling up to 5 s; creates make their
        // folders themselves meanwhile.
        let mut pause = Duration::ZERO;
        loop {
            let name = {
                let mut supply = lock(&self.supply);
                if !pause.is_zero() {
                    supply = self
                        .wanted
                        .wait_timeout(supply, pause)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                while !supply.closed && supply.ready.len() >= SPARE {
                    supply = self.wanted.wait(supply).unwrap_or_else(|e| e.into_inner());
                }
                if supply.closed {
                    return;
                }
                supply.next += 1;
                supply.next
            };
            let path = self.spare.join(name.to_string());
            match fs::create_dir(&path).and_then(|()| self.fill(&path)) {
                Ok(()) => {
                    pause = Duration::ZERO;
                    let mut supply = lock(&self.supply);
                    if supply.closed {
                        drop(supply);
                        let _ = warren_fstree::remove_all(&path);
                        return;
                    }
                    supply.ready.push(path);
                }
                Err(e) => {
                    let _ = warren_fstree::remove_all(&path);
                    pause = (pause * 2).clamp(Duration::from_millis(100), Duration::from_secs(5));
                    tracing::debug!(error = %e, "making a spare sandbox folder failed");
                }
            }
        }
    }

    fn empty_trash(&self) {
        let Ok(entries) = fs::read_dir(&self.trash) else {
            return;
        };
        for entry in entries.flatten() {
            if let Err(e) = warren_fstree::remove_all(entry.path()) {
                tracing::warn!(error = %e, path = %entry.path().display(), "removing a deleted sandbox's folder failed");
            }
        }
    }
}

/// `rename(2)` that fails with `AlreadyExists` instead of replacing an (empty) folder at `to`.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    };
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: renameat2(2) with two NUL-terminated paths that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `FS_TOPDIR_FL` from linux/fs.h (`chattr +T`).
const TOPDIR: libc::c_int = 0x0002_0000;

/// Asks ext2/3/4 to place each subdirectory of `dir` in a block group of its own choosing, as it
/// does for top-level directories (`chattr +T`, the Orlov allocator), instead of next to `dir`.
///
/// Every sandbox makes and removes a dozen inodes on the data dir's file system (its folders, the
/// overlay's work-dir probes, execd's socket). Left to the default, all of them land in the one
/// block group of the `sandboxes` folder, and ext4 without a journal checks every free inode it
/// passes for a recent deletion (`recently_deleted`, 5 s or, while the inode table is dirty, 5 min):
/// at a few hundred sandboxes a second each allocation walks thousands of them. Spread across
/// groups, measured on this project's machine (ext4 without a journal, 300 create → command →
/// delete cycles at 10 in flight): 12.5–13.8 → 9.8–11.0 ms of CPU per cycle. Other file systems
/// answer ENOTTY or EOPNOTSUPP, and nothing changes.
fn spread_subdirectories(dir: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = fs::File::open(dir)?;
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int to the pointer we pass, valid for the call.
    if unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & TOPDIR != 0 {
        return Ok(());
    }
    flags |= TOPDIR;
    // SAFETY: FS_IOC_SETFLAGS reads one int from the pointer we pass, valid for the call.
    if unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_for_spares(f: &Folders, n: usize) {
        for _ in 0..500 {
            if lock(&f.supply).ready.len() >= n {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no {n} spare folders after 5 s");
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_folder_comes_from_a_spare_and_goes_through_the_trash() {
        let t = tempfile::tempdir().expect("tempdir");
        let f = Folders::open(t.path(), &["upper", "work", "run"]).expect("open");
        wait_for_spares(&f, SPARE);
        let spare = lock(&f.supply).ready.last().cloned().expect("a spare");
        let dir = f.make("abc").expect("make");
        assert_eq!(dir, t.path().join("sandboxes/abc"));
        assert!(!spare.exists(), "the spare was renamed into place");
        assert_eq!(names(&dir), ["run", "sandbox.log", "upper", "work"]);
        // The spare taken is made again.
        wait_for_spares(&f, SPARE);
        assert_eq!(names(&t.path().join("spare-folders")).len(), SPARE);

        let e = f
            .make("abc")
            .expect_err("a second folder for the same sandbox");
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(names(&dir), ["run", "sandbox.log", "upper", "work"]);
        wait_for_spares(&f, SPARE);

        fs::write(dir.join("upper/file"), "x").expect("write");
        f.remove("abc").expect("remove");
        assert!(!dir.exists());
        assert!(names(&t.path().join("trash")).is_empty());
        f.remove("abc").expect("removing what is gone is no error");

        f.close();
        assert!(
            names(&t.path().join("spare-folders")).is_empty(),
            "close removes the spares"
        );
        assert!(names(&t.path().join("sandboxes")).is_empty());
    }

    #[test]
    fn without_spares_a_folder_is_made_in_place() {
        let t = tempfile::tempdir().expect("tempdir");
        let f = Folders::open(t.path(), &["upper", "work", "rootfs", "run"]).expect("open");
        f.close();
        let dir = f.make("x").expect("make");
        assert_eq!(
            names(&dir),
            ["rootfs", "run", "sandbox.log", "upper", "work"]
        );
        f.remove("x").expect("remove");
        assert!(names(&t.path().join("sandboxes")).is_empty());
    }

    #[test]
    fn what_an_earlier_server_left_is_cleared() {
        let t = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(t.path().join("trash/old.1/upper/deep")).expect("mkdir");
        fs::write(t.path().join("trash/old.1/upper/deep/f"), "x").expect("write");
        fs::create_dir_all(t.path().join("spare-folders/7/upper")).expect("mkdir");
        fs::write(t.path().join("spare-folders/7/upper/theirs"), "x").expect("write");
        let f = Folders::open(t.path(), &["upper", "work", "run"]).expect("open");
        wait_for_spares(&f, SPARE);
        // The trash is emptied before the first spare is made.
        assert!(names(&t.path().join("trash")).is_empty());
        assert!(!t.path().join("spare-folders/7/upper/theirs").exists());
        assert_eq!(
            names(&t.path().join("spare-folders/7")),
            ["run", "sandbox.log", "upper", "work"]
        );
        f.close();
    }

    #[test]
    fn sandbox_folders_are_spread_across_block_groups_on_ext4() {
        let dir = tempfile::tempdir().expect("tempdir");
        match spread_subdirectories(dir.path()) {
            Ok(()) => {}
            // not ext2/3/4 (tmpfs, overlay, xfs…): nothing to check
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EOPNOTSUPP)) => return,
            Err(e) => panic!("setting the flag: {e}"),
        }
        use std::os::fd::AsRawFd;
        let f = fs::File::open(dir.path()).expect("open");
        let mut flags: libc::c_int = 0;
        // SAFETY: FS_IOC_GETFLAGS writes one int to a valid pointer.
        let rc = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        assert_ne!(flags & TOPDIR, 0, "FS_TOPDIR_FL not set: {flags:#x}");
        // twice is fine (a restarted server)
        spread_subdirectories(dir.path()).expect("second time");
    }
}
