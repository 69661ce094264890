//! Sandboxes through an external OCI runtime (`runc`, `crun`, or gVisor's `runsc`) instead of the
//! embedded setup code. Warren still owns the root filesystem (an overlay it mounts on the host, under
//! the sandbox's folder), execd and its socket folder; the OCI runtime gets a bundle whose `config.json`
//! asks for the same isolation the embedded path builds.
//!
//! Why one file: ~195 of its lines are tests (of `config_json` and the private `roots_in`). The
//! rest is one backend whose start, bundle and teardown agree on private details: `LISTEN_FD`,
//! where the root is mounted, and which runtimes take a listening socket.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::mount::{umount2, MntFlags};
use serde_json::{json, Value};
use warren_core::policy;

use crate::cgroup::CpuShare;
use crate::security::KEPT_CAPABILITIES;
use crate::spec::{
    InitSpec, RootSource, EXECD_IN_SANDBOX, EXECD_SOCKET_NAME, SOCKET_DIR_IN_SANDBOX,
};
use crate::userns::{self, Idmapped};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OciKind {
    Runc,
    Crun,
    Runsc,
}

/// The descriptor execd's listening socket has in the container (`--preserve-fds 1`: the first
/// after stdio).
const LISTEN_FD: i32 = 3;

impl OciKind {
    /// Whether execd can be handed a listening socket bound outside the container (gVisor's
    /// sandbox serves its own sockets only).
    fn takes_listener(self) -> bool {
        !matches!(self, OciKind::Runsc)
    }
}

#[derive(Debug, Clone)]
pub struct OciRuntime {
    pub kind: OciKind,
    pub binary: PathBuf,
    /// The runtime's own state folder (`--root`), under Warren's data dir.
    pub state_root: PathBuf,
    /// Where sandboxes' roots are mounted (see [`roots_for`]).
    pub roots: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("{binary} {verb} failed: {stderr}")]
    Failed {
        binary: String,
        verb: String,
        stderr: String,
    },
    #[error("running {binary}")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    #[error("mounting the root filesystem at {0}")]
    Mount(PathBuf, #[source] nix::Error),
    #[error("writing the bundle")]
    Bundle(#[source] std::io::Error),
    #[error("mounting the volumes")]
    Volumes(#[source] crate::rootfs::RootfsError),
    #[error("binding execd into the root")]
    Execd(#[source] io::Error),
}

/// Where an OCI runtime finds sandboxes' roots: `/run/warren/roots/<device>-<inode>` of the data
/// dir, one folder per server. Not under the data dir: with user namespaces the runtime looks a
/// root up, and mounts into it, as the sandbox's root — an unprivileged id, which the data dir
/// (0700) keeps out. Every folder on the way can be passed through by anyone but not listed
/// (0711); a sandbox's own folder in there only by host root and the sandbox's range (0710, its
/// group), so neither host users nor other sandboxes reach into a root.
pub fn roots_for(data_dir: &Path) -> io::Result<PathBuf> {
    roots_in(Path::new("/run/warren"), data_dir)
}

fn roots_in(run: &Path, data_dir: &Path) -> io::Result<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(data_dir)?;
    let roots = run.join("roots");
    let ours = roots.join(format!("{}-{}", meta.dev(), meta.ino()));
    for dir in [run, &roots, &ours] {
        make_dir(dir, 0o711)?;
        let mode = fs::symlink_metadata(dir)?.permissions().mode();
        if mode & 0o011 != 0o011 {
            fs::set_permissions(dir, fs::Permissions::from_mode((mode & 0o7777) | 0o011))?;
        }
    }
    Ok(ours)
}

impl OciRuntime {
    pub fn new(name: &str, state_root: PathBuf, roots: PathBuf) -> Option<Self> {
        let kind = match name {
            "runc" => OciKind::Runc,
            "crun" => OciKind::Crun,
            "runsc" => OciKind::Runsc,
            _ => return None,
        };
        let binary = ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"]
            .iter()
            .map(|d| Path::new(d).join(name))
            .find(|p| p.is_file())?;
        Some(Self {
            kind,
            binary,
            state_root,
            roots,
        })
    }

    /// Whether sandboxes can have user namespaces of their own here. gVisor's Sentry is the
    /// sandbox's kernel, and runs unprivileged itself already.
    pub fn takes_userns(&self) -> bool {
        self.kind != OciKind::Runsc
    }

    /// Where sandbox `id`'s root is mounted.
    pub fn rootfs(&self, id: &str) -> PathBuf {
        self.roots.join(id).join("rootfs")
    }

    fn base_command(&self) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--root").arg(&self.state_root);
        // Out of the server's process group: the processes `run --detach` leaves behind (runsc's
        // sandbox and gofer) would otherwise get a Ctrl-C or hangup of the terminal running
        // `warren serve`, ending sandboxes the server means to keep for its next start.
        cmd.process_group(0);
        if self.kind == OciKind::Runsc {
            // Loopback only (as the embedded runtime), and let execd create its socket in the host
            // folder bind-mounted at /.warren/run so the server can reach it.
            // --oci-seccomp: apply the bundle's seccomp profile inside the Sentry too.
            cmd.args(["--network=none", "--host-uds=all", "--oci-seccomp"]);
        }
        cmd
    }

    fn run(&self, args: &[&str]) -> Result<String, OciError> {
        let out = self
            .base_command()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| OciError::Spawn {
                binary: self.binary.display().to_string(),
                source,
            })?;
        if !out.status.success() {
            return Err(OciError::Failed {
                binary: self.binary.display().to_string(),
                verb: args.first().copied().unwrap_or_default().to_string(),
                stderr: String::from_utf8_lossy(&out.stderr)
                    .trim()
                    .chars()
                    .take(2000)
                    .collect(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Mounts the rootfs, writes the bundle and starts the container detached; returns its pid.
    /// `idmapped`: for a sandbox in a user namespace of its own (`spec.userns`).
    pub fn start(
        &self,
        spec: &InitSpec,
        bundle: &Path,
        log: fs::File,
        limits: &warren_core::ResourceLimits,
        share: CpuShare,
        idmapped: Option<&Idmapped>,
    ) -> Result<i32, OciError> {
        mount_rootfs(spec, idmapped)?;
        if !self.kind.takes_listener() {
            warren_core::mount_socket_dir(&spec.socket_dir).map_err(OciError::Bundle)?;
        }
        // execd's socket, bound here and handed over as descriptor 3 (see `LISTEN_FD`), except
        // under gVisor, whose sandbox cannot serve a host socket: there execd binds it in the
        // folder bind-mounted at /.warren/run, reached through `--host-uds`.
        let listener = if self.kind.takes_listener() {
            Some(
                warren_core::bind_socket_in(&spec.socket_dir, EXECD_SOCKET_NAME)
                    .map_err(OciError::Bundle)?,
            )
        } else {
            None
        };
        let config = config_json(spec, limits, share, self.kind);
        let text = serde_json::to_vec_pretty(&config).map_err(|e| OciError::Bundle(e.into()))?;
        fs::write(bundle.join("config.json"), text).map_err(OciError::Bundle)?;
        fs::create_dir_all(&self.state_root).map_err(OciError::Bundle)?;
        let err_log = log.try_clone().map_err(OciError::Bundle)?;
        let mut cmd = self.base_command();
        cmd.args(["run", "--detach"]);
        if let Some(listener) = &listener {
            use std::os::fd::AsRawFd;
            let fd = listener.as_raw_fd();
            cmd.args(["--preserve-fds", "1"]);
            // SAFETY: between fork and exec only dup2/fcntl, which are async-signal-safe; `fd`
            // stays open in the parent until the child has exec'd (`listener` outlives `status`).
            unsafe {
                cmd.pre_exec(move || {
                    let rc = if fd == LISTEN_FD {
                        libc::fcntl(fd, libc::F_SETFD, 0)
                    } else {
                        libc::dup2(fd, LISTEN_FD)
                    };
                    if rc < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let out = cmd
            .arg("--bundle")
            .arg(bundle)
            .arg(&spec.id)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err_log))
            .status()
            .map_err(|source| OciError::Spawn {
                binary: self.binary.display().to_string(),
                source,
            })?;
        let log_tail = || {
            let text = fs::read_to_string(bundle.join("sandbox.log")).unwrap_or_default();
            text.lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join(" | ")
        };
        if !out.success() {
            return Err(OciError::Failed {
                binary: self.binary.display().to_string(),
                verb: "run".into(),
                stderr: log_tail(),
            });
        }
        self.pid(&spec.id).map_err(|_| OciError::Failed {
            binary: self.binary.display().to_string(),
            verb: "run".into(),
            stderr: format!("the container exited at once: {}", log_tail()),
        })
    }

    pub fn pid(&self, id: &str) -> Result<i32, OciError> {
        let state: Value = serde_json::from_str(&self.run(&["state", id])?).unwrap_or(Value::Null);
        // A stopped container reports pid 0; never hand that (or -1) to kill(2), which would signal
        // our own process group or every process.
        state
            .get("pid")
            .and_then(Value::as_i64)
            .filter(|p| *p > 1 && *p <= i64::from(i32::MAX))
            .map(|p| p as i32)
            .ok_or_else(|| OciError::Failed {
                binary: self.binary.display().to_string(),
                verb: "state".into(),
                stderr: "the container has no running process".into(),
            })
    }

    pub fn pause(&self, id: &str) -> Result<(), OciError> {
        self.run(&["pause", id]).map(drop)
    }

    pub fn resume(&self, id: &str) -> Result<(), OciError> {
        self.run(&["resume", id]).map(drop)
    }

    pub fn is_paused(&self, id: &str) -> bool {
        self.run(&["state", id])
            .ok()
            .and_then(|s| serde_json::from_str::<Value>(&s).ok())
            .and_then(|v| {
                v.get("status")
                    .and_then(Value::as_str)
                    .map(|s| s == "paused")
            })
            .unwrap_or(false)
    }

    /// Best effort, idempotent: kill, delete, unmount the rootfs and the socket folder, remove the
    /// root's folders. `folder` is the sandbox's (the bundle), where a sandbox started by an older
    /// server also had its root.
    pub fn teardown(&self, id: &str, folder: &Path) {
        let legacy = folder.join("rootfs");
        let _ = self.run(&["kill", id, "KILL"]);
        if let Err(e) = self.run(&["delete", "--force", id]) {
            tracing::debug!(sandbox_id = id, error = %e, "oci delete");
        }
        let rootfs = self.rootfs(id);
        warren_core::unmount_socket_dir(&folder.join("run"));
        for root in [rootfs.as_path(), &legacy] {
            match umount2(root, MntFlags::MNT_DETACH) {
                Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
                Err(e) => {
                    tracing::warn!(sandbox_id = id, error = %e, "unmounting the rootfs failed")
                }
            }
        }
        for dir in [rootfs.as_path(), &self.roots.join(id)] {
            match fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(sandbox_id = id, error = %e, path = %dir.display(), "removing the root's folder failed")
                }
            }
        }
    }
}

/// The overlay root, on the host, with the volumes and execd already mounted inside it as the
/// embedded runtime mounts volumes (from handles, see `rootfs::mount_volumes`): given to the runtime
/// as paths, a volume would be looked up again when it mounts it, after a sandbox sharing the volume
/// could have swapped a folder on it for a link — and in a user namespace the runtime looks paths up
/// as the sandbox's root, which may not pass through the folders on the way to execd's binary. The
/// runtime's recursive bind of the root takes them along; teardown's lazy unmount of the root takes
/// them away.
///
/// With a user namespace the layers are the idmapped copies and volumes are idmapped as on the
/// embedded runtime (`userns::volume_map`); the root's folder admits the range's group.
fn mount_rootfs(spec: &InitSpec, idmapped: Option<&Idmapped>) -> Result<(), OciError> {
    let root = &spec.rootfs_dir;
    let volume_ns = match spec.userns {
        Some(range) => userns::volume_namespaces(range, &spec.volumes).map_err(OciError::Bundle)?,
        None => Vec::new(),
    };
    make_root_folder(root, spec.userns).map_err(OciError::Bundle)?;
    let lowers = match idmapped {
        Some(m) => m.layer_paths(),
        None => spec.lower_dirs(),
    };
    crate::rootfs::mount_overlay(spec, root, &lowers)
        .map_err(|e| OciError::Mount(root.clone(), e))?;
    let inside = crate::rootfs::mount_volumes(spec, root, &volume_ns)
        .map_err(OciError::Volumes)
        .and_then(|()| bind_execd(spec).map_err(OciError::Execd));
    if inside.is_err() {
        let _ = umount2(root, MntFlags::MNT_DETACH);
    }
    inside
}

/// A folder made with `mode` (under the umask), or left as it is if there already.
fn make_dir(dir: &Path, mode: u32) -> io::Result<()> {
    match fs::DirBuilder::new().mode(mode).create(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

/// `root`'s folder (the sandbox's in [`roots_for`]'s) and `root` itself, the mount point.
fn make_root_folder(root: &Path, range: Option<userns::IdRange>) -> io::Result<()> {
    let Some(folder) = root.parent() else {
        return Err(io::Error::other("a root needs a folder"));
    };
    for dir in [folder, root] {
        make_dir(dir, 0o700)?;
    }
    if let Some(range) = range {
        std::os::unix::fs::chown(folder, Some(0), Some(range.base))?;
        fs::set_permissions(folder, fs::Permissions::from_mode(0o710))?;
    }
    Ok(())
}

/// execd's binary, read-only, at [`EXECD_IN_SANDBOX`] in the mounted root: opened here, as host
/// root, and bound handle to handle (a link the image put at `/.warren` is refused, not followed).
fn bind_execd(spec: &InitSpec) -> io::Result<()> {
    use nix::mount::MsFlags;
    let source: std::os::fd::OwnedFd = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
        .open(&spec.execd_path)?
        .into();
    let rel = Path::new(EXECD_IN_SANDBOX.trim_start_matches('/'));
    let target = warren_core::beneath::make_file_beneath(&spec.rootfs_dir, rel)?;
    let attrs = crate::rootfs::mount_api::attrs(true, MsFlags::MS_NOSUID | MsFlags::MS_NODEV);
    crate::rootfs::mount_api::bind_handle(&source, &target.fd, attrs, None).map_err(io::Error::from)
}

fn bind(dest: &str, source: &Path, ro: bool, kind: OciKind) -> Value {
    let mut options = vec!["rbind", "nosuid", "nodev"];
    options.push(if ro { "ro" } else { "rw" });
    // runc makes only the top mount of a recursive bind read-only; `rro` (runc 1.1, Linux 5.12)
    // makes every mount below it read-only too (a host's separate /usr/local, say). gVisor's sentry
    // enforces `ro` on the whole bind itself.
    if ro && kind == OciKind::Runc {
        options.push("rro");
    }
    json!({"destination": dest, "type": "bind", "source": source, "options": options})
}

pub fn config_json(
    spec: &InitSpec,
    limits: &warren_core::ResourceLimits,
    share: CpuShare,
    kind: OciKind,
) -> Value {
    let mut args = vec![EXECD_IN_SANDBOX.to_string()];
    if kind.takes_listener() {
        args.extend(["--listen-fd".to_string(), LISTEN_FD.to_string()]);
    } else {
        args.extend([
            "--socket".to_string(),
            format!("{SOCKET_DIR_IN_SANDBOX}/{EXECD_SOCKET_NAME}"),
        ]);
    }
    if let Some(floor) = &spec.hardening {
        args.extend(["--floor".to_string(), json!(floor).to_string()]);
    }
    args.extend([
        "--workdir".to_string(),
        spec.workdir.clone(),
        "--".to_string(),
    ]);
    args.extend(spec.entrypoint.iter().cloned());
    let caps: Vec<String> = KEPT_CAPABILITIES.iter().map(|c| c.to_string()).collect();

    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}),
    ];
    // Masked and read-only paths (`warren_core::policy`), which OCI runtimes apply themselves.
    let masked: Vec<&str> = policy::MASKED_FILES
        .iter()
        .chain(policy::MASKED_DIRS)
        .copied()
        .collect();
    if let RootSource::Host {
        binds,
        masked_files,
        masked_dirs,
        ..
    } = &spec.root
    {
        for b in binds {
            mounts.push(bind(&b.display().to_string(), b, true, kind));
        }
        // Explicit mounts rather than maskedPaths: gVisor does not mask paths inside bind mounts. Only
        // paths the binds make visible: a mount elsewhere would create the very path it hides.
        let visible = |p: &&PathBuf| binds.iter().any(|b| p.starts_with(b));
        for f in masked_files.iter().filter(visible).filter(|p| p.is_file()) {
            mounts.push(json!({"destination": f, "type": "bind", "source": "/dev/null", "options": ["bind", "ro", "nosuid", "nodev", "noexec"]}));
        }
        for d in masked_dirs.iter().filter(visible).filter(|p| p.is_dir()) {
            mounts.push(json!({"destination": d, "type": "tmpfs", "source": "tmpfs", "options": ["ro", "nosuid", "nodev", "noexec", "size=4k", "mode=700"]}));
        }
    }
    // execd's binary is in the root already (see `mount_rootfs`).
    if !kind.takes_listener() {
        mounts.push(bind(SOCKET_DIR_IN_SANDBOX, &spec.socket_dir, false, kind));
    }

    let mut resources = json!({"pids": {"limit": limits.pids}});
    if let Some(m) = limits.memory_bytes {
        // `swap` is memory + swap: equal to the limit, no swap beyond it (the runtime leaves
        // memsw unlimited otherwise).
        resources["memory"] = json!({"limit": m, "swap": m});
    }
    if let Some(c) = limits.cpu_millis {
        resources["cpu"] = json!({"quota": c * 100, "period": 100_000});
    }
    if share == CpuShare::Background {
        // v1 cpu.shares; runc turns it into the matching cpu.weight on v2 (2 → 1).
        resources["cpu"]["shares"] = json!(2);
    }
    let mut linux = json!({
        "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "cgroup"}],
        "resources": resources,
        "cgroupsPath": format!("/warren/{}", spec.id),
        "maskedPaths": masked,
        "readonlyPaths": policy::READONLY_PATHS,
    });
    // The same policy as the embedded path (see `warren_core::policy::oci_seccomp` for gVisor).
    linux["seccomp"] = policy::oci_seccomp(kind == OciKind::Runsc);
    if let Some(range) = spec.userns {
        // The runtime makes the user namespace first and every other one in it, so root inside
        // holds its capabilities over the sandbox's network (port 80, raw sockets for ping) as
        // in a container without one.
        let map = json!([{"containerID": 0, "hostID": range.base, "size": userns::SIZE}]);
        linux["namespaces"]
            .as_array_mut()
            .expect("namespaces is a list")
            .push(json!({"type": "user"}));
        linux["uidMappings"] = map.clone();
        linux["gidMappings"] = map;
    }
    let mut config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": spec.env,
            "cwd": spec.workdir,
            "capabilities": {"bounding": caps, "effective": caps, "inheritable": caps, "permitted": caps},
            // In a user namespace a setuid program reaches only the range's root (see `userns`),
            // so setuid programs (`su`, `sudo`, `ping` of old) work as in a container.
            "noNewPrivileges": spec.userns.is_none(),
        },
        "root": {"path": spec.rootfs_dir, "readonly": false},
        "hostname": spec.hostname,
        "mounts": mounts,
        "linux": linux,
    });
    // The open-file limit the server started with, not the one it raised for itself (see
    // `warren_core::fd_limit`); the runtime's own processes keep the raised one.
    if let Some((soft, hard)) = warren_core::fd_limit::for_children() {
        config["process"]["rlimits"] =
            json!([{"type": "RLIMIT_NOFILE", "soft": soft, "hard": hard}]);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> InitSpec {
        InitSpec {
            id: "abc".into(),
            hostname: "abc".into(),
            root: RootSource::Layers(vec!["/l1".into(), "/l2".into()]),
            upper_dir: "/s/upper".into(),
            work_dir: "/s/work".into(),
            rootfs_dir: "/s/rootfs".into(),
            socket_dir: "/s/run".into(),
            execd_path: "/bin/execd".into(),
            cgroup_v1_mounts: vec![],
            cgroup_v2: false,
            entrypoint: vec!["tail".into(), "-f".into(), "/dev/null".into()],
            env: vec!["PATH=/bin".into()],
            workdir: "/".into(),
            log_path: None,
            volumes: vec![crate::spec::HostMount {
                source: "/srv/data".into(),
                beneath: "/".into(),
                create: false,
                target: "/mnt/data".into(),
                read_only: true,
            }],
            base_layer: Some("/base".into()),
            userns: None,
            isolation: false,
            execd_tcp_verifier: None,
            hardening: None,
        }
    }

    #[test]
    fn bundle_carries_limits_caps_and_execd() {
        let limits = warren_core::ResourceLimits {
            cpu_millis: Some(500),
            memory_bytes: Some(1 << 30),
            pids: 100,
            disk_bytes: None,
        };
        let c = config_json(&spec(), &limits, CpuShare::Normal, OciKind::Runc);
        assert_eq!(c["linux"]["resources"]["cpu"]["quota"], 50_000);
        assert!(c["linux"]["resources"]["cpu"].get("shares").is_none());
        assert_eq!(c["linux"]["resources"]["memory"]["limit"], 1u64 << 30);
        assert_eq!(c["linux"]["resources"]["memory"]["swap"], 1u64 << 30);
        assert_eq!(c["linux"]["resources"]["pids"]["limit"], 100);
        assert_eq!(c["process"]["args"][0], EXECD_IN_SANDBOX);
        assert_eq!(c["process"]["args"][1], "--listen-fd");
        assert_eq!(c["process"]["args"][2], "3");
        assert_eq!(c["process"]["args"][6], "tail");
        let mounts = c["mounts"].as_array().expect("mounts");
        // Volumes are mounted inside the root before the runtime starts, from handles: never by path.
        assert!(!mounts.iter().any(|m| m["destination"] == "/mnt/data"));
        // execd is bound into the root before the runtime starts, from a handle: never by path.
        assert!(!mounts.iter().any(|m| m["destination"] == EXECD_IN_SANDBOX));
        assert_eq!(c["process"]["noNewPrivileges"], true);
        assert!(c["linux"].get("uidMappings").is_none());
        let caps = c["process"]["capabilities"]["bounding"]
            .as_array()
            .expect("caps");
        assert!(caps.iter().any(|v| v == "CAP_CHOWN"));
        assert!(!caps.iter().any(|v| v == "CAP_SYS_ADMIN"));
        let seccomp = &c["linux"]["seccomp"];
        assert_eq!(seccomp["defaultAction"], "SCMP_ACT_ERRNO");
        let allowed = seccomp["syscalls"][0]["names"].as_array().expect("names");
        assert!(allowed.iter().any(|n| n == "read"));
        assert!(!allowed.iter().any(|n| n == "mount"));
        assert!(c["linux"]["maskedPaths"]
            .as_array()
            .expect("masked")
            .iter()
            .any(|p| p == "/proc/kpageflags"));
        // Nothing the sandbox can write in is bound from the host; under gVisor the socket folder is.
        assert!(!mounts
            .iter()
            .any(|m| m["destination"] == SOCKET_DIR_IN_SANDBOX));
        let runsc = config_json(&spec(), &limits, CpuShare::Normal, OciKind::Runsc);
        assert_eq!(runsc["process"]["args"][1], "--socket");
        assert!(runsc["mounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .any(|m| m["destination"] == SOCKET_DIR_IN_SANDBOX));
        // gVisor: the deny list, default allow.
        assert_eq!(runsc["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ALLOW");
        assert!(runsc["linux"]["seccomp"]["syscalls"][0]["names"]
            .as_array()
            .expect("names")
            .iter()
            .any(|n| n == "mount"));
        let rules = |c: &serde_json::Value, name: &str| {
            c["linux"]["seccomp"]["syscalls"]
                .as_array()
                .expect("rules")
                .iter()
                .filter(|r| r["names"] == serde_json::json!([name]))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert!(rules(&c, "clone")[0]["args"].is_array());
        assert_eq!(rules(&c, "clone3")[0]["errnoRet"], 38);
        assert_eq!(rules(&c, "personality").len(), 5);
    }

    #[test]
    fn a_sandbox_in_a_range_gets_a_user_namespace_mapped_onto_it() {
        let limits = warren_core::ResourceLimits {
            cpu_millis: None,
            memory_bytes: None,
            pids: 100,
            disk_bytes: None,
        };
        let mut spec = spec();
        spec.userns = Some(userns::IdRange { base: 1 << 31 });
        let c = config_json(&spec, &limits, CpuShare::Normal, OciKind::Runc);
        let want = serde_json::json!([{"containerID": 0, "hostID": 1u64 << 31, "size": 65536}]);
        assert_eq!(c["linux"]["uidMappings"], want);
        assert_eq!(c["linux"]["gidMappings"], want);
        assert!(c["linux"]["namespaces"]
            .as_array()
            .expect("namespaces")
            .contains(&serde_json::json!({"type": "user"})));
        // setuid programs reach only the range's root
        assert_eq!(c["process"]["noNewPrivileges"], false);
    }

    #[test]
    fn roots_are_reached_through_folders_anyone_may_pass_but_not_list() {
        use std::os::unix::fs::MetadataExt;
        let t = tempfile::tempdir().expect("tempdir");
        let run = t.path().join("run");
        fs::create_dir(&run).expect("run");
        fs::set_permissions(&run, fs::Permissions::from_mode(0o700)).expect("chmod");
        let data = t.path().join("data");
        fs::create_dir(&data).expect("data");
        let roots = roots_in(&run, &data).expect("roots");
        let meta = fs::metadata(&data).expect("meta");
        assert_eq!(
            roots,
            run.join("roots")
                .join(format!("{}-{}", meta.dev(), meta.ino()))
        );
        let mode = |p: &Path| fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(
            mode(&run),
            0o711,
            "a folder that was closed is opened for passing"
        );
        assert_eq!(mode(&run.join("roots")), 0o711);
        assert_eq!(mode(&roots), 0o711);
        assert_eq!(roots_in(&run, &data).expect("again"), roots);

        let root = roots.join("sbx").join("rootfs");
        make_root_folder(&root, Some(userns::IdRange { base: 1 << 31 })).expect("folder");
        let folder = fs::metadata(roots.join("sbx")).expect("meta");
        assert_eq!(folder.permissions().mode() & 0o777, 0o710);
        assert_eq!((folder.uid(), folder.gid()), (0, 1 << 31));
        make_root_folder(&roots.join("other").join("rootfs"), None).expect("folder");
        assert_eq!(mode(&roots.join("other")), 0o700);
    }

    #[test]
    fn a_background_sandbox_asks_for_the_smallest_cpu_share() {
        let unlimited = warren_core::ResourceLimits {
            cpu_millis: None,
            memory_bytes: None,
            pids: 100,
            disk_bytes: None,
        };
        let c = config_json(&spec(), &unlimited, CpuShare::Background, OciKind::Runc);
        assert_eq!(
            c["linux"]["resources"]["cpu"],
            serde_json::json!({"shares": 2})
        );
    }

    #[test]
    fn the_container_gets_the_open_file_limit_the_server_started_with() {
        let (original, _) = warren_core::fd_limit::raise().expect("raise");
        let limits = warren_core::ResourceLimits {
            cpu_millis: None,
            memory_bytes: None,
            pids: 100,
            disk_bytes: None,
        };
        let c = config_json(&spec(), &limits, CpuShare::Normal, OciKind::Runsc);
        let rl = &c["process"]["rlimits"][0];
        assert_eq!(rl["type"], "RLIMIT_NOFILE");
        assert_eq!(rl["soft"], original);
        assert!(rl["hard"].as_u64().expect("hard") >= original);
    }
}
