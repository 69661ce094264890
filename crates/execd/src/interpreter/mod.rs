//! The code interpreter (reference §3.5): code contexts, each one real Jupyter kernel found through the
//! image's kernelspecs, driven over the Jupyter messaging protocol — or, for Java and Go where the
//! image has no kernel for them, the language's own tools in the image (see `tools`).
//!
//! A context runs one execution at a time (a second one is refused with 409 `CONTEXT_BUSY`, never
//! queued behind a runaway loop). Runs without a context id go to a default context per language,
//! created on first use and replaced if its kernel died. A kernel that dies mid-run ends the stream
//! with an `error` event saying why; the context then stays dead (its state is gone) until deleted.

pub mod gorun;
pub mod jshell;
pub mod jupyter_port;
pub mod kernel;
pub mod kernelspec;
pub mod message;
pub mod tools;
pub mod zmtp;

mod drive;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use serde::Deserialize;
use warren_api::execd::{
    CodeContext, CreateContextRequest, EventKind, ExecError, RunCodeRequest, StreamEvent,
};

use crate::error::{code, ApiError, ApiJson, ApiResult};
use crate::sse::{self};
use crate::AppState;
use drive::drive;
use kernel::{Kernel, Launch};

pub const CONTEXT_BUSY: &str = "CONTEXT_BUSY";
/// The `ename` of the error event sent when a context's kernel process is gone.
pub const KERNEL_DIED: &str = "KernelDied";

/// What runs a context's code.
enum Engine {
    Jupyter(Kernel),
    Jshell(jshell::Jshell),
    Go(gorun::GoRun),
}

impl Engine {
    /// Why the context cannot run code any more, if it cannot.
    fn died(&self) -> Option<String> {
        match self {
            Engine::Jupyter(k) => k.died(),
            Engine::Jshell(j) => j.died(),
            Engine::Go(_) => None,
        }
    }

    fn kill(&self) {
        match self {
            Engine::Jupyter(k) => k.kill(),
            Engine::Jshell(j) => j.kill(),
            Engine::Go(g) => g.kill(),
        }
    }

    async fn shutdown(&self) {
        match self {
            Engine::Jupyter(k) => k.shutdown().await,
            Engine::Jshell(j) => j.shutdown().await,
            Engine::Go(g) => g.kill(),
        }
    }
}

pub struct Context {
    pub id: String,
    pub language: String,
    engine: Engine,
    /// Held by the running execution.
    busy: Arc<tokio::sync::Mutex<()>>,
    /// Counts `DELETE /code?id=` calls: the running execution (if any) sees each one through.
    interrupts: tokio::sync::watch::Sender<u64>,
}

impl Context {
    fn info(&self) -> CodeContext {
        CodeContext {
            id: self.id.clone(),
            language: self.language.clone(),
        }
    }
}

#[derive(Default)]
pub struct Contexts {
    map: Mutex<HashMap<String, Arc<Context>>>,
    /// language → id of its default context.
    defaults: Mutex<HashMap<String, String>>,
    /// Serialises creating default contexts, so two first runs do not start two kernels.
    default_create: tokio::sync::Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Contexts {
    fn get(&self, id: &str) -> Option<Arc<Context>> {
        lock(&self.map).get(id).cloned()
    }

    fn remove(&self, id: &str) -> Option<Arc<Context>> {
        lock(&self.defaults).retain(|_, v| v != id);
        lock(&self.map).remove(id)
    }

    /// Kills every kernel (execd is stopping).
    pub fn kill_all(&self) {
        for (_, ctx) in lock(&self.map).drain() {
            ctx.engine.kill();
        }
    }
}

/// Where connection files go: private to execd's user, outside the workdir.
fn runtime_dir() -> PathBuf {
    std::env::temp_dir().join("warren-kernels")
}

async fn start_context(
    app: &AppState,
    language: &str,
    cwd: Option<&str>,
) -> ApiResult<Arc<Context>> {
    let language = kernelspec::normalize_language(language);
    let env = crate::process::base_env();
    let dirs = kernelspec::search_path(
        env.get("JUPYTER_PATH").map(String::as_str),
        env.get("HOME").map(String::as_str),
    );
    let specs = kernelspec::discover(&dirs);
    let cwd = app.resolve(cwd.unwrap_or_default());
    if !cwd.is_dir() {
        return Err(ApiError::bad_body(format!(
            "cwd {} is not a directory",
            cwd.display()
        )));
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let started = Instant::now();
    let engine = match kernelspec::pick(&specs, &language) {
        Some(spec) => {
            let kernel = Kernel::start(Launch {
                spec,
                cwd: &cwd,
                runtime_dir: &runtime_dir(),
                id: &id,
                reaper: &app.reaper,
                sources: &app.metrics,
            })
            .await
            .map_err(|e| ApiError::runtime(format!("starting the {language} kernel: {e}")))?;
            tracing::info!(context = %id, kernel = %spec.name, pid = kernel.pid, ms = started.elapsed().as_millis() as u64, "kernel ready");
            Engine::Jupyter(kernel)
        }
        None => {
            let tool = tools::Tool::find(&language, &env).ok_or_else(|| {
                let have: Vec<String> = specs
                    .iter()
                    .map(|s| format!("{} ({})", s.name, s.language))
                    .collect();
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    code::NOT_SUPPORTED,
                    format!(
                        "no Jupyter kernel for language '{language}' in this sandbox's image (kernelspecs found: {}); \
                         Python needs the python3-ipykernel package (or `pip install ipykernel`); Java, a JDK \
                         (its jshell); Go, a Go toolchain (Debian's golang-go)",
                        if have.is_empty() { "none".to_string() } else { have.join(", ") }
                    ),
                )
            })?;
            let launch = tools::ToolLaunch {
                program: tool.program(),
                cwd: &cwd,
                runtime_dir: &runtime_dir(),
                id: &id,
                reaper: &app.reaper,
                sources: &app.metrics,
            };
            let engine = match &tool {
                tools::Tool::Java(_) => jshell::Jshell::start(&launch).await.map(Engine::Jshell),
                tools::Tool::Go(_) => gorun::GoRun::start(&launch).map(Engine::Go),
            }
            .map_err(|e| ApiError::runtime(format!("starting the {language} context: {e}")))?;
            tracing::info!(context = %id, tool = %tool.program().display(), ms = started.elapsed().as_millis() as u64, "context ready");
            engine
        }
    };
    let ctx = Arc::new(Context {
        id: id.clone(),
        language,
        engine,
        busy: Default::default(),
        interrupts: tokio::sync::watch::Sender::new(0),
    });
    lock(&app.contexts.map).insert(id, ctx.clone());
    Ok(ctx)
}

pub async fn create_context(
    State(app): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CreateContextRequest>,
) -> ApiResult<Json<CodeContext>> {
    if req.language.trim().is_empty() {
        return Err(ApiError::bad_body("language is required"));
    }
    let ctx = start_context(&app, &req.language, req.cwd.as_deref()).await?;
    Ok(Json(ctx.info()))
}

#[derive(Debug, Deserialize)]
pub struct LanguageQuery {
    language: Option<String>,
}

pub async fn list_contexts(
    State(app): State<Arc<AppState>>,
    Query(q): Query<LanguageQuery>,
) -> Json<Vec<CodeContext>> {
    let lang = q
        .language
        .filter(|l| !l.trim().is_empty())
        .map(|l| kernelspec::normalize_language(&l));
    let mut out: Vec<CodeContext> = lock(&app.contexts.map)
        .values()
        .filter(|c| lang.as_ref().is_none_or(|l| *l == c.language))
        .map(|c| c.info())
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Json(out)
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(code::CONTEXT_NOT_FOUND, format!("no code context {id}"))
}

pub async fn get_context(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<CodeContext>> {
    let ctx = app.contexts.get(&id).ok_or_else(|| not_found(&id))?;
    Ok(Json(ctx.info()))
}

pub async fn delete_context(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let ctx = app.contexts.remove(&id).ok_or_else(|| not_found(&id))?;
    ctx.engine.shutdown().await;
    Ok(StatusCode::OK)
}

pub async fn delete_contexts(
    State(app): State<Arc<AppState>>,
    Query(q): Query<LanguageQuery>,
) -> ApiResult<StatusCode> {
    let lang = q
        .language
        .filter(|l| !l.trim().is_empty())
        .map(|l| kernelspec::normalize_language(&l))
        .ok_or_else(|| ApiError::missing_query("language"))?;
    let ids: Vec<String> = lock(&app.contexts.map)
        .values()
        .filter(|c| c.language == lang)
        .map(|c| c.id.clone())
        .collect();
    let doomed: Vec<_> = ids
        .iter()
        .filter_map(|id| app.contexts.remove(id))
        .collect();
    futures::future::join_all(doomed.iter().map(|c| c.engine.shutdown())).await;
    Ok(StatusCode::OK)
}

#[derive(Debug, Deserialize)]
pub struct InterruptQuery {
    id: Option<String>,
}

/// `DELETE /code?id=` — `id` is the context id (what the run's `init` event carried).
pub async fn interrupt(
    State(app): State<Arc<AppState>>,
    Query(q): Query<InterruptQuery>,
) -> ApiResult<StatusCode> {
    let id =
        q.id.filter(|s| !s.is_empty())
            .ok_or_else(|| ApiError::missing_query("id"))?;
    let ctx = app.contexts.get(&id).ok_or_else(|| not_found(&id))?;
    // The running execution sends it when the kernel can take it, and again until it ends; with
    // none running, nothing waits.
    ctx.interrupts.send_modify(|n| *n += 1);
    Ok(StatusCode::OK)
}

/// The context a run goes to: the named one, or the language's default (started if missing or dead).
async fn resolve_context(app: &AppState, req: &RunCodeRequest) -> ApiResult<Arc<Context>> {
    let wanted = req.context.clone().unwrap_or_default();
    let language = wanted
        .language
        .as_deref()
        .filter(|l| !l.trim().is_empty())
        .map(kernelspec::normalize_language);
    if let Some(id) = wanted.id.as_deref().filter(|s| !s.is_empty()) {
        let ctx = app.contexts.get(id).ok_or_else(|| not_found(id))?;
        if let Some(lang) = language.filter(|l| *l != ctx.language) {
            return Err(ApiError::bad_body(format!(
                "context {id} is a {} context, not {lang}",
                ctx.language
            )));
        }
        return Ok(ctx);
    }
    let language = language.unwrap_or_else(|| "python".to_string());
    let _creating = app.contexts.default_create.lock().await;
    let current = lock(&app.contexts.defaults)
        .get(&language)
        .and_then(|id| app.contexts.get(id));
    match current {
        Some(ctx) if ctx.engine.died().is_none() => Ok(ctx),
        stale => {
            if let Some(dead) = stale {
                app.contexts.remove(&dead.id);
            }
            let ctx = start_context(app, &language, None).await?;
            lock(&app.contexts.defaults).insert(language, ctx.id.clone());
            Ok(ctx)
        }
    }
}

pub async fn run(
    State(app): State<Arc<AppState>>,
    ApiJson(req): ApiJson<RunCodeRequest>,
) -> ApiResult<Response> {
    if req.code.trim().is_empty() {
        return Err(ApiError::bad_body("code is empty"));
    }
    let ctx = resolve_context(&app, &req).await?;
    let busy = ctx.busy.clone().try_lock_owned().map_err(|_| {
        ApiError::new(
            StatusCode::CONFLICT,
            CONTEXT_BUSY,
            format!(
                "context {} is running another execution; wait for it or interrupt it (DELETE /code?id={})",
                ctx.id, ctx.id
            ),
        )
    })?;
    let (stream, response) = sse::channel();
    tokio::spawn(async move {
        match &ctx.engine {
            Engine::Jupyter(kernel) => drive(&ctx, kernel, &req.code, stream).await,
            Engine::Jshell(j) => {
                j.run(&ctx.id, &req.code, &stream, ctx.interrupts.subscribe())
                    .await
            }
            Engine::Go(g) => {
                g.run(&ctx.id, &req.code, &stream, ctx.interrupts.subscribe())
                    .await
            }
        }
        drop(busy);
    });
    Ok(response)
}

pub(crate) fn kernel_died(why: String) -> StreamEvent {
    StreamEvent {
        error: Some(ExecError {
            ename: KERNEL_DIED.to_string(),
            evalue: why,
            traceback: Vec::new(),
        }),
        ..sse::event(EventKind::Error, None)
    }
}
