//! The local, content-addressed image store the native runtime stacks with overlayfs.
//!
//! Layout under `<data_dir>/images`:
//!
//! ```text
//! lock                   flock: exclusive for every change, shared for reads
//! names.json             {"names": {"python:3.11": "sha256:<id>"}}, replaced atomically
//! images/<id-hex>.json   layers (lowest first), config, size, created_at
//! layers/<diff-id-hex>/  one extracted layer, overlayfs whiteout format, shared between images
//! leases.jsonl           layers each sandbox is using, kept until released: an append-only journal
//!                        (see `leases`; `leases/<holder>.json` files of older stores are moved in)
//! tmp/                   staging (import-*, unzip-*, gc-*, meta-*), all named with the owner's pid
//! ```
//!
//! Layers are named by the sha256 of their uncompressed tar (for a folder, of a deterministic tar of
//! it). Imports unpack into `tmp/` without holding the lock and take it only to move layers in and
//! publish the name, so a long import never blocks a server resolving or leasing images; garbage
//! collection runs under the same lock, so it never sees half an import.

mod dirtar;
mod error;
mod leases;
pub mod oci;
mod reference;
mod source;
mod unpack;

/// Entry points for the fuzz targets in `fuzz/`; not an API.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    use std::path::Path;

    /// Unpacks one uncompressed layer tar into the empty folder `dest`, as pulls and imports do.
    pub fn unpack_layer(tar: &[u8], dest: &Path) -> Result<u64, crate::ImageError> {
        let budget = crate::unpack::Budget::new(crate::UnpackLimits::default());
        crate::unpack::unpack_layer(tar, dest, Path::new("fuzz"), &budget).map(|u| u.entries)
    }
}

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use error::{BoxError, ImageError};
pub use reference::{Reference, DOCKER_HUB, HOST_IMAGE};

use source::{hex_digest, ImagePlan, Plan};
use unpack::{unpack_layer, Budget, HashingReader, Unpacked};
pub use unpack::{UnpackLimits, MAX_DEPTH};

/// Images under this repository are sandbox snapshots, made and removed through the snapshot API;
/// `prune` leaves them alone.
pub const SNAPSHOT_REPOSITORY: &str = "warren-snapshot/";

/// Whether [`ImageStore::resolve`] takes `name` as an image id (`sha256:<64 hex>`), not a name.
pub fn is_image_id(name: &str) -> bool {
    hex_digest(name).is_some()
}

/// What a sandbox's runtime takes from an image: the types live in `warren-core` (the runtime
/// boundary), the store that makes them here.
pub use warren_core::image::{ImageConfig, ResolvedImage};

/// The store's id for the built-in `host` image (it has no content to hash).
pub const HOST_IMAGE_ID: &str = "host";
const MAX_HOLDER_LEN: usize = 128;

/// One named image as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// Normalised reference (`debian:latest`).
    pub name: String,
    /// `sha256:<hex>`: the config blob digest for docker/OCI imports, a digest of layers and config for
    /// rootfs imports; [`HOST_IMAGE_ID`] for the built-in image.
    pub id: String,
    /// Layer digests (`sha256:<hex>` of the uncompressed tar), lowest first.
    pub layers: Vec<String>,
    /// The registry manifest digest the name was pulled at (`None` for imports).
    #[serde(default)]
    pub digest: Option<String>,
    /// Sum of the apparent sizes of the layers' files (hardlinks counted once per layer).
    pub size_bytes: u64,
    /// RFC 3339, when the image (by id) was first imported.
    pub created_at: String,
    pub builtin: bool,
}

/// `images/<id-hex>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ImageMeta {
    id: String,
    layers: Vec<String>,
    config: ImageConfig,
    size_bytes: u64,
    created_at: String,
}

/// `names.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Names {
    names: BTreeMap<String, String>,
    /// Name -> the manifest digest it was pulled at (pulled names only).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    digests: BTreeMap<String, String>,
}

use leases::{Lease, Leases};

/// A layer of an import or pull in progress: unpacked into staging, or already in the store.
#[derive(Debug)]
pub struct StagedLayer {
    hex: String,
    /// Where it was unpacked, if it was (a layer already in the store is not unpacked again).
    staged: Option<PathBuf>,
    size: u64,
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

/// What [`ImageStore::prune`] removed (or would remove).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pruned {
    pub removed: Vec<String>,
    pub reclaimed_bytes: u64,
}

/// The staging folder of one pull (see [`ImageStore::staging`]).
pub struct Staging {
    dir: tempfile::TempDir,
    /// The pulled image's layers together are held to the store's [`UnpackLimits`].
    budget: Budget,
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

pub struct ImageStore {
    root: PathBuf,
    leases: Leases,
    limits: UnpackLimits,
}

impl ImageStore {
    /// Opens (creating if needed) the store at `<data_dir>/images`, removes staging left behind by
    /// processes that died mid-import and collects unreferenced layers.
    pub fn open(data_dir: &Path) -> Result<Self, ImageError> {
        let root = data_dir.join("images");
        let store = ImageStore {
            leases: Leases::new(root.join("leases.jsonl")),
            root,
            limits: UnpackLimits::default(),
        };
        for dir in [
            store.root.clone(),
            store.layers_dir(),
            store.images_dir(),
            store.tmp_dir(),
        ] {
            fs::create_dir_all(&dir).map_err(ImageError::io("create dir", &dir))?;
        }
        let lock = store.lock_path();
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&lock)
            .map_err(ImageError::io("create lock file", &lock))?;
        store.clean_stale_tmp()?;
        // Collects what a process that died mid-commit or mid-collection left unreferenced.
        let trash = {
            let _lock = store.lock(true)?;
            leases::migrate_files(&store.old_leases_dir(), &store.leases)?;
            store.gc_locked()?
        };
        empty_trash(trash);
        Ok(store)
    }

    /// Bounds what each import, pull and snapshot may unpack to from now on (default:
    /// [`UnpackLimits::default`]); a depth past [`MAX_DEPTH`] counts as that.
    pub fn set_unpack_limits(&mut self, limits: UnpackLimits) {
        self.limits = limits;
    }

    /// The store's root directory (`<data_dir>/images`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Imports `source` (rootfs folder, rootfs tarball, docker-save archive or OCI layout, as a folder or
    /// a tar, gzipped or not) under `name`, replacing whatever that name pointed to.
    pub fn import(&self, name: &str, source: &Path) -> Result<ImageRecord, ImageError> {
        let reference = Reference::parse(name)?;
        if reference.is_host() {
            return Err(ImageError::InvalidName {
                name: name.to_owned(),
                reason: "the name host is reserved for the built-in image",
            });
        }
        if reference.digest.is_some() {
            return Err(ImageError::InvalidName {
                name: name.to_owned(),
                reason: "an imported image is named by tag, not digest",
            });
        }
        let name = reference.to_string();
        // First try reuses layers already in the store; should one vanish (a concurrent remove) before
        // we publish, the second try unpacks every layer itself.
        for reuse in [true, false] {
            let staging = tempfile::Builder::new()
                .prefix(&format!("import-{}-", std::process::id()))
                .tempdir_in(self.tmp_dir())
                .map_err(ImageError::io("create staging dir", self.tmp_dir()))?;
            let (id, config, layers) = self.prepare(
                &reference,
                source,
                staging.path(),
                reuse,
                &Budget::new(self.limits),
            )?;
            if let Some(record) = self.commit(&name, id, config, None, &layers)? {
                return Ok(record);
            }
        }
        Err(ImageError::source(source, "store changed during import"))
    }

    /// All named images, the built-in `host` first, then by name.
    pub fn list(&self) -> Result<Vec<ImageRecord>, ImageError> {
        let _lock = self.lock(false)?;
        let names = self.read_names()?;
        let mut metas: HashMap<String, ImageMeta> = HashMap::new();
        let mut out = vec![host_record()];
        for (name, id) in names.names {
            if !metas.contains_key(&id) {
                let Some(meta) = self.read_image(&id)? else {
                    continue;
                };
                metas.insert(id.clone(), meta);
            }
            if let Some(meta) = metas.get(&id) {
                let digest = names.digests.get(&name).cloned();
                out.push(record(name, meta, digest));
            }
        }
        Ok(out)
    }

    /// Removes the name; the image and its layers go once nothing (name or lease) refers to them.
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        let reference = Reference::parse(name)?;
        if reference.is_host() {
            return Err(ImageError::InvalidName {
                name: name.to_owned(),
                reason: "the built-in host image cannot be removed",
            });
        }
        let name = reference.to_string();
        let trash = {
            let _lock = self.lock(true)?;
            let mut names = self.read_names()?;
            if names.names.remove(&name).is_none() {
                return Err(ImageError::NotFound { name });
            }
            names.digests.remove(&name);
            self.write_names(&names)?;
            self.gc_locked()?
        };
        empty_trash(trash);
        Ok(())
    }

    /// The names that point at image `id` (`sha256:<hex>`), by name. [`ImageStore::resolve`]
    /// takes an id as well as a name, so whoever decides what a caller may run by name must also
    /// know which names an id stands for (a snapshot's image is reachable by its id too).
    pub fn names_of(&self, id: &str) -> Result<Vec<String>, ImageError> {
        let _lock = self.lock(false)?;
        Ok(self
            .read_names()?
            .names
            .into_iter()
            .filter(|(_, image)| image == id)
            .map(|(name, _)| name)
            .collect())
    }

    /// Resolves a name (or an image id `sha256:<hex>`) to its layers and config.
    pub fn resolve(&self, name: &str) -> Result<ResolvedImage, ImageError> {
        let by_id = hex_digest(name).map(|hex| format!("sha256:{hex}"));
        let name = match &by_id {
            Some(_) => name.to_owned(),
            None => {
                let reference = Reference::parse(name)?;
                if reference.is_host() {
                    return Ok(ResolvedImage::Host);
                }
                reference.to_string()
            }
        };
        let not_found = || ImageError::NotFound { name: name.clone() };
        let _lock = self.lock(false)?;
        let id = match by_id {
            Some(id) => id,
            None => self
                .read_names()?
                .names
                .get(&name)
                .cloned()
                .ok_or_else(not_found)?,
        };
        let meta = self.read_image(&id)?.ok_or_else(not_found)?;
        let layers = dedup_keep_last(&meta.layers)
            .into_iter()
            .map(|d| self.layers_dir().join(d.trim_start_matches("sha256:")))
            .collect();
        Ok(ResolvedImage::Layers {
            name,
            id: meta.id,
            layers,
            config: meta.config,
        })
    }

    /// Records that `holder` (a sandbox) uses the image's layers, so they survive removal of the image
    /// until [`release`](Self::release). Re-leasing the same layers is a no-op; a holder can hold one
    /// image only. The `host` image has nothing to hold.
    pub fn lease(&self, holder: &str, image: &ResolvedImage) -> Result<(), ImageError> {
        validate_holder(holder)?;
        let ResolvedImage::Layers {
            name,
            layers,
            id,
            config,
        } = image
        else {
            return Ok(());
        };
        let layers_dir = self.layers_dir();
        let mut digests = Vec::with_capacity(layers.len());
        for path in layers {
            let hex = path
                .strip_prefix(&layers_dir)
                .ok()
                .and_then(|p| p.to_str())
                .filter(|h| hex_digest(&format!("sha256:{h}")).is_some())
                .ok_or_else(|| ImageError::NotFound { name: name.clone() })?;
            digests.push(format!("sha256:{hex}"));
        }
        let _lock = self.lock(true)?;
        // Resolve and lease are separate calls: the image may have been removed in between.
        if layers.iter().any(|p| !p.is_dir()) {
            return Err(ImageError::NotFound { name: name.clone() });
        }
        let lease = Lease {
            image: name.clone(),
            layers: digests,
            id: id.clone(),
            config: Some(config.clone()),
        };
        match self.leases.add(holder, lease.clone())? {
            Some(held) if held.layers != lease.layers => Err(ImageError::InUse {
                holder: holder.to_owned(),
            }),
            _ => Ok(()),
        }
    }

    /// The image `holder` leased, as it was when leased (`None` without a lease or for `host`).
    pub fn leased(&self, holder: &str) -> Result<Option<ResolvedImage>, ImageError> {
        validate_holder(holder)?;
        let _lock = self.lock(false)?;
        let Some(lease) = self.leases.read(|live| live.get(holder).cloned())? else {
            return Ok(None);
        };
        let Some(config) = lease.config else {
            return Ok(None);
        };
        let layers = lease
            .layers
            .iter()
            .filter_map(|d| hex_digest(d).map(|h| self.layers_dir().join(h)))
            .collect();
        Ok(Some(ResolvedImage::Layers {
            name: lease.image,
            id: lease.id,
            layers,
            config,
        }))
    }

    /// Drops `holder`'s lease (if any) and collects what it alone kept alive.
    pub fn release(&self, holder: &str) -> Result<(), ImageError> {
        validate_holder(holder)?;
        let trash = {
            let _lock = self.lock(true)?;
            let Some(lease) = self.leases.remove(holder)? else {
                return Ok(());
            };
            // An image that still has a name keeps its layers (an id is the hash of its layers
            // and config): nothing to collect, and no need to read every image's metadata.
            if !lease.id.is_empty() && self.read_names()?.names.values().any(|id| *id == lease.id) {
                return Ok(());
            }
            self.gc_locked()?
        };
        empty_trash(trash);
        Ok(())
    }

    // ---- pulls (and other importers that bring their own layer streams) ----

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

    // ---- import ----

    /// Unpacks what is not in the store yet into `staging`.
    fn prepare(
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
    fn commit(
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

    // ---- garbage collection ----

    /// Deletes image metadata no name refers to and moves unreferenced layers to `tmp/` (returned, to
    /// be deleted once the lock is released). If any metadata cannot be read, no layer is touched.
    fn gc_locked(&self) -> Result<Vec<PathBuf>, ImageError> {
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
    fn clean_stale_tmp(&self) -> Result<(), ImageError> {
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

    // ---- files ----

    fn layers_dir(&self) -> PathBuf {
        self.root.join("layers")
    }
    fn images_dir(&self) -> PathBuf {
        self.root.join("images")
    }
    /// Where leases were kept, a file each, before the journal.
    fn old_leases_dir(&self) -> PathBuf {
        self.root.join("leases")
    }
    /// The leases still in files of [`Self::old_leases_dir`] (none once moved into the journal).
    fn old_leases(&self) -> Result<Vec<Result<Lease, ImageError>>, ImageError> {
        let dir = self.old_leases_dir();
        if !dir.exists() {
            return Ok(Vec::new());
        }
        Ok(read_dir_names(&dir)?
            .into_iter()
            .filter(|n| n.ends_with(".json"))
            .filter_map(|n| read_json::<Lease>(&dir.join(n)).transpose())
            .collect())
    }
    fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }
    fn lock_path(&self) -> PathBuf {
        self.root.join("lock")
    }
    fn names_path(&self) -> PathBuf {
        self.root.join("names.json")
    }
    fn image_path(&self, id: &str) -> Result<PathBuf, ImageError> {
        let hex = hex_digest(id).ok_or_else(|| ImageError::NotFound {
            name: id.to_owned(),
        })?;
        Ok(self.images_dir().join(format!("{hex}.json")))
    }

    fn lock(&self, exclusive: bool) -> Result<Flock<File>, ImageError> {
        let path = self.lock_path();
        let arg = if exclusive {
            FlockArg::LockExclusive
        } else {
            FlockArg::LockShared
        };
        let mut file = OpenOptions::new()
            .read(true)
            .open(&path)
            .map_err(ImageError::io("open lock", &path))?;
        loop {
            match Flock::lock(file, arg) {
                Ok(lock) => return Ok(lock),
                Err((f, nix::errno::Errno::EINTR)) => file = f,
                Err((_, e)) => return Err(ImageError::io("lock", &path)(e.into())),
            }
        }
    }

    fn read_names(&self) -> Result<Names, ImageError> {
        Ok(read_json(&self.names_path())?.unwrap_or_default())
    }

    fn write_names(&self, names: &Names) -> Result<(), ImageError> {
        self.write_json(&self.names_path(), names)
    }

    fn read_image(&self, id: &str) -> Result<Option<ImageMeta>, ImageError> {
        read_json(&self.image_path(id)?)
    }

    /// Write to a temp file, fsync, rename over: readers see the old or the new file, never half.
    fn write_json<T: Serialize>(&self, path: &Path, value: &T) -> Result<(), ImageError> {
        let mut data = serde_json::to_vec_pretty(value).map_err(|e| ImageError::Corrupt {
            path: path.to_path_buf(),
            source: e,
        })?;
        data.push(b'\n');
        let tmp = self.tmp_dir();
        let mut file = tempfile::Builder::new()
            .prefix(&format!("meta-{}-", std::process::id()))
            .tempfile_in(&tmp)
            .map_err(ImageError::io("create temp file", &tmp))?;
        file.write_all(&data)
            .and_then(|()| file.as_file().sync_all())
            .map_err(ImageError::io("write", file.path()))?;
        file.persist(path)
            .map_err(|e| ImageError::io("replace", path)(e.error))?;
        Ok(())
    }
}

fn host_record() -> ImageRecord {
    ImageRecord {
        name: HOST_IMAGE.to_owned(),
        id: HOST_IMAGE_ID.to_owned(),
        layers: Vec::new(),
        digest: None,
        size_bytes: 0,
        created_at: "1970-01-01T00:00:00Z".to_owned(),
        builtin: true,
    }
}

fn record(name: String, meta: &ImageMeta, digest: Option<String>) -> ImageRecord {
    ImageRecord {
        name,
        id: meta.id.clone(),
        layers: meta.layers.clone(),
        digest,
        size_bytes: meta.size_bytes,
        created_at: meta.created_at.clone(),
        builtin: false,
    }
}

/// A rootfs import: one layer, empty config, id derived from both.
fn rootfs_image(layer: StagedLayer) -> (String, ImageConfig, Vec<StagedLayer>) {
    let config = ImageConfig::default();
    let id = rootfs_id(&layer.hex, &config);
    (id, config, vec![layer])
}

fn rootfs_id(layer_hex: &str, config: &ImageConfig) -> String {
    let doc = serde_json::json!({ "layers": [format!("sha256:{layer_hex}")], "config": config });
    format!(
        "sha256:{}",
        hex::encode(Sha256::digest(doc.to_string().as_bytes()))
    )
}

/// Unpacks one layer blob (gzip, zstd or plain tar) into `dest`, checking the blob's and the
/// uncompressed tar's sha256 (hex) where they are known. On any error `dest` may hold a partial
/// layer; it lives in staging, which its owner removes.
fn unpack_verified(
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

fn staged(unpacked: Unpacked, dest: PathBuf) -> Result<StagedLayer, ImageError> {
    let size = unpacked.bytes;
    Ok(StagedLayer {
        hex: unpacked.digest,
        staged: Some(dest),
        size,
    })
}

fn make_stage_dir(staging: &Path, index: usize) -> Result<PathBuf, ImageError> {
    let dir = staging.join(index.to_string());
    fs::create_dir(&dir).map_err(ImageError::io("create staging dir", &dir))?;
    Ok(dir)
}

/// Apparent size of the regular files under `root`, each inode counted once.
fn dir_size(root: &Path) -> Result<u64, ImageError> {
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

fn dedup_keep_last(layers: &[String]) -> Vec<&str> {
    let mut seen = HashSet::new();
    let mut out: Vec<&str> = layers
        .iter()
        .rev()
        .filter(|l| seen.insert(l.as_str()))
        .map(String::as_str)
        .collect();
    out.reverse();
    out
}

fn validate_holder(holder: &str) -> Result<(), ImageError> {
    let ok = !holder.is_empty()
        && holder.len() <= MAX_HOLDER_LEN
        && !holder.starts_with('.')
        && holder
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ImageError::InvalidHolder {
            holder: holder.to_owned(),
        })
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, ImageError> {
    let mut data = Vec::new();
    match File::open(path) {
        Ok(mut f) => f
            .read_to_end(&mut data)
            .map_err(ImageError::io("read", path))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ImageError::io("read", path)(e)),
    };
    serde_json::from_slice(&data)
        .map(Some)
        .map_err(|source| ImageError::Corrupt {
            path: path.to_path_buf(),
            source,
        })
}

fn read_dir_names(dir: &Path) -> Result<Vec<String>, ImageError> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(ImageError::io("read dir", dir))? {
        let entry = entry.map_err(ImageError::io("read dir", dir))?;
        if let Ok(name) = entry.file_name().into_string() {
            out.push(name);
        }
    }
    Ok(out)
}

fn empty_trash(trash: Vec<PathBuf>) {
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
