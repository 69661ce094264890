//! The privilege boundary applied as the last step before execd starts: capabilities cut to a set no
//! wider than Docker's default, `no_new_privs`, and a seccomp filter; and, since the embedded
//! runtime's PID 1 runs execd without an `execve`, what that exec would have cleaned up (inherited
//! descriptors) and hidden (its memory, behind `PR_SET_DUMPABLE`).
//!
//! Capabilities: Docker's default set minus `CAP_MKNOD`. Docker keeps MKNOD and relies on the devices
//! cgroup to stop its use; Warren has no devices controller on cgroup v2 without BPF, so it drops the
//! capability instead (a sandbox cannot create a node for a host disk). Root inside a sandbox can still
//! chown, bind low ports, change uid/gid and so run `apt-get install`.
//!
//! Seccomp: a deny list mirroring what Docker's default profile blocks for a container without
//! `CAP_SYS_ADMIN`: kernel modules, kexec, mount and namespace syscalls, keyrings, bpf, perf, clock
//! changes, handle-based opens, userfaultfd, new user namespaces through `clone`; `clone3` answers
//! ENOSYS so libc falls back to `clone`, where flags can be inspected. One BPF program, built by
//! `crate::seccomp` as a search tree (what each install costs grows with the program).

use std::collections::BTreeMap;
use std::os::fd::RawFd;

use crate::seccomp::{self, Verdict};
use caps::{CapSet, Capability, CapsHashSet};

pub const KEPT_CAPABILITIES: [Capability; 13] = [
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_NET_RAW,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// Syscalls that fail with EPERM inside a sandbox (names for OCI profiles, numbers for our BPF).
pub const DENIED_SYSCALLS: &[(&str, i64)] = &[
    ("acct", libc::SYS_acct),
    ("add_key", libc::SYS_add_key),
    ("bpf", libc::SYS_bpf),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("clock_settime", libc::SYS_clock_settime),
    ("delete_module", libc::SYS_delete_module),
    ("finit_module", libc::SYS_finit_module),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fsopen", libc::SYS_fsopen),
    ("fspick", libc::SYS_fspick),
    ("init_module", libc::SYS_init_module),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("ioperm", libc::SYS_ioperm),
    ("iopl", libc::SYS_iopl),
    ("kcmp", libc::SYS_kcmp),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("kexec_load", libc::SYS_kexec_load),
    ("keyctl", libc::SYS_keyctl),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ("mount", libc::SYS_mount),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("move_mount", libc::SYS_move_mount),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("nfsservctl", libc::SYS_nfsservctl),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("open_tree", libc::SYS_open_tree),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("pivot_root", libc::SYS_pivot_root),
    ("quotactl", libc::SYS_quotactl),
    ("reboot", libc::SYS_reboot),
    ("request_key", libc::SYS_request_key),
    ("setns", libc::SYS_setns),
    ("settimeofday", libc::SYS_settimeofday),
    ("swapoff", libc::SYS_swapoff),
    ("swapon", libc::SYS_swapon),
    ("syslog", libc::SYS_syslog),
    ("sysfs", libc::SYS_sysfs),
    ("_sysctl", libc::SYS__sysctl),
    ("umount2", libc::SYS_umount2),
    ("unshare", libc::SYS_unshare),
    ("uselib", libc::SYS_uselib),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("ustat", libc::SYS_ustat),
    ("vhangup", libc::SYS_vhangup),
];

#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("capabilities: {0}")]
    Caps(String),
    #[error("no_new_privs")]
    NoNewPrivs(#[source] nix::Error),
    #[error(transparent)]
    Seccomp(seccomp::FilterError),
    #[error("making the sandbox's PID 1 undumpable: {0}")]
    Prctl(std::io::Error),
}

/// Builds the sandbox's seccomp filter: the deny list → EPERM, `clone` with `CLONE_NEWUSER` → EPERM,
/// `clone3` → ENOSYS (libc then falls back to `clone`, whose flags a filter can read).
pub fn seccomp_filter() -> Result<seccomp::Program, SecurityError> {
    let mut verdicts: BTreeMap<u32, Verdict> = DENIED_SYSCALLS
        .iter()
        .map(|(_, nr)| (*nr as u32, Verdict::Errno(libc::EPERM as u16)))
        .collect();
    verdicts.insert(libc::SYS_clone as u32, Verdict::CloneUnlessNewUser);
    verdicts.insert(libc::SYS_clone3 as u32, Verdict::Errno(libc::ENOSYS as u16));
    seccomp::build(&verdicts).map_err(SecurityError::Seccomp)
}

/// Closes every descriptor above stderr but `keep`: what an `execve` with close-on-exec
/// descriptors would have done for the sandbox's PID 1, which runs execd without one.
pub fn close_descriptors_except(keep: &[RawFd]) -> std::io::Result<()> {
    let mut keep: Vec<u32> = keep
        .iter()
        .filter(|fd| **fd > 2)
        .map(|fd| *fd as u32)
        .collect();
    keep.sort_unstable();
    keep.dedup();
    let mut from: u32 = 3;
    for next in keep.into_iter().chain(std::iter::once(u32::MAX)) {
        if next > from {
            // SAFETY: close_range(2) on descriptor numbers; nothing in this process uses the
            // closed ones again (they are inherited from the zygote and the setup helper).
            if unsafe { libc::syscall(libc::SYS_close_range, from, next - 1, 0) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        from = next.saturating_add(1);
    }
    Ok(())
}

/// How the sandbox's PID 1 shows itself once it runs execd in the setup helper's forked process:
/// named `warren-execd`, with execd's command line (as much as fits) in /proc/1/cmdline instead of
/// the zygote's, and not dumpable — the sandbox's processes, without `CAP_SYS_PTRACE`, can then
/// neither read its memory or environment nor follow /proc/1/exe, which names the host's `warren`
/// binary.
pub fn present_as(argv: &[String]) -> Result<(), SecurityError> {
    // SAFETY: prctl(2) with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(SecurityError::Prctl(std::io::Error::last_os_error()));
    }
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"warren-execd".as_ptr(), 0, 0, 0) };
    rewrite_command_line(argv);
    Ok(())
}

/// Writes `argv` over this process's original argument area, which /proc/PID/cmdline shows
/// (PR_SET_MM would move it, but needs CAP_SYS_RESOURCE, which hosts do not always give root).
/// The area is the zygote's `<path of warren> __sandbox-zygote`: what does not fit is cut, and the
/// rest is NUL-filled. Cosmetic (`ps`): any failure leaves the old line.
fn rewrite_command_line(argv: &[String]) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // arg_start and arg_end are fields 48 and 49 (proc(5)).
    let Some(fields) = warren_core::stat_fields(&stat) else {
        return;
    };
    let field = |n| warren_core::stat_field::<usize>(&fields, n);
    let (Some(start), Some(end)) = (field(48), field(49)) else {
        return;
    };
    if start == 0 || end <= start {
        return;
    }
    let mut line: Vec<u8> = argv.iter().flat_map(|a| a.bytes().chain([0])).collect();
    line.resize(end - start, 0);
    if let Some(last) = line.last_mut() {
        *last = 0;
    }
    // SAFETY: [start, end) is this process's own argument area on its stack (the kernel's record of
    // it, just read), writable and no longer read by anything: execd gets its arguments as a
    // vector, not from the process's argv.
    unsafe { std::ptr::copy_nonoverlapping(line.as_ptr(), start as *mut u8, line.len()) };
}

/// Drops capabilities and sets `no_new_privs`; call after every mount is done.
pub fn restrict_privileges() -> Result<(), SecurityError> {
    let keep: CapsHashSet = KEPT_CAPABILITIES.into_iter().collect();
    let all = caps::all();
    for cap in all.difference(&keep) {
        // Capabilities newer than the running kernel are absent from its bounding set already.
        if caps::has_cap(None, CapSet::Bounding, *cap).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, *cap)
                .map_err(|e| SecurityError::Caps(e.to_string()))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|e| SecurityError::Caps(e.to_string()))?;
    caps::set(None, CapSet::Inheritable, &keep).map_err(|e| SecurityError::Caps(e.to_string()))?;
    caps::set(None, CapSet::Effective, &keep).map_err(|e| SecurityError::Caps(e.to_string()))?;
    caps::set(None, CapSet::Permitted, &keep).map_err(|e| SecurityError::Caps(e.to_string()))?;
    nix::sys::prctl::set_no_new_privs().map_err(SecurityError::NoNewPrivs)?;
    Ok(())
}

/// Installs the precompiled filter; the last step of the privilege boundary.
pub fn install_seccomp(program: &seccomp::Program) -> Result<(), SecurityError> {
    seccomp::install(program).map_err(SecurityError::Seccomp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_policy_as_the_other_runtimes() {
        let names: Vec<&str> = DENIED_SYSCALLS.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, warren_core::policy::DENIED_SYSCALLS);
        let caps: Vec<String> = KEPT_CAPABILITIES.iter().map(|c| c.to_string()).collect();
        assert_eq!(caps, warren_core::policy::KEPT_CAPABILITIES);
    }

    #[test]
    fn seccomp_filter_builds() {
        let prog = seccomp_filter().expect("build");
        // Two instructions or so per denied number: a tree, not a chain of rules.
        assert!(
            prog.len() < 2 * DENIED_SYSCALLS.len() + 32,
            "{}",
            prog.len()
        );
    }

    #[test]
    fn kept_set_is_within_docker_default() {
        assert!(!KEPT_CAPABILITIES.contains(&Capability::CAP_SYS_ADMIN));
        assert!(!KEPT_CAPABILITIES.contains(&Capability::CAP_MKNOD));
        assert!(!KEPT_CAPABILITIES.contains(&Capability::CAP_NET_ADMIN));
        assert!(!KEPT_CAPABILITIES.contains(&Capability::CAP_SYS_PTRACE));
    }
}
