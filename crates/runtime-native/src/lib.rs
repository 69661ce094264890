//! The native runtime: sandboxes made directly from Linux primitives, no Docker needed.
//!
//! Per sandbox: a cgroup (limits, freezer, metrics), a setup helper process that unshares mount, PID,
//! UTS, IPC, network and cgroup namespaces and forks the sandbox's PID 1, which assembles the root
//! filesystem (see `rootfs`), drops privileges (see `security`) and execs execd. The server reaches
//! execd through a Unix socket in a per-sandbox host folder bind-mounted into the sandbox.
//!
//! Host-side state of a sandbox is only: its folder under `<data_dir>/sandboxes/<id>` and its cgroup
//! directories. Mounts live in the sandbox's own mount namespace and vanish with it (with an external
//! OCI runtime, the overlay root is mounted on the host instead, and teardown unmounts it).
//!
//! On cgroup v1 a few setup helpers are kept started ahead of need ("standby"), each already inside a
//! cgroup of its own: there, joining a cgroup can wait ~10 ms for an RCU grace period, so a create
//! adopts a standby helper by renaming its cgroup to the sandbox's instead. (v2 cannot rename a
//! cgroup, and needs no standby: helpers start inside their cgroup.)

mod cgroup;
mod children;
mod create;
mod disk;
mod folders;
mod host_image;
mod hugetext;
pub mod init;
mod isolation;
mod leftovers;
mod oci;
mod priority;
mod reply;
mod rootfs;
use warren_seccomp as seccomp;
mod security;
mod spec;
mod standby;
mod teardown;
pub mod userns;
mod volumes;
pub mod zygote;

use create::yield_cpu;
use host_image::{
    build_base_layer, build_host_skeleton, check_layers_can_live_in, private_host_files,
    HOST_MASKED_DIRS, HOST_MASKED_FILES,
};
use standby::StandbyPool;

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use warren_core::{
    ExecdAddress, ExecdTransport, ExitInfo, HostVolumes, ImageSource, Liveness, NetworkLinks,
    Runtime, RuntimeError, RuntimeFeatures, RuntimeState, SandboxSpec, WritableLayers,
};

use crate::children::{pidfd_open, reap_pidfd};

pub use cgroup::{Cgroup, CgroupError, CpuShare, Layout as CgroupLayout};
pub use spec::{InitReply, InitSpec, RootSource, EXECD_SOCKET_NAME, JOINED_LINE};

/// A process's start time (clock ticks since boot), a zombie's too.
fn start_time_even_exited(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    warren_core::stat_field(&warren_core::stat_fields(&stat)?, 22)
}

/// The hidden subcommand of the `warren` binary that runs `init::main`.
pub const INIT_SUBCOMMAND: &str = "__sandbox-init";

#[derive(Debug, Clone)]
pub struct NativeConfig {
    pub data_dir: PathBuf,
    /// The static execd binary, bind-mounted read-only into every sandbox.
    pub execd_path: PathBuf,
    /// The executable that implements `INIT_SUBCOMMAND` (the `warren` binary).
    pub helper_exe: PathBuf,
    /// Name of the parent cgroup under each hierarchy.
    pub cgroup_parent: String,
    /// Where cgroup hierarchies are mounted (normally `/sys/fs/cgroup`).
    pub cgroup_root: PathBuf,
    /// Extra host files to hide from the `host` image (the config file…); the data dir is always
    /// hidden.
    pub extra_masked_files: Vec<PathBuf>,
    /// How long to wait for execd's socket after the helper reports the sandbox started.
    pub ready_timeout: Duration,
    /// `embedded` (Warren's own setup code) or an OCI runtime binary name: `runc`, `crun`, `runsc`.
    pub oci_runtime: String,
    /// Setup helpers kept started ahead of need (embedded runtime only); 0 disables.
    pub standby_helpers: usize,
    /// Creates run at most this many at a time (creating is CPU work on this machine); `None`: no
    /// limit.
    pub max_parallel_creates: Option<usize>,
    /// User namespaces (embedded runtime): `(first host id, ranges)` — each sandbox's root is one
    /// range of 65,536 host ids of its own (see `userns`). `None`: sandbox root is host root.
    pub userns_ids: Option<(u32, u32)>,
    /// execd listens on a loopback TCP port of the host, and checks a credential, instead of a
    /// Unix socket (embedded runtime only): the transport remote runtimes use, served on this host.
    pub execd_tcp: bool,
}

/// What the server persists for a native sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct NativeState {
    pid: i32,
    /// Kernel start time of `pid` (clock ticks), to tell our process from a recycled pid.
    start_time: u64,
    /// Named volumes this sandbox created with `deleteOnSandboxTermination`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    delete_volumes: Vec<String>,
    /// Where execd listens when it listens on TCP (`execd_tcp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    execd_tcp: Option<std::net::SocketAddr>,
}

#[derive(Clone)]
pub struct NativeRuntime {
    inner: Arc<Inner>,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Inner {
    standby: std::sync::Mutex<StandbyPool>,
    config: NativeConfig,
    layout: cgroup::Layout,
    skeleton: PathBuf,
    /// What the `host` image hides besides [`HOST_MASKED_FILES`] and [`HOST_MASKED_DIRS`]: the
    /// files and folders of the host's /etc that its other users may not read (see
    /// `private_host_files`), found when the runtime starts.
    private_files: Vec<PathBuf>,
    private_dirs: Vec<PathBuf>,
    /// The lowest layer of every sandbox's root (see `InitSpec::base_layer`).
    base_layer: PathBuf,
    /// Where the embedded runtime mounts every sandbox's root: one empty host folder serves them all,
    /// since each mount lives only in its sandbox's own mount namespace.
    mount_point: PathBuf,
    /// `None` for the embedded runtime.
    oci: Option<oci::OciRuntime>,
    /// Forks setup helpers (embedded runtime only).
    zygote: zygote::Zygote,
    volumes: volumes::Volumes,
    /// What deleted sandboxes left behind because it could not die yet: cgroups, PID 1s to reap.
    leftovers: Arc<leftovers::Leftovers>,
    /// Sandbox folders, made ahead of need and removed out of the way.
    folders: Arc<folders::Folders>,
    /// The id ranges of sandboxes' user namespaces, when they have them.
    userns: Option<userns::Slots>,
}

impl NativeRuntime {
    pub fn new(config: NativeConfig) -> Result<Self, RuntimeError> {
        let layout = cgroup::Layout::detect(&config.cgroup_root)
            .map_err(|e| RuntimeError::backend_with("cgroups are not usable", e))?;
        layout.prepare(&config.cgroup_parent).map_err(|e| {
            let errno = match &e {
                cgroup::CgroupError::Io { source, .. } => source.raw_os_error(),
                _ => None,
            };
            RuntimeError::backend_with(
                match errno {
                    Some(libc::EROFS) => "cgroups are mounted read-only here (a container? Warren needs a writable cgroup file system: `docker run --privileged`, say)",
                    Some(libc::EACCES | libc::EPERM) if !nix::unistd::geteuid().is_root() => {
                        "the native runtime needs root (it makes cgroups, namespaces and mounts): run Warren as root, or with sudo"
                    }
                    _ => "cgroups are not usable",
                },
                e,
            )
        })?;
        if !config.execd_path.is_file() {
            return Err(RuntimeError::backend(format!(
                "execd binary not found at {}",
                config.execd_path.display()
            )));
        }
        if config.execd_tcp && !matches!(config.oci_runtime.as_str(), "embedded" | "") {
            return Err(RuntimeError::Unsupported(format!(
                "execd over TCP ([runtime] execd_transport = \"tcp\") needs the embedded runtime, not {:?}",
                config.oci_runtime
            )));
        }
        let oci = match config.oci_runtime.as_str() {
            "embedded" | "" => None,
            name => {
                let roots = oci::roots_for(&config.data_dir).map_err(|e| {
                    RuntimeError::backend_with("preparing the folder for sandboxes' roots", e)
                })?;
                Some(oci::OciRuntime::new(name, config.data_dir.join("oci").join(name), roots).ok_or_else(|| {
                    RuntimeError::backend(format!("OCI runtime {name:?} is not supported or not installed (supported: embedded, runc, crun, runsc)"))
                })?)
            }
        };
        let folders = folders::Folders::open(&config.data_dir, &["upper", "work", "run"])
            .map_err(|e| RuntimeError::backend_with("preparing the sandboxes folder", e))?;
        let userns = match config.userns_ids {
            None => None,
            Some(_) if oci.as_ref().is_some_and(|o| !o.takes_userns()) => {
                return Err(RuntimeError::backend(
                    "user namespaces ([runtime] user_namespaces) are for the embedded runtime, runc and crun: gVisor's Sentry is the sandbox's kernel",
                ))
            }
            Some((first, count)) => {
                let slots = userns::Slots::new(
                    first,
                    count,
                    Path::new(userns::HOST_CLAIMS),
                    &config.data_dir.display().to_string(),
                )
                .map_err(RuntimeError::backend)?;
                adopt_ranges(&slots, &config.data_dir.join("sandboxes"));
                Some(slots)
            }
        };
        let known: Vec<&str> = HOST_MASKED_FILES
            .iter()
            .chain(HOST_MASKED_DIRS.iter())
            .copied()
            .collect();
        let (private_files, private_dirs) = private_host_files(Path::new("/etc"), &known);
        let skeleton = build_host_skeleton(&config.data_dir.join("host-skeleton"))
            .map_err(|e| RuntimeError::backend_with("building the host image skeleton", e))?;
        // Named anew whenever its content changes: running sandboxes keep the one they were made with.
        let base_layer = build_base_layer(&config.data_dir.join("sandbox-base-1"))
            .map_err(|e| RuntimeError::backend_with("building the sandbox base layer", e))?;
        check_layers_can_live_in(&config.data_dir, &base_layer)?;
        let mount_point = config.data_dir.join("mnt");
        fs::create_dir_all(&mount_point)
            .map_err(|e| RuntimeError::backend_with("creating the sandbox mount point", e))?;
        // Sandboxes we start are reparented to us when their setup helper (or `runc run --detach`)
        // exits, so their exit status reaches `wait_exit` instead of a possibly non-reaping PID 1.
        // Not with gVisor: runsc leaves processes of its own (its gofer, its unmount helpers) to the
        // nearest subreaper, where only a reaper of every orphan would collect them — Warren kept
        // them as zombies, four per sandbox, and `runsc delete` waited 5 s for each gofer to go.
        // gVisor's sandbox process is not execd anyway; its end is seen through a pidfd.
        if !oci.as_ref().is_some_and(|o| o.kind == oci::OciKind::Runsc) {
            // SAFETY: prctl with constant arguments.
            unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        }
        let this = Self {
            inner: Arc::new(Inner {
                zygote: zygote::Zygote::new(&config.helper_exe),
                standby: Default::default(),
                leftovers: leftovers::Leftovers::open(
                    config.data_dir.join("cgroup-leftovers"),
                    layout.clone(),
                    config.cgroup_parent.clone(),
                ),
                volumes: volumes::Volumes::new(
                    &config.data_dir,
                    userns.as_ref().map(|_| userns::VOLUME_BASE),
                ),
                folders,
                userns,
                config,
                layout,
                skeleton,
                private_files,
                private_dirs,
                base_layer,
                mount_point,
                oci,
            }),
        };
        if this.inner.oci.is_none() {
            this.remove_stale_standby();
            this.refill_standby();
        }
        Ok(this)
    }

    /// Whether sandboxes run under gVisor (runsc), which brings its own network stack and keeps
    /// the root filesystem's writes in an overlay of its own.
    fn is_gvisor(&self) -> bool {
        self.inner
            .oci
            .as_ref()
            .is_some_and(|o| o.kind == oci::OciKind::Runsc)
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.inner.folders.path(id)
    }

    fn cgroup(&self, id: &str) -> Cgroup {
        Cgroup::at(&self.inner.layout, &self.inner.config.cgroup_parent, id)
    }

    fn set_paused(&self, id: &str, paused: bool) -> Result<(), RuntimeError> {
        let what = if paused { "pausing" } else { "resuming" };
        match &self.inner.oci {
            Some(oci) => if paused {
                oci.pause(id)
            } else {
                oci.resume(id)
            }
            .map_err(|e| RuntimeError::backend_with(format!("{what} sandbox {id}"), e)),
            None => self
                .cgroup(id)
                .set_frozen(paused)
                .map_err(|e| RuntimeError::backend_with(format!("{what} sandbox {id}"), e)),
        }
    }

    fn is_paused(&self, id: &str) -> bool {
        match &self.inner.oci {
            Some(oci) => oci.is_paused(id),
            None => self.cgroup(id).is_frozen(),
        }
    }

    fn state(state: &RuntimeState) -> Option<NativeState> {
        serde_json::from_value(state.clone()).ok()
    }

    /// The pid, if it still names the process this state recorded.
    fn live_pid(state: &RuntimeState) -> Option<i32> {
        let st = Self::state(state)?;
        (process_start_time(st.pid) == Some(st.start_time)).then_some(st.pid)
    }
}

impl WritableLayers for NativeRuntime {
    fn id_base(&self, id: &str) -> Option<u32> {
        self.inner.userns.as_ref()?;
        fs::read_to_string(self.sandbox_dir(id).join(USERNS_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn upper_dir(&self, id: &str) -> PathBuf {
        let dir = self.sandbox_dir(id);
        let layers = if disk::is_mounted(&dir) {
            disk::mount_point(&dir)
        } else {
            dir
        };
        layers.join("upper")
    }
}

impl NetworkLinks for NativeRuntime {
    fn network_pid(&self, state: &RuntimeState) -> Option<i32> {
        Self::live_pid(state)
    }
}

#[async_trait::async_trait]
impl Runtime for NativeRuntime {
    fn features(&self) -> RuntimeFeatures {
        RuntimeFeatures {
            execd_transport: if self.inner.config.execd_tcp {
                ExecdTransport::Tcp
            } else {
                ExecdTransport::Unix
            },
            pause: true,
            // gVisor keeps the sandbox's writes in its own memory, bounded by the memory limit.
            disk_bound: !self.is_gvisor(),
            user_namespaces: self.inner.userns.is_some(),
            // The isolation helper is forked by the embedded runtime's PID 1, in the sandbox's
            // user namespace (see `isolation`).
            isolated_sessions: self.inner.oci.is_none() && self.inner.userns.is_some(),
            host_volumes: HostVolumes::Server,
            image_source: ImageSource::Store,
            create_parallelism: self.inner.config.max_parallel_creates,
        }
    }

    /// Not under gVisor, which runs its own network stack inside the sandbox (started with
    /// --network=none here): a link in the host-side namespace would not reach it.
    fn links(&self) -> Option<&dyn NetworkLinks> {
        (!self.is_gvisor()).then_some(self as &dyn NetworkLinks)
    }

    /// Not under gVisor, which keeps the sandbox's writes in its own overlay, not in ours.
    fn layers(&self) -> Option<&dyn WritableLayers> {
        (!self.is_gvisor()).then_some(self as &dyn WritableLayers)
    }

    fn name(&self) -> String {
        format!(
            "native/{}",
            self.inner
                .oci
                .as_ref()
                .map(|o| o
                    .binary
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned())
                .unwrap_or_else(|| "embedded".into())
        )
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError> {
        let this = self.clone();
        let spec = spec.clone();
        tokio::task::spawn_blocking(move || this.create_blocking(&spec))
            .await
            .map_err(|e| RuntimeError::backend_with("create task", e))?
    }

    fn promote(&self, id: &str) -> Result<(), RuntimeError> {
        // The same directories for an OCI runtime's cgroup (`cgroupsPath` is ours).
        self.cgroup(id)
            .set_cpu_share(CpuShare::Normal)
            .map_err(|e| RuntimeError::backend_with("raising the sandbox's CPU share", e))
    }

    fn execd_address(&self, id: &str, state: &RuntimeState) -> ExecdAddress {
        // The one field, not the whole state: the proxy asks on every request. A sandbox keeps
        // the transport it was made with, whatever the config says now.
        let tcp = state
            .get("execd_tcp")
            .and_then(|v| v.as_str())
            .and_then(|a| a.parse::<SocketAddr>().ok());
        match tcp {
            Some(addr) => ExecdAddress::Tcp(addr),
            None => ExecdAddress::Unix(self.sandbox_dir(id).join("run").join(EXECD_SOCKET_NAME)),
        }
    }

    fn wait_exit(&self, _id: &str, state: &RuntimeState) -> BoxFuture<'static, ExitInfo> {
        let pid = Self::live_pid(state);
        Box::pin(async move {
            let gone = ExitInfo {
                code: None,
                signal: None,
                vanished: false,
                detail: None,
            };
            let Some(pid) = pid else { return gone };
            let Some(fd) = pidfd_open(pid) else {
                return gone;
            };
            // SAFETY: the AsyncFd owns the pidfd, so the descriptor stays open for as long as it is
            // registered and is closed only after deregistration on drop.
            let Ok(afd) = (unsafe { tokio::io::unix::AsyncFd::register(fd) }) else {
                return gone;
            };
            if let Ok(mut guard) = afd.readable().await {
                guard.retain_ready();
            }
            reap_pidfd(afd.get_ref()).unwrap_or(gone)
        })
    }

    async fn pause(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError> {
        if Self::live_pid(state).is_none() {
            return Err(RuntimeError::NotFound(format!(
                "sandbox {id} is not running"
            )));
        }
        let this = self.clone();
        let sid = id.to_string();
        tokio::task::spawn_blocking(move || this.set_paused(&sid, true))
            .await
            .map_err(|e| RuntimeError::backend_with("pause task", e))?
    }

    async fn resume(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError> {
        if Self::live_pid(state).is_none() {
            return Err(RuntimeError::NotFound(format!(
                "sandbox {id} is not running"
            )));
        }
        let this = self.clone();
        let sid = id.to_string();
        tokio::task::spawn_blocking(move || this.set_paused(&sid, false))
            .await
            .map_err(|e| RuntimeError::backend_with("resume task", e))?
    }

    async fn destroy(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError> {
        let this = self.clone();
        let id = id.to_string();
        let pid = Self::live_pid(state);
        let delete_volumes = serde_json::from_value::<NativeState>(state.clone())
            .map(|s| s.delete_volumes)
            .unwrap_or_default();
        // On a thread of its own at the lowest CPU priority, the sandbox's cgroup at the smallest
        // CPU weight: see `yield_cpu`.
        let (done, finished) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("warren-teardown".into())
            .spawn(move || {
                yield_cpu(&this.cgroup(&id));
                this.teardown(&id, pid);
                this.inner.volumes.release_all(&id, &delete_volumes);
                let _ = done.send(());
            })
            // Nothing was touched yet: the sandbox stays as it is, and the delete can be retried.
            .map_err(|e| RuntimeError::Unavailable(format!("starting the teardown: {e}")))?;
        finished
            .await
            .map_err(|e| RuntimeError::backend_with("destroy task", e))
    }

    async fn shutdown(&self) {
        let this = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            this.close_standby();
            this.inner.folders.close();
            if let Some(oci) = &this.inner.oci {
                // Empty unless sandboxes stay running for the next start.
                let _ = fs::remove_dir(&oci.roots);
            }
        })
        .await;
    }

    async fn liveness(&self, id: &str, state: &RuntimeState) -> Liveness {
        match Self::live_pid(state) {
            None => Liveness::Gone,
            Some(_) if self.is_paused(id) => Liveness::Paused,
            Some(_) => Liveness::Running,
        }
    }
}

/// The file in a sandbox's folder that holds the first host id of its range.
const USERNS_FILE: &str = "userns";
/// In a sandbox's folder: it has an isolation helper (see `isolation`).
const ISOLATION_FILE: &str = "isolation";

/// The ranges of sandboxes an earlier server left running (read from their folders), so no new
/// sandbox gets one of them.
fn adopt_ranges(slots: &userns::Slots, sandboxes: &Path) {
    let Ok(entries) = fs::read_dir(sandboxes) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(base) = fs::read_to_string(entry.path().join(USERNS_FILE)) else {
            continue;
        };
        let id = entry.file_name().to_string_lossy().into_owned();
        match base.trim().parse() {
            Ok(base) if slots.adopt(&id, userns::IdRange { base }) => {}
            _ => {
                tracing::warn!(sandbox_id = %id, "its user namespace range is not one this server hands out")
            }
        }
    }
}

/// Field 22 of `/proc/<pid>/stat`: when the process started, in clock ticks since boot.
use warren_core::process_start_time;
