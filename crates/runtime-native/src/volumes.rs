//! Named volumes of the native runtime: folders under `<data_dir>/volumes/<claim>` that outlive
//! sandboxes. Each sandbox using one holds a lease (`volumes/.leases/<claim>/<sandbox>`), so a volume
//! marked `deleteOnSandboxTermination` is removed only by the sandbox that created it and only once
//! no other sandbox still has it mounted.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use warren_core::{RuntimeError, VolumeMount, VolumeSource};

use crate::spec::HostMount;

pub struct Volumes {
    root: PathBuf,
    /// Who a new volume's folder belongs to: with user namespaces, the volume range's root
    /// (`userns::VOLUME_BASE`), so that each sandbox's root owns it through its idmapping; else
    /// host root, which is then the sandbox's root too.
    owner: Option<u32>,
}

/// What resolving a sandbox's volumes produced.
pub struct Resolved {
    pub mounts: Vec<HostMount>,
    /// Claims this call created.
    pub created: Vec<String>,
    /// Claims this sandbox created and must delete when it goes (if nobody else uses them).
    pub delete_on_exit: Vec<String>,
}

impl Volumes {
    pub fn new(data_dir: &Path, owner: Option<u32>) -> Self {
        Self {
            root: data_dir.join("volumes"),
            owner,
        }
    }

    fn dir(&self, claim: &str) -> PathBuf {
        self.root.join(claim)
    }

    fn leases(&self, claim: &str) -> PathBuf {
        self.root.join(".leases").join(claim)
    }

    /// Turns `volumes` into host mounts for sandbox `id`, creating and leasing named volumes. On
    /// error, what this call created or leased is undone.
    pub fn resolve(&self, id: &str, volumes: &[VolumeMount]) -> Result<Resolved, RuntimeError> {
        let mut out = Resolved {
            mounts: Vec::new(),
            created: Vec::new(),
            delete_on_exit: Vec::new(),
        };
        let result = (|| {
            for v in volumes {
                let (beneath, source, create) = match &v.source {
                    // Canonical when the server checked it: from `/`, with no link on the way, it
                    // is still what was checked (see `warren_core::beneath`).
                    VolumeSource::Host(p) => (PathBuf::from("/"), p.clone(), false),
                    VolumeSource::Named {
                        claim,
                        sub_path,
                        create_if_missing,
                        delete_on_termination,
                    } => {
                        let dir = self.dir(claim);
                        if !dir.is_dir() {
                            if !create_if_missing {
                                return Err(RuntimeError::Invalid(format!(
                                    "volume {claim:?} does not exist (createIfNotExists is false)"
                                )));
                            }
                            fs::create_dir_all(&dir)
                                .and_then(|()| match self.owner {
                                    Some(id) => std::os::unix::fs::chown(&dir, Some(id), Some(id)),
                                    None => Ok(()),
                                })
                                .map_err(|e| {
                                    RuntimeError::backend_with(
                                        format!("creating volume {claim}"),
                                        e,
                                    )
                                })?;
                            out.created.push(claim.clone());
                            if *delete_on_termination {
                                out.delete_on_exit.push(claim.clone());
                            }
                        }
                        self.lease(claim, id)?;
                        // k8s creates a missing subPath; so do we, inside the volume only: its
                        // contents are the sandboxes', and a link there must lead nowhere.
                        let source = match sub_path {
                            Some(sub) => dir.join(sub),
                            None => dir.clone(),
                        };
                        (dir, source, sub_path.is_some())
                    }
                };
                let mount = HostMount {
                    source,
                    beneath,
                    create,
                    target: v.target.clone(),
                    read_only: v.read_only,
                };
                // Checked (and a subPath made) now for a clear error; the sandbox's setup opens it
                // the same way again and mounts what it opened.
                mount.open_source().map_err(|e| match e.kind() {
                    io::ErrorKind::InvalidInput | io::ErrorKind::NotFound => {
                        RuntimeError::Invalid(format!("volume at {}: {e}", v.target))
                    }
                    _ => RuntimeError::backend_with(format!("volume at {}", v.target), e),
                })?;
                out.mounts.push(mount);
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(out),
            Err(e) => {
                self.release(id, volumes, &out.created);
                Err(e)
            }
        }
    }

    fn lease(&self, claim: &str, id: &str) -> Result<(), RuntimeError> {
        let dir = self.leases(claim);
        fs::create_dir_all(&dir)
            .and_then(|()| fs::write(dir.join(id), b""))
            .map_err(|e| RuntimeError::backend_with(format!("leasing volume {claim}"), e))
    }

    /// Drops sandbox `id`'s leases and deletes the volumes in `delete` that nobody else holds.
    pub fn release(&self, id: &str, volumes: &[VolumeMount], delete: &[String]) {
        let claims = volumes.iter().filter_map(|v| match &v.source {
            VolumeSource::Named { claim, .. } => Some(claim.as_str()),
            VolumeSource::Host(_) => None,
        });
        for claim in claims.chain(delete.iter().map(String::as_str)) {
            let leases = self.leases(claim);
            let _ = fs::remove_file(leases.join(id));
            let _ = fs::remove_dir(&leases); // only when empty
        }
        for claim in delete {
            if self.leases(claim).exists() {
                tracing::info!(volume = %claim, "volume still in use; not deleting it");
                continue;
            }
            if let Err(e) = warren_fstree::remove_all(self.dir(claim)) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(volume = %claim, error = %e, "deleting a volume");
                }
            }
        }
    }

    /// Drops every lease sandbox `id` holds (its volume list is not known any more, e.g. after a
    /// restart), and deletes the volumes in `delete` nobody else holds.
    pub fn release_all(&self, id: &str, delete: &[String]) {
        if let Ok(entries) = fs::read_dir(self.root.join(".leases")) {
            for e in entries.flatten() {
                let _ = fs::remove_file(e.path().join(id));
                let _ = fs::remove_dir(e.path());
            }
        }
        self.release(id, &[], delete);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(claim: &str, create: bool, delete: bool) -> VolumeMount {
        VolumeMount {
            target: format!("/mnt/{claim}"),
            read_only: false,
            source: VolumeSource::Named {
                claim: claim.into(),
                sub_path: None,
                create_if_missing: create,
                delete_on_termination: delete,
            },
        }
    }

    #[test]
    fn lifecycle_of_named_volumes() {
        let t = tempfile::tempdir().expect("tmp");
        let v = Volumes::new(t.path(), None);
        let a = [named("shared", true, true)];
        let r = v.resolve("sb1", &a).expect("create");
        assert_eq!(r.delete_on_exit, ["shared"]);
        fs::write(r.mounts[0].source.join("f"), "x").expect("write");
        // a second sandbox uses it (did not create it: nothing to delete on its exit)
        let r2 = v.resolve("sb2", &a).expect("reuse");
        assert!(r2.delete_on_exit.is_empty());
        // the creator goes first: the volume stays for sb2
        v.release("sb1", &a, &r.delete_on_exit);
        assert!(t.path().join("volumes/shared/f").exists());
        v.release("sb2", &a, &r2.delete_on_exit);
        assert!(
            t.path().join("volumes/shared/f").exists(),
            "only the creator deletes"
        );
        v.release_all("nobody", &["shared".to_string()]);
        assert!(!t.path().join("volumes/shared").exists());
        assert!(!t.path().join("volumes/.leases/shared").exists());
    }

    #[test]
    fn missing_volume_without_create_is_refused_and_nothing_stays() {
        let t = tempfile::tempdir().expect("tmp");
        let v = Volumes::new(t.path(), None);
        let vols = [named("made", true, false), named("absent", false, false)];
        let e = v.resolve("sb", &vols).err().expect("refused");
        assert!(matches!(e, RuntimeError::Invalid(_)), "{e}");
        assert!(
            !t.path().join("volumes/.leases/made/sb").exists(),
            "lease undone"
        );
        assert!(
            !t.path().join("volumes/made").exists(),
            "what the failed create made is gone"
        );
    }
}
