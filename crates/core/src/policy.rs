//! Security policy shared by every runtime: the capabilities a sandbox keeps and the syscalls it is
//! denied, so a sandbox is confined the same way whether Warren's own code, an OCI runtime or a
//! Docker daemon starts it.

use serde_json::{json, Value};

/// Docker's default capability set minus `CAP_MKNOD`.
pub const KEPT_CAPABILITIES: [&str; 13] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// Syscalls that fail with EPERM inside a sandbox: what Docker's default profile denies (mounts,
/// namespaces, modules, kexec, bpf, perf, keyrings, clocks, swap, …).
pub const DENIED_SYSCALLS: &[&str] = &[
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "init_module",
    // io_uring: a large kernel surface behind a few syscalls, and the source of many of its
    // privilege escalations; Docker's default profile dropped it in 25.0, Google's fleet and
    // ChromeOS turn it off. Programs that use it fall back to ordinary syscalls.
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "syslog",
    "sysfs",
    "_sysctl",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "ustat",
    "vhangup",
];

const EPERM: i32 = 1;
const ENOSYS: i32 = 38;
const CLONE_NEWUSER: u64 = 0x1000_0000;

/// The deny list as an OCI (and Docker) seccomp profile. gVisor applies a profile inside its Sentry
/// (`--oci-seccomp`) but mis-evaluates the argument-matching `clone` rule (every thread creation then
/// fails), and user namespaces inside gVisor live in the Sentry rather than the host kernel, so for
/// gVisor the plain list is used.
pub fn oci_seccomp(gvisor: bool) -> Value {
    let mut syscalls =
        vec![json!({"names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM})];
    if !gvisor {
        syscalls.push(json!({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS}));
        syscalls.push(json!({"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
            "args": [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]}));
    }
    json!({"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"], "syscalls": syscalls})
}
