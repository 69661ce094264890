//! Files as another identity: `/v1/filesystem/{uid}/{gid}/files/…` and `…/directories/…` (the
//! SDKs' `files_with_identity`) do what the plain routes do, as that user and group — the kernel
//! checks every permission, and what they create is theirs.
//!
//! As in the reference, each request is served by a worker process of its own: execd starts its
//! binary again with `--filesystem-worker UID GID`, which drops to that identity (no supplementary
//! groups; the kernel clears the capabilities when a root process takes a uid other than 0 — uid 0
//! stays root, as on the plain routes) before it reads anything, and hands it the request over a
//! socket pair. At most [`MAX_WORKERS`] run at once; more requests get 429.
//! Nothing of execd's own identity is shared with the worker but the binary, so a path the user
//! may not reach stays unreachable however the request is shaped; bodies stream both ways, so
//! uploads and downloads of any size work as on the plain routes.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use crate::error::{code, ApiError};
use crate::AppState;

/// The first argument that makes the binary a worker.
pub const WORKER_ARG: &str = "--filesystem-worker";
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
    let permit = worker_permit(app)?;
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| ApiError::runtime(format!("a socket for the worker: {e}")))?;
    let mut cmd = std::process::Command::new(OWN_BINARY);
    cmd.arg(WORKER_ARG)
        .arg(uid.to_string())
        .arg(gid.to_string())
        .arg(&app.workdir)
        .stdin(std::process::Stdio::from(OwnedFd::from(theirs)))
        .stdout(std::process::Stdio::null());
    let spawned = app
        .reaper
        .spawn(&mut cmd)
        .map_err(|e| ApiError::runtime(format!("starting the filesystem worker: {e}")))?;
    drop(cmd); // our copy of the worker's end: the worker alone holds it now
    let path_and_query = match req.uri().query() {
        Some(q) => format!("/{raw_rest}?{q}"),
        None => format!("/{raw_rest}"),
    };
    relay(ours, req, path_and_query, async move {
        // The worker exits once its connection closes; its status is the reaper's to collect.
        let _ = spawned.exit.await;
        drop(spawned.child);
        drop(permit);
    })
    .await
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

/// This process's own binary, whatever its path in the sandbox's view (`/proc/self/exe` reaches it
/// even where no path does): `warren-execd`, or under the embedded runtime, which runs execd in
/// the sandbox's first process without exec'ing it, the `warren` binary — both start a worker on
/// [`WORKER_ARG`].
pub(crate) const OWN_BINARY: &str = "/proc/self/exe";

/// The worker's whole life (`warren-execd --filesystem-worker UID GID WORKDIR`, its stdin the
/// socket): take the identity, then serve one connection of file requests. Returns the exit code.
/// Binaries that run execd in-process dispatch [`WORKER_ARG`] here first thing.
/// Must run in the only thread of its process (setgroups and setres[ug]id below are per thread).
pub fn worker(args: &[std::ffi::OsString]) -> i32 {
    let [uid, gid, workdir] = args else {
        eprintln!("warren-execd {WORKER_ARG}: UID GID WORKDIR");
        return 2;
    };
    let id = |v: &std::ffi::OsString| v.to_str().and_then(|v| v.parse::<u32>().ok());
    let (Some(uid), Some(gid)) = (id(uid), id(gid)) else {
        eprintln!("warren-execd {WORKER_ARG}: bad uid or gid");
        return 2;
    };
    let became = become_identity(uid, gid);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren-execd {WORKER_ARG}: {e}");
            return 1;
        }
    };
    let workdir = std::path::PathBuf::from(workdir);
    runtime.block_on(async move {
        // SAFETY: fd 0 is the socket execd handed over; nothing else in this process owns it.
        let std_stream =
            unsafe { <std::os::unix::net::UnixStream as std::os::fd::FromRawFd>::from_raw_fd(0) };
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
