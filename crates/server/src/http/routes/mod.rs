//! Lifecycle handlers: translate wire types to registry calls and records back to wire types, with
//! the exact success codes the SDKs require. One file per resource (`sandboxes`, `snapshots`,
//! `pools`, `templates`); here, `/health`, `/v1/metrics/events`, the fallback, and what they share
//! (running an operation to its end, paging, a record's wire form, metadata filters).

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

use crate::time::rfc3339;
use warren_api::lifecycle::{Health, ImageSpec, MetricsEvent, Pagination, Sandbox, SandboxStatus};
use warren_api::ErrorCode;
use warren_store::SandboxRecord;

use crate::error::{ErrorKind, SandboxError};
use crate::http::error::ApiJson;
use crate::http::AppState;
use warren_core::RuntimeExt;

mod pools;
mod sandboxes;
mod snapshots;
mod templates;
mod timeline;

pub use pools::*;
pub use sandboxes::*;
pub use snapshots::*;
pub use templates::*;
pub use timeline::*;

const MAX_PAGE_SIZE: u32 = 1000;

/// States the reference system's clients may filter by that no Warren sandbox is ever shown in
/// (the reference's own internal `Allocated` shows as Running there too; `Unknown` is the SDK's
/// name for a state it does not know): a filter naming one matches nothing, as there.
const STATES_NEVER_SHOWN: [&str; 2] = ["Allocated", "Unknown"];

/// Runs a state-changing operation to its end even when the client goes away. hyper drops a
/// handler's future once its connection closes, and an operation cut off between two of its awaits
/// would stay half-done: a create dropped while it waits for a slot or for the runtime leaves a
/// `Pending` record that never expires (and, in the second case, a running sandbox nobody watches);
/// a delete, pause or resume leaves the record in a state the sandbox is not in. So the work runs as
/// a task of its own, and only waiting for its answer belongs to the request.
async fn to_completion<T: Send + 'static>(
    op: impl std::future::Future<Output = Result<T, SandboxError>> + Send + 'static,
) -> Result<T, SandboxError> {
    use tracing::Instrument;
    // In the request's span still: its logs and trace spans stay the request's.
    tokio::spawn(op.instrument(tracing::Span::current()))
        .await
        .map_err(|e| SandboxError::internal("the operation's task", &e))?
}

/// `page` (from 1) and `pageSize` (1 to [`MAX_PAGE_SIZE`]) of a list query.
struct Paging {
    page: u32,
    page_size: u32,
}

impl Default for Paging {
    fn default() -> Self {
        Paging {
            page: 1,
            page_size: 20,
        }
    }
}

impl Paging {
    fn set(&mut self, key: &str, value: &str) -> Result<(), SandboxError> {
        if key == "page" {
            self.page = value
                .parse()
                .ok()
                .filter(|p| *p >= 1)
                .ok_or_else(|| SandboxError::invalid("page must be an integer ≥ 1"))?;
        } else {
            self.page_size = value
                .parse()
                .ok()
                .filter(|p| (1..=MAX_PAGE_SIZE).contains(p))
                .ok_or_else(|| {
                    SandboxError::invalid(format!(
                        "pageSize must be an integer from 1 to {MAX_PAGE_SIZE}"
                    ))
                })?;
        }
        Ok(())
    }

    /// This page of `all`, and the pagination block describing it.
    fn apply<'a, T>(&self, all: &'a [T]) -> (&'a [T], Pagination) {
        let total = all.len() as u64;
        let total_pages = total.div_ceil(u64::from(self.page_size)) as u32;
        let start = ((self.page - 1) as usize)
            .saturating_mul(self.page_size as usize)
            .min(all.len());
        let end = start.saturating_add(self.page_size as usize).min(all.len());
        (
            &all[start..end],
            Pagination {
                page: self.page,
                page_size: self.page_size,
                total_items: total,
                total_pages,
                has_next_page: self.page < total_pages,
            },
        )
    }
}

pub fn to_wire(r: &SandboxRecord) -> Sandbox {
    Sandbox {
        id: r.id.clone(),
        status: SandboxStatus {
            state: r.state,
            reason: r.reason.clone(),
            message: r.message.clone(),
            last_transition_at: Some(rfc3339(r.last_transition_at)),
        },
        created_at: rfc3339(r.created_at),
        entrypoint: r.entrypoint.clone(),
        image: r.snapshot_id.is_none().then(|| ImageSpec {
            uri: r.image.clone(),
            auth: None,
        }),
        snapshot_id: r.snapshot_id.clone(),
        expires_at: r.expires_at.map(rfc3339),
        metadata: r.metadata.clone(),
        platform: None,
        extensions: r.extensions.clone(),
    }
}

#[utoipa::path(get, path = "/v1/health", tag = "health", responses((status = 200, body = Health)))]
pub async fn health(State(app): State<AppState>) -> Json<Health> {
    let runtime = app.sandboxes.runtime();
    Json(Health {
        status: "healthy".into(),
        runtime: Some(warren_api::lifecycle::RuntimeInfo {
            kind: app.config.runtime.kind.as_str().into(),
            name: runtime.name(),
            capabilities: runtime.capabilities(),
        }),
    })
}

#[utoipa::path(post, path = "/v1/metrics/events", tag = "metrics", request_body = MetricsEvent, responses((status = 204)))]
pub async fn metrics_event(ApiJson(ev): ApiJson<MetricsEvent>) -> StatusCode {
    tracing::info!(event = %ev.event_type, sandbox_id = ?ev.sandbox_id, create_ms = ?ev.create_duration_ms, success = ?ev.success, "client metrics event");
    StatusCode::NO_CONTENT
}

pub async fn not_found() -> SandboxError {
    SandboxError::new(ErrorKind::NotFound, ErrorCode::Unknown, "no such route")
}

/// The metadata filter is itself a query string (`k1=v1&k2=v2`), percent-encoded once more.
fn parse_metadata_filter(value: &str) -> Result<Vec<(String, String)>, SandboxError> {
    let bad = || {
        SandboxError::bad_request(
            ErrorCode::InvalidMetadataFormat,
            format!("metadata filter {value:?} must look like k1=v1&k2=v2"),
        )
    };
    let mut out = Vec::new();
    for pair in value.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').ok_or_else(bad)?;
        let k: String = form_urlencoded::parse(format!("k={k}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .ok_or_else(bad)?;
        let v: String = form_urlencoded::parse(format!("v={v}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .ok_or_else(bad)?;
        if k.is_empty() {
            return Err(bad());
        }
        out.push((k, v));
    }
    Ok(out)
}
