//! What the endpoint proxy writes on a sandbox's timeline (see `timeline`) for the calls it
//! relays to execd: each command, session or isolated run and code cell (its text, then its exit
//! code and duration, read from the event stream as it passes), each file change (upload,
//! delete, move, replace, permissions, directories), terminals made (and, in `terminal`, what is
//! typed into them), and a GUI agent's desktop actions (launches, clicks, keys, typed text). The proxy sees every call an SDK, the CLI or
//! a signed URL makes, and nothing inside the sandbox can reach the recorder: what execd is asked
//! to do is recorded here, not what execd says it did.
//!
//! Bodies are looked at as they stream past, never held back: a run's JSON body (its first
//! [`MAX_BODY`] bytes) is copied as execd reads it, an upload's multipart body is searched for its
//! `metadata` parts (`upload`), and a run's answer is read line by line for its end.

use std::sync::{Arc, Mutex as StdMutex};
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use serde_json::{json, Value};

use crate::timeline::Timeline;

pub(crate) mod terminal;
mod upload;

/// The boundary of a `multipart/form-data` content type (`boundary=…`, quoted or not).
fn multipart_boundary(content_type: &str) -> Option<String> {
    let (mime, params) = content_type.split_once(';')?;
    if !mime.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.split(';').find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"').to_string())
            .filter(|b| !b.is_empty() && b.len() <= 70)
    })
}

/// The most of a request body copied for the record (runs' and file calls' JSON bodies are small;
/// a longer one is recorded as cut).
const MAX_BODY: usize = 1 << 20;
/// The longest event line read for a run's end (`error` events carry a traceback).
const MAX_LINE: usize = 64 << 10;
/// Paths one file event lists at most.
const MAX_PATHS: usize = 100;

/// A call to execd the recorder writes down.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    /// `POST /command`, `/session/{id}/run`, `/v1/isolated/session/{id}/run`: `via` says which.
    Run { via: &'static str },
    /// `POST /code`.
    Code,
    /// `POST /files/upload`.
    Upload,
    /// `DELETE /files` or `/directories` (`?path=`).
    Delete { directory: bool },
    /// `POST /files/mv`.
    Move,
    /// `POST /files/replace`, `/files/permissions`, `/directories`: a JSON object keyed by path.
    Change { op: &'static str },
    /// `POST /desktop/launch`.
    Launch,
    /// `POST /desktop/mouse` or `/desktop/keyboard`: a GUI agent's action (`op` says which).
    Desktop { op: &'static str },
    /// `POST /pty`: a terminal made (its `command` runs when its WebSocket opens).
    Pty,
}

fn classify(method: &http::Method, path: &str) -> Option<Call> {
    use http::Method;
    let path = path.trim_matches('/');
    let segs: Vec<&str> = path.split('/').collect();
    match (method, segs.as_slice()) {
        (&Method::POST, ["command"]) => Some(Call::Run { via: "command" }),
        (&Method::POST, ["session", _, "run"]) => Some(Call::Run { via: "session" }),
        (&Method::POST, ["v1", "isolated", "session", _, "run"]) => {
            Some(Call::Run { via: "isolated" })
        }
        (&Method::POST, ["code"]) => Some(Call::Code),
        (&Method::POST, ["files", "upload"]) => Some(Call::Upload),
        (&Method::DELETE, ["files"]) => Some(Call::Delete { directory: false }),
        (&Method::DELETE, ["directories"]) => Some(Call::Delete { directory: true }),
        (&Method::POST, ["files", "mv"]) => Some(Call::Move),
        (&Method::POST, ["files", "replace"]) => Some(Call::Change { op: "replace" }),
        (&Method::POST, ["files", "permissions"]) => Some(Call::Change { op: "permissions" }),
        (&Method::POST, ["directories"]) => Some(Call::Change { op: "mkdir" }),
        (&Method::POST, ["desktop", "launch"]) => Some(Call::Launch),
        (&Method::POST, ["desktop", "mouse"]) => Some(Call::Desktop { op: "mouse" }),
        (&Method::POST, ["desktop", "keyboard"]) => Some(Call::Desktop { op: "keyboard" }),
        (&Method::POST, ["pty"]) => Some(Call::Pty),
        // As another user: the same calls under `/v1/filesystem/{uid}/{gid}/`.
        (_, ["v1", "filesystem", _, _, ..]) => classify(method, &segs[4..].join("/")),
        _ => None,
    }
}

/// One call being recorded: made by [`start`] before the request is relayed, finished by
/// [`Recording::answered`] with execd's answer.
pub(crate) struct Recording {
    timeline: Arc<Timeline>,
    call: Call,
    /// `uid`/`gid` of a call made as another user (`/v1/filesystem/{uid}/{gid}/…`).
    user: Option<(String, String)>,
    query: String,
    body: Arc<StdMutex<Captured>>,
    /// Upload paths, from the scan of the body as it passed.
    upload: Option<Arc<StdMutex<upload::Scanned>>>,
    started: Instant,
}

#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    cut: bool,
}

/// Starts recording `req` (to execd's `path`) when it is a call the timeline keeps; returns the
/// request to relay, its body now watched.
pub(crate) fn start(
    timeline: Option<Arc<Timeline>>,
    path: &str,
    req: Request,
) -> (Request, Option<Recording>) {
    let Some(timeline) = timeline.filter(|t| t.enabled()) else {
        return (req, None);
    };
    let Some(call) = classify(req.method(), path) else {
        return (req, None);
    };
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let user = match segs.as_slice() {
        ["v1", "filesystem", uid, gid, ..] => Some((uid.to_string(), gid.to_string())),
        _ => None,
    };
    let query = req.uri().query().unwrap_or_default().to_string();
    let body = Arc::new(StdMutex::new(Captured::default()));
    let (parts, inner) = req.into_parts();
    let mut upload = None;
    let watched = match call {
        Call::Upload => {
            let boundary = parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(multipart_boundary);
            let found = Arc::new(StdMutex::new(upload::Scanned::default()));
            upload = Some(found.clone());
            match boundary {
                Some(boundary) => {
                    Body::new(Tap::new(inner, upload::UploadScan::new(&boundary, found)))
                }
                None => {
                    found.lock().unwrap_or_else(|p| p.into_inner()).incomplete = true;
                    inner
                }
            }
        }
        Call::Delete { .. } => inner,
        _ => Body::new(Tap::new(inner, Copy(body.clone()))),
    };
    let recording = Recording {
        timeline,
        call,
        user,
        query,
        body,
        upload,
        started: Instant::now(),
    };
    (Request::from_parts(parts, watched), Some(recording))
}

impl Recording {
    /// Records the call now that execd answered `resp` (the request body has been read whole by
    /// then: execd answers a run or a file call after taking its body); a run's answer is watched
    /// for its end.
    pub(crate) fn answered(self, resp: Response) -> Response {
        let status = resp.status().as_u16();
        let ok = resp.status().is_success();
        let body: Value = {
            let c = self.body.lock().unwrap_or_else(|p| p.into_inner());
            serde_json::from_slice(&c.bytes).unwrap_or(Value::Null)
        };
        let cut = self.body.lock().map(|c| c.cut).unwrap_or(false);
        match self.call.clone() {
            Call::Run { via } => {
                let text = run_text(&body);
                let mut detail = self.timeline.text_fields(&text);
                detail.insert("via".into(), via.into());
                if let Some(cwd) = body.get("cwd").and_then(Value::as_str) {
                    detail.insert("cwd".into(), cwd.into());
                }
                let background = body.get("background").and_then(Value::as_bool) == Some(true);
                if background {
                    detail.insert("background".into(), true.into());
                }
                self.run(detail, status, ok, resp, background)
            }
            Call::Code => {
                let text = body.get("code").and_then(Value::as_str).unwrap_or_default();
                let mut detail = self.timeline.text_fields(text);
                detail.insert("via".into(), "code".into());
                let context = body.get("context");
                if let Some(l) = context
                    .and_then(|c| c.get("language"))
                    .and_then(Value::as_str)
                {
                    detail.insert("language".into(), l.into());
                }
                if let Some(c) = context.and_then(|c| c.get("id")).and_then(Value::as_str) {
                    detail.insert("context".into(), c.into());
                }
                self.run(detail, status, ok, resp, false)
            }
            Call::Upload => {
                let scanned = self
                    .upload
                    .map(|f| f.lock().unwrap_or_else(|p| p.into_inner()).clone())
                    .unwrap_or_default();
                let mut detail = json!({"op": "upload", "status": status});
                put_paths(&mut detail, scanned.paths);
                if scanned.incomplete {
                    detail["incomplete"] = true.into();
                }
                put_user(&mut detail, self.user);
                self.timeline.record("file.write", detail);
                resp
            }
            Call::Delete { directory } => {
                let paths = form_urlencoded::parse(self.query.as_bytes())
                    .filter(|(k, _)| k == "path")
                    .map(|(_, v)| v.into_owned())
                    .collect();
                let mut detail = json!({"status": status});
                if directory {
                    detail["directory"] = true.into();
                }
                put_paths(&mut detail, paths);
                put_user(&mut detail, self.user);
                self.timeline.record("file.delete", detail);
                resp
            }
            Call::Move => {
                let moves: Vec<Value> = body
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .take(MAX_PATHS)
                            .map(|m| json!({"src": m.get("src"), "dest": m.get("dest")}))
                            .collect()
                    })
                    .unwrap_or_default();
                let mut detail = json!({"status": status, "moves": moves});
                if cut || body.as_array().is_some_and(|a| a.len() > MAX_PATHS) {
                    detail["incomplete"] = true.into();
                }
                put_user(&mut detail, self.user);
                self.timeline.record("file.move", detail);
                resp
            }
            Call::Change { op } => {
                let paths = body
                    .as_object()
                    .map(|o| o.keys().cloned().collect())
                    .unwrap_or_default();
                let mut detail = json!({"op": op, "status": status});
                put_paths(&mut detail, paths);
                if cut {
                    detail["incomplete"] = true.into();
                }
                put_user(&mut detail, self.user);
                self.timeline.record("file.write", detail);
                resp
            }
            Call::Launch => {
                let mut detail = json!({"status": status});
                for k in ["app", "command", "url"] {
                    if let Some(v) = body.get(k) {
                        detail[k] = v.clone();
                    }
                }
                self.timeline.record("desktop.launch", detail);
                resp
            }
            Call::Desktop { op } => {
                // The action as sent (`click` at x, y; `key` chords), its typed text as a
                // command's text is kept (or only its hash).
                let mut detail = serde_json::Map::new();
                if let Some(action) = body.as_object() {
                    for (k, v) in action.iter().filter(|(k, _)| *k != "text").take(8) {
                        detail.insert(k.clone(), v.clone());
                    }
                    if let Some(text) = action.get("text").and_then(Value::as_str) {
                        detail.extend(self.timeline.text_fields(text));
                    }
                }
                detail.insert("op".into(), op.into());
                detail.insert("status".into(), status.into());
                self.timeline.record("desktop.input", Value::Object(detail));
                resp
            }
            Call::Pty => {
                let mut detail = match body.get("command").and_then(Value::as_str) {
                    Some(command) => self.timeline.text_fields(command),
                    None => serde_json::Map::new(),
                };
                if let Some(cwd) = body.get("cwd").and_then(Value::as_str) {
                    detail.insert("cwd".into(), cwd.into());
                }
                detail.insert("status".into(), status.into());
                self.timeline
                    .record("terminal.create", Value::Object(detail));
                resp
            }
        }
    }

    /// A run: its start now, and its end when its answer ends (or at once when execd refused it).
    fn run(
        self,
        mut detail: serde_json::Map<String, Value>,
        status: u16,
        ok: bool,
        resp: Response,
        background: bool,
    ) -> Response {
        if let Some((uid, gid)) = &self.user {
            detail.insert("uid".into(), uid.as_str().into());
            detail.insert("gid".into(), gid.as_str().into());
        }
        let of = self.timeline.record("command", Value::Object(detail));
        if !ok {
            self.timeline.record(
                "command.exit",
                json!({"of": of, "outcome": "refused", "status": status}),
            );
            return resp;
        }
        let end = RunEnd::new(self.timeline, of, self.started, background);
        let (parts, body) = resp.into_parts();
        Response::from_parts(parts, Body::new(Tap::new(body, end)))
    }
}

/// The text a run's body asks for: `command`, or `argv` joined (a shell would read it so).
fn run_text(body: &Value) -> String {
    if let Some(c) = body.get("command").and_then(Value::as_str) {
        return c.to_string();
    }
    body.get("argv")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or_default())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

fn put_paths(detail: &mut Value, mut paths: Vec<String>) {
    if paths.len() > MAX_PATHS {
        detail["morePaths"] = (paths.len() - MAX_PATHS).into();
        paths.truncate(MAX_PATHS);
    }
    detail["paths"] = paths.into();
}

fn put_user(detail: &mut Value, user: Option<(String, String)>) {
    if let Some((uid, gid)) = user {
        detail["uid"] = uid.into();
        detail["gid"] = gid.into();
    }
}

/// Sees a body's bytes as they pass, and its end (`whole`: it ended; not whole: it was dropped
/// first, the client or execd gone).
trait Watch: Send + Unpin + 'static {
    fn data(&mut self, data: &Bytes);
    fn ended(&mut self, whole: bool);
}

/// A body relayed unchanged, shown to a [`Watch`] as it goes.
struct Tap<W: Watch> {
    inner: Body,
    watch: W,
    ended: bool,
}

impl<W: Watch> Tap<W> {
    fn new(inner: Body, watch: W) -> Self {
        Self {
            inner,
            watch,
            ended: false,
        }
    }
}

impl<W: Watch> http_body::Body for Tap<W> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.watch.data(data);
                }
            }
            std::task::Poll::Ready(None) if !this.ended => {
                this.ended = true;
                this.watch.ended(true);
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<W: Watch> Drop for Tap<W> {
    fn drop(&mut self) {
        if !self.ended {
            self.ended = true;
            self.watch.ended(false);
        }
    }
}

/// Copies a request body's first [`MAX_BODY`] bytes.
struct Copy(Arc<StdMutex<Captured>>);

impl Watch for Copy {
    fn data(&mut self, data: &Bytes) {
        let mut c = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let room = MAX_BODY.saturating_sub(c.bytes.len());
        if data.len() > room {
            c.cut = true;
        }
        c.bytes.extend_from_slice(&data[..data.len().min(room)]);
    }

    fn ended(&mut self, _whole: bool) {}
}

/// Reads a run's answer (execd's events: one JSON object per line) for its id, its end and its
/// exit code, and records `command.exit` when the answer ends. Most lines are output: each is
/// told by its first bytes and skipped unread and uncopied, so a run printing megabytes costs the
/// recorder a scan for newlines.
struct RunEnd {
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
    fn new(timeline: Arc<Timeline>, of: u64, started: Instant, background: bool) -> Self {
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
    use http::Method;

    #[test]
    fn calls_are_told_by_method_and_path() {
        assert_eq!(
            classify(&Method::POST, "command"),
            Some(Call::Run { via: "command" })
        );
        assert_eq!(classify(&Method::DELETE, "command"), None, "an interrupt");
        assert_eq!(classify(&Method::GET, "files/download"), None);
        assert_eq!(classify(&Method::POST, "code/"), Some(Call::Code));
        assert_eq!(
            classify(&Method::POST, "v1/filesystem/1000/1000/files/mv"),
            Some(Call::Move)
        );
        assert_eq!(
            classify(&Method::DELETE, "directories"),
            Some(Call::Delete { directory: true })
        );
        assert_eq!(
            classify(&Method::POST, "v1/isolated/session/s1/run"),
            Some(Call::Run { via: "isolated" })
        );
        assert_eq!(classify(&Method::POST, "pty"), Some(Call::Pty));
        assert_eq!(
            classify(&Method::POST, "desktop/keyboard"),
            Some(Call::Desktop { op: "keyboard" })
        );
    }

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

    #[test]
    fn multipart_boundaries_are_read_as_clients_write_them() {
        assert_eq!(
            multipart_boundary("multipart/form-data; boundary=abc123").as_deref(),
            Some("abc123")
        );
        assert_eq!(
            multipart_boundary("Multipart/Form-Data;charset=utf-8; Boundary=\"a b\"").as_deref(),
            Some("a b")
        );
        assert_eq!(multipart_boundary("application/json; boundary=x"), None);
        assert_eq!(multipart_boundary("multipart/form-data"), None);
    }
}
