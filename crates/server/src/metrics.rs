//! The server's metrics: every name, its labels and its meaning, in one place, recorded through the
//! `metrics` facade (a no-op until a recorder is installed: `http::metrics` installs the Prometheus
//! one). Labels are bounded: a state, a runtime, a phase, an outcome, a wire error code, a reason
//! the server itself names, a pool (as many as there are pools). No sandbox id is a label.

use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

/// Sandboxes the server knows, by `state` and `runtime` (set when scraped).
pub const SANDBOXES: &str = "warren_sandboxes";
/// Sandboxes made, by a create or a pool's refill (a create a pool serves makes none), by `result`
/// (`ok`, `failed`) and, for a failure, its wire `code`.
pub const CREATES: &str = "warren_sandbox_creates_total";
/// Seconds of a create, by `phase`: `admission` (checks, limits, the record), `image` (resolved
/// from the store, pulled when missing), `queue` (waiting for a create slot), `start` (the
/// runtime's create: root filesystem, execd answering, the network link), `total`.
pub const CREATE_SECONDS: &str = "warren_sandbox_create_seconds";
/// Sandboxes that ended, by `state` (`Terminated`, `Failed`) and `reason`.
pub const ENDS: &str = "warren_sandbox_ends_total";
/// Warm sandboxes a pool holds now, by `pool` (set when scraped).
pub const POOL_WARM: &str = "warren_pool_warm";
/// Creates a pool was asked to serve, by `pool` and `result`: `hit` (a warm sandbox was handed
/// over), `miss` (none came within the wait).
pub const POOL_CLAIMS: &str = "warren_pool_claims_total";
/// Requests the endpoint proxy relayed into sandboxes, by how the port was opened (`via`:
/// `token`, `key`, `signed-url`, `endpoint-token`).
pub const PROXY_REQUESTS: &str = "warren_proxy_requests_total";
/// Bytes of the answers the endpoint proxy relayed out of sandboxes.
pub const PROXY_RESPONSE_BYTES: &str = "warren_proxy_response_bytes_total";
/// Images pulled from registries on demand, by `result` (`ok`, `failed`).
pub const IMAGE_PULLS: &str = "warren_image_pulls_total";

/// The reasons a sandbox ends with that the server names itself; any other is counted as `other`,
/// so that the label stays bounded whatever a record carries.
const KNOWN_REASONS: [&str; 7] = [
    crate::sandboxes::REASON_USER_DELETE,
    crate::sandboxes::REASON_TTL_EXPIRY,
    crate::sandboxes::REASON_PRE_START_FAILED,
    crate::sandboxes::REASON_DELETE_FAILED,
    "process_exited",
    "internal_error",
    "lost",
];

/// Says what each metric is, for the exposition's `# HELP` lines.
pub fn describe() {
    describe_gauge!(
        SANDBOXES,
        "Sandboxes the server knows, by state and runtime."
    );
    describe_counter!(
        CREATES,
        "Sandboxes made (by creates and pools' refills), by result (ok, failed) and wire code."
    );
    describe_histogram!(
        CREATE_SECONDS,
        metrics::Unit::Seconds,
        "Seconds of a create, by phase (admission, image, queue, start, total)."
    );
    describe_counter!(ENDS, "Sandboxes that ended, by state and reason.");
    describe_gauge!(POOL_WARM, "Warm sandboxes a pool holds, by pool.");
    describe_counter!(
        POOL_CLAIMS,
        "Creates a pool was asked to serve, by pool and result (hit, miss)."
    );
    describe_counter!(
        PROXY_REQUESTS,
        "Requests the endpoint proxy relayed into sandboxes, by how the port was opened."
    );
    describe_counter!(
        PROXY_RESPONSE_BYTES,
        metrics::Unit::Bytes,
        "Bytes of the answers the endpoint proxy relayed out of sandboxes."
    );
    describe_counter!(
        IMAGE_PULLS,
        "Images pulled from registries on demand, by result (ok, failed)."
    );
    warren_egress::metrics::describe();
}

/// A create was answered: `Ok` or the wire code of its failure.
pub fn create_answered(result: Result<(), &str>) {
    match result {
        Ok(()) => counter!(CREATES, "result" => "ok", "code" => "").increment(1),
        Err(code) => {
            counter!(CREATES, "result" => "failed", "code" => code.to_string()).increment(1)
        }
    }
}

/// One phase of a create took `took`.
pub fn create_phase(phase: &'static str, took: Duration) {
    histogram!(CREATE_SECONDS, "phase" => phase).record(took.as_secs_f64());
}

/// A sandbox ended in `state` for `reason`.
pub fn sandbox_ended(state: &'static str, reason: Option<&str>) {
    let reason = reason
        .and_then(|r| KNOWN_REASONS.iter().find(|k| **k == r).copied())
        .unwrap_or(if reason.is_some() { "other" } else { "" });
    counter!(ENDS, "state" => state, "reason" => reason).increment(1);
}

/// Sets the number of sandboxes in `state` on `runtime`.
pub fn sandboxes_now(state: &'static str, runtime: &str, count: usize) {
    gauge!(SANDBOXES, "state" => state, "runtime" => runtime.to_string()).set(count as f64);
}

/// Sets the warm sandboxes `pool` holds.
pub fn pool_warm(pool: &str, warm: u32) {
    gauge!(POOL_WARM, "pool" => pool.to_string()).set(f64::from(warm));
}

/// A create asked `pool` for a warm sandbox and got one, or not.
pub fn pool_claim(pool: &str, hit: bool) {
    let result = if hit { "hit" } else { "miss" };
    counter!(POOL_CLAIMS, "pool" => pool.to_string(), "result" => result).increment(1);
}

/// The proxy relayed a request opened `via` (a token, a key, a signed URL…).
pub fn proxy_request(via: &'static str) {
    counter!(PROXY_REQUESTS, "via" => via).increment(1);
}

/// The counter of the bytes the proxy relays out: looked up once per answer, not per frame.
pub fn proxy_response_bytes() -> metrics::Counter {
    counter!(PROXY_RESPONSE_BYTES)
}

/// An on-demand pull ended.
pub fn image_pull(ok: bool) {
    let result = if ok { "ok" } else { "failed" };
    counter!(IMAGE_PULLS, "result" => result).increment(1);
}
