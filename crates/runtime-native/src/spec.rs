//! What the server tells the setup helper about one sandbox. Serialized to the helper's stdin, so the
//! helper needs nothing else from the server (no shared memory, no inherited threads).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RootSource {
    /// Image layer directories, lowest first, stacked read-only under the sandbox's upper dir.
    Layers(Vec<PathBuf>),
    /// The built-in host view: a skeleton dir under the upper dir plus read-only binds of host folders.
    Host {
        skeleton: PathBuf,
        binds: Vec<PathBuf>,
        masked_files: Vec<PathBuf>,
        masked_dirs: Vec<PathBuf>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitSpec {
    pub id: String,
    pub hostname: String,
    pub root: RootSource,
    pub upper_dir: PathBuf,
    pub work_dir: PathBuf,
    /// Mount point for the assembled rootfs (inside the sandbox's private mount namespace only).
    pub rootfs_dir: PathBuf,
    /// Host folder bind-mounted at `/.warren/run`; execd's socket appears here.
    pub socket_dir: PathBuf,
    pub execd_path: PathBuf,
    /// cgroup v1 option sets to mount under `/sys/fs/cgroup` (e.g. ["memory"], ["cpu","cpuacct"]);
    /// empty on v2, where the unified hierarchy is mounted instead.
    pub cgroup_v1_mounts: Vec<Vec<String>>,
    pub cgroup_v2: bool,
    pub entrypoint: Vec<String>,
    pub env: Vec<String>,
    pub workdir: String,
    /// The sandbox log, for a standby helper whose stderr was fixed before the sandbox existed.
    #[serde(default)]
    pub log_path: Option<PathBuf>,
    /// Volumes, bind-mounted over the rootfs.
    #[serde(default)]
    pub volumes: Vec<HostMount>,
    /// The lowest layer under every image: the folders Warren mounts on or makes in each sandbox
    /// (`/.warren`, `/tmp`, `/workspace`, `/dev`, `/proc`, `/sys`), so an image without them does
    /// not get them made in the
    /// sandbox's upper dir (an inode made and freed on disk per sandbox). The image wins where it
    /// has them.
    #[serde(default)]
    pub base_layer: Option<PathBuf>,
    /// The sandbox's ids on the host, when it runs in a user namespace of its own.
    #[serde(default)]
    pub userns: Option<crate::userns::IdRange>,
    /// Start the isolation helper for execd's isolated sessions (see `isolation`).
    #[serde(default)]
    pub isolation: bool,
    /// execd listens on a loopback TCP port of the host instead of the socket folder's Unix
    /// socket, and checks the credential whose SHA-256 (hex) this is (see `warren_execd::access`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execd_tcp_verifier: Option<String>,
    /// The floor execd lays under user code (`warren_execd::hardening`); `None`: hardening off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardening: Option<warren_api::hardening::FloorPolicy>,
}

impl InitSpec {
    /// The overlay's `lowerdir` list, topmost first.
    pub fn lower_dirs(&self) -> Vec<PathBuf> {
        let mut lowers: Vec<PathBuf> = match &self.root {
            RootSource::Layers(layers) => layers.iter().rev().cloned().collect(),
            RootSource::Host { skeleton, .. } => vec![skeleton.clone()],
        };
        lowers.extend(self.base_layer.iter().cloned());
        lowers
    }

    /// The overlay mount's options with `lowers` as its layers (`rootfs::mount_overlay` adds
    /// `volatile` where it can).
    pub fn overlay_options(&self, lowers: &[PathBuf]) -> String {
        let lower = lowers
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":");
        format!(
            "lowerdir={lower},upperdir={},workdir={}",
            self.upper_dir.display(),
            self.work_dir.display()
        )
    }
}

/// A host folder (or file) bind-mounted at `target` inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMount {
    pub source: PathBuf,
    /// A folder above `source` that sandboxes cannot change: the rest of the way to `source` may be
    /// theirs (a volume's contents), so it is walked without following links
    /// (`warren_core::beneath`) and mounted from the handle that walk gives.
    pub beneath: PathBuf,
    /// Make missing folders on the way from `beneath` (a named volume's `subPath`).
    pub create: bool,
    /// Absolute and normalised (validated by the server).
    pub target: String,
    pub read_only: bool,
}

impl HostMount {
    /// `source` opened from `beneath` as the field says.
    pub fn open_source(&self) -> std::io::Result<warren_core::beneath::Opened> {
        let rel = self.source.strip_prefix(&self.beneath).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} is not under {}",
                    self.source.display(),
                    self.beneath.display()
                ),
            )
        })?;
        warren_core::beneath::open_beneath(&self.beneath, rel, self.create)
    }
}

/// The helper's one-line answer on stdout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum InitReply {
    Started {
        pid: i32,
        /// The loopback port execd listens on, when it listens on TCP.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        execd_port: Option<u16>,
        /// The isolation helper, as the host numbers it (see `isolation::start`): the server's
        /// to reap once the sandbox has ended.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        isolation_helper: Option<i32>,
    },
    Failed {
        error: String,
    },
}

/// Inside the sandbox: where execd and its socket folder are mounted.
pub const WARREN_DIR: &str = ".warren";
pub use warren_core::{EXECD_IN_SANDBOX, EXECD_SOCKET_NAME, SOCKET_DIR_IN_SANDBOX};

/// The helper's first line on stdout once it sits in its cgroup(s); its reply follows on the next.
pub const JOINED_LINE: &str = "joined";
