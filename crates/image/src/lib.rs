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

mod commit;
mod dirtar;
mod error;
mod gc;
mod lease_verbs;
mod leases;
pub mod oci;
mod reference;
mod source;
mod staging;
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
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use error::{BoxError, ImageError};
pub use reference::{Reference, DOCKER_HUB, HOST_IMAGE};

pub use gc::Pruned;
use source::{hex_digest, ImagePlan, Plan};
pub use staging::{StagedLayer, Staging};
use unpack::{Budget, HashingReader, Unpacked};
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

use crate::gc::empty_trash;
use leases::{Lease, Leases};

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

    // ---- pulls (and other importers that bring their own layer streams) ----

    // ---- import ----

    // ---- garbage collection ----

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
