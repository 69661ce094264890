//! Teardown: the container removed (stopped first if it will not go), and the sandbox's folder.

use std::time::Duration;

use crate::{DockerError, DockerRuntime};
use hyper::Method;
use serde_json::Value;
use warren_core::RuntimeError;

impl DockerRuntime {
    /// Force-removes the container. The daemon sometimes gives up killing one (a gVisor sandbox that
    /// does not die within its wait, seen under load): then unpause, kill and try again, a few times.
    pub(crate) async fn remove(&self, container: &str) -> Result<(), RuntimeError> {
        // A paused container is resumed first. The daemon's forced removal kills it and resumes it
        // only after: under gVisor a paused sandbox cannot take the kill, the daemon waits 10 s,
        // kills runsc's processes directly, fails to resume what is then gone, and removes the
        // container while containerd keeps its task and its shim process — one leaked per deleted
        // paused sandbox. Not paused (the usual case), this answers 409 and costs one round trip.
        self.try_action(container, "unpause").await;
        let path = format!("/containers/{container}?force=true&v=true");
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.client.call::<Value>(Method::DELETE, &path, None).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_not_found() => return Ok(()),
                // "removal already in progress"
                Err(DockerError::Api { status: 409, .. }) => return Ok(()),
                Err(e @ DockerError::Api { status: 500, .. }) if attempt < 4 => {
                    tracing::warn!(container, error = %e, attempt, "removing the container failed; retrying");
                    for action in ["unpause", "kill"] {
                        self.try_action(container, action).await;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(self.map_err("removing the container", e)),
            }
        }
    }

    /// `POST /containers/{container}/{action}`, whose failure (not paused, already gone) is fine.
    pub(crate) async fn try_action(&self, container: &str, action: &str) {
        let _ = self
            .client
            .call::<Value>(
                Method::POST,
                &format!("/containers/{container}/{action}"),
                None,
            )
            .await;
    }

    pub(crate) fn remove_dir(&self, id: &str) {
        warren_core::unmount_socket_dir(&self.run_dir(id));
        let dir = self.config.data_dir.join("sandboxes").join(id);
        if let Err(e) = warren_fstree::remove_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(sandbox_id = id, error = %e, "removing the sandbox folder");
            }
        }
    }
}
