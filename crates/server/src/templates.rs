//! Templates (`/v1/templates`, create with `templateId`): the reference's fsb templates — a golden
//! image built once from an OCI image, from which sandboxes start already warmed up — made of
//! Warren's own parts. A build starts a sandbox from the image with the template's entrypoint, env
//! and resources (hidden from lists, as warm sandboxes are), waits for its readiness probe, takes a
//! snapshot of it and deletes it: the snapshot is the golden image. A create naming the template
//! restores that snapshot and runs the template's entrypoint, env and resources under whatever the
//! request adds.
//!
//! `publish` (the reference's S3 target) is recorded; the golden image stays in Warren's store, and
//! `format` is always `native`. Templates live in `templates.json` in the data dir; a build a
//! server restart cut off ends Failed.
//!
//! Why one file: it is one feature end to end. The records and their file, the API calls, the
//! background build and how a create applies a template all read and change the same `Record`s
//! under one lock.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use warren_api::lifecycle::{
    CreateSandboxRequest, CreateTemplateRequest, ImageSpec, Template, TemplateStatus,
};
use warren_api::ErrorCode;

use crate::config::LimitsSection;
use crate::error::{ErrorKind, SandboxError};
use crate::keys::Caller;
use crate::sandboxes::{Sandboxes, REASON_USER_DELETE};
use crate::snapshots::{self, Snapshots};
use crate::stored::Stored;
use crate::volumes::StoragePolicy;

pub const PENDING: &str = "Pending";
pub const BUILDING: &str = "Building";
pub const SUCCEEDED: &str = "Succeeded";
pub const FAILED: &str = "Failed";

/// How long a build may wait for its readiness probe when the template gives no `warmupSeconds`.
const DEFAULT_WARMUP: u64 = 60;
/// The longest warmup a template may ask for.
const MAX_WARMUP: u64 = 3600;
/// How long a build waits for its snapshot.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(600);

/// A template as kept on disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    id: String,
    request: CreateTemplateRequest,
    phase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    message: Option<String>,
    /// The golden image, once built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot_id: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    /// Whose it is (its build sandbox, golden image and the sandboxes made from it are too).
    #[serde(default = "warren_store::default_tenant")]
    tenant: String,
}

impl Record {
    fn to_wire(&self) -> Template {
        let r = &self.request;
        Template {
            template_id: self.id.clone(),
            image: r.image.clone(),
            publish: r.publish.clone(),
            format: "native".into(),
            status: TemplateStatus {
                phase: self.phase.clone(),
                manifest_ref: self
                    .snapshot_id
                    .as_ref()
                    .filter(|_| self.phase == SUCCEEDED)
                    .map(|s| format!("warren-snapshot://{s}")),
                message: self.message.clone(),
            },
            created_at: crate::time::rfc3339(self.created_at),
            updated_at: crate::time::rfc3339(self.updated_at),
            resource_limits: r.resource_limits.clone(),
            entrypoint: r.entrypoint.clone(),
            env: r.env.clone(),
            metadata: r.metadata.clone(),
            readiness: r.readiness.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Templates {
    inner: Arc<Inner>,
}

struct Inner {
    file: PathBuf,
    records: Mutex<BTreeMap<String, Record>>,
    /// Serializes [`Templates::save`].
    saving: Mutex<()>,
    sandboxes: Sandboxes,
    snapshots: Snapshots,
    /// A build's image is resolved for the template's tenant as any create's is.
    stored: Stored,
    /// What a build's sandbox is checked and completed with, as any create is.
    limits: LimitsSection,
    max_timeout: Option<i64>,
    storage: Arc<StoragePolicy>,
}

impl Templates {
    /// Reads the templates back; builds a restart cut off end Failed.
    pub fn open(
        data_dir: &std::path::Path,
        sandboxes: Sandboxes,
        snapshots: Snapshots,
        stored: Stored,
        limits: LimitsSection,
        max_timeout: Option<i64>,
        storage: Arc<StoragePolicy>,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let file = data_dir.join("templates.json");
        let mut records: BTreeMap<String, Record> = match std::fs::read(&file) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .with_context(|| format!("parsing {}", file.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
        };
        // A build cut off by the restart ends Failed; a golden image it had begun is thrown away
        // (its sandbox, a warm sandbox of no pool, is deleted by the pools' start).
        let mut orphans = Vec::new();
        for rec in records.values_mut() {
            if rec.phase == PENDING || rec.phase == BUILDING {
                rec.phase = FAILED.into();
                rec.message =
                    Some("the server restarted while the template was being built".into());
                rec.updated_at = Utc::now();
                orphans.extend(rec.snapshot_id.take());
            }
        }
        if !orphans.is_empty() {
            let snapshots = snapshots.clone();
            tokio::spawn(async move {
                for id in orphans {
                    let _ = snapshots.delete(&id).await;
                }
            });
        }
        let this = Templates {
            inner: Arc::new(Inner {
                file,
                records: Mutex::new(records),
                saving: Mutex::new(()),
                sandboxes,
                snapshots,
                stored,
                limits,
                max_timeout,
                storage,
            }),
        };
        this.save();
        Ok(this)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Record>> {
        self.inner.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks the request, records the template (Pending) and builds it in the background.
    /// `admission`: the build sandbox's share of the tenant's quotas, held until the build ends.
    pub fn create(
        &self,
        req: CreateTemplateRequest,
        tenant: &str,
        admission: crate::quotas::Admission,
    ) -> Result<Template, SandboxError> {
        let probe = validate(&req)?;
        // Refused now, not when the build fails: an image naming another tenant's snapshot
        // answers as a missing one (and the build resolves it again, for the snapshot may go).
        self.inner.stored.image(&req.image, tenant)?;
        self.inner.sandboxes.check_room("a template")?;
        let now = Utc::now();
        let rec = Record {
            id: format!("tpl_{}", uuid::Uuid::new_v4()),
            request: req,
            phase: PENDING.into(),
            message: None,
            snapshot_id: None,
            created_at: now,
            updated_at: now,
            tenant: tenant.to_string(),
        };
        self.lock().insert(rec.id.clone(), rec.clone());
        self.save();
        let me = self.clone();
        let id = rec.id.clone();
        tokio::spawn(async move {
            let _admission = admission;
            // In a task of its own: should the build panic, the template still ends, Failed.
            let builder = me.clone();
            let build_id = id.clone();
            let outcome = tokio::spawn(async move { builder.build(&build_id, probe).await })
                .await
                .unwrap_or_else(|e| Err(format!("the build stopped: {e}")));
            me.finish(&id, outcome).await;
        });
        Ok(rec.to_wire())
    }

    /// Template `id` if `caller` sees it: another tenant's answers as a missing one.
    pub fn get(&self, caller: &Caller, id: &str) -> Result<Template, SandboxError> {
        self.lock()
            .get(id)
            .filter(|r| caller.sees(&r.tenant))
            .map(Record::to_wire)
            .ok_or_else(|| not_found(id))
    }

    /// Every template `caller` sees whose metadata holds all of `metadata`, oldest first.
    pub fn list(&self, caller: &Caller, metadata: &BTreeMap<String, String>) -> Vec<Template> {
        let mut out: Vec<Record> = self
            .lock()
            .values()
            .filter(|r| caller.sees(&r.tenant))
            .filter(|r| {
                let have = r.request.metadata.clone().unwrap_or_default();
                metadata.iter().all(|(k, v)| have.get(k) == Some(v))
            })
            .cloned()
            .collect();
        out.sort_by_key(|r| r.created_at);
        out.iter().map(Record::to_wire).collect()
    }

    /// Removes the template and its golden image. A build in progress ends on its own and throws
    /// away what it made.
    pub async fn delete(&self, caller: &Caller, id: &str) -> Result<(), SandboxError> {
        let rec = {
            let mut records = self.lock();
            if !records.get(id).is_some_and(|r| caller.sees(&r.tenant)) {
                return Err(not_found(id));
            }
            records.remove(id).ok_or_else(|| not_found(id))?
        };
        self.save();
        if let Some(snapshot) = rec.snapshot_id {
            let _ = self.inner.snapshots.delete(&snapshot).await;
        }
        Ok(())
    }

    /// Turns a create naming `templateId` into a restore of the template's golden image with the
    /// template's entrypoint, env and resources. As in the reference's spec, the template fixes the
    /// workload: a request that shapes it too (entrypoint, env, resources, volumes, platform,
    /// secureAccess, lifecycle hooks) is refused; metadata, network policy, extensions, the idle
    /// and renewal policies and the timeout (required) are the request's; `credentialProxy` is
    /// accepted and ignored (the vault's first create starts the proxy); and a template that is
    /// not the caller's tenant's, or not Succeeded, is 404 (no existence leak).
    pub fn apply(&self, req: &mut CreateSandboxRequest, tenant: &str) -> Result<(), SandboxError> {
        let Some(id) = req.template_id.take() else {
            return Ok(());
        };
        if req.image.is_some() || req.snapshot_id.is_some() {
            return Err(SandboxError::invalid(
                "templateId cannot be given with image or snapshotId",
            ));
        }
        let hooks = req
            .lifecycle
            .as_ref()
            .and_then(|l| l.as_object())
            .and_then(|l| {
                ["preStart", "periodic"]
                    .into_iter()
                    .find(|k| l.contains_key(*k))
            });
        let shaped = [
            ("entrypoint", req.entrypoint.is_some()),
            ("env", req.env.is_some()),
            ("resourceLimits", req.resource_limits.is_some()),
            ("resourceRequests", req.resource_requests.is_some()),
            ("volumes", req.volumes.is_some()),
            ("platform", req.platform.is_some()),
            ("secureAccess", req.secure_access == Some(true)),
            ("lifecycle hooks", hooks.is_some()),
        ];
        if let Some((field, _)) = shaped.iter().find(|(_, set)| *set) {
            let field = match hooks {
                Some(hook) if *field == "lifecycle hooks" => format!("lifecycle.{hook}"),
                _ => field.to_string(),
            };
            return Err(SandboxError::invalid(format!(
                "{field} cannot be given with templateId: the template fixes the sandbox's workload"
            )));
        }
        if req.timeout.is_none() {
            return Err(SandboxError::invalid(
                "timeout is required with templateId (a template's sandbox is not kept without one)",
            ));
        }
        // Accepted and ignored, as the spec has it: the vault is configured after creation, and
        // its first create starts the credential proxy.
        req.credential_proxy = None;
        let rec = self
            .lock()
            .get(&id)
            .filter(|r| r.tenant == tenant)
            .cloned()
            .ok_or_else(|| {
                SandboxError::new(
                    ErrorKind::NotFound,
                    ErrorCode::ImageNotFound,
                    format!("template {id} not found"),
                )
            })?;
        if rec.phase != SUCCEEDED {
            return Err(SandboxError::new(
                ErrorKind::NotFound,
                ErrorCode::ImageNotFound,
                format!(
                    "template {id} is {}{}; sandboxes start only from a Succeeded template",
                    rec.phase,
                    rec.message.map(|m| format!(" ({m})")).unwrap_or_default()
                ),
            ));
        }
        let golden = rec.snapshot_id.clone().unwrap_or_default();
        if self.inner.snapshots.get(&golden).is_none() {
            // Its snapshot was deleted through the snapshots API: the template cannot start
            // anything any more, and says so from now on.
            let why = format!("its golden image (snapshot {golden}) was deleted");
            self.set(&id, |r| {
                r.phase = FAILED.into();
                r.message = Some(why.clone());
                r.snapshot_id = None;
            });
            return Err(SandboxError::new(
                ErrorKind::NotFound,
                ErrorCode::ImageNotFound,
                format!("template {id} is {FAILED} ({why}); sandboxes start only from a Succeeded template"),
            ));
        }
        let t = rec.request;
        req.snapshot_id = rec.snapshot_id;
        req.entrypoint = t.entrypoint;
        req.env = t.env;
        req.resource_limits = t.resource_limits;
        Ok(())
    }

    /// Starts a sandbox from the image, waits until it is ready, snapshots it; returns the
    /// snapshot's id. The sandbox is deleted however the build ends.
    async fn build(&self, id: &str, probe: Probe) -> Result<String, String> {
        self.set(id, |r| r.phase = BUILDING.into());
        let req = self
            .lock()
            .get(id)
            .map(|r| r.request.clone())
            .ok_or("the template was deleted")?;
        let warmup = req
            .readiness
            .as_ref()
            .and_then(|r| r.warmup_seconds)
            .unwrap_or(DEFAULT_WARMUP);
        let create = CreateSandboxRequest {
            image: Some(ImageSpec {
                uri: req.image.clone(),
                auth: None,
            }),
            entrypoint: req.entrypoint.clone(),
            env: req.env.clone(),
            resource_limits: req.resource_limits.clone(),
            // the build's own bound: the warmup, the snapshot, and room to spare, within the
            // server's maximum (a build that needs more fails on its own deadlines first)
            timeout: Some(
                ((warmup + SNAPSHOT_TIMEOUT.as_secs() + 600) as i64)
                    .min(self.inner.max_timeout.unwrap_or(i64::MAX)),
            ),
            ..Default::default()
        };
        let mut plan = crate::validate::create_plan(
            create,
            &self.inner.limits,
            self.inner.max_timeout,
            &self.inner.storage,
        )
        .map_err(|e| format!("the template's sandbox: {}", e.public_message()))?;
        plan.warm_pool = Some(format!("template:{id}"));
        let tenant = self
            .lock()
            .get(id)
            .map(|r| r.tenant.clone())
            .ok_or("the template was deleted")?;
        plan.set_tenant(&tenant)
            .and_then(|()| self.inner.stored.resolve(&mut plan))
            .map_err(|e| format!("the template's sandbox: {}", e.public_message()))?;
        let rec = self
            .inner
            .sandboxes
            .create(plan)
            .await
            .map_err(|e| format!("starting the template's sandbox: {}", e.public_message()))?;
        let sandbox = DeleteOnDrop(Some((self.inner.sandboxes.clone(), rec.id.clone())));
        let result = self.ready_and_capture(id, &rec.id, &probe, warmup).await;
        sandbox.delete().await;
        result
    }

    async fn ready_and_capture(
        &self,
        id: &str,
        sandbox: &str,
        probe: &Probe,
        warmup: u64,
    ) -> Result<String, String> {
        let Some(endpoint) = self.inner.sandboxes.execd_endpoint(sandbox) else {
            return Err(format!("sandbox {sandbox} is gone"));
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(warmup);
        match probe {
            Probe::None if warmup > 0 => tokio::time::sleep(Duration::from_secs(warmup)).await,
            Probe::None => {}
            probe => loop {
                let ready = match probe {
                    Probe::Port(port) => crate::sandbox_files::port_open(&endpoint, *port)
                        .await
                        .unwrap_or(false),
                    Probe::Command(cmd) => {
                        crate::sandbox_files::run(&endpoint, cmd).await.ok() == Some(0)
                    }
                    Probe::None => true,
                };
                if ready {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(format!(
                        "the readiness probe did not pass within {warmup} s"
                    ));
                }
                if !self.lock().contains_key(id) {
                    return Err("the template was deleted".into());
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            },
        }
        let snap = self
            .inner
            .snapshots
            .create(sandbox, Some(format!("template {id}")))
            .await
            .map_err(|e| format!("taking the golden image: {}", e.public_message()))?;
        // Recorded at once: whatever cuts the build off from here (a restart, a panic) leaves a
        // record that names the snapshot to throw away.
        self.set(id, |r| r.snapshot_id = Some(snap.id.clone()));
        let until = tokio::time::Instant::now() + SNAPSHOT_TIMEOUT;
        loop {
            match self.inner.snapshots.get(&snap.id) {
                Some(s) if s.state == snapshots::READY => return Ok(snap.id),
                Some(s) if s.state == snapshots::FAILED => {
                    let _ = self.inner.snapshots.delete(&snap.id).await;
                    return Err(format!(
                        "taking the golden image: {}",
                        s.message.unwrap_or_default()
                    ));
                }
                None => return Err("the golden image was deleted while it was taken".into()),
                Some(_) if tokio::time::Instant::now() >= until => {
                    let _ = self.inner.snapshots.delete(&snap.id).await;
                    return Err("taking the golden image timed out".into());
                }
                Some(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Records how the build ended; a template deleted meanwhile loses what the build made.
    async fn finish(&self, id: &str, outcome: Result<String, String>) {
        // a golden image begun by a build that failed or whose template went meanwhile
        let mut leftover = None;
        let kept = {
            let mut records = self.lock();
            match records.get_mut(id) {
                Some(r) => {
                    r.updated_at = Utc::now();
                    match &outcome {
                        Ok(snapshot) => {
                            r.phase = SUCCEEDED.into();
                            r.snapshot_id = Some(snapshot.clone());
                        }
                        Err(why) => {
                            r.phase = FAILED.into();
                            r.message = Some(why.clone());
                            leftover = r.snapshot_id.take();
                        }
                    }
                    true
                }
                None => false,
            }
        };
        if let (false, Ok(snapshot)) = (kept, &outcome) {
            leftover = Some(snapshot.clone());
        }
        if let Some(snapshot) = leftover {
            let _ = self.inner.snapshots.delete(&snapshot).await;
        }
        if let Err(why) = &outcome {
            tracing::warn!(template = %id, "template build failed: {why}");
        }
        self.save();
    }

    fn set(&self, id: &str, f: impl FnOnce(&mut Record)) {
        if let Some(r) = self.lock().get_mut(id) {
            f(r);
            r.updated_at = Utc::now();
        }
        self.save();
    }

    fn save(&self) {
        // Held from the snapshot to the rename: two saves racing cannot leave the older on disk.
        let _saving = self.inner.saving.lock().unwrap_or_else(|e| e.into_inner());
        let bytes = match serde_json::to_vec_pretty(&*self.lock()) {
            Ok(b) => b,
            Err(e) => return tracing::error!("serializing templates: {e}"),
        };
        if let Err(e) = crate::state_file::replace(&self.inner.file, &bytes) {
            tracing::error!(
                "saving templates to {} failed: {e}",
                self.inner.file.display()
            );
        }
    }
}

/// A build's sandbox, deleted however the build ends: awaited on the normal path, from a task of
/// its own when the build is dropped (a panic) before it gets there.
struct DeleteOnDrop(Option<(Sandboxes, String)>);

impl DeleteOnDrop {
    async fn delete(mut self) {
        if let Some((sandboxes, id)) = self.0.take() {
            let _ = sandboxes.delete(&id, REASON_USER_DELETE).await;
        }
    }
}

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        if let Some((sandboxes, id)) = self.0.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = sandboxes.delete(&id, REASON_USER_DELETE).await;
                });
            }
        }
    }
}

/// How a build knows the sandbox is ready.
#[derive(Debug, Clone, PartialEq)]
enum Probe {
    None,
    Port(u16),
    Command(String),
}

fn validate(req: &CreateTemplateRequest) -> Result<Probe, SandboxError> {
    if req.image.trim().is_empty() || req.image.len() > 255 {
        return Err(SandboxError::invalid("image must be 1 to 255 characters"));
    }
    if req.publish.trim().is_empty() {
        return Err(SandboxError::invalid("publish is required"));
    }
    match req.format.as_deref() {
        None | Some("native") | Some("overlaybd") => {}
        Some(f) => {
            return Err(SandboxError::invalid(format!(
                "format {f:?}: native or overlaybd"
            )))
        }
    }
    let readiness = req.readiness.clone().unwrap_or_default();
    if readiness.warmup_seconds.is_some_and(|w| w > MAX_WARMUP) {
        return Err(SandboxError::invalid(format!(
            "readiness.warmupSeconds is at most {MAX_WARMUP}"
        )));
    }
    let probe = match readiness.probe.as_deref().map(str::trim) {
        None | Some("") => Probe::None,
        Some(p) => {
            if let Some(cmd) = p.strip_prefix("cmd://") {
                if cmd.trim().is_empty() {
                    return Err(SandboxError::invalid(
                        "readiness.probe cmd:// needs a command",
                    ));
                }
                Probe::Command(cmd.to_owned())
            } else if let Some(addr) = p.strip_prefix("tcp://") {
                let (host, port) = addr.rsplit_once(':').ok_or_else(|| {
                    SandboxError::invalid("readiness.probe tcp:// needs HOST:PORT")
                })?;
                if !matches!(host, "127.0.0.1" | "localhost" | "[::1]" | "0.0.0.0") {
                    return Err(SandboxError::invalid(
                        "readiness.probe tcp:// checks the sandbox's own loopback (127.0.0.1:PORT)",
                    ));
                }
                Probe::Port(port.parse().ok().filter(|p| *p > 0).ok_or_else(|| {
                    SandboxError::invalid(format!("readiness.probe: bad port {port:?}"))
                })?)
            } else {
                return Err(SandboxError::invalid(
                    "readiness.probe is tcp://127.0.0.1:PORT or cmd://COMMAND",
                ));
            }
        }
    };
    // Without a probe, warmupSeconds is a plain wait (none unless asked for).
    Ok(probe)
}

fn not_found(id: &str) -> SandboxError {
    SandboxError::new(
        ErrorKind::NotFound,
        ErrorCode::ImageNotFound,
        format!("template {id} not found"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_api::lifecycle::TemplateReadiness;

    fn req(probe: Option<&str>) -> CreateTemplateRequest {
        CreateTemplateRequest {
            image: "host".into(),
            publish: "s3://bucket/publish".into(),
            readiness: probe.map(|p| TemplateReadiness {
                probe: Some(p.into()),
                warmup_seconds: None,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn probes_are_parsed_and_bad_ones_refused() {
        assert_eq!(validate(&req(None)).expect("none"), Probe::None);
        assert_eq!(
            validate(&req(Some("tcp://127.0.0.1:8080"))).expect("tcp"),
            Probe::Port(8080)
        );
        assert_eq!(
            validate(&req(Some("cmd://test -e /tmp/ready"))).expect("cmd"),
            Probe::Command("test -e /tmp/ready".into())
        );
        for bad in [
            "tcp://10.0.0.1:80",
            "tcp://127.0.0.1:0",
            "tcp://127.0.0.1",
            "cmd://",
            "http://x",
        ] {
            assert!(validate(&req(Some(bad))).is_err(), "{bad}");
        }
        let mut r = req(None);
        r.publish = " ".into();
        assert!(validate(&r).is_err());
        r = req(None);
        r.format = Some("squashfs".into());
        assert!(validate(&r).is_err());
    }
}
