//! A sandbox's volumes as Docker mounts: host folders (staged on this host), named volumes
//! (made on the daemon when asked), and their removal.

use std::path::Path;

use crate::create::bind_mount;
use crate::{client, DockerRuntime, LABEL_OWNER};
use hyper::Method;
use serde_json::{json, Value};
use warren_core::{RuntimeError, VolumeMount, VolumeSource};

/// A sandbox's volumes as Docker mounts, and which named volumes resolving them created.
#[derive(Default)]
pub(crate) struct Mounts {
    pub(crate) mounts: Vec<Value>,
    pub(crate) created: Vec<String>,
    pub(crate) delete_on_exit: Vec<String>,
}

impl DockerRuntime {
    /// Docker mounts for sandbox `id`'s volumes; named volumes are Docker named volumes (created
    /// here, labelled as Warren's, when missing and allowed). On error, volumes created so far are
    /// removed (the caller removes what was staged).
    pub(crate) async fn volume_mounts(
        &self,
        id: &str,
        volumes: &[VolumeMount],
    ) -> Result<Mounts, RuntimeError> {
        let mut out = Mounts::default();
        for (n, v) in volumes.iter().enumerate() {
            match self.volume_mount(id, n, v, &mut out).await {
                Ok(mount) => out.mounts.push(mount),
                Err(e) => {
                    self.remove_volumes(&out.created).await;
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// The Docker mount of sandbox `id`'s `n`th volume `v`; a named volume created for it is
    /// recorded in `out`.
    pub(crate) async fn volume_mount(
        &self,
        id: &str,
        n: usize,
        v: &VolumeMount,
        out: &mut Mounts,
    ) -> Result<Value, RuntimeError> {
        let invalid = |e: std::io::Error, what: String| match e.kind() {
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::NotFound => {
                RuntimeError::Invalid(format!("{what}: {e}"))
            }
            _ => RuntimeError::backend_with(what, e),
        };
        let (claim, sub_path, create_if_missing, delete_on_termination) = match &v.source {
            VolumeSource::Host(_) if !self.local => {
                return Err(RuntimeError::Unsupported(
                    "host volumes need a Docker daemon on this host; this one is reached over TCP \
                     (use a named volume)"
                        .into(),
                ));
            }
            // Canonical when the server checked it: from `/`, with no link on the way, it is
            // still what was checked (see `warren_core::beneath`); a sandbox with a folder above
            // it mounted may change that at any time, so the daemon gets it staged.
            VolumeSource::Host(path) => {
                let what = format!("volume at {}", v.target);
                let rel = path.strip_prefix("/").unwrap_or(path);
                let opened = warren_core::beneath::open_beneath(Path::new("/"), rel, false)
                    .map_err(|e| invalid(e, what.clone()))?;
                let staged = self
                    .staging
                    .stage(id, n, &opened, v.read_only)
                    .map_err(|e| RuntimeError::backend_with(format!("staging the {what}"), e))?;
                return Ok(bind_mount(&staged, &v.target, v.read_only));
            }
            VolumeSource::Named {
                claim,
                sub_path,
                create_if_missing,
                delete_on_termination,
            } => (claim, sub_path, *create_if_missing, *delete_on_termination),
        };
        let info = match self.volume(claim).await? {
            Some(info) => info,
            None if !create_if_missing => {
                return Err(RuntimeError::Invalid(format!(
                    "volume {claim:?} does not exist (createIfNotExists is false)"
                )));
            }
            None => {
                let body = json!({"Name": claim, "Labels": {LABEL_OWNER: self.owner}});
                let info = self
                    .client
                    .call::<Value>(Method::POST, "/volumes/create", Some(&body))
                    .await
                    .map_err(|e| self.map_err(&format!("creating volume {claim}"), e))?;
                out.created.push(claim.clone());
                if delete_on_termination {
                    out.delete_on_exit.push(claim.clone());
                }
                info
            }
        };
        let Some(sub) = sub_path else {
            return Ok(
                json!({"Type": "volume", "Source": claim, "Target": v.target,
                             "ReadOnly": v.read_only}),
            );
        };
        // Docker 20.10 has no volume subpaths: bind the folder inside the volume's mount point
        // (local driver, daemon on this host), creating it like k8s does — inside the volume only:
        // its contents are sandboxes', and a link there must not make the server create, or
        // Docker mount, a host folder. The daemon is given the folder staged, never its path in
        // the volume, which a sandbox using the volume may swap for a link after this check.
        let base = info["Mountpoint"].as_str().unwrap_or_default();
        let what =
            format!("volume {claim:?}: subPath {sub:?} (it needs a local volume on this host)");
        let opened = if base.is_empty() {
            Err(std::io::Error::other("not a local volume"))
        } else {
            warren_core::beneath::open_beneath(Path::new(base), Path::new(sub), true)
        }
        .map_err(|e| RuntimeError::Invalid(format!("{what}: {e}")))?;
        if !self.local {
            // Unchanged for a daemon elsewhere: its volumes are not this host's to stage.
            return Ok(bind_mount(
                &Path::new(base).join(sub),
                &v.target,
                v.read_only,
            ));
        }
        let staged = self
            .staging
            .stage(id, n, &opened, v.read_only)
            .map_err(|e| RuntimeError::backend_with(format!("staging volume {claim:?}"), e))?;
        Ok(bind_mount(&staged, &v.target, v.read_only))
    }

    /// `Some(inspect)` when the named volume exists.
    pub(crate) async fn volume(&self, claim: &str) -> Result<Option<Value>, RuntimeError> {
        match self
            .client
            .call::<Value>(
                Method::GET,
                &format!("/volumes/{}", client::encode(claim)),
                None,
            )
            .await
        {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(self.map_err(&format!("inspecting volume {claim}"), e)),
        }
    }

    /// Removes named volumes; one still in use by another container stays (Docker refuses).
    pub(crate) async fn remove_volumes(&self, claims: &[String]) {
        for claim in claims {
            match self
                .client
                .call::<Value>(
                    Method::DELETE,
                    &format!("/volumes/{}", client::encode(claim)),
                    None,
                )
                .await
            {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => tracing::info!(volume = %claim, error = %e, "volume not removed"),
            }
        }
    }
}
