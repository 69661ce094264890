//! Sandboxes through an external OCI runtime (`runc`, `crun`, or gVisor's `runsc`) instead of the
//! embedded setup code. Warren still owns the root filesystem (an overlay it mounts on the host, under
//! the sandbox's folder), execd and its socket folder; the OCI runtime gets a bundle whose `config.json`
//! asks for the same isolation the embedded path builds.

use std::fs;
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
}

impl OciRuntime {
    pub fn new(name: &str, state_root: PathBuf) -> Option<Self> {
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
        })
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
    pub fn start(
        &self,
        spec: &InitSpec,
        bundle: &Path,
        log: fs::File,
        limits: &warren_core::ResourceLimits,
        share: CpuShare,
    ) -> Result<i32, OciError> {
        mount_rootfs(spec)?;
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

    /// Best effort, idempotent: kill, delete, unmount the rootfs.
    pub fn teardown(&self, id: &str, rootfs: &Path) {
        let _ = self.run(&["kill", id, "KILL"]);
        if let Err(e) = self.run(&["delete", "--force", id]) {
            tracing::debug!(sandbox_id = id, error = %e, "oci delete");
        }
        match umount2(rootfs, MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
            Err(e) => tracing::warn!(sandbox_id = id, error = %e, "unmounting the rootfs failed"),
        }
    }
}

/// The overlay root, on the host, with the volumes already mounted inside it as the embedded runtime
/// mounts them (from handles, see `rootfs::mount_volumes`): given to the runtime as paths, a volume
/// would be looked up again when it mounts it, after a sandbox sharing the volume could have swapped
/// a folder on it for a link. The runtime's recursive bind of the root takes them along; teardown's
/// lazy unmount of the root takes them away.
fn mount_rootfs(spec: &InitSpec) -> Result<(), OciError> {
    crate::rootfs::mount_overlay(spec, &spec.rootfs_dir, &spec.lower_dirs())
        .map_err(|e| OciError::Mount(spec.rootfs_dir.clone(), e))?;
    crate::rootfs::mount_volumes(spec, &spec.rootfs_dir, None).map_err(|e| {
        let _ = umount2(&spec.rootfs_dir, MntFlags::MNT_DETACH);
        OciError::Volumes(e)
    })
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
    mounts.push(bind(EXECD_IN_SANDBOX, &spec.execd_path, true, kind));
    if !kind.takes_listener() {
        mounts.push(bind(SOCKET_DIR_IN_SANDBOX, &spec.socket_dir, false, kind));
    }

    let mut resources = json!({"pids": {"limit": limits.pids}});
    if let Some(m) = limits.memory_bytes {
        resources["memory"] = json!({"limit": m});
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
    let mut config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": spec.env,
            "cwd": spec.workdir,
            "capabilities": {"bounding": caps, "effective": caps, "inheritable": caps, "permitted": caps},
            "noNewPrivileges": true,
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
        assert_eq!(c["linux"]["resources"]["pids"]["limit"], 100);
        assert_eq!(c["process"]["args"][0], EXECD_IN_SANDBOX);
        assert_eq!(c["process"]["args"][1], "--listen-fd");
        assert_eq!(c["process"]["args"][2], "3");
        assert_eq!(c["process"]["args"][6], "tail");
        let mounts = c["mounts"].as_array().expect("mounts");
        // Volumes are mounted inside the root before the runtime starts, from handles: never by path.
        assert!(!mounts.iter().any(|m| m["destination"] == "/mnt/data"));
        let execd = mounts
            .iter()
            .find(|m| m["destination"] == EXECD_IN_SANDBOX)
            .expect("execd is bound");
        let opts = execd["options"].as_array().expect("opts");
        assert!(opts.contains(&serde_json::json!("ro")));
        assert!(
            opts.contains(&serde_json::json!("rro")),
            "read-only all the way down"
        );
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
