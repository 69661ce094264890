//! Durable sandbox records so a restarted server re-attaches to what is running and keeps expiry.
//!
//! One JSON file per sandbox under `<data_dir>/state/sandboxes/`, written to a temp file and renamed,
//! so a crash of the server leaves either the old or the new record, never half of one. No fsync: the
//! records describe running processes, which a power loss or kernel crash ends anyway (after a reboot
//! every record is re-checked and ends as Failed), so paying a disk flush on every create and delete
//! would buy nothing; a torn file after such a crash is skipped as corrupt. A file per record
//! keeps writes independent (no global lock, no compaction) and lets an operator read state with `cat`;
//! at the scale of one machine's sandboxes (thousands) loading them all at start is milliseconds.
//! Files are 0600: records hold each sandbox's endpoint token and its environment.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use warren_api::lifecycle::SandboxState;
use warren_core::{ResourceLimits, RuntimeState};

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
    /// Per-sandbox secret that proxied requests must carry; never enters the sandbox.
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
}

impl SandboxRecord {
    pub fn transition(
        &mut self,
        state: SandboxState,
        reason: Option<&str>,
        message: Option<String>,
    ) {
        self.state = state;
        self.reason = reason.map(str::to_string);
        self.message = message;
        self.last_transition_at = Utc::now();
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state folder {path}")]
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

#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        let dir = data_dir.join("state").join("sandboxes");
        fs::create_dir_all(&dir).map_err(|source| StoreError::Io {
            path: dir.clone(),
            source,
        })?;
        Ok(Self { dir })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    pub fn save(&self, record: &SandboxRecord) -> Result<(), StoreError> {
        let path = self.path(&record.id);
        let tmp = self.dir.join(format!(".{}.tmp", record.id));
        let io_err = |source| StoreError::Io {
            path: path.clone(),
            source,
        };
        let bytes = serde_json::to_vec_pretty(record).map_err(|source| StoreError::Corrupt {
            path: path.clone(),
            source,
        })?;
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err)?;
        f.write_all(&bytes).map_err(io_err)?;
        fs::rename(&tmp, &path).map_err(io_err)
    }

    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let path = self.path(id);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(StoreError::Io { path, source: e })
            }
            _ => Ok(()),
        }
    }

    /// Every record; a corrupt file is reported and skipped rather than blocking start-up.
    pub fn load_all(&self) -> Result<(Vec<SandboxRecord>, Vec<StoreError>), StoreError> {
        let mut records = Vec::new();
        let mut errors = Vec::new();
        let entries = fs::read_dir(&self.dir).map_err(|source| StoreError::Io {
            path: self.dir.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                if path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.ends_with(".tmp"))
                {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            match fs::read(&path) {
                Ok(bytes) => match serde_json::from_slice(&bytes) {
                    Ok(r) => records.push(r),
                    Err(source) => errors.push(StoreError::Corrupt { path, source }),
                },
                Err(source) => errors.push(StoreError::Io { path, source }),
            }
        }
        Ok((records, errors))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> SandboxRecord {
        SandboxRecord {
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
        }
    }

    #[test]
    fn save_load_remove_roundtrip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        store.save(&record("a")).expect("save a");
        let mut b = record("b");
        store.save(&b).expect("save b");
        b.transition(SandboxState::Terminated, Some("user_delete"), None);
        store.save(&b).expect("overwrite b");
        fs::write(dir.path().join("state/sandboxes/c.json"), b"{not json").expect("write corrupt");
        let (mut all, errors) = store.load_all().expect("load");
        all.sort_by(|x, y| x.id.cmp(&y.id));
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].state, SandboxState::Terminated);
        assert_eq!(all[1].reason.as_deref(), Some("user_delete"));
        assert_eq!(errors.len(), 1);
        store.remove("a").expect("remove");
        store.remove("a").expect("remove twice is fine");
        assert_eq!(store.load_all().expect("load").0.len(), 1);
    }
}
