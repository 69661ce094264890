//! Opening a path inside a folder that sandboxes can write to, without being led out of it.
//!
//! A sandbox that has a folder mounted (a named volume, an allowed host folder) can put symbolic
//! links in it, or swap a folder for one while the server is looking. Anything the server (root on
//! the host) then does by path there — create a `subPath`, bind-mount it into another sandbox —
//! would follow the link to wherever it points on the host. [`open_beneath`] walks the path one
//! component at a time from a trusted folder, refusing links, and hands back a handle: mounting from
//! the handle (`/proc/self/fd/N`, or `open_tree`) mounts exactly what was checked.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

/// What [`open_beneath`] found: an `O_PATH` handle and whether it is a folder.
#[derive(Debug)]
pub struct Opened {
    pub fd: OwnedFd,
    pub is_dir: bool,
}

fn refused(path: &Path, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{}: {why}", path.display()),
    )
}

/// `openat(2)` of `name` in `dir` (always close-on-exec), as an owned descriptor.
fn openat(
    dir: &OwnedFd,
    name: &CString,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<OwnedFd> {
    // SAFETY: openat(2) on a descriptor we own and a NUL-terminated name; the result is owned here.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            mode,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One step of a walk: an `O_PATH` handle on `name` in `dir`, never following a link (a link there
/// is opened as itself).
fn step(dir: &OwnedFd, name: &CString, flags: libc::c_int) -> io::Result<OwnedFd> {
    openat(dir, name, flags | libc::O_PATH | libc::O_NOFOLLOW, 0)
}

/// What the walk ended on, `path` for errors: refused if it is a link.
fn opened(fd: OwnedFd, path: &Path) -> io::Result<Opened> {
    let file = File::from(fd);
    let kind = file.metadata()?.file_type();
    if kind.is_symlink() {
        return Err(refused(path, "is a symbolic link"));
    }
    Ok(Opened {
        fd: file.into(),
        is_dir: kind.is_dir(),
    })
}

/// Opens `root/rel` without following a symbolic link in `rel` (`root` itself is trusted and opened
/// as usual). With `create`, missing folders on the way — the last component included — are made
/// (mode 0755), as Kubernetes does for a `subPath`, each owned as the folder it is made in (a
/// volume's folders belong to the ids its sandboxes see as root, not to the host root that makes
/// them). `rel` must be relative and free of `..`.
pub fn open_beneath(root: &Path, rel: &Path, create: bool) -> io::Result<Opened> {
    let start = File::open(root)?;
    let mut cur: OwnedFd = start.into();
    let parts: Vec<&std::ffi::OsStr> = rel
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .map(|c| match c {
            Component::Normal(name) => Ok(name),
            _ => Err(refused(rel, "must be a relative path without `..`")),
        })
        .collect::<io::Result<_>>()?;
    let mut walked = root.to_path_buf();
    for (i, name) in parts.iter().enumerate() {
        walked.push(name);
        let last = i + 1 == parts.len();
        let cname = CString::new(name.as_bytes()).map_err(|_| refused(rel, "holds a NUL byte"))?;
        // Folders on the way must be folders (a link is not: O_NOFOLLOW opens the link itself, and
        // O_DIRECTORY then refuses it); the last component may also be a file.
        let flags = if last { 0 } else { libc::O_DIRECTORY };
        let next = match step(&cur, &cname, flags) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && create => {
                // SAFETY: mkdirat(2) on a descriptor we own and a NUL-terminated name.
                if unsafe { libc::mkdirat(cur.as_raw_fd(), cname.as_ptr(), 0o755) } != 0 {
                    let err = io::Error::last_os_error();
                    if err.raw_os_error() != Some(libc::EEXIST) {
                        return Err(io::Error::new(
                            err.kind(),
                            format!("creating {}: {err}", walked.display()),
                        ));
                    }
                } else {
                    take_parents_owner(&cur, &cname).map_err(|e| {
                        io::Error::new(e.kind(), format!("owning {}: {e}", walked.display()))
                    })?;
                }
                step(&cur, &cname, libc::O_DIRECTORY)
            }
            other => other,
        };
        cur = next.map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) | Some(libc::ELOOP) => {
                refused(&walked, "is a symbolic link or not a folder")
            }
            _ => io::Error::new(e.kind(), format!("{}: {e}", walked.display())),
        })?;
    }
    opened(cur, &walked)
}

/// Gives `name`, just made in `parent`, `parent`'s owner and group (without following a link, which
/// a sandbox sharing the folder could have put there meanwhile, and on the handle that was checked). Nothing is changed where the
/// owners agree already (a folder of the caller's own).
fn take_parents_owner(parent: &OwnedFd, name: &CString) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let st = File::from(parent.try_clone()?).metadata()?;
    // The folder is opened once, and what was checked is what is changed: a name can be swapped.
    let made = step(parent, name, libc::O_DIRECTORY)?;
    let made_st = File::from(made.try_clone()?).metadata()?;
    if (made_st.uid(), made_st.gid()) == (st.uid(), st.gid()) {
        return Ok(());
    }
    // SAFETY: fchownat(2) with AT_EMPTY_PATH on a descriptor we own: the folder it names.
    if unsafe {
        libc::fchownat(
            made.as_raw_fd(),
            c"".as_ptr(),
            st.uid(),
            st.gid(),
            libc::AT_EMPTY_PATH,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Opens the file `root/rel`, creating it empty (mode 0644) and the folders on the way when missing,
/// with the same refusals as [`open_beneath`]: a mount point for a file bind. An existing folder
/// there is refused.
pub fn make_file_beneath(root: &Path, rel: &Path) -> io::Result<Opened> {
    let (Some(parent), Some(name)) = (rel.parent(), rel.file_name()) else {
        return Err(refused(rel, "names no file"));
    };
    let dir = open_beneath(root, parent, true)?;
    if !dir.is_dir {
        return Err(refused(&root.join(parent), "is not a folder"));
    }
    let cname = CString::new(name.as_bytes()).map_err(|_| refused(rel, "holds a NUL byte"))?;
    let path = root.join(rel);
    let made = openat(
        &dir.fd,
        &cname,
        libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_WRONLY,
        0o644,
    );
    match made {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("creating {}: {e}", path.display()),
            ))
        }
    }
    // From the folder's handle, not walked again from `root`.
    let fd = step(&dir.fd, &cname, 0)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let file = opened(fd, &path)?;
    if file.is_dir {
        return Err(refused(&path, "is a folder, not a file"));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs root: gives a folder another owner (scripts/test runs it as root)"]
    fn made_folders_belong_to_the_folder_they_are_made_in() {
        use std::os::unix::fs::MetadataExt;
        let base = tempfile::tempdir().expect("tempdir");
        let vol = base.path().join("vol");
        std::fs::create_dir(&vol).expect("mkdir");
        std::os::unix::fs::chown(&vol, Some(4242), Some(4343)).expect("chown");
        open_beneath(&vol, Path::new("a/b"), true).expect("made");
        for dir in [vol.join("a"), vol.join("a/b")] {
            let m = std::fs::metadata(&dir).expect("stat");
            assert_eq!((m.uid(), m.gid()), (4242, 4343), "{}", dir.display());
        }
    }

    #[test]
    fn links_on_the_way_or_at_the_end_are_refused_and_nothing_is_made_through_them() {
        let base = tempfile::tempdir().expect("tempdir");
        let vol = base.path().join("vol");
        let outside = base.path().join("outside");
        std::fs::create_dir_all(vol.join("a/b")).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        std::fs::write(vol.join("a/file"), b"x").expect("file");
        std::os::unix::fs::symlink(&outside, vol.join("esc")).expect("symlink");
        std::os::unix::fs::symlink(&outside, vol.join("a/b/esc")).expect("symlink");

        let ok = open_beneath(&vol, Path::new("a/b"), false).expect("a/b");
        assert!(ok.is_dir);
        let file = open_beneath(&vol, Path::new("./a/file"), false).expect("a/file");
        assert!(!file.is_dir);
        for bad in ["esc", "esc/new", "a/b/esc", "a/b/esc/new", "a/file/x"] {
            let err = open_beneath(&vol, Path::new(bad), true).expect_err(bad);
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{bad}: {err}");
        }
        assert!(
            std::fs::read_dir(&outside)
                .expect("outside")
                .next()
                .is_none(),
            "made something outside"
        );
        for bad in ["../outside", "/etc"] {
            assert!(open_beneath(&vol, Path::new(bad), true).is_err(), "{bad}");
        }
        assert!(open_beneath(&vol, Path::new("missing"), false).is_err());
    }

    #[test]
    fn file_mount_points_are_made_but_never_through_a_link() {
        let base = tempfile::tempdir().expect("tempdir");
        let root = base.path().join("root");
        let outside = base.path().join("outside");
        std::fs::create_dir_all(root.join("etc")).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        std::fs::write(outside.join("victim"), b"keep").expect("victim");
        std::os::unix::fs::symlink(outside.join("victim"), root.join("etc/link")).expect("symlink");
        std::os::unix::fs::symlink(&outside, root.join("out")).expect("symlink");

        let made = make_file_beneath(&root, Path::new("a/b/file")).expect("made");
        assert!(!made.is_dir && root.join("a/b/file").is_file());
        // an existing file is taken as it is
        std::fs::write(root.join("a/b/file"), b"content").expect("write");
        make_file_beneath(&root, Path::new("a/b/file")).expect("again");
        assert_eq!(
            std::fs::read(root.join("a/b/file")).expect("read"),
            b"content"
        );
        for bad in ["etc/link", "out/new", "a/b"] {
            assert!(make_file_beneath(&root, Path::new(bad)).is_err(), "{bad}");
        }
        assert_eq!(
            std::fs::read(outside.join("victim")).expect("victim"),
            b"keep"
        );
        assert_eq!(std::fs::read_dir(&outside).expect("outside").count(), 1);
    }

    #[test]
    fn missing_folders_are_made_when_asked() {
        let base = tempfile::tempdir().expect("tempdir");
        let made = open_beneath(base.path(), Path::new("x/y/z"), true).expect("made");
        assert!(made.is_dir);
        assert!(base.path().join("x/y/z").is_dir());
        // the handle names what was made
        assert_eq!(
            std::fs::read_link(format!("/proc/self/fd/{}", made.fd.as_raw_fd())).expect("readlink"),
            base.path().join("x/y/z")
        );
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    /// What a path inside a volume may be made of: folders, a file, links that lead out (to a
    /// folder, to a file, to `..`), `.` and `..`.
    fn part() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "a", "b", "file", "out", "up", "victim", ".", "..", "new",
        ])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// However the path is put together, what opens is beneath the root (the descriptor's
        /// own path says so), and nothing is ever made outside it, with or without `create`.
        #[test]
        fn nothing_outside_the_root_is_opened_or_made(
            parts in prop::collection::vec(part(), 1..6),
            create: bool,
            file in any::<bool>(),
        ) {
            let base = tempfile::tempdir().expect("tempdir");
            let root = base.path().join("vol");
            let outside = base.path().join("outside");
            std::fs::create_dir_all(root.join("a/b")).expect("mkdir");
            std::fs::create_dir_all(&outside).expect("mkdir");
            std::fs::write(outside.join("secret"), b"x").expect("secret");
            std::fs::write(root.join("a/file"), b"x").expect("file");
            symlink(&outside, root.join("a/out")).expect("link");
            symlink("..", root.join("a/up")).expect("link");
            symlink(outside.join("secret"), root.join("a/b/victim")).expect("link");
            let rel: PathBuf = parts.iter().collect();
            let opened = if file {
                make_file_beneath(&root, &rel)
            } else {
                open_beneath(&root, &rel, create)
            };
            if let Ok(o) = opened {
                let at = std::fs::read_link(format!("/proc/self/fd/{}", o.fd.as_raw_fd()))
                    .expect("fd path");
                let root = root.canonicalize().expect("root");
                prop_assert!(at.starts_with(&root), "{:?} opened {:?}", rel, at);
            }
            let made: Vec<_> = std::fs::read_dir(&outside)
                .expect("outside")
                .map(|e| e.expect("entry").file_name())
                .collect();
            prop_assert_eq!(made, vec![std::ffi::OsString::from("secret")], "{:?}", rel);
            prop_assert_eq!(std::fs::read(outside.join("secret")).expect("secret"), b"x");
        }
    }
}
