//! What the fuzz targets share.

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};

/// Confines this process before its first input, for the targets that write files as root (the
/// layer unpacker, uploads): in a private mount namespace every mount is made read-only but a fresh
/// tmpfs, returned as the scratch folder, and the folders libFuzzer writes to (the corpus and
/// artifact folders named on its command line). Whatever a bug in the code under test made it write
/// or chown, nothing outside the scratch folder can change. Needs root (CAP_SYS_ADMIN).
pub fn confine() -> PathBuf {
    match try_confine() {
        Ok(scratch) => scratch,
        Err(e) => panic!("confining the fuzz target (run it as root): {e}"),
    }
}

fn try_confine() -> io::Result<PathBuf> {
    let scratch = std::env::temp_dir().join("warren-fuzz-scratch");
    std::fs::create_dir_all(&scratch)?;
    let mut writable = vec![];
    for arg in std::env::args().skip(1) {
        let dir = if let Some(prefix) = arg.strip_prefix("-artifact_prefix=") {
            // a prefix of file names: its folder, unless it names a folder itself
            let p = PathBuf::from(prefix);
            if prefix.ends_with('/') {
                p
            } else {
                p.parent().map(Path::to_path_buf).unwrap_or_default()
            }
        } else if arg.starts_with('-') {
            continue;
        } else {
            PathBuf::from(arg)
        };
        let dir = if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        };
        if dir.is_dir() {
            writable.push(dir.canonicalize()?);
        }
    }
    check(unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
    mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE)?;
    // Own mounts for the folders that stay writable, so that their read-only flag can be cleared
    // alone once everything is read-only.
    for dir in &writable {
        mount(Some(dir), dir, None, libc::MS_BIND | libc::MS_REC)?;
    }
    mount(Some(Path::new("tmpfs")), &scratch, Some("tmpfs"), 0)?;
    set_read_only(Path::new("/"), true)?;
    for dir in writable.iter().chain([&scratch]) {
        set_read_only(dir, false)?;
    }
    // The confinement holds, or nothing runs: beside the scratch folder nothing can be written.
    let probe = scratch.with_file_name("warren-fuzz-probe");
    match std::fs::File::create(&probe) {
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => {}
        other => panic!("{} is writable after confining: {other:?}", probe.display()),
    }
    std::fs::File::create(scratch.join("probe"))?;
    std::fs::remove_file(scratch.join("probe"))?;
    Ok(scratch)
}

/// Empties `dir` (the scratch folder between inputs).
pub fn empty(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
        }
    }
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).expect("a path without nul")
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
) -> io::Result<()> {
    let source = source.map(cstr);
    let target = cstr(target);
    let fstype = fstype.map(|t| CString::new(t).expect("no nul"));
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    check(unsafe {
        libc::mount(
            ptr(&source),
            target.as_ptr(),
            ptr(&fstype),
            flags,
            std::ptr::null(),
        )
    })
}

/// `mount_setattr(2)` on the mount at `dir` and every mount below it.
fn set_read_only(dir: &Path, read_only: bool) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: if read_only {
            libc::MOUNT_ATTR_RDONLY
        } else {
            0
        },
        attr_clr: if read_only {
            0
        } else {
            libc::MOUNT_ATTR_RDONLY
        },
        propagation: 0,
        userns_fd: 0,
    };
    let path = cstr(dir);
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_RECURSIVE,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    check(rc as libc::c_int)
}
