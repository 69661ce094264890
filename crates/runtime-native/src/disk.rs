//! A sandbox's own disk: the bound on its root filesystem's writes (`ephemeral-storage`).
//!
//! Without one, a sandbox's writes land in its overlay's upper folder on the data dir's file
//! system, and one sandbox can fill the host's disk for every other. Project quotas would bound a
//! folder in place, but they need the data dir on XFS or ext4 mounted with `prjquota`, and a kernel
//! built with quota support (this project's machine has neither). Instead, a sandbox gets a file
//! system of exactly its size: a sparse file in its folder, ext4, loop-mounted at `disk/`, holding
//! the overlay's `upper` and `work`. Writes past the size fail with ENOSPC inside the sandbox and
//! nothing outside it notices. Only what is written takes host disk (the file is sparse), and it is
//! freed with the sandbox.
//!
//! Every sandbox has one by default (`[limits] default_ephemeral_storage`), so making it must be
//! cheap: the file system is formatted once per size into a template (`<data_dir>/disks/`), and each
//! disk is a copy of the template's few hundred KiB of data (its holes stay holes), attached to a
//! loop device and mounted by system calls. No `mkfs.ext4` or `mount` process runs per sandbox.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::mount::{umount2, MntFlags};

/// The disk's mount point in a sandbox's folder.
const MOUNT_DIR: &str = "disk";
/// The disk's backing file in a sandbox's folder.
const IMAGE_FILE: &str = "disk.img";
/// Formatted file systems to copy, one per size, under the data dir.
const TEMPLATES_DIR: &str = "disks";

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

/// Makes a disk of `bytes` for the sandbox whose folder is `dir` (from the template of that size
/// under `data_dir`, made first if need be) and mounts it at [`mount_point`], holding empty `upper`
/// and `work` folders. On failure nothing of it is left.
pub(crate) fn make(data_dir: &Path, dir: &Path, bytes: u64) -> io::Result<()> {
    let result = try_make(data_dir, dir, bytes);
    if result.is_err() {
        remove(dir);
    }
    result
}

fn try_make(data_dir: &Path, dir: &Path, bytes: u64) -> io::Result<()> {
    let template = template(data_dir, bytes)?;
    let image = dir.join(IMAGE_FILE);
    let point = mount_point(dir);
    // The mount point first: a folder without it has no disk file either (see `remove`).
    fs::create_dir(&point)?;
    let file = copy_sparse(&template, &image)?;
    let device = loop_device::attach(&file)?;
    drop(file);
    // `noinit_itable`: no kernel thread zeroing inode tables in the background, which would write
    // (and allocate) a few MiB of the sparse file per GiB for nothing. `discard`: what the sandbox
    // deletes becomes a hole in the file again, so the host gets that room back at once, not only
    // when the sandbox ends (disks are thin: together they may promise more than the data dir has).
    nix::mount::mount(
        Some(&device.path),
        &point,
        Some("ext4"),
        nix::mount::MsFlags::MS_NOSUID
            | nix::mount::MsFlags::MS_NODEV
            | nix::mount::MsFlags::MS_NOATIME,
        Some("noinit_itable,discard"),
    )
    .map_err(|e| io::Error::other(format!("mounting {}: {e}", device.path.display())))?;
    // The mount holds the device now; with autoclear it detaches when the mount goes.
    drop(device);
    fs::create_dir(point.join("upper"))?;
    fs::create_dir(point.join("work"))?;
    Ok(())
}

/// The formatted ext4 of `bytes` to copy, made once (by whichever create needs it first; a
/// concurrent one may format its own, and the last rename wins).
fn template(data_dir: &Path, bytes: u64) -> io::Result<PathBuf> {
    let dir = data_dir.join(TEMPLATES_DIR);
    // The name says how it was formatted: a template of other options is never taken for it.
    let path = dir.join(format!("ext4-i8192-{bytes}.img"));
    if path.is_file() {
        return Ok(path);
    }
    fs::create_dir_all(&dir)?;
    remove_dead_partials(&dir);
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let partial = dir.join(format!(
        ".partial-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let made = format_template(&partial, bytes).and_then(|()| fs::rename(&partial, &path));
    if made.is_err() {
        let _ = fs::remove_file(&partial);
    }
    made.map(|()| path)
}

/// Removes the half-made templates of servers that died while formatting them.
fn remove_dead_partials(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix(".partial-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if let Some(pid) = pid {
            if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

fn format_template(partial: &Path, bytes: u64) -> io::Result<()> {
    fs::File::create_new(partial)?.set_len(bytes)?;
    // No journal (a sandbox's writes do not outlive a host crash anyway), no room kept for growing
    // the file system (`resize_inode`: 37 → 10 ms of mkfs for 10 GiB here, 4.3 MiB → 0.2 MiB
    // written), no blocks reserved for root (the sandbox's root is the only user), nothing
    // discarded or zeroed ahead: a sparse file stays sparse. An inode per 8 KiB, not 16: a
    // sandbox's trees of small files (`node_modules`) run out of inodes long before of bytes, and
    // inode tables not yet used take no room on the host.
    run(Command::new(program("mkfs.ext4"))
        .args(["-q", "-F", "-m", "0", "-i", "8192"])
        .args(["-O", "^has_journal,^resize_inode"])
        .args([
            "-E",
            "nodiscard,lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0",
        ])
        .arg(partial))
}

/// Copies `from` to the new file `to` as the same sparse file: only its data is copied (in the
/// kernel), its holes stay holes. Returns `to`, open for reading and writing.
fn copy_sparse(from: &Path, to: &Path) -> io::Result<fs::File> {
    let src = fs::File::open(from)?;
    let len = src.metadata()?.len();
    let dst = fs::File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(to)?;
    dst.set_len(len)?;
    let mut at: i64 = 0;
    while (at as u64) < len {
        // SAFETY: lseek(2) on an open descriptor.
        let data = unsafe { libc::lseek(src.as_raw_fd(), at, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only holes remain
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(src.as_raw_fd(), data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let (mut from_at, mut to_at) = (data, data);
        while from_at < hole {
            // SAFETY: copy_file_range(2) between two open descriptors at offsets we own.
            let n = unsafe {
                libc::copy_file_range(
                    src.as_raw_fd(),
                    &mut from_at,
                    dst.as_raw_fd(),
                    &mut to_at,
                    (hole - from_at) as usize,
                    0,
                )
            };
            match n {
                n if n > 0 => {}
                0 => return Err(io::Error::other("the disk template ended early")),
                _ => return Err(io::Error::last_os_error()),
            }
        }
        at = hole;
    }
    Ok(dst)
}

/// Loop devices through `/dev/loop-control` (the kernel's `linux/loop.h`, which libc lacks).
mod loop_device {
    use super::{fs, io, AsRawFd, FromRawFd, OwnedFd, PathBuf};

    const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
    const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
    const LOOP_SET_FD: libc::c_ulong = 0x4C00;
    const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
    const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
    const LO_FLAGS_AUTOCLEAR: u32 = 4;

    #[repr(C)]
    struct LoopInfo64 {
        device: u64,
        inode: u64,
        rdevice: u64,
        offset: u64,
        sizelimit: u64,
        number: u32,
        encrypt_type: u32,
        encrypt_key_size: u32,
        flags: u32,
        file_name: [u8; 64],
        crypt_name: [u8; 64],
        encrypt_key: [u8; 32],
        init: [u64; 2],
    }

    #[repr(C)]
    struct LoopConfig {
        fd: u32,
        block_size: u32,
        info: LoopInfo64,
        reserved: [u64; 8],
    }

    /// An attached loop device, open; it detaches by itself once nothing holds it (autoclear).
    pub(super) struct Device {
        pub(super) path: PathBuf,
        _fd: OwnedFd,
    }

    fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    }

    /// Attaches `file` to a free loop device, with autoclear set.
    pub(super) fn attach(file: &fs::File) -> io::Result<Device> {
        let control = fs::File::options()
            .read(true)
            .write(true)
            .open("/dev/loop-control")?;
        // Another process may take the device we were told is free before we configure it.
        for _ in 0..16 {
            // SAFETY: an ioctl without argument on the open control device.
            let n = check(unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) })?;
            let path = PathBuf::from(format!("/dev/loop{n}"));
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
                .map_err(io::Error::other)?;
            // SAFETY: open(2) of a NUL-terminated path; the descriptor is owned at once.
            let fd = check(unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) })
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            // SAFETY: the descriptor was just opened and is owned by nobody else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: all-zero is a valid value of these plain C structs.
            let mut config: LoopConfig = unsafe { std::mem::zeroed() };
            config.fd = file.as_raw_fd() as u32;
            config.info.flags = LO_FLAGS_AUTOCLEAR;
            // SAFETY: LOOP_CONFIGURE reads a `struct loop_config` we own.
            let rc = unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_CONFIGURE, &config) };
            if rc == 0 {
                return Ok(Device { path, _fd: fd });
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EBUSY) => continue,
                // before Linux 5.8: the two-step way
                Some(libc::EINVAL | libc::ENOTTY) => {
                    // SAFETY: LOOP_SET_FD takes a descriptor; LOOP_SET_STATUS64 reads a
                    // `struct loop_info64` we own.
                    if unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_SET_FD, file.as_raw_fd()) } < 0 {
                        if io::Error::last_os_error().raw_os_error() == Some(libc::EBUSY) {
                            continue;
                        }
                        return Err(io::Error::last_os_error());
                    }
                    // SAFETY: as above
                    if unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_SET_STATUS64, &config.info) } < 0 {
                        let e = io::Error::last_os_error();
                        // SAFETY: an ioctl without argument on the loop device we configured.
                        unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_CLR_FD) };
                        return Err(e);
                    }
                    return Ok(Device { path, _fd: fd });
                }
                _ => return Err(io::Error::last_os_error()),
            }
        }
        Err(io::Error::other("no free loop device could be taken"))
    }
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
    let on_path = warren_env::var_os(warren_env::EnvVars::PATH)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;

    #[test]
    #[ignore = "needs root: loop devices and mounts (scripts/test runs it as root)"]
    fn disks_are_sparse_copies_that_bound_their_writes_and_go_cleanly() {
        let data = tempfile::tempdir().expect("tempdir");
        let size = 64u64 << 20;
        // a half-made template of a server that died (no such pid) goes when one is made
        fs::create_dir(data.path().join(TEMPLATES_DIR)).expect("templates");
        let dead = data.path().join(TEMPLATES_DIR).join(".partial-4194305-0");
        fs::write(&dead, b"half").expect("partial");
        let dirs: Vec<PathBuf> = (0..3).map(|i| data.path().join(format!("s{i}"))).collect();
        for dir in &dirs {
            fs::create_dir(dir).expect("sandbox folder");
            make(data.path(), dir, size).expect("disk");
            assert!(is_mounted(dir));
            assert!(mount_point(dir).join("upper").is_dir());
        }
        // one template for the size; each disk a sparse copy of it
        let templates: Vec<_> = fs::read_dir(data.path().join(TEMPLATES_DIR))
            .expect("templates")
            .collect();
        assert_eq!(templates.len(), 1, "the template alone: {templates:?}");
        assert!(!dead.exists());
        let image = fs::metadata(dirs[0].join(IMAGE_FILE)).expect("image");
        assert_eq!(image.len(), size);
        assert!(
            image.blocks() * 512 < 4 << 20,
            "sparse: {} blocks",
            image.blocks()
        );
        // the disk's size bounds what is written on it
        let mut f = fs::File::create(mount_point(&dirs[0]).join("upper/big")).expect("file");
        let chunk = vec![7u8; 1 << 20];
        let mut written = 0u64;
        let err = loop {
            match f.write_all(&chunk) {
                Ok(()) => written += chunk.len() as u64,
                Err(e) => break e,
            }
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert!(written < size, "{written}");
        drop(f);
        let allocated = || {
            fs::metadata(dirs[0].join(IMAGE_FILE))
                .expect("image")
                .blocks()
                * 512
        };
        assert!(allocated() > size / 2, "the writes took room on the host");
        fs::remove_file(mount_point(&dirs[0]).join("upper/big")).expect("rm");
        assert!(
            allocated() < 4 << 20,
            "a delete gives the room back: {}",
            allocated()
        );
        // the others are not touched by it
        assert!(fs::read_dir(mount_point(&dirs[1]).join("upper"))
            .expect("upper")
            .next()
            .is_none());
        for dir in &dirs {
            remove(dir);
            assert!(!is_mounted(dir));
            assert!(!dir.join(IMAGE_FILE).exists() && !mount_point(dir).exists());
        }
    }
}
