//! `GET /files/download`: the whole file, one byte range (`Range: bytes=a-b` → 206/416), or a line window
//! (`offset`/`limit`, 1-based, as `text/plain`). Always streamed from disk, never read whole.

use std::io::SeekFrom;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncSeekExt, BufReader};
use tokio_util::io::ReaderStream;

use crate::error::{ApiError, ApiResult};
use crate::query::Params;
use crate::AppState;

/// A parsed single range, inclusive, already clamped to the file size.
#[derive(Debug, PartialEq, Eq)]
pub enum RangeSpec {
    Whole,
    Part { start: u64, end: u64 },
    Unsatisfiable,
}

/// Parses `bytes=a-b`, `bytes=a-` and `bytes=-n` against `size`. Multiple ranges and other units are
/// ignored (the whole file is sent), as RFC 9110 allows.
pub fn parse_range(value: Option<&str>, size: u64) -> RangeSpec {
    let Some(spec) = value.and_then(|v| v.trim().strip_prefix("bytes=")) else {
        return RangeSpec::Whole;
    };
    if spec.contains(',') {
        return RangeSpec::Whole;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return RangeSpec::Whole;
    };
    let (a, b) = (a.trim(), b.trim());
    let (start, end) = match (a.is_empty(), b.is_empty()) {
        (true, true) => return RangeSpec::Whole,
        (true, false) => {
            let Ok(n) = b.parse::<u64>() else {
                return RangeSpec::Whole;
            };
            if n == 0 || size == 0 {
                return RangeSpec::Unsatisfiable;
            }
            (size.saturating_sub(n), size - 1)
        }
        (false, _) => {
            let Ok(start) = a.parse::<u64>() else {
                return RangeSpec::Whole;
            };
            let end = if b.is_empty() {
                size.saturating_sub(1)
            } else {
                match b.parse::<u64>() {
                    Ok(e) => e.min(size.saturating_sub(1)),
                    Err(_) => return RangeSpec::Whole,
                }
            };
            if start >= size || start > end {
                return RangeSpec::Unsatisfiable;
            }
            (start, end)
        }
    };
    RangeSpec::Part { start, end }
}

pub async fn download(
    State(app): State<Arc<AppState>>,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let params = Params::parse(q.as_deref());
    let p = params.require("path")?.to_string();
    let offset = params.number::<u64>("offset")?;
    let limit = params.number::<u64>("limit")?;
    let path = app.resolve(&p);
    let mut file = tokio::fs::File::from_std(
        crate::files::blocking({
            let (path, shown) = (path.clone(), p.clone());
            move || {
                crate::safe_path::open(&path, libc::O_RDONLY, 0)
                    .map_err(|e| ApiError::io(&shown, e))
            }
        })
        .await?,
    );
    let meta = file.metadata().await.map_err(|e| ApiError::io(&p, e))?;
    if meta.is_dir() {
        return Err(ApiError::invalid_file(format!("{p} is a directory")));
    }
    if offset.is_some() || limit.is_some() {
        return Ok(lines(file, offset.unwrap_or(1).max(1), limit));
    }
    let size = meta.len();
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().replace('"', ""))
        .unwrap_or_default();
    let range = parse_range(
        headers.get(header::RANGE).and_then(|v| v.to_str().ok()),
        size,
    );
    let mut builder = Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::ACCEPT_RANGES, "bytes")
        .header(
            header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{name}\""),
        );
    let resp = match range {
        RangeSpec::Whole => builder
            .header(header::CONTENT_LENGTH, size)
            .body(Body::from_stream(ReaderStream::with_capacity(
                file.take(size),
                64 * 1024,
            ))),
        RangeSpec::Part { start, end } => {
            file.seek(SeekFrom::Start(start))
                .await
                .map_err(|e| ApiError::io(&p, e))?;
            let len = end - start + 1;
            builder = builder
                .status(StatusCode::PARTIAL_CONTENT)
                .header(header::CONTENT_RANGE, format!("bytes {start}-{end}/{size}"))
                .header(header::CONTENT_LENGTH, len);
            builder.body(Body::from_stream(ReaderStream::with_capacity(
                file.take(len),
                64 * 1024,
            )))
        }
        RangeSpec::Unsatisfiable => {
            return Ok((
                StatusCode::RANGE_NOT_SATISFIABLE,
                [(
                    header::CONTENT_RANGE,
                    HeaderValue::from_str(&format!("bytes */{size}"))
                        .map_err(|e| ApiError::runtime(e.to_string()))?,
                )],
            )
                .into_response())
        }
    };
    resp.map_err(|e| ApiError::runtime(format!("building response: {e}")))
}

/// Lines `first..first+limit` (1-based), streamed as they are read, joined with `\n` and without a
/// terminator after the last (each line's own `\n` or `\r\n` removed), as the reference answers.
fn lines(file: tokio::fs::File, first: u64, limit: Option<u64>) -> Response {
    struct St {
        reader: BufReader<tokio::fs::File>,
        line_no: u64,
        first: u64,
        remaining: Option<u64>,
    }
    let st = St {
        reader: BufReader::new(file),
        line_no: 0,
        first,
        remaining: limit,
    };
    let stream = futures::stream::unfold(st, |mut st| async move {
        loop {
            if st.remaining == Some(0) {
                return None;
            }
            let mut line = Vec::new();
            match st.reader.read_until(b'\n', &mut line).await {
                Ok(0) => return None,
                Ok(_) => {
                    st.line_no += 1;
                    if st.line_no < st.first {
                        continue;
                    }
                    st.remaining = st.remaining.map(|r| r - 1);
                    if line.last() == Some(&b'\n') {
                        line.pop();
                        if line.last() == Some(&b'\r') {
                            line.pop();
                        }
                    }
                    if st.line_no > st.first {
                        line.insert(0, b'\n');
                    }
                    return Some((Ok::<_, std::io::Error>(line), st));
                }
                Err(e) => return Some((Err(e), st)),
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range(None, 10), RangeSpec::Whole);
        assert_eq!(
            parse_range(Some("bytes=0-3"), 10),
            RangeSpec::Part { start: 0, end: 3 }
        );
        assert_eq!(
            parse_range(Some("bytes=5-"), 10),
            RangeSpec::Part { start: 5, end: 9 }
        );
        assert_eq!(
            parse_range(Some("bytes=-3"), 10),
            RangeSpec::Part { start: 7, end: 9 }
        );
        assert_eq!(
            parse_range(Some("bytes=8-100"), 10),
            RangeSpec::Part { start: 8, end: 9 }
        );
        assert_eq!(parse_range(Some("bytes=10-"), 10), RangeSpec::Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=5-2"), 10), RangeSpec::Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=0-1,3-4"), 10), RangeSpec::Whole);
        assert_eq!(parse_range(Some("items=0-1"), 10), RangeSpec::Whole);
    }
}
