//! Builds a sandbox's root filesystem inside its private mount namespace and pivots into it:
//! overlay (or the host view), a minimal `/dev`, fresh `/proc` with Docker's masked paths, read-only
//! `/sys` and cgroup view, execd and its socket folder under `/.warren`. Every mount lives only in the
//! sandbox's namespace, so nothing needs unmounting on the host when the sandbox ends.

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};

use crate::spec::{InitSpec, RootSource, WARREN_DIR};
use warren_core::policy;

#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("mount {what} at {target}")]
    Mount {
        what: String,
        target: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("preparing {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("pivot_root into {0}")]
    Pivot(PathBuf, #[source] nix::Error),
}

pub(crate) type Result<T> = std::result::Result<T, RootfsError>;

pub(crate) fn mnt(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<()> {
    mount(src, target, fstype, flags, data).map_err(|source| RootfsError::Mount {
        what: fstype.or(src).unwrap_or("bind").to_string(),
        target: target.to_path_buf(),
        source,
    })
}

pub(crate) fn bind(src: &Path, target: &Path, readonly: bool, extra: MsFlags) -> Result<()> {
    mount(
        Some(src),
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|source| RootfsError::Mount {
        what: format!("bind {}", src.display()),
        target: target.to_path_buf(),
        source,
    })?;
    if readonly || !extra.is_empty() {
        // On every mount of the bind, not just its top: a remount would leave a mount below the
        // source (a host's separate /usr/local, say) writable inside the sandbox.
        let attrs = mount_api::attrs(readonly, extra);
        let path = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| {
            RootfsError::Io {
                path: target.to_path_buf(),
                source: io::Error::other("holds a NUL byte"),
            }
        })?;
        match mount_api::set_recursive(libc::AT_FDCWD, &path, attrs) {
            // Before Linux 5.12: the top mount only.
            Err(nix::errno::Errno::ENOSYS) => {
                let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | extra;
                if readonly {
                    flags |= MsFlags::MS_RDONLY;
                }
                mnt(None, target, None, flags, None)?;
            }
            other => other.map_err(|source| RootfsError::Mount {
                what: format!("attributes of bind {}", src.display()),
                target: target.to_path_buf(),
                source,
            })?,
        }
    }
    Ok(())
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> RootfsError + '_ {
    move |source| RootfsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn mkdir(path: &Path) -> Result<()> {
    fs::create_dir_all(path).map_err(io_at(path))
}

/// Runs `mount` onto `target`, making the mount point first only when the mount finds it missing.
/// The image or Warren's skeleton layer nearly always has it, and a mkdir that finds the folder
/// there plus the stat that confirms it, through a fresh overlay (whose first lookup of a name goes
/// down every layer), cost ~1 % of the machine's CPU with sandboxes made back to back.
fn onto(target: &Path, mount: impl Fn() -> Result<()>) -> Result<()> {
    match mount() {
        Err(RootfsError::Mount {
            source: nix::errno::Errno::ENOENT,
            ..
        }) => {
            mkdir(target)?;
            mount()
        }
        other => other,
    }
}

/// A mount over a /proc or /sys entry this kernel may lack: skipped when the mount finds nothing
/// there (ENOENT), as an `exists()` beforehand skipped it, without the stat. Any other failure
/// (a masked file that turned out to be a folder, say) still fails the sandbox.
fn unless_absent(mounted: Result<()>) -> Result<()> {
    match mounted {
        Err(RootfsError::Mount {
            source: nix::errno::Errno::ENOENT,
            ..
        }) => Ok(()),
        other => other,
    }
}

/// The same for a tmpfs laid over a folder, which an `is_dir()` beforehand also skipped when the
/// entry was something else: that mount's ENOTDIR is skipped too.
fn unless_not_a_folder(mounted: Result<()>) -> Result<()> {
    match mounted {
        Err(RootfsError::Mount {
            source: nix::errno::Errno::ENOTDIR,
            ..
        }) => Ok(()),
        other => unless_absent(other),
    }
}

/// Strips the leading `/` so a host path can be joined under the new root.
fn inside(root: &Path, abs: &Path) -> PathBuf {
    root.join(abs.strip_prefix("/").unwrap_or(abs))
}

/// The overlay's lower layers as the mount takes them: the layer folders, or with a user namespace
/// idmapped copies of them, named `/proc/self/fd/N` — the descriptors returned with them must stay
/// open until the overlay is made.
pub(crate) fn lowers(
    layers: &[PathBuf],
    userns: Option<&OwnedFd>,
) -> nix::Result<(Vec<PathBuf>, Vec<OwnedFd>)> {
    let Some(ns) = userns else {
        return Ok((layers.to_vec(), Vec::new()));
    };
    let held = layers
        .iter()
        .map(|l| mount_api::idmapped(l, ns))
        .collect::<nix::Result<Vec<_>>>()?;
    let paths = held.iter().map(fd_path).collect();
    Ok((paths, held))
}

/// The path a mount call takes for what descriptor `fd` of this process names (a detached mount,
/// say): valid while `fd` is open.
pub(crate) fn fd_path(fd: impl std::os::fd::AsFd) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd()))
}

/// Builds the sandbox's root and moves into it. `premade` is its overlay when the server made it
/// (see `premade_root` in the crate root); otherwise it is mounted here.
///
/// With user namespaces (`userns`, the namespace PID 1 joins last) the layers are idmapped through
/// it, the sandbox's own mounts (`/dev`, its pty group) and the folders made here belong to its
/// range, and each volume is idmapped through its namespace in `volume_ns`
/// (`userns::volume_namespaces`).
pub fn build(
    spec: &InitSpec,
    premade: Option<&OwnedFd>,
    userns: Option<&OwnedFd>,
    volume_ns: &[OwnedFd],
) -> Result<()> {
    // Nothing we mount may propagate back to the host.
    mnt(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )?;
    let root = spec.rootfs_dir.as_path();
    mount_root(spec, root, premade, userns)?;
    // /dev first: /proc's masked files are the sandbox's own /dev/null bound over them.
    mount_dev(root, spec.userns)?;
    mount_proc(root)?;
    mount_sys(spec, root)?;
    mount_warren(root)?;
    for dir in ["tmp", "workspace"] {
        let d = root.join(dir);
        if d.symlink_metadata().is_err() {
            mkdir(&d)?;
            if dir == "tmp" {
                fs::set_permissions(&d, fs::Permissions::from_mode(0o1777)).map_err(io_at(&d))?;
            }
            if let Some(range) = spec.userns {
                std::os::unix::fs::chown(&d, Some(range.base), Some(range.base))
                    .map_err(io_at(&d))?;
            }
        }
    }
    // after /tmp exists with its own mode: a volume under it must not create it 0755
    mount_volumes(spec, root, volume_ns)?;
    pivot(root)
}

/// Volumes go over the image's folders. Both ends are opened without following links and mounted
/// handle to handle: a volume's contents are sandboxes' (a link or a folder swapped for one while
/// this runs must not aim the mount at, or make a mount point in, a host folder), and so may be the
/// folders on the way to a mount point (a volume nested in another, or links in the image).
///
/// `namespaces`: for a sandbox in a user namespace, each volume's idmapping, in order (see
/// `userns::volume_map`); empty otherwise.
pub(crate) fn mount_volumes(spec: &InitSpec, root: &Path, namespaces: &[OwnedFd]) -> Result<()> {
    if spec.userns.is_some() && namespaces.len() != spec.volumes.len() {
        // Never a volume mounted as it is on disk in a sandbox whose ids are not the host's.
        return Err(RootfsError::Io {
            path: root.to_path_buf(),
            source: io::Error::other("a volume's idmapping is missing"),
        });
    }
    for (i, v) in spec.volumes.iter().enumerate() {
        let userns = namespaces.get(i);
        let source = v.open_source().map_err(io_at(&v.source))?;
        let rel = Path::new(v.target.trim_start_matches('/'));
        let target = if rel.as_os_str().is_empty() {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a volume cannot cover the root",
            ))
        } else if source.is_dir {
            warren_core::beneath::open_beneath(root, rel, true).and_then(|t| {
                if t.is_dir {
                    Ok(t)
                } else {
                    Err(io::Error::other("is a file; the volume is a folder"))
                }
            })
        } else {
            warren_core::beneath::make_file_beneath(root, rel)
        }
        .map_err(io_at(Path::new(&v.target)))?;
        let attrs = mount_api::attrs(v.read_only, MsFlags::MS_NOSUID | MsFlags::MS_NODEV);
        mount_api::bind_handle(&source.fd, &target.fd, attrs, userns).map_err(|source| {
            RootfsError::Mount {
                what: if source == nix::errno::Errno::ENOSYS {
                    format!(
                        "bind {} (volumes need Linux 5.12 or later)",
                        v.source.display()
                    )
                } else {
                    format!("bind {}", v.source.display())
                },
                target: PathBuf::from(&v.target),
                source,
            }
        })?;
    }
    Ok(())
}

/// What `mount(2)` reads of its options: one page, the last byte of it a NUL.
const MOUNT_OPTIONS_MAX: usize = 4095;

/// Linux's descriptor-based mount calls (5.2 on; `mount_setattr` 5.12 on), which libc does not wrap:
/// the attribute and bind calls are `warren_core::mount_api` (the Docker runtime stages volumes with
/// them too), here with nix's errors; making filesystems is the native runtime's alone.
pub(crate) mod mount_api {
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
        let fs =
            check(unsafe { libc::syscall(libc::SYS_fsopen, c"tmpfs".as_ptr(), FSOPEN_CLOEXEC) })?;
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
        let ptr =
            |s: &Option<std::ffi::CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
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
}

/// Mounts the sandbox's overlay root at `target`, `volatile` where the kernel has it (5.10 on;
/// older ones answer EINVAL and get a plain overlay). A sandbox's writable layer never outlives the
/// host's uptime, so syncing it to disk buys nothing; without `volatile`, overlay's unmount syncs
/// the whole filesystem under the upper layer (all of it, not just this sandbox's files) once per
/// sandbox, and every `fsync` inside the sandbox goes to disk. Volumes are bind mounts and keep
/// their syncs. Used by the embedded runtime and for OCI runtimes' bundles alike.
///
/// `mount(2)` copies at most one page of options, so with many layers (over ~40 with the store's
/// paths: a deep image, or a long chain of snapshots of snapshots) the list would be cut short;
/// those overlays are built one option at a time instead.
pub(crate) fn mount_overlay(spec: &InitSpec, target: &Path, lowers: &[PathBuf]) -> nix::Result<()> {
    let plain = spec.overlay_options(lowers);
    if plain.len() + ",volatile".len() >= MOUNT_OPTIONS_MAX {
        return mount_api::overlay(lowers, &spec.upper_dir, &spec.work_dir, target);
    }
    let overlay = |data: &str| {
        mount(
            Some("overlay"),
            target,
            Some("overlay"),
            MsFlags::MS_NODEV,
            Some(data),
        )
    };
    match overlay(&format!("{plain},volatile")) {
        Err(nix::errno::Errno::EINVAL) => overlay(&plain),
        other => other,
    }
}

fn mount_root(
    spec: &InitSpec,
    root: &Path,
    premade: Option<&OwnedFd>,
    userns: Option<&OwnedFd>,
) -> Result<()> {
    match premade {
        Some(mnt) => mount_api::attach(mnt, root),
        None => lowers(&spec.lower_dirs(), userns)
            .and_then(|(lowers, _held)| mount_overlay(spec, root, &lowers)),
    }
    .map_err(|source| RootfsError::Mount {
        what: "overlay".to_string(),
        target: root.to_path_buf(),
        source,
    })?;

    if let RootSource::Host {
        binds,
        masked_files,
        masked_dirs,
        ..
    } = &spec.root
    {
        for host_dir in binds {
            let target = inside(root, host_dir);
            onto(&target, || {
                bind(
                    host_dir,
                    &target,
                    true,
                    MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                )
            })?;
        }
        for file in masked_files {
            let target = inside(root, file);
            if target.exists() {
                bind(Path::new("/dev/null"), &target, true, MsFlags::empty())?;
            }
        }
        for dir in masked_dirs {
            let target = inside(root, dir);
            if target.is_dir() {
                mnt(
                    Some("tmpfs"),
                    &target,
                    Some("tmpfs"),
                    MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                    Some("size=4k,mode=700"),
                )?;
            }
        }
    }
    Ok(())
}

pub(crate) fn mount_proc(root: &Path) -> Result<()> {
    let proc_dir = root.join("proc");
    onto(&proc_dir, || {
        mnt(
            Some("proc"),
            &proc_dir,
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None,
        )
    })?;
    // The masked and read-only /proc paths of `warren_core::policy` (Docker's and a few more).
    // Masked files get the sandbox's own /dev/null (a node on its /dev tmpfs) bound over them, as
    // runc does: no read-only remount is needed, since writes go to /dev/null and a chmod or chown
    // through them changes only that node — never the host's /dev/null, which is why a bind of
    // that one had to be remounted read-only.
    let null = root.join("dev/null");
    let in_proc = |paths: &'static [&'static str]| {
        paths
            .iter()
            .filter_map(|p| p.strip_prefix("/proc/"))
            .map(|p| proc_dir.join(p))
    };
    for p in in_proc(policy::MASKED_FILES) {
        unless_absent(bind(&null, &p, false, MsFlags::empty()))?;
    }
    for p in in_proc(policy::MASKED_DIRS) {
        unless_not_a_folder(mnt(
            Some("tmpfs"),
            &p,
            Some("tmpfs"),
            MsFlags::MS_RDONLY,
            Some("size=0"),
        ))?;
    }
    for p in in_proc(policy::READONLY_PATHS) {
        unless_absent(bind(
            &p,
            &p,
            true,
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        ))?;
    }
    Ok(())
}

fn mount_dev(root: &Path, range: Option<crate::userns::IdRange>) -> Result<()> {
    // With a user namespace, the sandbox's root owns its /dev and /dev/shm and the pty group is its
    // `tty` (5); the nodes themselves stay root's, which is nobody inside (their 0666 mode is what
    // lets the sandbox use them).
    let owner = range.map_or(String::new(), |r| format!(",uid={},gid={}", r.base, r.base));
    let tty = range.map_or(5, |r| r.host(5));
    let dev = root.join("dev");
    let dev_options = format!("mode=755,size=65536k{owner}");
    onto(&dev, || {
        mnt(
            Some("tmpfs"),
            &dev,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME,
            Some(&dev_options),
        )
    })?;
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ] {
        let p = dev.join(name);
        mknod(
            &p,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(major, minor),
        )
        .map_err(|e| RootfsError::Io {
            path: p.clone(),
            source: io::Error::from(e),
        })?;
        fs::set_permissions(&p, fs::Permissions::from_mode(0o666)).map_err(io_at(&p))?;
    }
    let pts = dev.join("pts");
    mkdir(&pts)?;
    mnt(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(&format!("newinstance,ptmxmode=0666,mode=0620,gid={tty}")),
    )?;
    let shm = dev.join("shm");
    mkdir(&shm)?;
    mnt(
        Some("shm"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(&format!("mode=1777,size=65536k{owner}")),
    )?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let p = dev.join(link);
        symlink(target, &p).map_err(io_at(&p))?;
    }
    Ok(())
}

fn mount_sys(spec: &InitSpec, root: &Path) -> Result<()> {
    let sys = root.join("sys");
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    onto(&sys, || {
        mnt(Some("sysfs"), &sys, Some("sysfs"), flags, None)
    })?;
    for dir in policy::MASKED_DIRS
        .iter()
        .filter_map(|p| p.strip_prefix("/sys/"))
    {
        unless_not_a_folder(mnt(
            Some("tmpfs"),
            &sys.join(dir),
            Some("tmpfs"),
            MsFlags::MS_RDONLY,
            Some("size=0"),
        ))?;
    }
    // The sandbox sees its own cgroup as the root (cgroup namespace), read-only: execd reads its
    // metrics there.
    let cg = sys.join("fs/cgroup");
    if spec.cgroup_v2 {
        mnt(Some("cgroup2"), &cg, Some("cgroup2"), flags, None)?;
    } else if !spec.cgroup_v1_mounts.is_empty() {
        mnt(
            Some("tmpfs"),
            &cg,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("mode=755,size=64k"),
        )?;
        for opts in &spec.cgroup_v1_mounts {
            let joined = opts.join(",");
            let dir = cg.join(&joined);
            mkdir(&dir)?;
            mnt(Some("cgroup"), &dir, Some("cgroup"), flags, Some(&joined))?;
            for o in opts.iter().filter(|o| **o != joined) {
                let _ = symlink(&joined, cg.join(o));
            }
        }
        mnt(
            None,
            &cg,
            None,
            MsFlags::MS_REMOUNT | flags,
            Some("mode=755,size=64k"),
        )?;
    }
    Ok(())
}

fn mount_warren(root: &Path) -> Result<()> {
    let dir = root.join(WARREN_DIR);
    onto(&dir, || {
        mnt(
            Some("tmpfs"),
            &dir,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=755,size=64k"),
        )
    })?;
    // No execd binary in here: the embedded runtime's PID 1 runs execd without exec'ing it (see
    // `init::prepare_execd`); OCI runtimes and Docker bind it themselves. No socket folder either:
    // execd's socket is bound outside the sandbox and handed over (see `init::run`).
    mnt(
        None,
        &dir,
        None,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=755,size=64k"),
    )?;
    Ok(())
}

fn pivot(root: &Path) -> Result<()> {
    std::env::set_current_dir(root).map_err(io_at(root))?;
    // pivot_root(".", ".") stacks the old root on top of the new one; detaching it leaves only the new.
    nix::unistd::pivot_root(".", ".").map_err(|e| RootfsError::Pivot(root.to_path_buf(), e))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| RootfsError::Pivot(root.to_path_buf(), e))?;
    std::env::set_current_dir("/").map_err(io_at(Path::new("/")))?;
    Ok(())
}

/// Brings up `lo` in the fresh network namespace (the only interface a sandbox has for now).
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: plain socket/ioctl calls on a struct we own; the fd is closed before returning.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo\0".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        let mut rc = libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req);
        if rc == 0 {
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            rc = libc::ioctl(fd, libc::SIOCSIFFLAGS, &req);
        }
        let err = io::Error::last_os_error();
        libc::close(fd);
        if rc != 0 {
            return Err(err);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_overlay_is_made_detached_with_its_lower_layers_one_by_one_or_joined() {
        use std::os::fd::AsRawFd;
        for joined in [false, true] {
            let t = tempfile::tempdir().expect("tempdir");
            let dir = |name: &str| {
                let d = t.path().join(name);
                fs::create_dir(&d).expect("mkdir");
                d
            };
            let (top, bottom, upper, work) = (dir("top"), dir("bottom"), dir("upper"), dir("work"));
            fs::write(top.join("a"), "top").expect("write");
            fs::write(bottom.join("a"), "bottom").expect("write");
            fs::write(bottom.join("b"), "bottom").expect("write");
            let mnt = match mount_api::overlay_with(&[top, bottom], &upper, &work, joined) {
                Ok(mnt) => mnt,
                // not root, or no overlayfs here: nothing to check
                Err(nix::errno::Errno::EPERM | nix::errno::Errno::ENODEV) => return,
                Err(e) => panic!("joined {joined}: {e}"),
            };
            // Used through its descriptor, attached nowhere: the topmost layer wins, writes go up.
            let open = |name: &str, flags: libc::c_int| {
                let name = std::ffi::CString::new(name).expect("name");
                // SAFETY: openat(2) relative to a descriptor we own, with a NUL-terminated name.
                let fd = unsafe { libc::openat(mnt.as_raw_fd(), name.as_ptr(), flags, 0o644) };
                assert!(fd >= 0, "joined {joined}: {}", io::Error::last_os_error());
                // SAFETY: a fresh descriptor, owned by nobody else.
                fs::File::from(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
            };
            let read = |name: &str| {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut open(name, libc::O_RDONLY), &mut s)
                    .expect("read");
                s
            };
            assert_eq!(
                (read("a"), read("b")),
                ("top".into(), "bottom".into()),
                "joined {joined}"
            );
            drop(open("c", libc::O_CREAT | libc::O_WRONLY));
            assert!(upper.join("c").exists(), "joined {joined}");
        }
    }

    #[test]
    fn bind_attributes_follow_the_flags_asked_for() {
        assert_eq!(mount_api::attrs(false, MsFlags::empty()), 0);
        assert_eq!(
            mount_api::attrs(true, MsFlags::MS_NOSUID | MsFlags::MS_NODEV),
            0x1 | 0x2 | 0x4
        );
        assert_eq!(
            mount_api::attrs(
                false,
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC
            ),
            0x2 | 0x4 | 0x8
        );
    }
    use super::*;
    use std::cell::Cell;

    fn missing(target: &Path) -> RootfsError {
        RootfsError::Mount {
            what: "test".into(),
            target: target.to_path_buf(),
            source: nix::errno::Errno::ENOENT,
        }
    }

    #[test]
    fn a_mount_point_is_made_only_when_the_mount_finds_it_missing() {
        let t = tempfile::tempdir().expect("tempdir");
        let target = t.path().join("a/b");
        let tries = Cell::new(0);
        onto(&target, || {
            tries.set(tries.get() + 1);
            if target.is_dir() {
                Ok(())
            } else {
                Err(missing(&target))
            }
        })
        .expect("mounted after mkdir");
        assert_eq!(tries.get(), 2);
        assert!(target.is_dir());
        // There already: one try, nothing made.
        tries.set(0);
        onto(&target, || {
            tries.set(tries.get() + 1);
            Ok(())
        })
        .expect("mounted");
        assert_eq!(tries.get(), 1);
        // Other errors pass through untouched.
        let err = onto(&target, || {
            Err(RootfsError::Mount {
                what: "test".into(),
                target: target.clone(),
                source: nix::errno::Errno::EPERM,
            })
        });
        assert!(matches!(
            err,
            Err(RootfsError::Mount {
                source: nix::errno::Errno::EPERM,
                ..
            })
        ));
    }

    #[test]
    fn absent_mask_targets_are_skipped_and_other_failures_are_not() {
        let p = Path::new("/proc/nothing-here");
        let failed = |errno| {
            Err(RootfsError::Mount {
                what: "test".into(),
                target: p.to_path_buf(),
                source: errno,
            })
        };
        assert!(unless_absent(Err(missing(p))).is_ok());
        assert!(unless_not_a_folder(Err(missing(p))).is_ok());
        // A tmpfs over something that is not a folder is skipped, as is_dir() skipped it; a file
        // mask over a folder is not (exists() did not skip that either).
        assert!(unless_not_a_folder(failed(nix::errno::Errno::ENOTDIR)).is_ok());
        assert!(unless_absent(failed(nix::errno::Errno::ENOTDIR)).is_err());
        assert!(unless_absent(failed(nix::errno::Errno::EPERM)).is_err());
        assert!(unless_not_a_folder(failed(nix::errno::Errno::EPERM)).is_err());
    }
}
