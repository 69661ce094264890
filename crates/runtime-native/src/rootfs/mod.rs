//! Builds a sandbox's root filesystem inside its private mount namespace and pivots into it:
//! overlay (or the host view), a minimal `/dev`, fresh `/proc` with Docker's masked paths, read-only
//! `/sys` and cgroup view, execd and its socket folder under `/.warren`. Every mount lives only in the
//! sandbox's namespace, so nothing needs unmounting on the host when the sandbox ends.
//!
//! Why one file: one sequence of mounts, each step a function that the next relies on (the
//! overlay, `/proc`, `/dev`, `/sys`, `/.warren`, the pivot), sharing the mount helpers at its top;
//! ~130 of its lines are tests. The descriptor-based mount calls are `mount_api`.

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

pub(crate) mod mount_api;

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
