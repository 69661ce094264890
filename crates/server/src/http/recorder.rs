//! What the endpoint proxy writes on a sandbox's timeline (see `timeline`) for the calls it
//! relays to execd: each command, session or isolated run and code cell (its text, then its exit
//! code and duration, read from the event stream as it passes), and each file change (upload,
//! delete, move, replace, permissions, directories). The proxy sees every call an SDK, the CLI or
//! a signed URL makes, and nothing inside the sandbox can reach the recorder: what execd is asked
//! to do is recorded here, not what execd says it did.
//!
//! Bodies are looked at as they stream past, never held back: a run's JSON body (its first
//! [`MAX_BODY`] bytes) is copied as execd reads it, an upload's multipart body is scanned for its
//! `metadata` parts beside the relay, and a run's answer is read line by line for its end.

use std::sync::{Arc, Mutex as StdMutex};
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use serde_json::{json, Value};

use crate::timeline::Timeline;

/// The most of a request body copied for the record (runs' and file calls' JSON bodies are small;
/// a longer one is recorded as cut).
const MAX_BODY: usize = 1 << 20;
/// The longest answer line read for a run's end (`error` events carry a traceback).
const MAX_LINE: usize = 64 << 10;
/// Upload bytes queued for the metadata scan at most; past them it stops and says so.
const MAX_SCAN_QUEUE: usize = 16 << 20;
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
    /// Upload paths, from the scan beside the relay.
    upload: Option<tokio::sync::oneshot::Receiver<Scanned>>,
    started: Instant,
}

#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    cut: bool,
}

#[derive(Default)]
struct Scanned {
    paths: Vec<String>,
    /// The scan did not see the whole body (too much queued, or a body it could not parse).
    incomplete: bool,
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
                .and_then(|ct| multer::parse_boundary(ct).ok());
            let (tx, rx) = tokio::sync::oneshot::channel();
            upload = Some(rx);
            match boundary {
                Some(boundary) => {
                    let (feed, scan) = UploadScan::new(boundary, tx);
                    tokio::spawn(scan);
                    Body::new(Tap::new(inner, feed))
                }
                None => {
                    let _ = tx.send(Scanned {
                        paths: Vec::new(),
                        incomplete: true,
                    });
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
                let (timeline, user, upload) =
                    (self.timeline.clone(), self.user.clone(), self.upload);
                // The scan may still be reading the last bytes: the event is written when it is done.
                tokio::spawn(async move {
                    let scanned = match upload {
                        Some(rx) => rx.await.unwrap_or(Scanned {
                            paths: Vec::new(),
                            incomplete: true,
                        }),
                        None => Scanned::default(),
                    };
                    let mut detail = json!({"op": "upload", "status": status});
                    put_paths(&mut detail, scanned.paths);
                    if scanned.incomplete {
                        detail["incomplete"] = true.into();
                    }
                    put_user(&mut detail, user);
                    timeline.record("file.write", detail);
                });
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
        let end = RunEnd {
            timeline: self.timeline,
            of,
            started: self.started,
            background,
            line: Vec::new(),
            long_line: false,
            id: None,
            exit: None,
            recorded: false,
        };
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

/// Feeds an upload's bytes to the scan beside the relay (cheap: `Bytes` are shared, not copied),
/// until [`MAX_SCAN_QUEUE`] bytes wait unread.
struct UploadScan {
    tx: Option<futures::channel::mpsc::UnboundedSender<Result<Bytes, std::io::Error>>>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

impl UploadScan {
    /// The feeding end, and the scan to spawn: it reads each `metadata` part's `path` and sends
    /// what it found on `done` when the body ends.
    fn new(
        boundary: String,
        done: tokio::sync::oneshot::Sender<Scanned>,
    ) -> (Self, impl std::future::Future<Output = ()> + Send) {
        use futures::StreamExt;
        use std::sync::atomic::Ordering;
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let taken = queued.clone();
        let stream = rx.map(move |item: Result<Bytes, std::io::Error>| {
            if let Ok(b) = &item {
                taken.fetch_sub(b.len(), Ordering::Relaxed);
            }
            item
        });
        let scan = async move {
            let mut found = Scanned::default();
            let mut parts = multer::Multipart::new(stream, boundary);
            loop {
                match parts.next_field().await {
                    Ok(Some(field)) if field.name() == Some("metadata") => {
                        let Ok(text) = field.text().await else {
                            found.incomplete = true;
                            break;
                        };
                        let path = serde_json::from_str::<Value>(&text)
                            .ok()
                            .and_then(|v| v.get("path").and_then(Value::as_str).map(str::to_owned));
                        match path {
                            Some(p) => found.paths.push(p),
                            None => found.incomplete = true,
                        }
                    }
                    // A file's bytes are read past, not kept.
                    Ok(Some(mut field)) => loop {
                        match field.chunk().await {
                            Ok(Some(_)) => {}
                            Ok(None) => break,
                            Err(_) => {
                                found.incomplete = true;
                                break;
                            }
                        }
                    },
                    Ok(None) => break,
                    Err(_) => {
                        found.incomplete = true;
                        break;
                    }
                }
                if found.incomplete {
                    break;
                }
            }
            let _ = done.send(found);
        };
        (
            Self {
                tx: Some(tx),
                queued,
            },
            scan,
        )
    }
}

impl Watch for UploadScan {
    fn data(&mut self, data: &Bytes) {
        use std::sync::atomic::Ordering;
        let Some(tx) = &self.tx else { return };
        if self.queued.load(Ordering::Relaxed) + data.len() > MAX_SCAN_QUEUE {
            // The scan fell behind: it stops at a cut body and says it saw only part.
            self.tx = None;
            return;
        }
        self.queued.fetch_add(data.len(), Ordering::Relaxed);
        if tx.unbounded_send(Ok(data.clone())).is_err() {
            self.tx = None;
        }
    }

    fn ended(&mut self, whole: bool) {
        if !whole {
            if let Some(tx) = &self.tx {
                let _ = tx.unbounded_send(Err(std::io::Error::other("upload cut short")));
            }
        }
        self.tx = None;
    }
}

/// Reads a run's answer (execd's events: one JSON object per line) for its id, its end and its
/// exit code, and records `command.exit` when the answer ends.
struct RunEnd {
    timeline: Arc<Timeline>,
    /// The number of the run's `command` event.
    of: u64,
    started: Instant,
    background: bool,
    line: Vec<u8>,
    long_line: bool,
    /// execd's id for the run (its `init` event's text).
    id: Option<String>,
    /// `Some(Some(code))` once the run ended with a code; `Some(None)` ended without one.
    exit: Option<Option<i64>>,
    recorded: bool,
}

impl RunEnd {
    fn line_done(&mut self) {
        let line = std::mem::take(&mut self.line);
        if std::mem::take(&mut self.long_line) || line.is_empty() {
            return;
        }
        // Only these events are parsed; output lines (most of the stream) are skipped unread.
        let head = &line[..line.len().min(40)];
        let is = |t: &str| head.starts_with(format!("{{\"type\":\"{t}\"").as_bytes());
        if is("init") {
            self.id = serde_json::from_slice::<Value>(&line)
                .ok()
                .and_then(|v| v.get("text").and_then(Value::as_str).map(str::to_owned));
        } else if is("execution_complete") {
            self.exit = Some(Some(0));
        } else if is("error") {
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
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            if !self.long_line {
                self.line.extend_from_slice(&rest[..i]);
            }
            self.line_done();
            rest = &rest[i + 1..];
        }
        if self.line.len() + rest.len() > MAX_LINE {
            self.long_line = true;
            self.line.clear();
        } else if !self.long_line {
            self.line.extend_from_slice(rest);
        }
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
    }

    fn run_end(t: &Arc<Timeline>) -> RunEnd {
        RunEnd {
            timeline: t.clone(),
            of: 1,
            started: Instant::now(),
            background: false,
            line: Vec::new(),
            long_line: false,
            id: None,
            exit: None,
            recorded: false,
        }
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
        assert!(w.line.is_empty(), "nothing of a long line is kept");
        w.ended(false);
        let e = last(&t);
        assert_eq!(e["outcome"], "disconnected");
        assert!(e.get("exitCode").is_none());
    }

    #[tokio::test]
    async fn an_upload_scan_finds_every_metadata_path() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (mut feed, scan) = UploadScan::new("XyZ".into(), tx);
        let task = tokio::spawn(scan);
        let mut body = String::new();
        for (i, path) in ["/tmp/a.txt", "/etc/évil"].iter().enumerate() {
            body += &format!(
                "--XyZ\r\nContent-Disposition: form-data; name=\"metadata\"\r\n\r\n{{\"path\":\"{path}\"}}\r\n\
                 --XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f{i}\"\r\n\r\n{}\r\n",
                "data ".repeat(1000)
            );
        }
        body += "--XyZ--\r\n";
        for chunk in body.as_bytes().chunks(1000) {
            feed.data(&Bytes::copy_from_slice(chunk));
        }
        feed.ended(true);
        task.await.expect("scan");
        let found = rx.await.expect("scanned");
        assert_eq!(found.paths, ["/tmp/a.txt", "/etc/évil"]);
        assert!(!found.incomplete);
    }
}
