//! The execd event stream: one compact JSON object per event followed by `\n\n` (no `data:` prefix), a
//! `ping` every 3 s while the producer runs, and the body ends the moment the producer drops its sender.
//!
//! Dropping the response body (client gone) fires a cancellation token so the producer can kill what it
//! started: nothing a disconnected client asked for keeps running.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use tokio::sync::mpsc;
use tokio::time::{interval_at, Instant, MissedTickBehavior};
use tokio_util::sync::{CancellationToken, DropGuard};
use warren_api::execd::{EventKind, ExecError, StreamEvent};

pub const PING_INTERVAL: Duration = Duration::from_secs(3);

pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

pub fn event(kind: EventKind, text: Option<String>) -> StreamEvent {
    StreamEvent {
        kind,
        timestamp: now_ms(),
        text,
        execution_count: None,
        execution_time: None,
        results: None,
        error: None,
    }
}

pub fn init(id: &str) -> StreamEvent {
    event(EventKind::Init, Some(id.to_string()))
}

pub fn complete(execution_time_ms: i64) -> StreamEvent {
    StreamEvent {
        execution_time: Some(execution_time_ms),
        ..event(EventKind::ExecutionComplete, None)
    }
}

pub fn error(evalue: impl Into<String>, traceback: Vec<String>) -> StreamEvent {
    StreamEvent {
        error: Some(ExecError {
            ename: "CommandExecError".to_string(),
            evalue: evalue.into(),
            traceback,
        }),
        ..event(EventKind::Error, None)
    }
}

pub fn encode(ev: &StreamEvent) -> Bytes {
    // Serialising plain data into a Vec cannot fail; an empty object would still be valid framing.
    let mut buf = serde_json::to_vec(ev).unwrap_or_else(|_| b"{}".to_vec());
    buf.extend_from_slice(b"\n\n");
    Bytes::from(buf)
}

/// The producer side of one stream.
pub struct EventStream {
    pub tx: mpsc::Sender<StreamEvent>,
    /// Cancelled when the client goes away (or after the body has ended).
    pub cancelled: CancellationToken,
}

/// Creates a stream and the HTTP response that carries it.
pub fn channel() -> (EventStream, Response) {
    let (tx, rx) = mpsc::channel(256);
    let token = CancellationToken::new();
    let response = response(rx, token.clone().drop_guard());
    (
        EventStream {
            tx,
            cancelled: token,
        },
        response,
    )
}

struct BodyState {
    rx: mpsc::Receiver<StreamEvent>,
    ping: tokio::time::Interval,
    _guard: DropGuard,
}

fn response(rx: mpsc::Receiver<StreamEvent>, guard: DropGuard) -> Response {
    let mut ping = interval_at(Instant::now() + PING_INTERVAL, PING_INTERVAL);
    ping.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let state = BodyState {
        rx,
        ping,
        _guard: guard,
    };
    let stream = futures::stream::unfold(state, |mut st| async move {
        let ev = tokio::select! {
            biased;
            ev = st.rx.recv() => ev?,
            _ = st.ping.tick() => event(EventKind::Ping, Some("pong".to_string())),
        };
        Some((Ok::<_, std::convert::Infallible>(encode(&ev)), st))
    });
    event_stream_response(Body::from_stream(stream))
}

/// A 200 `text/event-stream` response with the headers that keep proxies from buffering it.
pub fn event_stream_response(body: Body) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_single_line_with_blank_line() {
        let ev = StreamEvent {
            text: Some("a\nb".into()),
            ..event(EventKind::Stdout, None)
        };
        let bytes = encode(&ev);
        let s = std::str::from_utf8(&bytes).expect("utf8");
        assert!(s.ends_with("}\n\n"));
        assert_eq!(
            s.matches('\n').count(),
            2,
            "newlines inside text must be escaped: {s}"
        );
        let v: serde_json::Value = serde_json::from_str(s.trim()).expect("json");
        assert_eq!(v["type"], "stdout");
        assert!(v["timestamp"].is_i64());
    }

    #[test]
    fn error_event_shape() {
        let v = serde_json::to_value(error("3", vec!["exit status 3".into()])).expect("json");
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["ename"], "CommandExecError");
        assert_eq!(v["error"]["evalue"], "3");
        assert!(v.get("execution_time").is_none());
    }
}
