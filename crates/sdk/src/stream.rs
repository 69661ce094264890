//! The event stream of `/command`, `/session/{id}/run` and `/code`: one JSON object per line, blank
//! lines between events (some servers prefix `data:`), read as the bytes arrive.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use warren_api::execd::{EventKind, StreamEvent};

use crate::error::{Error, Result};

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// A stream of [`StreamEvent`]s. Keep-alive `ping` events are skipped. It ends when the server closes
/// the stream, which execd does the moment the command or cell ends.
pub struct EventStream {
    body: ByteStream,
    buf: BytesMut,
    done: bool,
}

impl EventStream {
    pub(crate) fn new(resp: reqwest::Response) -> Self {
        Self {
            body: Box::pin(resp.bytes_stream()),
            buf: BytesMut::new(),
            done: false,
        }
    }

    /// Reads the stream to its end, collecting output and the outcome.
    pub async fn collect_output(mut self) -> Result<Output> {
        let mut out = Output::default();
        let mut ended = false;
        while let Some(ev) = self.next().await {
            let ev = ev?;
            ended |= out.absorb(&ev);
        }
        if !ended {
            return Err(Error::Protocol(
                "the output stream ended without execution_complete or error".into(),
            ));
        }
        Ok(out)
    }

    /// The next complete line of the buffer, if there is one.
    fn next_line(&mut self) -> Option<Bytes> {
        let pos = self.buf.iter().position(|b| *b == b'\n')?;
        let line = self.buf.split_to(pos + 1).freeze();
        Some(line)
    }
}

/// Parses one line; `None` for blank lines, pings and lines that are not events.
fn parse_line(line: &[u8]) -> Option<Result<StreamEvent>> {
    let text = std::str::from_utf8(line).ok()?.trim();
    let text = text.strip_prefix("data:").unwrap_or(text).trim();
    if text.is_empty() {
        return None;
    }
    match serde_json::from_str::<StreamEvent>(text) {
        Ok(ev) if ev.kind == EventKind::Ping => None,
        Ok(ev) => Some(Ok(ev)),
        Err(e) => Some(Err(Error::Protocol(format!(
            "bad event line {text:?}: {e}"
        )))),
    }
}

impl Stream for EventStream {
    type Item = Result<StreamEvent>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            while let Some(line) = self.next_line() {
                if let Some(ev) = parse_line(&line) {
                    return Poll::Ready(Some(ev));
                }
            }
            if self.done {
                // A last event without a trailing newline.
                if self.buf.has_remaining() {
                    let rest = std::mem::take(&mut self.buf);
                    if let Some(ev) = parse_line(&rest) {
                        return Poll::Ready(Some(ev));
                    }
                }
                return Poll::Ready(None);
            }
            match self.body.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(chunk))) => self.buf.extend_from_slice(&chunk),
                Poll::Ready(Some(Err(e))) => {
                    self.done = true;
                    self.buf.clear();
                    return Poll::Ready(Some(Err(Error::Broken(e))));
                }
                Poll::Ready(None) => self.done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// What a command or code run produced, collected.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
    /// 0 when the run completed; the command's exit code (or 1 for a code error) otherwise.
    pub exit_code: i32,
    /// The error event of a failed run: for commands `evalue` is the exit code, for code the
    /// exception (`ename`, `evalue`, `traceback`).
    pub error: Option<warren_api::execd::ExecError>,
    /// Rich results of a code run (`text/plain`, `image/png` base64, …), in order.
    pub results: Vec<std::collections::BTreeMap<String, serde_json::Value>>,
    /// The context (code) or command id from the `init` event.
    pub id: Option<String>,
}

impl Output {
    /// Adds one event; true once the run's outcome (complete or error) has been seen.
    pub fn absorb(&mut self, ev: &StreamEvent) -> bool {
        match ev.kind {
            EventKind::Init => self.id = ev.text.clone(),
            EventKind::Stdout => self.stdout.push_str(ev.text.as_deref().unwrap_or("")),
            EventKind::Stderr => self.stderr.push_str(ev.text.as_deref().unwrap_or("")),
            EventKind::Result => {
                if let Some(r) = &ev.results {
                    self.results.push(r.clone());
                }
            }
            EventKind::Error => {
                self.exit_code = ev
                    .error
                    .as_ref()
                    .and_then(|e| e.evalue.trim().parse().ok())
                    .unwrap_or(1);
                self.error = ev.error.clone();
                return true;
            }
            EventKind::ExecutionComplete => return true,
            _ => {}
        }
        false
    }

    /// True when the run completed without an error event.
    pub fn success(&self) -> bool {
        self.error.is_none() && self.exit_code == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_prefixes() {
        let ev = parse_line(br#"data: {"type":"stdout","timestamp":1,"text":"hi\n"}"#)
            .and_then(|r| r.ok());
        assert_eq!(ev.map(|e| e.text), Some(Some("hi\n".to_string())));
        assert!(parse_line(b"\n").is_none());
        assert!(parse_line(br#"{"type":"ping","timestamp":1}"#).is_none());
        assert!(matches!(
            parse_line(b"{nope"),
            Some(Err(Error::Protocol(_)))
        ));
    }

    #[test]
    fn output_takes_exit_code_from_error() {
        let mut out = Output::default();
        let ev: StreamEvent = serde_json::from_str(
            r#"{"type":"error","timestamp":1,"error":{"ename":"CommandExecError","evalue":"3","traceback":[]}}"#,
        )
        .expect("event");
        assert!(out.absorb(&ev));
        assert_eq!(out.exit_code, 3);
        assert!(!out.success());
    }
}
