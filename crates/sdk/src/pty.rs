//! Interactive terminals (`/pty`): a shell inside the sandbox driven over a WebSocket, as execd's
//! PTY protocol defines it. [`Sandbox::create_pty`] makes a session; [`Sandbox::attach_pty`] connects
//! (the shell starts on the first connection); [`Pty::split`] gives a writer for keystrokes, resizes and
//! signals and a reader of output, so both can run at once.

use bytes::Bytes;
use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

use crate::client::{json, send};
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How to attach.
#[derive(Debug, Clone, Default)]
pub struct PtyOptions {
    /// Pipes instead of a terminal: stdout and stderr come apart, no TTY (only when this attach
    /// starts the shell).
    pub pipe: bool,
    /// Replay output from this byte offset first (after a reconnect).
    pub since: Option<u64>,
    /// Take the session from the client that holds it (it is disconnected) instead of a 409.
    pub takeover: bool,
}

/// What a terminal sends.
#[derive(Debug, Clone, PartialEq)]
pub enum PtyEvent {
    /// Terminal output (stdout in pipe mode).
    Output(Bytes),
    /// stderr, in pipe mode only.
    Stderr(Bytes),
    /// Output from before this connection, starting at `offset`.
    Replay { offset: u64, data: Bytes },
    /// The shell ended.
    Exit(i32),
    /// Another client took the session over.
    TakenOver,
    /// Any other JSON frame (`connected`, `pong`, `error`).
    Control(serde_json::Value),
}

/// The session's state.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PtyStatus {
    pub session_id: String,
    pub running: bool,
    pub output_offset: u64,
    #[serde(default)]
    pub exit_code: Option<i32>,
}

/// A connected terminal.
pub struct Pty {
    ws: Ws,
}

/// Sends keystrokes and control messages.
pub struct PtyWriter {
    sink: SplitSink<Ws, Message>,
}

/// Receives output.
pub struct PtyReader {
    stream: SplitStream<Ws>,
}

impl Sandbox {
    /// Creates a terminal session (`command` instead of an interactive shell when given).
    pub async fn create_pty(&self, cwd: Option<&str>, command: Option<&str>) -> Result<String> {
        #[derive(Deserialize)]
        struct Created {
            session_id: String,
        }
        let (r, url) = self.execd_call(reqwest::Method::POST, "/pty");
        let body = serde_json::json!({ "cwd": cwd, "command": command });
        let c: Created = json(send(r.json(&body), &url).await?).await?;
        Ok(c.session_id)
    }

    pub async fn pty_status(&self, id: &str) -> Result<PtyStatus> {
        let (r, url) = self.execd_call(reqwest::Method::GET, &format!("/pty/{id}"));
        json(send(r, &url).await?).await
    }

    /// Ends a terminal session and its processes.
    pub async fn delete_pty(&self, id: &str) -> Result<()> {
        let (r, url) = self.execd_call(reqwest::Method::DELETE, &format!("/pty/{id}"));
        send(r, &url).await?;
        Ok(())
    }

    /// Connects to a terminal session.
    pub async fn attach_pty(&self, id: &str, opts: &PtyOptions) -> Result<Pty> {
        let (base, headers) = self.execd_ws_base();
        let mut query = Vec::new();
        if opts.pipe {
            query.push("pty=0".to_string());
        }
        if let Some(s) = opts.since {
            query.push(format!("since={s}"));
        }
        if opts.takeover {
            query.push("takeover=1".to_string());
        }
        let mut url = format!("{base}/pty/{id}/ws");
        if !query.is_empty() {
            url = format!("{url}?{}", query.join("&"));
        }
        let mut req = url
            .as_str()
            .into_client_request()
            .map_err(|e| Error::WebSocket(e.to_string()))?;
        for (k, v) in headers {
            req.headers_mut().insert(k.clone(), v.clone());
        }
        let (ws, _) = tokio_tungstenite::connect_async(req)
            .await
            .map_err(|e| handshake_error(&url, e))?;
        Ok(Pty { ws })
    }
}

fn handshake_error(url: &str, e: tungstenite::Error) -> Error {
    match e {
        tungstenite::Error::Http(resp) => {
            let status = resp.status().as_u16();
            let body = resp.body().as_deref().unwrap_or_default();
            match serde_json::from_slice::<warren_api::ErrorBody>(body) {
                Ok(b) => Error::Api {
                    status,
                    code: b.code,
                    message: b.message,
                },
                Err(_) => Error::Api {
                    status,
                    code: String::new(),
                    message: format!("HTTP {status} opening {url}"),
                },
            }
        }
        tungstenite::Error::Io(io) => Error::Io(io),
        other => Error::WebSocket(other.to_string()),
    }
}

fn control(v: serde_json::Value) -> Message {
    Message::Text(v.to_string().into())
}

impl Pty {
    pub fn split(self) -> (PtyWriter, PtyReader) {
        let (sink, stream) = self.ws.split();
        (PtyWriter { sink }, PtyReader { stream })
    }
}

impl PtyWriter {
    /// Sends input (keystrokes, pasted text) to the shell.
    pub async fn write(&mut self, data: &[u8]) -> Result<()> {
        let mut frame = Vec::with_capacity(1 + data.len());
        frame.push(0u8);
        frame.extend_from_slice(data);
        self.send(Message::Binary(frame.into())).await
    }

    /// Tells the terminal its new size (the shell's foreground job gets SIGWINCH).
    pub async fn resize(&mut self, cols: u16, rows: u16) -> Result<()> {
        self.send(control(
            serde_json::json!({"type": "resize", "cols": cols, "rows": rows}),
        ))
        .await
    }

    /// Sends a signal (`SIGINT`, `TERM`, …) to the shell's process group.
    pub async fn signal(&mut self, name: &str) -> Result<()> {
        self.send(control(
            serde_json::json!({"type": "signal", "signal": name}),
        ))
        .await
    }

    pub async fn ping(&mut self) -> Result<()> {
        self.send(control(serde_json::json!({"type": "ping"})))
            .await
    }

    /// Closes this connection; the shell keeps running until the session is deleted.
    pub async fn close(mut self) -> Result<()> {
        self.send(Message::Close(None)).await
    }

    async fn send(&mut self, m: Message) -> Result<()> {
        self.sink
            .send(m)
            .await
            .map_err(|e| Error::WebSocket(e.to_string()))
    }
}

impl PtyReader {
    /// The next event; `None` once the connection is closed.
    pub async fn next(&mut self) -> Option<Result<PtyEvent>> {
        loop {
            let msg = match self.stream.next().await? {
                Ok(m) => m,
                Err(e) => return Some(Err(Error::WebSocket(e.to_string()))),
            };
            match msg {
                Message::Binary(b) => {
                    let Some((&channel, _)) = b.split_first() else {
                        continue;
                    };
                    return Some(Ok(match channel {
                        0x01 => PtyEvent::Output(b.slice(1..)),
                        0x02 => PtyEvent::Stderr(b.slice(1..)),
                        0x03 if b.len() >= 9 => {
                            let mut off = [0u8; 8];
                            off.copy_from_slice(&b[1..9]);
                            PtyEvent::Replay {
                                offset: u64::from_be_bytes(off),
                                data: b.slice(9..),
                            }
                        }
                        _ => continue,
                    }));
                }
                Message::Text(t) => {
                    let v: serde_json::Value = match serde_json::from_str(&t) {
                        Ok(v) => v,
                        Err(_) => continue,
                    };
                    if v["type"] == "exit" {
                        let code = v["exit_code"].as_i64().unwrap_or(-1);
                        return Some(Ok(PtyEvent::Exit(i32::try_from(code).unwrap_or(-1))));
                    }
                    return Some(Ok(PtyEvent::Control(v)));
                }
                Message::Close(Some(f)) if u16::from(f.code) == 4001 => {
                    return Some(Ok(PtyEvent::TakenOver))
                }
                Message::Close(_) => return None,
                _ => continue,
            }
        }
    }
}
