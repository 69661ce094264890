//! Warren's domain: what a sandbox is asked to be (`SandboxSpec`), the limits it runs under, and the
//! `Runtime` trait that every backend (native, docker, …) implements. The server drives runtimes only
//! through this trait and maps `RuntimeError` kinds, never backend strings, onto API errors.

pub mod beneath;
pub mod egress;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub mod fd_limit;
pub mod image;
pub mod mount_api;
pub mod policy;
pub mod quantity;
pub mod runtime;
pub mod shared;

pub use quantity::{
    parse_cpu_millis, parse_disk_bytes, parse_memory_bytes, parse_size_bytes, QuantityError,
};

/// An error and its causes on one line, `a: b: c`, leaving out a cause whose text the line already
/// holds (wrappers that quote their source). `Display` alone drops the causes, and with them the
/// errno a person needs.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(cause) = cur {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cur = cause.source();
    }
    out
}
pub use egress::{AddressPolicy, EgressPolicy, Net};
pub use runtime::{
    Background, EgressEnforcer, ExecdAddress, ExecdTransport, ExitInfo, HostVolumes, ImageSource,
    Liveness, NetworkLinks, ResourceLimits, Runtime, RuntimeCapabilities, RuntimeError, RuntimeExt,
    RuntimeFeatures, RuntimeState, SandboxImage, SandboxSpec, VolumeMount, VolumeSource,
    WritableLayers,
};
pub use shared::{RecordEvent, SharedPhase, SharedRecords};

/// Inside every sandbox, whatever the runtime: where execd is mounted (read-only) and the folder its
/// socket appears in (bind-mounted from a per-sandbox host folder the server connects through) on
/// the runtimes that cannot hand execd a listening socket bound outside (gVisor, Docker); the
/// embedded runtime and runc bind it outside with [`bind_socket_in`] and mount no such folder.
pub const EXECD_IN_SANDBOX: &str = warren_api::EXECD_IN_SANDBOX;
pub const SOCKET_DIR_IN_SANDBOX: &str = "/.warren/run";
pub const EXECD_SOCKET_NAME: &str = "execd.sock";

/// Validated sandbox id: lowercase hex/uuid-ish, safe as a path component and a cgroup name.
pub fn is_valid_sandbox_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// Where to connect to reach the Unix socket at `path`: `/proc/self/fd/N` of an `O_PATH` handle on
/// the socket itself, and that handle, which must stay open until the connect is done.
///
/// A symbolic link at `path` is not followed, and what is there must be a socket. A sandbox can
/// write in the folder its execd socket appears in (it is bind-mounted in, so that execd can create
/// the socket), so it could put a symlink to any host socket — Docker's, say — in the socket's
/// place; connecting through it would forward the sandbox's own requests there. The folders above
/// the socket are the server's. The returned path is short whatever `path`'s length (a Unix socket
/// address holds 108 bytes, and a sandbox's socket lives deep in the data dir).
pub fn socket_connect_path(
    path: &std::path::Path,
) -> std::io::Result<(std::fs::File, std::path::PathBuf)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
        .open(path)?;
    if !handle.metadata()?.file_type().is_socket() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a socket", path.display()),
        ));
    }
    let short = std::path::PathBuf::from(format!("/proc/self/fd/{}", handle.as_raw_fd()));
    Ok((handle, short))
}

/// A Unix socket listening at `dir/name` (a stale socket there is replaced), bound through a short
/// path whatever `dir`'s length. Made outside the sandbox and handed to execd as a descriptor, it
/// needs no folder the sandbox can write in: such a folder was a host folder outside every limit
/// of the sandbox's storage.
pub fn bind_socket_in(
    dir: &std::path::Path,
    name: &str,
) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    let short = std::path::PathBuf::from(format!("/proc/self/fd/{}/{name}", handle.as_raw_fd()));
    match std::fs::remove_file(&short) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::net::UnixListener::bind(&short)
}

/// Where execd must bind its socket inside the sandbox itself (gVisor's sandbox serves only sockets
/// of its own; a Docker container), the runtime mounts this folder writable at
/// [`SOCKET_DIR_IN_SANDBOX`]. A plain host folder there took whatever the sandbox wrote into it
/// (100 MiB in a test) onto the host's disk, outside every storage limit: it is a tmpfs of its own
/// instead, 64 KiB and 16 inodes, room for a socket and nothing worth filling.
pub fn mount_socket_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    std::fs::create_dir_all(dir)?;
    let target = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"size=64k,nr_inodes=16,mode=0755".as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Undoes [`mount_socket_dir`] (lazily: a runtime's process may still hold it); nothing mounted
/// there is fine.
pub fn unmount_socket_dir(dir: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(target) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: umount2(2) with a NUL-terminated string that outlives the call.
    unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
}

/// The fields of a `/proc/PID/stat` line after the parenthesised command name, which may itself hold
/// spaces and parentheses: index 0 is field 3 (`state`) in proc(5)'s numbering.
pub fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let (_, after_name) = stat.rsplit_once(") ")?;
    Some(after_name.split_whitespace().collect())
}

/// Field `n` of a `/proc/PID/stat` line as proc(5) numbers them (from 3), from [`stat_fields`].
pub fn stat_field<T: std::str::FromStr>(fields: &[&str], n: usize) -> Option<T> {
    fields.get(n.checked_sub(3)?)?.parse().ok()
}

/// The kernel start time of `pid` (clock ticks since boot), to tell a process from a later one that
/// got the same pid; `None` when it is gone or a zombie.
pub fn process_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = stat_fields(&stat)?;
    // A zombie has exited already.
    if fields.first() == Some(&"Z") {
        return None;
    }
    stat_field(&fields, 22)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_past_a_name_with_spaces_and_parentheses() {
        let stat = "42 (a) b (c)) S 1 42 42 0 -1 4194560 7 0 0 0 0 0 0 0 20 0 1 0 123456 0";
        let fields = stat_fields(stat).expect("fields");
        assert_eq!(fields[0], "S");
        assert_eq!(stat_field::<i32>(&fields, 4), Some(1));
        assert_eq!(stat_field::<u64>(&fields, 22), Some(123456));
        assert_eq!(stat_field::<u64>(&fields, 2), None);
        assert_eq!(stat_field::<u64>(&fields, 60), None);
        assert!(stat_fields("no name here").is_none());
    }

    #[test]
    fn our_own_start_time_is_read() {
        assert!(process_start_time(std::process::id() as i32).is_some_and(|t| t > 0));
    }

    /// A folder with a long path, and a listener bound in it (through the folder's handle: the
    /// path itself is too long for a socket address).
    fn long_folder_with_socket(
        tag: &str,
    ) -> (std::path::PathBuf, std::os::unix::net::UnixListener) {
        use std::os::fd::AsRawFd;
        let base = std::env::temp_dir().join(format!(
            "warren-core-{tag}-{}-{}",
            std::process::id(),
            "x".repeat(120)
        ));
        std::fs::create_dir_all(&base).expect("mkdir");
        let dir = std::fs::File::open(&base).expect("open folder");
        let listener = std::os::unix::net::UnixListener::bind(format!(
            "/proc/self/fd/{}/s.sock",
            dir.as_raw_fd()
        ))
        .expect("bind");
        (base, listener)
    }

    #[test]
    fn long_socket_paths_are_shortened_and_connectable() {
        let (base, listener) = long_folder_with_socket("long");
        let (_handle, short) = socket_connect_path(&base.join("s.sock")).expect("short");
        assert!(short.as_os_str().len() < 108);
        std::os::unix::net::UnixStream::connect(&short).expect("connect");
        drop(listener);
        std::fs::remove_dir_all(&base).expect("cleanup");
    }

    #[test]
    fn a_symlink_or_a_file_in_a_socket_s_place_is_refused() {
        let (base, listener) = long_folder_with_socket("link");
        // Another socket (standing in for a host socket a sandbox must not reach), a symlink to
        // it where the sandbox's socket should be, and a plain file.
        let target = base.join("s.sock");
        let link = base.join("execd.sock");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        let err = socket_connect_path(&link).expect_err("a symlink must not be followed");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
        let file = base.join("plain");
        std::fs::write(&file, b"").expect("file");
        assert!(socket_connect_path(&file).is_err());
        assert!(socket_connect_path(&base.join("missing")).is_err());
        drop(listener);
        std::fs::remove_dir_all(&base).expect("cleanup");
    }
}
