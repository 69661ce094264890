//! Builders for test images: layer tars, docker-save archives and OCI layouts, all made in memory or in
//! temp dirs; plus a read-only overlayfs mount in a private mount namespace.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tar::{EntryType, Header};
use tempfile::TempDir;
use warren_image::ImageStore;

pub fn store() -> (TempDir, ImageStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::open(dir.path()).expect("open store");
    (dir, store)
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// One entry of a layer tar.
pub enum E<'a> {
    Dir(&'a str),
    File(&'a str, &'a [u8]),
    Symlink(&'a str, &'a str),
    /// Written with a raw header, bypassing the tar builder's own path checks.
    Raw(EntryType, &'a str, Option<&'a str>),
}

pub fn layer(entries: &[E<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = Header::new_gnu();
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(0);
        match e {
            E::Dir(p) => {
                h.set_entry_type(EntryType::Directory);
                h.set_mode(0o755);
                b.append_data(&mut h, p, io::empty()).expect("dir");
            }
            E::File(p, data) => {
                h.set_entry_type(EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, *data).expect("file");
            }
            E::Symlink(p, target) => {
                h.set_entry_type(EntryType::Symlink);
                h.set_mode(0o777);
                b.append_link(&mut h, p, target).expect("symlink");
            }
            E::Raw(kind, p, link) => {
                h.set_entry_type(*kind);
                h.set_mode(0o644);
                h.as_old_mut().name[..p.len()].copy_from_slice(p.as_bytes());
                if let Some(link) = link {
                    h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
                }
                h.set_cksum();
                b.append(&h, io::empty()).expect("raw");
            }
        }
    }
    b.into_inner().expect("finish")
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(data).expect("gzip");
    enc.finish().expect("gzip")
}

/// A tar of named in-memory files.
pub fn tar_of_files(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = Header::new_gnu();
        h.set_entry_type(EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, name, *data).expect("append");
    }
    b.into_inner().expect("finish")
}

pub fn image_config(process: Value, layers: &[Vec<u8>]) -> Vec<u8> {
    let diff_ids: Vec<String> = layers
        .iter()
        .map(|l| format!("sha256:{}", sha256_hex(l)))
        .collect();
    serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": process,
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    }))
    .expect("json")
}

/// A `docker save` archive (legacy layout: `<n>/layer.tar`, `<config-hex>.json`, `manifest.json`).
pub fn docker_save(tag: &str, layers: &[Vec<u8>], process: Value) -> Vec<u8> {
    let config = image_config(process, layers);
    let config_name = format!("{}.json", sha256_hex(&config));
    let layer_names: Vec<String> = (0..layers.len())
        .map(|i| format!("layer{i}/layer.tar"))
        .collect();
    let manifest = serde_json::to_vec(&json!([{
        "Config": config_name,
        "RepoTags": [tag],
        "Layers": layer_names,
    }]))
    .expect("json");
    let mut files: Vec<(&str, &[u8])> = vec![(config_name.as_str(), &config)];
    for (name, data) in layer_names.iter().zip(layers) {
        files.push((name.as_str(), data));
    }
    files.push(("manifest.json", &manifest));
    tar_of_files(&files)
}

/// Writes an OCI image layout into `dir`: gzipped layers, and an image index (arm64 + amd64) between
/// index.json and the manifest. Returns the config digest (the image id the store should report).
pub fn oci_layout(dir: &Path, layers: &[Vec<u8>], process: Value) -> String {
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).expect("mkdir");
    let put = |data: &[u8]| -> String {
        let hex = sha256_hex(data);
        fs::write(blobs.join(&hex), data).expect("blob");
        format!("sha256:{hex}")
    };
    let config = image_config(process, layers);
    let config_digest = put(&config);
    let layer_descs: Vec<Value> = layers
        .iter()
        .map(|l| {
            let gz = gzip(l);
            json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": put(&gz),
                "size": gz.len(),
            })
        })
        .collect();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len() },
        "layers": layer_descs,
    }))
    .expect("json");
    let manifest_digest = put(&manifest);
    // A decoy for another platform; its blob does not even exist, so picking it would fail the import.
    let decoy = format!("sha256:{}", "e".repeat(64));
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            { "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": decoy, "size": 1,
              "platform": { "architecture": "arm64", "os": "linux" } },
            { "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest.len(),
              "platform": { "architecture": "amd64", "os": "linux" } },
        ],
    }))
    .expect("json");
    let index_digest = put(&index);
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.index.v1+json",
                "digest": index_digest,
                "size": index.len(),
                "annotations": { "org.opencontainers.image.ref.name": "latest" },
            }],
        }))
        .expect("json"),
    )
    .expect("index");
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).expect("oci-layout");
    config_digest
}

/// A tar of the contents of `dir` (for OCI layouts shipped as tarballs).
pub fn tar_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", dir).expect("tar dir");
    b.into_inner().expect("finish")
}

pub fn write(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, data).expect("write");
    path
}

/// Names of the entries of a directory, sorted.
pub fn ls(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Asserts the store holds no staging leftovers and exactly `layers` layers and `images` image files.
pub fn assert_store_counts(root: &Path, layers: usize, images: usize) {
    let store = root.join("images");
    assert_eq!(ls(&store.join("tmp")), Vec::<String>::new(), "tmp is empty");
    assert_eq!(
        ls(&store.join("layers")).len(),
        layers,
        "layers: {:?}",
        ls(&store.join("layers"))
    );
    assert_eq!(
        ls(&store.join("images")).len(),
        images,
        "images: {:?}",
        ls(&store.join("images"))
    );
}

/// Mounts a read-only overlay of `lower` (lowest first) and runs `check` on the merged dir. The mount
/// lives in a private mount namespace of a dedicated thread, so it can never leak into the host, and is
/// unmounted explicitly as well, even if `check` panics.
pub fn with_overlay<T: Send + 'static>(
    lower: Vec<PathBuf>,
    check: impl FnOnce(&Path) -> T + Send + 'static,
) -> T {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let handle = std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare mount ns");
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .expect("make / private");
        let target = tempfile::tempdir().expect("mountpoint");
        let lowerdir: Vec<String> = lower
            .iter()
            .rev()
            .map(|p| p.display().to_string())
            .collect();
        let options = format!("lowerdir={}", lowerdir.join(":"));
        mount(
            Some("overlay"),
            target.path(),
            Some("overlay"),
            MsFlags::MS_RDONLY,
            Some(options.as_str()),
        )
        .expect("mount overlay");
        struct Unmount(PathBuf);
        impl Drop for Unmount {
            fn drop(&mut self) {
                let _ = umount2(&self.0, MntFlags::MNT_DETACH);
            }
        }
        let _guard = Unmount(target.path().to_path_buf());
        check(target.path())
    });
    match handle.join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
