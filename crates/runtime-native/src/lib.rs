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
mod disk;
mod folders;
mod hugetext;
pub mod init;
mod isolation;
mod leftovers;
mod oci;
mod priority;
mod rootfs;
use warren_seccomp as seccomp;
mod security;
mod spec;
pub mod userns;
mod volumes;
pub mod zygote;

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::symlink;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use warren_core::image::ResolvedImage;
use warren_core::{
    ExecdAddress, ExecdTransport, ExitInfo, HostVolumes, ImageSource, Liveness, NetworkLinks,
    ResourceLimits, Runtime, RuntimeError, RuntimeFeatures, RuntimeState, SandboxImage,
    SandboxSpec, WritableLayers,
};

use crate::children::{pidfd_exited, pidfd_open, reap_pidfd, reap_pidfd_with};

pub use cgroup::{Cgroup, CgroupError, CpuShare, Layout as CgroupLayout};
pub use spec::{InitReply, InitSpec, RootSource, EXECD_SOCKET_NAME, JOINED_LINE};

/// A process's start time (clock ticks since boot), a zombie's too.
fn start_time_even_exited(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    warren_core::stat_field(&warren_core::stat_fields(&stat)?, 22)
}

/// The hidden subcommand of the `warren` binary that runs `init::main`.
pub const INIT_SUBCOMMAND: &str = "__sandbox-init";

/// The files and folders under `top` (at most [`PRIVATE_DEPTH`] deep, [`PRIVATE_MAX`] entries
/// looked at) that the host's other users may not read, except those under `known` folders:
/// secrets of the host's own services (a cluster's admin config, a Docker daemon's key, a
/// database's access rules, Wi-Fi and VPN keys). The `host` image hides them all, whatever their
/// names: without a user namespace (gVisor, `user_namespaces = false`) sandbox root reads any
/// file of the host's root, and a list of names can never be complete. Symlinks are left alone:
/// they resolve inside the sandbox's view.
fn private_host_files(top: &Path, known: &[&str]) -> (Vec<PathBuf>, Vec<PathBuf>) {
    use std::os::unix::fs::PermissionsExt;
    let (mut files, mut dirs) = (Vec::new(), Vec::new());
    let mut seen = 0usize;
    let mut stack = vec![(top.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            seen += 1;
            if seen > PRIVATE_MAX {
                return (files, dirs);
            }
            let path = entry.path();
            if known.iter().any(|k| path.starts_with(k)) {
                continue;
            }
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            let mode = meta.permissions().mode();
            if meta.is_dir() {
                if mode & 0o005 != 0o005 {
                    dirs.push(path);
                } else if depth + 1 < PRIVATE_DEPTH {
                    stack.push((path, depth + 1));
                }
            } else if meta.is_file() && mode & 0o004 == 0 {
                files.push(path);
            }
        }
    }
    (files, dirs)
}

/// How deep, and how many entries, `private_host_files` looks.
const PRIVATE_DEPTH: usize = 6;
const PRIVATE_MAX: usize = 50_000;

/// Host folders the built-in `host` image exposes read-only (when present and not symlinks).
const HOST_BINDS: [&str; 7] = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc"];
/// Secrets under exposed folders, hidden behind `/dev/null` or an empty read-only tmpfs.
const HOST_MASKED_FILES: [&str; 4] = [
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/shadow-",
    "/etc/gshadow-",
];
const HOST_MASKED_DIRS: [&str; 4] = [
    "/etc/ssh",
    "/etc/ssl/private",
    "/etc/warren",
    "/etc/sudoers.d",
];

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

/// A setup helper started ahead of need, already joined to a cgroup of its own and waiting on stdin
/// for a sandbox spec.
struct Standby {
    helper: zygote::Helper,
    cgroup: Cgroup,
}

#[derive(Default)]
struct StandbyPool {
    ready: Vec<Standby>,
    starting: usize,
    closed: bool,
}

const STANDBY_PREFIX: &str = ".standby-";
static STANDBY_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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

/// What the embedded path's start gives back: the sandbox's PID 1, the pipe that says when execd is
/// ready, execd's loopback port (TCP transport), and the isolation helper's pid (see `init`).
type EmbeddedStart = (i32, Option<fs::File>, Option<u16>, Option<i32>);

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

    /// Standby cgroups of a server that died (the pid in their name is gone); their helpers exited
    /// when that server's end of the pipe closed.
    fn remove_stale_standby(&self) {
        let probe = Cgroup::at(&self.inner.layout, &self.inner.config.cgroup_parent, "x");
        for parent in probe.dirs().iter().filter_map(|d| d.parent()) {
            let Ok(entries) = fs::read_dir(parent) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(rest) = name.strip_prefix(STANDBY_PREFIX) else {
                    continue;
                };
                let owner: Option<i32> = rest.rsplit('-').next().and_then(|p| p.parse().ok());
                if owner.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
                    let _ = Cgroup::at(&self.inner.layout, &self.inner.config.cgroup_parent, &name)
                        .remove(Duration::from_secs(1));
                }
            }
        }
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

    fn init_spec(&self, spec: &SandboxSpec) -> InitSpec {
        let dir = self.sandbox_dir(&spec.id);
        let config = &self.inner.config;
        let image = match &spec.image {
            SandboxImage::Resolved(image) => image,
            // `image_source` is `Store`: the server always resolves; `create` refuses the rest.
            SandboxImage::Reference { .. } => &ResolvedImage::Host,
        };
        let (root, image_env, workdir) = match image {
            ResolvedImage::Host => {
                let binds = HOST_BINDS
                    .iter()
                    .map(PathBuf::from)
                    .filter(|p| p.symlink_metadata().map(|m| m.is_dir()).unwrap_or(false))
                    .collect();
                let mut masked_dirs: Vec<PathBuf> =
                    HOST_MASKED_DIRS.iter().map(PathBuf::from).collect();
                masked_dirs.push(config.data_dir.clone());
                masked_dirs.extend(self.inner.private_dirs.iter().cloned());
                let mut masked_files: Vec<PathBuf> =
                    HOST_MASKED_FILES.iter().map(PathBuf::from).collect();
                masked_files.extend(self.inner.private_files.iter().cloned());
                masked_files.extend(config.extra_masked_files.iter().cloned());
                let root = RootSource::Host {
                    skeleton: self.inner.skeleton.clone(),
                    binds,
                    masked_files,
                    masked_dirs,
                };
                (root, Vec::new(), None)
            }
            ResolvedImage::Layers { layers, config, .. } => (
                RootSource::Layers(layers.clone()),
                config.env.clone(),
                config.working_dir.clone(),
            ),
        };
        let (cgroup_v2, cgroup_v1_mounts) = match &self.inner.layout {
            cgroup::Layout::V2 { .. } => (true, Vec::new()),
            cgroup::Layout::V1 { hierarchies } => {
                let mut mounts: Vec<Vec<String>> = Vec::new();
                for (_, path) in hierarchies {
                    let name = path
                        .file_name()
                        .map(|n| n.to_string_lossy().to_string())
                        .unwrap_or_default();
                    let opts: Vec<String> = name.split(',').map(str::to_string).collect();
                    if !mounts.contains(&opts) {
                        mounts.push(opts);
                    }
                }
                (false, mounts)
            }
        };
        // A sandbox with a disk of its own keeps its writes there (see `disk`).
        let layer_dir = match spec.limits.disk_bytes {
            Some(_) => disk::mount_point(&dir),
            None => dir.clone(),
        };
        InitSpec {
            id: spec.id.clone(),
            hostname: spec.id.chars().take(12).collect(),
            root,
            upper_dir: layer_dir.join("upper"),
            work_dir: layer_dir.join("work"),
            rootfs_dir: match &self.inner.oci {
                // an OCI runtime is handed the mounted root on the host
                Some(oci) => oci.rootfs(&spec.id),
                None => self.inner.mount_point.clone(),
            },
            socket_dir: dir.join("run"),
            execd_path: config.execd_path.clone(),
            cgroup_v1_mounts,
            cgroup_v2,
            entrypoint: spec.entrypoint.clone(),
            env: sandbox_env(&image_env, &spec.env, &spec.id),
            workdir: workdir
                .filter(|w| w.starts_with('/'))
                .unwrap_or_else(|| "/".to_string()),
            log_path: None,
            volumes: Vec::new(),
            base_layer: Some(self.inner.base_layer.clone()),
            userns: None,
            isolation: spec.isolation,
            execd_tcp_verifier: self
                .inner
                .config
                .execd_tcp
                .then(|| spec.execd_verifier.clone()),
            hardening: spec.hardening.clone(),
        }
    }

    fn create_blocking(&self, spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError> {
        if let SandboxImage::Reference { name, .. } = &spec.image {
            return Err(RuntimeError::Unsupported(format!(
                "the native runtime runs images from Warren's image store, not the reference {name}"
            )));
        }
        if spec.limits.disk_bytes.is_some() && self.is_gvisor() {
            // gVisor keeps the root's writes in an overlay of its own, in memory (bounded by the
            // memory limit, never on the host's disk). Moved onto a sandbox disk (see `disk`) it
            // ended the whole sandbox when the disk filled; without its overlay (writes through to
            // ours) this runsc answers EINVAL to every statx.
            return Err(RuntimeError::Unsupported(
                "ephemeral-storage: gVisor keeps a sandbox's root filesystem writes in its memory, \
                 bounded by the memory limit; it cannot bound them apart"
                    .into(),
            ));
        }
        let dir = self.sandbox_dir(&spec.id);
        if dir.exists() {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {} already exists",
                spec.id
            )));
        }
        let volumes = self.inner.volumes.resolve(&spec.id, &spec.volumes)?;
        let mut pid = None;
        let result = self.try_create(spec, &dir, &volumes, &mut pid);
        if result.is_err() {
            self.teardown(&spec.id, pid);
            // what this create made goes with it, including volumes it created
            self.inner
                .volumes
                .release(&spec.id, &spec.volumes, &volumes.created);
        }
        result
    }

    fn try_create(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        volumes: &volumes::Resolved,
        pid_out: &mut Option<i32>,
    ) -> Result<RuntimeState, RuntimeError> {
        let mut lowered = priority::Lowered::while_on(&spec.background);
        self.inner
            .folders
            .make(&spec.id)
            .map_err(|e| RuntimeError::backend_with(format!("creating {}", dir.display()), e))?;
        if let Some(bytes) = spec.limits.disk_bytes {
            disk::make(&self.inner.config.data_dir, dir, bytes).map_err(|e| {
                RuntimeError::backend_with(
                    format!("making the sandbox's {bytes}-byte disk (ephemeral-storage)"),
                    e,
                )
            })?;
        }
        let upper = match spec.limits.disk_bytes {
            Some(_) => disk::mount_point(dir),
            None => dir.to_path_buf(),
        }
        .join("upper");
        let range = self.take_range(&spec.id, dir, &upper)?;
        let log_path = dir.join(folders::LOG_NAME);
        let log = fs::OpenOptions::new()
            .append(true)
            .open(&log_path)
            .map_err(|e| RuntimeError::backend_with("opening the sandbox log", e))?;
        let started = Instant::now();
        // One budget for the whole start: the setup helper's answer, then execd listening.
        let deadline = started + self.inner.config.ready_timeout;
        let (pid, ready, execd_port, helper) = match &self.inner.oci {
            None => self.start_embedded(spec, log, &log_path, &volumes.mounts, deadline, range)?,
            Some(oci) => {
                // The OCI runtime creates the cgroup itself at the same path ours would have.
                let mut init_spec = self.init_spec(spec);
                init_spec.volumes = volumes.mounts.clone();
                init_spec.userns = range;
                let idmapped = self.idmapped(range, &init_spec)?;
                let share = if spec.background.is_on() {
                    CpuShare::Background
                } else {
                    CpuShare::Normal
                };
                let run = oci.start(&init_spec, dir, log, &spec.limits, share, idmapped.as_ref());
                if share == CpuShare::Background && !spec.background.is_on() {
                    // Wanted meanwhile: the server's promote may have come before the cgroup.
                    let _ = self.promote(&spec.id);
                }
                let pid = run.map_err(|e| {
                    RuntimeError::backend_with(
                        format!("starting sandbox {} with {}", spec.id, oci.binary.display()),
                        e,
                    )
                })?;
                (pid, None, None, None)
            }
        };
        *pid_out = Some(pid);
        if let Some(helper) = helper {
            // Read by the teardown: the helper, in the host's PID namespace, is the server's to
            // reap (its setup helper exited), and this pid names it only with this start time.
            let start = process_start_time(helper).unwrap_or_default();
            fs::write(dir.join(ISOLATION_FILE), format!("{helper} {start}"))
                .map_err(|e| RuntimeError::backend_with("recording the isolation helper", e))?;
        }
        priority::Lowered::follow(&mut lowered, &spec.background);
        let start_time = process_start_time(pid).ok_or_else(|| {
            RuntimeError::StartFailed(format!(
                "sandbox exited during start: {}",
                log_tail(&log_path)
            ))
        })?;
        let spawned = started.elapsed();
        let execd_tcp = execd_port.map(|port| SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
        let address = match execd_tcp {
            Some(addr) => ExecdAddress::Tcp(addr),
            None => ExecdAddress::Unix(dir.join("run").join(EXECD_SOCKET_NAME)),
        };
        self.wait_ready(pid, ready, deadline, &address, &log_path)?;
        if Instant::now() > deadline {
            // Ready, but late: an answer already waiting when the server, descheduled, came to
            // read it passed every check above. The setting bounds the whole start.
            return Err(RuntimeError::StartFailed(format!(
                "the sandbox started after the start timeout ({} s, [runtime] start_timeout_seconds)",
                self.inner.config.ready_timeout.as_secs_f64()
            )));
        }
        tracing::debug!(sandbox_id = %spec.id, spawn_us = spawned.as_micros() as u64, ready_us = started.elapsed().as_micros() as u64, "sandbox started");
        serde_json::to_value(NativeState {
            pid,
            start_time,
            delete_volumes: volumes.delete_on_exit.clone(),
            execd_tcp,
        })
        .map_err(|e| RuntimeError::backend_with("encoding state", e))
    }

    /// The embedded path: our cgroup, then the setup helper, which reports the sandbox's PID 1.
    fn start_embedded(
        &self,
        spec: &SandboxSpec,
        log: fs::File,
        log_path: &Path,
        volumes: &[spec::HostMount],
        deadline: Instant,
        range: Option<userns::IdRange>,
    ) -> Result<EmbeddedStart, RuntimeError> {
        let mut init_spec = self.init_spec(spec);
        init_spec.log_path = Some(log_path.to_path_buf());
        init_spec.volumes = volumes.to_vec();
        init_spec.userns = range;
        let payload = serde_json::to_vec(&init_spec)
            .map_err(|e| RuntimeError::backend_with("encoding the sandbox spec", e))?;
        let idmapped = self.idmapped(range, &init_spec)?;
        let root = premade_root(&init_spec, idmapped.as_ref());
        if root.is_none() && spec.limits.disk_bytes.is_some() {
            // PID 1 would mount the root itself, in a mount namespace (a standby helper's) that
            // may predate the sandbox's disk: its writes could land beside the disk, unbounded.
            return Err(RuntimeError::Unsupported(
                "ephemeral-storage needs a kernel that makes the root overlay with fsmount(2) \
                 (Linux 5.2, or 6.8 for images of many layers)"
                    .into(),
            ));
        }
        let mut helper = match self.take_standby(&spec.id, &spec.limits) {
            Some(warm) => warm,
            None => self.cold_helper(spec, log)?,
        };
        // Before the spec goes out, so the helper's whole setup runs at that share.
        self.lower_share(&spec.id, &spec.background);
        let stdin = helper
            .stdin
            .take()
            .ok_or_else(|| RuntimeError::backend("helper stdin"))?;
        // The user namespace first (the helper knows from the spec whether one comes), then the
        // root overlay if the server made it.
        let ns = idmapped.as_ref().map(|m| &*m.ns);
        let fds: Vec<&OwnedFd> = ns.into_iter().chain(root.as_ref()).collect();
        zygote::send_spec(stdin, &payload, &fds)
            .map_err(|e| RuntimeError::backend_with("sending the sandbox spec", e))?;
        drop(root);
        let mut out = helper.stdout.take();
        let reply_line = match out.as_mut().map(|pipe| read_reply(pipe, deadline)) {
            Some(Ok(line)) => line,
            Some(Err(e)) => {
                // A setup that hangs (a mount on a dead file system, say) must not hold the create,
                // and its slot, for ever: the helper goes now, what it made goes with the caller's
                // teardown (the cgroup it joined is emptied with SIGKILL).
                helper.kill();
                if !helper.wait_for(Duration::from_secs(5)) {
                    tracing::warn!(sandbox_id = %spec.id, "the setup helper did not exit after SIGKILL");
                }
                self.reap_strays(&spec.id, Duration::from_secs(2));
                return Err(if e.kind() == std::io::ErrorKind::TimedOut {
                    RuntimeError::StartFailed(format!(
                        "sandbox setup did not finish within the start timeout ({} s, [runtime] start_timeout_seconds)",
                        self.inner.config.ready_timeout.as_secs_f64()
                    ))
                } else {
                    RuntimeError::backend_with("reading the helper reply", e)
                });
            }
            None => String::new(),
        };
        helper.wait();
        self.refill_standby();
        let reply: InitReply = serde_json::from_str(reply_line.trim()).map_err(|_| {
            RuntimeError::backend(format!("sandbox setup helper died: {}", log_tail(log_path)))
        })?;
        match reply {
            // execd holds the pipe's last writer until it listens (see `init`).
            InitReply::Started {
                pid,
                execd_port,
                isolation_helper,
            } => {
                if self.inner.config.execd_tcp && execd_port.is_none() {
                    return Err(RuntimeError::backend(
                        "the setup helper reported no TCP port for execd",
                    ));
                }
                Ok((pid, out, execd_port, isolation_helper))
            }
            InitReply::Failed { error } => Err(RuntimeError::backend(format!(
                "sandbox setup failed: {error}"
            ))),
        }
    }

    /// Ends and reaps sandbox `id`'s isolation helper, if it has one (see `isolation::start`). It
    /// lives in the host's PID namespace, so PID 1's end does not end it; it leaves by itself once
    /// execd's end of its socket has closed and it has reaped what it started, and its setup
    /// helper has exited, so it is the server's (the subreaper's) child to reap. Killed if it has
    /// not left within a few seconds. The pid is trusted only with the start time it was
    /// recorded with.
    fn end_isolation_helper(&self, id: &str) {
        let Ok(record) = fs::read_to_string(self.sandbox_dir(id).join(ISOLATION_FILE)) else {
            return;
        };
        let mut words = record.split_whitespace().map(|w| w.parse::<u64>().ok());
        let (Some(Some(pid)), Some(Some(start))) = (words.next(), words.next()) else {
            return;
        };
        let pid = pid as i32;
        if pid <= 1 {
            return;
        }
        // The pidfd first: the helper may have left already, and a zombie child of ours keeps its
        // pid (and start time) until we reap it.
        let Some(fd) = pidfd_open(pid) else {
            return;
        };
        if start_time_even_exited(pid) != Some(start) {
            return;
        }
        if !pidfd_exited(&fd, 3000) {
            tracing::warn!(
                sandbox_id = id,
                "the isolation helper did not leave; killed"
            );
            // SAFETY: pidfd_send_signal(2) on a pidfd we own: it names exactly that process.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    libc::SIGKILL,
                    0,
                    0,
                )
            };
            pidfd_exited(&fd, 2000);
        }
        let _ = reap_pidfd_with(&fd, libc::WEXITED | libc::WNOHANG);
    }

    /// Kills and reaps the server's children that sit in sandbox `id`'s cgroup. A setup helper killed
    /// before it answered may have forked the sandbox's PID 1 already; that process was reparented to
    /// the server (the subreaper), and with no `wait_exit` for a create that failed, nothing else
    /// would reap it. Only our own children are touched, each through a pidfd: a child's pid cannot
    /// be reused before we reap it.
    fn reap_strays(&self, id: &str, within: Duration) {
        let marker = format!("/{}/{id}\n", self.inner.config.cgroup_parent);
        let in_sandbox = |c: &children::OwnChild| {
            fs::read_to_string(format!("/proc/{}/cgroup", c.pid))
                .is_ok_and(|cg| cg.contains(&marker))
        };
        if !children::reap_own_children(in_sandbox, true, within) {
            tracing::warn!(
                sandbox_id = id,
                "processes of a failed start are still alive"
            );
        }
    }

    /// Gives a sandbox made ahead of need the background CPU share while `background` is on; see
    /// [`warren_core::Background`] for why it is read twice. Failing only costs speed: logged.
    fn lower_share(&self, id: &str, background: &warren_core::Background) {
        if !background.is_on() {
            return;
        }
        let cg = self.cgroup(id);
        let mut set = cg.set_cpu_share(CpuShare::Background);
        if !background.is_on() {
            set = set.and_then(|()| cg.set_cpu_share(CpuShare::Normal));
        }
        if let Err(e) = set {
            tracing::warn!(sandbox_id = id, error = %e, "setting a warm sandbox's CPU share failed");
        }
    }

    /// A helper started now: create the sandbox's cgroup; the helper joins it itself.
    fn cold_helper(
        &self,
        spec: &SandboxSpec,
        log: fs::File,
    ) -> Result<zygote::Helper, RuntimeError> {
        let cg = Cgroup::create(
            &self.inner.layout,
            &self.inner.config.cgroup_parent,
            &spec.id,
            &spec.limits,
        )
        .map_err(|e| {
            RuntimeError::backend_with(format!("creating the cgroup of sandbox {}", spec.id), e)
        })?;
        self.spawn_helper(&cg, log.into())
            .map_err(|e| RuntimeError::backend_with("starting the sandbox setup helper", e))
    }

    /// A setup helper in the cgroup `cg`: forked by the zygote (straight into it on v2), or exec'd
    /// when the zygote fails; either joins through `Cgroup::join_files` where it was not created
    /// inside.
    fn spawn_helper(&self, cg: &Cgroup, stderr: OwnedFd) -> std::io::Result<zygote::Helper> {
        let join = cg.join_files();
        match self
            .inner
            .zygote
            .fork_helper(&join, cg.clone_into_dir(), &stderr)
        {
            Ok(helper) => return Ok(helper),
            Err(e) => {
                tracing::warn!(error = %e, "the zygote could not fork a setup helper; exec'ing one")
            }
        }
        let mut cmd = Command::new(&self.inner.config.helper_exe);
        warren_core::fd_limit::restore_in_child(&mut cmd);
        cmd.arg(INIT_SUBCOMMAND);
        for file in &join {
            cmd.arg("--join").arg(file);
        }
        let (stdin, theirs) = zygote::spec_channel()?;
        let child = cmd
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .env_clear()
            // Out of the server's process group, as the zygote is: see `Zygote::start`.
            .process_group(0)
            .spawn()?;
        Ok(zygote::Helper::spawned(child, stdin))
    }

    /// A standby helper, already in a cgroup of its own: the cgroup is renamed to the sandbox's and
    /// given its limits. `None` when there is none ready (or it cannot be adopted).
    fn take_standby(&self, id: &str, limits: &ResourceLimits) -> Option<zygote::Helper> {
        let mut standby = lock(&self.inner.standby).ready.pop()?;
        let adopted = standby
            .cgroup
            .rename(id)
            .and_then(|cg| cg.apply(limits).map(|()| cg));
        match (standby.helper.is_running(), adopted) {
            (true, Ok(_)) => Some(standby.helper),
            (_, adopted) => {
                tracing::warn!(
                    sandbox_id = id,
                    "a standby setup helper was unusable; starting a fresh one"
                );
                standby.helper.kill();
                standby.helper.wait();
                let cg = adopted.unwrap_or(standby.cgroup);
                let _ = cg.remove(Duration::from_secs(1));
                None
            }
        }
    }

    /// Tops the standby pool up to its target in a background thread.
    fn refill_standby(&self) {
        // On v2 every adoption would fail (no rename) after costing a helper and its cgroup.
        let target = if self.inner.layout.can_rename() {
            self.inner.config.standby_helpers
        } else {
            0
        };
        let missing = {
            let mut pool = lock(&self.inner.standby);
            let missing = target.saturating_sub(pool.ready.len() + pool.starting);
            pool.starting += missing;
            missing
        };
        if missing == 0 {
            return;
        }
        let this = self.clone();
        std::thread::spawn(move || {
            for _ in 0..missing {
                // `starting` counts down only once a helper is in the pool or gone for good:
                // `close_standby` waits for it to reach zero.
                if lock(&this.inner.standby).closed {
                    lock(&this.inner.standby).starting -= 1;
                    continue;
                }
                let started = this.start_standby();
                let mut pool = lock(&this.inner.standby);
                match started {
                    Ok(s) if !pool.closed => {
                        pool.ready.push(s);
                        pool.starting -= 1;
                    }
                    Ok(mut s) => {
                        drop(pool);
                        s.helper.kill();
                        s.helper.wait();
                        let _ = s.cgroup.remove(Duration::from_secs(1));
                        lock(&this.inner.standby).starting -= 1;
                    }
                    Err(e) => {
                        pool.starting -= 1;
                        tracing::warn!(error = %e, "starting a standby setup helper failed");
                    }
                }
            }
        });
    }

    fn start_standby(&self) -> Result<Standby, RuntimeError> {
        let name = format!(
            "{STANDBY_PREFIX}{}",
            STANDBY_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let name = format!("{name}-{}", std::process::id());
        let none = ResourceLimits {
            cpu_millis: None,
            memory_bytes: None,
            pids: 64,
            disk_bytes: None,
        };
        let cgroup = Cgroup::create(
            &self.inner.layout,
            &self.inner.config.cgroup_parent,
            &name,
            &none,
        )
        .map_err(|e| RuntimeError::backend_with("creating a standby cgroup", e))?;
        let null = fs::OpenOptions::new().write(true).open("/dev/null");
        let spawned = null.and_then(|null| self.spawn_helper(&cgroup, null.into()));
        let mut helper = match spawned {
            Ok(h) => h,
            Err(e) => {
                let _ = cgroup.remove(Duration::from_secs(1));
                return Err(RuntimeError::backend_with(
                    "starting a standby setup helper",
                    e,
                ));
            }
        };
        // Ready only once it has joined: renaming the cgroup before that would break its join.
        if read_line(helper.stdout.as_mut()).as_deref() != Some(JOINED_LINE) {
            helper.kill();
            helper.wait();
            let _ = cgroup.remove(Duration::from_secs(1));
            return Err(RuntimeError::backend(
                "a standby setup helper could not join its cgroup",
            ));
        }
        Ok(Standby { helper, cgroup })
    }

    /// Ends the standby helpers and removes their cgroups (server shutdown).
    pub fn close_standby(&self) {
        let ready = {
            let mut pool = lock(&self.inner.standby);
            pool.closed = true;
            std::mem::take(&mut pool.ready)
        };
        for mut s in ready {
            s.helper.kill();
            s.helper.wait();
            let _ = s.cgroup.remove(Duration::from_secs(1));
        }
        // Helpers still starting are ended by their refill thread once it sees `closed`; the server
        // exits right after this returns, which would kill that thread first and leave the
        // helper's cgroup behind (seen in CI after a test stopped its server mid-refill).
        let deadline = Instant::now() + Duration::from_secs(3);
        while lock(&self.inner.standby).starting > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.inner.zygote.stop();
    }

    /// Ready means execd accepts connections: the SDK's first `/ping` must succeed. With `ready`,
    /// the pipe execd closes once it listens, that moment is waited for rather than polled.
    fn wait_ready(
        &self,
        pid: i32,
        ready: Option<fs::File>,
        deadline: Instant,
        address: &ExecdAddress,
        log: &Path,
    ) -> Result<(), RuntimeError> {
        if let Some(pipe) = ready {
            wait_closed(pipe, deadline);
        }
        let mut delay = Duration::from_micros(200);
        loop {
            let listening = match address {
                ExecdAddress::Unix(socket) => warren_core::socket_connect_path(socket)
                    .is_ok_and(|(_handle, reachable)| UnixStream::connect(&reachable).is_ok()),
                ExecdAddress::Tcp(addr) => std::net::TcpStream::connect(addr).is_ok(),
                // not one of this runtime's
                ExecdAddress::Relayed { .. } => false,
            };
            if listening {
                return Ok(());
            }
            if !is_alive(pid) {
                return Err(RuntimeError::StartFailed(format!(
                    "execd exited during start: {}",
                    log_tail(log)
                )));
            }
            if Instant::now() > deadline {
                return Err(RuntimeError::StartFailed(format!(
                    "execd did not become ready within the start timeout ({} s, [runtime] start_timeout_seconds): {}",
                    self.inner.config.ready_timeout.as_secs_f64(),
                    log_tail(log)
                )));
            }
            // execd needs ~1-2 ms to listen; a connect attempt is one cheap syscall, so poll finely
            // rather than overshoot with a long back-off.
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_micros(500));
        }
    }

    /// Kills and removes everything a sandbox holds on the host. Safe to call repeatedly.
    fn teardown(&self, id: &str, pid: Option<i32>) {
        // kill(0) or kill(-1) would hit our own group or everything: only ever signal a real pid.
        let pid = pid.filter(|p| *p > 1);
        if let Some(oci) = &self.inner.oci {
            oci.teardown(id, &self.sandbox_dir(id));
        }
        let cg = self.cgroup(id);
        // Opened before the kill, while the pid still names the verified process: its end is then
        // waited for with one poll, not by reading /proc/PID/stat every 2 ms (~0.6 % of the
        // machine's CPU at 10 creates in flight).
        let pidfd = pid.and_then(pidfd_open);
        if let Some(pid) = pid {
            // SAFETY: kill(2); the pid was verified to be the sandbox's init (or is our fresh child).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // Frozen tasks cannot die; thaw after the kill is queued.
        if cg.is_frozen() {
            let _ = cg.set_frozen(false);
        }
        // A PID 1 that cannot die yet (see `leftovers`) is reaped later.
        let mut unreaped = None;
        match (pid, pidfd) {
            (Some(_), Some(fd)) => {
                // Reaped here too: the server (its subreaper) is PID 1's parent, and a create that
                // failed after PID 1 started has no `wait_exit` to do it, which left a zombie per
                // failure until the server exited. Where `wait_exit` waits as well, one of the two
                // finds nothing to reap; where the server is not the parent (gVisor, a sandbox
                // adopted after a restart), the kernel says so and nothing happens.
                if pidfd_exited(&fd, 5000) {
                    let _ = reap_pidfd_with(&fd, libc::WEXITED | libc::WNOHANG);
                } else {
                    unreaped = Some(fd);
                }
            }
            (Some(pid), None) => wait_gone(pid, Duration::from_secs(5)),
            (None, _) => {}
        }
        self.end_isolation_helper(id);
        let cgroup_left = match cg.remove(Duration::from_secs(3)) {
            Ok(()) => false,
            Err(e) => {
                tracing::warn!(sandbox_id = id, error = %e, "cgroup removal failed; retried in the background");
                true
            }
        };
        if let (Some(slots), None) = (&self.inner.userns, &unreaped) {
            // Its processes are gone: the range may serve another sandbox. (A PID 1 that cannot
            // die yet keeps it until the server restarts.)
            slots.release(id);
        }
        if cgroup_left || unreaped.is_some() {
            self.inner.leftovers.add(id, unreaped);
        }
        if self.inner.oci.is_some() {
            cgroup::remove_everywhere(
                &self.inner.config.cgroup_root,
                &self.inner.config.cgroup_parent,
                id,
            );
        }
        if let Err(e) = self.inner.folders.remove(id) {
            tracing::warn!(sandbox_id = id, error = %e, "sandbox folder removal failed");
        }
    }

    /// With user namespaces: a range of ids for sandbox `id`, recorded in its folder `dir` (for a
    /// restarted server) and given its `upper` dir, which is the root folder the sandbox sees.
    fn take_range(
        &self,
        id: &str,
        dir: &Path,
        upper: &Path,
    ) -> Result<Option<userns::IdRange>, RuntimeError> {
        let Some(slots) = &self.inner.userns else {
            return Ok(None);
        };
        let range = slots.take(id).ok_or_else(|| {
            RuntimeError::Unavailable(
                "every id range for sandboxes' user namespaces is in use; retry when one ends"
                    .into(),
            )
        })?;
        fs::write(dir.join(USERNS_FILE), range.base.to_string())
            .and_then(|()| std::os::unix::fs::chown(upper, Some(range.base), Some(range.base)))
            .map_err(|e| RuntimeError::backend_with("giving the sandbox its ids", e))?;
        Ok(Some(range))
    }

    /// For a sandbox in `range`: the range's namespace and the idmapped layers of its root.
    fn idmapped(
        &self,
        range: Option<userns::IdRange>,
        spec: &InitSpec,
    ) -> Result<Option<userns::Idmapped>, RuntimeError> {
        let (Some(slots), Some(range)) = (&self.inner.userns, range) else {
            return Ok(None);
        };
        slots
            .idmapped(range, &spec.lower_dirs())
            .map(Some)
            .map_err(|e| RuntimeError::backend_with("idmapping the image for the sandbox's ids", e))
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

/// Environment of the sandbox's processes: image env, then the request's env, then Warren's defaults
/// for what neither set.
fn sandbox_env(image_env: &[String], request: &BTreeMap<String, String>, id: &str) -> Vec<String> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert(
        "PATH".into(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    env.insert("HOME".into(), "/root".into());
    env.insert("HOSTNAME".into(), id.chars().take(12).collect());
    env.insert("LANG".into(), "C.UTF-8".into());
    for kv in image_env {
        if let Some((k, v)) = kv.split_once('=') {
            env.insert(k.to_string(), v.to_string());
        }
    }
    for (k, v) in request {
        env.insert(k.clone(), v.clone());
    }
    env.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// Makes a deleted sandbox's teardown yield the CPU to sandboxes in use: the calling thread (one
/// of its own, which ends with the teardown) gets the lowest priority, and the sandbox's cgroup
/// the smallest weight before its processes are killed, since their exit (freeing address spaces
/// and namespaces) runs as them. On a busy machine a delete then takes longer and the creates and
/// commands beside it less. Measured on this project's machine (2 CPUs; four alternated pairs of
/// 300 create → command → delete cycles at 10 in flight, each client waiting for its delete),
/// create → first output p50 53–59 → 39–46 ms, p99 76–134 → 59–75 ms, the same cycles per
/// second. Nothing is deferred: the delete still answers once everything is gone.
fn yield_cpu(cg: &Cgroup) {
    priority::set(19);
    let _ = cg.set_cpu_share(CpuShare::Background);
}

/// The sandbox's root overlay, made here for its PID 1 to attach (`rootfs::build`), or `None` where
/// the kernel cannot (before Linux 5.2, or a layer list over 255 bytes before 6.8, see
/// `overlay_detached`): PID 1 mounts it then.
///
/// Made in the server, it is charged to the server's memory cgroup. Making an overlay writes its
/// work-dir probes to disk (a few pages of ext4 metadata, ~16 KiB, cached after), and pages charged
/// to a sandbox's memory cgroup keep that cgroup alive in the kernel after it is removed, until the
/// page cache lets them go. Measured on this project's machine (cgroup v1, 2 CPUs): 140–270 of
/// every 300 deleted sandboxes stayed behind as such "dying" cgroups, ~78 KiB of unreclaimable
/// kernel memory each (594 of them, 45 MiB, after 1,200 sandboxes); with the overlay made here,
/// 0–3 of 300.
///
/// `idmapped`: for a sandbox in a user namespace, its layers' idmapped copies.
fn premade_root(spec: &InitSpec, idmapped: Option<&userns::Idmapped>) -> Option<OwnedFd> {
    let lowers = match idmapped {
        Some(m) => m.layer_paths(),
        None => spec.lower_dirs(),
    };
    rootfs::mount_api::overlay_detached(&lowers, &spec.upper_dir, &spec.work_dir)
        .map_err(
            |e| tracing::debug!(error = %e, "the root overlay is left to the sandbox to mount"),
        )
        .ok()
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

/// Refuses to start where no sandbox could be made: every sandbox's writable layer is an overlay's
/// upper folder under the data dir, and some file systems cannot hold one — overlayfs itself above
/// all, which is where a data dir lands when Warren runs in a container without a volume for it.
/// Found at start, with the kernel's reason, instead of at every create as "mount overlay at …".
/// The probe overlay is made and never mounted (`fsopen(2)`; skipped on kernels without it).
fn check_layers_can_live_in(data_dir: &Path, lower: &Path) -> Result<(), RuntimeError> {
    let probe = data_dir.join(format!("overlay-probe.{}", std::process::id()));
    let (upper, work) = (probe.join("upper"), probe.join("work"));
    let made = fs::create_dir_all(&upper).and_then(|()| fs::create_dir_all(&work));
    let outcome = made
        .map_err(|e| RuntimeError::backend_with("preparing the overlay probe in the data dir", e))
        .and_then(|()| {
            rootfs::mount_api::probe_overlay(&[lower.to_path_buf()], &upper, &work).map_err(
                |(errno, kernel)| {
                    let said = if kernel.is_empty() {
                        " (overlayfs says why in the kernel log, `dmesg`)".to_string()
                    } else {
                        format!(" (the kernel: {kernel})")
                    };
                    RuntimeError::backend(format!(
                        "the data dir {} cannot hold sandboxes' writable layers: an overlay with its upper folder there fails with {errno}{said}{}",
                        data_dir.display(),
                        if on_overlayfs(data_dir) {
                            ". The data dir is on overlayfs (a container's own file system?): give it a volume or a host file system, e.g. `docker run -v /var/lib/warren:/var/lib/warren …`"
                        } else {
                            ""
                        }
                    ))
                },
            )
        });
    let _ = fs::remove_dir_all(&probe);
    outcome
}

/// Whether `path` is on overlayfs (`OVERLAYFS_SUPER_MAGIC`).
fn on_overlayfs(path: &Path) -> bool {
    use nix::sys::statfs::{statfs, OVERLAYFS_SUPER_MAGIC};
    statfs(path).is_ok_and(|s| s.filesystem_type() == OVERLAYFS_SUPER_MAGIC)
}

/// The sandbox base layer (see `InitSpec::base_layer`), made once; running sandboxes have it as a
/// lower dir, so it is never changed after.
fn build_base_layer(dir: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if dir.is_dir() {
        return Ok(dir.to_path_buf());
    }
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    for (name, mode) in [
        ("", 0o755),
        (spec::WARREN_DIR, 0o755),
        ("tmp", 0o1777),
        ("workspace", 0o755),
        // mount points
        ("dev", 0o755),
        ("proc", 0o555),
        ("sys", 0o555),
    ] {
        let path = tmp.join(name);
        fs::create_dir_all(&path)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
    }
    // Mount points an OCI runtime would otherwise create in the upper dir (the embedded runtime
    // mounts a tmpfs over /.warren first).
    fs::create_dir_all(tmp.join(spec::WARREN_DIR).join("run"))?;
    fs::write(tmp.join(spec::WARREN_DIR).join("execd"), b"")?;
    match fs::rename(&tmp, dir) {
        Ok(()) => Ok(dir.to_path_buf()),
        // another process made it first
        Err(_) if dir.is_dir() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(dir.to_path_buf())
        }
        Err(e) => Err(e),
    }
}

/// The `host` image's lower layer: the top-level shape of the host's root (merged-/usr symlinks and
/// empty mount points), with nothing of the host's content. Running sandboxes use it as an overlay
/// lower dir, so it is never modified once made: a host whose shape changed gets a new one, named by
/// a digest of the shape, under `base`.
fn build_host_skeleton(base: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    const DIRS: [&str; 16] = [
        "usr",
        "etc",
        "root",
        "home",
        "var",
        "var/tmp",
        "var/log",
        "run",
        "tmp",
        "dev",
        "proc",
        "sys",
        "opt",
        "srv",
        "mnt",
        "workspace",
    ];
    let mut shape: Vec<(String, Option<PathBuf>)> = Vec::new();
    for name in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        let host = Path::new("/").join(name);
        if let Ok(target) = fs::read_link(&host) {
            shape.push((name.to_string(), Some(target)));
        } else if host.is_dir() {
            shape.push((name.to_string(), None));
        }
    }
    let digest = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&shape, DIRS).hash(&mut h);
        format!("{:016x}", h.finish())
    };
    let dir = base.join(&digest);
    if dir.is_dir() {
        return Ok(dir);
    }
    fs::create_dir_all(base)?;
    let tmp = base.join(format!(".{digest}.{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    for (name, target) in &shape {
        match target {
            Some(t) => symlink(t, tmp.join(name))?,
            None => fs::create_dir(tmp.join(name))?,
        }
    }
    for name in DIRS {
        fs::create_dir_all(tmp.join(name))?;
    }
    fs::set_permissions(tmp.join("tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::set_permissions(tmp.join("var/tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::set_permissions(tmp.join("root"), fs::Permissions::from_mode(0o700))?;
    match fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process made the same skeleton first.
        Err(_) if dir.is_dir() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e),
    }
}

/// Reads the setup helper's stdout up to its reply line (a complete line other than
/// `JOINED_LINE`), or to EOF; returns that line, empty if none came. Reads no further: the pipe
/// stays open while execd starts.
fn read_reply(pipe: &mut fs::File, deadline: Instant) -> std::io::Result<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        if !wait_readable(pipe, deadline)? {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer before the start timeout",
            ));
        }
        let n = match pipe.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf);
        // Until EOF, only whole lines count (the reply may arrive in pieces).
        let complete = match (n, text.rsplit_once('\n')) {
            (0, _) => &*text,
            (_, Some((done, _))) => done,
            (_, None) => "",
        };
        let reply = complete
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty() && *l != JOINED_LINE);
        if reply.is_some() || n == 0 {
            return Ok(reply.unwrap_or_default().to_owned());
        }
    }
}

/// Waits until `pipe` can be read (data or EOF); `false` once `deadline` passed first.
fn wait_readable(pipe: &fs::File, deadline: Instant) -> std::io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Rounded up: a deadline less than a millisecond away must not become a busy zero wait.
        let ms = i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        let mut p = libc::pollfd {
            fd: pipe.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        match n {
            n if n > 0 => return Ok(true),
            0 => return Ok(false),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Waits until every writer of `pipe` has closed it, or `deadline`.
fn wait_closed(mut pipe: fs::File, deadline: Instant) {
    let mut scratch = [0u8; 64];
    loop {
        if !matches!(wait_readable(&pipe, deadline), Ok(true)) {
            return; // timed out (or poll failed): the caller's own checks decide
        }
        match pipe.read(&mut scratch) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// One line from a pipe, read byte by byte so nothing after it is consumed.
fn read_line(pipe: Option<&mut fs::File>) -> Option<String> {
    let pipe = pipe?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while pipe.read(&mut byte).ok()? == 1 {
        if byte[0] == b'\n' {
            return String::from_utf8(line).ok();
        }
        line.push(byte[0]);
    }
    None
}

/// Field 22 of `/proc/<pid>/stat`: when the process started, in clock ticks since boot.
use warren_core::process_start_time;

fn is_alive(pid: i32) -> bool {
    process_start_time(pid).is_some()
}

fn wait_gone(pid: i32, within: Duration) {
    let deadline = Instant::now() + within;
    while is_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    let tail = lines.into_iter().rev().collect::<Vec<_>>().join(" | ");
    if tail.is_empty() {
        "no output".into()
    } else {
        tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_host_image_hides_what_other_users_may_not_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let top = dir.path();
        let mode = |p: &Path, m: u32| fs::set_permissions(p, fs::Permissions::from_mode(m));
        for (name, m) in [
            ("public.conf", 0o644),
            ("admin.conf", 0o600),
            ("known", 0o600),
        ] {
            fs::write(top.join(name), "x").expect("write");
            mode(&top.join(name), m).expect("chmod");
        }
        fs::create_dir_all(top.join("svc/keys")).expect("mkdir");
        fs::write(top.join("svc/keys/k"), "x").expect("write");
        mode(&top.join("svc/keys"), 0o700).expect("chmod");
        fs::create_dir_all(top.join("deep/a/b")).expect("mkdir");
        fs::write(top.join("deep/a/b/token"), "x").expect("write");
        mode(&top.join("deep/a/b/token"), 0o640).expect("chmod");
        std::os::unix::fs::symlink("admin.conf", top.join("link")).expect("symlink");
        let known = top.join("known");
        let (mut files, dirs) = private_host_files(top, &[known.to_str().expect("utf-8")]);
        files.sort();
        assert_eq!(
            files,
            vec![top.join("admin.conf"), top.join("deep/a/b/token")]
        );
        assert_eq!(
            dirs,
            vec![top.join("svc/keys")],
            "a private folder, not what it holds"
        );
    }

    fn pipe() -> (fs::File, fs::File) {
        let (r, w) = std::io::pipe().expect("pipe");
        (
            fs::File::from(OwnedFd::from(r)),
            fs::File::from(OwnedFd::from(w)),
        )
    }

    #[test]
    fn a_reply_is_read_whole_even_in_pieces() {
        let (mut r, mut w) = pipe();
        let writer = std::thread::spawn(move || {
            w.write_all(b"{\"started\":").expect("write");
            std::thread::sleep(Duration::from_millis(20));
            w.write_all(b"1}\n").expect("write");
            w
        });
        let line = read_reply(&mut r, Instant::now() + Duration::from_secs(5)).expect("reply");
        assert_eq!(line, "{\"started\":1}");
        drop(writer.join());
    }

    #[test]
    fn a_setup_that_never_answers_times_out_at_the_deadline() {
        let (mut r, _w) = pipe(); // the writer stays open and silent
        let started = Instant::now();
        let err = read_reply(&mut r, started + Duration::from_millis(100)).expect_err("a timeout");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(100),
            "returned early: {took:?}"
        );
        assert!(
            took < Duration::from_secs(5),
            "did not honour the deadline: {took:?}"
        );
    }

    #[test]
    fn a_partial_line_then_silence_also_times_out() {
        let (mut r, mut w) = pipe();
        w.write_all(b"{\"started\"").expect("write");
        let err =
            read_reply(&mut r, Instant::now() + Duration::from_millis(50)).expect_err("a timeout");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    }
}
