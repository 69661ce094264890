//! execd's side of the isolation helper: requests over the socket pair (one at a time, off the
//! async threads), and processes started in a session with their status pipe read.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

use tokio::io::AsyncBufReadExt;

use super::channel::{self, Mount, Reply, Request};

/// How long a process started in a session gets to report its pid.
const START_WITHIN: std::time::Duration = std::time::Duration::from_secs(15);

/// The helper's socket. Requests are serialised: the helper answers them in order.
pub struct Helper {
    sock: Mutex<OwnedFd>,
}

/// How a process started in a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    Exit(i32),
    Signal(i32),
    /// It never ran (or its runner failed): why.
    Failed(String),
}

/// A process started in a session.
pub struct Started {
    /// As this sandbox numbers it (execd's view of /proc).
    pub pid: i32,
    /// Set once it ended.
    pub end: tokio::sync::watch::Receiver<Option<End>>,
}

impl Helper {
    pub fn new(sock: OwnedFd) -> Arc<Self> {
        Arc::new(Self {
            sock: Mutex::new(sock),
        })
    }

    async fn call(self: &Arc<Self>, request: Request, fds: Vec<OwnedFd>) -> Result<Reply, String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let sock = me.sock.lock().unwrap_or_else(|e| e.into_inner());
            let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
            channel::send(&*sock, &request, &raw).map_err(|e| format!("isolation helper: {e}"))?;
            drop(fds);
            match channel::recv::<Reply>(&*sock) {
                Ok(Some((reply, _))) => Ok(reply),
                Ok(None) => Err("the isolation helper has gone".to_string()),
                Err(e) => Err(format!("isolation helper: {e}")),
            }
        })
        .await
        .map_err(|e| format!("isolation helper: {e}"))?
    }

    /// Makes a session; its id, as the helper names it.
    pub async fn create(
        self: &Arc<Self>,
        mounts: Vec<Mount>,
        private_tmp: bool,
        share_net: bool,
    ) -> Result<u64, String> {
        let request = Request::Create {
            mounts,
            private_tmp,
            share_net,
        };
        match self.call(request, Vec::new()).await? {
            Reply::Created { session } => Ok(session),
            Reply::Failed { error } => Err(error),
            other => Err(format!("unexpected answer {other:?}")),
        }
    }

    pub async fn destroy(self: &Arc<Self>, session: u64) -> Result<(), String> {
        match self.call(Request::Destroy { session }, Vec::new()).await? {
            Reply::Done => Ok(()),
            Reply::Failed { error } => Err(error),
            other => Err(format!("unexpected answer {other:?}")),
        }
    }

    /// Starts `argv` in `session` with the given stdio; waits until it runs (or could not).
    #[allow(clippy::too_many_arguments)]
    pub async fn exec(
        self: &Arc<Self>,
        session: u64,
        argv: Vec<String>,
        env: Vec<String>,
        cwd: String,
        (uid, gid): (u32, u32),
        stdio: [OwnedFd; 3],
    ) -> Result<Started, String> {
        let request = Request::Exec {
            session,
            argv,
            env,
            cwd,
            uid,
            gid,
        };
        self.start(request, stdio).await
    }

    /// Starts a files worker in `session` serving `conn` as `uid:gid`; waits until it runs.
    pub async fn files_worker(
        self: &Arc<Self>,
        session: u64,
        (uid, gid): (u32, u32),
        workdir: String,
        conn: OwnedFd,
    ) -> Result<Started, String> {
        let out = null().map_err(|e| e.to_string())?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let request = Request::FilesWorker {
            session,
            uid,
            gid,
            workdir,
        };
        self.start(request, [conn, out, err]).await
    }

    /// Sends `request` (an `Exec` or a `FilesWorker`) with stdio and a status pipe; reads the
    /// status until the process runs, then in the background until it ends.
    async fn start(
        self: &Arc<Self>,
        request: Request,
        [stdin, stdout, stderr]: [OwnedFd; 3],
    ) -> Result<Started, String> {
        let (status_r, status_w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
        match self
            .call(request, vec![stdin, stdout, stderr, status_w])
            .await?
        {
            Reply::Done => {}
            Reply::Failed { error } => return Err(error),
            other => return Err(format!("unexpected answer {other:?}")),
        }
        let status = tokio::net::unix::pipe::Receiver::from_owned_fd(status_r)
            .map_err(|e| format!("status pipe: {e}"))?;
        let mut lines = tokio::io::BufReader::new(status).lines();
        let (tx, rx) = tokio::sync::watch::channel(None);
        let mut pid = None;
        let mut error = None;
        // Until the pid: an error the child wrote first is why it did not start. Bounded: the
        // runner is a process of the sandbox, which its code may stop.
        let started = tokio::time::timeout(START_WITHIN, async {
            while pid.is_none() {
                match lines.next_line().await {
                    Ok(Some(line)) => {
                        if let Some(p) = line.strip_prefix("pid ") {
                            pid = p.trim().parse::<i32>().ok();
                        } else if let Some(e) = line.strip_prefix("error ") {
                            // The runner may still say pid; the start failed all the same.
                            error = Some(e.to_string());
                        }
                    }
                    _ => break,
                }
            }
        })
        .await;
        if started.is_err() {
            return Err("the process did not start in time (its runner was stopped?)".into());
        }
        let (Some(pid), None) = (pid, &error) else {
            return Err(error.unwrap_or_else(|| "the process did not start".into()));
        };
        tokio::spawn(async move {
            let mut end = None;
            while let Ok(Some(line)) = lines.next_line().await {
                let (word, rest) = line.split_once(' ').unwrap_or((&line, ""));
                match word {
                    "exit" => {
                        let code = rest.trim().parse().unwrap_or(-1);
                        // A failed exec ends 127 after its error line: the error is the news.
                        if end.is_none() {
                            end = Some(End::Exit(code));
                        }
                    }
                    "signal" => end = Some(End::Signal(rest.trim().parse().unwrap_or(-1))),
                    "error" => end = Some(End::Failed(rest.to_string())),
                    _ => {}
                }
            }
            let _ = tx.send(Some(end.unwrap_or_else(|| {
                End::Failed("the runner ended without a status".into())
            })));
        });
        Ok(Started { pid, end: rx })
    }
}

/// A pipe whose read end execd keeps, as a tokio receiver, and whose write end goes to a session.
pub fn pipe_in() -> std::io::Result<(tokio::net::unix::pipe::Receiver, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((tokio::net::unix::pipe::Receiver::from_owned_fd(r)?, w))
}

/// A pipe whose write end execd keeps, and whose read end goes to a session.
pub fn pipe_out() -> std::io::Result<(tokio::net::unix::pipe::Sender, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((tokio::net::unix::pipe::Sender::from_owned_fd(w)?, r))
}

/// /dev/null for a stdin.
pub fn null() -> std::io::Result<OwnedFd> {
    Ok(std::fs::File::open("/dev/null")?.into())
}
