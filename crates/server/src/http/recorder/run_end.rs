//! A run's end, read from execd's answer as it passes to the caller.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use serde_json::{json, Value};

use super::Watch;
use crate::timeline::Timeline;

/// The longest event line read for a run's end (`error` events carry a traceback).
const MAX_LINE: usize = 64 << 10;

/// Reads a run's answer (execd's events: one JSON object per line) for its id, its end and its
/// exit code, and records `command.exit` when the answer ends. Most lines are output: each is
/// told by its first bytes and skipped unread and uncopied, so a run printing megabytes costs the
/// recorder a scan for newlines.
pub(super) struct RunEnd {
    timeline: Arc<Timeline>,
    /// The number of the run's `command` event.
    of: u64,
    started: Instant,
    background: bool,
    /// The current line: its first [`HEAD`] bytes, or all of it once it is one to read.
    line: Vec<u8>,
    state: LineState,
    /// execd's id for the run (its `init` event's text).
    id: Option<String>,
    /// `Some(Some(code))` once the run ended with a code; `Some(None)` ended without one.
    exit: Option<Option<i64>>,
    recorded: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum LineState {
    /// Its first bytes are being gathered.
    Head,
    /// An event to read (`init`, `error`): kept whole, up to [`MAX_LINE`].
    Keep,
    /// Output, or a line too long: passed by.
    Skip,
}

/// Bytes enough to tell an event's type (`{"type":"execution_complete"` is 28).
const HEAD: usize = 32;
const INIT: &[u8] = br#"{"type":"init""#;
const ERROR: &[u8] = br#"{"type":"error""#;
const COMPLETE: &[u8] = br#"{"type":"execution_complete""#;

impl RunEnd {
    pub(super) fn new(
        timeline: Arc<Timeline>,
        of: u64,
        started: Instant,
        background: bool,
    ) -> Self {
        Self {
            timeline,
            of,
            started,
            background,
            line: Vec::with_capacity(HEAD),
            state: LineState::Head,
            id: None,
            exit: None,
            recorded: false,
        }
    }

    /// Part of the current line.
    fn take(&mut self, part: &[u8]) {
        match self.state {
            LineState::Skip => {}
            LineState::Keep if self.line.len() + part.len() > MAX_LINE => {
                // Too long to read whole (an error's long traceback): the run failed, its code
                // unread.
                if self.line.starts_with(ERROR) {
                    self.exit = Some(None);
                }
                self.state = LineState::Skip;
                self.line = Vec::with_capacity(HEAD);
            }
            LineState::Keep => self.line.extend_from_slice(part),
            LineState::Head => {
                let room = HEAD - self.line.len();
                self.line.extend_from_slice(&part[..part.len().min(room)]);
                if self.line.len() == HEAD {
                    self.state = if self.line.starts_with(INIT) || self.line.starts_with(ERROR) {
                        LineState::Keep
                    } else {
                        if self.line.starts_with(COMPLETE) {
                            self.exit = Some(Some(0));
                        }
                        LineState::Skip
                    };
                    if self.state == LineState::Keep {
                        self.take(&part[room..]);
                    }
                }
            }
        }
    }

    fn line_done(&mut self) {
        let state = std::mem::replace(&mut self.state, LineState::Head);
        if state == LineState::Skip || self.line.is_empty() {
            self.line.clear();
            return;
        }
        let line = std::mem::take(&mut self.line);
        if line.starts_with(INIT) {
            self.id = serde_json::from_slice::<Value>(&line)
                .ok()
                .and_then(|v| v.get("text").and_then(Value::as_str).map(str::to_owned));
        } else if line.starts_with(COMPLETE) {
            self.exit = Some(Some(0));
        } else if line.starts_with(ERROR) {
            let evalue = serde_json::from_slice::<warren_api::execd::StreamEvent>(&line)
                .ok()
                .and_then(|e| e.error)
                .map(|e| e.evalue);
            self.exit = Some(evalue.and_then(|v| v.trim().parse().ok()));
        }
    }
}

impl Watch for RunEnd {
    fn data(&mut self, data: &Bytes) {
        let mut rest = &data[..];
        while let Some(i) = memchr::memchr(b'\n', rest) {
            self.take(&rest[..i]);
            self.line_done();
            rest = &rest[i + 1..];
        }
        self.take(rest);
    }

    fn ended(&mut self, whole: bool) {
        if std::mem::replace(&mut self.recorded, true) {
            return;
        }
        self.line_done();
        let outcome = match (self.exit, whole) {
            (Some(_), _) if self.background => "detached",
            (Some(Some(0)), _) => "completed",
            (Some(_), _) => "failed",
            // The caller went away before the end: execd stops what it started.
            (None, false) => "disconnected",
            (None, true) => "unfinished",
        };
        let mut detail = json!({
            "of": self.of,
            "outcome": outcome,
            "durationMs": self.started.elapsed().as_millis() as u64,
        });
        if let Some(Some(code)) = self.exit {
            detail["exitCode"] = code.into();
        }
        if let Some(id) = self.id.take() {
            detail["id"] = id.into();
        }
        self.timeline.record("command.exit", detail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::Settings;

    fn run_end(t: &Arc<Timeline>) -> RunEnd {
        RunEnd::new(t.clone(), 1, Instant::now(), false)
    }

    fn last(t: &Timeline) -> Value {
        let page = t.read(0);
        serde_json::from_str(page.lines.last().expect("an event")).expect("json")
    }

    #[test]
    fn a_failed_run_is_read_across_chunks_and_output_that_looks_like_events_is_not() {
        let t = Arc::new(Timeline::new(Arc::new(Settings::default())));
        let mut w = run_end(&t);
        let stream = concat!(
            "{\"type\":\"init\",\"text\":\"cmd-7\",\"timestamp\":1}\n\n",
            "{\"type\":\"stdout\",\"text\":\"{\\\"type\\\":\\\"execution_complete\\\"}\",\"timestamp\":2}\n\n",
            "{\"type\":\"error\",\"error\":{\"ename\":\"CommandExecError\",\"evalue\":\"3\",\"traceback\":[]},\"timestamp\":3}\n\n"
        );
        for chunk in stream.as_bytes().chunks(7) {
            w.data(&Bytes::copy_from_slice(chunk));
        }
        w.ended(true);
        let e = last(&t);
        assert_eq!(e["kind"], "command.exit");
        assert_eq!(e["exitCode"], 3);
        assert_eq!(e["outcome"], "failed");
        assert_eq!(e["id"], "cmd-7");
        // Recorded once, however the body ends after.
        w.ended(false);
        assert_eq!(t.read(0).lines.len(), 1);
    }

    #[test]
    fn a_run_cut_short_is_disconnected_and_long_output_lines_are_skipped() {
        let t = Arc::new(Timeline::new(Arc::new(Settings::default())));
        let mut w = run_end(&t);
        let long = format!(
            "{{\"type\":\"stdout\",\"text\":\"{}\"}}\n\n",
            "x".repeat(3 * MAX_LINE)
        );
        w.data(&Bytes::from(long));
        assert!(
            w.line.len() <= HEAD,
            "nothing past an output line's head is kept"
        );
        w.ended(false);
        let e = last(&t);
        assert_eq!(e["outcome"], "disconnected");
        assert!(e.get("exitCode").is_none());
    }
}
