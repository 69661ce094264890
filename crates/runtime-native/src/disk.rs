//! A sandbox's own disk: the bound on its root filesystem's writes (`ephemeral-storage`).
//!
//! Without one, a sandbox's writes land in its overlay's upper folder on the data dir's file
//! system, and one sandbox can fill the host's disk for every other. Project quotas would bound a
//! folder in place, but they need the data dir on XFS or ext4 mounted with `prjquota`, and a kernel
//! built with quota support (this project's machine has neither). Instead, a sandbox that asks for
//! a bound gets a file system of exactly that size: a sparse file in its folder, formatted ext4 and
//! loop-mounted at `disk/`, holding the overlay's `upper` and `work`. Writes past the size fail
//! with ENOSPC inside the sandbox and nothing outside it notices. Only what is written takes host
//! disk (the file is sparse), and it is freed with the sandbox. The cost is on the create path:
//! `mkfs.ext4` and `mount` (a create took ~13 ms more here, a delete ~7 ms, for a 10 GiB disk;
//! release build, serial), paid only by the sandboxes that ask.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::mount::{umount2, MntFlags};

/// The disk's mount point in a sandbox's folder.
const MOUNT_DIR: &str = "disk";
/// The disk's backing file in a sandbox's folder.
const IMAGE_FILE: &str = "disk.img";

/// The mount point of the disk of the sandbox whose folder is `dir`.
pub(crate) fn mount_point(dir: &Path) -> PathBuf {
    dir.join(MOUNT_DIR)
}

/// Whether the sandbox whose folder is `dir` has a disk of its own mounted.
pub(crate) fn is_mounted(dir: &Path) -> bool {
    let point = mount_point(dir);
    match (fs::metadata(dir), fs::metadata(&point)) {
        // a mount point is on another device than the folder holding it
        (Ok(d), Ok(p)) => {
            use std::os::unix::fs::MetadataExt;
            d.dev() != p.dev()
        }
        _ => false,
    }
}

/// Makes a disk of `bytes` for the sandbox whose folder is `dir` and mounts it at
/// [`mount_point`], holding empty `upper` and `work` folders. On failure nothing of it is left.
pub(crate) fn make(dir: &Path, bytes: u64) -> io::Result<()> {
    let result = try_make(dir, bytes);
    if result.is_err() {
        remove(dir);
    }
    result
}

fn try_make(dir: &Path, bytes: u64) -> io::Result<()> {
    let image = dir.join(IMAGE_FILE);
    let point = mount_point(dir);
    // The mount point first: a folder without it has no disk file either (see `remove`).
    fs::create_dir(&point)?;
    fs::File::create_new(&image)?.set_len(bytes)?;
    // No journal (a sandbox's writes do not outlive a host crash anyway), no room kept for growing
    // the file system (`resize_inode`: 37 → 10 ms of mkfs for 10 GiB here, 4.3 MiB → 0.2 MiB
    // written), no blocks reserved for root (the sandbox's root is the only user), nothing
    // discarded or zeroed ahead: a sparse file stays sparse.
    run(Command::new(program("mkfs.ext4"))
        .args(["-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode"])
        .args([
            "-E",
            "nodiscard,lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0",
        ])
        .arg(&image))?;
    // `noinit_itable`: no kernel thread zeroing inode tables in the background, which would write
    // (and allocate) a few MiB of the sparse file per GiB for nothing.
    run(Command::new(program("mount"))
        .args([
            "-t",
            "ext4",
            "-o",
            "loop,nosuid,nodev,noatime,noinit_itable",
        ])
        .arg(&image)
        .arg(&point))?;
    fs::create_dir(point.join("upper"))?;
    fs::create_dir(point.join("work"))?;
    Ok(())
}

/// Unmounts and removes the disk of the sandbox whose folder is `dir`, if it has one. The unmount is
/// lazy: an overlay still built on it (a sandbox's mount namespace going away) keeps it until then,
/// and the loop device clears itself with the last user (mount's `loop` sets autoclear).
pub(crate) fn remove(dir: &Path) {
    let point = mount_point(dir);
    // Every delete comes here: a sandbox without a disk costs it one failed lookup.
    if fs::symlink_metadata(&point).is_err() {
        return;
    }
    if is_mounted(dir) {
        if let Err(e) = umount2(&point, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
            tracing::warn!(path = %point.display(), error = %e, "unmounting a sandbox disk");
        }
    }
    let _ = fs::remove_dir(&point);
    let _ = fs::remove_file(dir.join(IMAGE_FILE));
}

/// A system program by name: from `PATH`, or from the sbin folders a service's `PATH` often lacks.
fn program(name: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()));
    if on_path {
        return PathBuf::from(name);
    }
    ["/usr/sbin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Runs a helper program, its stderr kept for the error.
fn run(cmd: &mut Command) -> io::Result<()> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("{program}: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{program} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}
