//! Setup helpers forked from a zygote instead of exec'd one by one.
//!
//! Every sandbox needs a fresh single-threaded process to unshare namespaces and fork its PID 1 (see
//! `init`); the server cannot fork itself for that, being multi-threaded. Exec'ing the `warren` binary
//! for each one cost ~0.8 ms of CPU per sandbox here — most of it the kernel mapping a 30 MB static
//! binary, glibc's start-up (whose CPU feature probes are hypervisor exits in a VM) and relocations —
//! a measurable share of a create. So the server starts one zygote (`warren __sandbox-zygote`, a
//! single-threaded process that does nothing else) and asks it, over a `SOCK_SEQPACKET` socket, to
//! fork a helper: the request carries the cgroup files to join and the helper's stdin, stdout and
//! stderr as file descriptors (on cgroup v2 also the cgroup's directory, which the helper is cloned
//! straight into); the answer carries a pidfd of the new helper. The helper then runs exactly as an
//! exec'd one would (`init::helper`).
//!
//! The zygote is the server's child and exits when the server's end of the socket closes; it reaps
//! its helpers.
//! Sandbox PID 1s, orphaned when their helper exits, are reparented past the zygote to the server
//! (a child subreaper), as before. If the zygote cannot be started or stops answering, the runtime
//! falls back to exec'ing helpers.
//!
//! Why one file: both ends of one wire protocol, the server's (`Zygote`, `Helper`) and the zygote's
//! (`main`, `serve_one`), which share the `Request` and `Reply` messages, and the spec channel to a
//! helper; all of it is built on the same descriptor-passing `send` and `receive`.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType,
};
use serde::{Deserialize, Serialize};

use crate::children::{pidfd_exited, reap_pidfd_with};

/// The hidden subcommand of the `warren` binary that runs `zygote::main`.
pub const ZYGOTE_SUBCOMMAND: &str = "__sandbox-zygote";

/// The zygote reads its requests on stdin (the socket the server gave it).
const CONTROL_FD: RawFd = 0;
/// Largest request: the cgroup files of one helper.
const MAX_REQUEST: usize = 64 * 1024;
/// How long the server waits for the zygote to take a request and answer it.
const ANSWER_TIMEOUT_SECS: i64 = 5;

#[derive(Serialize, Deserialize)]
struct Request {
    /// Files the helper writes `0` into to join its cgroups, unless it was cloned into them.
    join: Vec<PathBuf>,
    /// A fourth descriptor, the cgroup directory to clone the helper into (v2).
    #[serde(default)]
    into_cgroup: bool,
}

#[derive(Serialize, Deserialize)]
enum Reply {
    /// The pidfd rides along as ancillary data.
    Forked {
        pid: i32,
    },
    Failed {
        error: String,
    },
}

/// A setup helper: its pipes, and a handle to watch and stop it.
pub struct Helper {
    pub stdin: Option<File>,
    pub stdout: Option<File>,
    process: Process,
}

enum Process {
    /// Exec'd by the server (the fallback): its child.
    Spawned(Child),
    /// Forked by the zygote, which reaps it; watched through its pidfd.
    Forked { pidfd: OwnedFd },
}

impl Helper {
    /// An exec'd helper, given `stdin` (our end of [`spec_channel`]).
    pub fn spawned(mut child: Child, stdin: File) -> Self {
        Self {
            stdin: Some(stdin),
            stdout: child.stdout.take().map(|s| File::from(OwnedFd::from(s))),
            process: Process::Spawned(child),
        }
    }

    /// Its process ID (for a forked helper, as its pidfd's `fdinfo` reports it).
    pub fn pid(&self) -> Option<u32> {
        match &self.process {
            Process::Spawned(c) => Some(c.id()),
            Process::Forked { pidfd } => {
                let info =
                    std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd()))
                        .ok()?;
                info.lines()
                    .find_map(|l| l.strip_prefix("Pid:"))
                    .and_then(|p| p.trim().parse().ok())
            }
        }
    }

    pub fn is_running(&mut self) -> bool {
        match &mut self.process {
            Process::Spawned(c) => matches!(c.try_wait(), Ok(None)),
            Process::Forked { pidfd } => !pidfd_exited(pidfd, 0),
        }
    }

    pub fn kill(&mut self) {
        match &mut self.process {
            Process::Spawned(c) => {
                let _ = c.kill();
            }
            // SAFETY: pidfd_send_signal(2) on our pidfd; a pidfd cannot name a recycled pid.
            Process::Forked { pidfd } => unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                );
            },
        }
    }

    /// Waits up to `limit` for it to exit; whether it has.
    pub fn wait_for(&mut self, limit: Duration) -> bool {
        match &mut self.process {
            Process::Spawned(c) => {
                let deadline = std::time::Instant::now() + limit;
                loop {
                    match c.try_wait() {
                        Ok(None) if std::time::Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        Ok(None) => return false,
                        _ => return true,
                    }
                }
            }
            Process::Forked { pidfd } => {
                let gone =
                    pidfd_exited(pidfd, i32::try_from(limit.as_millis()).unwrap_or(i32::MAX));
                if gone {
                    reap_if_orphaned(pidfd);
                }
                gone
            }
        }
    }

    /// Waits until it has exited.
    pub fn wait(&mut self) {
        match &mut self.process {
            Process::Spawned(c) => {
                let _ = c.wait();
            }
            Process::Forked { pidfd } => {
                pidfd_exited(pidfd, -1);
                reap_if_orphaned(pidfd);
            }
        }
    }
}

/// Reaps a forked helper that has exited, if it is ours to reap: the zygote reaps its children, but
/// when the zygote died first they were reparented to the server (their subreaper), and without this
/// each one stayed a zombie until the server exited. While the zygote lives, the helper is not our
/// child and waitid says so (ECHILD); nothing happens.
fn reap_if_orphaned(pidfd: &OwnedFd) {
    let _ = reap_pidfd_with(pidfd, libc::WEXITED | libc::WNOHANG);
}

/// The name a forked setup helper gives itself (`ps`, and `reap_orphaned_helpers`).
const HELPER_NAME: &str = "warren-setup";
const HELPER_NAME_C: &std::ffi::CStr = c"warren-setup";

/// Reaps, for up to `within`, the server's children that are setup helpers (`warren-setup`) once
/// they have exited. A helper some `Helper` still tracks and that ends meanwhile is reaped either
/// here or by its own `wait`, whichever comes first.
fn reap_orphaned_helpers(within: Duration) {
    crate::children::reap_own_children(|c| c.comm == HELPER_NAME, false, within);
}

/// The server's side: starts the zygote on first use and again after it died.
pub struct Zygote {
    exe: PathBuf,
    running: Mutex<Option<Running>>,
}

struct Running {
    child: Child,
    control: OwnedFd,
}

impl Zygote {
    pub fn new(exe: &Path) -> Self {
        Self {
            exe: exe.to_path_buf(),
            running: Mutex::new(None),
        }
    }

    fn start(&self) -> io::Result<Running> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        // A zygote that stops answering (stopped, wedged) must not hang every create behind it: after
        // this long the request fails, the zygote is replaced and the helper exec'd instead.
        let timeout = nix::sys::time::TimeVal::new(ANSWER_TIMEOUT_SECS, 0);
        nix::sys::socket::setsockopt(&ours, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)?;
        nix::sys::socket::setsockopt(&ours, nix::sys::socket::sockopt::SendTimeout, &timeout)?;
        let mut cmd = Command::new(&self.exe);
        // Sandboxes are forked from it: they get the open-file limit the server started with.
        warren_core::fd_limit::restore_in_child(&mut cmd);
        let child = cmd
            .arg(ZYGOTE_SUBCOMMAND)
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .env_clear()
            // A group of its own: a Ctrl-C in the terminal that runs `warren serve` (SIGINT to the
            // foreground process group) is the server's to handle, and must not kill the zygote
            // and the setup helpers it forks. It ends when the server's end of its socket closes.
            .process_group(0)
            .args(crate::hugetext::turned_off().then_some(crate::hugetext::OFF_FLAG))
            .spawn()?;
        Ok(Running {
            child,
            control: ours,
        })
    }

    /// A helper in the cgroups that the files `join` name (`Cgroup::join_files`) — created inside
    /// `into` when given and the kernel can (`Cgroup::clone_into_dir`), joining through `join`
    /// otherwise — with its stderr on `stderr`.
    pub fn fork_helper(
        &self,
        join: &[PathBuf],
        into: Option<&Path>,
        stderr: &OwnedFd,
    ) -> io::Result<Helper> {
        let (stdin_w, stdin_r) = spec_channel()?;
        let (stdout_r, stdout_w) = io::pipe()?;
        let into = match into {
            Some(dir) => Some(File::open(dir)?),
            None => None,
        };
        let request = serde_json::to_vec(&Request {
            join: join.to_vec(),
            into_cgroup: into.is_some(),
        })
        .map_err(io::Error::other)?;
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if running.is_none() {
            *running = Some(self.start()?);
        }
        let Some(zygote) = running.as_ref() else {
            return Err(io::Error::other("zygote not running"));
        };
        let mut fds = vec![
            stdin_r.as_raw_fd(),
            stdout_w.as_raw_fd(),
            stderr.as_raw_fd(),
        ];
        fds.extend(into.as_ref().map(AsRawFd::as_raw_fd));
        match ask(&zygote.control, &request, &fds) {
            Ok(pidfd) => Ok(Helper {
                stdin: Some(File::from(OwnedFd::from(stdin_w))),
                stdout: Some(File::from(OwnedFd::from(stdout_r))),
                process: Process::Forked { pidfd },
            }),
            Err(e) => {
                // Whatever went wrong, a fresh zygote next time.
                if let Some(mut z) = running.take() {
                    let _ = z.child.kill();
                    let _ = z.child.wait();
                    // Its helpers are the server's now. One it forked for this very request, whose
                    // pidfd never reached us, ends when this request's pipes close and is tracked
                    // by no `Helper`: reaped here.
                    std::thread::spawn(|| reap_orphaned_helpers(Duration::from_secs(2)));
                }
                Err(e)
            }
        }
    }

    /// Ends the zygote (server shutdown). Helpers it forked live on.
    pub fn stop(&self) {
        if let Some(mut z) = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            drop(z.control);
            let _ = z.child.kill();
            let _ = z.child.wait();
        }
    }
}

/// Sends one message with `fds` attached; how many of its bytes went (on a stream socket, maybe
/// not all).
fn send(socket: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsg: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    Ok(sendmsg::<()>(
        socket,
        &[IoSlice::new(bytes)],
        cmsg,
        MsgFlags::empty(),
        None,
    )?)
}

/// Receives one message (at most 4 descriptors with it) into `buf`: its length (0 once the other
/// end has closed) and the descriptors, owned.
fn receive(socket: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        socket,
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = c {
            // SAFETY: descriptors the kernel just installed for us; owned from here.
            fds.extend(
                received
                    .into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    Ok((msg.bytes, fds))
}

/// A helper's stdin: a stream socket rather than a pipe, so that a descriptor (the sandbox's root
/// mount) can travel with its spec. Our end first, the helper's second.
pub fn spec_channel() -> io::Result<(File, OwnedFd)> {
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    Ok((File::from(ours), theirs))
}

/// Sends a helper its sandbox's spec, with `fds` (its user namespace, the root overlay as a detached
/// mount) attached to the first bytes, and closes the helper's stdin.
pub fn send_spec(stdin: File, payload: &[u8], fds: &[&OwnedFd]) -> io::Result<()> {
    use std::io::Write;
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let sent = match raw.is_empty() {
        false => match send(stdin.as_raw_fd(), payload, &raw) {
            Ok(n) => n,
            // Not a socket: the spec alone, and the helper makes what the descriptors were itself.
            Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => 0,
            Err(e) => return Err(e),
        },
        true => 0,
    };
    (&stdin).write_all(&payload[sent..])
}

/// The helper's side of [`send_spec`]: its stdin read to the end, and the descriptors that came.
pub(crate) fn receive_spec() -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    use std::io::Read;
    let mut spec = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let mut fds = Vec::new();
    loop {
        let n = match receive(0, &mut buf) {
            Ok((n, received)) => {
                fds.extend(received);
                n
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // A pipe (nothing can come with the spec then): read as a file.
            Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => {
                // SAFETY: fd 0 is our stdin, open for the whole process; ManuallyDrop keeps it so.
                let stdin = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(0) });
                (&*stdin).read_to_end(&mut spec)?;
                break;
            }
            Err(e) => return Err(e),
        };
        if n == 0 {
            break;
        }
        spec.extend_from_slice(&buf[..n]);
    }
    Ok((spec, fds))
}

/// One request and its answer; the answer's pidfd, or why there is none.
fn ask(control: &OwnedFd, request: &[u8], fds: &[RawFd]) -> io::Result<OwnedFd> {
    send(control.as_raw_fd(), request, fds)?;
    let mut buf = vec![0u8; 4096];
    let (len, received) = receive(control.as_raw_fd(), &mut buf)?;
    if len == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the zygote exited",
        ));
    }
    match serde_json::from_slice::<Reply>(&buf[..len]).map_err(io::Error::other)? {
        Reply::Forked { .. } => received
            .into_iter()
            .next()
            .ok_or_else(|| io::Error::other("the zygote sent no pidfd")),
        Reply::Failed { error } => Err(io::Error::other(error)),
    }
}

/// Entry point of `warren __sandbox-zygote`. Never returns.
pub fn main() -> ! {
    // First, while the zygote is one thread: every sandbox's PID 1 then inherits the binary's code
    // mapped through huge pages instead of faulting it in (see `hugetext`). Failure only costs speed.
    if !std::env::args().any(|a| a == crate::hugetext::OFF_FLAG) {
        if let Err(err) = crate::hugetext::remap_self() {
            eprintln!("warren zygote: binary kept on small pages: {err}");
        }
    }
    // One receive buffer for the zygote's life: every page the zygote writes while helpers it forked
    // still share it is copied for it (copy-on-write), so a buffer zeroed anew per request cost 16
    // page copies per sandbox; this one costs the one page a request lands in.
    let mut buf = vec![0u8; MAX_REQUEST];
    // State every sandbox's PID 1 would otherwise build for itself after the fork, made once here
    // and inherited: execd's log subscriber (to stderr, which in a sandbox is its log), its routes,
    // and the CPU feature cache (each probe is a `cpuid`, a hypervisor exit in a VM).
    warren_execd::cli::init_logging(Some(crate::init::EXECD_LOG_LEVEL));
    warren_execd::prebuild_routes();
    #[cfg(target_arch = "x86_64")]
    let _ = std::arch::is_x86_feature_detected!("avx2");
    // The zygote ends when the server's end of the socket closes — when the server exits, however it
    // exits. (Not PR_SET_PDEATHSIG: that fires when the server *thread* that started us ends.)
    loop {
        reap();
        // Wake at least once a second to reap helpers that exited.
        let mut p = libc::pollfd {
            fd: CONTROL_FD,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, 1000) };
        if n == 0 || (n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted) {
            continue;
        }
        if n < 0 {
            std::process::exit(1);
        }
        match serve_one(&mut buf) {
            Ok(true) => {}
            Ok(false) | Err(_) => std::process::exit(0),
        }
    }
}

fn reap() {
    // SAFETY: waitpid(2) for any of our children, without blocking.
    while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
}

/// Handles one request; `false` once the server has closed its end.
fn serve_one(buf: &mut [u8]) -> io::Result<bool> {
    let (len, fds) = receive(CONTROL_FD, buf)?;
    if len == 0 {
        return Ok(false);
    }
    let reply = match serde_json::from_slice::<Request>(&buf[..len]) {
        Ok(request) if fds.len() == 3 + usize::from(request.into_cgroup) => {
            fork_helper(request, &fds)
        }
        Ok(request) => Reply::Failed {
            error: format!(
                "expected {} descriptors, got {}",
                3 + usize::from(request.into_cgroup),
                fds.len()
            ),
        },
        Err(e) => Reply::Failed {
            error: format!("bad request: {e}"),
        },
    };
    drop(fds);
    let (reply, pidfd) = match reply {
        Reply::Forked { pid } => {
            // SAFETY: pidfd_open(2) on the child we just forked (not reaped yet: reap() runs only
            // between requests, after this answer).
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
            if fd < 0 {
                let error = format!("pidfd_open: {}", io::Error::last_os_error());
                // SAFETY: kill(2) of our own fresh child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                (Reply::Failed { error }, None)
            } else {
                // SAFETY: a descriptor pidfd_open just returned; owned from here.
                (
                    Reply::Forked { pid },
                    Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }),
                )
            }
        }
        failed => (failed, None),
    };
    let bytes = serde_json::to_vec(&reply).map_err(io::Error::other)?;
    let raw: Vec<RawFd> = pidfd.iter().map(AsRawFd::as_raw_fd).collect();
    send(CONTROL_FD, &bytes, &raw)?;
    Ok(true)
}

fn fork_helper(request: Request, fds: &[OwnedFd]) -> Reply {
    // Created inside its cgroup when the request brought the cgroup's directory and the kernel
    // can; forked and left to join through `request.join` otherwise (an older kernel, or a cgroup
    // the clone may not enter).
    let (forked, join) = match fds.get(3) {
        Some(cgroup) => match clone_into_cgroup(cgroup) {
            Ok(forked) => (Ok(forked), Vec::new()),
            Err(_) => (fork(), request.join),
        },
        None => (fork(), request.join),
    };
    match forked {
        Ok(Forked::Child) => {
            // SAFETY: prctl(PR_SET_NAME) with a NUL-terminated name: `ps` tells helpers apart.
            unsafe { libc::prctl(libc::PR_SET_NAME, HELPER_NAME_C.as_ptr(), 0, 0, 0) };
            // The helper's stdin, stdout and stderr; dup2 onto 0 also closes our control socket
            // there, so the helper holds nothing of the zygote. (A fourth descriptor, the cgroup
            // directory, is only closed below.)
            for (fd, target) in fds.iter().take(3).zip(0..) {
                // SAFETY: dup2 of descriptors we own onto the standard ones.
                if unsafe { libc::dup2(fd.as_raw_fd(), target) } < 0 {
                    // SAFETY: _exit in the forked child.
                    unsafe { libc::_exit(126) };
                }
            }
            for fd in fds {
                // SAFETY: closing our copies (all above 2: received while 0, 1, 2 were open).
                unsafe { libc::close(fd.as_raw_fd()) };
            }
            let join = join.iter().map(|p| p.display().to_string()).collect();
            crate::init::helper(join)
        }
        Ok(Forked::Parent(pid)) => Reply::Forked { pid },
        Err(e) => Reply::Failed {
            error: format!("fork: {e}"),
        },
    }
}

enum Forked {
    Child,
    Parent(i32),
}

fn fork() -> io::Result<Forked> {
    // SAFETY: the zygote is single-threaded (it dispatches here at start, before any thread or
    // runtime exists), so the child may run arbitrary code.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => Ok(Forked::Child),
        nix::unistd::ForkResult::Parent { child } => Ok(Forked::Parent(child.as_raw())),
    }
}

/// `struct clone_args` of clone3(2), up to `cgroup` (Linux 5.7).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// `CLONE_INTO_CGROUP` (linux/sched.h; not in every libc crate's list).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// A fork that starts the child in the cgroup v2 directory `cgroup` (clone3 with
/// `CLONE_INTO_CGROUP`): no migration afterwards, so no write-lock of the kernel's global
/// thread-group semaphore, whose grace period every cgroup operation on the machine waits behind.
/// Like `fork()` but for what glibc's wrapper adds (fork handlers, the TID cached in the thread
/// block), which the single-threaded zygote's children do not use.
fn clone_into_cgroup(cgroup: &OwnedFd) -> io::Result<Forked> {
    let args = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: cgroup.as_raw_fd() as u64,
        ..Default::default()
    };
    // SAFETY: clone3(2) without CLONE_VM or a new stack behaves as fork: the child continues on a
    // copy of this (single-threaded) process; `args` outlives the call and its size is passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    match rc {
        0 => Ok(Forked::Child),
        pid if pid > 0 => Ok(Forked::Parent(pid as i32)),
        _ => Err(io::Error::last_os_error()),
    }
}
