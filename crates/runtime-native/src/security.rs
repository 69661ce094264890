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
//! Seccomp: the allow list of `warren_core::policy` (Docker's default profile for a container
//! with these capabilities, with its argument rules, a little tighter), one BPF program built by
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

// x86-64 numbers of calls newer than the `libc` crate's table (arch/x86/entry/syscalls/syscall_64.tbl).
const SYS_IO_PGETEVENTS: i64 = 333;
const SYS_CACHESTAT: i64 = 451;
const SYS_MAP_SHADOW_STACK: i64 = 453;
const SYS_FUTEX_WAKE: i64 = 454;
const SYS_FUTEX_WAIT: i64 = 455;
const SYS_FUTEX_REQUEUE: i64 = 456;

/// [`warren_core::policy::ALLOWED_SYSCALLS`] with their numbers, in the same order.
pub const ALLOWED_SYSCALLS: &[(&str, i64)] = &[
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("access", libc::SYS_access),
    ("adjtimex", libc::SYS_adjtimex),
    ("alarm", libc::SYS_alarm),
    ("arch_prctl", libc::SYS_arch_prctl),
    ("bind", libc::SYS_bind),
    ("brk", libc::SYS_brk),
    ("cachestat", SYS_CACHESTAT),
    ("capget", libc::SYS_capget),
    ("capset", libc::SYS_capset),
    ("chdir", libc::SYS_chdir),
    ("chmod", libc::SYS_chmod),
    ("chown", libc::SYS_chown),
    ("chroot", libc::SYS_chroot),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("clock_getres", libc::SYS_clock_getres),
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("close", libc::SYS_close),
    ("close_range", libc::SYS_close_range),
    ("connect", libc::SYS_connect),
    ("copy_file_range", libc::SYS_copy_file_range),
    ("creat", libc::SYS_creat),
    ("dup", libc::SYS_dup),
    ("dup2", libc::SYS_dup2),
    ("dup3", libc::SYS_dup3),
    ("epoll_create", libc::SYS_epoll_create),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    ("epoll_ctl_old", libc::SYS_epoll_ctl_old),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    ("epoll_wait", libc::SYS_epoll_wait),
    ("epoll_wait_old", libc::SYS_epoll_wait_old),
    ("eventfd", libc::SYS_eventfd),
    ("eventfd2", libc::SYS_eventfd2),
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("faccessat", libc::SYS_faccessat),
    ("faccessat2", libc::SYS_faccessat2),
    ("fadvise64", libc::SYS_fadvise64),
    ("fallocate", libc::SYS_fallocate),
    ("fanotify_mark", libc::SYS_fanotify_mark),
    ("fchdir", libc::SYS_fchdir),
    ("fchmod", libc::SYS_fchmod),
    ("fchmodat", libc::SYS_fchmodat),
    ("fchmodat2", libc::SYS_fchmodat2),
    ("fchown", libc::SYS_fchown),
    ("fchownat", libc::SYS_fchownat),
    ("fcntl", libc::SYS_fcntl),
    ("fdatasync", libc::SYS_fdatasync),
    ("fgetxattr", libc::SYS_fgetxattr),
    ("flistxattr", libc::SYS_flistxattr),
    ("flock", libc::SYS_flock),
    ("fork", libc::SYS_fork),
    ("fremovexattr", libc::SYS_fremovexattr),
    ("fsetxattr", libc::SYS_fsetxattr),
    ("fstat", libc::SYS_fstat),
    ("fstatfs", libc::SYS_fstatfs),
    ("fsync", libc::SYS_fsync),
    ("ftruncate", libc::SYS_ftruncate),
    ("futex", libc::SYS_futex),
    ("futex_requeue", SYS_FUTEX_REQUEUE),
    ("futex_wait", SYS_FUTEX_WAIT),
    ("futex_waitv", libc::SYS_futex_waitv),
    ("futex_wake", SYS_FUTEX_WAKE),
    ("futimesat", libc::SYS_futimesat),
    ("getcpu", libc::SYS_getcpu),
    ("getcwd", libc::SYS_getcwd),
    ("getdents", libc::SYS_getdents),
    ("getdents64", libc::SYS_getdents64),
    ("getegid", libc::SYS_getegid),
    ("geteuid", libc::SYS_geteuid),
    ("getgid", libc::SYS_getgid),
    ("getgroups", libc::SYS_getgroups),
    ("getitimer", libc::SYS_getitimer),
    ("getpeername", libc::SYS_getpeername),
    ("getpgid", libc::SYS_getpgid),
    ("getpgrp", libc::SYS_getpgrp),
    ("getpid", libc::SYS_getpid),
    ("getppid", libc::SYS_getppid),
    ("getpriority", libc::SYS_getpriority),
    ("getrandom", libc::SYS_getrandom),
    ("getresgid", libc::SYS_getresgid),
    ("getresuid", libc::SYS_getresuid),
    ("getrlimit", libc::SYS_getrlimit),
    ("get_robust_list", libc::SYS_get_robust_list),
    ("getrusage", libc::SYS_getrusage),
    ("getsid", libc::SYS_getsid),
    ("getsockname", libc::SYS_getsockname),
    ("getsockopt", libc::SYS_getsockopt),
    ("get_thread_area", libc::SYS_get_thread_area),
    ("gettid", libc::SYS_gettid),
    ("gettimeofday", libc::SYS_gettimeofday),
    ("getuid", libc::SYS_getuid),
    ("getxattr", libc::SYS_getxattr),
    ("inotify_add_watch", libc::SYS_inotify_add_watch),
    ("inotify_init", libc::SYS_inotify_init),
    ("inotify_init1", libc::SYS_inotify_init1),
    ("inotify_rm_watch", libc::SYS_inotify_rm_watch),
    ("io_cancel", libc::SYS_io_cancel),
    ("ioctl", libc::SYS_ioctl),
    ("io_destroy", libc::SYS_io_destroy),
    ("io_getevents", libc::SYS_io_getevents),
    ("io_pgetevents", SYS_IO_PGETEVENTS),
    ("ioprio_get", libc::SYS_ioprio_get),
    ("ioprio_set", libc::SYS_ioprio_set),
    ("io_setup", libc::SYS_io_setup),
    ("io_submit", libc::SYS_io_submit),
    ("kill", libc::SYS_kill),
    ("landlock_add_rule", libc::SYS_landlock_add_rule),
    ("landlock_create_ruleset", libc::SYS_landlock_create_ruleset),
    ("landlock_restrict_self", libc::SYS_landlock_restrict_self),
    ("lchown", libc::SYS_lchown),
    ("lgetxattr", libc::SYS_lgetxattr),
    ("link", libc::SYS_link),
    ("linkat", libc::SYS_linkat),
    ("listen", libc::SYS_listen),
    ("listxattr", libc::SYS_listxattr),
    ("llistxattr", libc::SYS_llistxattr),
    ("lremovexattr", libc::SYS_lremovexattr),
    ("lseek", libc::SYS_lseek),
    ("lsetxattr", libc::SYS_lsetxattr),
    ("lstat", libc::SYS_lstat),
    ("madvise", libc::SYS_madvise),
    ("map_shadow_stack", SYS_MAP_SHADOW_STACK),
    ("membarrier", libc::SYS_membarrier),
    ("memfd_create", libc::SYS_memfd_create),
    ("mincore", libc::SYS_mincore),
    ("mkdir", libc::SYS_mkdir),
    ("mkdirat", libc::SYS_mkdirat),
    ("mknod", libc::SYS_mknod),
    ("mknodat", libc::SYS_mknodat),
    ("mlock", libc::SYS_mlock),
    ("mlock2", libc::SYS_mlock2),
    ("mlockall", libc::SYS_mlockall),
    ("mmap", libc::SYS_mmap),
    ("modify_ldt", libc::SYS_modify_ldt),
    ("mprotect", libc::SYS_mprotect),
    ("mq_getsetattr", libc::SYS_mq_getsetattr),
    ("mq_notify", libc::SYS_mq_notify),
    ("mq_open", libc::SYS_mq_open),
    ("mq_timedreceive", libc::SYS_mq_timedreceive),
    ("mq_timedsend", libc::SYS_mq_timedsend),
    ("mq_unlink", libc::SYS_mq_unlink),
    ("mremap", libc::SYS_mremap),
    ("mseal", libc::SYS_mseal),
    ("msgctl", libc::SYS_msgctl),
    ("msgget", libc::SYS_msgget),
    ("msgrcv", libc::SYS_msgrcv),
    ("msgsnd", libc::SYS_msgsnd),
    ("msync", libc::SYS_msync),
    ("munlock", libc::SYS_munlock),
    ("munlockall", libc::SYS_munlockall),
    ("munmap", libc::SYS_munmap),
    ("nanosleep", libc::SYS_nanosleep),
    ("newfstatat", libc::SYS_newfstatat),
    ("open", libc::SYS_open),
    ("openat", libc::SYS_openat),
    ("openat2", libc::SYS_openat2),
    ("pause", libc::SYS_pause),
    ("pidfd_open", libc::SYS_pidfd_open),
    ("pidfd_send_signal", libc::SYS_pidfd_send_signal),
    ("pipe", libc::SYS_pipe),
    ("pipe2", libc::SYS_pipe2),
    ("pkey_alloc", libc::SYS_pkey_alloc),
    ("pkey_free", libc::SYS_pkey_free),
    ("pkey_mprotect", libc::SYS_pkey_mprotect),
    ("poll", libc::SYS_poll),
    ("ppoll", libc::SYS_ppoll),
    ("prctl", libc::SYS_prctl),
    ("pread64", libc::SYS_pread64),
    ("preadv", libc::SYS_preadv),
    ("preadv2", libc::SYS_preadv2),
    ("prlimit64", libc::SYS_prlimit64),
    ("process_mrelease", libc::SYS_process_mrelease),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("pselect6", libc::SYS_pselect6),
    ("ptrace", libc::SYS_ptrace),
    ("pwrite64", libc::SYS_pwrite64),
    ("pwritev", libc::SYS_pwritev),
    ("pwritev2", libc::SYS_pwritev2),
    ("read", libc::SYS_read),
    ("readahead", libc::SYS_readahead),
    ("readlink", libc::SYS_readlink),
    ("readlinkat", libc::SYS_readlinkat),
    ("readv", libc::SYS_readv),
    ("recvfrom", libc::SYS_recvfrom),
    ("recvmmsg", libc::SYS_recvmmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("remap_file_pages", libc::SYS_remap_file_pages),
    ("removexattr", libc::SYS_removexattr),
    ("rename", libc::SYS_rename),
    ("renameat", libc::SYS_renameat),
    ("renameat2", libc::SYS_renameat2),
    ("restart_syscall", libc::SYS_restart_syscall),
    ("rmdir", libc::SYS_rmdir),
    ("rseq", libc::SYS_rseq),
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigpending", libc::SYS_rt_sigpending),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigqueueinfo", libc::SYS_rt_sigqueueinfo),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("rt_sigsuspend", libc::SYS_rt_sigsuspend),
    ("rt_sigtimedwait", libc::SYS_rt_sigtimedwait),
    ("rt_tgsigqueueinfo", libc::SYS_rt_tgsigqueueinfo),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("sched_getattr", libc::SYS_sched_getattr),
    ("sched_getparam", libc::SYS_sched_getparam),
    ("sched_get_priority_max", libc::SYS_sched_get_priority_max),
    ("sched_get_priority_min", libc::SYS_sched_get_priority_min),
    ("sched_getscheduler", libc::SYS_sched_getscheduler),
    ("sched_rr_get_interval", libc::SYS_sched_rr_get_interval),
    ("sched_setaffinity", libc::SYS_sched_setaffinity),
    ("sched_setattr", libc::SYS_sched_setattr),
    ("sched_setparam", libc::SYS_sched_setparam),
    ("sched_setscheduler", libc::SYS_sched_setscheduler),
    ("sched_yield", libc::SYS_sched_yield),
    ("seccomp", libc::SYS_seccomp),
    ("select", libc::SYS_select),
    ("semctl", libc::SYS_semctl),
    ("semget", libc::SYS_semget),
    ("semop", libc::SYS_semop),
    ("semtimedop", libc::SYS_semtimedop),
    ("sendfile", libc::SYS_sendfile),
    ("sendmmsg", libc::SYS_sendmmsg),
    ("sendmsg", libc::SYS_sendmsg),
    ("sendto", libc::SYS_sendto),
    ("setfsgid", libc::SYS_setfsgid),
    ("setfsuid", libc::SYS_setfsuid),
    ("setgid", libc::SYS_setgid),
    ("setgroups", libc::SYS_setgroups),
    ("setitimer", libc::SYS_setitimer),
    ("setpgid", libc::SYS_setpgid),
    ("setpriority", libc::SYS_setpriority),
    ("setregid", libc::SYS_setregid),
    ("setresgid", libc::SYS_setresgid),
    ("setresuid", libc::SYS_setresuid),
    ("setreuid", libc::SYS_setreuid),
    ("setrlimit", libc::SYS_setrlimit),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("setsid", libc::SYS_setsid),
    ("setsockopt", libc::SYS_setsockopt),
    ("set_thread_area", libc::SYS_set_thread_area),
    ("set_tid_address", libc::SYS_set_tid_address),
    ("setuid", libc::SYS_setuid),
    ("setxattr", libc::SYS_setxattr),
    ("shmat", libc::SYS_shmat),
    ("shmctl", libc::SYS_shmctl),
    ("shmdt", libc::SYS_shmdt),
    ("shmget", libc::SYS_shmget),
    ("shutdown", libc::SYS_shutdown),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("signalfd", libc::SYS_signalfd),
    ("signalfd4", libc::SYS_signalfd4),
    ("socketpair", libc::SYS_socketpair),
    ("splice", libc::SYS_splice),
    ("stat", libc::SYS_stat),
    ("statfs", libc::SYS_statfs),
    ("statx", libc::SYS_statx),
    ("symlink", libc::SYS_symlink),
    ("symlinkat", libc::SYS_symlinkat),
    ("sync", libc::SYS_sync),
    ("sync_file_range", libc::SYS_sync_file_range),
    ("syncfs", libc::SYS_syncfs),
    ("sysinfo", libc::SYS_sysinfo),
    ("tee", libc::SYS_tee),
    ("tgkill", libc::SYS_tgkill),
    ("time", libc::SYS_time),
    ("timer_create", libc::SYS_timer_create),
    ("timer_delete", libc::SYS_timer_delete),
    ("timer_getoverrun", libc::SYS_timer_getoverrun),
    ("timer_gettime", libc::SYS_timer_gettime),
    ("timer_settime", libc::SYS_timer_settime),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_gettime", libc::SYS_timerfd_gettime),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("times", libc::SYS_times),
    ("tkill", libc::SYS_tkill),
    ("truncate", libc::SYS_truncate),
    ("umask", libc::SYS_umask),
    ("uname", libc::SYS_uname),
    ("unlink", libc::SYS_unlink),
    ("unlinkat", libc::SYS_unlinkat),
    ("utime", libc::SYS_utime),
    ("utimensat", libc::SYS_utimensat),
    ("utimes", libc::SYS_utimes),
    ("vfork", libc::SYS_vfork),
    ("vmsplice", libc::SYS_vmsplice),
    ("wait4", libc::SYS_wait4),
    ("waitid", libc::SYS_waitid),
    ("write", libc::SYS_write),
    ("writev", libc::SYS_writev),
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

/// Builds the sandbox's seccomp filter from [`warren_core::policy`]: the allow list, the argument
/// rules of `clone`, `personality` and `socket`, `clone3` → ENOSYS (libc then falls back to
/// `clone`, whose flags a filter can read), anything else up to the newest listed call → EPERM,
/// newer calls → ENOSYS.
pub fn seccomp_filter() -> Result<seccomp::Program, SecurityError> {
    filter_with(&[])
}

/// The calls the isolation helper makes besides the sandbox's (`crate::isolation`): namespaces
/// and mounts, for the sessions it makes (`clone` with namespace flags, `unshare` of a user
/// namespace included).
const ISOLATION_HELPER_SYSCALLS: &[i64] = &[
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_mount_setattr,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
];

/// The isolation helper's filter: the sandbox's, plus [`ISOLATION_HELPER_SYSCALLS`] and `clone`
/// with any flags. Each session's processes stack the sandbox's own filter on it.
pub fn isolation_helper_filter() -> Result<seccomp::Program, SecurityError> {
    filter_with(ISOLATION_HELPER_SYSCALLS)
}

fn filter_with(extra: &[i64]) -> Result<seccomp::Program, SecurityError> {
    use warren_core::policy::{ALLOWED_PERSONAS, CLONE_NAMESPACE_FLAGS, DENIED_SOCKET_FAMILY};
    let mut verdicts: BTreeMap<u32, Verdict> = ALLOWED_SYSCALLS
        .iter()
        .map(|(_, nr)| (*nr as u32, Verdict::Allow))
        .collect();
    verdicts.insert(
        libc::SYS_clone as u32,
        if extra.is_empty() {
            Verdict::AllowUnlessFlags(CLONE_NAMESPACE_FLAGS)
        } else {
            Verdict::Allow
        },
    );
    for nr in extra {
        verdicts.insert(*nr as u32, Verdict::Allow);
    }
    verdicts.insert(libc::SYS_clone3 as u32, Verdict::Errno(libc::ENOSYS as u16));
    verdicts.insert(
        libc::SYS_personality as u32,
        Verdict::AllowIfArgIn(&ALLOWED_PERSONAS),
    );
    verdicts.insert(
        libc::SYS_socket as u32,
        Verdict::AllowUnlessArg(DENIED_SOCKET_FAMILY),
    );
    seccomp::build(&verdicts, Verdict::Errno(libc::EPERM as u16)).map_err(SecurityError::Seccomp)
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
/// named `execd` (as the reference's PID 1 is), with execd's command line (as much as fits) in /proc/1/cmdline instead of
/// the zygote's, and not dumpable — the sandbox's processes, without `CAP_SYS_PTRACE`, can then
/// neither read its memory or environment nor follow /proc/1/exe, which names the host's `warren`
/// binary.
pub fn present_as(argv: &[String]) -> Result<(), SecurityError> {
    // SAFETY: prctl(2) with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(SecurityError::Prctl(std::io::Error::last_os_error()));
    }
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"execd".as_ptr(), 0, 0, 0) };
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

/// Drops capabilities and, with `no_new_privs`, sets it; call after every mount is done.
///
/// In a user namespace of its own a sandbox goes without `no_new_privs`: a setuid program then
/// works as it does in a container (`sudo`, `su`, `ping`), and what it can reach is the sandbox's
/// root — ids of its own range and the kept capabilities, bounded by the set dropped here.
pub fn restrict_privileges(no_new_privs: bool) -> Result<(), SecurityError> {
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
    if no_new_privs {
        nix::sys::prctl::set_no_new_privs().map_err(SecurityError::NoNewPrivs)?;
    }
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
        let names: Vec<&str> = ALLOWED_SYSCALLS.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, warren_core::policy::ALLOWED_SYSCALLS);
        let caps: Vec<String> = KEPT_CAPABILITIES.iter().map(|c| c.to_string()).collect();
        assert_eq!(caps, warren_core::policy::KEPT_CAPABILITIES);
    }

    #[test]
    fn seccomp_filter_builds_small() {
        let prog = seccomp_filter().expect("build");
        // A tree over runs of the number line, not a rule per call.
        assert!(prog.len() < ALLOWED_SYSCALLS.len(), "{}", prog.len());
    }

    #[test]
    fn what_docker_denies_a_container_without_privileges_is_not_listed() {
        for denied in [
            "mount",
            "umount2",
            "unshare",
            "setns",
            "pivot_root",
            "keyctl",
            "add_key",
            "request_key",
            "bpf",
            "perf_event_open",
            "userfaultfd",
            "kcmp",
            "pidfd_getfd",
            "process_madvise",
            "get_mempolicy",
            "set_mempolicy",
            "mbind",
            "migrate_pages",
            "move_pages",
            "memfd_secret",
            "io_uring_setup",
            "open_by_handle_at",
            "name_to_handle_at",
            "init_module",
            "kexec_load",
            "reboot",
            "swapon",
            "syslog",
            "acct",
            "settimeofday",
            "clock_settime",
            "sethostname",
            "setdomainname",
            "fanotify_init",
            "iopl",
            "ioperm",
            "vhangup",
            "lookup_dcookie",
            "quotactl",
            "personality",
            "socket",
            "clone",
            "clone3",
        ] {
            assert!(
                !ALLOWED_SYSCALLS.iter().any(|(n, _)| *n == denied),
                "{denied} is allowed without conditions"
            );
        }
    }

    #[test]
    fn kept_set_is_within_docker_default() {
        assert!(!KEPT_CAPABILITIES.contains(&Capability::CAP_SYS_ADMIN));
        assert!(!KEPT_CAPABILITIES.contains(&Capability::CAP_MKNOD));
        assert!(!KEPT_CAPABILITIES.contains(&Capability::CAP_NET_ADMIN));
        assert!(!KEPT_CAPABILITIES.contains(&Capability::CAP_SYS_PTRACE));
    }
}
