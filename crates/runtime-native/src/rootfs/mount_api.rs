//! Linux's descriptor-based mount calls (5.2 on; `mount_setattr` 5.12 on), which libc does not wrap:
//! the attribute and bind calls are `warren_core::mount_api` (the Docker runtime stages volumes with
//! them too), here with nix's errors; making filesystems is the native runtime's alone.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub use warren_core::mount_api::MOUNT_ATTR_RDONLY;
use warren_core::mount_api::{
    MountAttr, MOUNT_ATTR_IDMAP, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID,
    MOVE_MOUNT_F_EMPTY_PATH, OPEN_TREE_CLONE,
};

/// The errno of a core mount call's error.
fn errno(e: std::io::Error) -> nix::errno::Errno {
    nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

/// The `MOUNT_ATTR_*` bits for a bind that is read-only or not, with `extra`'s nosuid, nodev
/// and noexec.
pub fn attrs(readonly: bool, extra: nix::mount::MsFlags) -> u64 {
    use nix::mount::MsFlags;
    [
        (readonly, MOUNT_ATTR_RDONLY),
        (extra.contains(MsFlags::MS_NOSUID), MOUNT_ATTR_NOSUID),
        (extra.contains(MsFlags::MS_NODEV), MOUNT_ATTR_NODEV),
        (extra.contains(MsFlags::MS_NOEXEC), MOUNT_ATTR_NOEXEC),
    ]
    .into_iter()
    .filter(|(on, _)| *on)
    .fold(0, |all, (_, bit)| all | bit)
}

fn check(rc: libc::c_long) -> nix::Result<libc::c_long> {
    if rc < 0 {
        Err(nix::errno::Errno::last())
    } else {
        Ok(rc)
    }
}

/// Clears `attrs` on the mount at `dfd`/`path`, and with `recursive` every mount below it.
pub fn clear(
    dfd: libc::c_int,
    path: &std::ffi::CStr,
    attrs: u64,
    recursive: bool,
) -> nix::Result<()> {
    let attr = MountAttr {
        attr_clr: attrs,
        ..MountAttr::default()
    };
    warren_core::mount_api::setattr(dfd, path, &attr, recursive).map_err(errno)
}

/// A new tmpfs, attached nowhere (its descriptor names its root).
pub fn tmpfs_detached(options: &[(&str, &str)]) -> nix::Result<OwnedFd> {
    // SAFETY: fsopen(2) with a NUL-terminated name; the result is owned here.
    let fs = check(unsafe { libc::syscall(libc::SYS_fsopen, c"tmpfs".as_ptr(), FSOPEN_CLOEXEC) })?;
    // SAFETY: a fresh descriptor, owned by nobody else.
    let fs = unsafe { OwnedFd::from_raw_fd(fs as libc::c_int) };
    for (key, value) in options {
        fsconfig(&fs, FSCONFIG_SET_STRING, Some(key), Some(value))?;
    }
    fsconfig(&fs, FSCONFIG_CMD_CREATE, None, None)?;
    mount_created(&fs)
}

/// Sets `attrs` on the mount at `dfd`/`path` and every mount below it.
pub fn set_recursive(dfd: libc::c_int, path: &std::ffi::CStr, attrs: u64) -> nix::Result<()> {
    let attr = MountAttr {
        attr_set: attrs,
        ..MountAttr::default()
    };
    warren_core::mount_api::setattr(dfd, path, &attr, true).map_err(errno)
}

/// Binds what `source` names (with the mounts below it) onto what `target` names, with `attrs`
/// on every mount of the copy, idmapped through `userns` where one is given: a detached copy is
/// made, set up, then attached in one step.
pub fn bind_handle(
    source: &OwnedFd,
    target: &OwnedFd,
    attrs: u64,
    userns: Option<&OwnedFd>,
) -> nix::Result<()> {
    let attr = MountAttr {
        attr_set: attrs | userns.map_or(0, |_| MOUNT_ATTR_IDMAP),
        userns_fd: userns.map_or(0, |ns| ns.as_raw_fd() as u64),
        ..MountAttr::default()
    };
    warren_core::mount_api::bind_handle(source, target, &attr).map_err(errno)
}

const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;

fn fsconfig(
    fs: &OwnedFd,
    cmd: libc::c_uint,
    key: Option<&str>,
    value: Option<&str>,
) -> nix::Result<()> {
    let c = |s: &str| std::ffi::CString::new(s).map_err(|_| nix::errno::Errno::EINVAL);
    let key = key.map(c).transpose()?;
    let value = value.map(c).transpose()?;
    let ptr = |s: &Option<std::ffi::CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: fsconfig(2) on a filesystem context we own, with NUL-terminated strings or nulls.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            cmd,
            ptr(&key),
            ptr(&value),
            0,
        )
    })
    .map(drop)
}

/// Mounts an overlay at `target` one option at a time (`lowerdir+`, Linux 6.8 on), for layer
/// lists that do not fit the single page `mount(2)` copies of its options. `volatile` where
/// the kernel has it.
pub fn overlay(
    lowers: &[std::path::PathBuf],
    upper: &std::path::Path,
    work: &std::path::Path,
    target: &std::path::Path,
) -> nix::Result<()> {
    attach(&overlay_detached(lowers, upper, work)?, target)
}

/// The overlay [`overlay`] mounts, made but not attached anywhere: a descriptor that
/// [`attach`] puts in place, in whichever mount namespace its caller is in.
pub fn overlay_detached(
    lowers: &[std::path::PathBuf],
    upper: &std::path::Path,
    work: &std::path::Path,
) -> nix::Result<OwnedFd> {
    mount_created(&created_overlay(lowers, upper, work).map_err(|(e, _)| e)?)
}

/// [`overlay_detached`] with the lower layers given one by one (`lowerdir+`) or `joined` into
/// one `lowerdir`, topmost first: both ways are tested where the kernel has both.
#[cfg(test)]
pub(super) fn overlay_with(
    lowers: &[std::path::PathBuf],
    upper: &std::path::Path,
    work: &std::path::Path,
    joined: bool,
) -> nix::Result<OwnedFd> {
    mount_created(&created(lowers, upper, work, joined).map_err(|(e, _)| e)?)
}

/// Whether the kernel makes the overlay [`overlay_detached`] would (and mounts it nowhere);
/// if not, its errno and whatever overlayfs wrote into the file system context's log (its `e`
/// and `w` lines; most of its reasons, such as an upper folder on overlayfs, go only to the
/// kernel log, and then this is empty). `Ok` too where the kernel has no `fsopen(2)` (before
/// 5.2): nothing can be asked then.
pub fn probe_overlay(
    lowers: &[std::path::PathBuf],
    upper: &std::path::Path,
    work: &std::path::Path,
) -> Result<(), (nix::errno::Errno, String)> {
    match created_overlay(lowers, upper, work) {
        Ok(_) | Err((nix::errno::Errno::ENOSYS, _)) => Ok(()),
        Err(refused) => Err(refused),
    }
}

/// The overlay's file system context, created: its lower layers one by one, or joined where
/// the kernel refuses that. On failure, the errno and what the context logged.
fn created_overlay(
    lowers: &[std::path::PathBuf],
    upper: &std::path::Path,
    work: &std::path::Path,
) -> Result<OwnedFd, (nix::errno::Errno, String)> {
    match created(lowers, upper, work, false) {
        // Before Linux 6.8 overlayfs knows no `lowerdir+` (older kernels refuse it when the
        // mount is created): the whole list as one `lowerdir`, which fsconfig(2) takes up to
        // 255 bytes of (a longer one is refused too, EINVAL).
        Err((nix::errno::Errno::EINVAL, _)) => created(lowers, upper, work, true),
        other => other,
    }
}

/// [`created_overlay`] for one way of giving the lower layers.
fn created(
    lowers: &[std::path::PathBuf],
    upper: &std::path::Path,
    work: &std::path::Path,
    joined: bool,
) -> Result<OwnedFd, (nix::errno::Errno, String)> {
    let fs = overlay_context(lowers, upper, work, joined).map_err(|e| (e, String::new()))?;
    fsconfig(&fs, FSCONFIG_CMD_CREATE, None, None).map_err(|e| (e, context_log(&fs)))?;
    Ok(fs)
}

/// The mount of a created file system context, attached nowhere.
fn mount_created(fs: &OwnedFd) -> nix::Result<OwnedFd> {
    // SAFETY: fsmount(2) on a created context we own; the result is owned here.
    let mnt = check(unsafe {
        libc::syscall(
            libc::SYS_fsmount,
            fs.as_raw_fd(),
            FSMOUNT_CLOEXEC,
            MOUNT_ATTR_NODEV,
        )
    })?;
    // SAFETY: a fresh descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(mnt as libc::c_int) })
}

/// The messages a file system context holds (one per read(2), `e `, `w ` or `i ` first),
/// joined with "; ".
fn context_log(fs: &OwnedFd) -> String {
    let mut lines = Vec::new();
    let mut buf = [0u8; 512];
    // A context keeps at most 8 messages; the bound stops a kernel that kept answering.
    for _ in 0..16 {
        // SAFETY: read(2) into a buffer we own, of the length passed.
        let n = unsafe { libc::read(fs.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        let Ok(n) = usize::try_from(n) else { break };
        if n == 0 {
            break;
        }
        lines.push(String::from_utf8_lossy(&buf[..n]).trim().to_string());
    }
    lines.join("; ")
}

/// An overlay's file system context with its options set, not yet created.
fn overlay_context(
    lowers: &[std::path::PathBuf],
    upper: &std::path::Path,
    work: &std::path::Path,
    joined: bool,
) -> nix::Result<OwnedFd> {
    // SAFETY: fsopen(2) with a NUL-terminated name; the result is owned here.
    let fs =
        check(unsafe { libc::syscall(libc::SYS_fsopen, c"overlay".as_ptr(), FSOPEN_CLOEXEC) })?;
    // SAFETY: a fresh descriptor, owned by nobody else.
    let fs = unsafe { OwnedFd::from_raw_fd(fs as libc::c_int) };
    let path = |p: &std::path::Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or(nix::errno::Errno::EINVAL)
    };
    // What mount(2) would have shown as the source (`findmnt`, `df`), instead of "none".
    fsconfig(&fs, FSCONFIG_SET_STRING, Some("source"), Some("overlay"))?;
    if joined {
        let list = lowers
            .iter()
            .map(|l| path(l))
            .collect::<nix::Result<Vec<_>>>()?;
        fsconfig(
            &fs,
            FSCONFIG_SET_STRING,
            Some("lowerdir"),
            Some(&list.join(":")),
        )?;
    } else {
        for lower in lowers {
            fsconfig(
                &fs,
                FSCONFIG_SET_STRING,
                Some("lowerdir+"),
                Some(&path(lower)?),
            )?;
        }
    }
    fsconfig(
        &fs,
        FSCONFIG_SET_STRING,
        Some("upperdir"),
        Some(&path(upper)?),
    )?;
    fsconfig(
        &fs,
        FSCONFIG_SET_STRING,
        Some("workdir"),
        Some(&path(work)?),
    )?;
    match fsconfig(&fs, FSCONFIG_SET_FLAG, Some("volatile"), None) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) => {}
        Err(e) => return Err(e),
    }
    Ok(fs)
}

/// Attaches a detached mount (`fsmount(2)`'s descriptor) at `target`.
/// A detached copy of the folder `path` whose owners read through user namespace `userns`:
/// on-disk id N shows as the host id that N is inside the namespace.
pub fn idmapped(path: &std::path::Path, userns: &OwnedFd) -> nix::Result<OwnedFd> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| nix::errno::Errno::EINVAL)?;
    // SAFETY: open_tree(2) with a NUL-terminated path; the result is owned here.
    let tree = check(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    })?;
    // SAFETY: a fresh descriptor, owned by nobody else.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as libc::c_int) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    warren_core::mount_api::setattr(tree.as_raw_fd(), c"", &attr, false).map_err(errno)?;
    Ok(tree)
}

pub fn attach(mnt: &OwnedFd, target: &std::path::Path) -> nix::Result<()> {
    let target = std::ffi::CString::new(target.as_os_str().as_encoded_bytes())
        .map_err(|_| nix::errno::Errno::EINVAL)?;
    // SAFETY: move_mount(2) from a descriptor we own to a NUL-terminated path.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mnt.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })
    .map(drop)
}
