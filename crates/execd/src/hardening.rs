//! The floor under user code (the reference's OSEP-0018; what it is: [`warren_api::hardening`]).
//!
//! execd keeps what the sandbox gives it; every process it starts for user code is lowered between
//! fork and exec, in an order Linux pins: the bounding set is cut while the process still holds
//! `CAP_SETPCAP`; `no_new_privs`; the identity change (with `PR_SET_KEEPCAPS`, else the kept
//! capabilities would go with it); exactly the kept capabilities, raised as ambient ones so that
//! they survive `execve`; and the seccomp deny list last, so that it cannot refuse the steps before
//! it. A root process that execs regains its bounding set, so the cut is what leaves it without
//! capabilities.
//!
//! The reference lowers each child in a helper binary it execs first, since Go cannot run code
//! between fork and exec. Rust can: everything the child needs (the filter, the masks) is built
//! here beforehand, and the child makes only system calls, which are safe after the fork of a
//! process with threads.
//!
//! Where the floor is asked for: the server's `[runtime] execd_run_as_init` (passed to execd with
//! `--floor`), and an image's isolation TOML named by `EXECD_ISOLATION_CONFIG` with `[hardening]
//! enabled = true`, as the reference reads it. When both are there the image's can only tighten
//! the server's.
//!
//! Why one file: ~200 of its lines are tests, some starting real children under the floor. The rest
//! is one floor: reading its policy, reporting what is in force and lowering children, all three
//! about the same `Floor` fields.

use std::collections::BTreeSet;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Arc;

use serde::Deserialize;
use warren_api::hardening::{FloorPolicy, HardeningStatus, LayerState};

/// The variable that names an image's isolation TOML, as in the reference.
pub const ISOLATION_CONFIG_VAR: &str = warren_env::EnvVars::EXECD_ISOLATION_CONFIG;

/// execd's own settings, which commands, sessions, terminals and kernels do not see under the
/// floor: a credential, the policy's file, a kernel gateway's token, and the env file's path (so
/// user code cannot rewrite what later commands start with).
const STRIPPED: [&str; 5] = [
    "EXECD_ACCESS_TOKEN",
    ISOLATION_CONFIG_VAR,
    "JUPYTER_HOST",
    "JUPYTER_TOKEN",
    crate::process::EXECD_ENVS_VAR,
];

/// The entrypoint is the image's own program and may read its settings; only the credential goes.
const STRIPPED_FROM_ENTRYPOINT: [&str; 1] = ["EXECD_ACCESS_TOKEN"];

/// What a refused call returns, as in the reference.
const REFUSED_ERRNO: u16 = libc::EACCES as u16;

/// Which process is being started: the entrypoint keeps more of its environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Entrypoint,
    UserCode,
}

/// Who the child becomes, when not execd's own user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
}

/// The floor, ready to lay under children.
#[derive(Debug)]
pub struct Floor {
    /// Capabilities kept (bit n: capability n), within what execd holds.
    keep: u64,
    /// Capabilities asked to be kept that execd does not hold (gVisor gives no `CAP_NET_RAW`
    /// without `--net-raw`, say): reported, not an error.
    not_held: u64,
    /// Whether execd may cut its children's bounding sets (it holds `CAP_SETPCAP`).
    trim_bounding: bool,
    /// The highest capability number this kernel knows.
    last_cap: u32,
    filter: Option<warren_seccomp::Program>,
}

/// The image's isolation TOML: the reference's keys that concern the floor; the rest (its
/// isolated sessions' settings) is not read here.
#[derive(Debug, Default, Deserialize)]
struct IsolationToml {
    #[serde(default)]
    hardening: HardeningToml,
    #[serde(default)]
    seccomp: SeccompToml,
    #[serde(default)]
    landlock: Toggle,
}

#[derive(Debug, Default, Deserialize)]
struct HardeningToml {
    #[serde(default)]
    enabled: bool,
    #[serde(default)]
    keep_capabilities: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
struct SeccompToml {
    deny: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
struct Toggle {
    #[serde(default)]
    enabled: bool,
}

/// What execd was asked for and what it could do: the report, and the floor when there is one.
pub struct Hardening {
    pub floor: Option<Arc<Floor>>,
    pub status: HardeningStatus,
}

impl Hardening {
    /// The floor from the server's `policy` and the image's TOML (`toml_path`, when its variable is
    /// set). An unusable policy is an error: execd then refuses to start rather than run user code
    /// without the floor it was asked for.
    pub fn resolve(
        policy: Option<&FloorPolicy>,
        toml_path: Option<&str>,
        supervision: Supervision,
    ) -> Result<Hardening, String> {
        let image = match toml_path.filter(|p| !p.is_empty()) {
            Some(path) => read_toml(path)?,
            None => None,
        };
        let landlock_asked = image.as_ref().is_some_and(|t| t.landlock.enabled);
        let image_policy = image.filter(|t| t.hardening.enabled).map(|t| FloorPolicy {
            keep_capabilities: t.hardening.keep_capabilities,
            seccomp_deny: t.seccomp.deny,
        });
        let policy = match (policy, image_policy) {
            (Some(server), Some(image)) => Some(server.tightened_by(&image)),
            (Some(server), None) => Some(server.clone()),
            (None, image) => image,
        };
        let floor = policy.as_ref().map(Floor::new).transpose()?.map(Arc::new);
        let status = report(floor.as_deref(), landlock_asked, supervision);
        Ok(Hardening { floor, status })
    }
}

fn read_toml(path: &str) -> Result<Option<IsolationToml>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            tracing::warn!(
                path,
                "{ISOLATION_CONFIG_VAR} names no file; no image policy"
            );
            return Ok(None);
        }
        Err(e) => return Err(format!("{ISOLATION_CONFIG_VAR}={path}: {e}")),
    };
    toml::from_str(&text)
        .map(Some)
        .map_err(|e| format!("{ISOLATION_CONFIG_VAR}={path}: {}", e.message()))
}

/// How execd supervises the sandbox, as the report states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Supervision {
    /// `pid1` when execd is its PID namespace's init, `subreaper` when it adopts the orphans of
    /// its own children only, `none` otherwise.
    pub init_mode: &'static str,
    /// Whether the kernel keeps the sandbox's processes from killing execd: Linux does for a PID
    /// namespace's init; gVisor's Sentry lets a `kill -9 1` from inside through.
    pub signal_shield: bool,
}

impl Supervision {
    pub fn detect(subreaper: bool) -> Supervision {
        let pid1 = std::process::id() == 1;
        Supervision {
            init_mode: match (pid1, subreaper) {
                (true, _) => "pid1",
                (false, true) => "subreaper",
                (false, false) => "none",
            },
            signal_shield: pid1 && !under_gvisor(),
        }
    }
}

/// gVisor's Sentry presents itself as one fixed Linux build, which no real kernel is.
fn under_gvisor() -> bool {
    std::fs::read_to_string("/proc/version")
        .is_ok_and(|v| v.contains("4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016"))
}

fn report(
    floor: Option<&Floor>,
    landlock_asked: bool,
    supervision: Supervision,
) -> HardeningStatus {
    let off = || {
        LayerState::with(
            "disabled",
            "hardening not enabled ([runtime] execd_run_as_init)",
        )
    };
    let (cap_drop, seccomp) = match floor {
        None => (off(), off()),
        Some(f) => (
            if f.trim_bounding {
                LayerState::active((f.not_held != 0).then(|| {
                    format!(
                        "kept capabilities execd does not hold, so user code cannot either: {}",
                        capability_names(f.not_held)
                    )
                }))
            } else {
                LayerState::with(
                    "degraded",
                    "cap_drop degraded: execd lacks CAP_SETPCAP, so the bounding set cannot be cut \
                     (user code keeps only the kept capabilities until a program it runs as root \
                     regains the bounding set); no_new_privs and seccomp still apply",
                )
            },
            if f.filter.is_some() {
                LayerState::active(None)
            } else {
                LayerState::with("degraded", "seccomp floor skipped: the deny list is empty")
            },
        ),
    };
    HardeningStatus {
        init_mode: supervision.init_mode.to_string(),
        signal_shield: supervision.signal_shield,
        cap_drop,
        seccomp,
        landlock: if landlock_asked {
            LayerState::with(
                "unsupported",
                "Warren's execd does not apply Landlock; user code's files are bounded by the \
                 sandbox's own root filesystem and mounts",
            )
        } else {
            LayerState::with("disabled", "landlock confinement is not enabled")
        },
        ebpf: LayerState::with(
            "disabled",
            "eBPF observation is not offered by Warren's execd",
        ),
    }
}

impl Floor {
    /// Checks `policy` and builds what the children will need, for children of this process
    /// (its capabilities are what they can keep).
    pub fn new(policy: &FloorPolicy) -> Result<Floor, String> {
        let held = own_capabilities();
        Self::with_held(policy, held.permitted, held.effective)
    }

    /// [`Floor::new`] for children that will hold `permitted` and `effective` (bit n: capability
    /// n) when they are lowered: an isolated session's processes, prepared by the setup helper
    /// that holds more.
    pub fn with_held(
        policy: &FloorPolicy,
        permitted: u64,
        effective: u64,
    ) -> Result<Floor, String> {
        policy.check()?;
        let mut denied = BTreeSet::new();
        for name in policy.deny_list() {
            let nr = warren_seccomp::number(&name)
                .ok_or_else(|| format!("seccomp deny: {name:?} is not an x86-64 syscall"))?;
            denied.insert(nr);
        }
        let filter = if denied.is_empty() {
            None
        } else {
            Some(
                warren_seccomp::deny(&denied, REFUSED_ERRNO)
                    .map_err(|e| format!("building the seccomp floor: {e}"))?,
            )
        };
        let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .unwrap_or(40)
            .min(63);
        let asked = policy.keep_mask()?;
        Ok(Floor {
            // A capability execd does not hold cannot be given; asking for it is not an error
            // (the runtime decides what execd holds).
            keep: asked & permitted,
            not_held: asked & !permitted,
            trim_bounding: effective & (1 << CAP_SETPCAP) != 0,
            last_cap,
            filter,
        })
    }

    /// Sets `cmd` up to start under the floor: execd's settings out of its environment and the
    /// lowering between fork and exec. `identity`: who it becomes (else execd's user); `cmd` must
    /// not change its identity itself.
    pub fn prepare(self: &Arc<Self>, cmd: &mut Command, role: Role, identity: Option<Identity>) {
        let stripped: &[&str] = match role {
            Role::Entrypoint => &STRIPPED_FROM_ENTRYPOINT,
            Role::UserCode => &STRIPPED,
        };
        for name in stripped {
            cmd.env_remove(name);
        }
        // `Command` enters the working folder before it runs this; as another user, the folder is
        // entered once that user (from `/` until then), so it reaches only what that user may.
        let cwd = match identity {
            Some(_) => {
                let dir = cmd
                    .get_current_dir()
                    .map(|d| d.as_os_str().as_bytes().to_vec());
                cmd.current_dir("/");
                dir.and_then(|d| std::ffi::CString::new(d).ok())
            }
            None => None,
        };
        let floor = self.clone();
        // SAFETY: `lower` makes system calls only (no allocation, no lock), on data built before
        // the fork: safe between fork and exec in a process with threads.
        unsafe {
            cmd.pre_exec(move || {
                floor.lower(identity)?;
                match &cwd {
                    Some(dir) if libc::chdir(dir.as_ptr()) != 0 => Err(io::Error::last_os_error()),
                    _ => Ok(()),
                }
            });
        }
    }

    /// Whether the floor takes variable `name` out of a `role`'s environment.
    pub fn strips(role: Role, name: &str) -> bool {
        match role {
            Role::Entrypoint => STRIPPED_FROM_ENTRYPOINT.contains(&name),
            Role::UserCode => STRIPPED.contains(&name),
        }
    }

    /// In the child, between fork and exec: see the module's comment for the order. Makes system
    /// calls only: safe after the fork of a process with threads.
    pub fn lower(&self, identity: Option<Identity>) -> io::Result<()> {
        fn check(rc: libc::c_long) -> io::Result<()> {
            if rc < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        }
        // SAFETY: prctl, setgroups, setresgid, setresuid and capset with integer arguments or
        // pointers to values that outlive the calls.
        unsafe {
            if identity.is_some() {
                check(libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0).into())?;
            }
            if self.trim_bounding {
                for cap in 0..=self.last_cap {
                    // Below 0: a capability this kernel (or gVisor's Sentry) does not know; 0:
                    // out of the set already. Any other one must go.
                    let cap = cap as libc::c_ulong;
                    if self.keep & (1u64 << cap) == 0
                        && libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) > 0
                    {
                        check(libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0).into())?;
                    }
                }
            }
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0).into())?;
            if let Some(id) = identity {
                check(libc::syscall(
                    libc::SYS_setgroups,
                    0,
                    std::ptr::null::<libc::gid_t>(),
                ))?;
                check(libc::syscall(libc::SYS_setresgid, id.gid, id.gid, id.gid))?;
                check(libc::syscall(libc::SYS_setresuid, id.uid, id.uid, id.uid))?;
            }
            let header = CapHeader {
                version: LINUX_CAPABILITY_VERSION_3,
                pid: 0,
            };
            let set = |half: u32| CapData {
                effective: half,
                permitted: half,
                inheritable: half,
            };
            let data = [set(self.keep as u32), set((self.keep >> 32) as u32)];
            // (The ambient set keeps nothing the inheritable set just lost: no clearing needed.)
            check(libc::syscall(libc::SYS_capset, &header, data.as_ptr()))?;
            for cap in 0..=self.last_cap {
                if self.keep & (1u64 << cap) != 0 {
                    check(
                        libc::prctl(
                            libc::PR_CAP_AMBIENT,
                            libc::PR_CAP_AMBIENT_RAISE,
                            cap as libc::c_ulong,
                            0,
                            0,
                        )
                        .into(),
                    )?;
                }
            }
        }
        if let Some(filter) = &self.filter {
            warren_seccomp::install(filter).map_err(|e| match e {
                warren_seccomp::FilterError::Install(e) => e,
                // (built before the fork; no allocation here)
                _ => io::Error::from_raw_os_error(libc::EINVAL),
            })?;
        }
        Ok(())
    }
}

fn capability_names(mask: u64) -> String {
    warren_api::hardening::CAPABILITY_NAMES
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1u64 << i) != 0)
        .map(|(_, n)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const CAP_SETPCAP: u32 = 8;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

struct Held {
    permitted: u64,
    effective: u64,
}

/// execd's own capability sets, from `/proc/self/status` (all zero if it cannot be read).
fn own_capabilities() -> Held {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    Held {
        permitted: field("CapPrm:"),
        effective: field("CapEff:"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const PID1: Supervision = Supervision {
        init_mode: "pid1",
        signal_shield: true,
    };
    const SUBREAPER: Supervision = Supervision {
        init_mode: "subreaper",
        signal_shield: false,
    };

    fn status_of(out: &str, field: &str) -> String {
        out.lines()
            .find_map(|l| l.strip_prefix(field))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    }

    #[test]
    fn the_report_says_what_is_in_force() {
        let off = Hardening::resolve(None, None, PID1).expect("off");
        assert!(off.floor.is_none());
        assert_eq!(off.status.init_mode, "pid1");
        assert!(off.status.signal_shield);
        for layer in [
            &off.status.cap_drop,
            &off.status.seccomp,
            &off.status.landlock,
            &off.status.ebpf,
        ] {
            assert_eq!(layer.state, "disabled");
            assert!(layer.message.is_some());
        }
        let on = Hardening::resolve(Some(&FloorPolicy::default()), None, SUBREAPER).expect("on");
        assert!(on.floor.is_some());
        assert_eq!(on.status.seccomp.state, "active");
        assert!(!on.status.signal_shield);
        let empty = FloorPolicy {
            keep_capabilities: vec![],
            seccomp_deny: Some(vec![]),
        };
        let on = Hardening::resolve(Some(&empty), None, PID1).expect("on");
        assert_eq!(on.status.seccomp.state, "degraded");
    }

    #[test]
    fn bad_policies_refuse_to_start() {
        for deny in [vec!["execve"], vec!["no_such_call"]] {
            let p = FloorPolicy {
                keep_capabilities: vec![],
                seccomp_deny: Some(deny.iter().map(|s| s.to_string()).collect()),
            };
            assert!(
                Hardening::resolve(Some(&p), None, PID1).is_err(),
                "{deny:?}"
            );
        }
        let p = FloorPolicy {
            keep_capabilities: vec!["CAP_EVERYTHING".into()],
            seccomp_deny: None,
        };
        assert!(Hardening::resolve(Some(&p), None, PID1).is_err());
    }

    #[test]
    fn an_image_toml_turns_the_floor_on_and_only_tightens_the_servers() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("isolation.toml");
        let write = |text: &str| {
            let mut f = std::fs::File::create(&path).expect("create");
            f.write_all(text.as_bytes()).expect("write");
        };
        let path_str = path.to_str().expect("utf-8");
        write(
            "upper_root = \"/x\"\n[hardening]\nenabled = true\nkeep_capabilities = [\"CAP_NET_RAW\"]\n\
             [seccomp]\ndeny = [\"chmod\"]\n[landlock]\nenabled = true\n",
        );
        let h = Hardening::resolve(None, Some(path_str), PID1).expect("image floor");
        assert!(h.floor.is_some());
        assert_eq!(h.status.landlock.state, "unsupported");
        // Off in the file: no floor from it.
        write("[hardening]\nenabled = false\n");
        assert!(Hardening::resolve(None, Some(path_str), PID1)
            .expect("read")
            .floor
            .is_none());
        // A missing file is no policy; a broken one refuses.
        assert!(Hardening::resolve(None, Some("/nonexistent/x.toml"), PID1)
            .expect("missing")
            .floor
            .is_none());
        // With a server policy, the image's can only tighten it: CAP_NET_RAW is kept only if both
        // keep it, and its deny list adds to the server's.
        write("[hardening]\nenabled = true\nkeep_capabilities = [\"CAP_SYS_ADMIN\"]\n[seccomp]\ndeny = [\"chmod\"]\n");
        let server = FloorPolicy {
            keep_capabilities: vec!["CAP_NET_RAW".into()],
            seccomp_deny: Some(vec!["ptrace".into()]),
        };
        let both = Hardening::resolve(Some(&server), Some(path_str), PID1).expect("both");
        let floor = both.floor.expect("floor");
        assert_eq!(
            floor.keep, 0,
            "neither the server's nor the image's capability alone is kept"
        );
        let filter = floor.filter.as_ref().expect("filter");
        assert!(!filter.is_empty());
        // An image with the floor off leaves the server's as it is.
        write("[hardening]\nenabled = false\nkeep_capabilities = [\"CAP_SYS_ADMIN\"]\n");
        let kept = Hardening::resolve(Some(&server), Some(path_str), PID1).expect("server only");
        assert_eq!(
            kept.floor.expect("floor").keep & (1 << 13),
            own_capabilities().permitted & (1 << 13)
        );
        write("[hardening\n");
        assert!(Hardening::resolve(None, Some(path_str), PID1).is_err());
        write("[hardening]\nenabled = true\n[seccomp]\ndeny = [\"execve\"]\n");
        assert!(Hardening::resolve(None, Some(path_str), PID1).is_err());
    }

    /// A child under the floor: no capabilities left in any set, `no_new_privs`, a filter, and the
    /// refused calls refused. Needs root (or at least CAP_SETPCAP) to see the bounding set cut.
    #[test]
    fn a_child_under_the_floor_holds_nothing() {
        let policy = FloorPolicy {
            keep_capabilities: vec![],
            seccomp_deny: Some(vec!["chmod".into(), "fchmodat".into(), "fchmodat2".into()]),
        };
        let floor = Arc::new(Floor::new(&policy).expect("floor"));
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("f");
        std::fs::write(&file, "x").expect("write");
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(format!(
                "grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status; chmod 600 {} && echo CHMOD-OK; echo \"token=${{EXECD_ACCESS_TOKEN:-unset}}\"",
                file.display()
            ))
            .env("EXECD_ACCESS_TOKEN", "secret");
        floor.prepare(&mut cmd, Role::UserCode, None);
        let out = cmd.output().expect("run");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(status_of(&text, "CapEff:"), "0000000000000000", "{text}");
        assert_eq!(status_of(&text, "CapPrm:"), "0000000000000000", "{text}");
        assert_eq!(status_of(&text, "CapAmb:"), "0000000000000000", "{text}");
        assert_eq!(status_of(&text, "NoNewPrivs:"), "1", "{text}");
        assert_eq!(status_of(&text, "Seccomp:"), "2", "{text}");
        if floor.trim_bounding {
            assert_eq!(status_of(&text, "CapBnd:"), "0000000000000000", "{text}");
        }
        assert!(!text.contains("CHMOD-OK"), "{text}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"));
        assert!(text.contains("token=unset"), "{text}");
    }

    /// A kept capability survives `execve` (as an ambient one) and is all the child holds, even
    /// when it becomes another user. Needs root, as execd in a sandbox is.
    #[test]
    fn a_kept_capability_survives_exec_and_an_identity_change() {
        let policy = FloorPolicy {
            keep_capabilities: vec!["CAP_NET_RAW".into()],
            seccomp_deny: None,
        };
        let floor = Arc::new(Floor::new(&policy).expect("floor"));
        for identity in [
            None,
            Some(Identity {
                uid: 65534,
                gid: 65534,
            }),
        ] {
            let mut cmd = Command::new("/bin/sh");
            cmd.arg("-c").arg("grep -E '^(Cap|Uid)' /proc/self/status");
            floor.prepare(&mut cmd, Role::UserCode, identity);
            let out = cmd.output().expect("run");
            let text = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                status_of(&text, "CapEff:"),
                "0000000000002000",
                "{identity:?} {text}"
            );
            assert_eq!(
                status_of(&text, "CapAmb:"),
                "0000000000002000",
                "{identity:?} {text}"
            );
            if floor.trim_bounding {
                assert_eq!(status_of(&text, "CapBnd:"), "0000000000002000", "{text}");
            }
            if identity.is_some() {
                assert!(status_of(&text, "Uid:").starts_with("65534"), "{text}");
            }
        }
    }
}
