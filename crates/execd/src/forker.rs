//! The files workers' forker: where each filesystem worker (`identity`) comes from.
//!
//! A worker takes another identity, so it must be a process of its own; and it must hold nothing
//! of the host. An `exec` of execd's own binary gave it both wrongs at once: under the embedded
//! runtime that binary is the host's `warren`, and a freshly exec'd process is dumpable, so the
//! sandbox's code could follow the worker's `/proc/<pid>/exe` to the host binary (and, without
//! user namespaces, change its mode), read its environment, learn host paths. So no worker is
//! exec'd: this forker is forked from execd while execd still has one thread (a fork of a
//! multi-threaded process may only call async-signal-safe functions, and a worker runs a whole
//! HTTP server), keeps that one thread, and forks a worker per request. Its workers, like itself,
//! are non-dumpable from their first instruction, and their memory map was made by the runtime
//! outside the sandbox's user namespace, so the kernel refuses the sandbox every `/proc/<pid>/`
//! link and file that leads anywhere (exe, fd, environ, maps, cwd, root) for want of
//! `CAP_SYS_PTRACE` there.
//!
//! The forker holds nothing but its socket (execd's end of a `SOCK_SEQPACKET` pair) and the
//! sandbox's `/dev/null` as stdio. Sandbox root can still signal it, as it can signal any of its
//! own processes: then workers can no longer be made, and requests that need one answer 503
//! saying so, while every other route goes on.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::isolation::channel;

/// What one worker is asked to be; its connection travels beside the message.
#[derive(Debug, Serialize, Deserialize)]
struct Job {
    uid: u32,
    gid: u32,
    workdir: PathBuf,
}

/// execd's end of the forker's socket.
pub struct Forker {
    sock: OwnedFd,
}

/// Why a worker could not be asked for.
#[derive(Debug)]
pub enum SpawnError {
    /// The forker has gone (killed by the sandbox's own code, say): no worker can be made.
    Gone,
    /// Its queue is full (it is stopped, say): try again.
    Busy,
    Other(std::io::Error),
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpawnError::Gone => f.write_str(
                "the files workers' forker has gone (a process in the sandbox ended it); \
                 requests served as another identity cannot run until the sandbox restarts",
            ),
            SpawnError::Busy => f.write_str(
                "the files workers' forker is not taking requests (stopped?); retry later",
            ),
            SpawnError::Other(e) => write!(f, "asking for a files worker: {e}"),
        }
    }
}

impl Forker {
    /// Forks the forker. Must be called while the calling process has one thread (execd before
    /// its runtime starts).
    pub fn start() -> std::io::Result<Forker> {
        let (ours, theirs) = channel::pair()?;
        // SAFETY: the caller is single-threaded (see above), so the child may run any code.
        match unsafe { nix::unistd::fork() }? {
            nix::unistd::ForkResult::Child => {
                drop(ours);
                serve(theirs)
            }
            nix::unistd::ForkResult::Parent { .. } => {
                drop(theirs);
                // Never block execd's one thread on a forker that does not read.
                nix::fcntl::fcntl(
                    ours.as_raw_fd(),
                    nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
                )?;
                Ok(Forker { sock: ours })
            }
        }
    }

    /// Has a worker serve `conn` as `uid:gid`, relative paths under `workdir`. Never blocks.
    pub fn spawn(
        &self,
        uid: u32,
        gid: u32,
        workdir: PathBuf,
        conn: OwnedFd,
    ) -> Result<(), SpawnError> {
        let job = Job { uid, gid, workdir };
        channel::send(&self.sock, &job, &[conn.as_raw_fd()]).map_err(|e| match e.raw_os_error() {
            Some(libc::EPIPE) | Some(libc::ECONNRESET) | Some(libc::ENOTCONN) => SpawnError::Gone,
            Some(libc::EAGAIN) => SpawnError::Busy,
            _ => SpawnError::Other(e),
        })
    }
}

/// The forker's life: one job at a time, a worker forked for each. Never returns.
fn serve(sock: OwnedFd) -> ! {
    // SAFETY: prctl(2) with integer and string arguments. Not dumpable before it reads a thing
    // (execd under an OCI runtime makes itself so only later); gone with execd.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        libc::prctl(libc::PR_SET_NAME, c"execd-forker".as_ptr(), 0, 0, 0);
    }
    // Whatever execd held when it forked us (its listeners, the ready pipe, the isolation
    // helper's socket, stdout and stderr on a log of the host's under some runtimes) is not ours.
    stdio_to_null();
    close_all_but(&[0, 1, 2, sock.as_raw_fd()]);
    // Workers are reaped by the kernel: execd learns a worker ended from its connection.
    // SAFETY: setting a signal's disposition to SIG_IGN.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_IGN) };
    loop {
        let (job, mut fds) = match channel::recv::<Job>(&sock) {
            Ok(Some(got)) => got,
            Ok(None) => break,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            // A message that does not parse came from execd alone; skip it.
            Err(_) => continue,
        };
        let Some(conn) = fds.pop().filter(|_| fds.is_empty()) else {
            continue;
        };
        // SAFETY: this process has one thread, so the child may run any code.
        match unsafe { nix::unistd::fork() } {
            Ok(nix::unistd::ForkResult::Child) => {
                drop(sock);
                // SAFETY: restoring a signal's default disposition (ours is the forker's own).
                unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
                let code = crate::identity::serve_worker(conn, job.uid, job.gid, job.workdir);
                // SAFETY: _exit in a forked child: no atexit handlers or buffers of the parent.
                unsafe { libc::_exit(code) }
            }
            // (a failed fork drops the connection: the request gets an error from execd)
            Ok(nix::unistd::ForkResult::Parent { .. }) | Err(_) => drop(conn),
        }
    }
    // SAFETY: _exit in a forked child.
    unsafe { libc::_exit(0) }
}

/// Points stdin, stdout and stderr at the sandbox's `/dev/null`, or, without one, at a pipe with
/// no reader (writes fail), so nothing a worker prints lands on a descriptor of the host's.
fn stdio_to_null() {
    let target: Option<OwnedFd> = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map(OwnedFd::from)
        .ok()
        .or_else(|| nix::unistd::pipe().ok().map(|(_read, write)| write));
    for fd in 0..3 {
        match &target {
            // SAFETY: dup2 of a descriptor we own onto a standard one.
            Some(t) => unsafe {
                libc::dup2(t.as_raw_fd(), fd);
            },
            // SAFETY: closing a standard descriptor nothing here uses any more.
            None => unsafe {
                libc::close(fd);
            },
        }
    }
}

/// Closes every descriptor but `keep`: those listed in `/proc/self/fd`, or where that cannot be
/// read, every number up to the descriptor limit.
pub(crate) fn close_all_but(keep: &[RawFd]) {
    let open: Vec<RawFd> = match std::fs::read_dir("/proc/self/fd") {
        Ok(dir) => dir
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect(),
        Err(_) => {
            // SAFETY: sysconf(3) with a constant name.
            let max = unsafe { libc::sysconf(libc::_SC_OPEN_MAX) }.clamp(1024, 65536);
            (0..max as RawFd).collect()
        }
    };
    for fd in open.into_iter().filter(|fd| !keep.contains(fd)) {
        // SAFETY: closing descriptors this process inherited and will not use (the directory's
        // own descriptor was closed with it, so at worst this fails with EBADF).
        unsafe { libc::close(fd) };
    }
}
