//! The built-in `host` image: the host's system folders, read-only, over a base layer and a
//! skeleton of this runtime's own, with the host's private files (keys, shadow, its data) masked.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use warren_core::RuntimeError;

use crate::{rootfs, spec};

/// The files and folders under `top` (at most [`PRIVATE_DEPTH`] deep, [`PRIVATE_MAX`] entries
/// looked at) that the host's other users may not read, except those under `known` folders:
/// secrets of the host's own services (a cluster's admin config, a Docker daemon's key, a
/// database's access rules, Wi-Fi and VPN keys). The `host` image hides them all, whatever their
/// names: without a user namespace (gVisor, `user_namespaces = false`) sandbox root reads any
/// file of the host's root, and a list of names can never be complete. Symlinks are left alone:
/// they resolve inside the sandbox's view.
pub(crate) fn private_host_files(top: &Path, known: &[&str]) -> (Vec<PathBuf>, Vec<PathBuf>) {
    use std::os::unix::fs::PermissionsExt;
    let (mut files, mut dirs) = (Vec::new(), Vec::new());
    let mut seen = 0usize;
    let mut stack = vec![(top.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            seen += 1;
            if seen > PRIVATE_MAX {
                return (files, dirs);
            }
            let path = entry.path();
            if known.iter().any(|k| path.starts_with(k)) {
                continue;
            }
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            let mode = meta.permissions().mode();
            if meta.is_dir() {
                if mode & 0o005 != 0o005 {
                    dirs.push(path);
                } else if depth + 1 < PRIVATE_DEPTH {
                    stack.push((path, depth + 1));
                }
            } else if meta.is_file() && mode & 0o004 == 0 {
                files.push(path);
            }
        }
    }
    (files, dirs)
}

/// How deep, and how many entries, `private_host_files` looks.
pub(crate) const PRIVATE_DEPTH: usize = 6;

pub(crate) const PRIVATE_MAX: usize = 50_000;

/// Host folders the built-in `host` image exposes read-only (when present and not symlinks).
pub(crate) const HOST_BINDS: [&str; 7] =
    ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc"];

/// Secrets under exposed folders, hidden behind `/dev/null` or an empty read-only tmpfs.
pub(crate) const HOST_MASKED_FILES: [&str; 4] = [
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/shadow-",
    "/etc/gshadow-",
];

pub(crate) const HOST_MASKED_DIRS: [&str; 4] = [
    "/etc/ssh",
    "/etc/ssl/private",
    "/etc/warren",
    "/etc/sudoers.d",
];

/// Refuses to start where no sandbox could be made: every sandbox's writable layer is an overlay's
/// upper folder under the data dir, and some file systems cannot hold one — overlayfs itself above
/// all, which is where a data dir lands when Warren runs in a container without a volume for it.
/// Found at start, with the kernel's reason, instead of at every create as "mount overlay at …".
/// The probe overlay is made and never mounted (`fsopen(2)`; skipped on kernels without it).
pub(crate) fn check_layers_can_live_in(data_dir: &Path, lower: &Path) -> Result<(), RuntimeError> {
    let probe = data_dir.join(format!("overlay-probe.{}", std::process::id()));
    let (upper, work) = (probe.join("upper"), probe.join("work"));
    let made = fs::create_dir_all(&upper).and_then(|()| fs::create_dir_all(&work));
    let outcome = made
        .map_err(|e| RuntimeError::backend_with("preparing the overlay probe in the data dir", e))
        .and_then(|()| {
            rootfs::mount_api::probe_overlay(&[lower.to_path_buf()], &upper, &work).map_err(
                |(errno, kernel)| {
                    let said = if kernel.is_empty() {
                        " (overlayfs says why in the kernel log, `dmesg`)".to_string()
                    } else {
                        format!(" (the kernel: {kernel})")
                    };
                    RuntimeError::backend(format!(
                        "the data dir {} cannot hold sandboxes' writable layers: an overlay with its upper folder there fails with {errno}{said}{}",
                        data_dir.display(),
                        if on_overlayfs(data_dir) {
                            ". The data dir is on overlayfs (a container's own file system?): give it a volume or a host file system, e.g. `docker run -v /var/lib/warren:/var/lib/warren …`"
                        } else {
                            ""
                        }
                    ))
                },
            )
        });
    let _ = fs::remove_dir_all(&probe);
    outcome
}

/// Whether `path` is on overlayfs (`OVERLAYFS_SUPER_MAGIC`).
pub(crate) fn on_overlayfs(path: &Path) -> bool {
    use nix::sys::statfs::{statfs, OVERLAYFS_SUPER_MAGIC};
    statfs(path).is_ok_and(|s| s.filesystem_type() == OVERLAYFS_SUPER_MAGIC)
}

/// The sandbox base layer (see `InitSpec::base_layer`), made once; running sandboxes have it as a
/// lower dir, so it is never changed after.
pub(crate) fn build_base_layer(dir: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if dir.is_dir() {
        return Ok(dir.to_path_buf());
    }
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    for (name, mode) in [
        ("", 0o755),
        (spec::WARREN_DIR, 0o755),
        ("tmp", 0o1777),
        ("workspace", 0o755),
        // mount points
        ("dev", 0o755),
        ("proc", 0o555),
        ("sys", 0o555),
    ] {
        let path = tmp.join(name);
        fs::create_dir_all(&path)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
    }
    // Mount points an OCI runtime would otherwise create in the upper dir (the embedded runtime
    // mounts a tmpfs over /.warren first).
    fs::create_dir_all(tmp.join(spec::WARREN_DIR).join("run"))?;
    fs::write(tmp.join(spec::WARREN_DIR).join("execd"), b"")?;
    match fs::rename(&tmp, dir) {
        Ok(()) => Ok(dir.to_path_buf()),
        // another process made it first
        Err(_) if dir.is_dir() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(dir.to_path_buf())
        }
        Err(e) => Err(e),
    }
}

/// The `host` image's lower layer: the top-level shape of the host's root (merged-/usr symlinks and
/// empty mount points), with nothing of the host's content. Running sandboxes use it as an overlay
/// lower dir, so it is never modified once made: a host whose shape changed gets a new one, named by
/// a digest of the shape, under `base`.
pub(crate) fn build_host_skeleton(base: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    const DIRS: [&str; 16] = [
        "usr",
        "etc",
        "root",
        "home",
        "var",
        "var/tmp",
        "var/log",
        "run",
        "tmp",
        "dev",
        "proc",
        "sys",
        "opt",
        "srv",
        "mnt",
        "workspace",
    ];
    let mut shape: Vec<(String, Option<PathBuf>)> = Vec::new();
    for name in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        let host = Path::new("/").join(name);
        if let Ok(target) = fs::read_link(&host) {
            shape.push((name.to_string(), Some(target)));
        } else if host.is_dir() {
            shape.push((name.to_string(), None));
        }
    }
    let digest = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&shape, DIRS).hash(&mut h);
        format!("{:016x}", h.finish())
    };
    let dir = base.join(&digest);
    if dir.is_dir() {
        return Ok(dir);
    }
    fs::create_dir_all(base)?;
    let tmp = base.join(format!(".{digest}.{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    for (name, target) in &shape {
        match target {
            Some(t) => symlink(t, tmp.join(name))?,
            None => fs::create_dir(tmp.join(name))?,
        }
    }
    for name in DIRS {
        fs::create_dir_all(tmp.join(name))?;
    }
    fs::set_permissions(tmp.join("tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::set_permissions(tmp.join("var/tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::set_permissions(tmp.join("root"), fs::Permissions::from_mode(0o700))?;
    match fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process made the same skeleton first.
        Err(_) if dir.is_dir() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_image_hides_what_other_users_may_not_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let top = dir.path();
        let mode = |p: &Path, m: u32| fs::set_permissions(p, fs::Permissions::from_mode(m));
        for (name, m) in [
            ("public.conf", 0o644),
            ("admin.conf", 0o600),
            ("known", 0o600),
        ] {
            fs::write(top.join(name), "x").expect("write");
            mode(&top.join(name), m).expect("chmod");
        }
        fs::create_dir_all(top.join("svc/keys")).expect("mkdir");
        fs::write(top.join("svc/keys/k"), "x").expect("write");
        mode(&top.join("svc/keys"), 0o700).expect("chmod");
        fs::create_dir_all(top.join("deep/a/b")).expect("mkdir");
        fs::write(top.join("deep/a/b/token"), "x").expect("write");
        mode(&top.join("deep/a/b/token"), 0o640).expect("chmod");
        std::os::unix::fs::symlink("admin.conf", top.join("link")).expect("symlink");
        let known = top.join("known");
        let (mut files, dirs) = private_host_files(top, &[known.to_str().expect("utf-8")]);
        files.sort();
        assert_eq!(
            files,
            vec![top.join("admin.conf"), top.join("deep/a/b/token")]
        );
        assert_eq!(
            dirs,
            vec![top.join("svc/keys")],
            "a private folder, not what it holds"
        );
    }
}
