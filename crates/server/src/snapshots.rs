//! Snapshots: the file system of a running sandbox captured as an image in the store (its image's
//! layers plus its writable layer, under `warren-snapshot/<id>`), restored by creates with
//! `snapshotId`. Every sandbox restored from one snapshot shares all of its layers, so N of them
//! (a fork) cost N overlay mounts, not N copies.
//!
//! Records are JSON files under `<data_dir>/snapshots`, replaced atomically; a capture that a
//! server restart interrupted is marked Failed at the next start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use warren_api::lifecycle::{Snapshot, SnapshotStatus};
use warren_api::ErrorCode;
use warren_image::{ImageStore, SNAPSHOT_REPOSITORY};

use crate::error::{ErrorKind, SandboxError};
use crate::keys::Caller;
use crate::sandboxes::{snapshot_source_state, Sandboxes};
use crate::time::rfc3339;

pub const CREATING: &str = "Creating";
pub const READY: &str = "Ready";
pub const FAILED: &str = "Failed";
const MAX_NAME_LEN: usize = 253;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub id: String,
    pub sandbox_id: String,
    pub name: Option<String>,
    pub state: String,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub created_at: DateTime<Utc>,
    pub last_transition_at: DateTime<Utc>,
    /// The store image holding the captured file system.
    pub image: String,
    /// Whose it is: its sandbox's tenant.
    #[serde(default = "warren_store::default_tenant")]
    pub tenant: String,
    /// What it adds to the image store (the layer its capture made), once Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

impl SnapshotRecord {
    pub fn to_wire(&self) -> Snapshot {
        Snapshot {
            id: self.id.clone(),
            sandbox_id: self.sandbox_id.clone(),
            name: self.name.clone(),
            status: SnapshotStatus {
                state: self.state.clone(),
                reason: self.reason.clone(),
                message: self.message.clone(),
                last_transition_at: Some(rfc3339(self.last_transition_at)),
            },
            created_at: rfc3339(self.created_at),
        }
    }
}

#[derive(Clone)]
pub struct Snapshots {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    records: RwLock<HashMap<String, SnapshotRecord>>,
    images: Arc<ImageStore>,
    sandboxes: Sandboxes,
    quotas: Arc<crate::quotas::Quotas>,
}

impl Snapshots {
    /// Loads the records under `<data_dir>/snapshots`; captures a previous run left half done are
    /// marked Failed and their partial images removed.
    pub fn open(
        data_dir: &Path,
        sandboxes: Sandboxes,
        quotas: Arc<crate::quotas::Quotas>,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let dir = data_dir.join("snapshots");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut records = HashMap::new();
        let mut interrupted = Vec::new();
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let text = std::fs::read(&path)?;
            let Ok(mut rec) = serde_json::from_slice::<SnapshotRecord>(&text) else {
                tracing::warn!(path = %path.display(), "unreadable snapshot record left alone");
                continue;
            };
            if rec.state == CREATING {
                rec.state = FAILED.into();
                rec.reason = Some("server_restart".into());
                rec.message = Some("the server stopped while the snapshot was being taken".into());
                rec.last_transition_at = Utc::now();
                interrupted.push(rec.clone());
            }
            records.insert(rec.id.clone(), rec);
        }
        let snapshots = Snapshots {
            inner: Arc::new(Inner {
                dir,
                records: RwLock::new(records),
                images: sandboxes.images().clone(),
                sandboxes,
                quotas,
            }),
        };
        for rec in interrupted {
            let _ = snapshots.inner.images.remove(&rec.image);
            snapshots.persist(&rec);
        }
        // A capture whose snapshot was deleted while it ran, cut off by a stop before it could
        // drop its image: the image has no record, so nothing else would ever remove it.
        let known: std::collections::HashSet<String> = snapshots
            .inner
            .records
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        for image in snapshots.inner.images.list().unwrap_or_default() {
            let Some(rest) = image.name.strip_prefix(SNAPSHOT_REPOSITORY) else {
                continue;
            };
            let id = rest.split(':').next().unwrap_or(rest);
            if !known.contains(id) {
                tracing::info!(image = %image.name, "removing a snapshot image with no snapshot");
                let _ = snapshots.inner.images.remove(&image.name);
            }
        }
        Ok(snapshots)
    }

    /// Starts a capture of `sandbox_id` and answers at once with the record (state Creating); the
    /// capture itself runs in the background and ends Ready or Failed.
    pub async fn create(
        &self,
        sandbox_id: &str,
        name: Option<String>,
    ) -> Result<SnapshotRecord, SandboxError> {
        if let Some(n) = &name {
            if n.is_empty() || n.len() > MAX_NAME_LEN || n.chars().any(char::is_control) {
                return Err(SandboxError::invalid(format!(
                    "snapshot name must be 1 to {MAX_NAME_LEN} printable characters"
                )));
            }
        }
        // Refuse early what the capture would refuse (unknown sandbox, wrong state).
        let source = self
            .inner
            .sandboxes
            .get(sandbox_id)
            .ok_or_else(|| SandboxError::not_found(sandbox_id))?;
        snapshot_source_state(&source)?;
        self.inner.sandboxes.check_snapshots()?;
        // The capture copies the sandbox's writable layer into the image store.
        self.inner.sandboxes.check_room("a snapshot")?;
        // Its size is known only once it is taken (checked again then): here, a quota already
        // reached refuses it; and under a quota one capture at a time is taken (`begin`), so that
        // several at once cannot each fill the disk before the quota is looked at.
        self.inner.quotas.admit_snapshot(
            &source.tenant,
            self.bytes_of(&source.tenant, None),
            None,
        )?;
        let id = uuid::Uuid::new_v4().to_string();
        let now = Utc::now();
        let rec = SnapshotRecord {
            image: format!("{SNAPSHOT_REPOSITORY}{id}"),
            id,
            sandbox_id: sandbox_id.to_owned(),
            name,
            state: CREATING.into(),
            reason: None,
            message: None,
            created_at: now,
            last_transition_at: now,
            tenant: source.tenant.clone(),
            size_bytes: None,
        };
        let one_at_a_time = self
            .inner
            .quotas
            .quota(&source.tenant)
            .snapshot_bytes
            .is_some();
        if !self.begin(&rec, one_at_a_time) {
            let mut e = SandboxError::new(
                ErrorKind::Busy,
                ErrorCode::QuotaExceeded,
                format!("quota snapshot_storage: tenant {} has a snapshot being taken; under a storage quota one is taken at a time", source.tenant),
            );
            e.retry_after = Some(2);
            return Err(e);
        }
        let me = self.clone();
        let capture = rec.clone();
        tokio::spawn(async move {
            // In a task of its own: should it panic, the snapshot still ends, Failed.
            let (sandboxes, sid, image) = (
                me.inner.sandboxes.clone(),
                capture.sandbox_id.clone(),
                capture.image.clone(),
            );
            let outcome = tokio::spawn(async move { sandboxes.capture(&sid, &image).await })
                .await
                .unwrap_or_else(|e| Err(SandboxError::internal("taking the snapshot", &e)));
            let mut done = capture.clone();
            done.last_transition_at = Utc::now();
            match outcome {
                Ok(adds) => {
                    done.state = READY.into();
                    done.size_bytes = Some(adds);
                }
                Err(e) => {
                    done.state = FAILED.into();
                    done.reason = Some("capture_failed".into());
                    done.message = Some(e.public_message());
                }
            }
            // Deleted while it was being taken, or past the tenant's storage quota: drop what the
            // capture made. Checked and written under the lock `delete` removes the record with,
            // so the record cannot come back after a delete, exactly one of the two removes the
            // image, and two captures ending at once cannot both slip under the quota.
            if !me.finish(&mut done) {
                let images = me.inner.images.clone();
                let image = done.image.clone();
                let _ = tokio::task::spawn_blocking(move || images.remove(&image)).await;
            }
        });
        Ok(rec)
    }

    pub fn get(&self, id: &str) -> Option<SnapshotRecord> {
        self.inner
            .records
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    pub fn lookup(&self, id: &str) -> Result<SnapshotRecord, SandboxError> {
        self.get(id).ok_or_else(|| not_found(id))
    }

    /// Snapshot `id` if `caller` sees it: another tenant's answers as a missing one.
    pub fn lookup_as(&self, caller: &Caller, id: &str) -> Result<SnapshotRecord, SandboxError> {
        self.get(id)
            .filter(|r| caller.sees(&r.tenant))
            .ok_or_else(|| not_found(id))
    }

    /// Every record, oldest first.
    pub fn all(&self) -> Vec<SnapshotRecord> {
        let mut all: Vec<SnapshotRecord> = self
            .inner
            .records
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        all
    }

    /// The store image a create with `snapshotId` runs; the snapshot must be Ready, and `tenant`'s.
    pub fn image_for_restore(&self, id: &str, tenant: &str) -> Result<String, SandboxError> {
        let rec = self
            .get(id)
            .filter(|r| r.tenant == tenant)
            .ok_or_else(|| not_found(id))?;
        if rec.state != READY {
            return Err(SandboxError::conflict(
                ErrorCode::SnapshotInvalidState,
                format!("snapshot {id} is {}, not Ready", rec.state),
            ));
        }
        Ok(rec.image)
    }

    /// Deletes the record and the image name; sandboxes restored from it keep their layers (their
    /// leases) until they are gone. A capture in progress ends as if it never happened.
    pub async fn delete(&self, id: &str) -> Result<(), SandboxError> {
        // The state that decides who removes the image is the one at removal, under the lock
        // the capture's end writes with (see `create`).
        let rec = {
            let mut records = self
                .inner
                .records
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let rec = records.remove(id).ok_or_else(|| not_found(id))?;
            if let Err(e) = std::fs::remove_file(self.path(id)) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    records.insert(id.to_owned(), rec);
                    return Err(SandboxError::internal("removing the snapshot record", &e));
                }
            }
            rec
        };
        if rec.state != CREATING {
            let images = self.inner.images.clone();
            let removed = tokio::task::spawn_blocking(move || images.remove(&rec.image))
                .await
                .map_err(|e| SandboxError::internal("removing the snapshot image", &e))?;
            match removed {
                Ok(()) | Err(warren_image::ImageError::NotFound { .. }) => {}
                Err(e) => return Err(SandboxError::internal("removing the snapshot image", &e)),
            }
        }
        Ok(())
    }

    /// Writes the end of a capture if its record still exists (it was not deleted meanwhile): Ready
    /// only within the tenant's snapshot storage quota, else Failed. False when the image it made
    /// must go.
    fn finish(&self, done: &mut SnapshotRecord) -> bool {
        let mut records = self
            .inner
            .records
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if !records.contains_key(&done.id) {
            return false;
        }
        let mut keep = true;
        if let Some(adds) = done.size_bytes.filter(|_| done.state == READY) {
            let used = bytes_in(records.values(), &done.tenant, Some(&done.id));
            if let Err(e) = self
                .inner
                .quotas
                .admit_snapshot(&done.tenant, used, Some(adds))
            {
                done.state = FAILED.into();
                done.reason = Some("quota_exceeded".into());
                done.message = Some(e.public_message());
                done.size_bytes = None;
                keep = false;
            }
        }
        self.persist(done);
        records.insert(done.id.clone(), done.clone());
        keep
    }

    /// Records a capture that starts; with `one_at_a_time`, only if its tenant has none in
    /// progress (checked and written under one lock).
    fn begin(&self, rec: &SnapshotRecord, one_at_a_time: bool) -> bool {
        let mut records = self
            .inner
            .records
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if one_at_a_time
            && records
                .values()
                .any(|r| r.tenant == rec.tenant && r.state == CREATING)
        {
            return false;
        }
        self.persist(rec);
        records.insert(rec.id.clone(), rec.clone());
        true
    }

    /// What `tenant`'s Ready snapshots take in the image store (but `except`'s).
    pub fn bytes_of(&self, tenant: &str, except: Option<&str>) -> u64 {
        let records = self.inner.records.read().unwrap_or_else(|p| p.into_inner());
        bytes_in(records.values(), tenant, except)
    }

    fn persist(&self, rec: &SnapshotRecord) {
        let path = self.path(&rec.id);
        let write = || -> std::io::Result<()> {
            crate::state_file::replace(&path, &serde_json::to_vec_pretty(rec)?)
        };
        if let Err(e) = write() {
            tracing::error!(snapshot = %rec.id, "persisting the snapshot record failed: {e}");
        }
    }

    fn path(&self, id: &str) -> PathBuf {
        self.inner.dir.join(format!("{id}.json"))
    }
}

fn bytes_in<'a>(
    records: impl Iterator<Item = &'a SnapshotRecord>,
    tenant: &str,
    except: Option<&str>,
) -> u64 {
    records
        .filter(|r| r.tenant == tenant && r.state == READY && Some(r.id.as_str()) != except)
        .filter_map(|r| r.size_bytes)
        .sum()
}

fn not_found(id: &str) -> SandboxError {
    SandboxError::new(
        ErrorKind::NotFound,
        ErrorCode::SnapshotNotFound,
        format!("snapshot {id} not found"),
    )
}
