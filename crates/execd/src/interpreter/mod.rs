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

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use serde::Deserialize;
use serde_json::Value;
use warren_api::execd::{
    CodeContext, CreateContextRequest, EventKind, ExecError, RunCodeRequest, StreamEvent,
};

use crate::error::{code, ApiError, ApiJson, ApiResult};
use crate::sse::{self, EventStream};
use crate::AppState;
use kernel::{Event, Kernel, Launch};

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

/// How long an interrupt may show no effect before it is sent again, and how long one asked for
/// before the kernel shows the execution started (`execute_input`) waits for that before it is sent
/// anyway (a kernel that never shows it). An interrupt is held until then because ipykernel turns
/// SIGINT on only while it handles a message, and one landing in the few instructions between
/// turning it on and entering the handler's `try` escapes the event loop: the kernel exits. Once
/// the execution started, its handler takes the interrupt. A kernel drops one that lands outside an
/// execution, hence the resends; none once the execution shows it ended (an `error`, a reply,
/// idle), since one landing while ipykernel turns SIGINT off again stops the kernel the same way.
const INTERRUPT_AGAIN: Duration = Duration::from_secs(1);
/// After an interrupt, how long an idle kernel gets to send the `execute_reply` it owes before the
/// run ends without it.
const REPLY_AFTER_IDLE: Duration = Duration::from_secs(1);
/// Interrupts sent again at most this many times per execution: code that catches
/// `KeyboardInterrupt` and goes on is the user's to stop (a restart of the context), not a signal
/// every second for as long as it runs.
const INTERRUPT_RESENDS: u32 = 10;
/// For kernels whose output may trail their idle status ([`kernel::Kernel::late_output`]): how
/// long the execution's messages must have been quiet, once it is idle with its reply, before the
/// run ends.
const LATE_OUTPUT_QUIET: Duration = Duration::from_millis(50);

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

/// Runs one execution and turns the kernel's messages into the event stream. Returns only when the
/// kernel is idle again (or dead), so the context's busy lock covers the whole execution even when the
/// client went away (then the execution is interrupted, not left running).
///
/// Once interrupted (`DELETE /code`, or the client gone) the interrupt is sent again until the
/// execution ends, and an idle kernel ends it even without its `execute_reply` (after
/// [`REPLY_AFTER_IDLE`]): the stream always ends with a terminal event, and the context is free.
async fn drive(ctx: &Context, kernel: &Kernel, code: &str, out: EventStream) {
    let started = Instant::now();
    let send = |ev: StreamEvent| {
        let tx = out.tx.clone();
        async move {
            let _ = tx.send(ev).await;
        }
    };
    // Interrupts from before this run are not for it; any after its `init` are.
    let mut interrupts = ctx.interrupts.subscribe();
    interrupts.mark_unchanged();
    send(sse::init(&ctx.id)).await;
    let (msg_id, mut rx) = match kernel.execute(code).await {
        Ok(r) => r,
        Err(why) => return send(kernel_died(why)).await,
    };
    let (mut idle, mut reply, mut failed) = (false, None::<Value>, false);
    // When an interrupt was asked for, when one was last sent for this execution, and when the
    // kernel was first seen idle after one was asked for.
    let (mut asked, mut sent, mut idle_since) = (None::<Instant>, None::<Instant>, None::<Instant>);
    // The kernel showed this execution started (its `execute_input`).
    let mut executing = false;
    let mut resends = 0u32;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let late_output = kernel.late_output();
    while !(idle && reply.is_some()) || late_output {
        let ending = idle || failed || reply.is_some();
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = tokio::time::sleep(LATE_OUTPUT_QUIET), if late_output && idle && reply.is_some() => break,
            _ = out.cancelled.cancelled(), if asked.is_none() => {
                tracing::info!(context = %ctx.id, "client went away; interrupting the execution");
                asked = Some(Instant::now());
                if idle {
                    idle_since.get_or_insert_with(Instant::now);
                }
                if executing && !ending {
                    sent = Some(Instant::now());
                    kernel.interrupt().await;
                }
                continue;
            }
            Ok(()) = interrupts.changed() => {
                asked = Some(Instant::now());
                if idle {
                    // already idle, the reply still owed: the idle clock starts now
                    idle_since.get_or_insert_with(Instant::now);
                }
                if executing && !ending {
                    sent = Some(Instant::now());
                    kernel.interrupt().await;
                }
                continue;
            }
            _ = tick.tick(), if asked.is_some() => {
                if idle_since.is_some_and(|t| t.elapsed() >= REPLY_AFTER_IDLE) {
                    tracing::info!(context = %ctx.id, "interrupted kernel is idle without a reply; ending the run");
                    reply = Some(serde_json::json!({
                        "status": "error",
                        "ename": "KeyboardInterrupt",
                        "evalue": "interrupted",
                        "traceback": [],
                    }));
                    break;
                }
                // sent again after a while without effect; held ones sent anyway after as long
                let since = sent.or(asked);
                if !ending
                    && resends < INTERRUPT_RESENDS
                    && since.is_some_and(|t| t.elapsed() >= INTERRUPT_AGAIN)
                {
                    resends += 1;
                    sent = Some(Instant::now());
                    kernel.interrupt().await;
                }
                continue;
            }
        };
        let msg = match ev {
            Some(Event::IoPub(m)) => m,
            Some(Event::Reply(m)) => {
                reply = Some(m.content);
                continue;
            }
            Some(Event::Died(why)) => {
                if !failed {
                    send(kernel_died(why)).await;
                }
                return;
            }
            None => return,
        };
        let c = &msg.content;
        if msg.msg_type() == "status" {
            idle |= c["execution_state"] == "idle";
            if idle && asked.is_some() {
                idle_since.get_or_insert_with(Instant::now);
            }
        }
        if msg.msg_type() == "execute_input" && !executing {
            executing = true;
            // an interrupt held until now goes out at once
            if asked.is_some() && sent.is_none() && !(idle || failed || reply.is_some()) {
                sent = Some(Instant::now());
                kernel.interrupt().await;
            }
        }
        if failed {
            continue; // `error` is terminal for the stream; just wait for the kernel to go idle
        }
        match msg.msg_type() {
            "status" => {
                let state = c["execution_state"].as_str().unwrap_or_default();
                send(sse::event(EventKind::Status, Some(state.to_string()))).await;
            }
            "stream" => {
                let kind = if c["name"] == "stderr" {
                    EventKind::Stderr
                } else {
                    EventKind::Stdout
                };
                let text = c["text"].as_str().unwrap_or_default().to_string();
                send(sse::event(kind, Some(text))).await;
            }
            "execute_input" => {
                if let Some(n) = c["execution_count"].as_i64() {
                    send(StreamEvent {
                        execution_count: Some(n),
                        ..sse::event(EventKind::ExecutionCount, None)
                    })
                    .await;
                }
            }
            "execute_result" | "display_data" | "update_display_data" => {
                send(StreamEvent {
                    results: Some(kernel::results_of(&c["data"])),
                    execution_count: c["execution_count"].as_i64(),
                    ..sse::event(EventKind::Result, None)
                })
                .await;
            }
            "error" => {
                failed = true;
                send(error_event(c)).await;
            }
            _ => {}
        }
    }
    kernel.forget(&msg_id);
    if failed {
        return;
    }
    let reply = reply.unwrap_or_default();
    match reply["status"].as_str() {
        Some("error") => send(error_event(&reply)).await,
        Some("aborted") => {
            // An interrupt that reaches the kernel before the execution starts makes ipykernel
            // abort it: to the caller that is its interrupt, answered as every other one.
            let (ename, evalue) = match asked {
                Some(_) => ("KeyboardInterrupt", "interrupted before it started"),
                None => ("ExecutionAborted", "the kernel aborted the execution"),
            };
            send(StreamEvent {
                error: Some(ExecError {
                    ename: ename.into(),
                    evalue: evalue.into(),
                    traceback: Vec::new(),
                }),
                ..sse::event(EventKind::Error, None)
            })
            .await
        }
        _ => send(sse::complete(started.elapsed().as_millis() as i64)).await,
    }
}

fn error_event(content: &Value) -> StreamEvent {
    let traceback = content["traceback"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|l| l.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default();
    StreamEvent {
        error: Some(ExecError {
            // bash_kernel, for one, reports a failing command with an empty ename
            ename: content["ename"]
                .as_str()
                .filter(|n| !n.is_empty())
                .unwrap_or("Error")
                .to_string(),
            evalue: content["evalue"].as_str().unwrap_or_default().to_string(),
            traceback,
        }),
        ..sse::event(EventKind::Error, None)
    }
}
