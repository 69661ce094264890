//! A deterministic tar stream of a rootfs folder, so a folder import is content-addressed exactly like a
//! tarball: the stream is hashed and unpacked by the same code. Entries come in byte order of their
//! names, with owner, mode, mtime (seconds), symlinks, hardlinks (by inode) and xattrs (pax
//! `SCHILY.xattr.*`); no user or group names, no atime. Devices, fifos and sockets are left out, as the
//! unpacker would skip them anyway.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tar::{EntryType, Header};

use crate::unpack::{unpack_layer, Budget, Unpacked};
use crate::ImageError;

/// Unpacks the folder `src` into `dest` through its deterministic tar stream (written by a thread into
/// a pipe), so the layer digest is that of the stream.
/// A directory whose (dev, inode) is `exclude` is left out: importing a folder that contains the image
/// store must not copy the store (and its own staging) into the image.
pub(crate) fn unpack_dir(
    src: &Path,
    dest: &Path,
    exclude: Option<(u64, u64)>,
    budget: &Budget,
) -> Result<Unpacked, ImageError> {
    unpack_tree(src, dest, exclude, false, None, budget)
}

/// Like [`unpack_dir`] for an overlayfs upper directory: its whiteouts (0:0 character devices) and
/// opaque directories (`trusted.overlay.opaque=y`) travel as OCI `.wh.` entries, so the layer means
/// in the store what the upper meant over its lower layers.
/// `id_base` shifts owners back from a user namespace's range (see `ImageStore::commit_snapshot`).
pub(crate) fn unpack_upper(
    src: &Path,
    dest: &Path,
    id_base: Option<u32>,
    budget: &Budget,
) -> Result<Unpacked, ImageError> {
    unpack_tree(src, dest, None, true, id_base, budget)
}

fn unpack_tree(
    src: &Path,
    dest: &Path,
    exclude: Option<(u64, u64)>,
    overlay: bool,
    id_base: Option<u32>,
    budget: &Budget,
) -> Result<Unpacked, ImageError> {
    let (read_end, write_end) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| ImageError::Io {
            op: "create pipe",
            path: src.to_path_buf(),
            source: e.into(),
        })?;
    let src_owned = src.to_path_buf();
    let writer = std::thread::Builder::new()
        .name("warren-image-dirtar".into())
        .spawn(move || {
            let out = io::BufWriter::with_capacity(256 * 1024, File::from(write_end));
            write_tree_tar(&src_owned, out, exclude, overlay, id_base)
        })
        .map_err(ImageError::io("spawn folder tar writer", src))?;
    // Taking the read end by value closes it as soon as unpacking stops, which ends the writer
    // (EPIPE) if unpacking failed early.
    let unpacked = unpack_layer(
        io::BufReader::with_capacity(256 * 1024, File::from(read_end)),
        dest,
        src,
        budget,
    );
    let written = writer
        .join()
        .map_err(|_| ImageError::source(src, "folder tar writer panicked"))?;
    match (unpacked, written) {
        (Ok(u), Ok(())) => Ok(u),
        (Ok(_), Err(w)) => Err(w),
        (Err(u), Ok(())) => Err(u),
        // The writer only sees a broken pipe when unpacking stopped first; otherwise its error
        // (an unreadable file, say) explains the truncated stream and wins.
        (Err(u), Err(ImageError::Io { source, .. }))
            if source.kind() == io::ErrorKind::BrokenPipe =>
        {
            Err(u)
        }
        (Err(_), Err(w)) => Err(w),
    }
}

/// Writes the tar of `src`'s contents (not `src` itself) to `out`.
#[cfg(test)]
pub(crate) fn write_dir_tar<W: Write>(
    src: &Path,
    out: W,
    exclude: Option<(u64, u64)>,
) -> Result<(), ImageError> {
    write_tree_tar(src, out, exclude, false, None)
}

fn write_tree_tar<W: Write>(
    src: &Path,
    out: W,
    exclude: Option<(u64, u64)>,
    overlay: bool,
    id_base: Option<u32>,
) -> Result<(), ImageError> {
    let mut writer = DirTar {
        src: src.to_path_buf(),
        exclude,
        overlay,
        id_base,
        builder: tar::Builder::new(out),
        links: HashMap::new(),
    };
    writer.walk()?;
    let mut out = writer
        .builder
        .into_inner()
        .map_err(ImageError::io("write folder tar", src))?;
    out.flush().map_err(ImageError::io("write folder tar", src))
}

/// The longest path (bytes, below the folder) a layer made from a folder holds. The unpacker, and
/// every program that reads the layer later, names files by path, which Linux refuses past 4,096
/// bytes: a deeper tree in a sandbox fails its snapshot with this reason.
pub(crate) const MAX_PATH_BYTES: usize = 3072;

struct DirTar<W: Write> {
    src: PathBuf,
    exclude: Option<(u64, u64)>,
    /// Source is an overlayfs upper: whiteouts and opaque markers become `.wh.` entries.
    overlay: bool,
    /// Owners are a user namespace's: host id `base + n` is recorded as `n`, and an id outside
    /// the range (nobody's, inside) as 65534.
    id_base: Option<u32>,
    builder: tar::Builder<W>,
    /// First path seen for each multiply-linked inode.
    links: HashMap<(u64, u64), PathBuf>,
}

impl<W: Write> DirTar<W> {
    /// The id recorded for host id `id`.
    fn own(&self, id: u32) -> u32 {
        match self.id_base {
            None => id,
            Some(base) => id
                .checked_sub(base)
                .filter(|n| *n < 65_536)
                .unwrap_or(65_534),
        }
    }

    /// Every entry below the folder, in byte order of names, parents before children: a loop
    /// with a stack of folders being listed, not a recursion (a sandbox's 30,000-level tree
    /// overflowed this thread's stack and aborted the server).
    fn walk(&mut self) -> Result<(), ImageError> {
        let mut stack = vec![(PathBuf::new(), self.list(Path::new(""))?.into_iter())];
        while let Some((rel, names)) = stack.last_mut() {
            let Some(name) = names.next() else {
                stack.pop();
                continue;
            };
            if let Some(dir) = self.entry(rel, name)? {
                let names = self.list(&dir)?.into_iter();
                stack.push((dir, names));
            }
        }
        Ok(())
    }

    /// The names in folder `rel`, sorted.
    fn list(&self, rel: &Path) -> Result<Vec<OsString>, ImageError> {
        let dir = self.src.join(rel);
        let mut names = fs::read_dir(&dir)
            .and_then(|it| {
                it.map(|e| e.map(|e| e.file_name()))
                    .collect::<io::Result<Vec<OsString>>>()
            })
            .map_err(ImageError::io("read dir", &dir))?;
        names.sort();
        Ok(names)
    }

    /// Writes the entry `name` of folder `rel`; returns its path when it is a folder to walk.
    fn entry(&mut self, rel: &Path, name: OsString) -> Result<Option<PathBuf>, ImageError> {
        let rel_child = rel.join(&name);
        let path = self.src.join(&rel_child);
        if rel_child.as_os_str().len() > MAX_PATH_BYTES {
            let shown: String = rel_child.to_string_lossy().chars().take(60).collect();
            return Err(ImageError::source(
                &self.src,
                format!(
                    "a path in it is longer than {MAX_PATH_BYTES} bytes ({shown}…), the most an \
                     image layer holds"
                ),
            ));
        }
        let meta = fs::symlink_metadata(&path).map_err(ImageError::io("stat", &path))?;
        let file_type = meta.file_type();
        let mut header = Header::new_gnu();
        header.set_mode(meta.mode() & 0o7777);
        header.set_uid(u64::from(self.own(meta.uid())));
        header.set_gid(u64::from(self.own(meta.gid())));
        header.set_mtime(u64::try_from(meta.mtime()).unwrap_or(0));
        header.set_size(0);
        let write_err = ImageError::io("write folder tar", &path);
        if file_type.is_dir() {
            if self.exclude == Some((meta.dev(), meta.ino())) {
                return Ok(None);
            }
            self.xattrs(&path)?;
            header.set_entry_type(EntryType::Directory);
            self.builder
                .append_data(&mut header, &rel_child, io::empty())
                .map_err(write_err)?;
            if self.overlay && is_opaque(&path) {
                self.marker(&rel_child.join(OPAQUE_ENTRY), &path)?;
            }
            return Ok(Some(rel_child));
        } else if file_type.is_file() {
            if meta.nlink() > 1 {
                let key = (meta.dev(), meta.ino());
                if let Some(first) = self.links.get(&key) {
                    header.set_entry_type(EntryType::Link);
                    self.builder
                        .append_link(&mut header, &rel_child, first)
                        .map_err(write_err)?;
                    return Ok(None);
                }
                self.links.insert(key, rel_child.clone());
            }
            self.xattrs(&path)?;
            let file = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
                .map_err(ImageError::io("open", &path))?;
            header.set_entry_type(EntryType::Regular);
            header.set_size(meta.len());
            let exact = ExactReader {
                inner: file,
                remaining: meta.len(),
            };
            self.builder
                .append_data(&mut header, &rel_child, exact)
                .map_err(write_err)?;
        } else if file_type.is_symlink() {
            let target = fs::read_link(&path).map_err(ImageError::io("read symlink", &path))?;
            header.set_entry_type(EntryType::Symlink);
            self.builder
                .append_link(&mut header, &rel_child, &target)
                .map_err(write_err)?;
        } else if self.overlay && file_type.is_char_device() && meta.rdev() == 0 {
            let mut whiteout = OsString::from(".wh.");
            whiteout.push(&name);
            self.marker(&rel.join(whiteout), &path)?;
        }
        Ok(None)
    }

    /// An empty `.wh.` entry (whiteout or opaque marker).
    fn marker(&mut self, rel: &Path, source: &Path) -> Result<(), ImageError> {
        let mut header = Header::new_gnu();
        header.set_entry_type(EntryType::Regular);
        header.set_mode(0o644);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        header.set_size(0);
        self.builder
            .append_data(&mut header, rel, io::empty())
            .map_err(ImageError::io("write folder tar", source))
    }

    /// Emits a pax header carrying the xattrs of `path` (if any) for the entry that follows.
    fn xattrs(&mut self, path: &Path) -> Result<(), ImageError> {
        // A filesystem without xattr support simply has none.
        let Ok(names) = xattr::list(path) else {
            return Ok(());
        };
        let mut names: Vec<OsString> = names.collect();
        if names.is_empty() {
            return Ok(());
        }
        names.sort();
        let mut records = Vec::new();
        for name in names {
            let Some(name_str) = name.to_str() else {
                continue;
            };
            if name_str.starts_with("trusted.overlay.") {
                continue;
            }
            if let Ok(Some(value)) = xattr::get(path, &name) {
                pax_record(&mut records, &format!("SCHILY.xattr.{name_str}"), &value);
            }
        }
        if records.is_empty() {
            return Ok(());
        }
        let mut header = Header::new_ustar();
        header.set_entry_type(EntryType::XHeader);
        header.set_mode(0o644);
        header.set_size(records.len() as u64);
        header
            .set_path("PaxHeader")
            .map_err(ImageError::io("write folder tar", path))?;
        header.set_cksum();
        self.builder
            .append(&header, records.as_slice())
            .map_err(ImageError::io("write folder tar", path))
    }
}

const OPAQUE_ENTRY: &str = ".wh..wh..opq";

fn is_opaque(dir: &Path) -> bool {
    matches!(xattr::get(dir, "trusted.overlay.opaque"), Ok(Some(v)) if v == b"y")
}

/// One pax record: `"<len> <key>=<value>\n"` where `<len>` counts the whole record, itself included.
fn pax_record(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    let base = key.len() + value.len() + 3;
    let mut len = base + base.to_string().len();
    if len.to_string().len() != base.to_string().len() {
        len = base + len.to_string().len();
    }
    out.extend_from_slice(format!("{len} {key}=").as_bytes());
    out.extend_from_slice(value);
    out.push(b'\n');
}

/// Yields exactly `remaining` bytes or fails: a file that changes size while being read must not
/// produce a corrupt archive.
struct ExactReader {
    inner: File,
    remaining: u64,
}

impl Read for ExactReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.remaining == 0 {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.remaining).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file shrank while being read",
            ));
        }
        self.remaining -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn pax_record_lengths_count_themselves() {
        for (key, value_len) in [
            ("k", 0usize),
            ("SCHILY.xattr.user.a", 1),
            ("k", 5),
            ("x", 94),
            ("x", 95),
            ("x", 996),
        ] {
            let mut out = Vec::new();
            pax_record(&mut out, key, &vec![b'v'; value_len]);
            let text = String::from_utf8(out.clone()).expect("utf8");
            let (len, _) = text.split_once(' ').expect("space");
            assert_eq!(
                len.parse::<usize>().expect("len"),
                out.len(),
                "{key} {value_len}"
            );
        }
    }

    #[test]
    fn same_tree_gives_same_stream() {
        let make = || {
            let dir = tempfile::tempdir().expect("tempdir");
            let root = dir.path();
            fs::create_dir_all(root.join("b/c")).expect("mkdir");
            fs::write(root.join("b/c/f"), b"data").expect("write");
            fs::write(root.join("a"), b"first").expect("write");
            fs::hard_link(root.join("a"), root.join("z")).expect("link");
            std::os::unix::fs::symlink("b/c/f", root.join("s")).expect("symlink");
            xattr::set(root.join("a"), "user.test", b"1").expect("xattr");
            for p in ["a", "b", "b/c", "b/c/f", "s", "z", ""] {
                let p = root.join(p);
                if !fs::symlink_metadata(&p)
                    .expect("stat")
                    .file_type()
                    .is_symlink()
                {
                    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).expect("chmod");
                }
                let t = nix::sys::time::TimeSpec::new(1_000, 0);
                nix::sys::stat::utimensat(
                    None,
                    &p,
                    &t,
                    &t,
                    nix::sys::stat::UtimensatFlags::NoFollowSymlink,
                )
                .expect("utimes");
            }
            dir
        };
        let (d1, d2) = (make(), make());
        let mut t1 = Vec::new();
        let mut t2 = Vec::new();
        write_dir_tar(d1.path(), &mut t1, None).expect("tar 1");
        write_dir_tar(d2.path(), &mut t2, None).expect("tar 2");
        assert_eq!(t1, t2);

        let mut archive = tar::Archive::new(t1.as_slice());
        let mut seen = Vec::new();
        for e in archive.entries().expect("entries") {
            let mut e = e.expect("entry");
            let xattr = e
                .pax_extensions()
                .expect("pax")
                .map(|p| {
                    p.filter_map(Result::ok)
                        .map(|x| x.key().unwrap_or("").to_owned())
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            seen.push((
                e.path().expect("path").display().to_string(),
                e.header().entry_type(),
                xattr,
            ));
        }
        let names: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(names, ["a", "b", "b/c", "b/c/f", "s", "z"]);
        assert_eq!(seen[0].2, ["SCHILY.xattr.user.test"]);
        assert_eq!(seen[4].1, EntryType::Symlink);
        assert_eq!(seen[5].1, EntryType::Link);
    }

    /// A chain of `levels` folders named `d` under `root`, made by descriptor (its paths outgrow
    /// what the kernel takes by name).
    fn chain(root: &Path, levels: usize) {
        use nix::fcntl::{openat, OFlag};
        use nix::sys::stat::{mkdirat, Mode};
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        fs::create_dir_all(root).expect("root");
        let mut fd = OwnedFd::from(File::open(root).expect("open"));
        for _ in 0..levels {
            mkdirat(Some(fd.as_raw_fd()), "d", Mode::from_bits_truncate(0o755)).expect("mkdir");
            let down = openat(
                Some(fd.as_raw_fd()),
                "d",
                OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .expect("down");
            // SAFETY: a fresh descriptor, owned by nobody else.
            fd = unsafe { OwnedFd::from_raw_fd(down) };
        }
    }

    #[test]
    fn a_tree_past_a_layers_paths_fails_cleanly_and_one_within_is_kept() {
        let t = tempfile::tempdir().expect("tempdir");
        let (deep, fits) = (t.path().join("deep"), t.path().join("fits"));
        chain(&deep, 20_000);
        chain(&fits, 1_500);
        // on a small stack: the walk's depth must cost heap, not stack
        let run = move || {
            let a = write_dir_tar(&deep, io::sink(), None);
            let b = write_dir_tar(&fits, io::sink(), None);
            (a.map_err(|e| e.to_string()), b.map_err(|e| e.to_string()))
        };
        let (a, b) = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(run)
            .expect("thread")
            .join()
            .expect("no overflow");
        // (std's removal, TempDir's, recurses per level: GNU rm walks such a tree)
        let rm = std::process::Command::new("rm")
            .arg("-rf")
            .arg(t.path())
            .status();
        assert!(rm.expect("rm").success());
        let e = a.expect_err("refused");
        assert!(e.contains("longer than 3072 bytes"), "{e}");
        b.expect("1,500 levels fit");
    }
}
