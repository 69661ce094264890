//! Paths from the files API, resolved so that `/proc`'s magic links are never followed.
//!
//! execd is the sandbox's PID 1 and acts, as root, for whoever holds the files API. A path that runs
//! through a magic link — `/proc/<pid>/exe`, `fd/N`, `cwd`, `root`, `map_files/*` — reaches the
//! object behind the link wherever it lives, not a file by that name: on the native runtime PID 1's
//! own executable is the host's `warren` binary, so a `chmod` of `/proc/1/exe` changed the host's
//! binary. Every path the API names is therefore resolved with `openat2(RESOLVE_NO_MAGICLINKS)` (a
//! magic link anywhere on the way is refused with `ELOOP`), and the operation then runs on what was
//! resolved, through execd's own descriptor (`/proc/self/fd/N`, a link execd made and trusts).
//!
//! Ordinary symbolic links are still followed where the operation would follow them: inside the
//! sandbox they lead only to what the sandbox's own root could reach anyway. Operations that do not
//! follow their last component (lstat, unlink, rename, rmdir) resolve only the parent folder this way.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// `RESOLVE_NO_MAGICLINKS` of `openat2(2)` (linux/openat2.h).
const RESOLVE_NO_MAGICLINKS: u64 = 0x02;

/// `struct open_how` of `openat2(2)`.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// What a refused magic link is reported as: an error of its own, so the client is told why (the
/// caller names the path).
fn magic_link_refused() -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        "refusing to follow a /proc magic link (or a symbolic link loop)",
    )
}

/// `openat2(AT_FDCWD, path, flags, mode, RESOLVE_NO_MAGICLINKS)`, close-on-exec.
fn openat2(path: &Path, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        // openat2 refuses a mode without O_CREAT/O_TMPFILE.
        mode: if flags & libc::O_CREAT != 0 {
            u64::from(mode)
        } else {
            0
        },
        resolve: RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: openat2(2) with a NUL-terminated path and a fully initialised open_how of the size
    // passed; the returned descriptor is owned here.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        let err = io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::EXDEV) => magic_link_refused(),
            Some(libc::ENOSYS) => return open_without_openat2(&c, flags, mode),
            _ => err,
        });
    }
    // SAFETY: a fresh descriptor returned by the kernel, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
    if is_own_proc_entry(&fd) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "execd's own /proc entries are not served",
        ));
    }
    Ok(fd)
}

/// Where the kernel has no `openat2` (gVisor's Sentry, Linux before 5.6): an ordinary open, refused
/// when it reached an object execd itself holds — its executable or one of its descriptors, the only
/// objects from outside that the sandbox's magic links could lead to.
fn open_without_openat2(
    path: &CString,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<OwnedFd> {
    // SAFETY: open(2) with a NUL-terminated path; the returned descriptor is owned here.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            flags | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor returned by the kernel, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if is_own_proc_entry(&fd) || held_by_execd(&fd) {
        return Err(magic_link_refused());
    }
    Ok(fd)
}

/// Whether the object `fd` refers to is execd's executable or one of execd's other descriptors.
fn held_by_execd(fd: &OwnedFd) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(this) = nix::sys::stat::fstat(fd.as_raw_fd()) else {
        return true;
    };
    let same = |m: std::fs::Metadata| m.dev() == this.st_dev && m.ino() == this.st_ino;
    if std::fs::metadata("/proc/self/exe").is_ok_and(same) {
        return true;
    }
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return true;
    };
    entries.flatten().any(|e| {
        e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) != Some(fd.as_raw_fd())
            && std::fs::metadata(e.path()).is_ok_and(same)
    })
}

/// Whether `fd` is in execd's own `/proc/<pid>` (or one of its threads'): its memory map, its
/// limits, its status. Sandbox processes cannot read them (PID 1 is not dumpable), so neither may
/// the API that execd serves; on the native runtime they name the host's binary.
fn is_own_proc_entry(fd: &OwnedFd) -> bool {
    // By the path the kernel gives the object (not by the file system's magic number, which
    // gVisor's /proc does not report as Linux's does).
    let Ok(target) = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) else {
        // Cannot tell what it is: refuse rather than serve it.
        return true;
    };
    let mut parts = target.components().skip(1);
    if parts.next() != Some(Component::Normal(OsStr::new("proc"))) {
        return false;
    }
    let Some(Component::Normal(first)) = parts.next() else {
        return false;
    };
    let Some(pid) = first.to_str().and_then(|s| s.parse::<u32>().ok()) else {
        // /proc/self and /proc/thread-self are magic links, refused before this; other names
        // (cpuinfo, meminfo, …) are the kernel's, not execd's.
        return false;
    };
    pid == std::process::id()
        || std::fs::read_dir("/proc/self/task").is_ok_and(|tasks| {
            tasks
                .flatten()
                .any(|t| t.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) == Some(pid))
        })
}

/// An object (or a folder and a name in it) resolved without magic links, held open by execd.
/// `path()` names it through execd's own descriptor, for the standard library's calls.
#[derive(Debug)]
pub struct Resolved {
    fd: OwnedFd,
    /// The last component, for an entry of the folder `fd`; empty for the object `fd` itself.
    name: OsString,
}

impl Resolved {
    /// A path that reaches exactly what was resolved (while `self` is alive).
    pub fn path(&self) -> PathBuf {
        let dir = PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()));
        if self.name.is_empty() {
            dir
        } else {
            dir.join(&self.name)
        }
    }
}

/// The object at `path`, following ordinary symbolic links but never a magic link (an `O_PATH`
/// handle: it opens nothing, so a FIFO or device is not touched).
pub fn follow(path: &Path) -> io::Result<Resolved> {
    Ok(Resolved {
        fd: openat2(path, libc::O_PATH, 0)?,
        name: OsString::new(),
    })
}

/// The folder holding `path`'s last component (resolved as [`follow`] does) and that component,
/// for operations that act on the entry itself rather than on where a link in it points.
pub fn entry(path: &Path) -> io::Result<Resolved> {
    let (parent, name) = split(path);
    let fd = openat2(parent, libc::O_PATH | libc::O_DIRECTORY, 0)?;
    Ok(Resolved {
        fd,
        // A path that names a folder itself (`/`, `x/..`) is that folder's `.`: the bare
        // `/proc/self/fd/N` would be lstat'ed as the link it is.
        name: if name.is_empty() {
            OsString::from(".")
        } else {
            name.to_os_string()
        },
    })
}

/// `path` split into its folder and last component; `/` and `.`-ending paths name the folder itself.
fn split(path: &Path) -> (&Path, &OsStr) {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => (
            if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            },
            name,
        ),
        _ => (path, OsStr::new("")),
    }
}

/// Opens `path` with `flags` (`O_CREAT` uses `mode`), never through a magic link.
pub fn open(path: &Path, flags: libc::c_int, mode: libc::mode_t) -> io::Result<File> {
    Ok(File::from(openat2(path, flags, mode)?))
}

/// `std::fs::metadata`, never through a magic link.
pub fn metadata(path: &Path) -> io::Result<std::fs::Metadata> {
    File::from(follow(path)?.fd).metadata()
}

/// `std::fs::symlink_metadata`: the entry itself, its folder resolved without magic links.
pub fn symlink_metadata(path: &Path) -> io::Result<std::fs::Metadata> {
    std::fs::symlink_metadata(entry(path)?.path())
}

/// Sets the permission bits of what `path` names.
pub fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let target = follow(path)?;
    std::fs::set_permissions(target.path(), std::fs::Permissions::from_mode(mode))
}

/// Changes the owner and/or group of what `path` names.
pub fn chown(path: &Path, uid: Option<u32>, gid: Option<u32>) -> io::Result<()> {
    let target = follow(path)?;
    std::os::unix::fs::chown(target.path(), uid, gid)
}

/// `mkdir -p`: each missing folder is made in its parent as resolved without magic links.
pub fn create_dir_all(path: &Path) -> io::Result<()> {
    // Most uploads go into a folder that is there already: one resolution then.
    if is_folder(path)? {
        return Ok(());
    }
    // Walk down from the root, making what is missing; a component that is `..` or `.` is left to
    // the kernel's resolution of the prefix.
    let mut prefix = PathBuf::new();
    for comp in path.components() {
        prefix.push(comp);
        if !matches!(comp, Component::Normal(_)) || is_folder(&prefix)? {
            continue;
        }
        match std::fs::create_dir(entry(&prefix)?.path()) {
            Ok(()) => {}
            // Made meanwhile by someone else: fine, as for `mkdir -p`.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `Ok(true)` for a folder, `Ok(false)` for nothing there, an error for anything else there.
fn is_folder(path: &Path) -> io::Result<bool> {
    match metadata(path) {
        Ok(m) if m.is_dir() => Ok(true),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a folder", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn magic_links_are_refused_ordinary_links_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        std::fs::write(&file, "data").expect("write");
        symlink(&file, dir.path().join("link")).expect("symlink");
        assert_eq!(
            metadata(&dir.path().join("link")).expect("follows").len(),
            4
        );
        assert!(symlink_metadata(&dir.path().join("link"))
            .expect("lstat")
            .file_type()
            .is_symlink());

        // Our own executable and descriptors, through /proc: refused wherever the link sits.
        let held = File::open(&file).expect("open");
        for p in [
            "/proc/self/exe".to_string(),
            format!("/proc/self/fd/{}", held.as_raw_fd()),
            "/proc/self/root/etc/hostname".to_string(),
            "/proc/self/cwd".to_string(),
        ] {
            let err = metadata(Path::new(&p)).expect_err(&p);
            assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{p}: {err}");
            assert!(err.to_string().contains("magic link"), "{err}");
            assert!(open(Path::new(&p), libc::O_RDONLY, 0).is_err(), "{p}");
            assert!(set_mode(Path::new(&p), 0o777).is_err(), "{p}");
        }
        // Our own /proc entries that are not links (the memory map, status) are refused too; other
        // processes' and the kernel's are served.
        let me = std::process::id();
        for p in [
            format!("/proc/{me}/maps"),
            format!("/proc/{me}/status"),
            format!("/proc/{me}"),
        ] {
            assert!(metadata(Path::new(&p)).is_err(), "{p}");
        }
        assert!(metadata(Path::new("/proc/cpuinfo")).is_ok());
        assert!(metadata(Path::new("/proc/1/status")).is_ok() || me == 1);
        // An ordinary link to a magic link is refused too.
        symlink("/proc/self/exe", dir.path().join("exe")).expect("symlink");
        assert!(metadata(&dir.path().join("exe")).is_err());
        // The entry itself (not what it points to) is still there to look at or remove, except in
        // execd's own /proc folder.
        assert!(symlink_metadata(Path::new("/proc/1/exe")).is_ok() || me == 1);
        assert!(symlink_metadata(Path::new("/proc/self/exe")).is_err());
        std::fs::remove_file(entry(&dir.path().join("exe")).expect("entry").path())
            .expect("unlink");
    }

    #[test]
    fn without_openat2_objects_execd_holds_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        std::fs::write(&file, "data").expect("write");
        let c = |p: &str| CString::new(p).expect("cstring");
        assert!(open_without_openat2(&c(file.to_str().expect("utf-8")), libc::O_RDONLY, 0).is_ok());
        let held = File::open(&file).expect("open");
        let via_fd = format!("/proc/self/fd/{}", held.as_raw_fd());
        assert!(open_without_openat2(&c(&via_fd), libc::O_RDONLY, 0).is_err());
        // The same file by its own name is one execd holds too: refused while it is held.
        assert!(
            open_without_openat2(&c(file.to_str().expect("utf-8")), libc::O_RDONLY, 0).is_err()
        );
        drop(held);
        assert!(open_without_openat2(&c("/proc/self/exe"), libc::O_PATH, 0).is_err());
    }

    #[test]
    fn create_dir_all_makes_what_is_missing_and_stops_at_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let deep = dir.path().join("a/b/c");
        create_dir_all(&deep).expect("mkdir -p");
        assert!(deep.is_dir());
        create_dir_all(&deep).expect("again");
        std::fs::write(dir.path().join("file"), "").expect("write");
        assert!(create_dir_all(&dir.path().join("file/x")).is_err());
        symlink(dir.path().join("a"), dir.path().join("via")).expect("symlink");
        create_dir_all(&dir.path().join("via/d")).expect("through an ordinary link");
        assert!(dir.path().join("a/d").is_dir());
        assert!(create_dir_all(Path::new("/proc/self/cwd/x")).is_err());
    }

    #[test]
    fn chmod_and_chown_act_on_the_resolved_object() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        std::fs::write(&file, "").expect("write");
        set_mode(&file, 0o640).expect("chmod");
        assert_eq!(
            std::fs::metadata(&file).expect("stat").permissions().mode() & 0o7777,
            0o640
        );
        let me = std::fs::metadata(&file).expect("stat").uid();
        chown(&file, Some(me), None).expect("chown to ourselves");
        assert_eq!(split(Path::new("/")), (Path::new("/"), OsStr::new("")));
        // The entry of a path that names a folder itself is that folder, not a link to it.
        for p in ["/", "/tmp/..", dir.path().to_str().expect("utf-8")] {
            let m = symlink_metadata(Path::new(p)).expect(p);
            assert!(m.is_dir() && !m.file_type().is_symlink(), "{p}");
        }
        assert_eq!(split(Path::new("x")), (Path::new("."), OsStr::new("x")));
    }
}
