//! Commits: staged layers moved into the store and the image's name published, under the
//! store's lock (pulled images and snapshots); an import's layers go the same way.

use std::fs::{self, File};
use std::io::BufReader;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::{
    dirtar, gc::empty_trash, hex_digest, record, rootfs_image, source, staging::dir_size,
    staging::make_stage_dir, staging::staged, staging::unpack_verified, unpack::unpack_layer,
    Budget, ImageConfig, ImageError, ImageMeta, ImagePlan, ImageRecord, ImageStore, Plan,
    Reference, ResolvedImage, StagedLayer,
};

impl ImageStore {
    /// Publishes a pulled image: moves its new layers in and points `name` at `id` (the config
    /// digest), recording the manifest `digest`. `None` if a layer meant to be reused is gone (pull
    /// it again).
    pub fn commit_pulled(
        &self,
        name: &str,
        id: &str,
        config: ImageConfig,
        digest: &str,
        layers: &[StagedLayer],
    ) -> Result<Option<ImageRecord>, ImageError> {
        let reference = Reference::parse(name)?;
        if reference.is_host() {
            return Err(ImageError::InvalidName {
                name: name.to_owned(),
                reason: "the name host is reserved for the built-in image",
            });
        }
        if hex_digest(id).is_none() {
            return Err(ImageError::InvalidName {
                name: id.to_owned(),
                reason: "an image id is sha256:<64 hex>",
            });
        }
        self.commit(
            &reference.to_string(),
            id.to_owned(),
            config,
            Some(digest.to_owned()),
            layers,
        )
    }

    /// Names `name` an image of `base`'s layers plus the overlayfs upper directory `upper` as a new
    /// top layer (whiteouts and opaque directories kept), with `base`'s config: the file system of a
    /// sandbox made from `base`, whose upper that is. The caller keeps `upper` still meanwhile
    /// (a frozen sandbox). `base`'s layers must be in the store (the sandbox's lease keeps them).
    /// `id_base`: the sandbox ran in a user namespace whose id 0 is that host id; the layer records
    /// its files with the sandbox's own ids, so any sandbox made from it sees them the same.
    /// Answers the image and the bytes of its new top layer (what it adds to the store).
    pub fn commit_snapshot(
        &self,
        name: &str,
        base: &ResolvedImage,
        upper: &Path,
        id_base: Option<u32>,
    ) -> Result<(ImageRecord, u64), ImageError> {
        let ResolvedImage::Layers {
            layers: base_layers,
            config,
            ..
        } = base
        else {
            return Err(ImageError::source(
                upper,
                "a sandbox of the built-in host image has no layers to snapshot",
            ));
        };
        let reference = Reference::parse(name)?;
        let name = reference.to_string();
        let staging = self.staging()?;
        let dest = make_stage_dir(staging.dir.path(), 0)?;
        let top = staged(
            dirtar::unpack_upper(upper, &dest, id_base, &Budget::new(self.limits))?,
            dest,
        )?;
        let mut layers = Vec::with_capacity(base_layers.len() + 1);
        for path in base_layers {
            let hex = path
                .file_name()
                .and_then(|n| n.to_str())
                .filter(|h| hex_digest(&format!("sha256:{h}")).is_some())
                .ok_or_else(|| ImageError::source(path, "not a layer of this store"))?;
            let layer = self
                .existing_layer(&format!("sha256:{hex}"))
                .ok_or_else(|| ImageError::source(path, "base layer missing from the store"))?;
            layers.push(layer);
        }
        let doc = serde_json::json!({
            "layers": layers.iter().map(|l| format!("sha256:{}", l.hex)).chain([format!("sha256:{}", top.hex)]).collect::<Vec<_>>(),
            "config": config,
        });
        let id = format!(
            "sha256:{}",
            hex::encode(Sha256::digest(doc.to_string().as_bytes()))
        );
        let adds = top.size;
        layers.push(top);
        let image = self
            .commit(&name, id, config.clone(), None, &layers)?
            .ok_or_else(|| ImageError::source(upper, "base layers vanished during the snapshot"))?;
        Ok((image, adds))
    }

    /// Unpacks what is not in the store yet into `staging`.
    pub(crate) fn prepare(
        &self,
        reference: &Reference,
        source: &Path,
        staging: &Path,
        reuse: bool,
        budget: &Budget,
    ) -> Result<(String, ImageConfig, Vec<StagedLayer>), ImageError> {
        match source::plan(source, &self.tmp_dir(), reference)? {
            Plan::RootfsDir(dir) => {
                let dest = make_stage_dir(staging, 0)?;
                let exclude = fs::metadata(&self.root).ok().map(|m| (m.dev(), m.ino()));
                let unpacked = dirtar::unpack_dir(&dir, &dest, exclude, budget)?;
                Ok(rootfs_image(staged(unpacked, dest)?))
            }
            Plan::RootfsTar(path) => {
                let dest = make_stage_dir(staging, 0)?;
                let file = File::open(&path).map_err(ImageError::io("open source", &path))?;
                let reader =
                    source::decompressed(BufReader::with_capacity(256 * 1024, file), &path)?;
                let unpacked = unpack_layer(reader, &dest, &path, budget)?;
                if unpacked.entries == 0 {
                    return Err(ImageError::source(&path, "empty archive"));
                }
                Ok(rootfs_image(staged(unpacked, dest)?))
            }
            Plan::Image(plan) => {
                let layers = self.prepare_layers(&plan, staging, reuse, budget)?;
                Ok((plan.id, plan.config, layers))
            }
        }
    }

    fn prepare_layers(
        &self,
        plan: &ImagePlan,
        staging: &Path,
        reuse: bool,
        budget: &Budget,
    ) -> Result<Vec<StagedLayer>, ImageError> {
        let mut out: Vec<StagedLayer> = Vec::with_capacity(plan.layers.len());
        for (i, layer) in plan.layers.iter().enumerate() {
            if let Some(diff_id) = &layer.diff_id {
                let done = out.iter().find(|p| &p.hex == diff_id).map(|p| p.size);
                let existing = self.layers_dir().join(diff_id);
                let size = match done {
                    Some(size) => Some(size),
                    // Unreadable means a concurrent remove is collecting it: unpack our own copy.
                    None if reuse && existing.is_dir() => dir_size(&existing).ok(),
                    None => None,
                };
                if let Some(size) = size {
                    out.push(StagedLayer {
                        hex: diff_id.clone(),
                        staged: None,
                        size,
                    });
                    continue;
                }
            }
            let label = plan.bundle.member_label(&layer.member);
            let dest = make_stage_dir(staging, i)?;
            out.push(unpack_verified(
                plan.bundle.open(&layer.member)?,
                dest,
                &label,
                layer.blob_digest.as_deref(),
                layer.diff_id.as_deref(),
                budget,
            )?);
        }
        Ok(out)
    }

    /// Moves new layers in and publishes the image under `name`, all under the lock. `None` if a layer
    /// we meant to reuse is gone.
    pub(crate) fn commit(
        &self,
        name: &str,
        id: String,
        config: ImageConfig,
        digest: Option<String>,
        layers: &[StagedLayer],
    ) -> Result<Option<ImageRecord>, ImageError> {
        let (meta, trash) = {
            let _lock = self.lock(true)?;
            for layer in layers {
                let dest = self.layers_dir().join(&layer.hex);
                if dest.is_dir() {
                    continue;
                }
                let Some(staged) = &layer.staged else {
                    return Ok(None);
                };
                fs::rename(staged, &dest).map_err(ImageError::io("store layer", &dest))?;
            }
            let meta = match self.read_image(&id)? {
                Some(meta) => meta,
                None => {
                    let meta = ImageMeta {
                        id: id.clone(),
                        layers: layers.iter().map(|l| format!("sha256:{}", l.hex)).collect(),
                        config,
                        size_bytes: layers.iter().map(|l| l.size).sum(),
                        created_at: chrono::Utc::now()
                            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    };
                    self.write_json(&self.image_path(&id)?, &meta)?;
                    meta
                }
            };
            let mut names = self.read_names()?;
            let previous = names.names.insert(name.to_owned(), id);
            match &digest {
                Some(d) => names.digests.insert(name.to_owned(), d.clone()),
                None => names.digests.remove(name),
            };
            self.write_names(&names)?;
            // Retagging may have orphaned the previous image.
            let trash = if previous.is_some() {
                self.gc_locked()?
            } else {
                Vec::new()
            };
            (meta, trash)
        };
        empty_trash(trash);
        Ok(Some(record(name.to_owned(), &meta, digest)))
    }
}
