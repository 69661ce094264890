//! The audit log: one JSON line per mutating call of the API and per request the endpoint proxy
//! takes — when, who (tenant and key id), what (method and route, ids shown as `{id}`; for the
//! proxy, the port), which sandbox, the status it was answered with, the request id and the
//! client's address — in `<data_dir>/audit/audit.jsonl`, rotated by size (`audit.jsonl.1` is the
//! newest older file). Never a body, a header, a query or a key: nothing that could hold a secret.
//! `warren audit` reads it back with filters. What is logged of each request is the HTTP layer's
//! (`http::audit`).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub use crate::config::AuditSection;

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEntry {
    pub time: DateTime<Utc>,
    /// `None`: the caller had no valid key.
    pub tenant: Option<String>,
    pub key_id: Option<String>,
    /// `POST /sandboxes/{id}/pause`, `proxy 8080`.
    pub action: String,
    pub sandbox: Option<String>,
    /// The pool, snapshot, template or key the route names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
    pub status: u16,
    pub request_id: Option<String>,
    pub client: Option<String>,
}

/// The peer a request came from (set by the front door).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

pub const FILE: &str = "audit.jsonl";

pub fn dir(data_dir: &Path) -> PathBuf {
    data_dir.join("audit")
}

struct Open {
    file: std::fs::File,
    size: u64,
}

pub struct AuditLog {
    dir: PathBuf,
    cfg: AuditSection,
    open: Mutex<Option<Open>>,
    anonymous: Mutex<Anonymous>,
}

/// Lines for callers with no valid key are bounded: anyone can send requests, and the log must not
/// fill the disk (or push the keyed lines out through rotation) for them. Past the bound they are
/// counted, and the count is written with the next one that is kept.
const ANONYMOUS_PER_SECOND: u32 = 50;

#[derive(Default)]
struct Anonymous {
    second: i64,
    written: u32,
    dropped: u64,
}

/// Longest a field the client chose (a request id, a path's part) is kept.
const MAX_FIELD: usize = 200;

fn capped(mut s: String) -> String {
    if s.len() > MAX_FIELD {
        let mut end = MAX_FIELD;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

impl AuditLog {
    pub fn new(data_dir: &Path, cfg: AuditSection) -> Self {
        Self {
            dir: dir(data_dir),
            cfg,
            open: Mutex::new(None),
            anonymous: Mutex::new(Anonymous::default()),
        }
    }

    fn path(&self, n: u32) -> PathBuf {
        match n {
            0 => self.dir.join(FILE),
            n => self.dir.join(format!("{FILE}.{n}")),
        }
    }

    fn open_file(&self) -> std::io::Result<Open> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(self.path(0))?;
        let size = file.metadata()?.len();
        Ok(Open { file, size })
    }

    /// Appends `entry` (one `write`), rotating first when the file is full. A failure is logged,
    /// never the caller's: the request has been answered.
    pub fn record(&self, entry: &AuditEntry) {
        if !self.cfg.enabled {
            return;
        }
        let mut entry = AuditEntry {
            action: capped(entry.action.clone()),
            sandbox: entry.sandbox.clone().map(capped),
            object: entry.object.clone().map(capped),
            request_id: entry.request_id.clone().map(capped),
            ..entry.clone()
        };
        let mut line = Vec::new();
        if entry.tenant.is_none() {
            let mut a = self.anonymous.lock().unwrap_or_else(|e| e.into_inner());
            let second = entry.time.timestamp();
            if a.second != second {
                (a.second, a.written) = (second, 0);
            }
            if a.written >= ANONYMOUS_PER_SECOND {
                a.dropped += 1;
                return;
            }
            a.written += 1;
            if a.dropped > 0 {
                let note = AuditEntry {
                    action: format!("(not recorded: {} requests with no valid key)", a.dropped),
                    sandbox: None,
                    object: None,
                    status: 0,
                    request_id: None,
                    client: None,
                    ..entry.clone()
                };
                a.dropped = 0;
                let Ok(mut text) = serde_json::to_vec(&note) else {
                    return;
                };
                text.push(b'\n');
                line = text;
            }
        }
        entry.client = entry.client.take().map(capped);
        let Ok(text) = serde_json::to_vec(&entry) else {
            return;
        };
        line.extend_from_slice(&text);
        line.push(b'\n');
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let result = (|| -> std::io::Result<()> {
            if open
                .as_ref()
                .is_some_and(|o| o.size + line.len() as u64 > self.cfg.rotate_bytes && o.size > 0)
            {
                *open = None;
                for n in (1..self.cfg.keep_files).rev() {
                    let _ = std::fs::rename(self.path(n), self.path(n + 1));
                }
                if self.cfg.keep_files > 0 {
                    std::fs::rename(self.path(0), self.path(1))?;
                } else {
                    std::fs::remove_file(self.path(0))?;
                }
            }
            if open.is_none() {
                *open = Some(self.open_file()?);
            }
            let o = open.as_mut().expect("opened above");
            o.file.write_all(&line)?;
            o.size += line.len() as u64;
            Ok(())
        })();
        if let Err(e) = result {
            *open = None;
            tracing::error!(error = %e, dir = %self.dir.display(), "writing the audit log");
        }
    }
}

/// Every file of the log, oldest first.
pub fn files(data_dir: &Path) -> Vec<PathBuf> {
    let d = dir(data_dir);
    let mut numbered: Vec<(u32, PathBuf)> = std::fs::read_dir(&d)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = if name == FILE {
                0
            } else {
                name.strip_prefix(&format!("{FILE}."))?.parse().ok()?
            };
            Some((n, e.path()))
        })
        .collect();
    numbered.sort_by_key(|(n, _)| std::cmp::Reverse(*n));
    numbered.into_iter().map(|(_, p)| p).collect()
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_rotates_by_size_and_keeps_as_many_files_as_asked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = AuditLog::new(
            dir.path(),
            AuditSection {
                enabled: true,
                rotate_bytes: 400,
                keep_files: 2,
            },
        );
        let entry = |n: u16| AuditEntry {
            time: Utc::now(),
            tenant: Some("acme".into()),
            key_id: Some("k".into()),
            action: "POST /sandboxes".into(),
            sandbox: None,
            object: None,
            status: n,
            request_id: None,
            client: None,
        };
        for n in 0..40 {
            log.record(&entry(n));
        }
        let all = files(dir.path());
        assert_eq!(all.len(), 3, "{all:?}");
        let mut statuses = Vec::new();
        for f in &all {
            assert!(std::fs::metadata(f).expect("stat").len() <= 400);
            for line in std::fs::read_to_string(f).expect("read").lines() {
                statuses.push(
                    serde_json::from_str::<AuditEntry>(line)
                        .expect("line")
                        .status,
                );
            }
        }
        // Oldest first, in order, ending with the last written.
        assert!(statuses.windows(2).all(|w| w[0] < w[1]), "{statuses:?}");
        assert_eq!(statuses.last(), Some(&39));
    }

    #[test]
    fn callers_with_no_key_cannot_flood_the_log_and_long_fields_are_cut() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = AuditLog::new(dir.path(), AuditSection::default());
        let at = |second: i64| chrono::DateTime::from_timestamp(second, 0).expect("time");
        let anonymous = |second: i64| AuditEntry {
            time: at(second),
            tenant: None,
            key_id: None,
            action: format!("POST /{}", "x".repeat(10_000)),
            sandbox: None,
            object: None,
            status: 401,
            request_id: Some("r".repeat(10_000)),
            client: None,
        };
        for _ in 0..1_000 {
            log.record(&anonymous(100));
        }
        // A keyed caller's lines are never dropped.
        let keyed = AuditEntry {
            tenant: Some("acme".into()),
            ..anonymous(100)
        };
        for _ in 0..100 {
            log.record(&keyed);
        }
        log.record(&anonymous(101));
        let lines: Vec<AuditEntry> = std::fs::read_to_string(dir.path().join("audit").join(FILE))
            .expect("read")
            .lines()
            .map(|l| serde_json::from_str(l).expect("line"))
            .collect();
        let kept = |t: Option<&str>| lines.iter().filter(|e| e.tenant.as_deref() == t).count();
        assert_eq!(kept(Some("acme")), 100);
        // 50 in the first second, then the count of the rest, then the next second's.
        assert_eq!(kept(None), ANONYMOUS_PER_SECOND as usize + 2);
        assert!(lines
            .iter()
            .any(|e| e.action == "(not recorded: 950 requests with no valid key)"));
        assert!(lines.iter().all(|e| e.action.len() <= MAX_FIELD + 3
            && e.request_id
                .as_ref()
                .is_none_or(|r| r.len() <= MAX_FIELD + 3)));
    }
}
