//! Staging: layers unpacked (and their digests checked) into `tmp/` without the store's lock,
//! ready to be moved in by a commit; and the layers already in the store a pull can reuse.

use std::collections::HashSet;
use std::fs;
use std::io::{BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::{
    hex_digest, source, unpack::unpack_layer, Budget, HashingReader, ImageError, ImageStore,
    Unpacked,
};

/// A layer of an import or pull in progress: unpacked into staging, or already in the store.
#[derive(Debug)]
pub struct StagedLayer {
    pub(crate) hex: String,
    /// Where it was unpacked, if it was (a layer already in the store is not unpacked again).
    pub(crate) staged: Option<PathBuf>,
    pub(crate) size: u64,
}

impl StagedLayer {
    /// The same layer again, for an image that lists it twice: the commit moves it in once and
    /// finds it in place the second time.
    pub fn duplicate(&self) -> StagedLayer {
        StagedLayer {
            hex: self.hex.clone(),
            staged: None,
            size: self.size,
        }
    }
}

/// The staging folder of one pull (see [`ImageStore::staging`]).
pub struct Staging {
    pub(crate) dir: tempfile::TempDir,
    /// The pulled image's layers together are held to the store's [`UnpackLimits`].
    pub(crate) budget: Budget,
}

impl Staging {
    /// Unpacks layer `index` of the image from its blob stream (gzip, zstd or plain tar, recognised
    /// from the stream), refusing unsafe entries and checking the blob digest and the diff_id
    /// (`sha256:<hex>` each). May be called from several threads for different indexes.
    pub fn unpack_layer(
        &self,
        index: usize,
        blob: impl Read,
        label: &Path,
        blob_digest: &str,
        diff_id: &str,
    ) -> Result<StagedLayer, ImageError> {
        let bad = |d: &str| ImageError::source(label, format!("bad digest {d:?}"));
        let blob_hex = hex_digest(blob_digest).ok_or_else(|| bad(blob_digest))?;
        let diff_hex = hex_digest(diff_id).ok_or_else(|| bad(diff_id))?;
        let dest = make_stage_dir(self.dir.path(), index)?;
        unpack_verified(
            blob,
            dest,
            label,
            Some(blob_hex),
            Some(diff_hex),
            &self.budget,
        )
    }
}

/// Unpacks one layer blob (gzip, zstd or plain tar) into `dest`, checking the blob's and the
/// uncompressed tar's sha256 (hex) where they are known. On any error `dest` may hold a partial
/// layer; it lives in staging, which its owner removes.
pub(crate) fn unpack_verified(
    blob: impl Read,
    dest: PathBuf,
    label: &Path,
    blob_digest: Option<&str>,
    diff_id: Option<&str>,
    budget: &Budget,
) -> Result<StagedLayer, ImageError> {
    let mut raw = HashingReader::new(blob);
    let unpacked = {
        let buffered = BufReader::with_capacity(256 * 1024, &mut raw);
        unpack_layer(source::decompressed(buffered, label)?, &dest, label, budget)?
    };
    raw.drain()
        .map_err(|e| ImageError::source_with(label, "read layer", e))?;
    if let Some(expected) = blob_digest {
        let actual = raw.hex_digest();
        if actual != expected {
            return Err(ImageError::DigestMismatch {
                path: label.to_path_buf(),
                what: "layer blob",
                expected: format!("sha256:{expected}"),
                actual: format!("sha256:{actual}"),
            });
        }
    }
    if let Some(expected) = diff_id {
        // The blob was what the manifest promised, so the image itself is inconsistent.
        if unpacked.digest != expected {
            return Err(ImageError::source(
                label,
                format!(
                    "uncompressed layer has digest sha256:{}, the image config says sha256:{expected} (diff_id)",
                    unpacked.digest
                ),
            ));
        }
    }
    staged(unpacked, dest)
}

pub(crate) fn staged(unpacked: Unpacked, dest: PathBuf) -> Result<StagedLayer, ImageError> {
    let size = unpacked.bytes;
    Ok(StagedLayer {
        hex: unpacked.digest,
        staged: Some(dest),
        size,
    })
}

pub(crate) fn make_stage_dir(staging: &Path, index: usize) -> Result<PathBuf, ImageError> {
    let dir = staging.join(index.to_string());
    fs::create_dir(&dir).map_err(ImageError::io("create staging dir", &dir))?;
    Ok(dir)
}

/// Apparent size of the regular files under `root`, each inode counted once.
pub(crate) fn dir_size(root: &Path) -> Result<u64, ImageError> {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = fs::read_dir(&dir).map_err(ImageError::io("read dir", &dir))?;
        for entry in entries {
            let entry = entry.map_err(ImageError::io("read dir", &dir))?;
            let meta = entry
                .metadata()
                .map_err(ImageError::io("stat", entry.path()))?;
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() && (meta.nlink() == 1 || seen.insert((meta.dev(), meta.ino())))
            {
                total += meta.len();
            }
        }
    }
    Ok(total)
}

impl ImageStore {
    /// A private staging folder for the layers of one pull; removed (with whatever is in it) on drop.
    pub fn staging(&self) -> Result<Staging, ImageError> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("pull-{}-", std::process::id()))
            .tempdir_in(self.tmp_dir())
            .map_err(ImageError::io("create staging dir", self.tmp_dir()))?;
        Ok(Staging {
            dir,
            budget: Budget::new(self.limits),
        })
    }

    /// The layer with this diff_id (`sha256:<hex>`) if the store has it, so a pull need not fetch it.
    /// A layer a concurrent collection is removing may still vanish before [`commit_pulled`]
    /// (which then answers `None`).
    ///
    /// [`commit_pulled`]: Self::commit_pulled
    pub fn existing_layer(&self, diff_id: &str) -> Option<StagedLayer> {
        let hex = hex_digest(diff_id)?;
        let path = self.layers_dir().join(hex);
        let size = dir_size(&path).ok()?;
        Some(StagedLayer {
            hex: hex.to_owned(),
            staged: None,
            size,
        })
    }
}
