//! Files as another identity: `/v1/filesystem/{uid}/{gid}/files/…` and `…/directories/…` (the
//! SDKs' `files_with_identity`) do what the plain routes do, as that user and group — the kernel
//! checks every permission, and what they create is theirs.
//!
//! As in the reference, each request is served by a worker process of its own, which drops to
//! that identity (no supplementary groups; the kernel clears the capabilities when a root process
//! takes a uid other than 0 — uid 0 stays root, as on the plain routes) before it reads anything,
//! and is handed the request over a socket pair. Workers are forked, never exec'd: from execd's
//! forker (see `forker`), or in an isolated session from the isolation helper's runner, so no
//! worker runs a host file or can be inspected by the sandbox. At most [`MAX_WORKERS`] run at
//! once; more requests get 429. Nothing of execd's own identity is shared with the worker, so a
//! path the user may not reach stays unreachable however the request is shaped; bodies stream
//! both ways, so uploads and downloads of any size work as on the plain routes.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use crate::error::{code, ApiError};
use crate::AppState;

/// The highest id the protocol takes (the SDKs check the same bound).
const MAX_ID: u64 = 4_294_967_294;
/// What a worker that cannot take the identity answers.
const UNAVAILABLE: &str = "FILESYSTEM_IDENTITY_UNAVAILABLE";

/// `ANY /v1/filesystem/{uid}/{gid}/{*rest}`: the request, as `/{rest}`, served by a worker running
/// as `uid:gid`.
pub async fn forward(
    State(app): State<Arc<AppState>>,
    // (the rest of the path is read raw from the request: see `raw_rest`)
    Path((uid, gid, _rest)): Path<(String, String, String)>,
    req: Request,
) -> Response {
    match forward_inner(&app, &uid, &gid, req).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn forward_inner(
    app: &AppState,
    uid: &str,
    gid: &str,
    req: Request,
) -> Result<Response, ApiError> {
    let id = |name: &str, v: &str| {
        v.parse::<u64>()
            .ok()
            .filter(|n| *n <= MAX_ID)
            .map(|n| n as u32)
            .ok_or_else(|| {
                ApiError::bad_body(format!("{name} must be an integer between 0 and {MAX_ID}"))
            })
    };
    let (uid, gid) = (id("uid", uid)?, id("gid", gid)?);
    // The rest of the path as the client sent it (still percent-encoded: the decoded `rest` could
    // hold a `?` or `/` that was not there), which must be one of the file routes.
    let raw_rest = raw_rest(req.uri().path()).unwrap_or_default().to_owned();
    let first = raw_rest.split('/').next().unwrap_or_default();
    if !(first == "files" || first == "directories") {
        return Err(ApiError::not_found(
            code::NOT_SUPPORTED,
            "only /files and /directories routes take an identity",
        ));
    }
    let forker = app.forker.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            UNAVAILABLE,
            "this execd has no files workers' forker",
        )
    })?;
    let permit = worker_permit(app)?;
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| ApiError::runtime(format!("a socket for the worker: {e}")))?;
    forker
        .spawn(uid, gid, app.workdir.clone(), OwnedFd::from(theirs))
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, UNAVAILABLE, e.to_string()))?;
    let path_and_query = match req.uri().query() {
        Some(q) => format!("/{raw_rest}?{q}"),
        None => format!("/{raw_rest}"),
    };
    // The worker exits once its connection closes (the kernel reaps it: see `forker`).
    relay(ours, req, path_and_query, async move { drop(permit) }).await
}

/// One worker per request in flight, up to [`MAX_WORKERS`]: each is a process. More get 429.
pub(crate) fn worker_permit(app: &AppState) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    app.filesystem_workers
        .clone()
        .try_acquire_owned()
        .map_err(|_| {
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                code::TOO_MANY_REQUESTS,
                format!(
                    "{MAX_WORKERS} requests served by a worker are in flight; retry when one ends"
                ),
            )
        })
}

/// Sends `req` (its path replaced by `path_and_query`) to a worker on `ours` and streams the
/// answer back; `ended` runs once the connection has closed (the worker's end, permits).
pub(crate) async fn relay(
    ours: std::os::unix::net::UnixStream,
    req: Request,
    path_and_query: String,
    ended: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<Response, ApiError> {
    ours.set_nonblocking(true)
        .map_err(|e| ApiError::runtime(e.to_string()))?;
    let stream =
        tokio::net::UnixStream::from_std(ours).map_err(|e| ApiError::runtime(e.to_string()))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|e| ApiError::runtime(format!("the filesystem worker: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.await;
        ended.await;
    });
    let (mut parts, body) = req.into_parts();
    parts.uri = Uri::try_from(path_and_query).map_err(|e| ApiError::bad_body(e.to_string()))?;
    let resp = send
        .send_request(axum::http::Request::from_parts(parts, body))
        .await
        .map_err(|e| ApiError::runtime(format!("the filesystem worker: {e}")))?;
    Ok(resp.map(Body::new))
}

/// Workers alive at once, per execd.
pub const MAX_WORKERS: usize = 64;

/// What follows `/v1/filesystem/{uid}/{gid}/` in a raw request path.
fn raw_rest(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/filesystem/")?;
    let (_uid, rest) = rest.split_once('/')?;
    let (_gid, rest) = rest.split_once('/')?;
    Some(rest)
}

/// A worker's whole life, in a process forked for it (see `forker`; the isolation helper's runner
/// calls it too): become `uid:gid`, then serve one connection of file requests on `conn`, relative
/// paths under `workdir`. Returns the exit code. Must run in the only thread of its process
/// (setgroups and setres[ug]id below are per thread).
pub fn serve_worker(conn: OwnedFd, uid: u32, gid: u32, workdir: std::path::PathBuf) -> i32 {
    // Not dumpable before it reads anything; again after the identity changes, which resets the
    // flag to the system's `suid_dumpable` (never "user" for a changed identity, but say so).
    set_not_dumpable();
    let became = become_identity(uid, gid);
    set_not_dumpable();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren-execd files worker: {e}");
            return 1;
        }
    };
    runtime.block_on(async move {
        let std_stream = std::os::unix::net::UnixStream::from(conn);
        if std_stream.set_nonblocking(true).is_err() {
            return 1;
        }
        let Ok(stream) = tokio::net::UnixStream::from_std(std_stream) else {
            return 1;
        };
        let app = match &became {
            Ok(()) => {
                let state = Arc::new(AppState::new(crate::reaper::Reaper::new(), workdir));
                crate::files_routes().with_state(state)
            }
            Err(why) => {
                let why = format!("cannot act as {uid}:{gid}: {why}");
                axum::Router::new().fallback(move || {
                    let why = why.clone();
                    async move { ApiError::new(StatusCode::NOT_IMPLEMENTED, UNAVAILABLE, why) }
                })
            }
        };
        let service = hyper_util::service::TowerToHyperService::new(app);
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
        0
    })
}

fn set_not_dumpable() {
    // SAFETY: prctl(2) with integer and string arguments.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        libc::prctl(libc::PR_SET_NAME, c"files-worker".as_ptr(), 0, 0, 0);
    }
}

/// Drops to `uid:gid` with no supplementary groups. Raw syscalls: they act on this thread alone,
/// which here is the whole process (glibc's wrappers would signal threads there are none of).
fn become_identity(uid: u32, gid: u32) -> Result<(), String> {
    // SAFETY: plain syscalls on this thread's credentials, with no pointers but a null group list.
    unsafe {
        if libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()) != 0 {
            return Err(format!("setgroups: {}", std::io::Error::last_os_error()));
        }
        if libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0 {
            return Err(format!("setresgid: {}", std::io::Error::last_os_error()));
        }
        if libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0 {
            return Err(format!("setresuid: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}
