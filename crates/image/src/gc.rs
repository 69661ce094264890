//! Garbage collection: images no name points to, layers no image or lease holds, and staging
//! left behind by processes that are gone; removed by renaming into the trash under the lock,
//! then deleted outside it.

use std::collections::HashSet;
use std::fs;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{
    hex_digest, read_dir_names, staging::dir_size, ImageError, ImageStore, SNAPSHOT_REPOSITORY,
};

/// What [`ImageStore::prune`] removed (or would remove).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pruned {
    pub removed: Vec<String>,
    pub reclaimed_bytes: u64,
}

pub(crate) fn empty_trash(trash: Vec<PathBuf>) {
    for dir in trash {
        // Already unreachable from the store; a leftover is retried by the next `open`.
        let _ = warren_fstree::remove_all(&dir);
    }
}

fn process_alive(pid: i32) -> bool {
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(nix::errno::Errno::ESRCH) => false,
        Err(_) => true,
    }
}

impl ImageStore {
    /// Removes every named image no sandbox holds a lease on (snapshots excepted),
    /// and staging left by dead processes. Returns the names removed and the bytes their layers took
    /// (layers another image still uses are not counted).
    pub fn prune(&self, dry_run: bool) -> Result<Pruned, ImageError> {
        self.clean_stale_tmp()?;
        let (pruned, trash) = {
            let _lock = self.lock(true)?;
            let mut names = self.read_names()?;
            // In use: named by a sandbox's lease. Layers a lease holds survive the collection
            // anyway, so they are not counted as reclaimed.
            let mut in_use: HashSet<String> = HashSet::new();
            let mut kept_layers: HashSet<String> = HashSet::new();
            self.leases.read(|live| {
                for lease in live.values() {
                    in_use.insert(lease.image.clone());
                    kept_layers.extend(lease.layers.iter().cloned());
                }
            })?;
            // Old lease files are moved into the journal when the store opens; one left is one
            // that could not be read, and stops the prune as it always did.
            for lease in self.old_leases()? {
                let lease = lease?;
                in_use.insert(lease.image);
                kept_layers.extend(lease.layers);
            }
            let mut removed = Vec::new();
            let mut doomed_layers: HashSet<String> = HashSet::new();
            for (name, id) in &names.names {
                let Some(meta) = self.read_image(id)? else {
                    continue;
                };
                if in_use.contains(name) || name.starts_with(SNAPSHOT_REPOSITORY) {
                    kept_layers.extend(meta.layers);
                } else {
                    removed.push(name.clone());
                    doomed_layers.extend(meta.layers);
                }
            }
            let mut reclaimed = 0;
            for layer in doomed_layers.difference(&kept_layers) {
                if let Some(hex) = hex_digest(layer) {
                    reclaimed += dir_size(&self.layers_dir().join(hex)).unwrap_or(0);
                }
            }
            let trash = if dry_run || removed.is_empty() {
                Vec::new()
            } else {
                for name in &removed {
                    names.names.remove(name);
                    names.digests.remove(name);
                }
                self.write_names(&names)?;
                self.gc_locked()?
            };
            (
                Pruned {
                    removed,
                    reclaimed_bytes: reclaimed,
                },
                trash,
            )
        };
        empty_trash(trash);
        Ok(pruned)
    }

    /// Deletes image metadata no name refers to and moves unreferenced layers to `tmp/` (returned, to
    /// be deleted once the lock is released). If any metadata cannot be read, no layer is touched.
    pub(crate) fn gc_locked(&self) -> Result<Vec<PathBuf>, ImageError> {
        let names = self.read_names()?;
        let named: HashSet<&String> = names.names.values().collect();
        let mut keep: HashSet<String> = HashSet::new();
        let mut complete = true;

        let images_dir = self.images_dir();
        for entry in read_dir_names(&images_dir)? {
            let Some(hex) = entry.strip_suffix(".json") else {
                continue;
            };
            let id = format!("sha256:{hex}");
            if hex_digest(&id).is_none() {
                continue;
            }
            if !named.contains(&id) {
                let path = images_dir.join(&entry);
                fs::remove_file(&path).map_err(ImageError::io("remove image", &path))?;
                continue;
            }
            match self.read_image(&id) {
                Ok(Some(meta)) => keep.extend(meta.layers),
                _ => complete = false,
            }
        }
        self.leases.read(|live| {
            for lease in live.values() {
                keep.extend(lease.layers.iter().cloned());
            }
        })?;
        for lease in self.old_leases()? {
            match lease {
                Ok(lease) => keep.extend(lease.layers),
                Err(_) => complete = false,
            }
        }
        if !complete {
            return Ok(Vec::new());
        }

        let mut trash = Vec::new();
        let layers_dir = self.layers_dir();
        for entry in read_dir_names(&layers_dir)? {
            let digest = format!("sha256:{entry}");
            if hex_digest(&digest).is_none() || keep.contains(&digest) {
                continue;
            }
            let doomed = tempfile::Builder::new()
                .prefix(&format!("gc-{}-", std::process::id()))
                .tempdir_in(self.tmp_dir())
                .map_err(ImageError::io("create dir", self.tmp_dir()))?
                .keep();
            let from = layers_dir.join(&entry);
            let to = doomed.join("layer");
            fs::rename(&from, &to).map_err(ImageError::io("remove layer", &from))?;
            trash.push(doomed);
        }
        Ok(trash)
    }

    /// Removes `tmp/` entries whose owning process is gone.
    pub(crate) fn clean_stale_tmp(&self) -> Result<(), ImageError> {
        let tmp = self.tmp_dir();
        let me = std::process::id();
        for entry in read_dir_names(&tmp)? {
            let pid = entry.split('-').nth(1).and_then(|p| p.parse::<i32>().ok());
            let Some(pid) = pid else { continue };
            if pid as u32 == me || process_alive(pid) {
                continue;
            }
            let path = tmp.join(&entry);
            let _ = warren_fstree::remove_all(&path);
        }
        Ok(())
    }
}
