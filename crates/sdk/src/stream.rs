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
///
/// Command and session output comes one line per event without its terminator (the protocol's
/// framing; an empty line is `"\n"`): this stream gives each such line back with a `\n`, so the
/// texts put together are the output (a `\r` or `\r\n` reads as `\n`, and a last line without one
/// gets one). Code output is the kernel's text as it was sent.
pub struct EventStream {
    body: ByteStream,
    buf: BytesMut,
    done: bool,
    framing: Framing,
}

/// How the server framed the output events of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// One event per line, its terminator removed (`/command`, `/session/{id}/run`).
    Lines,
    /// The text as produced (`/code`).
    Raw,
}

impl EventStream {
    pub(crate) fn new(resp: reqwest::Response, framing: Framing) -> Self {
        Self {
            body: Box::pin(resp.bytes_stream()),
            buf: BytesMut::new(),
            done: false,
            framing,
        }
    }

    /// The event as this stream hands it out (see the type's documentation).
    fn unframe(&self, mut ev: StreamEvent) -> StreamEvent {
        let output = matches!(ev.kind, EventKind::Stdout | EventKind::Stderr);
        if self.framing == Framing::Lines && output {
            if let Some(text) = ev.text.as_mut().filter(|t| t.as_str() != "\n") {
                text.push('\n');
            }
        }
        ev
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
                    return Poll::Ready(Some(ev.map(|ev| self.unframe(ev))));
                }
            }
            if self.done {
                // A last event without a trailing newline.
                if self.buf.has_remaining() {
                    let rest = std::mem::take(&mut self.buf);
                    if let Some(ev) = parse_line(&rest) {
                        return Poll::Ready(Some(ev.map(|ev| self.unframe(ev))));
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

    /// A stream of the given event lines, as a server would send it.
    fn stream_of(lines: &[&str], framing: Framing) -> EventStream {
        let body = lines.iter().map(|l| format!("{l}\n\n")).collect::<String>();
        EventStream::new(http::Response::new(body).into(), framing)
    }

    #[tokio::test]
    async fn line_events_read_back_as_the_output() {
        let events = [
            r#"{"type":"init","timestamp":1,"text":"c1"}"#,
            r#"{"type":"stdout","timestamp":1,"text":"a"}"#,
            r#"{"type":"stdout","timestamp":1,"text":"\n"}"#,
            r#"{"type":"stderr","timestamp":1,"text":"oops"}"#,
            r#"{"type":"stdout","timestamp":1,"text":"b"}"#,
            r#"{"type":"execution_complete","timestamp":1,"execution_time":3}"#,
        ];
        let out = stream_of(&events, Framing::Lines)
            .collect_output()
            .await
            .expect("output");
        assert_eq!(
            (out.stdout.as_str(), out.stderr.as_str()),
            ("a\n\nb\n", "oops\n")
        );
        assert_eq!(out.id.as_deref(), Some("c1"));
        // Code output is the kernel's text as sent.
        let out = stream_of(&events, Framing::Raw)
            .collect_output()
            .await
            .expect("output");
        assert_eq!(out.stdout, "a\nb");
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
