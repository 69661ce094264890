//! Sandbox diagnostics, as the 1.1.1 clients ask for them (`osb diagnostics`, the SDKs'
//! `get_diagnostic_logs|events`, and the deprecated `osb devops`).
//!
//! With `scope`, `logs` and `events` answer the protocol's JSON descriptor with the text inline:
//! logs (`container`) are what the sandbox's entrypoint and execd printed, from the bounded ring
//! execd keeps in the sandbox (1 MiB), and (`lifecycle`) the last runs of its lifecycle hooks; events (`runtime`) are the sandbox's state changes this
//! server has seen (the newest 200, in memory). `all` is both. Without `scope` the deprecated
//! plain-text forms answer, as the reference keeps them for older clients: `logs?tail=`,
//! `events?limit=`, `inspect`, `summary`.

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use warren_api::lifecycle::{DiagnosticContent, DiagnosticContext, SandboxState};
use warren_api::{ErrorBody, ErrorCode};

use crate::error::{ErrorKind, SandboxError};
use crate::http::AppState;
use crate::sandboxes::Events;
use crate::time::rfc3339;

const LOG_SCOPES: &[&str] = &["container", "lifecycle", "all"];
const EVENT_SCOPES: &[&str] = &["runtime", "all"];

#[derive(Debug, Deserialize)]
pub struct LogsQuery {
    scope: Option<String>,
    /// Deprecated plain text: trailing lines.
    tail: Option<usize>,
    /// Deprecated plain text: accepted, not applied (the output carries no timestamps).
    #[allow(dead_code)]
    since: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct EventsQuery {
    scope: Option<String>,
    /// Deprecated plain text: the newest events.
    limit: Option<usize>,
}

#[derive(Debug, Deserialize)]
pub struct SummaryQuery {
    tail: Option<usize>,
    event_limit: Option<usize>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/diagnostics/logs", tag = "diagnostics",
    params(("id" = String, Path), ("scope" = Option<String>, Query, description = "container or all; without it, the deprecated plain text")),
    responses((status = 200, body = DiagnosticContent), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn logs(
    State(app): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<LogsQuery>,
) -> Result<Response, SandboxError> {
    let Some(scope) = q.scope else {
        let tail = q.tail.unwrap_or(100).clamp(1, 10_000);
        let (text, _) = output(&app, &id).await?;
        return Ok(deprecated(last_lines(&text, tail)));
    };
    check_scope("logs", &scope, LOG_SCOPES)?;
    if scope == "lifecycle" {
        // The runs of the sandbox's lifecycle hooks (preStart, periodic), newest last.
        visible(&app, &id)?;
        let text = app.sandboxes.hook_runs(&id);
        return Ok(Json(content(&id, "logs", &scope, text, Note::default())).into_response());
    }
    let (mut text, mut note) = output(&app, &id).await?;
    if scope == "all" {
        let runs = app.sandboxes.hook_runs(&id);
        if !runs.is_empty() {
            text.push_str("\n--- lifecycle hooks ---\n");
            text.push_str(&runs);
        }
        let events = events_of(&app, &id)?;
        text.push_str("\n--- lifecycle events ---\n");
        text.push_str(&events_text(&events, usize::MAX));
        note.warnings.extend(events_warnings(&events));
        note.truncated |= events.dropped > 0;
    }
    Ok(Json(content(&id, "logs", &scope, text, note)).into_response())
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/diagnostics/events", tag = "diagnostics",
    params(("id" = String, Path), ("scope" = Option<String>, Query, description = "runtime or all; without it, the deprecated plain text")),
    responses((status = 200, body = DiagnosticContent), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn events(
    State(app): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
) -> Result<Response, SandboxError> {
    let events = events_of(&app, &id)?;
    let Some(scope) = q.scope else {
        let limit = q.limit.unwrap_or(50).clamp(1, 500);
        return Ok(deprecated(events_text(&events, limit)));
    };
    check_scope("events", &scope, EVENT_SCOPES)?;
    let note = Note {
        truncated: events.dropped > 0,
        warnings: events_warnings(&events),
    };
    let text = events_text(&events, usize::MAX);
    Ok(Json(content(&id, "events", &scope, text, note)).into_response())
}

/// Deprecated: the sandbox's record as the server keeps it, without secrets (its endpoint token is
/// left out, its env shows names only).
pub async fn inspect(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, SandboxError> {
    Ok(plain(inspect_text(&app, &id)?))
}

/// Deprecated: inspect, events and logs in one text.
pub async fn summary(
    State(app): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<SummaryQuery>,
) -> Result<Response, SandboxError> {
    let tail = q.tail.unwrap_or(50).clamp(1, 10_000);
    let limit = q.event_limit.unwrap_or(20).clamp(1, 500);
    let inspect = inspect_text(&app, &id)?;
    let events = events_of(&app, &id)?;
    let logs = match output(&app, &id).await {
        Ok((text, _)) => last_lines(&text, tail),
        Err(e) => format!("[error] {}\n", e.public_message()),
    };
    let rule = "=".repeat(72);
    let line = "-".repeat(40);
    Ok(plain(format!(
        "{rule}\nSANDBOX DIAGNOSTICS SUMMARY\nSandbox ID: {id}\n{rule}\n\n{line}\nINSPECT\n{line}\n{inspect}\n\
         {line}\nEVENTS\n{line}\n{}\n{line}\nLOGS (last {tail} lines)\n{line}\n{logs}",
        events_text(&events, limit)
    )))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/diagnostics/context", tag = "diagnostics",
    params(("id" = String, Path)),
    responses((status = 200, body = DiagnosticContext), (status = 404, body = ErrorBody)))]
/// Where the sandbox runs: the runtime's kind, and the names its backend knows it by (the 1.1.2
/// clients' `get_diagnostic_context`). Nothing secret, nothing of the host's layout.
pub async fn context(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<DiagnosticContext>, SandboxError> {
    let rec = visible(&app, &id)?;
    let runtime = app.sandboxes.runtime();
    let mut identifiers = runtime.backend_identifiers(&id);
    identifiers.insert("runtime".into(), runtime.name());
    Ok(Json(DiagnosticContext {
        sandbox_id: rec.id,
        backend_type: app.config.runtime.kind.as_str().into(),
        backend_identifiers: identifiers,
        state: Some(rec.state),
    }))
}

/// Non-fatal facts about what the text holds.
#[derive(Default)]
struct Note {
    truncated: bool,
    warnings: Vec<String>,
}

fn check_scope(kind: &str, scope: &str, supported: &[&str]) -> Result<(), SandboxError> {
    if supported.contains(&scope) {
        return Ok(());
    }
    Err(SandboxError::new(
        ErrorKind::Invalid,
        ErrorCode::DiagnosticsScopeUnsupported,
        format!(
            "unsupported {kind} diagnostics scope {scope:?}; supported scopes: {}",
            supported.join(", ")
        ),
    ))
}

/// The sandbox's output, with what explains an empty or partial one. A sandbox that is not running
/// has no execd to ask: the text is empty and a warning says why.
async fn output(app: &AppState, id: &str) -> Result<(String, Note), SandboxError> {
    let rec = visible(app, id)?;
    let mut note = Note::default();
    if rec.state != SandboxState::Running {
        note.warnings.push(format!(
            "the sandbox is {}: its output can be read only while it runs",
            rec.state.as_str()
        ));
        return Ok((String::new(), note));
    }
    let endpoint = app.sandboxes.endpoint_of(&rec);
    match crate::sandbox_files::output(&endpoint).await {
        Ok((bytes, dropped)) => {
            if dropped > 0 {
                note.truncated = true;
                note.warnings.push(format!(
                    "the oldest {dropped} bytes of output were dropped (the sandbox keeps the newest 1 MiB)"
                ));
            }
            Ok((String::from_utf8_lossy(&bytes).into_owned(), note))
        }
        Err(e) => {
            tracing::debug!(sandbox_id = %id, error = %e, "diagnostics: reading the output");
            note.warnings
                .push(format!("the sandbox's output could not be read: {e}"));
            Ok((String::new(), note))
        }
    }
}

/// The sandbox's record, as get shows it: warm pool and template-build sandboxes are not the
/// caller's to see.
fn visible(app: &AppState, id: &str) -> Result<warren_store::SandboxRecord, SandboxError> {
    app.sandboxes
        .get(id)
        .filter(|r| r.warm_pool.is_none())
        .ok_or_else(|| SandboxError::not_found(id))
}

fn events_of(app: &AppState, id: &str) -> Result<Events, SandboxError> {
    visible(app, id)?;
    app.sandboxes
        .events(id)
        .ok_or_else(|| SandboxError::not_found(id))
}

fn events_warnings(events: &Events) -> Vec<String> {
    let mut out = Vec::new();
    if events.recovered {
        out.push(
            "the server restarted since the sandbox was created: earlier events are not kept"
                .into(),
        );
    }
    if events.dropped > 0 {
        out.push(format!("the oldest {} events were dropped", events.dropped));
    }
    out
}

/// One line per state change, oldest first, the newest `limit`.
fn events_text(events: &Events, limit: usize) -> String {
    let skip = events.list.len().saturating_sub(limit);
    let mut out = String::new();
    for ev in events.list.iter().skip(skip) {
        out.push_str(&format!(
            "{}  {:<11} {}{}\n",
            rfc3339(ev.at),
            ev.state.as_str(),
            ev.reason.as_deref().unwrap_or("-"),
            ev.message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ));
    }
    out
}

fn inspect_text(app: &AppState, id: &str) -> Result<String, SandboxError> {
    let rec = visible(app, id)?;
    let mut value = serde_json::to_value(&rec).unwrap_or_default();
    if let Some(map) = value.as_object_mut() {
        // What the caller may know of its sandbox, and nothing else: not its endpoint secret, not
        // the host's view of it (pids, paths, link index) — a list of what to keep, so a field
        // added to the record later stays out until it is put here.
        const SHOWN: &[&str] = &[
            "id",
            "image",
            "snapshot_id",
            "pool_ref",
            "entrypoint",
            "env",
            "metadata",
            "extensions",
            "limits",
            "created_at",
            "expires_at",
            "state",
            "reason",
            "message",
            "last_transition_at",
            "network_policy",
            "credential_proxy",
        ];
        map.retain(|k, _| SHOWN.contains(&k.as_str()));
        // env values often are secrets
        if let Some(env) = map.get_mut("env").and_then(|e| e.as_object_mut()) {
            for v in env.values_mut() {
                *v = serde_json::Value::String("(set)".into());
            }
        }
    }
    Ok(serde_json::to_string_pretty(&value).unwrap_or_default() + "\n")
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    lines[lines.len().saturating_sub(n)..].concat()
}

fn content(id: &str, kind: &str, scope: &str, text: String, note: Note) -> DiagnosticContent {
    DiagnosticContent {
        sandbox_id: id.to_owned(),
        kind: kind.to_owned(),
        scope: scope.to_owned(),
        delivery: "inline".to_owned(),
        content_type: "text/plain; charset=utf-8".to_owned(),
        truncated: note.truncated,
        content_length: Some(text.len() as u64),
        content: Some(text),
        warnings: note.warnings,
    }
}

fn plain(text: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

/// The deprecated plain-text form, marked as the reference marks it.
fn deprecated(text: String) -> Response {
    let mut resp = plain(text);
    resp.headers_mut()
        .insert("deprecation", HeaderValue::from_static("true"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_lines_keeps_the_tail() {
        assert_eq!(last_lines("a\nb\nc\n", 2), "b\nc\n");
        assert_eq!(last_lines("a\nb\nc", 2), "b\nc");
        assert_eq!(last_lines("a\n", 5), "a\n");
        assert_eq!(last_lines("", 5), "");
    }

    #[test]
    fn unknown_scopes_are_named_with_the_supported_ones() {
        let err = check_scope("logs", "kernel", LOG_SCOPES).expect_err("unknown");
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(
            err.to_string().contains("container, lifecycle, all"),
            "{}",
            err.to_string()
        );
        assert!(check_scope("events", "runtime", EVENT_SCOPES).is_ok());
    }
}
