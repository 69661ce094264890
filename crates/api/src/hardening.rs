//! The floor execd lays under user code when an operator turns hardening on (the reference's
//! OSEP-0018, "execd as sandbox init"): what is asked for ([`FloorPolicy`], from the server's
//! config or an image's isolation TOML) and what is in force ([`HardeningStatus`], reported in
//! `GET /v1/isolated/capabilities` under `hardening`).
//!
//! Under the floor every process execd starts for user code (the entrypoint, commands, sessions,
//! terminals, kernels) gets, between fork and exec: execd's own settings out of its environment, the
//! capability bounding set cut to the kept capabilities, `no_new_privs`, exactly the kept
//! capabilities (raised as ambient ones, so they survive `execve`), and a seccomp deny list on top
//! of the sandbox's own filter.

use serde::{Deserialize, Serialize};

/// The calls the floor refuses when no list is given: the reference's built-in list (mounts,
/// tracing and memory access across processes, kernel modules, BPF, keys, namespaces, handles,
/// reboots and swaps).
pub const DEFAULT_SECCOMP_DENY: &[&str] = &[
    "mount",
    "umount2",
    "chroot",
    "pivot_root",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "seccomp",
    "personality",
    "add_key",
    "request_key",
    "keyctl",
    "iopl",
    "ioperm",
    "reboot",
    "syslog",
    "swapon",
    "swapoff",
    "setns",
    "unshare",
    "name_to_handle_at",
    "open_by_handle_at",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "acct",
];

/// The call that ends every launch under the floor, after the filter is in place: a deny list
/// that names it would refuse every launch, so it is refused as configuration instead
/// (`execveat`, which the launch does not use, may be listed).
pub const RESERVED_SYSCALL: &str = "execve";

/// Linux capability names in number order (`CAP_CHOWN` is 0).
pub const CAPABILITY_NAMES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

/// The number of the capability called `name` (`CAP_NET_RAW`, or `NET_RAW` as Docker writes it).
pub fn capability_number(name: &str) -> Option<u8> {
    let upper = name.to_ascii_uppercase();
    let full = if upper.starts_with("CAP_") {
        upper
    } else {
        format!("CAP_{upper}")
    };
    CAPABILITY_NAMES
        .iter()
        .position(|c| *c == full)
        .and_then(|i| u8::try_from(i).ok())
}

/// What the floor keeps and refuses. The default keeps no capability and refuses
/// [`DEFAULT_SECCOMP_DENY`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FloorPolicy {
    /// Capabilities user code keeps (names as in `capabilities(7)`); every other one leaves its
    /// bounding set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keep_capabilities: Vec<String>,
    /// Calls user code is refused (EACCES), replacing the default list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seccomp_deny: Option<Vec<String>>,
}

impl FloorPolicy {
    /// The deny list in force: the one given, else the default.
    pub fn deny_list(&self) -> Vec<String> {
        match &self.seccomp_deny {
            Some(list) => list.clone(),
            None => DEFAULT_SECCOMP_DENY.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// What can be checked without a syscall table: capability names, and that the call every
    /// launch ends with is not refused. (Whether each refused call exists is the seccomp crate's.)
    pub fn check(&self) -> Result<(), String> {
        self.keep_mask()?;
        if self.deny_list().iter().any(|n| n == RESERVED_SYSCALL) {
            return Err(format!(
                "seccomp_deny lists {RESERVED_SYSCALL}, the call that starts every program under the \
                 floor; list execveat instead to refuse that one"
            ));
        }
        Ok(())
    }

    /// The kept capabilities as a mask (bit n: capability n), or the first name that is none.
    pub fn keep_mask(&self) -> Result<u64, String> {
        self.keep_capabilities.iter().try_fold(0u64, |mask, name| {
            capability_number(name)
                .map(|n| mask | 1 << n)
                .ok_or_else(|| format!("keep_capabilities: {name:?} is not a Linux capability"))
        })
    }

    /// This policy made no wider by `other`: the capabilities both keep, the calls either refuses.
    pub fn tightened_by(&self, other: &FloorPolicy) -> FloorPolicy {
        let keep = self
            .keep_capabilities
            .iter()
            .filter(|c| {
                other
                    .keep_capabilities
                    .iter()
                    .any(|o| capability_number(o) == capability_number(c))
            })
            .cloned()
            .collect();
        let mut deny = self.deny_list();
        for name in other.deny_list() {
            if !deny.contains(&name) {
                deny.push(name);
            }
        }
        FloorPolicy {
            keep_capabilities: keep,
            seccomp_deny: Some(deny),
        }
    }
}

/// `hardening` in `GET /v1/isolated/capabilities`: how execd supervises the sandbox and which
/// layers of the floor are in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HardeningStatus {
    /// `pid1` (execd is the PID namespace's init), `subreaper` (it reaps the orphans of its own
    /// children only), or `none`.
    pub init_mode: String,
    /// Whether the kernel's PID 1 shield keeps the sandbox's processes from killing execd.
    pub signal_shield: bool,
    pub cap_drop: LayerState,
    pub seccomp: LayerState,
    pub landlock: LayerState,
    pub ebpf: LayerState,
}

/// One layer: `active`, `disabled` (not asked for), `degraded` (asked for, but something it needs
/// is missing) or `unsupported`; `message` says why whenever it is not `active`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerState {
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl LayerState {
    pub fn active(message: Option<String>) -> Self {
        Self {
            state: "active".into(),
            message,
        }
    }

    pub fn with(state: &str, message: impl Into<String>) -> Self {
        Self {
            state: state.into(),
            message: Some(message.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_names_in_both_spellings() {
        assert_eq!(capability_number("CAP_CHOWN"), Some(0));
        assert_eq!(capability_number("CAP_NET_RAW"), Some(13));
        assert_eq!(capability_number("NET_RAW"), Some(13));
        assert_eq!(capability_number("cap_sys_admin"), Some(21));
        assert_eq!(capability_number("CAP_CHECKPOINT_RESTORE"), Some(40));
        assert_eq!(capability_number("CAP_NOPE"), None);
        let p = FloorPolicy {
            keep_capabilities: vec!["CAP_NET_RAW".into(), "CHOWN".into()],
            seccomp_deny: None,
        };
        assert_eq!(p.keep_mask(), Ok(0x2001));
        let bad = FloorPolicy {
            keep_capabilities: vec!["CAP_ROOT".into()],
            seccomp_deny: None,
        };
        assert!(bad
            .keep_mask()
            .expect_err("not a capability")
            .contains("CAP_ROOT"));
        assert!(bad.check().is_err());
        let execve = FloorPolicy {
            keep_capabilities: vec![],
            seccomp_deny: Some(vec!["chmod".into(), "execve".into()]),
        };
        assert!(execve
            .check()
            .expect_err("execve refused")
            .contains("execveat"));
        let execveat = FloorPolicy {
            keep_capabilities: vec![],
            seccomp_deny: Some(vec!["execveat".into()]),
        };
        assert_eq!(execveat.check(), Ok(()));
        assert_eq!(FloorPolicy::default().check(), Ok(()));
    }

    #[test]
    fn tightening_keeps_fewer_capabilities_and_refuses_more_calls() {
        let operator = FloorPolicy {
            keep_capabilities: vec!["CAP_NET_RAW".into(), "CAP_CHOWN".into()],
            seccomp_deny: None,
        };
        let image = FloorPolicy {
            keep_capabilities: vec!["NET_RAW".into(), "CAP_SYS_ADMIN".into()],
            seccomp_deny: Some(vec!["chmod".into()]),
        };
        let both = operator.tightened_by(&image);
        assert_eq!(both.keep_capabilities, vec!["CAP_NET_RAW".to_string()]);
        let deny = both.deny_list();
        assert!(deny.contains(&"chmod".to_string()));
        assert!(deny.contains(&"ptrace".to_string()));
        assert_eq!(deny.len(), DEFAULT_SECCOMP_DENY.len() + 1);
    }
}
