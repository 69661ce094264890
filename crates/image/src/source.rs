//! Working out what an import source is and which layer streams it holds: a rootfs folder, a plain
//! rootfs tarball, a `docker save` archive or an OCI image layout (each of the last two as a folder or a
//! tar, optionally gzipped). Nothing is written to the store here; see `lib.rs` for that.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::oci::{check_layer_media_type, pick_manifest, ConfigFile, Document};
use crate::reference::Reference;
use crate::ImageError;

const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];
/// Manifests, indexes and configs are small; refuse to buffer anything absurd.
const MAX_JSON: u64 = 16 << 20;
const MAX_LINK_HOPS: usize = 8;
const MAX_INDEX_DEPTH: usize = 4;

/// What to import.
pub(crate) enum Plan {
    /// A rootfs folder: one layer, the deterministic tar of the folder.
    RootfsDir(PathBuf),
    /// A plain rootfs tarball: one layer, the whole (possibly gzipped) file.
    RootfsTar(PathBuf),
    /// A docker-save archive or an OCI layout.
    Image(Box<ImagePlan>),
}

pub(crate) struct ImagePlan {
    pub bundle: Bundle,
    /// `sha256:<hex>` of the image config blob: the same image gets the same id whichever way it came.
    pub id: String,
    pub config: crate::ImageConfig,
    /// Lowest first.
    pub layers: Vec<LayerRef>,
}

pub(crate) struct LayerRef {
    /// Path of the layer blob inside the bundle.
    pub member: String,
    /// Hex sha256 the raw (possibly compressed) blob must have, when the format names blobs by digest.
    pub blob_digest: Option<String>,
    /// Hex sha256 of the uncompressed tar, from the image config's `rootfs.diff_ids`.
    pub diff_id: Option<String>,
}

/// Classifies `source`. `tmp_dir` (on the store's filesystem) receives a decompressed copy of a gzipped
/// image archive, which needs random access; `wanted` picks an image from multi-image archives.
pub(crate) fn plan(source: &Path, tmp_dir: &Path, wanted: &Reference) -> Result<Plan, ImageError> {
    let meta = std::fs::metadata(source).map_err(ImageError::io("stat source", source))?;
    if meta.is_dir() {
        let bundle = Bundle::Dir(source.to_path_buf());
        return Ok(match image_plan(bundle, wanted)? {
            Some(p) => Plan::Image(Box::new(p)),
            None => Plan::RootfsDir(source.to_path_buf()),
        });
    }
    if !meta.is_file() {
        return Err(ImageError::source(source, "not a file or directory"));
    }
    let bundle = if sniff_compressed(source)? {
        // Scan names first so a compressed rootfs (the common case) is streamed, not copied.
        let names = tar_names(open_decompressed(source)?, source)?;
        if !looks_like_image(|n| names.iter().any(|x| x == n)) {
            return Ok(Plan::RootfsTar(source.to_path_buf()));
        }
        let mut temp = tempfile::Builder::new()
            .prefix(&format!("unzip-{}-", std::process::id()))
            .tempfile_in(tmp_dir)
            .map_err(ImageError::io("create temp file", tmp_dir))?;
        io::copy(&mut open_decompressed(source)?, temp.as_file_mut())
            .map_err(|e| ImageError::source_with(source, "decompress", e))?;
        Bundle::tar(temp.path().to_path_buf(), source.to_path_buf(), Some(temp))?
    } else {
        Bundle::tar(source.to_path_buf(), source.to_path_buf(), None)?
    };
    Ok(match image_plan(bundle, wanted)? {
        Some(p) => Plan::Image(Box::new(p)),
        None => Plan::RootfsTar(source.to_path_buf()),
    })
}

/// Wraps `reader` in a gzip or zstd decoder when the stream starts with that format's magic.
pub(crate) fn decompressed<'a, R: BufRead + 'a>(
    mut reader: R,
    label: &Path,
) -> Result<Box<dyn Read + 'a>, ImageError> {
    let head = reader
        .fill_buf()
        .map_err(|e| ImageError::source_with(label, "read", e))?;
    if head.starts_with(GZIP_MAGIC) {
        Ok(Box::new(flate2::bufread::MultiGzDecoder::new(reader)))
    } else if head.starts_with(ZSTD_MAGIC) {
        let decoder = ruzstd::decoding::StreamingDecoder::new(reader)
            .map_err(|e| ImageError::source_with(label, "bad zstd stream", e))?;
        Ok(Box::new(decoder))
    } else {
        Ok(Box::new(reader))
    }
}

/// True if the file starts like a gzip or zstd stream.
fn sniff_compressed(path: &Path) -> Result<bool, ImageError> {
    let mut head = [0u8; 4];
    let mut file = File::open(path).map_err(ImageError::io("open source", path))?;
    let n = read_up_to(&mut file, &mut head).map_err(ImageError::io("read source", path))?;
    Ok(head[..n].starts_with(GZIP_MAGIC) || head[..n].starts_with(ZSTD_MAGIC))
}

fn open_decompressed(path: &Path) -> Result<Box<dyn Read>, ImageError> {
    let file = File::open(path).map_err(ImageError::io("open source", path))?;
    decompressed(BufReader::with_capacity(256 * 1024, file), path)
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn tar_names(reader: impl Read, label: &Path) -> Result<Vec<String>, ImageError> {
    let bad = |e: io::Error| ImageError::source_with(label, "read tar", e);
    let mut archive = tar::Archive::new(reader);
    let mut names = Vec::new();
    for entry in archive.entries().map_err(bad)? {
        let entry = entry.map_err(bad)?;
        if let Some(name) = member_name(&entry.path_bytes()) {
            names.push(name);
        }
    }
    Ok(names)
}

fn looks_like_image(has: impl Fn(&str) -> bool) -> bool {
    has("manifest.json") || (has("oci-layout") && has("index.json"))
}

/// Archive member name with `./` and leading `/` dropped and `..` resolved lexically;
/// `None` for the root or a path escaping it.
fn member_name(raw: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(raw);
    let mut parts: Vec<&str> = Vec::new();
    for c in Path::new(text.as_ref()).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_str()?),
            Component::ParentDir => {
                parts.pop()?;
            }
            _ => {}
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

#[derive(Debug, Clone)]
pub(crate) enum Member {
    File { offset: u64, size: u64 },
    Symlink(String),
    Hardlink(String),
}

/// Random access to the files of an image archive or folder.
pub(crate) enum Bundle {
    Dir(PathBuf),
    Tar {
        file: PathBuf,
        /// The user's source path, for messages.
        label: PathBuf,
        members: HashMap<String, Member>,
        /// Keeps a decompressed copy alive (and removes it on drop).
        _temp: Option<tempfile::NamedTempFile>,
    },
}

impl Bundle {
    fn tar(
        file: PathBuf,
        label: PathBuf,
        temp: Option<tempfile::NamedTempFile>,
    ) -> Result<Self, ImageError> {
        let bad = |e: io::Error| ImageError::source_with(&label, "read tar", e);
        let handle = File::open(&file).map_err(ImageError::io("open source", &file))?;
        let mut archive = tar::Archive::new(handle);
        let mut members = HashMap::new();
        for entry in archive.entries_with_seek().map_err(bad)? {
            let entry = entry.map_err(bad)?;
            let Some(name) = member_name(&entry.path_bytes()) else {
                continue;
            };
            let link = || {
                entry
                    .link_name_bytes()
                    .map(|l| String::from_utf8_lossy(&l).into_owned())
                    .unwrap_or_default()
            };
            let member = match entry.header().entry_type() {
                tar::EntryType::Regular | tar::EntryType::Continuous => Member::File {
                    offset: entry.raw_file_position(),
                    size: entry.size(),
                },
                tar::EntryType::Symlink => Member::Symlink(link()),
                tar::EntryType::Link => Member::Hardlink(link()),
                _ => continue,
            };
            members.insert(name, member);
        }
        Ok(Bundle::Tar {
            file,
            label,
            members,
            _temp: temp,
        })
    }

    pub(crate) fn label(&self) -> &Path {
        match self {
            Bundle::Dir(p) => p,
            Bundle::Tar { label, .. } => label,
        }
    }

    /// Label for errors about one member: `<source>/<member>` (for a tar, a path inside it).
    pub(crate) fn member_label(&self, member: &str) -> PathBuf {
        self.label().join(member)
    }

    fn has(&self, member: &str) -> bool {
        match self {
            Bundle::Dir(root) => root.join(member).is_file(),
            Bundle::Tar { members, .. } => members.contains_key(member),
        }
    }

    /// Opens a member for reading, following symlinks and hardlinks inside the archive.
    pub(crate) fn open(&self, member: &str) -> Result<Box<dyn Read + '_>, ImageError> {
        let missing = || ImageError::source(self.label(), format!("missing {member}"));
        let name = member_name(member.as_bytes()).ok_or_else(missing)?;
        match self {
            Bundle::Dir(root) => {
                let path = root.join(&name);
                let file = File::open(&path).map_err(|e| {
                    ImageError::source_with(self.label(), format!("missing {member}"), e)
                })?;
                Ok(Box::new(file))
            }
            Bundle::Tar { file, members, .. } => {
                let mut name = name;
                for _ in 0..MAX_LINK_HOPS {
                    match members.get(&name).ok_or_else(missing)? {
                        Member::File { offset, size } => {
                            let mut handle =
                                File::open(file).map_err(ImageError::io("open source", file))?;
                            handle
                                .seek(SeekFrom::Start(*offset))
                                .map_err(ImageError::io("read source", file))?;
                            return Ok(Box::new(handle.take(*size)));
                        }
                        Member::Symlink(target) => {
                            let base = Path::new(&name).parent().unwrap_or(Path::new(""));
                            let joined = base.join(target);
                            name = member_name(joined.as_os_str().as_encoded_bytes())
                                .ok_or_else(missing)?;
                        }
                        Member::Hardlink(target) => {
                            name = member_name(target.as_bytes()).ok_or_else(missing)?;
                        }
                    }
                }
                Err(ImageError::source(
                    self.label(),
                    format!("too many links for {member}"),
                ))
            }
        }
    }

    /// Reads a small member whole.
    fn read_small(&self, member: &str) -> Result<Vec<u8>, ImageError> {
        let mut data = Vec::new();
        self.open(member)?
            .take(MAX_JSON + 1)
            .read_to_end(&mut data)
            .map_err(|e| ImageError::source_with(self.member_label(member), "read", e))?;
        if data.len() as u64 > MAX_JSON {
            return Err(ImageError::source(self.member_label(member), "too large"));
        }
        Ok(data)
    }

    fn parse<T: for<'de> Deserialize<'de>>(
        &self,
        member: &str,
        data: &[u8],
    ) -> Result<T, ImageError> {
        serde_json::from_slice(data)
            .map_err(|e| ImageError::source_with(self.member_label(member), "invalid json", e))
    }

    /// Reads a blob of an OCI layout, checking its digest.
    fn blob(&self, digest: &str) -> Result<Vec<u8>, ImageError> {
        let member = blob_member(digest).ok_or_else(|| {
            ImageError::source(self.label(), format!("unsupported digest {digest:?}"))
        })?;
        let data = self.read_small(&member)?;
        let actual = hex::encode(Sha256::digest(&data));
        if Some(actual.as_str()) != digest.strip_prefix("sha256:") {
            return Err(ImageError::source(
                self.member_label(&member),
                "digest mismatch",
            ));
        }
        Ok(data)
    }
}

/// `sha256:<hex>` -> `blobs/sha256/<hex>`, refusing anything else (the digest comes from the source).
fn blob_member(digest: &str) -> Option<String> {
    let hex = hex_digest(digest)?;
    Some(format!("blobs/sha256/{hex}"))
}

/// The 64-char lowercase hex of a `sha256:` digest.
pub(crate) fn hex_digest(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    .then_some(hex)
}

// ---- image formats ----

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifestEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// `Some` if the bundle is a docker-save archive or an OCI layout, `None` if it is a plain rootfs.
fn image_plan(bundle: Bundle, wanted: &Reference) -> Result<Option<ImagePlan>, ImageError> {
    if bundle.has("manifest.json") {
        let data = bundle.read_small("manifest.json")?;
        // A rootfs may well ship some unrelated /manifest.json.
        if let Ok(entries) = serde_json::from_slice::<Vec<DockerManifestEntry>>(&data) {
            if !entries.is_empty() {
                return docker_plan(bundle, entries, wanted).map(Some);
            }
        }
    }
    if bundle.has("oci-layout") && bundle.has("index.json") {
        return oci_plan(bundle, wanted).map(Some);
    }
    Ok(None)
}

fn docker_plan(
    bundle: Bundle,
    entries: Vec<DockerManifestEntry>,
    wanted: &Reference,
) -> Result<ImagePlan, ImageError> {
    let wanted_name = wanted.to_string();
    let count = entries.len();
    let entry = if count == 1 {
        entries.into_iter().next()
    } else {
        entries.into_iter().find(|e| {
            e.repo_tags.iter().flatten().any(|t| {
                Reference::parse(t)
                    .map(|r| r.to_string() == wanted_name)
                    .unwrap_or(false)
            })
        })
    }
    .ok_or_else(|| {
        ImageError::source(
            bundle.label(),
            format!("archive holds {count} images and none is tagged {wanted_name}"),
        )
    })?;
    let raw = bundle.read_small(&entry.config)?;
    let config: ConfigFile = bundle.parse(&entry.config, &raw)?;
    let diff_ids = diff_ids(&bundle, &entry.config, &config, entry.layers.len())?;
    let layers = entry
        .layers
        .into_iter()
        .zip(diff_ids)
        .map(|(member, diff_id)| LayerRef {
            member,
            blob_digest: None,
            diff_id,
        })
        .collect();
    Ok(ImagePlan {
        id: format!("sha256:{}", hex::encode(Sha256::digest(&raw))),
        config: config.image_config(),
        layers,
        bundle,
    })
}

fn oci_plan(bundle: Bundle, wanted: &Reference) -> Result<ImagePlan, ImageError> {
    let raw = bundle.read_small("index.json")?;
    let mut doc: Document = bundle.parse("index.json", &raw)?;
    let mut top_level = true;
    for _ in 0..MAX_INDEX_DEPTH {
        if let Some(manifests) = doc.manifests.take() {
            let chosen = pick_manifest(&manifests, top_level.then_some(wanted))
                .map_err(|reason| ImageError::source(bundle.label(), reason))?;
            let blob = bundle.blob(&chosen.digest)?;
            doc = bundle.parse(&chosen.digest, &blob)?;
            top_level = false;
            continue;
        }
        let Some(config_desc) = doc.manifest_config().cloned() else {
            return Err(ImageError::source(
                bundle.label(),
                "manifest without config",
            ));
        };
        let config_raw = bundle.blob(&config_desc.digest)?;
        let config: ConfigFile = bundle.parse(&config_desc.digest, &config_raw)?;
        let diff_ids = diff_ids(&bundle, &config_desc.digest, &config, doc.layers.len())?;
        let mut layers = Vec::with_capacity(doc.layers.len());
        for (desc, diff_id) in doc.layers.into_iter().zip(diff_ids) {
            check_layer_media_type(&desc.media_type)
                .map_err(|reason| ImageError::source(bundle.label(), reason))?;
            let member = blob_member(&desc.digest).ok_or_else(|| {
                ImageError::source(
                    bundle.label(),
                    format!("unsupported digest {:?}", desc.digest),
                )
            })?;
            layers.push(LayerRef {
                member,
                blob_digest: hex_digest(&desc.digest).map(str::to_owned),
                diff_id,
            });
        }
        return Ok(ImagePlan {
            id: format!("sha256:{}", hex::encode(Sha256::digest(&config_raw))),
            config: config.image_config(),
            layers,
            bundle,
        });
    }
    Err(ImageError::source(
        bundle.label(),
        "image indexes nested too deeply",
    ))
}

fn diff_ids(
    bundle: &Bundle,
    config_member: &str,
    config: &ConfigFile,
    layer_count: usize,
) -> Result<Vec<Option<String>>, ImageError> {
    let ids = config.diff_ids();
    if ids.is_empty() {
        return Ok(vec![None; layer_count]);
    }
    if ids.len() != layer_count {
        return Err(ImageError::source(
            bundle.member_label(config_member),
            format!(
                "config lists {} diff_ids for {layer_count} layers",
                ids.len()
            ),
        ));
    }
    ids.iter()
        .map(|id| {
            hex_digest(id).map(|h| Some(h.to_owned())).ok_or_else(|| {
                ImageError::source(
                    bundle.member_label(config_member),
                    format!("bad diff_id {id:?}"),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names_are_lexical_and_contained() {
        assert_eq!(
            member_name(b"./manifest.json").as_deref(),
            Some("manifest.json")
        );
        assert_eq!(
            member_name(b"a/../b/layer.tar").as_deref(),
            Some("b/layer.tar")
        );
        assert_eq!(member_name(b"../x"), None);
        assert_eq!(member_name(b"./"), None);
    }

    #[test]
    fn blob_members_only_for_sha256_hex() {
        let hex = "0123456789abcdef".repeat(4);
        assert_eq!(
            blob_member(&format!("sha256:{hex}")),
            Some(format!("blobs/sha256/{hex}"))
        );
        assert_eq!(blob_member("sha256:../../etc/passwd"), None);
        assert_eq!(blob_member(&format!("sha512:{hex}")), None);
    }
}
