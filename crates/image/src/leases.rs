//! Leases — which layers each sandbox uses — kept in one append-only journal, `leases.jsonl`.
//!
//! A file per lease (`leases/<holder>.json`, the layout before this journal) made and removed an
//! inode per sandbox, and every release read every other lease back to collect garbage: on this
//! project's machine (ext4 without a journal, many inodes freed a second ago) the inode alone was
//! ~2 % of the whole machine's CPU in create → command → delete cycles, and the reads grew with the
//! number of sandboxes running. Here a lease is one line appended, a release another, both under
//! the store's exclusive lock; readers replay the file, and each process keeps what it replayed,
//! reading only what others appended since (or all of it again when the file was rewritten).
//!
//! Lines: `{"lease":{"holder":…,"image":…,…}}` and `{"release":"<holder>"}`. Each is written with a
//! single `write`; a line a crash cut short has no newline and is skipped (its lease call never
//! returned, so no sandbox relies on it), and the next append starts on a line of its own. When
//! most lines are dead the file is rewritten with the live leases and renamed over.
//!
//! Not fsynced: a lease matters only while its sandbox's processes run, and a power loss or kernel
//! crash, the only thing that can lose a written line, ends them.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::ImageConfig;
use crate::ImageError;

/// Rewrite once the file holds this many lines more than live leases (and twice as many).
const COMPACT_SLACK: usize = 1024;

/// One sandbox's lease.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Lease {
    pub image: String,
    pub layers: Vec<String>,
    /// The image's id and config at lease time, so a snapshot of the sandbox can be made even after
    /// its image was removed or retagged (absent in leases written before snapshots existed).
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub config: Option<ImageConfig>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Line {
    Lease {
        holder: String,
        #[serde(flatten)]
        lease: Lease,
    },
    Release(String),
}

/// The journal at `path`. Every method must be called with the store's lock held: shared for
/// [`Leases::read`], exclusive for the others.
pub(crate) struct Leases {
    path: PathBuf,
    replayed: Mutex<Replayed>,
}

/// What this process has read of the file.
#[derive(Default)]
struct Replayed {
    /// (device, inode) of the file read; another inode means it was rewritten.
    file: Option<(u64, u64)>,
    /// Bytes read, up to the end of the last complete line.
    offset: u64,
    /// Whether the byte before `offset`'s unread rest is a newline (false after a cut line).
    clean_end: bool,
    lines: usize,
    live: HashMap<String, Lease>,
}

impl Leases {
    pub fn new(path: PathBuf) -> Self {
        Leases {
            path,
            replayed: Mutex::new(Replayed::default()),
        }
    }

    /// Runs `f` on the live leases, as the file has them now.
    pub fn read<T>(&self, f: impl FnOnce(&HashMap<String, Lease>) -> T) -> Result<T, ImageError> {
        let mut r = self.lock();
        self.catch_up(&mut r)?;
        Ok(f(&r.live))
    }

    /// Adds `holder`'s lease, unless it holds one already: that one is returned, and nothing is
    /// written.
    pub fn add(&self, holder: &str, lease: Lease) -> Result<Option<Lease>, ImageError> {
        let mut r = self.lock();
        self.catch_up(&mut r)?;
        if let Some(held) = r.live.get(holder) {
            return Ok(Some(held.clone()));
        }
        self.append(
            &mut r,
            &Line::Lease {
                holder: holder.to_owned(),
                lease: lease.clone(),
            },
        )?;
        r.live.insert(holder.to_owned(), lease);
        self.compact_if_due(&mut r)?;
        Ok(None)
    }

    /// Drops `holder`'s lease; returns it, or `None` if it had none.
    pub fn remove(&self, holder: &str) -> Result<Option<Lease>, ImageError> {
        let mut r = self.lock();
        self.catch_up(&mut r)?;
        if !r.live.contains_key(holder) {
            return Ok(None);
        }
        self.append(&mut r, &Line::Release(holder.to_owned()))?;
        let gone = r.live.remove(holder);
        self.compact_if_due(&mut r)?;
        Ok(gone)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Replayed> {
        self.replayed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Brings `r` up to the file: the lines appended since it last looked, or all of them when the
    /// file is another one (rewritten) or shorter than what was read.
    fn catch_up(&self, r: &mut Replayed) -> Result<(), ImageError> {
        let io_err = |what| ImageError::io(what, &self.path);
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                *r = Replayed {
                    clean_end: true,
                    ..Replayed::default()
                };
                return Ok(());
            }
            Err(e) => return Err(io_err("open")(e)),
        };
        let meta = file.metadata().map_err(io_err("stat"))?;
        let id = (meta.dev(), meta.ino());
        if r.file != Some(id) || meta.len() < r.offset {
            *r = Replayed {
                file: Some(id),
                clean_end: true,
                ..Replayed::default()
            };
        }
        if meta.len() == r.offset {
            return Ok(());
        }
        file.seek(SeekFrom::Start(r.offset))
            .map_err(io_err("seek"))?;
        let mut rest = Vec::with_capacity((meta.len() - r.offset) as usize);
        file.read_to_end(&mut rest).map_err(io_err("read"))?;
        // Only complete lines count; a cut last line (a writer that died mid-write) is left unread.
        let complete = rest.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        for line in rest[..complete].split(|&b| b == b'\n') {
            if line.is_empty() {
                continue;
            }
            r.lines += 1;
            match serde_json::from_slice::<Line>(line) {
                Ok(Line::Lease { holder, lease }) => {
                    r.live.insert(holder, lease);
                }
                Ok(Line::Release(holder)) => {
                    r.live.remove(&holder);
                }
                // The cut line of a writer that died, followed by a newline the next writer put
                // there: that lease never returned.
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "skipping a damaged lease line")
                }
            }
        }
        r.offset += complete as u64;
        r.clean_end = complete == rest.len();
        Ok(())
    }

    fn append(&self, r: &mut Replayed, line: &Line) -> Result<(), ImageError> {
        let mut data = Vec::with_capacity(512);
        if !r.clean_end {
            // End the cut line first, so this one is read on its own.
            data.push(b'\n');
        }
        serde_json::to_writer(&mut data, line).map_err(|source| ImageError::Corrupt {
            path: self.path.clone(),
            source,
        })?;
        data.push(b'\n');
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&self.path)
            .map_err(ImageError::io("open", &self.path))?;
        let meta = file
            .metadata()
            .map_err(ImageError::io("stat", &self.path))?;
        file.write_all(&data)
            .map_err(ImageError::io("append to", &self.path))?;
        // What was there plus this line is read: catch_up was called under the same exclusive
        // lock, so nobody else wrote meanwhile (a file made just now starts the replay afresh).
        if r.file != Some((meta.dev(), meta.ino())) {
            *r = Replayed {
                file: Some((meta.dev(), meta.ino())),
                live: std::mem::take(&mut r.live),
                ..Replayed::default()
            };
        }
        r.offset = meta.len() + data.len() as u64;
        r.clean_end = true;
        r.lines += 1;
        Ok(())
    }

    /// Rewrites the file with only the live leases once dead lines dominate it.
    fn compact_if_due(&self, r: &mut Replayed) -> Result<(), ImageError> {
        if r.lines < COMPACT_SLACK + 2 * r.live.len() {
            return Ok(());
        }
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let mut tmp = tempfile::Builder::new()
            .prefix(&format!("leases-{}-", std::process::id()))
            .tempfile_in(dir)
            .map_err(ImageError::io("create temp file", dir))?;
        let mut data = Vec::new();
        let mut holders: Vec<&String> = r.live.keys().collect();
        holders.sort();
        for holder in holders {
            let line = Line::Lease {
                holder: holder.clone(),
                lease: r.live[holder].clone(),
            };
            serde_json::to_writer(&mut data, &line).map_err(|source| ImageError::Corrupt {
                path: self.path.clone(),
                source,
            })?;
            data.push(b'\n');
        }
        tmp.write_all(&data)
            .map_err(ImageError::io("write", tmp.path()))?;
        let file = tmp
            .persist(&self.path)
            .map_err(|e| ImageError::io("replace", &self.path)(e.error))?;
        let meta = file
            .metadata()
            .map_err(ImageError::io("stat", &self.path))?;
        r.file = Some((meta.dev(), meta.ino()));
        r.offset = data.len() as u64;
        r.clean_end = true;
        r.lines = r.live.len();
        Ok(())
    }
}

/// Moves leases of the one-file-per-lease layout (`dir/<holder>.json`) into the journal and
/// removes the files, then `dir` itself. A file that cannot be parsed stays (and so does `dir`), so
/// that nothing it might hold is collected (see `ImageStore::old_leases`).
pub(crate) fn migrate_files(dir: &Path, leases: &Leases) -> Result<(), ImageError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(ImageError::io("read dir", dir)(e)),
    };
    let mut complete = true;
    for entry in entries {
        let entry = entry.map_err(ImageError::io("read dir", dir))?;
        let path = entry.path();
        let Some(holder) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
            .map(str::to_owned)
        else {
            continue;
        };
        match crate::read_json::<Lease>(&path) {
            Ok(Some(lease)) => {
                // Already in the journal if a migration stopped between the two steps.
                leases.add(&holder, lease)?;
                fs::remove_file(&path).map_err(ImageError::io("remove lease", &path))?;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "an old lease file could not be read; its layers are kept");
                complete = false;
            }
        }
    }
    if complete {
        // Fails, harmlessly, if something other than a lease file is in there.
        let _ = fs::remove_dir(dir);
    }
    Ok(())
}
