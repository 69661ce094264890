//! Linux's descriptor-based mount calls (`open_tree`, `move_mount`: 5.2 on; `mount_setattr`: 5.12
//! on), which libc does not wrap: what both the native runtime (volumes into a sandbox's root) and
//! the Docker runtime (volumes staged for the daemon) need to mount exactly the folder a handle
//! names, handle to handle, never by a path that could be changed between the check and the mount.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
pub const MOUNT_ATTR_NOEXEC: u64 = 0x8;
pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
pub const OPEN_TREE_CLONE: libc::c_uint = 1;
pub const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
pub const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
#[derive(Debug, Default)]
pub struct MountAttr {
    pub attr_set: u64,
    pub attr_clr: u64,
    /// `MS_PRIVATE`, `MS_SLAVE`, … or 0 to leave it.
    pub propagation: u64,
    pub userns_fd: u64,
}

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// mount_setattr(2) of `attr` on the mount at `dfd`/`path` (`dfd` itself when `path` is empty),
/// and with `recursive` every mount below it.
pub fn setattr(dfd: libc::c_int, path: &CStr, attr: &MountAttr, recursive: bool) -> io::Result<()> {
    let flags = if recursive { libc::AT_RECURSIVE } else { 0 }
        | if path.is_empty() {
            libc::AT_EMPTY_PATH
        } else {
            0
        };
    // SAFETY: mount_setattr(2) with a valid descriptor, a NUL-terminated path and a struct of the
    // size passed.
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dfd,
            path.as_ptr(),
            flags as libc::c_uint,
            attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })
    .map(drop)
}

/// Binds what `source` names (with the mounts below it) onto what `target` names, with `attr` set
/// on every mount of the copy: a detached copy is made, set up, then attached in one step, so the
/// copy is never reachable without its attributes.
pub fn bind_handle(source: &OwnedFd, target: &OwnedFd, attr: &MountAttr) -> io::Result<()> {
    // SAFETY: open_tree(2) on a descriptor we own, with an empty path; the result is owned here.
    let tree = check(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            source.as_raw_fd(),
            c"".as_ptr(),
            OPEN_TREE_CLONE
                | libc::O_CLOEXEC as libc::c_uint
                | libc::AT_EMPTY_PATH as libc::c_uint
                | libc::AT_RECURSIVE as libc::c_uint,
        )
    })?;
    // SAFETY: a fresh descriptor, owned by nobody else.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as libc::c_int) };
    setattr(tree.as_raw_fd(), c"", attr, true)?;
    // SAFETY: move_mount(2) between two descriptors we own, with empty paths.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            target.as_raw_fd(),
            c"".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    })
    .map(drop)
}
