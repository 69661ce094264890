//! `GET /v1/sandboxes/{id}/timeline`: a sandbox's flight recorder as JSON lines (see `timeline`),
//! the whole of what is kept, then, with `follow=true`, each new event as it is recorded until the
//! sandbox ends (or the caller goes). `after=N` starts after event N, to pick up where a cut
//! stream left off. Tenant-scoped as every `/sandboxes/{id}` path is (`auth::guard`), the
//! timeline of a deleted sandbox too (until its retention ends).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use serde::Deserialize;
use warren_api::{ErrorBody, ErrorCode};

use crate::error::{ErrorKind, SandboxError};
use crate::http::AppState;
use crate::timeline::Timeline;

#[derive(Debug, Deserialize)]
pub struct TimelineQuery {
    /// Keep the answer open and send events as they come, until the sandbox ends.
    #[serde(default)]
    follow: bool,
    /// Only events numbered after this one.
    #[serde(default)]
    after: u64,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/timeline", tag = "sandboxes",
    params(("id" = String, Path),
        ("follow" = Option<bool>, Query, description = "stream new events until the sandbox ends"),
        ("after" = Option<u64>, Query, description = "only events numbered after this one")),
    responses((status = 200, description = "JSON lines, one event each (application/x-ndjson)"),
        (status = 404, body = ErrorBody)))]
pub async fn timeline(
    State(app): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<TimelineQuery>,
) -> Result<Response, SandboxError> {
    // A warm pool sandbox is nobody's yet: as missing as for `GET /sandboxes/{id}`.
    if app
        .sandboxes
        .get(&id)
        .is_some_and(|r| r.warm_pool.is_some())
    {
        return Err(SandboxError::not_found(&id));
    }
    // Its record, or a user's delete forgot it: kept until the retention period ends.
    let (_, timeline) = app
        .sandboxes
        .timeline_of(&id)
        .ok_or_else(|| SandboxError::not_found(&id))?;
    if !timeline.enabled() {
        return Err(SandboxError::new(
            ErrorKind::NotFound,
            ErrorCode::ApiNotSupported,
            "the flight recorder is off on this server ([timeline] enabled = false)",
        ));
    }
    let mut resp = Response::new(Body::from_stream(lines(timeline, q.after, q.follow)));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}

/// The events after `after`, in chunks of whatever is there at each look; following, it waits for
/// more until the timeline ends.
fn lines(
    timeline: Arc<Timeline>,
    after: u64,
    follow: bool,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let rx = timeline.watch();
    futures::stream::unfold(
        (timeline, rx, after, false),
        move |(timeline, mut rx, after, done)| async move {
            if done {
                return None;
            }
            loop {
                // Marked seen before reading: an event recorded after this read wakes the wait.
                rx.borrow_and_update();
                let page = timeline.read(after);
                if !page.lines.is_empty() || page.missed > 0 {
                    let mut chunk = String::new();
                    if page.missed > 0 {
                        chunk += &crate::timeline::missed_line(page.missed);
                        chunk.push('\n');
                    }
                    for line in &page.lines {
                        chunk += line;
                        chunk.push('\n');
                    }
                    let done = !follow;
                    return Some((Ok(Bytes::from(chunk)), (timeline, rx, page.last, done)));
                }
                if page.ended || !follow || rx.changed().await.is_err() {
                    return None;
                }
            }
        },
    )
}
