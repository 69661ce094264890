//! The isolated execution API (`/v1/isolated/…`, the 1.1.1 SDKs' `sandbox.isolation`): sessions,
//! each a set of namespaces of its own inside the sandbox — its own PID, mount, UTS, IPC and cgroup
//! namespaces, the network's unless shared, the sandbox's tree read-only, its workspace writable,
//! read-only or an overlay whose writes stay in the session — with runs in a persistent shell,
//! background runs, and the files routes as the session sees its files.
//!
//! Sessions are made by the isolation helper (`channel`; the embedded runtime forks it for
//! sandboxes created with `extensions["bootstrap.execd.isolation"] = "enable"`), since execd,
//! under the sandbox's seccomp filter, cannot make namespaces or mounts. Without a helper
//! (another runtime, or the extension not asked for) capabilities say `available: false` and
//! why, and every other route answers 503 `SERVICE_UNAVAILABLE`, as the reference does.
//!
//! Diff and commit are 503 `NOT_SUPPORTED`, as in the reference (which has only stubs). Files
//! routes differ from the reference for the better: they act on the session's real view (a write
//! is visible to the session at once, a delete in an overlay is a real whiteout), through a files
//! worker started inside the session as its identity.

pub mod channel;
mod helper;
mod options;
mod session;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::isolated::{
    BackgroundRunResponse, Capabilities, CreateSessionRequest, CreateSessionResponse, RunRequest,
    SessionList, SessionState, SessionSummary, WorkspaceSpec, TAIL_CURSOR_HEADER,
};

use crate::command::rfc3339;
use crate::error::{code, ApiError, ApiJson, ApiResult};
use crate::AppState;
use helper::Helper;
use session::IsoSession;

/// Sessions one execd holds at once.
pub const MAX_SESSIONS: usize = 32;
/// How often idle sessions are looked for.
const IDLE_TICK: Duration = Duration::from_secs(1);

/// Why no session can be made without the helper.
const WHY_NOT: &str = "isolated sessions are not enabled in this sandbox: create it with \
    extensions {\"bootstrap.execd.isolation\": \"enable\"} (embedded runtime, with user \
    namespaces); otherwise its seccomp filter and capabilities refuse the namespaces and mounts \
    a session is made of";

/// execd's isolated sessions.
#[derive(Default)]
pub struct Isolation {
    helper: Option<Arc<Helper>>,
    sessions: Mutex<HashMap<String, Arc<IsoSession>>>,
}

impl Isolation {
    /// With the helper's socket, sessions can be made.
    pub fn new(helper: Option<OwnedFd>) -> Self {
        Self {
            helper: helper.map(Helper::new),
            ..Default::default()
        }
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Arc<IsoSession>>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn helper(&self) -> ApiResult<&Arc<Helper>> {
        self.helper.as_ref().ok_or_else(unavailable_error)
    }

    fn session(&self, id: &str) -> ApiResult<Arc<IsoSession>> {
        self.helper()?;
        self.map().get(id).cloned().ok_or_else(session_not_found)
    }

    /// Starts the idle collector (with a helper only).
    pub fn start_collector(state: &Arc<AppState>) {
        if state.isolation.helper.is_none() {
            return;
        }
        let weak = Arc::downgrade(state);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(IDLE_TICK);
            loop {
                tick.tick().await;
                let Some(app) = weak.upgrade() else { return };
                let due: Vec<Arc<IsoSession>> = app
                    .isolation
                    .map()
                    .values()
                    .filter(|s| {
                        s.dead.load(std::sync::atomic::Ordering::SeqCst)
                            || (s.idle_remaining() == Some(0)
                                && !s.busy_in_background()
                                && s.shell.try_lock().is_ok())
                    })
                    .cloned()
                    .collect();
                for s in due {
                    tracing::info!(session = %s.id, "isolated session collected (idle or ended)");
                    let _ = app.isolation.remove(&s.id).await;
                }
            }
        });
    }

    /// Removes a session and ends everything in it.
    async fn remove(&self, id: &str) -> ApiResult<()> {
        let helper = self.helper()?.clone();
        let session = self.map().remove(id).ok_or_else(session_not_found)?;
        helper.destroy(session.helper_id).await.map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code::SERVICE_UNAVAILABLE,
                e,
            )
        })
    }
}

fn unavailable_error() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        code::SERVICE_UNAVAILABLE,
        format!("isolation unavailable: {WHY_NOT}"),
    )
}

fn session_not_found() -> ApiError {
    ApiError::not_found(code::SESSION_NOT_FOUND, "session not found")
}

/// `GET /v1/isolated/capabilities`: always 200.
pub async fn capabilities(State(app): State<Arc<AppState>>) -> Json<Capabilities> {
    let iso = &app.isolation;
    let available = iso.helper.is_some();
    let message = if available {
        "sessions have their own mount, PID, UTS, IPC and cgroup namespaces (network unless \
         shared) and run in a user namespace of their own; /proc is the sandbox's (the kernel \
         refuses a procfs of their own under the sandbox's masks): the sandbox's processes are \
         listed there but cannot be signalled or inspected from a session"
    } else {
        WHY_NOT
    };
    Json(Capabilities {
        available,
        isolator: "warren".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        message: message.to_string(),
        setpriv_available: available,
        userns_available: false,
        commit_supported: false,
        diff_supported: false,
        hardening: app.hardening.clone(),
    })
}

/// `POST /v1/isolated/session`: 201.
pub async fn create(
    State(app): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CreateSessionRequest>,
) -> ApiResult<Response> {
    let iso = &app.isolation;
    let helper = iso.helper()?.clone();
    let options = options::normalize(req)?;
    if iso.map().len() >= MAX_SESSIONS {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            code::TOO_MANY_REQUESTS,
            format!("{MAX_SESSIONS} isolated sessions exist; delete one first"),
        ));
    }
    // The workspace and overlay folders are made if missing, as the reference does.
    for o in &options.overlays {
        std::fs::create_dir_all(&o.path).map_err(|e| {
            ApiError::bad_body(format!(
                "{} must be an existing path or one execd can make: {e}",
                o.path
            ))
        })?;
    }
    // The strict profile's /tmp is the session's own — unless the caller's workspace (or another
    // of its mounts) is /tmp or lies in it: then /tmp is the sandbox's, as the reference has it.
    let mounts = options.mounts();
    let private_tmp = options.profile == "strict" && !mounts.iter().any(|m| m.within_tmp());
    let helper_id = helper
        .create(mounts, private_tmp, options.share_net)
        .await
        .map_err(|e| ApiError::runtime(format!("making the session: {e}")))?;
    let id = uuid::Uuid::new_v4().to_string();
    // (variables that are not UTF-8 are left out: the wire cannot carry them anyway)
    let env = options.env(warren_env::vars());
    let session = match IsoSession::start(&helper, id.clone(), helper_id, options, env).await {
        Ok(s) => s,
        Err(e) => {
            let _ = helper.destroy(helper_id).await;
            return Err(ApiError::runtime(e));
        }
    };
    iso.map().insert(id.clone(), session.clone());
    tracing::info!(session = %id, "isolated session created");
    Ok((
        StatusCode::CREATED,
        Json(CreateSessionResponse {
            session_id: id,
            created_at: rfc3339(session.created_at),
        }),
    )
        .into_response())
}

fn state_of(s: &IsoSession) -> SessionState {
    let o = &s.options;
    SessionState {
        status: s.status().into(),
        created_at: rfc3339(s.created_at),
        last_run_at: rfc3339(s.last_run_at()),
        idle_remaining_seconds: s.idle_remaining(),
        profile: o.profile.clone(),
        workspace: (o.overlays.len() == 1).then(|| WorkspaceSpec {
            path: o.overlays[0].path.clone(),
            mode: o.overlays[0].mode.clone(),
        }),
        overlays: o.overlays.clone(),
        extra_writable: o.extra_writable.clone(),
        binds: o.binds.clone(),
        share_net: o.share_net,
        env_passthrough: o.env_passthrough.clone(),
        uid: o.uid,
        gid: o.gid,
        uid_mode: o.uid_mode.clone(),
        idle_timeout_seconds: o.idle_timeout_seconds,
    }
}

/// `GET /v1/isolated/sessions`.
pub async fn list(State(app): State<Arc<AppState>>) -> ApiResult<Json<SessionList>> {
    app.isolation.helper()?;
    let mut sessions: Vec<SessionSummary> = app
        .isolation
        .map()
        .values()
        .map(|s| SessionSummary {
            session_id: s.id.clone(),
            status: s.status().into(),
            created_at: rfc3339(s.created_at),
            last_run_at: rfc3339(s.last_run_at()),
            idle_remaining_seconds: s.idle_remaining(),
        })
        .collect();
    sessions.sort_by(|a, b| a.created_at.cmp(&b.created_at));
    Ok(Json(SessionList { sessions }))
}

/// `GET /v1/isolated/session/{id}`.
pub async fn get_session(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<SessionState>> {
    let session = app.isolation.session(&id)?;
    Ok(Json(state_of(&session)))
}

/// `DELETE /v1/isolated/session/{id}`.
pub async fn delete(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult<()> {
    app.isolation.remove(&id).await?;
    tracing::info!(session = %id, "isolated session deleted");
    Ok(())
}

/// `POST /v1/isolated/session/{id}/run`: an event stream, or 202 for a background run.
pub async fn run(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<RunRequest>,
) -> ApiResult<Response> {
    let session = app.isolation.session(&id)?;
    if req.code.trim().is_empty() {
        return Err(ApiError::bad_body("code must not be empty"));
    }
    let timeout = match req.timeout_seconds {
        Some(t) if t < 0 => return Err(ApiError::bad_body("timeout_seconds cannot be negative")),
        Some(t) if t > 0 => Some(Duration::from_secs(t as u64)),
        _ => None,
    };
    if session.dead.load(std::sync::atomic::Ordering::SeqCst) {
        let _ = app.isolation.remove(&id).await;
        return Err(session_not_found());
    }
    if req.background.unwrap_or(false) {
        let helper = app.isolation.helper()?.clone();
        let run = session
            .start_background(&helper, &req.code, req.envs.as_ref())
            .await
            .map_err(ApiError::bad_body)?;
        return Ok((
            StatusCode::ACCEPTED,
            Json(BackgroundRunResponse {
                session_id: id,
                run_id: run.id.clone(),
                started_at: rfc3339(run.started_at),
            }),
        )
            .into_response());
    }
    let (stream, response) = crate::sse::channel();
    let app2 = app.clone();
    tokio::spawn(async move {
        let started = Instant::now();
        let outcome = session
            .run(
                &req.code,
                req.envs.as_ref(),
                timeout,
                stream.tx.clone(),
                stream.cancelled.clone(),
            )
            .await;
        let elapsed = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
        let _ = stream.tx.send(outcome.event(elapsed)).await;
        if matches!(outcome, session::Outcome::ShellGone(_)) {
            // As in the reference, a session whose shell ended is gone.
            let _ = app2.isolation.remove(&id).await;
        }
    });
    Ok(response)
}

/// `GET /v1/isolated/session/{id}/runs/{run}`.
pub async fn run_status(
    State(app): State<Arc<AppState>>,
    Path((id, run)): Path<(String, String)>,
) -> ApiResult<Response> {
    let session = app.isolation.session(&id)?;
    let run = session.background_run(&run).ok_or_else(session_not_found)?;
    Ok(Json(run.status(&id)).into_response())
}

#[derive(serde::Deserialize)]
pub struct LogsQuery {
    #[serde(default)]
    cursor: Option<String>,
}

/// `GET /v1/isolated/session/{id}/runs/{run}/logs?cursor=N`: the output after byte N, and the
/// next offset in a header.
pub async fn run_logs(
    State(app): State<Arc<AppState>>,
    Path((id, run)): Path<(String, String)>,
    Query(q): Query<LogsQuery>,
) -> ApiResult<Response> {
    let cursor = match q.cursor.as_deref() {
        None | Some("") => 0,
        Some(c) => {
            let n: i64 = c
                .parse()
                .map_err(|_| ApiError::bad_body("cursor must be an integer"))?;
            usize::try_from(n).map_err(|_| ApiError::bad_body("cursor cannot be negative"))?
        }
    };
    let session = app.isolation.session(&id)?;
    let run = session.background_run(&run).ok_or_else(session_not_found)?;
    let (text, next) = run.log.tail(cursor);
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp.headers_mut()
        .insert(TAIL_CURSOR_HEADER, HeaderValue::from(next as u64));
    Ok(resp)
}

/// `GET …/diff` and `POST …/commit`: not supported, as in the reference.
pub async fn diff(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult<()> {
    app.isolation.session(&id)?;
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        code::NOT_SUPPORTED,
        "diff not implemented yet (phase 2)",
    ))
}

pub async fn commit(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult<()> {
    app.isolation.session(&id)?;
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        code::NOT_SUPPORTED,
        "commit not implemented yet (phase 2)",
    ))
}

/// `…/session/{id}/files/…` and `…/directories…`: served by a files worker started inside the
/// session, as its identity, so paths mean what they mean to the session's own processes.
pub async fn files(
    State(app): State<Arc<AppState>>,
    Path((id, rest)): Path<(String, String)>,
    req: Request,
) -> Response {
    let first = rest.split('/').next().unwrap_or_default();
    if !(first == "files" || first == "directories") {
        return unknown(State(app)).await.into_response();
    }
    match files_inner(&app, &id, req).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn files_inner(app: &Arc<AppState>, id: &str, req: Request) -> ApiResult<Response> {
    let session = app.isolation.session(id)?;
    let helper = app.isolation.helper()?.clone();
    // The rest of the raw path (still percent-encoded), as `/files/…` or `/directories…`.
    let prefix = format!("/v1/isolated/session/{id}");
    let rest = req
        .uri()
        .path()
        .strip_prefix(&prefix)
        .unwrap_or_default()
        .to_owned();
    let path_and_query = match req.uri().query() {
        Some(q) => format!("{rest}?{q}"),
        None => rest,
    };
    let permit = crate::identity::worker_permit(app)?;
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| ApiError::runtime(format!("a socket for the worker: {e}")))?;
    let o = &session.options;
    // The worker takes the session's identity itself (it needs root's rights to).
    let started = helper
        .files_worker(
            session.helper_id,
            (o.uid, o.gid),
            o.workdir().to_string(),
            OwnedFd::from(theirs),
        )
        .await
        .map_err(|e| ApiError::runtime(format!("starting the files worker: {e}")))?;
    let mut end = started.end;
    crate::identity::relay(ours, req, path_and_query, async move {
        let _ = end.wait_for(Option::is_some).await;
        drop(permit);
    })
    .await
}

/// Every `/v1/isolated/…` route this execd does not serve.
pub async fn unknown(State(app): State<Arc<AppState>>) -> ApiError {
    if app.isolation.helper.is_none() {
        return unavailable_error();
    }
    ApiError::not_found(code::NOT_SUPPORTED, "no such route")
}
