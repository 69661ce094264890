//! Safe unpacking of one layer tar into a fresh directory, converting OCI/Docker whiteouts to the
//! overlayfs format and hashing the uncompressed stream as it goes (the digest names the layer).
//!
//! The destination is a private temp dir that nothing else writes to, so checking each path component
//! with `lstat` before use is race-free: the only symlinks that can appear are the ones this tar created,
//! and we refuse to walk through them. Files are created with `O_EXCL|O_NOFOLLOW` after removing whatever
//! an earlier entry left at the same path.
//!
//! Why one file: ~300 of its lines are tests that unpack crafted tars through the crate-private
//! `unpack_layer`. The rest is one `Unpacker` whose branches, one per kind of entry, share its
//! path-safety helpers (`ensure_dirs`, `remove_existing`) and the image-wide `Budget` they spend.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::stat::{makedev, mknod, utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use sha2::{Digest, Sha256};
use tar::EntryType;

use crate::ImageError;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
/// xattrs in this namespace steer overlayfs itself (opaque, redirect, metacopy); a layer must not set them.
const OVERLAY_XATTR_PREFIX: &str = "trusted.overlay.";
const COPY_BUF: usize = 128 * 1024;

/// Folders above an entry, at most: snapshots keep paths of at most 3,072 bytes (`dirtar`), which
/// is at most 1,536 levels, so no image may be deeper whatever its limits say.
pub const MAX_DEPTH: usize = 1536;

/// Bounds on what one image unpacks to, all its layers together, checked while they stream: an
/// image from a hostile registry or archive must not fill the host's disk, nor make a tree deeper
/// than what walks it can take. (A 407 KB gzip of zeros and a 10 KB tar with a sparse file each
/// became 401 MiB on disk before there were bounds.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackLimits {
    /// Entries of all layers.
    pub max_entries: u64,
    /// Folders above an entry (at most [`MAX_DEPTH`]).
    pub max_depth: usize,
    /// Bytes of data written. Runs of zeros are holes (sparse files stay sparse) and are not
    /// counted here, only in `max_apparent_bytes`.
    pub max_data_bytes: u64,
    /// The files' sizes together, holes included.
    pub max_apparent_bytes: u64,
}

impl Default for UnpackLimits {
    fn default() -> Self {
        UnpackLimits {
            max_entries: 2_000_000,
            max_depth: MAX_DEPTH,
            max_data_bytes: 64 << 30,
            max_apparent_bytes: 1 << 40,
        }
    }
}

/// One image's running totals against its [`UnpackLimits`], shared by the threads that unpack
/// its layers at once.
#[derive(Debug)]
pub(crate) struct Budget {
    limits: UnpackLimits,
    entries: AtomicU64,
    data: AtomicU64,
    apparent: AtomicU64,
}

impl Budget {
    pub(crate) fn new(limits: UnpackLimits) -> Self {
        Budget {
            limits: UnpackLimits {
                max_depth: limits.max_depth.min(MAX_DEPTH),
                ..limits
            },
            entries: AtomicU64::new(0),
            data: AtomicU64::new(0),
            apparent: AtomicU64::new(0),
        }
    }

    /// Counts `n` more against `total`; `Err` names what went past `max`.
    fn spend(
        total: &AtomicU64,
        n: u64,
        max: u64,
        what: &str,
        label: &Path,
    ) -> Result<(), ImageError> {
        let now = total.fetch_add(n, Ordering::Relaxed).saturating_add(n);
        if now > max {
            return Err(ImageError::source(
                label,
                format!(
                    "the image holds more than {max} {what} (a limit of this server's, [images])"
                ),
            ));
        }
        Ok(())
    }

    fn entry(&self, label: &Path) -> Result<(), ImageError> {
        Self::spend(&self.entries, 1, self.limits.max_entries, "entries", label)
    }

    fn data(&self, n: u64, label: &Path) -> Result<(), ImageError> {
        Self::spend(
            &self.data,
            n,
            self.limits.max_data_bytes,
            "bytes of data",
            label,
        )
    }

    fn apparent(&self, n: u64, label: &Path) -> Result<(), ImageError> {
        Self::spend(
            &self.apparent,
            n,
            self.limits.max_apparent_bytes,
            "bytes in its files' sizes",
            label,
        )
    }
}

/// A reader that hashes (sha256) and counts everything read through it.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// Reads the rest of the stream so the digest covers all of it (tar readers stop at the end marker).
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(|_| ())
    }

    /// Lowercase hex sha256 of everything read.
    pub(crate) fn hex_digest(self) -> String {
        hex::encode(self.hasher.finalize())
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// What unpacking a layer produced.
#[derive(Debug)]
pub(crate) struct Unpacked {
    /// Hex sha256 of the uncompressed tar stream (the OCI `diff_id`).
    pub digest: String,
    /// Number of tar entries seen (0 for an empty archive).
    pub entries: u64,
    /// Apparent size of the regular files written (hardlinks not counted again).
    pub bytes: u64,
}

/// Unpacks the uncompressed tar stream `reader` into the empty directory `dest`.
/// `label` names the source in errors.
pub(crate) fn unpack_layer<R: Read>(
    reader: R,
    dest: &Path,
    label: &Path,
    budget: &Budget,
) -> Result<Unpacked, ImageError> {
    // tempfile makes 0700 dirs; the layer root becomes `/` of the sandbox unless an entry says otherwise.
    fs::set_permissions(dest, fs::Permissions::from_mode(0o755))
        .map_err(ImageError::io("chmod layer dir", dest))?;
    let mut hashing = HashingReader::new(reader);
    let mut unpacker = Unpacker {
        root: dest.to_path_buf(),
        label: label.to_path_buf(),
        dir_times: HashMap::new(),
        known_dirs: HashSet::new(),
        bytes: 0,
        budget,
        buf: vec![0; COPY_BUF],
    };
    let read_err = |e: io::Error| ImageError::source_with(label, "read layer tar", e);
    let mut entries = 0;
    {
        let mut archive = tar::Archive::new(&mut hashing);
        for entry in archive.entries().map_err(read_err)? {
            let mut entry = entry.map_err(read_err)?;
            entries += 1;
            budget.entry(label)?;
            unpacker.entry(&mut entry)?;
        }
    }
    hashing.drain().map_err(read_err)?;
    let bytes = unpacker.bytes;
    unpacker.finish()?;
    Ok(Unpacked {
        digest: hashing.hex_digest(),
        entries,
        bytes,
    })
}

/// Turns a tar path into a relative path inside the layer: leading `/` and `.` components are dropped,
/// `..` is refused. `None` means the layer root itself.
pub(crate) fn normalize_entry_path(raw: &[u8]) -> Result<Option<PathBuf>, &'static str> {
    if raw.contains(&0) {
        return Err("path contains a nul byte");
    }
    let mut out = PathBuf::new();
    for component in Path::new(OsStr::from_bytes(raw)).components() {
        match component {
            Component::RootDir | Component::Prefix(_) | Component::CurDir => {}
            Component::ParentDir => return Err("path escapes the layer (..)"),
            Component::Normal(c) => out.push(c),
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

/// Owner, mode, times and xattrs of one entry, read from its header and pax records.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    xattrs: Vec<(String, Vec<u8>)>,
}

struct Unpacker<'b> {
    root: PathBuf,
    label: PathBuf,
    /// Directory mtimes are applied last: creating children would bump them again.
    dir_times: HashMap<PathBuf, i64>,
    /// Directories (relative to the root) known to be real directories: walked without an `lstat`
    /// per component. Only this unpacker writes below the root, so an entry stays valid until this
    /// unpacker removes or replaces it (see `forget`).
    known_dirs: HashSet<PathBuf>,
    /// Apparent size of the regular files written.
    bytes: u64,
    /// The image's totals, which this layer adds to.
    budget: &'b Budget,
    buf: Vec<u8>,
}

impl Unpacker<'_> {
    fn unsafe_entry(&self, entry: &str, reason: &'static str) -> ImageError {
        ImageError::UnsafeEntry {
            path: self.label.clone(),
            entry: entry.to_owned(),
            reason,
        }
    }

    fn read_err(&self, e: io::Error) -> ImageError {
        ImageError::source_with(&self.label, "read layer tar", e)
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), ImageError> {
        let raw_path = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw_path).into_owned();
        let kind = entry.header().entry_type();
        let rel = match normalize_entry_path(&raw_path) {
            Ok(Some(rel)) => rel,
            Ok(None) => {
                // `./`: attributes of the layer root (and so of the sandbox's `/`).
                if kind == EntryType::Directory {
                    let meta = self.meta(entry)?;
                    let root = self.root.clone();
                    self.apply_meta(&root, &meta, false)?;
                    self.dir_times.insert(root, meta.mtime);
                }
                return Ok(());
            }
            Err(reason) => return Err(self.unsafe_entry(&shown, reason)),
        };
        if rel.components().count() > self.budget.limits.max_depth {
            return Err(self.unsafe_entry(&shown, "deeper than the folders an image may nest"));
        }
        let (Some(name), Some(parent_rel)) = (rel.file_name(), rel.parent()) else {
            return Err(self.unsafe_entry(&shown, "no file name"));
        };
        let name = name.to_owned();

        if let Some(hidden) = name.as_bytes().strip_prefix(WHITEOUT_PREFIX) {
            let parent = self.ensure_dirs(parent_rel, &shown)?;
            if name.as_bytes() == OPAQUE_MARKER {
                return xattr::set(&parent, OPAQUE_XATTR, b"y")
                    .map_err(ImageError::io("set opaque xattr", &parent));
            }
            if hidden.starts_with(WHITEOUT_PREFIX) {
                // Other aufs metadata (`.wh..wh.plnk`, `.wh..wh.aufs`): meaningless to overlayfs.
                return Ok(());
            }
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(self.unsafe_entry(&shown, "whiteout of nothing"));
            }
            let target = parent.join(OsStr::from_bytes(hidden));
            self.remove_existing(&target)?;
            return mknod(&target, SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).map_err(|e| {
                ImageError::Io {
                    op: "create whiteout",
                    path: target,
                    source: e.into(),
                }
            });
        }

        match kind {
            EntryType::Directory => {
                let meta = self.meta(entry)?;
                let path = self.ensure_dirs(parent_rel, &shown)?.join(&name);
                match DirBuilder::new().mode(0o755).create(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        let is_dir = fs::symlink_metadata(&path)
                            .map_err(ImageError::io("stat", &path))?
                            .file_type()
                            .is_dir();
                        if !is_dir {
                            self.remove_existing(&path)?;
                            create_dir(&path)?;
                        }
                    }
                    Err(e) => return Err(ImageError::io("create dir", &path)(e)),
                }
                self.apply_meta(&path, &meta, false)?;
                self.known_dirs.insert(rel.clone());
                self.dir_times.insert(path, meta.mtime);
            }
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                let meta = self.meta(entry)?;
                let path = self.ensure_dirs(parent_rel, &shown)?.join(&name);
                let mut file = match self.create_file(&path) {
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        self.remove_existing(&path)?;
                        self.create_file(&path)
                    }
                    other => other,
                }
                .map_err(ImageError::io("create file", &path))?;
                self.bytes += entry.size();
                self.budget.apparent(entry.size(), &self.label)?;
                self.copy(entry, &mut file, &path)?;
                // On the open file: no second path walk.
                std::os::unix::fs::fchown(&file, Some(meta.uid), Some(meta.gid))
                    .map_err(ImageError::io("chown", &path))?;
                file.set_permissions(fs::Permissions::from_mode(meta.mode))
                    .map_err(ImageError::io("chmod", &path))?;
                for (name, value) in &meta.xattrs {
                    let _ = xattr::set(&path, name, value);
                }
                let t = std::time::UNIX_EPOCH
                    + std::time::Duration::from_secs(meta.mtime.max(0) as u64);
                file.set_times(fs::FileTimes::new().set_accessed(t).set_modified(t))
                    .map_err(ImageError::io("set mtime", &path))?;
            }
            EntryType::Symlink => {
                let meta = self.meta(entry)?;
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.unsafe_entry(&shown, "symlink without target"))?
                    .into_owned();
                if target.contains(&0) {
                    return Err(self.unsafe_entry(&shown, "symlink target contains a nul byte"));
                }
                let path = self.ensure_dirs(parent_rel, &shown)?.join(&name);
                let target = OsStr::from_bytes(&target);
                match std::os::unix::fs::symlink(target, &path) {
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        self.remove_existing(&path)?;
                        std::os::unix::fs::symlink(target, &path)
                    }
                    other => other,
                }
                .map_err(ImageError::io("create symlink", &path))?;
                self.apply_meta(&path, &meta, true)?;
                set_mtime(&path, meta.mtime)?;
            }
            EntryType::Link => {
                let target_raw = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.unsafe_entry(&shown, "hardlink without target"))?
                    .into_owned();
                let target_rel = match normalize_entry_path(&target_raw) {
                    Ok(Some(t)) => t,
                    Ok(None) => return Err(self.unsafe_entry(&shown, "hardlink to the layer root")),
                    Err(_) => {
                        return Err(self.unsafe_entry(&shown, "hardlink target outside the layer"))
                    }
                };
                let target = self.existing_file(&target_rel).ok_or_else(|| {
                    self.unsafe_entry(&shown, "hardlink target missing or outside the layer")
                })?;
                let path = self.ensure_dirs(parent_rel, &shown)?.join(&name);
                if path == target {
                    return Ok(());
                }
                self.remove_existing(&path)?;
                fs::hard_link(&target, &path).map_err(ImageError::io("create hardlink", &path))?;
            }
            // Device nodes and fifos have no business in an image layer (the runtime provides /dev).
            EntryType::Char | EntryType::Block | EntryType::Fifo => {}
            // Pax/GNU metadata entries are consumed by the tar reader; anything else is ignored.
            _ => {}
        }
        Ok(())
    }

    fn meta<R: Read>(&self, entry: &mut tar::Entry<'_, R>) -> Result<Meta, ImageError> {
        let header = entry.header();
        let bad = |e: io::Error| ImageError::source_with(&self.label, "bad tar header", e);
        let mut meta = Meta {
            mode: header.mode().map_err(bad)? & 0o7777,
            uid: u32::try_from(header.uid().map_err(bad)?).unwrap_or(u32::MAX - 1),
            gid: u32::try_from(header.gid().map_err(bad)?).unwrap_or(u32::MAX - 1),
            mtime: i64::try_from(header.mtime().map_err(bad)?).unwrap_or(0),
            xattrs: Vec::new(),
        };
        if let Some(pax) = entry.pax_extensions().map_err(bad)? {
            for ext in pax {
                let ext = ext.map_err(bad)?;
                let Ok(key) = ext.key() else { continue };
                let int_value = || {
                    ext.value()
                        .ok()
                        .and_then(|v| v.split('.').next())
                        .and_then(|v| v.parse::<i64>().ok())
                };
                match key {
                    "uid" => {
                        meta.uid = int_value()
                            .and_then(|v| u32::try_from(v).ok())
                            .unwrap_or(meta.uid)
                    }
                    "gid" => {
                        meta.gid = int_value()
                            .and_then(|v| u32::try_from(v).ok())
                            .unwrap_or(meta.gid)
                    }
                    "mtime" => meta.mtime = int_value().unwrap_or(meta.mtime),
                    _ => {
                        if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                            if !name.starts_with(OVERLAY_XATTR_PREFIX) {
                                meta.xattrs
                                    .push((name.to_owned(), ext.value_bytes().to_vec()));
                            }
                        }
                    }
                }
            }
        }
        Ok(meta)
    }

    /// Owner first (chown clears setuid bits and file capabilities), then mode, then xattrs.
    fn apply_meta(&self, path: &Path, meta: &Meta, is_symlink: bool) -> Result<(), ImageError> {
        std::os::unix::fs::lchown(path, Some(meta.uid), Some(meta.gid))
            .map_err(ImageError::io("chown", path))?;
        if !is_symlink {
            fs::set_permissions(path, fs::Permissions::from_mode(meta.mode))
                .map_err(ImageError::io("chmod", path))?;
        }
        for (name, value) in &meta.xattrs {
            // Best effort: filesystems differ in which namespaces they accept, and a missing
            // xattr (say security.selinux) must not make a whole image unusable.
            let _ = xattr::set(path, name, value);
        }
        Ok(())
    }

    fn copy<R: Read>(
        &mut self,
        entry: &mut R,
        file: &mut File,
        path: &Path,
    ) -> Result<(), ImageError> {
        use std::io::{Seek, SeekFrom};
        // Zeros are skipped over, leaving holes: a file of zeros (a GNU sparse entry's holes
        // come out of the reader as zeros too) takes no disk, whatever its size.
        let mut len = 0u64;
        let mut hole = false;
        loop {
            let n = match entry.read(&mut self.buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.read_err(e)),
            };
            len += n as u64;
            if self.buf[..n].iter().all(|b| *b == 0) {
                file.seek(SeekFrom::Current(n as i64))
                    .map_err(ImageError::io("write file", path))?;
                hole = true;
                continue;
            }
            self.budget.data(n as u64, &self.label)?;
            file.write_all(&self.buf[..n])
                .map_err(ImageError::io("write file", path))?;
            hole = false;
        }
        if hole {
            // a file that ends in a hole has its size only once told
            file.set_len(len)
                .map_err(ImageError::io("write file", path))?;
        }
        Ok(())
    }

    /// Creates the missing directories of `rel` below the root and returns the full path, refusing
    /// to go through anything that is not a real directory (notably a symlink an earlier entry made).
    fn ensure_dirs(&mut self, rel: &Path, shown: &str) -> Result<PathBuf, ImageError> {
        if rel.as_os_str().is_empty() || self.known_dirs.contains(rel) {
            return Ok(self.root.join(rel));
        }
        let mut cur = self.root.clone();
        let mut cur_rel = PathBuf::new();
        for component in rel.components() {
            cur.push(component);
            cur_rel.push(component);
            if self.known_dirs.contains(&cur_rel) {
                continue;
            }
            match fs::symlink_metadata(&cur) {
                Ok(m) if m.file_type().is_dir() => {}
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(self.unsafe_entry(shown, "path goes through a symlink"))
                }
                Ok(_) => return Err(self.unsafe_entry(shown, "parent is not a directory")),
                Err(e) if e.kind() == io::ErrorKind::NotFound => create_dir(&cur)?,
                Err(e) => return Err(ImageError::io("stat", &cur)(e)),
            }
            self.known_dirs.insert(cur_rel.clone());
        }
        Ok(cur)
    }

    fn create_file(&self, path: &Path) -> io::Result<File> {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
    }

    /// The full path of an existing non-directory at `rel`, reached without following symlinks.
    fn existing_file(&self, rel: &Path) -> Option<PathBuf> {
        let mut cur = self.root.clone();
        let mut components = rel.components().peekable();
        while let Some(component) = components.next() {
            cur.push(component);
            let file_type = fs::symlink_metadata(&cur).ok()?.file_type();
            let last = components.peek().is_none();
            if (last && file_type.is_dir()) || (!last && !file_type.is_dir()) {
                return None;
            }
        }
        Some(cur)
    }

    /// Later entries replace earlier ones at the same path, whatever they were.
    fn remove_existing(&mut self, path: &Path) -> Result<(), ImageError> {
        match fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_dir() => {
                if let Ok(rel) = path.strip_prefix(&self.root) {
                    let rel = rel.to_path_buf();
                    self.known_dirs.retain(|d| !d.starts_with(&rel));
                }
                warren_fstree::remove_all(path).map_err(ImageError::io("remove dir", path))
            }
            Ok(_) => fs::remove_file(path).map_err(ImageError::io("remove file", path)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(ImageError::io("stat", path)(e)),
        }
    }

    fn finish(self) -> Result<(), ImageError> {
        for (path, mtime) in &self.dir_times {
            match fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_dir() => set_mtime(path, *mtime)?,
                _ => {} // replaced or removed by a later entry
            }
        }
        Ok(())
    }
}

fn create_dir(path: &Path) -> Result<(), ImageError> {
    DirBuilder::new()
        .mode(0o755)
        .create(path)
        .map_err(ImageError::io("create dir", path))
}

fn set_mtime(path: &Path, mtime: i64) -> Result<(), ImageError> {
    let t = TimeSpec::new(mtime, 0);
    utimensat(None, path, &t, &t, UtimensatFlags::NoFollowSymlink).map_err(|e| ImageError::Io {
        op: "set mtime",
        path: path.to_path_buf(),
        source: e.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    #[test]
    fn normalizes_paths() {
        let n = |s: &str| normalize_entry_path(s.as_bytes());
        assert_eq!(n("a/b"), Ok(Some(PathBuf::from("a/b"))));
        assert_eq!(n("/etc/passwd"), Ok(Some(PathBuf::from("etc/passwd"))));
        assert_eq!(n("./a/./b/"), Ok(Some(PathBuf::from("a/b"))));
        assert_eq!(n("./"), Ok(None));
        assert_eq!(n("/"), Ok(None));
        assert!(n("../x").is_err());
        assert!(n("a/../../x").is_err());
        assert!(
            n("a/../b").is_err(),
            "any .. is refused, even one that stays inside"
        );
        assert!(normalize_entry_path(b"a\0b").is_err());
    }

    fn header(kind: EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(1000);
        h.set_gid(1001);
        h.set_mtime(1_600_000_000);
        h
    }

    fn tar_of(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().unwrap_or_default()
    }

    fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8], mode: u32) {
        let mut h = header(EntryType::Regular, mode, data.len() as u64);
        b.append_data(&mut h, path, data).expect("append");
    }

    /// Writes a raw header, bypassing the builder's own path checks (which refuse `..`).
    fn raw(b: &mut tar::Builder<Vec<u8>>, kind: EntryType, path: &str, link: Option<&str>) {
        let mut h = header(kind, 0o644, 0);
        h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
        if let Some(link) = link {
            h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        h.set_cksum();
        b.append(&h, io::empty()).expect("append");
    }

    fn unpack(data: &[u8]) -> (tempfile::TempDir, Result<Unpacked, ImageError>) {
        unpack_within(data, &Budget::new(UnpackLimits::default()))
    }

    fn unpack_within(
        data: &[u8],
        budget: &Budget,
    ) -> (tempfile::TempDir, Result<Unpacked, ImageError>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = unpack_layer(data, dir.path(), Path::new("test.tar"), budget);
        (dir, r)
    }

    #[test]
    fn the_limits_hold_for_all_layers_of_an_image_together() {
        let layer = |name: &str| {
            tar_of(|b| {
                for i in 0..3 {
                    let mut h = header(EntryType::Regular, 0o644, 1000);
                    b.append_data(&mut h, format!("{name}{i}"), &[7u8; 1000][..])
                        .expect("append");
                }
            })
        };
        // entries: two layers of 3 within 5 each, not together
        let budget = Budget::new(UnpackLimits {
            max_entries: 5,
            ..UnpackLimits::default()
        });
        let (_a, first) = unpack_within(&layer("a"), &budget);
        first.expect("the first layer fits");
        let (_b, second) = unpack_within(&layer("b"), &budget);
        let e = second
            .expect_err("the second passes the image's bound")
            .to_string();
        assert!(e.contains("more than 5"), "{e}");
        // data: 6,000 bytes written against 5,000
        let budget = Budget::new(UnpackLimits {
            max_data_bytes: 5000,
            ..UnpackLimits::default()
        });
        let (_a, first) = unpack_within(&layer("a"), &budget);
        first.expect("the first layer fits");
        let (_b, second) = unpack_within(&layer("b"), &budget);
        assert!(
            matches!(second, Err(ImageError::InvalidSource { .. })),
            "{second:?}"
        );
        // apparent size, holes included: one sparse file past the bound
        let budget = Budget::new(UnpackLimits {
            max_apparent_bytes: 1 << 20,
            ..UnpackLimits::default()
        });
        let sparse = tar_of(|b| {
            let mut h = header(EntryType::Regular, 0o644, 2 << 20);
            b.append_data(&mut h, "holes", io::repeat(0).take(2 << 20))
                .expect("append");
        });
        let (_c, r) = unpack_within(&sparse, &budget);
        assert!(r.is_err(), "{r:?}");
        // depth: a configured bound below the hard one
        let budget = Budget::new(UnpackLimits {
            max_depth: 4,
            ..UnpackLimits::default()
        });
        let deep = tar_of(|b| {
            let mut h = header(EntryType::Regular, 0o644, 1);
            b.append_data(&mut h, "a/b/c/d/e", &b"x"[..])
                .expect("append");
        });
        let (_d, r) = unpack_within(&deep, &budget);
        assert!(r.expect_err("too deep").to_string().contains("deeper than"));
    }

    #[test]
    fn zeros_stay_holes_and_data_round_trips() {
        // 64 MiB of zeros with a little data in the middle and none at the end: the bomb shape
        let size = 64u64 << 20;
        let body = io::repeat(0)
            .take(size / 2)
            .chain(&b"middle"[..])
            .chain(io::repeat(0).take(size / 2 - 6));
        let data = tar_of(|b| {
            let mut h = header(EntryType::Regular, 0o644, size);
            b.append_data(&mut h, "zeros", body).expect("append");
        });
        let (dir, r) = unpack(&data);
        r.expect("unpack");
        let path = dir.path().join("zeros");
        let meta = fs::metadata(&path).expect("meta");
        assert_eq!(meta.len(), size, "the size is kept");
        assert!(
            meta.blocks() * 512 < 1 << 20,
            "{} bytes on disk",
            meta.blocks() * 512
        );
        let content = fs::read(&path).expect("read");
        assert_eq!(
            &content[(size / 2) as usize..(size / 2) as usize + 6],
            b"middle"
        );
        assert!(content[..(size / 2) as usize].iter().all(|b| *b == 0));
    }

    #[test]
    fn a_tree_deeper_than_the_bound_is_refused() {
        let deep = vec!["d"; MAX_DEPTH + 1].join("/");
        let data = tar_of(|b| {
            let mut h = header(EntryType::Regular, 0o644, 1);
            b.append_data(&mut h, &deep, &b"x"[..]).expect("append");
        });
        let (_dir, r) = unpack(&data);
        let e = r.expect_err("refused").to_string();
        assert!(e.contains("deeper than"), "{e}");
    }

    #[test]
    fn unpacks_files_with_metadata_and_digest() {
        let data = tar_of(|b| {
            let mut h = header(EntryType::Directory, 0o750, 0);
            b.append_data(&mut h, "usr/bin", io::empty()).expect("dir");
            file(b, "usr/bin/su", b"#!/bin/true\n", 0o4755);
            let mut h = header(EntryType::Symlink, 0o777, 0);
            b.append_link(&mut h, "bin", "usr/bin").expect("symlink");
            let mut h = header(EntryType::Link, 0o644, 0);
            b.append_link(&mut h, "usr/bin/su2", "usr/bin/su")
                .expect("link");
            let mut h = header(EntryType::Fifo, 0o644, 0);
            b.append_data(&mut h, "fifo", io::empty()).expect("fifo");
        });
        let (dir, r) = unpack(&data);
        let out = r.expect("unpack");
        assert_eq!(out.digest, hex::encode(Sha256::digest(&data)));
        assert_eq!(out.entries, 5);
        let root = dir.path();
        let su = fs::symlink_metadata(root.join("usr/bin/su")).expect("su");
        assert_eq!(su.mode() & 0o7777, 0o4755, "setuid kept");
        assert_eq!((su.uid(), su.gid()), (1000, 1001));
        assert_eq!(su.mtime(), 1_600_000_000);
        assert_eq!(su.nlink(), 2);
        let bin = fs::symlink_metadata(root.join("usr/bin")).expect("usr/bin");
        assert_eq!(bin.mode() & 0o7777, 0o750);
        assert_eq!(
            bin.mtime(),
            1_600_000_000,
            "dir mtime applied after children"
        );
        assert_eq!(
            fs::read_link(root.join("bin")).expect("link"),
            Path::new("usr/bin")
        );
        assert!(!root.join("fifo").exists(), "fifos are skipped");
        assert_eq!(fs::metadata(root).expect("root").mode() & 0o777, 0o755);
    }

    #[test]
    fn converts_whiteouts() {
        let data = tar_of(|b| {
            file(b, "etc/.wh.motd", b"", 0o644);
            file(b, "var/cache/.wh..wh..opq", b"", 0o644);
            file(b, "var/cache/kept", b"x", 0o644);
            file(b, ".wh..wh.plnk", b"", 0o644);
        });
        let (dir, r) = unpack(&data);
        r.expect("unpack");
        let root = dir.path();
        let wh = fs::symlink_metadata(root.join("etc/motd")).expect("whiteout");
        assert!(wh.file_type().is_char_device());
        assert_eq!(wh.rdev(), 0);
        assert!(!root.join("etc/.wh.motd").exists());
        let opq = xattr::get(root.join("var/cache"), OPAQUE_XATTR).expect("xattr");
        assert_eq!(opq.as_deref(), Some(&b"y"[..]));
        assert!(root.join("var/cache/kept").exists());
        assert!(!root.join(".wh..wh.plnk").exists());
    }

    #[test]
    fn refuses_escapes() {
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "dotdot",
                tar_of(|b| raw(b, EntryType::Regular, "../x", None)),
            ),
            (
                "nested dotdot",
                tar_of(|b| raw(b, EntryType::Regular, "a/../../x", None)),
            ),
            (
                "through symlink",
                tar_of(|b| {
                    raw(b, EntryType::Symlink, "a", Some("/etc"));
                    raw(b, EntryType::Regular, "a/passwd", None);
                }),
            ),
            (
                "whiteout through symlink",
                tar_of(|b| {
                    raw(b, EntryType::Symlink, "a", Some("/etc"));
                    raw(b, EntryType::Regular, "a/.wh.passwd", None);
                }),
            ),
            (
                "hardlink outside",
                tar_of(|b| raw(b, EntryType::Link, "x", Some("../../etc/passwd"))),
            ),
            (
                "hardlink absolute missing",
                tar_of(|b| raw(b, EntryType::Link, "x", Some("/etc/shadow"))),
            ),
            (
                "hardlink through symlink",
                tar_of(|b| {
                    raw(b, EntryType::Symlink, "a", Some("/etc"));
                    raw(b, EntryType::Link, "x", Some("a/passwd"));
                }),
            ),
        ];
        for (what, data) in cases {
            let (_dir, r) = unpack(&data);
            assert!(
                matches!(r, Err(ImageError::UnsafeEntry { .. })),
                "{what}: {r:?}"
            );
        }
    }

    #[test]
    fn later_entries_replace_earlier_ones_without_following() {
        let data = tar_of(|b| {
            raw(b, EntryType::Symlink, "f", Some("/etc/passwd"));
            file(b, "f", b"mine", 0o644);
        });
        let (dir, r) = unpack(&data);
        r.expect("unpack");
        let f = dir.path().join("f");
        assert!(fs::symlink_metadata(&f).expect("f").file_type().is_file());
        assert_eq!(fs::read(&f).expect("read"), b"mine");
    }

    #[test]
    fn bad_tar_is_invalid_source() {
        let mut data = tar_of(|b| file(b, "a", b"hello", 0o644));
        data[100] ^= 0xff; // break the header checksum
        let (_dir, r) = unpack(&data);
        assert!(matches!(r, Err(ImageError::InvalidSource { .. })), "{r:?}");
    }
}
