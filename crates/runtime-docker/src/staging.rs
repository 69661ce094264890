//! Volumes staged for a Docker daemon on this host.
//!
//! Docker takes a bind's source as a path and resolves it again when the container starts,
//! following links. A sandbox can change folders on such a path (a named volume's `subPath`, a
//! host folder under one it has mounted writable) between Warren's check and the daemon's
//! resolve: swapping a checked folder for a link to `/` would hand a later sandbox the host's
//! root, read-write, as root. So the daemon is never given such a path: Warren opens the folder
//! without following a link ([`warren_core::beneath`]), binds exactly what it opened onto a
//! mount point of its own, `<data dir>/binds/<sandbox id>/<n>` (folders only root can enter),
//! and gives the daemon that path, in which nothing belongs to a sandbox.
//!
//! The staged mounts are `nosuid`, `nodev` and private (no mount event propagates to or from
//! the source's peers); they go with the sandbox, with a create that fails, and, for sandboxes
//! that no longer exist, when the server starts.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use warren_core::beneath::{open_beneath, Opened};
use warren_core::mount_api::{self, MountAttr};

/// `<data dir>/binds`: one folder per sandbox with staged volumes.
pub(crate) struct Staging {
    root: PathBuf,
}

impl Staging {
    pub fn new(data_dir: &Path) -> Self {
        Self {
            root: data_dir.join("binds"),
        }
    }

    /// Binds what `source` names at the sandbox's `n`th staging point and returns that point's
    /// path, for the daemon. `read_only` binds it read-only already here (Docker does too).
    pub fn stage(
        &self,
        id: &str,
        n: usize,
        source: &Opened,
        read_only: bool,
    ) -> io::Result<PathBuf> {
        if !warren_core::is_valid_sandbox_id(id) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("invalid sandbox id {id:?}"),
            ));
        }
        // Only root enters: the mounts below are sandboxes' folders (and, until the daemon's
        // own copy exists, a host user must not reach them through here either).
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(self.root.join(id))?;
        let rel = Path::new(id).join(n.to_string());
        let point = self.root.join(&rel);
        // A mount point of the source's kind (a host volume may be a file); made new, so that
        // nothing else was mounted there.
        if source.is_dir {
            fs::DirBuilder::new().mode(0o700).create(&point)?;
        } else {
            fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&point)?;
        }
        let bound = open_beneath(&self.root, &rel, false).and_then(|target| {
            let attr = MountAttr {
                attr_set: mount_api::MOUNT_ATTR_NOSUID
                    | mount_api::MOUNT_ATTR_NODEV
                    | if read_only {
                        mount_api::MOUNT_ATTR_RDONLY
                    } else {
                        0
                    },
                propagation: libc::MS_PRIVATE,
                ..MountAttr::default()
            };
            mount_api::bind_handle(&source.fd, &target.fd, &attr).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOSYS) {
                    io::Error::new(e.kind(), "volumes need Linux 5.12 or later")
                } else {
                    e
                }
            })
        });
        if let Err(e) = bound {
            let _ = remove_point(&point);
            return Err(e);
        }
        Ok(point)
    }

    /// Unmounts and removes sandbox `id`'s staging points and its folder. Never removes what is
    /// below a staging point: a point still mounted is left (and logged), not emptied.
    pub fn remove(&self, id: &str) {
        if !warren_core::is_valid_sandbox_id(id) {
            return;
        }
        let dir = self.root.join(id);
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(sandbox_id = id, error = %e, "listing staged volumes");
                return;
            }
        };
        for entry in entries.flatten() {
            if let Err(e) = remove_point(&entry.path()) {
                tracing::warn!(sandbox_id = id, path = %entry.path().display(), error = %e,
                               "removing a staged volume");
            }
        }
        match fs::remove_dir(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                tracing::warn!(sandbox_id = id, error = %e, "removing the staged volumes' folder")
            }
            _ => {}
        }
    }

    /// Removes the staged volumes of every sandbox not in `known` (left by a crash).
    pub fn sweep(&self, known: &[String]) {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name.to_str() else { continue };
            if !known.iter().any(|k| k == id) {
                tracing::info!(
                    sandbox_id = id,
                    "removing staged volumes of a sandbox Warren has no record of"
                );
                self.remove(id);
            }
        }
    }
}

/// Unmounts whatever is mounted at `point` (lazily: the daemon may still hold it) and removes
/// the point itself with `rmdir`/`unlink` only, which refuse a point still mounted instead of
/// reaching into the volume.
fn remove_point(point: &Path) -> io::Result<()> {
    let c = CString::new(point.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let is_dir = fs::symlink_metadata(point)?.is_dir();
    // A few times: a mount may sit on another (a stage retried over a leftover); EINVAL once
    // nothing is mounted there.
    for _ in 0..8 {
        // SAFETY: umount2(2) with a NUL-terminated path that outlives the call.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) } != 0 {
            break;
        }
    }
    if is_dir {
        fs::remove_dir(point)
    } else {
        fs::remove_file(point)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mounted(path: &Path) -> bool {
        let path = path.to_string_lossy().to_string();
        fs::read_to_string("/proc/self/mountinfo")
            .expect("mountinfo")
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(path.as_str()))
    }

    #[test]
    #[ignore = "needs root: staging mounts (scripts/test runs it as root)"]
    fn the_staged_folder_is_the_one_opened_whatever_its_path_becomes() {
        let t = tempfile::tempdir().expect("tmp");
        let volume = t.path().join("volume");
        let host = t.path().join("host");
        fs::create_dir_all(volume.join("sub")).expect("mkdir");
        fs::create_dir_all(&host).expect("mkdir");
        fs::write(volume.join("sub/marker"), b"volume").expect("marker");
        fs::write(host.join("secret"), b"host").expect("secret");
        let staging = Staging::new(&t.path().join("data"));

        let opened = open_beneath(&volume, Path::new("sub"), false).expect("open");
        let point = staging.stage("sb1", 0, &opened, false).expect("stage");
        // The sandbox swaps the folder for a link to a host folder right after the check.
        fs::rename(volume.join("sub"), volume.join("moved")).expect("rename");
        std::os::unix::fs::symlink(&host, volume.join("sub")).expect("symlink");
        assert_eq!(fs::read(point.join("marker")).expect("marker"), b"volume");
        assert!(!point.join("secret").exists(), "the link was followed");
        assert!(mounted(&point));
        let info = fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let line = info
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(point.to_str().expect("utf-8")))
            .expect("its line");
        let options = line.split(' ').nth(5).expect("options");
        assert!(
            options.contains("nosuid") && options.contains("nodev"),
            "{line}"
        );
        assert!(!line.contains("shared:"), "private: {line}");

        // A file, read-only.
        let file = open_beneath(&volume, Path::new("moved/marker"), false).expect("file");
        let file_point = staging.stage("sb1", 1, &file, true).expect("stage file");
        assert_eq!(fs::read(&file_point).expect("read"), b"volume");
        assert!(fs::write(&file_point, b"x").is_err(), "read-only");

        staging.remove("sb1");
        assert!(!mounted(&point) && !mounted(&file_point));
        assert!(!t.path().join("data/binds/sb1").exists(), "nothing left");
        assert_eq!(
            fs::read(volume.join("moved/marker")).expect("kept"),
            b"volume",
            "the volume's contents stay"
        );
    }

    #[test]
    #[ignore = "needs root: staging mounts (scripts/test runs it as root)"]
    fn a_link_is_never_staged_and_leftovers_are_swept() {
        let t = tempfile::tempdir().expect("tmp");
        let volume = t.path().join("volume");
        fs::create_dir_all(volume.join("real")).expect("mkdir");
        std::os::unix::fs::symlink("/", volume.join("sub")).expect("symlink");
        assert!(open_beneath(&volume, Path::new("sub"), true).is_err());

        let staging = Staging::new(&t.path().join("data"));
        let real = open_beneath(&volume, Path::new("real"), false).expect("open");
        let kept = staging.stage("alive", 0, &real, false).expect("stage");
        let gone = staging.stage("gone", 0, &real, false).expect("stage");
        // a point that already exists is refused, not mounted over
        assert!(staging.stage("gone", 0, &real, false).is_err());
        assert!(staging.stage("../x", 0, &real, false).is_err());
        staging.sweep(&["alive".to_string()]);
        assert!(mounted(&kept) && !mounted(&gone));
        assert!(!t.path().join("data/binds/gone").exists());
        staging.remove("alive");
        assert!(!mounted(&kept));
        assert_eq!(
            fs::read_dir(t.path().join("data/binds"))
                .expect("binds")
                .count(),
            0
        );
    }
}
