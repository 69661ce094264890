//! Snapshots: a sandbox's writable layer captured as an image in the store.

use warren_api::lifecycle::SandboxState;
use warren_api::ErrorCode;
use warren_core::RuntimeExt;
use warren_store::SandboxRecord;

use super::Sandboxes;
use crate::error::{ErrorKind, SandboxError};

impl Sandboxes {
    /// 400 where the runtime keeps no writable layer to copy (its capabilities say so).
    pub fn check_snapshots(&self) -> Result<(), SandboxError> {
        if self.inner.runtime.capabilities().snapshots {
            Ok(())
        } else {
            Err(self.snapshots_unsupported())
        }
    }

    pub(super) fn snapshots_unsupported(&self) -> SandboxError {
        SandboxError::new(
            ErrorKind::Invalid,
            ErrorCode::ApiNotSupported,
            format!(
                "snapshots: the {} runtime keeps no writable layer Warren can copy (the native runtime, embedded or runc, can)",
                self.inner.runtime.name()
            ),
        )
    }

    /// Captures the file system of sandbox `id` as the store image `image_name`: its image's
    /// layers plus its writable layer. A running sandbox is frozen for the copy (its processes stop
    /// for that long and continue after, memory intact), a paused one stays paused. Answers the
    /// bytes it adds to the store (its own layer's; the ones below are its sandbox's image's).
    pub async fn capture(&self, id: &str, image_name: &str) -> Result<u64, SandboxError> {
        let held = self.hold(id).await?;
        let rec = held.rec.clone();
        snapshot_source_state(&rec)?;
        self.check_snapshots()?;
        let layers = self
            .inner
            .runtime
            .layers()
            .ok_or_else(|| self.snapshots_unsupported())?;
        let upper = layers.upper_dir(id);
        let images = self.inner.images.clone();
        let holder = id.to_owned();
        let base = tokio::task::spawn_blocking(move || images.leased(&holder))
            .await
            .map_err(|e| SandboxError::internal("reading the sandbox's image", &e))?
            .map_err(|e| SandboxError::internal("reading the sandbox's image", &e))?
            .ok_or_else(|| {
                SandboxError::new(
                    ErrorKind::Invalid,
                    ErrorCode::ApiNotSupported,
                    format!("sandbox {id} runs the built-in host image (or one from before snapshots existed): nothing to snapshot"),
                )
            })?;
        let freeze = rec.state == SandboxState::Running;
        if freeze {
            self.inner
                .runtime
                .pause(id, &rec.runtime_state)
                .await
                .map_err(|e| {
                    SandboxError::from_runtime("freezing the sandbox for its snapshot", e)
                })?;
        }
        let images = self.inner.images.clone();
        let name = image_name.to_owned();
        let id_base = layers.id_base(id);
        let captured = tokio::task::spawn_blocking(move || {
            images.commit_snapshot(&name, &base, &upper, id_base)
        })
        .await;
        if freeze {
            if let Err(e) = self.inner.runtime.resume(id, &rec.runtime_state).await {
                tracing::error!(sandbox = id, "thawing after a snapshot failed: {e}");
            }
        }
        captured
            .map_err(|e| SandboxError::internal("capturing the file system", &e))?
            .map_err(|e| match e {
                // What the sandbox made cannot be a layer (a path past what a layer holds): the
                // caller's to know, without the host path of the sandbox's folder.
                warren_image::ImageError::InvalidSource { reason, .. } => SandboxError::new(
                    ErrorKind::Unprocessable,
                    ErrorCode::SnapshotInvalidSourceState,
                    format!("the sandbox's files cannot be captured: {reason}"),
                ),
                e => SandboxError::internal("capturing the file system", &e),
            })
            .map(|(_, adds)| adds)
    }
}

/// Snapshots are taken of Running or Paused sandboxes only (409 otherwise).
pub fn snapshot_source_state(rec: &SandboxRecord) -> Result<(), SandboxError> {
    if matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
        return Ok(());
    }
    Err(SandboxError::conflict(
        ErrorCode::SnapshotInvalidSourceState,
        format!(
            "sandbox {} is {}; snapshots are taken of Running or Paused sandboxes",
            rec.id,
            rec.state.as_str()
        ),
    ))
}
