//! What a runtime takes from an image to build a sandbox: its layers and process configuration.
//! The image store (`warren-image`) makes these; runtimes only read them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Process configuration of an image (from its OCI/Docker config; empty for a rootfs import).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub entrypoint: Vec<String>,
    #[serde(default)]
    pub cmd: Vec<String>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
}

/// What the runtime needs to build a sandbox's root filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvedImage {
    /// The built-in `host` image; the runtime builds its view of the host.
    Host,
    Layers {
        name: String,
        id: String,
        /// Extracted layer dirs, lowest first, each at most once (ready for overlayfs `lowerdir`,
        /// which wants them in the reverse order).
        layers: Vec<PathBuf>,
        config: ImageConfig,
    },
}
