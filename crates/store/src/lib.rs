//! Durable sandbox records so a restarted server re-attaches to what is running and keeps expiry.
//!
//! One append-only journal, `<data_dir>/state/sandboxes.jsonl`: every save appends the whole record as
//! one JSON line, every removal a tombstone line; the last line for an id wins. It replaced a file per
//! record (written to a temp file and renamed) because each such replacement allocates and frees an
//! inode, a sandbox's life is four of them, and on ext4 — worst without a journal, where every
//! allocation scans past recently freed inodes — that was a measurable share of a create's CPU. An
//! append is one `write(2)` of about a kilobyte under a mutex. When the file holds four times what is
//! live (and at least `COMPACT_MIN`), it is rewritten with only live records and renamed into place.
//!
//! No fsync: the records describe running processes, which a power loss or kernel crash ends anyway
//! (after a reboot every record is re-checked and ends as Failed), so paying a disk flush on every
//! create and delete would buy nothing. A line torn by such a crash is the journal's last one; it is
//! cut off when the store is opened. The file is 0600: records hold each sandbox's endpoint token
//! and its environment. Records of the older one-file-per-sandbox layout are moved into the journal.
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use warren_api::lifecycle::SandboxState;
use warren_core::{ResourceLimits, RuntimeState};

pub mod transitions;
pub use transitions::IllegalTransition;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub image: String,
    /// The snapshot it was restored from (`image` is then the snapshot's image in the store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// A warm sandbox of this pool, not yet handed to anyone (not listed, never expires).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_pool: Option<String>,
    /// The pool it was allocated from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_ref: Option<String>,
    pub entrypoint: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub extensions: BTreeMap<String, String>,
    pub limits: ResourceLimits,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub state: SandboxState,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub last_transition_at: DateTime<Utc>,
    /// The sandbox's secret, from which each port's endpoint token is derived (an HMAC: see the
    /// server's `tokens`); never handed out, never enters the sandbox.
    pub token: String,
    #[serde(default)]
    pub runtime_state: RuntimeState,
    /// The sandbox's egress policy (wire form), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<serde_json::Value>,
    /// Index of its network link, when it has one (re-attached after a server restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_link: Option<u32>,
    /// The credential vault's proxy is on for this sandbox.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub credential_proxy: bool,
    /// Its lifecycle hooks (`preStart`, `periodic`) as the server keeps them: the periodic ones
    /// are armed again after a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle_hooks: Option<serde_json::Value>,
    /// The tenant whose sandbox it is (records from before tenants: the default one).
    #[serde(default = "default_tenant")]
    pub tenant: String,
}

/// The tenant of objects made before tenants existed, and of the server's own key.
pub const DEFAULT_TENANT: &str = "default";

pub fn default_tenant() -> String {
    DEFAULT_TENANT.to_string()
}

impl SandboxRecord {
    /// Moves the sandbox to `state`, if the table in [`transitions`] allows it from where it is;
    /// a refused move changes nothing.
    pub fn transition(
        &mut self,
        state: SandboxState,
        reason: Option<&str>,
        message: Option<String>,
    ) -> Result<(), IllegalTransition> {
        if !transitions::allowed(self.state, state) {
            return Err(IllegalTransition {
                id: self.id.clone(),
                from: self.state,
                to: state,
            });
        }
        self.state = state;
        self.reason = reason.map(str::to_string);
        self.message = message;
        self.last_transition_at = Utc::now();
        Ok(())
    }

    /// Takes back a move whose step failed (a delete the runtime could not start): the state, its
    /// reason, message and time, as they were in `before`.
    pub fn take_back(&mut self, before: &SandboxRecord) {
        self.state = before.state;
        self.reason = before.reason.clone();
        self.message = before.message.clone();
        self.last_transition_at = before.last_transition_at;
    }
}

#[cfg(test)]
impl SandboxRecord {
    /// A Running sandbox of the `host` image, for tests.
    pub(crate) fn for_tests(id: &str) -> Self {
        Self {
            id: id.into(),
            image: "host".into(),
            snapshot_id: None,
            warm_pool: None,
            pool_ref: None,
            entrypoint: vec!["tail".into(), "-f".into(), "/dev/null".into()],
            env: BTreeMap::new(),
            metadata: [("team".to_string(), "a".to_string())]
                .into_iter()
                .collect(),
            extensions: BTreeMap::new(),
            limits: ResourceLimits {
                cpu_millis: Some(1000),
                memory_bytes: None,
                pids: 4096,
                disk_bytes: None,
            },
            created_at: Utc::now(),
            expires_at: None,
            state: SandboxState::Running,
            reason: None,
            message: None,
            last_transition_at: Utc::now(),
            token: "t".into(),
            runtime_state: serde_json::json!({"pid": 1}),
            network_policy: None,
            network_link: None,
            credential_proxy: false,
            lifecycle_hooks: None,
            tenant: default_tenant(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state file {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("sandbox record {path} is corrupt")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// One journal line, as read.
#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum Line {
    Put(Box<SandboxRecord>),
    Del(String),
}

/// One journal line, as written (the same shape, borrowed).
#[derive(Serialize)]
#[serde(rename_all = "lowercase")]
enum LineRef<'a> {
    Put(&'a SandboxRecord),
    Del(&'a str),
}

/// Below this size the journal is never compacted.
const COMPACT_MIN: u64 = 1 << 20;
/// Compact when the file is this many times larger than its live records.
const COMPACT_RATIO: u64 = 4;

#[derive(Debug, Clone)]
pub struct Store {
    path: PathBuf,
    journal: std::sync::Arc<std::sync::Mutex<Journal>>,
}

#[derive(Debug)]
struct Journal {
    file: fs::File,
    /// Bytes in the file.
    len: u64,
    /// The live line of each record (with its newline): compaction writes these out as they are,
    /// without reading and parsing the file again under the lock that every save waits on.
    live: BTreeMap<String, Vec<u8>>,
    /// Bytes of the live lines.
    live_len: u64,
}

/// What a journal's bytes say: the live record lines by id, unreadable lines, and how many leading
/// bytes end in a complete line (what follows is a torn write).
struct Replay {
    lines: BTreeMap<String, (Box<SandboxRecord>, Vec<u8>)>,
    errors: Vec<serde_json::Error>,
    complete: usize,
}

fn replay(bytes: &[u8]) -> Replay {
    let complete = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    let mut lines = BTreeMap::new();
    let mut errors = Vec::new();
    for line in bytes[..complete].split(|b| *b == b'\n') {
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Line>(line) {
            Ok(Line::Put(r)) => {
                let mut kept = line.to_vec();
                kept.push(b'\n');
                lines.insert(r.id.clone(), (r, kept));
            }
            Ok(Line::Del(id)) => {
                lines.remove(&id);
            }
            Err(e) => errors.push(e),
        }
    }
    Replay {
        lines,
        errors,
        complete,
    }
}

fn lock(m: &std::sync::Mutex<Journal>) -> std::sync::MutexGuard<'_, Journal> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Store {
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        let dir = data_dir.join("state");
        let path = dir.join("sandboxes.jsonl");
        let io_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { path, source }
        };
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let _ = fs::remove_file(dir.join("sandboxes.jsonl.tmp"));
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io_err(&path)(e)),
        };
        let replayed = replay(&bytes);
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err(&path))?;
        if replayed.complete < bytes.len() {
            // A torn last line (a crash mid-append): appending after it would glue the next line on.
            file.set_len(replayed.complete as u64)
                .map_err(io_err(&path))?;
        }
        let live: BTreeMap<String, Vec<u8>> = replayed
            .lines
            .into_iter()
            .map(|(id, (_, line))| (id, line))
            .collect();
        let store = Self {
            path,
            journal: std::sync::Arc::new(std::sync::Mutex::new(Journal {
                file,
                len: replayed.complete as u64,
                live_len: live.values().map(|l| l.len() as u64).sum(),
                live,
            })),
        };
        store.adopt_legacy(&dir.join("sandboxes"))?;
        Ok(store)
    }

    /// Moves records of the one-file-per-sandbox layout into the journal.
    fn adopt_legacy(&self, dir: &Path) -> Result<(), StoreError> {
        let Ok(entries) = fs::read_dir(dir) else {
            return Ok(());
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) == Some("json") {
                match fs::read(&path).map(|b| serde_json::from_slice::<SandboxRecord>(&b)) {
                    Ok(Ok(record)) => self.save(&record)?,
                    // Kept where it is, for an operator to look at; it never loaded anyway.
                    Ok(Err(_)) | Err(_) => continue,
                }
            }
            let _ = fs::remove_file(&path);
        }
        let _ = fs::remove_dir(dir);
        Ok(())
    }

    fn io_err(&self) -> impl Fn(io::Error) -> StoreError + '_ {
        |source| StoreError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Appends one line; returns it as written.
    fn append(&self, j: &mut Journal, line: &LineRef) -> Result<Vec<u8>, StoreError> {
        let mut bytes = serde_json::to_vec(line).map_err(|source| StoreError::Corrupt {
            path: self.path.clone(),
            source,
        })?;
        bytes.push(b'\n');
        // One write of the whole line: O_APPEND puts it at the end in one piece.
        if let Err(e) = j.file.write_all(&bytes) {
            // A part written (a full disk) would glue the next line onto it: cut it off again.
            let _ = j.file.set_len(j.len);
            return Err(self.io_err()(e));
        }
        j.len += bytes.len() as u64;
        Ok(bytes)
    }

    pub fn save(&self, record: &SandboxRecord) -> Result<(), StoreError> {
        let mut j = lock(&self.journal);
        let line = self.append(&mut j, &LineRef::Put(record))?;
        let n = line.len() as u64;
        let old = j
            .live
            .insert(record.id.clone(), line)
            .map_or(0, |l| l.len() as u64);
        j.live_len = j.live_len + n - old;
        self.maybe_compact(&mut j)
    }

    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let mut j = lock(&self.journal);
        if !j.live.contains_key(id) {
            return Ok(());
        }
        self.append(&mut j, &LineRef::Del(id))?;
        if let Some(old) = j.live.remove(id) {
            j.live_len -= old.len() as u64;
        }
        self.maybe_compact(&mut j)
    }

    fn maybe_compact(&self, j: &mut Journal) -> Result<(), StoreError> {
        if j.len < COMPACT_MIN || j.len < COMPACT_RATIO * j.live_len {
            return Ok(());
        }
        let tmp = self.path.with_extension("jsonl.tmp");
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(self.io_err())?;
        // One write: a few kB per live sandbox.
        let all: Vec<u8> = j.live.values().flatten().copied().collect();
        out.write_all(&all).map_err(self.io_err())?;
        let len = all.len() as u64;
        fs::rename(&tmp, &self.path).map_err(self.io_err())?;
        j.file = fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(self.io_err())?;
        j.len = len;
        j.live_len = len;
        Ok(())
    }

    /// Every live record, and the lines that could not be read.
    pub fn load_all(&self) -> Result<(Vec<SandboxRecord>, Vec<StoreError>), StoreError> {
        let _j = lock(&self.journal);
        let bytes = fs::read(&self.path).map_err(self.io_err())?;
        let replayed = replay(&bytes);
        let records = replayed.lines.into_values().map(|(r, _)| *r).collect();
        let errors = replayed
            .errors
            .into_iter()
            .map(|source| StoreError::Corrupt {
                path: self.path.clone(),
                source,
            })
            .collect();
        Ok((records, errors))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> SandboxRecord {
        SandboxRecord::for_tests(id)
    }

    #[test]
    fn save_load_remove_roundtrip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        store.save(&record("a")).expect("save a");
        let mut b = record("b");
        store.save(&b).expect("save b");
        b.transition(SandboxState::Terminated, Some("user_delete"), None)
            .expect("a running sandbox may end");
        store.save(&b).expect("overwrite b");
        let (mut all, errors) = store.load_all().expect("load");
        all.sort_by(|x, y| x.id.cmp(&y.id));
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].state, SandboxState::Terminated);
        assert_eq!(all[1].reason.as_deref(), Some("user_delete"));
        assert!(errors.is_empty());
        store.remove("a").expect("remove");
        store.remove("a").expect("remove twice is fine");
        assert_eq!(store.load_all().expect("load").0.len(), 1);
        // a new process sees the same
        let reopened = Store::open(dir.path()).expect("reopen");
        let (all, _) = reopened.load_all().expect("load");
        assert_eq!(all.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["b"]);
        assert_eq!(all[0].state, SandboxState::Terminated);
    }

    #[test]
    fn a_torn_last_line_is_cut_and_a_corrupt_line_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        store.save(&record("a")).expect("save a");
        drop(store);
        let path = dir.path().join("state/sandboxes.jsonl");
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        f.write_all(b"{not json}\n{\"put\":{\"id\":\"half")
            .expect("write");
        drop(f);
        let store = Store::open(dir.path()).expect("reopen");
        store.save(&record("c")).expect("save after the torn line");
        let (mut all, errors) = store.load_all().expect("load");
        all.sort_by(|x, y| x.id.cmp(&y.id));
        assert_eq!(
            all.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
        assert_eq!(
            errors.len(),
            1,
            "the corrupt middle line is reported: {errors:?}"
        );
        let text = fs::read_to_string(&path).expect("read");
        assert!(!text.contains("half"), "the torn tail is gone");
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn the_journal_is_compacted_and_keeps_what_is_live() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        let path = dir.path().join("state/sandboxes.jsonl");
        store.save(&record("keep")).expect("save");
        let mut peak = 0;
        for i in 0..3000 {
            let mut r = record(&format!("gone-{i}"));
            store.save(&r).expect("save");
            r.transition(SandboxState::Terminated, Some("user_delete"), None)
                .expect("a running sandbox may end");
            store.save(&r).expect("save");
            store.remove(&r.id).expect("remove");
            peak = peak.max(fs::metadata(&path).expect("stat").len());
            if i == 1500 {
                // compactions after this must write the record's latest line, not its first
                let mut keep = record("keep");
                keep.transition(SandboxState::Paused, None, None)
                    .expect("a running sandbox may be found paused");
                store.save(&keep).expect("save");
            }
        }
        let size = fs::metadata(&path).expect("stat").len();
        assert!(
            peak < 2 * COMPACT_MIN,
            "compaction kept the file small: peak {peak}"
        );
        assert!(size < COMPACT_MIN, "{size}");
        let (all, errors) = Store::open(dir.path())
            .expect("reopen")
            .load_all()
            .expect("load");
        assert!(errors.is_empty());
        assert_eq!(
            all.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["keep"]
        );
        assert_eq!(all[0].state, SandboxState::Paused);
        assert!(!dir.path().join("state/sandboxes.jsonl.tmp").exists());
    }

    #[test]
    fn records_of_the_file_per_sandbox_layout_move_into_the_journal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let legacy = dir.path().join("state/sandboxes");
        fs::create_dir_all(&legacy).expect("mkdir");
        fs::write(
            legacy.join("old.json"),
            serde_json::to_vec(&record("old")).expect("json"),
        )
        .expect("write");
        fs::write(legacy.join(".old.tmp"), b"partial").expect("write");
        let store = Store::open(dir.path()).expect("open");
        let (all, _) = store.load_all().expect("load");
        assert_eq!(
            all.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["old"]
        );
        assert!(!legacy.exists(), "the old folder is gone once emptied");
    }
}
