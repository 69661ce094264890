//! Create: the init spec from the sandbox spec, a helper (standby or cold) made into the
//! sandbox's PID 1, its id range and root, and the wait until execd answers.

use std::collections::BTreeMap;
use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use warren_core::image::ResolvedImage;
use warren_core::{ExecdAddress, Runtime, RuntimeError, RuntimeState, SandboxImage, SandboxSpec};

use crate::host_image::{HOST_BINDS, HOST_MASKED_DIRS, HOST_MASKED_FILES};
use crate::reply::{read_reply, wait_closed};
use crate::teardown::{is_alive, log_tail};
use crate::{
    cgroup, disk, folders, priority, process_start_time, rootfs, spec, userns, volumes, zygote,
    Cgroup, CpuShare, InitReply, InitSpec, NativeRuntime, NativeState, RootSource,
    EXECD_SOCKET_NAME, ISOLATION_FILE, USERNS_FILE,
};

/// What the embedded path's start gives back: the sandbox's PID 1, the pipe that says when execd is
/// ready, execd's loopback port (TCP transport), and the isolation helper's pid (see `init`).
pub(crate) type EmbeddedStart = (i32, Option<fs::File>, Option<u16>, Option<i32>);

/// Environment of the sandbox's processes: image env, then the request's env, then Warren's defaults
/// for what neither set.
pub(crate) fn sandbox_env(
    image_env: &[String],
    request: &BTreeMap<String, String>,
    id: &str,
) -> Vec<String> {
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
pub(crate) fn yield_cpu(cg: &Cgroup) {
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
pub(crate) fn premade_root(
    spec: &InitSpec,
    idmapped: Option<&userns::Idmapped>,
) -> Option<OwnedFd> {
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

impl NativeRuntime {
    pub(crate) fn init_spec(&self, spec: &SandboxSpec) -> InitSpec {
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

    pub(crate) fn create_blocking(&self, spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError> {
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

    pub(crate) fn try_create(
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
    pub(crate) fn start_embedded(
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

    /// Gives a sandbox made ahead of need the background CPU share while `background` is on; see
    /// [`warren_core::Background`] for why it is read twice. Failing only costs speed: logged.
    pub(crate) fn lower_share(&self, id: &str, background: &warren_core::Background) {
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

    /// Ready means execd accepts connections: the SDK's first `/ping` must succeed. With `ready`,
    /// the pipe execd closes once it listens, that moment is waited for rather than polled.
    pub(crate) fn wait_ready(
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

    /// With user namespaces: a range of ids for sandbox `id`, recorded in its folder `dir` (for a
    /// restarted server) and given its `upper` dir, which is the root folder the sandbox sees.
    pub(crate) fn take_range(
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
    pub(crate) fn idmapped(
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
}
