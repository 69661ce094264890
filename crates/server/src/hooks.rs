//! Lifecycle hooks (`lifecycle.preStart`, `lifecycle.periodic`), upstream's shape, on every
//! runtime: the server runs them through the sandbox's execd, as commands of the sandbox's own.
//!
//! - `preStart {command[], timeoutSeconds}` runs once execd answers and before the sandbox is
//!   reported Running; a failure (an exit code other than 0, its timeout, or no answer) ends the
//!   sandbox Failed, with the exit code and the tail of its output in the status and diagnostics.
//! - `periodic [{name, schedule, command[], timeoutSeconds}]` runs on a five-field cron schedule
//!   or a descriptor (`@hourly`, `@every 30s`) while the sandbox runs (not while it is paused),
//!   one run of a hook at a time; the last runs of each show in `diagnostics/logs?scope=lifecycle`.
//!
//! A hook never outlives its timeout: execd kills the command's process group then. Commands are
//! argument lists, run as they are (no shell), as the field says.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::SandboxError;

/// The longest a `preStart` may run.
pub const MAX_PRE_START_SECONDS: u64 = 3600;
/// The longest a periodic hook may run (as the protocol says).
pub const MAX_PERIODIC_SECONDS: u64 = 300;
/// When a hook says nothing.
pub const DEFAULT_SECONDS: u64 = 60;
/// Periodic hooks per sandbox.
pub const MAX_PERIODIC: usize = 16;
/// Runs kept per hook for diagnostics.
const KEPT_RUNS: usize = 10;
/// Output kept per run: its end.
const OUTPUT_TAIL: usize = 2048;

/// A command and how long it may run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hook {
    pub command: Vec<String>,
    pub timeout_seconds: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Periodic {
    pub name: String,
    /// As written; parsed again when the sandbox's schedule is armed (see [`Schedule`]).
    pub schedule: String,
    pub hook: Hook,
}

/// A sandbox's hooks, and its idle policy (`crate::idle`), as kept in its record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hooks {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre_start: Option<Hook>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub periodic: Vec<Periodic>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<crate::idle::IdlePolicy>,
}

impl Hooks {
    pub fn is_empty(&self) -> bool {
        self.pre_start.is_none() && self.periodic.is_empty() && self.idle.is_none()
    }
}

/// When a periodic hook runs.
#[derive(Debug, Clone)]
pub enum Schedule {
    Every(Duration),
    Cron(Box<croner::Cron>),
}

impl Schedule {
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if let Some(every) = t.strip_prefix("@every") {
            let every = every.trim();
            let seconds = every
                .strip_suffix('s')
                .and_then(|n| n.parse::<u64>().ok())
                .filter(|n| *n >= 1)
                .ok_or_else(|| {
                    format!("{text:?}: an @every interval is a whole number of seconds, at least 1 (`@every 30s`)")
                })?;
            return Ok(Self::Every(Duration::from_secs(seconds)));
        }
        let fields = t.split_whitespace().count();
        if !t.starts_with('@') && fields != 5 {
            return Err(format!(
                "{text:?}: a schedule is five cron fields (minute hour day month weekday) or a descriptor (@hourly, @daily, @every 30s)"
            ));
        }
        croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Disallowed)
            .year(croner::parser::Year::Disallowed)
            .build()
            .parse(t)
            .map(|c| Self::Cron(Box::new(c)))
            .map_err(|e| format!("{text:?}: {e}"))
    }

    /// The next run strictly after `after`.
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Self::Every(d) => Some(after + chrono::Duration::from_std(*d).ok()?),
            Self::Cron(c) => c.find_next_occurrence(&after, false).ok(),
        }
    }
}

/// Reads `preStart` and `periodic` from a create's `lifecycle`, checking every field.
pub fn parse(
    pre_start: Option<&serde_json::Value>,
    periodic: Option<&serde_json::Value>,
) -> Result<Hooks, SandboxError> {
    let mut hooks = Hooks::default();
    if let Some(v) = pre_start.filter(|v| !v.is_null()) {
        hooks.pre_start = Some(hook(
            "lifecycle.preStart",
            v,
            &["command", "timeoutSeconds"],
            MAX_PRE_START_SECONDS,
        )?);
    }
    if let Some(v) = periodic.filter(|v| !v.is_null()) {
        let list = v
            .as_array()
            .ok_or_else(|| SandboxError::invalid("lifecycle.periodic must be a list of hooks"))?;
        if list.len() > MAX_PERIODIC {
            return Err(SandboxError::invalid(format!(
                "lifecycle.periodic: {} hooks, at most {MAX_PERIODIC}",
                list.len()
            )));
        }
        for (i, item) in list.iter().enumerate() {
            let at = format!("lifecycle.periodic[{i}]");
            let h = hook(
                &at,
                item,
                &["name", "schedule", "command", "timeoutSeconds"],
                MAX_PERIODIC_SECONDS,
            )?;
            let text = |field: &str| {
                item.get(field)
                    .and_then(serde_json::Value::as_str)
                    .map(str::trim)
                    .filter(|s| !s.is_empty() && s.len() <= 128)
                    .map(str::to_string)
                    .ok_or_else(|| {
                        SandboxError::invalid(format!("{at}.{field}: 1 to 128 characters"))
                    })
            };
            let name = text("name")?;
            let schedule = text("schedule")?;
            Schedule::parse(&schedule)
                .map_err(|e| SandboxError::invalid(format!("{at}.schedule: {e}")))?;
            if hooks.periodic.iter().any(|p| p.name == name) {
                return Err(SandboxError::invalid(format!(
                    "{at}.name: {name:?} names another periodic hook"
                )));
            }
            hooks.periodic.push(Periodic {
                name,
                schedule,
                hook: h,
            });
        }
    }
    Ok(hooks)
}

fn hook(at: &str, v: &serde_json::Value, fields: &[&str], max: u64) -> Result<Hook, SandboxError> {
    let obj = v
        .as_object()
        .ok_or_else(|| SandboxError::invalid(format!("{at} must be an object")))?;
    if let Some(k) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(SandboxError::invalid(format!(
            "{at}.{k} is not a field of a hook (known: {})",
            fields.join(", ")
        )));
    }
    let command: Vec<String> = obj
        .get("command")
        .and_then(|c| serde_json::from_value::<Vec<String>>(c.clone()).ok())
        .filter(|c| c.first().is_some_and(|p| !p.trim().is_empty()))
        .ok_or_else(|| {
            SandboxError::invalid(format!(
                "{at}.command: a list of strings, the program first (not empty)"
            ))
        })?;
    if command.iter().map(String::len).sum::<usize>() > 64 * 1024 {
        return Err(SandboxError::invalid(format!(
            "{at}.command: at most 64 KiB"
        )));
    }
    let timeout_seconds = match obj.get("timeoutSeconds") {
        None | Some(serde_json::Value::Null) => DEFAULT_SECONDS,
        Some(t) => t
            .as_u64()
            .filter(|t| (1..=max).contains(t))
            .ok_or_else(|| {
                SandboxError::invalid(format!(
                    "{at}.timeoutSeconds: a whole number of seconds from 1 to {max}"
                ))
            })?,
    };
    Ok(Hook {
        command,
        timeout_seconds,
    })
}

/// One run of a hook, for diagnostics.
#[derive(Debug, Clone)]
pub struct Run {
    pub hook: String,
    pub started: DateTime<Utc>,
    pub seconds: f64,
    /// `None`: it did not end with an exit code (its timeout, a signal, no answer).
    pub exit_code: Option<i32>,
    pub error: Option<String>,
    pub output_tail: String,
}

impl Run {
    pub fn succeeded(&self) -> bool {
        self.exit_code == Some(0)
    }

    /// One line for a status message or the diagnostics text.
    pub fn summary(&self) -> String {
        let end = match (self.exit_code, &self.error) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(e)) => e.clone(),
            (None, None) => "no exit code".into(),
        };
        let mut s = format!(
            "{} {} ran {:.2} s: {end}",
            crate::time::rfc3339(self.started),
            self.hook,
            self.seconds
        );
        if !self.output_tail.is_empty() {
            s.push_str(&format!("; output ends: {}", self.output_tail.trim_end()));
        }
        s
    }
}

/// Runs `hook` in the sandbox whose execd `endpoint` is; `label` names it in the record.
pub async fn run(endpoint: &crate::execd_conns::ExecdEndpoint, label: &str, hook: &Hook) -> Run {
    let started = Utc::now();
    let clock = std::time::Instant::now();
    let limit = Duration::from_secs(hook.timeout_seconds);
    // execd kills the command at its timeout; the wait here has room for that to be reported.
    let result = tokio::time::timeout(
        limit + Duration::from_secs(10),
        crate::sandbox_files::run_argv(endpoint, &hook.command, limit),
    )
    .await;
    let (exit_code, error, output) = match result {
        Ok(Ok(done)) => (done.exit_code, done.error, done.output),
        Ok(Err(e)) => (None, Some(format!("not run: {e}")), String::new()),
        Err(_) => (
            None,
            Some(format!(
                "no answer within its timeout ({} s)",
                hook.timeout_seconds
            )),
            String::new(),
        ),
    };
    Run {
        hook: label.to_string(),
        started,
        seconds: clock.elapsed().as_secs_f64(),
        exit_code,
        error,
        output_tail: tail(&output),
    }
}

fn tail(text: &str) -> String {
    if text.len() <= OUTPUT_TAIL {
        return text.to_string();
    }
    let mut start = text.len() - OUTPUT_TAIL;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

/// The last runs of every sandbox's hooks (memory only: after a restart, runs from then on).
#[derive(Default)]
pub struct Runs {
    by_sandbox: Mutex<BTreeMap<String, VecDeque<Run>>>,
}

impl Runs {
    pub fn record(&self, sandbox: &str, run: Run) {
        let mut all = self.by_sandbox.lock().unwrap_or_else(|e| e.into_inner());
        let runs = all.entry(sandbox.to_string()).or_default();
        // KEPT_RUNS per hook name: the oldest run of this hook goes first.
        if runs.iter().filter(|r| r.hook == run.hook).count() >= KEPT_RUNS {
            if let Some(i) = runs.iter().position(|r| r.hook == run.hook) {
                runs.remove(i);
            }
        }
        runs.push_back(run);
    }

    /// The runs of `sandbox`'s hooks, oldest first, one line each.
    pub fn text(&self, sandbox: &str) -> String {
        let all = self.by_sandbox.lock().unwrap_or_else(|e| e.into_inner());
        all.get(sandbox)
            .map(|runs| runs.iter().map(|r| r.summary() + "\n").collect())
            .unwrap_or_default()
    }

    pub fn forget(&self, sandbox: &str) {
        self.by_sandbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(sandbox);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schedules() {
        assert!(
            matches!(Schedule::parse("@every 30s"), Ok(Schedule::Every(d)) if d == Duration::from_secs(30))
        );
        for good in [
            "*/5 * * * *",
            "0 3 * * MON",
            "@hourly",
            "@daily",
            " 15 * * * * ",
        ] {
            assert!(Schedule::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "@every 0s",
            "@every 1.5s",
            "@every 1m",
            "* * * *",
            "0 * * * * *",
            "61 * * * *",
            "@sometimes",
            "",
        ] {
            assert!(Schedule::parse(bad).is_err(), "{bad}");
        }
        let at = DateTime::parse_from_rfc3339("2026-12-07T10:07:30Z")
            .expect("time")
            .with_timezone(&Utc);
        let next = Schedule::parse("*/5 * * * *")
            .expect("cron")
            .next_after(at)
            .expect("next");
        assert_eq!(next.to_rfc3339(), "2026-12-07T10:10:00+00:00");
        let hourly = Schedule::parse("@hourly")
            .expect("cron")
            .next_after(at)
            .expect("next");
        assert_eq!(hourly.to_rfc3339(), "2026-12-07T11:00:00+00:00");
    }

    #[test]
    fn hooks_are_read_whole_or_refused() {
        let h = parse(
            Some(&json!({"command": ["sh", "-c", "true"], "timeoutSeconds": 5})),
            Some(&json!([{"name": "tick", "schedule": "@every 2s", "command": ["date"]}])),
        )
        .expect("hooks");
        assert_eq!(h.pre_start.expect("pre").timeout_seconds, 5);
        assert_eq!(h.periodic[0].hook.timeout_seconds, DEFAULT_SECONDS);
        for (pre, periodic) in [
            (json!({"command": []}), json!(null)),
            (json!({"command": [" "]}), json!(null)),
            (json!({"command": "true"}), json!(null)),
            (
                json!({"command": ["true"], "timeoutSeconds": 0}),
                json!(null),
            ),
            (
                json!({"command": ["true"], "timeoutSeconds": 3601}),
                json!(null),
            ),
            (json!({"command": ["true"], "shell": true}), json!(null)),
            (
                json!(null),
                json!([{"name": "a", "schedule": "@every 1s", "command": ["x"], "timeoutSeconds": 301}]),
            ),
            (
                json!(null),
                json!([{"name": "a", "schedule": "never", "command": ["x"]}]),
            ),
            (
                json!(null),
                json!([{"schedule": "@hourly", "command": ["x"]}]),
            ),
            (
                json!(null),
                json!([{"name": "a", "schedule": "@hourly", "command": ["x"]},
                                 {"name": "a", "schedule": "@daily", "command": ["y"]}]),
            ),
            (json!(null), json!({"name": "a"})),
        ] {
            assert!(
                parse(Some(&pre), Some(&periodic)).is_err(),
                "{pre} {periodic}"
            );
        }
    }

    #[test]
    fn runs_keep_the_last_of_each_hook() {
        let runs = Runs::default();
        let run = |hook: &str, code| Run {
            hook: hook.into(),
            started: Utc::now(),
            seconds: 0.1,
            exit_code: Some(code),
            error: None,
            output_tail: String::new(),
        };
        for i in 0..15 {
            runs.record("s", run("tick", i));
        }
        runs.record("s", run("preStart", 0));
        let text = runs.text("s");
        assert_eq!(text.lines().count(), KEPT_RUNS + 1);
        assert!(
            text.contains("exit code 14") && !text.contains("exit code 4\n"),
            "{text}"
        );
        assert_eq!(tail(&"é".repeat(3000)).chars().count(), 1 + OUTPUT_TAIL / 2);
    }
}
