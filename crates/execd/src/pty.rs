//! Interactive terminals over WebSocket (`/pty`), as OpenSandbox's execd defines them (PTY.md):
//!
//! - `POST /pty {cwd?, command?}` → `{session_id}`; the shell starts on the first WebSocket.
//! - `GET /pty/{id}` → `{session_id, running, output_offset, exit_code?}`; `DELETE /pty/{id}` ends it.
//! - `GET /pty/{id}/ws[?pty=0][&since=N][&takeover=1]`: a JSON `connected` frame, then binary frames
//!   whose first byte is the channel — `0x01` output (stdout), `0x02` stderr (pipe mode only), `0x03`
//!   replay (an 8-byte big-endian offset, then bytes from it). The client sends stdin as `0x00` + bytes
//!   and JSON text frames `resize {cols, rows}`, `signal {signal}`, `ping`. When the shell ends the
//!   client gets `{"type":"exit","exit_code":N}` and the socket closes.
//! - One WebSocket per session: a second one gets 409 unless it passes `takeover=1`, which closes the
//!   first with code 4001 (`TAKEN_OVER`) and attaches to the same shell.
//!
//! Output is kept (the last [`REPLAY_BYTES`]) so a client that reconnects with `since=` misses nothing.
//!
//! Why one file: one protocol (PTY.md): the handlers, the session state that the attached client
//! and the output pumps share under one lock, and the two ways of starting the shell (a terminal or
//! pipes), which both yield the `Shell` and `Reader`s the rest uses.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use crate::error::{code, ApiError, ApiResult, OptionalJson};
use crate::process::{self, base_env, kill_group, shell, ProcessSpec, Program, StdinMode};
use crate::query::Params;
use crate::AppState;

/// How much output is kept for replay.
pub const REPLAY_BYTES: usize = 1 << 20;

const CH_STDIN: u8 = 0x00;
const CH_STDOUT: u8 = 0x01;
const CH_STDERR: u8 = 0x02;
const CH_REPLAY: u8 = 0x03;
/// Close code sent to a client whose session was taken over.
const TAKEN_OVER: u16 = 4001;

#[derive(Debug, Default, Deserialize)]
pub struct CreatePtyRequest {
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub command: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct PtyStatus {
    pub session_id: String,
    pub running: bool,
    pub output_offset: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

/// Output kept for replay, with absolute offsets.
#[derive(Default)]
struct Scrollback {
    bytes: VecDeque<u8>,
    /// Offset of `bytes[0]` in the whole output.
    start: u64,
}

impl Scrollback {
    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    fn push(&mut self, data: &[u8]) {
        self.bytes.extend(data);
        let excess = self.bytes.len().saturating_sub(REPLAY_BYTES);
        if excess > 0 {
            self.bytes.drain(..excess);
            self.start += excess as u64;
        }
    }

    /// What came at or after `since` (from the oldest kept byte when `since` is older), and its offset.
    fn since(&self, since: u64) -> (u64, Vec<u8>) {
        let from = since.clamp(self.start, self.end());
        let skip = (from - self.start) as usize;
        (from, self.bytes.iter().skip(skip).copied().collect())
    }
}

/// What the attached client is sent.
enum Out {
    Data(u8, Bytes),
    Exit(i32),
    Evicted,
}

/// Where the shell's input goes.
enum Input {
    Pty(Arc<AsyncFd<OwnedFd>>),
    Pipe(tokio::net::unix::pipe::Sender),
}

struct Shell {
    pgid: i32,
    input: tokio::sync::Mutex<Input>,
    /// The terminal, for resizes (None in pipe mode).
    master: Option<Arc<AsyncFd<OwnedFd>>>,
}

#[derive(Default)]
struct State_ {
    shell: Option<Arc<Shell>>,
    exit_code: Option<i32>,
    scrollback: Scrollback,
    /// The attached client: its id and its outbox.
    holder: Option<(u64, mpsc::UnboundedSender<Out>)>,
    next_holder: u64,
    /// Output from before the first client attached (the shell starts as the first WebSocket
    /// opens, and may write before that client is registered): handed to it, channels kept.
    early: Vec<(u8, Bytes)>,
    early_bytes: usize,
}

pub struct PtySession {
    id: String,
    cwd: std::path::PathBuf,
    command: Option<String>,
    state: Mutex<State_>,
}

impl PtySession {
    fn lock(&self) -> MutexGuard<'_, State_> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records output and hands it to the attached client.
    fn output(&self, channel: u8, data: &[u8]) {
        let mut st = self.lock();
        st.scrollback.push(data);
        if let Some((_, tx)) = &st.holder {
            let _ = tx.send(Out::Data(channel, Bytes::copy_from_slice(data)));
        } else if st.next_holder == 0 && st.early_bytes + data.len() <= REPLAY_BYTES {
            st.early_bytes += data.len();
            st.early.push((channel, Bytes::copy_from_slice(data)));
        }
    }

    fn exited(&self, code: i32) {
        let mut st = self.lock();
        st.exit_code = Some(code);
        if let Some((_, tx)) = &st.holder {
            let _ = tx.send(Out::Exit(code));
        }
    }

    fn kill(&self) {
        if let Some(shell) = &self.lock().shell {
            kill_group(shell.pgid, Signal::SIGKILL);
        }
    }
}

#[derive(Default)]
pub struct Ptys {
    map: Mutex<HashMap<String, Arc<PtySession>>>,
}

impl Ptys {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Arc<PtySession>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, id: &str) -> ApiResult<Arc<PtySession>> {
        self.map().get(id).cloned().ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                code::SESSION_NOT_FOUND,
                format!("pty session {id} not found"),
            )
        })
    }

    pub fn kill_all(&self) {
        for s in self.map().values() {
            s.kill();
        }
    }
}

pub async fn create(
    State(app): State<Arc<AppState>>,
    OptionalJson(req): OptionalJson<CreatePtyRequest>,
) -> ApiResult<axum::Json<serde_json::Value>> {
    let cwd = app.resolve(req.cwd.as_deref().unwrap_or(""));
    if !cwd.is_dir() {
        return Err(ApiError::bad_body(format!(
            "working directory {} does not exist or is not a directory",
            cwd.display()
        )));
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let session = Arc::new(PtySession {
        id: id.clone(),
        cwd,
        command: req.command.filter(|c| !c.trim().is_empty()),
        state: Mutex::new(State_::default()),
    });
    app.ptys.map().insert(id.clone(), session);
    Ok(axum::Json(serde_json::json!({ "session_id": id })))
}

pub async fn status(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<axum::Json<PtyStatus>> {
    let s = app.ptys.get(&id)?;
    let st = s.lock();
    Ok(axum::Json(PtyStatus {
        session_id: id,
        running: st.shell.is_some() && st.exit_code.is_none(),
        output_offset: st.scrollback.end(),
        exit_code: st.exit_code,
    }))
}

pub async fn delete(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult<()> {
    let s = app.ptys.get(&id)?;
    app.ptys.map().remove(&id);
    s.kill();
    if let Some((_, tx)) = s.lock().holder.take() {
        let _ = tx.send(Out::Exit(137));
    }
    Ok(())
}

pub async fn ws(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
    upgrade: WebSocketUpgrade,
) -> Response {
    let session = match app.ptys.get(&id) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let q = Params::parse(q.as_deref());
    let pty_mode = !matches!(q.get("pty"), Some("0" | "false"));
    let since = q.get("since").and_then(|s| s.parse::<u64>().ok());
    let takeover = matches!(q.get("takeover"), Some("1" | "true"));
    if session.lock().holder.is_some() && !takeover {
        return ApiError::new(
            StatusCode::CONFLICT,
            code::SESSION_BUSY,
            format!("pty session {id} already has a client (takeover=1 to take it)"),
        )
        .into_response();
    }
    if session.lock().shell.is_none() {
        if let Err(e) = start_shell(&app, &session, pty_mode) {
            return e.into_response();
        }
    }
    upgrade.on_upgrade(move |socket| attach(session, socket, since))
}

/// Starts the session's shell (once) and the task that reads its output.
fn start_shell(app: &AppState, session: &Arc<PtySession>, pty_mode: bool) -> ApiResult<()> {
    let mut st = session.lock();
    if st.shell.is_some() {
        return Ok(());
    }
    let (shell, exit, readers) = if pty_mode {
        spawn_pty(app, session)?
    } else {
        spawn_pipes(app, session)?
    };
    let shell = Arc::new(shell);
    st.shell = Some(shell);
    drop(st);
    let s = session.clone();
    tokio::spawn(async move {
        let pumps: Vec<_> = readers
            .into_iter()
            .map(|r| tokio::spawn(pump(s.clone(), r)))
            .collect();
        let code = exit.await.map(|e| e.shell_code()).unwrap_or(-1);
        // The output that was written before the exit still comes through the pumps.
        for p in pumps {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), p).await;
        }
        tracing::info!(pty = %s.id, code, "pty shell exited");
        s.exited(code);
    });
    Ok(())
}

enum Reader {
    Pty(Arc<AsyncFd<OwnedFd>>),
    Pipe(u8, tokio::net::unix::pipe::Receiver),
}

async fn pump(session: Arc<PtySession>, reader: Reader) {
    let mut buf = vec![0u8; 32 * 1024];
    match reader {
        Reader::Pty(fd) => loop {
            let n = match fd.readable().await {
                Ok(mut guard) => match guard.try_io(|inner| {
                    nix::unistd::read(inner.get_ref().as_raw_fd(), &mut buf)
                        .map_err(std::io::Error::from)
                }) {
                    Ok(r) => r,
                    Err(_would_block) => continue,
                },
                Err(_) => break,
            };
            match n {
                // EIO once every slave end is closed: the shell and its children are gone.
                Ok(0) | Err(_) => break,
                Ok(n) => session.output(CH_STDOUT, &buf[..n]),
            }
        },
        Reader::Pipe(channel, mut pipe) => loop {
            match pipe.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => session.output(channel, &buf[..n]),
            }
        },
    }
}

type Started = (Shell, oneshot::Receiver<crate::reaper::Exit>, Vec<Reader>);

fn program(session: &PtySession) -> Vec<String> {
    let sh = shell().to_string();
    match &session.command {
        Some(c) => vec![sh, "-c".into(), c.clone()],
        None => vec![sh, "-i".into()],
    }
}

fn spawn_pty(app: &AppState, session: &PtySession) -> ApiResult<Started> {
    let size = nix::pty::Winsize {
        ws_row: 24,
        ws_col: 80,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(Some(&size), None)
        .map_err(|e| ApiError::runtime(format!("opening a terminal: {e}")))?;
    // Non-blocking on our side only; the shell's end (the slave) stays blocking.
    let flags = nix::fcntl::fcntl(pty.master.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)
        .map_err(|e| ApiError::runtime(format!("terminal flags: {e}")))?;
    nix::fcntl::fcntl(
        pty.master.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFL(
            nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK,
        ),
    )
    .map_err(|e| ApiError::runtime(format!("terminal flags: {e}")))?;
    let argv = program(session);
    let mut env = base_env();
    env.entry("TERM".into())
        .or_insert_with(|| "xterm-256color".into());
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .current_dir(&session.cwd)
        .env_clear()
        .envs(env);
    let slave = |what| {
        pty.slave
            .try_clone()
            .map_err(|e| ApiError::runtime(format!("terminal {what}: {e}")))
    };
    cmd.stdin(slave("stdin")?)
        .stdout(slave("stdout")?)
        .stderr(slave("stderr")?);
    // SAFETY: only async-signal-safe calls between fork and exec: a new session (so the group
    // leader's pgid is its pid) with the terminal on fd 0 as its controlling terminal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let spawned = app
        .reaper
        .spawn(&mut cmd)
        .map_err(|e| ApiError::runtime(format!("starting {}: {e}", argv[0])))?;
    drop(cmd);
    drop(pty.slave);
    let pid = i32::try_from(spawned.child.id()).unwrap_or(i32::MAX);
    // SAFETY: an OwnedFd stays open, and is the same descriptor, for as long as the AsyncFd owns it.
    let master = match unsafe { AsyncFd::register(pty.master) } {
        Ok(fd) => Arc::new(fd),
        Err(e) => {
            kill_group(pid, Signal::SIGKILL);
            return Err(ApiError::runtime(format!("terminal: {e}")));
        }
    };
    Ok((
        Shell {
            pgid: pid,
            input: tokio::sync::Mutex::new(Input::Pty(master.clone())),
            master: Some(master.clone()),
        },
        spawned.exit,
        vec![Reader::Pty(master)],
    ))
}

fn spawn_pipes(app: &AppState, session: &PtySession) -> ApiResult<Started> {
    let spec = ProcessSpec {
        program: Program::Argv(program(session)),
        cwd: session.cwd.clone(),
        envs: Default::default(),
        uid: None,
        gid: None,
        combine_output: false,
    };
    let running = process::spawn(&app.reaper, &spec, StdinMode::Piped)
        .map_err(|e| ApiError::runtime(e.full_message()))?;
    let (Some(stdin), Some(stdout), Some(stderr)) = (running.stdin, running.stdout, running.stderr)
    else {
        kill_group(running.pid, Signal::SIGKILL);
        return Err(ApiError::runtime("the shell has no pipes"));
    };
    Ok((
        Shell {
            pgid: running.pid,
            input: tokio::sync::Mutex::new(Input::Pipe(stdin)),
            master: None,
        },
        running.exit,
        vec![
            Reader::Pipe(CH_STDOUT, stdout),
            Reader::Pipe(CH_STDERR, stderr),
        ],
    ))
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum Control {
    Resize { cols: u16, rows: u16 },
    Signal { signal: String },
    Ping,
}

/// Serves one attached client until it leaves, is taken over, or the shell ends.
async fn attach(session: Arc<PtySession>, mut socket: WebSocket, since: Option<u64>) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (me, replay, early, exit_code, shell) = {
        let mut st = session.lock();
        let early = std::mem::take(&mut st.early);
        if let Some((_, old)) = st.holder.take() {
            let _ = old.send(Out::Evicted);
        }
        st.next_holder += 1;
        let me = st.next_holder;
        st.holder = Some((me, tx));
        let replay = since.map(|s| st.scrollback.since(s));
        (me, replay, early, st.exit_code, st.shell.clone())
    };
    let connected = serde_json::json!({"type": "connected", "session_id": session.id});
    if socket
        .send(Message::Text(connected.to_string().into()))
        .await
        .is_err()
    {
        release(&session, me);
        return;
    }
    if let Some((offset, bytes)) = replay {
        let mut frame = Vec::with_capacity(9 + bytes.len());
        frame.push(CH_REPLAY);
        frame.extend_from_slice(&offset.to_be_bytes());
        frame.extend_from_slice(&bytes);
        let _ = socket.send(Message::Binary(frame.into())).await;
    }
    for (channel, data) in early {
        let mut frame = Vec::with_capacity(1 + data.len());
        frame.push(channel);
        frame.extend_from_slice(&data);
        let _ = socket.send(Message::Binary(frame.into())).await;
    }
    if let Some(code) = exit_code {
        send_exit(&mut socket, code).await;
        release(&session, me);
        return;
    }
    loop {
        tokio::select! {
            out = rx.recv() => match out {
                Some(Out::Data(channel, data)) => {
                    let mut frame = Vec::with_capacity(1 + data.len());
                    frame.push(channel);
                    frame.extend_from_slice(&data);
                    if socket.send(Message::Binary(frame.into())).await.is_err() {
                        break;
                    }
                }
                Some(Out::Exit(code)) => {
                    send_exit(&mut socket, code).await;
                    break;
                }
                Some(Out::Evicted) => {
                    let _ = socket.send(Message::Close(Some(CloseFrame {
                        code: TAKEN_OVER,
                        reason: "TAKEN_OVER".into(),
                    }))).await;
                    return; // the new holder is registered already
                }
                None => break,
            },
            msg = socket.recv() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    if let (Some(shell), Some((&CH_STDIN, data))) = (&shell, b.split_first()) {
                        if write_input(shell, data).await.is_err() {
                            break;
                        }
                    }
                }
                Some(Ok(Message::Text(t))) => {
                    match serde_json::from_str::<Control>(&t) {
                        Ok(Control::Resize { cols, rows }) => {
                            if let Some(shell) = &shell {
                                resize(shell, cols, rows);
                            }
                        }
                        Ok(Control::Signal { signal }) => {
                            if let (Some(shell), Some(sig)) = (&shell, parse_signal(&signal)) {
                                kill_group(foreground_group(shell), sig);
                            }
                        }
                        Ok(Control::Ping) => {
                            let _ = socket.send(Message::Text(r#"{"type":"pong"}"#.into())).await;
                        }
                        Err(e) => {
                            let err = serde_json::json!({"type": "error", "message": format!("bad control frame: {e}")});
                            let _ = socket.send(Message::Text(err.to_string().into())).await;
                        }
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
        }
    }
    release(&session, me);
}

async fn send_exit(socket: &mut WebSocket, code: i32) {
    let exit = serde_json::json!({"type": "exit", "exit_code": code});
    let _ = socket.send(Message::Text(exit.to_string().into())).await;
    let _ = socket.send(Message::Close(None)).await;
}

/// Forgets the holder if it is still `me` (a takeover may have replaced it).
fn release(session: &PtySession, me: u64) {
    let mut st = session.lock();
    if st.holder.as_ref().is_some_and(|(id, _)| *id == me) {
        st.holder = None;
    }
}

async fn write_input(shell: &Shell, data: &[u8]) -> std::io::Result<()> {
    match &mut *shell.input.lock().await {
        Input::Pipe(p) => p.write_all(data).await,
        Input::Pty(fd) => {
            let mut rest = data;
            while !rest.is_empty() {
                let mut guard = fd.writable().await?;
                match guard.try_io(|inner| {
                    nix::unistd::write(inner.get_ref(), rest).map_err(std::io::Error::from)
                }) {
                    Ok(Ok(n)) => rest = &rest[n..],
                    Ok(Err(e)) => return Err(e),
                    Err(_would_block) => continue,
                }
            }
            Ok(())
        }
    }
}

fn resize(shell: &Shell, cols: u16, rows: u16) {
    let Some(master) = &shell.master else { return };
    let size = libc::winsize {
        ws_row: rows.max(1),
        ws_col: cols.max(1),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize struct that lives for the call. The kernel sends
    // SIGWINCH to the terminal's foreground group.
    unsafe { libc::ioctl(master.get_ref().as_raw_fd(), libc::TIOCSWINSZ, &size) };
}

/// Who a signal is for: the terminal's foreground job (what Ctrl-C would hit), else the shell's group.
fn foreground_group(shell: &Shell) -> i32 {
    if let Some(master) = &shell.master {
        // SAFETY: tcgetpgrp only reads the terminal's foreground process group.
        let pgid = unsafe { libc::tcgetpgrp(master.get_ref().as_raw_fd()) };
        if pgid > 1 {
            return pgid;
        }
    }
    shell.pgid
}

fn parse_signal(name: &str) -> Option<Signal> {
    let upper = name.to_ascii_uppercase();
    let full = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    full.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrollback_keeps_the_tail_with_offsets() {
        let mut s = Scrollback::default();
        s.push(b"hello ");
        s.push(b"world");
        assert_eq!(s.since(6), (6, b"world".to_vec()));
        assert_eq!(s.since(99), (11, Vec::new()));
        let big = vec![b'x'; REPLAY_BYTES];
        s.push(&big);
        assert_eq!(s.start, 11);
        assert_eq!(s.end(), 11 + REPLAY_BYTES as u64);
        assert_eq!(
            s.since(0).0,
            11,
            "older than kept: from the oldest kept byte"
        );
    }

    #[test]
    fn signal_names() {
        assert_eq!(parse_signal("SIGINT"), Some(Signal::SIGINT));
        assert_eq!(parse_signal("term"), Some(Signal::SIGTERM));
        assert_eq!(parse_signal("nope"), None);
    }
}
