//! Room on the data dir's filesystem, checked before a create uses any.
//!
//! Sandboxes write into folders under the data dir (their root's writable layer, their log, their
//! execd socket), and so do the server's state journal and image store. With the filesystem full, a
//! create used to fail half-way with an error naming none of that ("execd exited during start: no
//! output": execd could not make its socket, nor the log say why). A create is now refused up front,
//! with 507 and the numbers, while the filesystem is below a small reserve; one that fails anyway
//! (a sandbox filled the disk meanwhile) gets the same explanation appended.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use warren_api::ErrorCode;

use crate::error::{ErrorKind, SandboxError};

/// Kept free: a sandbox's folders, log and socket, and the journal's next records, with room to
/// spare. A create below it would fail, or push the server's own writes into failing.
const RESERVE_BYTES: u64 = 64 << 20;
const RESERVE_INODES: u64 = 1024;

/// Free bytes and inodes (for unprivileged users, as `df` shows them) of the filesystem at `dir`.
fn free(dir: &Path) -> Option<(u64, u64)> {
    let path = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: zeroed statvfs is a valid out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs with a NUL-terminated path and a valid out-pointer.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    // Filesystems without inode accounting (btrfs, some FUSE) report 0 files: not a shortage.
    let inodes = if st.f_files == 0 {
        u64::MAX
    } else {
        st.f_favail
    };
    Some((st.f_bavail.saturating_mul(st.f_frsize), inodes))
}

/// The 507 a create (of `what`: "a sandbox", "a snapshot") gets while the data dir's filesystem is
/// below the reserve; `Ok` when it is not, or when it cannot be measured.
pub fn check(dir: &Path, what: &str) -> Result<(), SandboxError> {
    match shortage(dir) {
        Some(why) => Err(insufficient(format!(
            "no room for {what}: {why}; delete sandboxes, snapshots or images to make room"
        ))),
        None => Ok(()),
    }
}

/// The 507 `SANDBOX::INSUFFICIENT_STORAGE` error with `message`.
pub fn insufficient(message: String) -> SandboxError {
    SandboxError::new(ErrorKind::NoSpace, ErrorCode::InsufficientStorage, message)
}

/// Why the filesystem at `dir` is short of room, if it is.
pub fn shortage(dir: &Path) -> Option<String> {
    let (bytes, inodes) = free(dir)?;
    judge(dir, bytes, inodes)
}

/// Why `bytes` and `inodes` free at `dir` are short of the reserve, if they are.
fn judge(dir: &Path, bytes: u64, inodes: u64) -> Option<String> {
    (bytes < RESERVE_BYTES || inodes < RESERVE_INODES).then(|| {
        format!(
            "the data dir's filesystem ({}) has {} MiB and {} inodes free, below the {} MiB and {} inodes kept in reserve",
            dir.display(),
            bytes >> 20,
            if inodes == u64::MAX { "unlimited".to_string() } else { inodes.to_string() },
            RESERVE_BYTES >> 20,
            RESERVE_INODES
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_roomy_filesystem_passes_and_a_missing_one_is_not_blamed() {
        let dir = tempfile::tempdir().expect("tempdir");
        // The test machine's temp dir has far more than the reserve.
        assert!(
            check(dir.path(), "a sandbox").is_ok(),
            "{:?}",
            shortage(dir.path())
        );
        assert!(check(&dir.path().join("missing"), "a sandbox").is_ok());
    }

    #[test]
    fn too_few_bytes_or_inodes_is_a_shortage_that_says_so() {
        let dir = Path::new("/data");
        assert_eq!(judge(dir, RESERVE_BYTES, RESERVE_INODES), None);
        assert_eq!(judge(dir, u64::MAX, u64::MAX), None);
        let bytes = judge(dir, RESERVE_BYTES - 1, u64::MAX).expect("short of bytes");
        assert!(
            bytes.contains("63 MiB and unlimited inodes free"),
            "{bytes}"
        );
        let inodes = judge(dir, u64::MAX, RESERVE_INODES - 1).expect("short of inodes");
        assert!(inodes.contains("1023 inodes free"), "{inodes}");
    }

    /// The whole path on a real filesystem that is full: a 507 with the numbers.
    #[test]
    #[ignore = "needs root: mounts a small tmpfs (scripts/test runs it as root)"]
    fn a_full_filesystem_refuses_with_507_and_the_numbers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = CString::new(dir.path().as_os_str().as_bytes()).expect("path");
        // SAFETY: mount(2) with NUL-terminated strings that live for the call.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                c"size=4m".as_ptr().cast(),
            )
        };
        assert_eq!(rc, 0, "mount: {}", std::io::Error::last_os_error());
        struct Unmount(CString);
        impl Drop for Unmount {
            fn drop(&mut self) {
                // SAFETY: umount2(2) of the tmpfs this test mounted.
                unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
            }
        }
        let _unmount = Unmount(target);
        let err = check(dir.path(), "a sandbox").expect_err("4 MiB is below the reserve");
        assert_eq!(err.kind, ErrorKind::NoSpace);
        assert!(
            err.to_string().contains("no room for a sandbox") && err.to_string().contains("MiB"),
            "{}",
            err.to_string()
        );
    }
}
