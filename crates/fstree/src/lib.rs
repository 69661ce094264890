//! Removing folder trees that sandboxes (and images) made: a sandbox's folder, a named volume, the
//! trash, a folder deleted through execd's files API, an unpacked image. Such a tree may be 100,000 levels deep or a million entries wide, so the walk is a loop,
//! not a recursion (std's `remove_dir_all` recurses once per level: a 100,000-level tree overflowed
//! its thread's stack and aborted the server, again at every restart while emptying the trash), it
//! works by descriptor (no path grows past `PATH_MAX`), and it keeps at most [`OPEN_LEVELS`] folders
//! open (deeper ones are reopened through `..` on the way back up, checked by device and inode).
//! It never follows a link and never descends into another file system (a mount left inside is an
//! error, not something to empty).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Folders kept open at once on the way down; above them, a folder is reopened from its child.
const OPEN_LEVELS: usize = 64;

/// One folder on the way down.
struct Level {
    fd: Option<OwnedFd>,
    dev: u64,
    ino: u64,
    /// Its name in the folder above (unused for the top).
    name: CString,
    /// Subfolders still to empty and remove.
    subdirs: Vec<CString>,
}

/// Removes `path` and everything below it, as `std::fs::remove_dir_all` does (a file or a link at
/// `path` is unlinked; a missing `path` is `NotFound`), with a loop, by descriptor.
pub fn remove_all(path: impl AsRef<Path>) -> io::Result<()> {
    let path = path.as_ref();
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let top = match open_dir(libc::AT_FDCWD, &cpath) {
        Ok(fd) => fd,
        // a file or a link: unlinked as it is
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
            // SAFETY: unlinkat(2) of a NUL-terminated path that lives for the call.
            return check(unsafe { libc::unlinkat(libc::AT_FDCWD, cpath.as_ptr(), 0) });
        }
        Err(e) => return Err(e),
    };
    let (dev, ino) = dev_ino(&top)?;
    let subdirs = empty_files(&top)?;
    let mut stack = vec![Level {
        fd: Some(top),
        dev,
        ino,
        name: CString::default(),
        subdirs,
    }];
    loop {
        let depth = stack.len();
        let here = stack
            .last_mut()
            .expect("the stack holds the top until it is removed");
        let fd = here
            .fd
            .as_ref()
            .expect("the deepest level is open")
            .as_raw_fd();
        if let Some(name) = here.subdirs.pop() {
            // An empty folder (most leaves) goes in one call.
            // SAFETY: unlinkat(2) with an open folder and a NUL-terminated name.
            if unsafe { libc::unlinkat(fd, name.as_ptr(), libc::AT_REMOVEDIR) } == 0 {
                continue;
            }
            let child = match open_dir(fd, &name) {
                Ok(child) => child,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let (dev, ino) = dev_ino(&child)?;
            if dev != here.dev {
                return Err(io::Error::other(format!(
                    "{}: another file system is mounted inside",
                    path.display()
                )));
            }
            let subdirs = empty_files(&child)?;
            if depth >= OPEN_LEVELS {
                stack[depth - OPEN_LEVELS].fd = None;
            }
            stack.push(Level {
                fd: Some(child),
                dev,
                ino,
                name,
                subdirs,
            });
            continue;
        }
        let done = stack.pop().expect("a level");
        let Some(parent) = stack.last_mut() else {
            drop(done);
            // SAFETY: unlinkat(2) with a NUL-terminated path.
            return check(unsafe {
                libc::unlinkat(libc::AT_FDCWD, cpath.as_ptr(), libc::AT_REMOVEDIR)
            });
        };
        let done_fd = done.fd.expect("the deepest level is open");
        if parent.fd.is_none() {
            let up = open_dir(done_fd.as_raw_fd(), c"..")?;
            if dev_ino(&up)? != (parent.dev, parent.ino) {
                return Err(io::Error::other(format!(
                    "{}: the tree was moved while being removed",
                    path.display()
                )));
            }
            parent.fd = Some(up);
        }
        drop(done_fd);
        let parent_fd = parent.fd.as_ref().expect("opened above").as_raw_fd();
        // SAFETY: unlinkat(2) with an open folder and a NUL-terminated name.
        let removed =
            check(unsafe { libc::unlinkat(parent_fd, done.name.as_ptr(), libc::AT_REMOVEDIR) });
        match removed {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            other => other?,
        }
    }
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn open_dir(at: libc::c_int, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: openat(2) with a NUL-terminated name; the result is owned here.
    let fd = unsafe {
        libc::openat(
            at,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn dev_ino(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    // SAFETY: all-zero is a valid `stat`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) of an open descriptor into a struct we own.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok((st.st_dev, st.st_ino))
}

/// Unlinks every entry of the folder `dir` that is not a folder; returns the names of those that are.
fn empty_files(dir: &OwnedFd) -> io::Result<Vec<CString>> {
    // fdopendir takes over a descriptor of its own, closed by closedir.
    // SAFETY: F_DUPFD_CLOEXEC of an open descriptor.
    let dup = unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fdopendir(3) of a descriptor we own; on failure it stays ours to close.
    let stream = unsafe { libc::fdopendir(dup) };
    if stream.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: closing the descriptor fdopendir did not take.
        unsafe { libc::close(dup) };
        return Err(e);
    }
    let mut names = Vec::new();
    let mut subdirs = Vec::new();
    let result = loop {
        // readdir's end and its errors look alike but for errno.
        // SAFETY: errno is thread-local.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: readdir(3) on a stream we own; the entry is copied out before the next call.
        let entry = unsafe { libc::readdir64(stream) };
        if entry.is_null() {
            let errno = io::Error::last_os_error();
            break match errno.raw_os_error() {
                Some(0) | None => Ok(()),
                _ => Err(errno),
            };
        }
        // SAFETY: d_name is NUL-terminated within the entry.
        let name = unsafe { CStr::from_ptr((*entry).d_name.as_ptr()) };
        if name == c"." || name == c".." {
            continue;
        }
        // SAFETY: reading a field of the entry readdir returned.
        let kind = unsafe { (*entry).d_type };
        names.push((name.to_owned(), kind));
    };
    // SAFETY: closedir(3) of the stream opened above.
    unsafe { libc::closedir(stream) };
    result?;
    for (name, kind) in names {
        if kind == libc::DT_DIR {
            subdirs.push(name);
            continue;
        }
        // SAFETY: unlinkat(2) with an open folder and a NUL-terminated name.
        if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } != 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // a file system that does not fill d_type, or a folder made since
                Some(libc::EISDIR) => subdirs.push(name),
                Some(libc::ENOENT) => {}
                _ => return Err(e),
            }
        }
    }
    Ok(subdirs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn deep(root: &Path, levels: usize) {
        fs::create_dir(root).expect("root");
        let mut fd = open_dir(
            libc::AT_FDCWD,
            &CString::new(root.as_os_str().as_bytes()).expect("c"),
        )
        .expect("open");
        for i in 0..levels {
            assert_eq!(
                // SAFETY: mkdirat with an open folder and a NUL-terminated name.
                unsafe { libc::mkdirat(fd.as_raw_fd(), c"d".as_ptr(), 0o755) },
                0
            );
            if i % 1000 == 0 {
                // SAFETY: openat with an open folder and a NUL-terminated name.
                let f = unsafe {
                    libc::openat(
                        fd.as_raw_fd(),
                        c"f".as_ptr(),
                        libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                        0o644,
                    )
                };
                assert!(f >= 0);
                // SAFETY: closes the descriptor just opened, used nowhere else.
                unsafe { libc::close(f) };
            }
            fd = open_dir(fd.as_raw_fd(), c"d").expect("down");
        }
    }

    #[test]
    fn a_tree_deeper_than_any_stack_is_removed() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path().join("tree");
        deep(&root, 20_000);
        // a thread with a small stack: the walk's depth must not cost stack
        let r = root.clone();
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || remove_all(&r))
            .expect("thread")
            .join()
            .expect("no overflow")
            .expect("removed");
        assert!(!root.exists());
    }

    #[test]
    fn wide_trees_links_and_files_go_and_links_are_not_followed() {
        let t = tempfile::tempdir().expect("tempdir");
        let outside = t.path().join("outside");
        fs::create_dir(&outside).expect("outside");
        fs::write(outside.join("keep"), "x").expect("keep");
        let root = t.path().join("tree");
        fs::create_dir(&root).expect("root");
        for i in 0..2000 {
            let d = root.join(format!("d{i}"));
            fs::create_dir(&d).expect("d");
            fs::write(d.join("f"), "y").expect("f");
            if i % 100 == 0 {
                fs::create_dir(d.join("e")).expect("empty");
            }
        }
        std::os::unix::fs::symlink(&outside, root.join("link")).expect("link");
        std::os::unix::fs::symlink(&outside, root.join("d7").join("link")).expect("link");
        remove_all(&root).expect("removed");
        assert!(!root.exists());
        assert!(
            outside.join("keep").exists(),
            "a link is removed, not followed"
        );
        // a link or a file at the top is unlinked; a missing path is NotFound
        let link = t.path().join("top-link");
        std::os::unix::fs::symlink(&outside, &link).expect("link");
        remove_all(&link).expect("link removed");
        assert!(outside.join("keep").exists() && link.symlink_metadata().is_err());
        let file = t.path().join("file");
        fs::write(&file, "z").expect("file");
        remove_all(&file).expect("file removed");
        assert_eq!(
            remove_all(t.path().join("none"))
                .expect_err("missing")
                .kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    #[ignore = "needs root: mounts a tmpfs (scripts/test runs it as root)"]
    fn a_mount_inside_is_refused_not_emptied() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path().join("tree");
        let inner = root.join("a").join("mnt");
        fs::create_dir_all(&inner).expect("dirs");
        let target = CString::new(inner.as_os_str().as_bytes()).expect("c");
        // SAFETY: mount(2) with NUL-terminated strings (the tests run as root).
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "mount a tmpfs: {}", io::Error::last_os_error());
        fs::write(inner.join("theirs"), "x").expect("write");
        let e = remove_all(&root).expect_err("refused");
        assert!(e.to_string().contains("mounted inside"), "{e}");
        assert!(
            inner.join("theirs").exists(),
            "the mounted file system is untouched"
        );
        // SAFETY: umount2(2) with a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        remove_all(&root).expect("removed once unmounted");
    }
}
