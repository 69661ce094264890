//! `/metrics`: the server's metrics in Prometheus's text format, from the `metrics` facade's
//! Prometheus recorder (names and labels: `crate::metrics`). What is counted as it happens is
//! recorded where it happens; what is a state (sandboxes by state, warm sandboxes per pool) is
//! read when scraped.

use std::sync::OnceLock;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use warren_api::lifecycle::SandboxState;

use crate::error::SandboxError;
use crate::http::AppState;

/// Seconds a create's phases are counted in: from a warm claim's milliseconds to a cold pull's
/// minute.
const CREATE_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// The process's recorder, installed once: the `metrics` facade has one global recorder, which
/// every server in the process (tests start several) shares.
pub fn install() -> Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full(crate::metrics::CREATE_SECONDS.to_string()),
                    &CREATE_BUCKETS,
                )
                .map_err(|e| tracing::warn!(error = %e, "metrics: histogram buckets"))
                .ok()?
                .build_recorder();
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => {
                    crate::metrics::describe();
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: another recorder is installed; /metrics is off");
                    None
                }
            }
        })
        .clone()
}

/// `[metrics] listen`'s own router: `/metrics` and nothing else, without a key.
pub fn router(app: AppState) -> axum::Router {
    axum::Router::new()
        .route("/metrics", axum::routing::get(scrape))
        .with_state(app)
}

/// `GET /metrics`.
pub async fn scrape(State(app): State<AppState>) -> Response {
    let Some(handle) = &app.metrics else {
        return SandboxError::new(
            crate::error::ErrorKind::NotFound,
            warren_api::ErrorCode::Unknown,
            "metrics are off ([metrics] enabled = false)",
        )
        .into_response();
    };
    let runtime = app.sandboxes.runtime().name();
    // One pass over the records, each locked once, whatever their number.
    let counts = app.sandboxes.count_by_state();
    for (state, n) in SandboxState::ALL.iter().zip(counts) {
        crate::metrics::sandboxes_now(state.as_str(), &runtime, n);
    }
    for (pool, warm) in app.pools.warm_counts() {
        crate::metrics::pool_warm(&pool, warm);
    }
    // Histograms are drained into their buckets here (no thread of the exporter's runs).
    handle.run_upkeep();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the server records shows in the exposition, with its help line and bounded labels;
    /// an end reason the server does not name is counted as `other`.
    #[test]
    fn recorded_metrics_are_rendered() {
        let handle = install().expect("the recorder");
        crate::metrics::create_answered(Ok(()));
        crate::metrics::create_answered(Err("SANDBOX::START_FAILED"));
        crate::metrics::create_phase("start", std::time::Duration::from_millis(30));
        crate::metrics::sandbox_ended("Terminated", Some("user_delete"));
        crate::metrics::sandbox_ended("Failed", Some("something a replica made up"));
        crate::metrics::pool_claim("p", false);
        handle.run_upkeep();
        let text = handle.render();
        for line in [
            "# HELP warren_sandbox_creates_total",
            "warren_sandbox_creates_total{result=\"ok\",code=\"\"}",
            "warren_sandbox_creates_total{result=\"failed\",code=\"SANDBOX::START_FAILED\"}",
            "warren_sandbox_create_seconds_bucket{phase=\"start\",le=\"0.05\"}",
            "warren_sandbox_ends_total{state=\"Terminated\",reason=\"user_delete\"}",
            "warren_sandbox_ends_total{state=\"Failed\",reason=\"other\"}",
            "warren_pool_claims_total{pool=\"p\",result=\"miss\"}",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        assert!(!text.contains("made up"), "{text}");
    }
}
