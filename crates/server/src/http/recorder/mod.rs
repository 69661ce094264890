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
use serde_json::{json, Value};

use crate::timeline::{capped, Timeline};

mod run_end;
mod tap;
pub(crate) mod terminal;
mod upload;

use run_end::RunEnd;
use tap::{Copy, Tap, Watch};

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
    /// Its event is written (see the `Drop`).
    written: bool,
}

#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    cut: bool,
}

/// Starts recording `req` when it is a call the timeline keeps; returns the request to relay, its
/// body now watched. `upstream` is the URI execd will be sent (its path and query are what execd
/// routes by, which a percent-encoded `?` in the caller's path can make differ from the caller's).
pub(crate) fn start(
    timeline: Option<Arc<Timeline>>,
    upstream: &http::Uri,
    req: Request,
) -> (Request, Option<Recording>) {
    let path = upstream.path();
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
    let query = upstream.query().unwrap_or_default().to_string();
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
        written: false,
    };
    (Request::from_parts(parts, watched), Some(recording))
}

impl Recording {
    /// Records the call now that execd answered `resp` (the request body has been read whole by
    /// then: execd answers a run or a file call after taking its body); a run's answer is watched
    /// for its end.
    pub(crate) fn answered(mut self, resp: Response) -> Response {
        let status = resp.status().as_u16();
        let written = self.write(Some(status));
        let Some((of, background)) = written else {
            return resp;
        };
        if !resp.status().is_success() {
            self.timeline.record(
                "command.exit",
                json!({"of": of, "outcome": "refused", "status": status}),
            );
            return resp;
        }
        let end = RunEnd::new(self.timeline.clone(), of, self.started, background);
        let (parts, body) = resp.into_parts();
        Response::from_parts(parts, Body::new(Tap::new(body, end)))
    }

    /// Writes the call's event, with execd's `status` (`None`: no answer came, the caller went
    /// first); for a run, returns its event's number and whether it runs in the background.
    fn write(&mut self, status: Option<u16>) -> Option<(u64, bool)> {
        self.written = true;
        let (body, cut) = {
            let c = self.body.lock().unwrap_or_else(|p| p.into_inner());
            (
                serde_json::from_slice::<Value>(&c.bytes).unwrap_or(Value::Null),
                c.cut,
            )
        };
        let mut detail = serde_json::Map::new();
        let mut run = None;
        let kind = match self.call {
            Call::Run { via } => {
                detail = self.timeline.text_fields(&run_text(&body));
                detail.insert("via".into(), via.into());
                for k in ["cwd", "uid", "gid"] {
                    if let Some(v) = body.get(k).filter(|v| v.is_string() || v.is_number()) {
                        detail.insert(k.into(), v.clone());
                    }
                }
                let background = body.get("background").and_then(Value::as_bool) == Some(true);
                if background {
                    detail.insert("background".into(), true.into());
                }
                run = Some(background);
                "command"
            }
            Call::Code => {
                let text = body.get("code").and_then(Value::as_str).unwrap_or_default();
                detail = self.timeline.text_fields(text);
                detail.insert("via".into(), "code".into());
                let context = body.get("context");
                for (k, field) in [("language", "language"), ("context", "id")] {
                    if let Some(v) = context.and_then(|c| c.get(field)).and_then(Value::as_str) {
                        detail.insert(k.into(), capped(v).into());
                    }
                }
                run = Some(false);
                "command"
            }
            Call::Upload => {
                let scanned = self
                    .upload
                    .as_ref()
                    .map(|f| f.lock().unwrap_or_else(|p| p.into_inner()).clone())
                    .unwrap_or_default();
                detail.insert("op".into(), "upload".into());
                put_paths(&mut detail, scanned.paths);
                if scanned.incomplete {
                    detail.insert("incomplete".into(), true.into());
                }
                "file.write"
            }
            Call::Delete { directory } => {
                let paths = form_urlencoded::parse(self.query.as_bytes())
                    .filter(|(k, _)| k == "path")
                    .map(|(_, v)| v.into_owned())
                    .collect();
                if directory {
                    detail.insert("directory".into(), true.into());
                }
                put_paths(&mut detail, paths);
                "file.delete"
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
                detail.insert("moves".into(), moves.into());
                if body.as_array().is_some_and(|a| a.len() > MAX_PATHS) {
                    detail.insert("incomplete".into(), true.into());
                }
                "file.move"
            }
            Call::Change { op } => {
                let paths = body
                    .as_object()
                    .map(|o| o.keys().cloned().collect())
                    .unwrap_or_default();
                detail.insert("op".into(), op.into());
                put_paths(&mut detail, paths);
                "file.write"
            }
            Call::Launch => {
                for k in ["app", "command", "url"] {
                    if let Some(v) = body.get(k).and_then(Value::as_str) {
                        // A launched command is a command: its text as the settings keep one.
                        let mut f = self.timeline.text_fields(v);
                        if let Some(text) = f.remove("text") {
                            detail.insert(k.into(), text);
                        }
                        if let Some(hash) = f.remove("sha256") {
                            detail.insert(format!("{k}Sha256"), hash);
                        }
                    }
                }
                "desktop.launch"
            }
            Call::Desktop { op } => {
                // The action's own fields (`click` at x, y; `key` chords), and its typed text as
                // a command's text is kept (or only its hash).
                for k in DESKTOP_FIELDS {
                    if let Some(v) = body.get(*k) {
                        detail.insert((*k).into(), capped_value(v));
                    }
                }
                if let Some(text) = body.get("text").and_then(Value::as_str) {
                    detail.extend(self.timeline.text_fields(text));
                }
                detail.insert("op".into(), op.into());
                "desktop.input"
            }
            Call::Pty => {
                if let Some(command) = body.get("command").and_then(Value::as_str) {
                    detail = self.timeline.text_fields(command);
                }
                if let Some(cwd) = body.get("cwd").and_then(Value::as_str) {
                    detail.insert("cwd".into(), capped(cwd).into());
                }
                "terminal.create"
            }
        };
        if cut {
            // A body past what is copied: what it asked for is not all known.
            detail.insert("incomplete".into(), true.into());
        }
        if let Some((uid, gid)) = &self.user {
            detail.insert("uid".into(), uid.as_str().into());
            detail.insert("gid".into(), gid.as_str().into());
        }
        detail.insert("status".into(), status.map_or(Value::Null, Value::from));
        let seq = self.timeline.record(kind, Value::Object(detail));
        run.map(|background| (seq, background))
    }
}

impl Drop for Recording {
    /// The caller went away before execd answered (the handler was dropped): the call is written
    /// anyway, for execd may have acted on it.
    fn drop(&mut self) {
        if self.written {
            return;
        }
        if let Some((of, _)) = self.write(None) {
            self.timeline.record(
                "command.exit",
                json!({"of": of, "outcome": "no-answer",
                       "durationMs": self.started.elapsed().as_millis() as u64}),
            );
        }
    }
}

/// The fields of a desktop action that are kept (`text` is kept as a command's text is).
const DESKTOP_FIELDS: &[&str] = &[
    "action", "x", "y", "button", "count", "dx", "dy", "from", "to", "keys",
];

/// A copied JSON value, no bigger than an event keeps.
fn capped_value(v: &Value) -> Value {
    if v.to_string().len() <= crate::timeline::MAX_TEXT {
        v.clone()
    } else {
        json!({"truncated": true})
    }
}

/// The text a run's body asks for, as execd reads it: `argv` when it is given (its words
/// JSON-quoted, so that a word with a space is one), else `command`; an isolated run's `code`.
fn run_text(body: &Value) -> String {
    if let Some(argv) = body
        .get("argv")
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty())
    {
        return argv
            .iter()
            .map(|v| match v.as_str() {
                Some(w)
                    if !w.is_empty() && !w.contains(char::is_whitespace) && !w.contains('"') =>
                {
                    w.to_string()
                }
                _ => v.to_string(),
            })
            .collect::<Vec<_>>()
            .join(" ");
    }
    body.get("command")
        .or_else(|| body.get("code"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn put_paths(detail: &mut serde_json::Map<String, Value>, mut paths: Vec<String>) {
    if paths.len() > MAX_PATHS {
        detail.insert("morePaths".into(), (paths.len() - MAX_PATHS).into());
        paths.truncate(MAX_PATHS);
    }
    detail.insert("paths".into(), paths.into());
}

#[cfg(test)]
mod tests {
    use super::*;
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
