//! `lifecycle.idlePolicy` (OSEP-0024): a sandbox paused after a stretch with no activity, and woken
//! when it is accessed.
//!
//! Activity is what reaches the sandbox through Warren: every request the endpoint proxy relays
//! (commands, files, sessions, an app's port), counted from when it starts until its answer has
//! been sent whole — a command that streams for an hour keeps its sandbox busy for that hour. When
//! nothing has been under way for `idleTimeoutSeconds`, the sandbox's `activeProbe`, if it has one,
//! is asked (`GET {path}` on its `port` inside the sandbox; `200 {"active": true}` counts as
//! activity), and otherwise the sandbox is paused.
//!
//! A paused sandbox with `wakeOnAccess` (the default) is resumed by the proxy when a request comes
//! for it, which waits for the resume and is then relayed; past [`WAKE_WAIT`] it is answered 503
//! with `OpenSandbox-Wake: expired` and `Retry-After`, never relayed, so the clients replay it.
//! Without `wakeOnAccess` the answer stays that 503 until an explicit resume.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::SandboxError;

/// How long the proxy holds a request for a sandbox it wakes before it answers 503.
pub const WAKE_WAIT: Duration = Duration::from_secs(30);
/// The longest idle timeout (the reference's activity TTL).
pub const MAX_IDLE_SECONDS: u64 = 1800;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdlePolicy {
    /// `None`: wake-only (never paused for idleness, woken when paused by hand).
    pub idle_timeout_seconds: Option<u64>,
    pub wake_on_access: bool,
    pub probe: Option<Probe>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    pub port: u16,
    pub path: String,
    pub timeout_seconds: u64,
}

/// Reads `lifecycle.idlePolicy`, checking it as the clients do.
pub fn parse(v: &serde_json::Value) -> Result<Option<IdlePolicy>, SandboxError> {
    let bad = |m: String| SandboxError::invalid(format!("lifecycle.idlePolicy{m}"));
    let obj = match v {
        serde_json::Value::Null => return Ok(None),
        serde_json::Value::Object(o) => o,
        _ => return Err(bad(" must be an object".into())),
    };
    const FIELDS: [&str; 4] = [
        "idleTimeoutSeconds",
        "onIdle",
        "wakeOnAccess",
        "activeProbe",
    ];
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(bad(format!(
            ".{k} is not a field (known: {})",
            FIELDS.join(", ")
        )));
    }
    let timeout = match obj.get("idleTimeoutSeconds") {
        None | Some(serde_json::Value::Null) => None,
        Some(t) => Some(
            t.as_u64()
                .filter(|t| (30..=MAX_IDLE_SECONDS).contains(t))
                .ok_or_else(|| {
                    bad(format!(
                        ".idleTimeoutSeconds: a whole number of seconds from 30 to {MAX_IDLE_SECONDS} (the activity TTL)"
                    ))
                })?,
        ),
    };
    match (obj.get("onIdle").filter(|v| !v.is_null()), timeout) {
        (Some(serde_json::Value::String(s)), Some(_)) if s == "pause" => {}
        (None, None) => {}
        (Some(other), Some(_)) => {
            return Err(bad(format!(
                ".onIdle: {other} is not an action (only \"pause\")"
            )))
        }
        (None, Some(_)) => return Err(bad(".onIdle is required with idleTimeoutSeconds".into())),
        (Some(_), None) => return Err(bad(".onIdle is only valid with idleTimeoutSeconds".into())),
    }
    let wake_on_access = match obj.get("wakeOnAccess") {
        None | Some(serde_json::Value::Null) => true,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(_) => return Err(bad(".wakeOnAccess must be true or false".into())),
    };
    let probe = match obj.get("activeProbe").filter(|v| !v.is_null()) {
        None => None,
        Some(p) => Some(probe(p).map_err(|m| bad(format!(".activeProbe{m}")))?),
    };
    Ok(Some(IdlePolicy {
        idle_timeout_seconds: timeout,
        wake_on_access,
        probe,
    }))
}

fn probe(v: &serde_json::Value) -> Result<Probe, String> {
    let obj = v.as_object().ok_or(" must be an object")?;
    if let Some(k) = obj
        .keys()
        .find(|k| !["port", "path", "timeoutSeconds"].contains(&k.as_str()))
    {
        return Err(format!(
            ".{k} is not a field (known: port, path, timeoutSeconds)"
        ));
    }
    let port = obj
        .get("port")
        .and_then(serde_json::Value::as_u64)
        .filter(|p| (1..=65_535).contains(p))
        .ok_or(".port: 1 to 65535")? as u16;
    let path = obj
        .get("path")
        .and_then(serde_json::Value::as_str)
        .filter(|p| {
            p.starts_with('/')
                && p.len() <= 512
                && !p.chars().any(|c| c.is_whitespace() || c.is_control())
        })
        .ok_or(".path: an absolute path, 1 to 512 characters, no whitespace or control characters")?
        .to_string();
    let timeout_seconds = match obj.get("timeoutSeconds") {
        None | Some(serde_json::Value::Null) => 2,
        Some(t) => t
            .as_u64()
            .filter(|t| (1..=10).contains(t))
            .ok_or(".timeoutSeconds: 1 to 10")?,
    };
    Ok(Probe {
        port,
        path,
        timeout_seconds,
    })
}

#[derive(Debug)]
struct Act {
    last: Instant,
    under_way: u32,
}

/// What is under way for each sandbox, and when the last of it ended.
#[derive(Default)]
pub struct Activity {
    by_sandbox: Mutex<HashMap<String, Act>>,
}

impl Activity {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Act>> {
        self.by_sandbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Something starts for `id`: it stays busy until the guard goes.
    pub fn begin(self: &std::sync::Arc<Self>, id: &str) -> Busy {
        let mut all = self.lock();
        let act = all.entry(id.to_string()).or_insert(Act {
            last: Instant::now(),
            under_way: 0,
        });
        act.under_way += 1;
        act.last = Instant::now();
        Busy {
            activity: self.clone(),
            id: id.to_string(),
        }
    }

    /// Activity for `id` now (a probe that said so, a resume).
    pub fn touch(&self, id: &str) {
        let mut all = self.lock();
        let act = all.entry(id.to_string()).or_insert(Act {
            last: Instant::now(),
            under_way: 0,
        });
        act.last = Instant::now();
    }

    /// How long nothing has been under way for `id`; `None` while something is. A sandbox never
    /// seen counts from `since` (its start, or the server's).
    pub fn idle_for(&self, id: &str, since: Instant) -> Option<Duration> {
        let mut all = self.lock();
        let act = all.entry(id.to_string()).or_insert(Act {
            last: since,
            under_way: 0,
        });
        (act.under_way == 0).then(|| act.last.elapsed())
    }

    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }
}

/// Keeps a sandbox busy while it lives (see [`Activity::begin`]).
pub struct Busy {
    activity: std::sync::Arc<Activity>,
    id: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut all = self.activity.lock();
        if let Some(act) = all.get_mut(&self.id) {
            act.under_way = act.under_way.saturating_sub(1);
            act.last = Instant::now();
        }
    }
}

/// Whether the probe says the sandbox is busy: `200` with `{"active": true}`.
pub fn probe_says_active(status: u16, body: &[u8]) -> bool {
    status == 200
        && serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("active").and_then(serde_json::Value::as_bool))
            == Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn policies_are_checked_as_the_clients_check_them() {
        let p = parse(&json!({"idleTimeoutSeconds": 60, "onIdle": "pause",
                              "activeProbe": {"port": 8080, "path": "/busy"}}))
        .expect("valid")
        .expect("some");
        assert_eq!(p.idle_timeout_seconds, Some(60));
        assert!(p.wake_on_access, "the default");
        assert_eq!(p.probe.expect("probe").timeout_seconds, 2);
        let wake_only = parse(&json!({"wakeOnAccess": true}))
            .expect("valid")
            .expect("some");
        assert_eq!(wake_only.idle_timeout_seconds, None);
        for bad in [
            json!({"idleTimeoutSeconds": 29, "onIdle": "pause"}),
            json!({"idleTimeoutSeconds": 1801, "onIdle": "pause"}),
            json!({"idleTimeoutSeconds": 60}),
            json!({"onIdle": "pause"}),
            json!({"idleTimeoutSeconds": 60, "onIdle": "stop"}),
            json!({"wakeOnAccess": "yes"}),
            json!({"idleTimeoutSeconds": 60, "onIdle": "pause", "activeProbe": {"port": 0, "path": "/"}}),
            json!({"idleTimeoutSeconds": 60, "onIdle": "pause", "activeProbe": {"port": 80, "path": "busy"}}),
            json!({"idleTimeoutSeconds": 60, "onIdle": "pause", "activeProbe": {"port": 80, "path": "/a b"}}),
            json!({"idleTimeoutSeconds": 60, "onIdle": "pause", "activeProbe": {"port": 80, "path": "/", "timeoutSeconds": 11}}),
            json!({"idle": 1}),
        ] {
            assert!(parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_sandbox_is_idle_only_with_nothing_under_way() {
        let a = std::sync::Arc::new(Activity::default());
        let long_ago = Instant::now() - Duration::from_secs(100);
        assert!(a.idle_for("s", long_ago).expect("idle") >= Duration::from_secs(99));
        let busy = a.begin("s");
        assert!(a.idle_for("s", long_ago).is_none(), "a request under way");
        drop(busy);
        assert!(
            a.idle_for("s", long_ago).expect("idle") < Duration::from_secs(1),
            "counted from its end"
        );
        assert!(probe_says_active(200, br#"{"active": true}"#));
        assert!(!probe_says_active(200, br#"{"active": false}"#));
        assert!(!probe_says_active(500, br#"{"active": true}"#));
        assert!(!probe_says_active(200, b"yes"));
    }
}
