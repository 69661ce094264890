//! What execd and the isolation helper say to each other (see `warren_runtime_native::isolation`
//! for the helper): one JSON message per datagram of a `SOCK_SEQPACKET` pair, descriptors beside
//! it as `SCM_RIGHTS`. execd asks, the helper answers, one request at a time.
//!
//! The helper trusts nothing in a request beyond what the sandbox could do itself: every path is
//! one of the sandbox's own, and whatever it makes lives in namespaces of the session's.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{Deserialize, Serialize};

/// The largest message either side sends (a request names at most a few dozen paths).
pub const MAX_MESSAGE: usize = 256 * 1024;
/// The most descriptors one message carries.
const MAX_FDS: usize = 8;

/// A mount of a session, made in its own mount namespace over the sandbox's tree.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum Mount {
    /// `path` writable, as the sandbox's.
    Writable { path: String },
    /// `path` read-only.
    ReadOnly { path: String },
    /// `path` as an overlay: the sandbox's folder below, the session's writes above it (on a tmpfs
    /// of the session's, gone with it).
    Overlay { path: String },
    /// `source` shown at `dest`, writable or not.
    Bind {
        source: String,
        dest: String,
        readonly: bool,
    },
}

impl Mount {
    /// Where the mount shows in the session.
    pub fn target(&self) -> &str {
        match self {
            Self::Writable { path } | Self::ReadOnly { path } | Self::Overlay { path } => path,
            Self::Bind { dest, .. } => dest,
        }
    }

    /// Whether the mount is `/tmp` or lies under it, or comes from there: a private `/tmp`
    /// would hide it, so the session keeps the sandbox's `/tmp` (the caller named a folder there).
    pub fn within_tmp(&self) -> bool {
        let under = |p: &str| {
            let p = p.trim_end_matches('/');
            p == "/tmp" || p.starts_with("/tmp/")
        };
        under(self.target()) || matches!(self, Self::Bind { source, .. } if under(source))
    }
}

/// What execd asks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Request {
    /// Make a session's namespaces (mount, PID, UTS, IPC, cgroup; network unless shared): the
    /// sandbox's tree read-only but `/dev`, `mounts` in order, `/tmp` private or shared.
    Create {
        mounts: Vec<Mount>,
        private_tmp: bool,
        share_net: bool,
    },
    /// Start `argv` in session `session` (the id `Created` gave) as `uid:gid`, under the
    /// sandbox's privilege boundary. Descriptors: stdin, stdout, stderr, and a status pipe on
    /// which the helper writes `pid N` (the process, as this sandbox numbers it), then `exit N` or
    /// `signal N` when it ends.
    Exec {
        session: u64,
        argv: Vec<String>,
        env: Vec<String>,
        cwd: String,
        uid: u32,
        gid: u32,
    },
    /// Start a files worker (see `crate::identity`) in session `session`, serving as `uid:gid`
    /// with relative paths under `workdir`: a fork of the helper that joins the session, never
    /// an exec. Descriptors as for `Exec`, the worker's connection as its stdin.
    FilesWorker {
        session: u64,
        uid: u32,
        gid: u32,
        workdir: String,
    },
    /// End session `session` and everything in it.
    Destroy { session: u64 },
}

/// What the helper answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Reply {
    /// The session exists. With it: a pidfd that becomes readable when the session ends.
    Created {
        session: u64,
    },
    Done,
    Failed {
        error: String,
    },
}

/// Why `path` cannot be where a session mounts something (or takes it from), or `None`: it must
/// be absolute and plain (no empty, `.` or `..` part), not `/`, outside the kernel's trees, and free
/// of what overlayfs options cannot carry. execd checks it to answer 400; the helper again, since
/// it acts with the rights.
pub fn mount_path_problem(path: &str) -> Option<String> {
    if !path.starts_with('/') {
        return Some("must be an absolute path".into());
    }
    if path == "/" {
        return Some("must not be /".into());
    }
    if !path
        .split('/')
        .skip(1)
        .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
    {
        return Some("must be a clean path".into());
    }
    for kernel in ["/proc", "/sys", "/dev"] {
        if path == kernel || path.starts_with(&format!("{kernel}/")) {
            return Some(format!("is in {kernel}, which sessions cannot mount over"));
        }
    }
    // overlayfs takes its folders in one option string.
    if path.contains([',', ':', '\\']) || path.contains(char::is_control) {
        return Some(
            "holds a character mounts cannot take (',', ':', '\\' or a control character)".into(),
        );
    }
    None
}

/// Sends `msg` with `fds`.
pub fn send<T: Serialize>(sock: &impl AsRawFd, msg: &T, fds: &[RawFd]) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    if bytes.len() > MAX_MESSAGE {
        return Err(std::io::Error::other("message too large"));
    }
    let iov = [IoSlice::new(&bytes)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// Receives one message and the descriptors that came with it. `Ok(None)` when the other side
/// has gone.
pub fn recv<T: for<'de> Deserialize<'de>>(
    sock: &impl AsRawFd,
) -> std::io::Result<Option<(T, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (len, fds, truncated) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = loop {
            match recvmsg::<()>(
                sock.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => break other?,
            }
        };
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                // SAFETY: the kernel just installed these descriptors in this process for us.
                fds.extend(
                    received
                        .into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        let truncated = msg
            .flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
        (msg.bytes, fds, truncated)
    };
    if len == 0 && fds.is_empty() {
        return Ok(None);
    }
    if truncated {
        return Err(std::io::Error::other("message truncated"));
    }
    let msg = serde_json::from_slice(&buf[..len]).map_err(std::io::Error::other)?;
    Ok(Some((msg, fds)))
}

/// A connected pair for execd (first) and the helper (second).
pub fn pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    Ok(socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn a_request_and_its_descriptors_arrive_whole() {
        let (a, b) = pair().expect("pair");
        let (r, w) = nix::unistd::pipe().expect("pipe");
        let req = Request::Create {
            mounts: vec![Mount::Overlay {
                path: "/workspace".into(),
            }],
            private_tmp: true,
            share_net: false,
        };
        send(&a, &req, &[w.as_raw_fd()]).expect("send");
        drop(w);
        let (got, fds): (Request, _) = recv(&b).expect("recv").expect("a message");
        assert!(matches!(got, Request::Create { ref mounts, .. } if mounts.len() == 1));
        assert_eq!(fds.len(), 1);
        std::fs::File::from(fds.into_iter().next().expect("fd"))
            .write_all(b"x")
            .expect("write");
        let mut s = String::new();
        std::fs::File::from(r).read_to_string(&mut s).expect("read");
        assert_eq!(s, "x");
        drop(a);
        assert!(recv::<Request>(&b).expect("recv").is_none());
    }
}
