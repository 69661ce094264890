//! warren-execd: the daemon inside every sandbox (usually PID 1). It serves the OpenSandbox execd HTTP API
//! — commands, shell sessions, code contexts on Jupyter kernels, files, metrics and a port proxy — on Unix sockets and/or TCP, runs the
//! sandbox's entrypoint, and reaps every process of the sandbox.

pub mod access;
pub mod browser;
pub mod cli;
pub mod command;
pub mod daemon;
pub mod desktop;
pub mod download;
pub mod error;
pub mod files;
pub mod forker;
pub mod hardening;
pub mod identity;
pub mod ids;
pub mod interpreter;
pub mod isolation;
pub mod lines;
pub mod logbuf;
pub mod metrics;
pub mod oom;
pub mod output;
pub mod process;
pub mod proxy;
pub mod pty;
pub mod query;
pub mod reaper;
pub mod relay;
pub mod safe_path;
pub mod session;
pub mod spare;
pub mod spawn;
pub mod sse;
pub mod upload;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::{any, get, post};
use axum::Router;

use crate::error::{code, ApiError};
use crate::reaper::Reaper;

/// Shared by every handler.
pub struct AppState {
    pub reaper: Reaper,
    /// Relative paths and commands without `cwd` start here.
    pub workdir: PathBuf,
    pub commands: command::Commands,
    pub sessions: session::Sessions,
    pub ptys: pty::Ptys,
    pub contexts: interpreter::Contexts,
    pub metrics: metrics::Sources,
    /// A shell started ahead of the next command.
    pub spare: spare::SpareShell,
    /// Filesystem workers (files as another identity, files of isolated sessions) alive at once.
    pub filesystem_workers: Arc<tokio::sync::Semaphore>,
    /// Isolated sessions (`/v1/isolated/…`).
    pub isolation: isolation::Isolation,
    /// Where files workers come from (see `forker`); `None` in a worker itself.
    pub forker: Option<forker::Forker>,
    /// execd as init and the floor under user code, as `GET /v1/isolated/capabilities` reports it.
    pub hardening: warren_api::hardening::HardeningStatus,
    /// The sandbox's desktop, when it asked for one (see `desktop`).
    pub desktop: Option<Arc<desktop::Desktop>>,
    /// The sandbox's browser, when it asked for one (see `browser`).
    pub browser: Option<Arc<browser::Browser>>,
}

impl AppState {
    pub fn new(reaper: Reaper, workdir: PathBuf) -> Self {
        Self {
            reaper,
            workdir,
            commands: Default::default(),
            sessions: Default::default(),
            ptys: Default::default(),
            contexts: Default::default(),
            metrics: Default::default(),
            spare: Default::default(),
            filesystem_workers: Arc::new(tokio::sync::Semaphore::new(identity::MAX_WORKERS)),
            isolation: Default::default(),
            forker: None,
            desktop: None,
            browser: None,
            hardening: hardening::Hardening::resolve(
                None,
                None,
                hardening::Supervision {
                    init_mode: "none",
                    signal_shield: false,
                },
            )
            .map(|h| h.status)
            .expect("no policy is always a report"),
        }
    }

    /// Absolute paths are taken as they are; anything else is relative to the workdir.
    pub fn resolve(&self, p: &str) -> PathBuf {
        let path = Path::new(p);
        if path.is_absolute() {
            path.to_path_buf()
        } else if p.is_empty() {
            self.workdir.clone()
        } else {
            self.workdir.join(path)
        }
    }

    /// Kills everything execd started (used when execd itself stops).
    pub fn shutdown(&self) {
        self.commands.kill_all();
        self.sessions.kill_all();
        self.ptys.kill_all();
        self.contexts.kill_all();
        self.spare.stop();
    }
}

/// execd's HTTP surface for `state`.
pub fn router(state: Arc<AppState>) -> Router {
    PREBUILT
        .get()
        .cloned()
        .unwrap_or_else(routes)
        .with_state(state)
}

/// Routes built ahead by [`prebuild_routes`].
static PREBUILT: std::sync::OnceLock<Router<Arc<AppState>>> = std::sync::OnceLock::new();

/// Builds the routes once, for every execd this process will fork to come from it: the embedded
/// runtime's zygote does, so each sandbox's execd (its PID 1, forked from there) starts from a
/// clone instead of building ~35 boxed handlers and the path tree itself — ~1 % of the machine's
/// CPU when sandboxes are made back to back.
pub fn prebuild_routes() {
    let _ = PREBUILT.set(routes());
}

/// The file and directory routes: execd's own, and all a filesystem worker serves (see `identity`).
pub fn files_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/files", axum::routing::delete(files::delete_files))
        .route("/files/info", get(files::info))
        .route("/files/permissions", post(files::permissions))
        .route("/files/mv", post(files::mv))
        .route("/files/search", get(files::search))
        .route("/files/replace", post(files::replace))
        .route("/files/upload", post(upload::upload))
        .route("/files/download", get(download::download))
        .route("/directories", post(files::mkdir).delete(files::rmdir))
        .route("/directories/list", get(files::list))
        .fallback(|| async { ApiError::not_found(code::NOT_SUPPORTED, "no such route") })
}

fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/ping", get(|| async { StatusCode::OK }))
        .route("/logs", get(output::logs))
        .route("/command", post(command::run).delete(command::interrupt))
        .route("/command/status/{id}", get(command::status))
        .route("/command/{id}/logs", get(command::logs))
        .route("/pty", post(pty::create))
        .route("/pty/{id}", get(pty::status).delete(pty::delete))
        .route("/pty/{id}/ws", get(pty::ws))
        .route("/session", post(session::create))
        .route("/session/{id}", axum::routing::delete(session::delete))
        .route("/session/{id}/run", post(session::run))
        .route(
            "/code",
            post(interpreter::run).delete(interpreter::interrupt),
        )
        .route("/code/context", post(interpreter::create_context))
        .route(
            "/code/contexts",
            get(interpreter::list_contexts).delete(interpreter::delete_contexts),
        )
        .route(
            "/code/contexts/{id}",
            get(interpreter::get_context).delete(interpreter::delete_context),
        )
        .merge(files_routes())
        .route("/v1/filesystem/{uid}/{gid}/{*rest}", any(identity::forward))
        .route("/v1/isolated/capabilities", get(isolation::capabilities))
        .route("/desktop", get(desktop::info))
        .route("/desktop/screenshot", get(desktop::screenshot))
        .route("/desktop/cursor", get(desktop::cursor))
        .route("/desktop/mouse", post(desktop::mouse))
        .route("/desktop/keyboard", post(desktop::keyboard))
        .route("/desktop/windows", get(desktop::windows))
        .route("/desktop/windows/{id}/focus", post(desktop::focus))
        .route("/desktop/launch", post(desktop::launch))
        .route("/desktop/wait", post(desktop::wait))
        .route(
            "/desktop/recording",
            post(desktop::recording::start)
                .get(desktop::recording::status)
                .delete(desktop::recording::stop),
        )
        .route("/v1/isolated/session", post(isolation::create))
        .route("/v1/isolated/sessions", get(isolation::list))
        .route(
            "/v1/isolated/session/{id}",
            get(isolation::get_session).delete(isolation::delete),
        )
        .route("/v1/isolated/session/{id}/run", post(isolation::run))
        .route(
            "/v1/isolated/session/{id}/runs/{run}",
            get(isolation::run_status),
        )
        .route(
            "/v1/isolated/session/{id}/runs/{run}/logs",
            get(isolation::run_logs),
        )
        .route("/v1/isolated/session/{id}/diff", get(isolation::diff))
        .route("/v1/isolated/session/{id}/commit", post(isolation::commit))
        .route("/v1/isolated/session/{id}/{*rest}", any(isolation::files))
        .route("/v1/isolated/{*rest}", any(isolation::unknown))
        .route("/metrics", get(metrics::metrics))
        .route("/metrics/watch", get(metrics::watch))
        .route("/proxy/{port}", any(proxy::proxy))
        .route("/proxy/{port}/", any(proxy::proxy))
        .route("/proxy/{port}/{*path}", any(proxy::proxy))
        .fallback(|| async { ApiError::not_found(code::NOT_SUPPORTED, "no such route") })
}
