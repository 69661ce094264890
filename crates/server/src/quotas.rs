//! Tenants' quotas (`[quotas.default]` for every tenant but the default one, `[quotas.tenants.NAME]`
//! for one): sandboxes not yet ended, their CPU and memory in total, creates per minute, and the
//! storage its snapshots take. A create over one is refused before anything is made: 403 `QUOTA_EXCEEDED` naming the quota (what
//! waiting alone would not cure), 429 with `Retry-After` for the rate.
//!
//! What a tenant uses is read from the sandboxes' records (warm sandboxes of its pools count: they
//! are its), plus the creates it has in flight, which hold their share from admission until their
//! record exists (a create is counted twice for that moment: conservatively, so concurrent creates
//! cannot all slip under a quota).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use warren_api::admin::{QuotaInfo, Usage};
use warren_api::ErrorCode;
use warren_core::ResourceLimits;
use warren_store::{SandboxRecord, DEFAULT_TENANT};

use crate::error::{ErrorKind, SandboxError};

pub use crate::config::{QuotaSection, QuotaSpec};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub sandboxes: Option<u64>,
    pub cpu_millis: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub creates_per_minute: Option<u64>,
    pub snapshot_bytes: Option<u64>,
}

impl QuotaSpec {
    fn parse(&self, what: &str) -> anyhow::Result<Quota> {
        use anyhow::Context;
        Ok(Quota {
            sandboxes: self.sandboxes,
            cpu_millis: self
                .cpu
                .as_deref()
                .map(warren_core::quantity::parse_cpu_millis)
                .transpose()
                .with_context(|| format!("{what} cpu"))?,
            memory_bytes: self
                .memory
                .as_deref()
                .map(warren_core::quantity::parse_memory_bytes)
                .transpose()
                .with_context(|| format!("{what} memory"))?,
            creates_per_minute: self.creates_per_minute,
            // "0": no snapshots at all.
            snapshot_bytes: self
                .snapshot_storage
                .as_deref()
                .map(|v| match v.trim() {
                    "0" => Ok(0),
                    v => warren_core::quantity::parse_size_bytes("snapshot_storage", v),
                })
                .transpose()
                .with_context(|| format!("{what} snapshot_storage"))?,
        })
    }
}

impl QuotaSection {
    pub fn check(&self) -> anyhow::Result<()> {
        Quotas::new(self).map(|_| ())
    }
}

/// What a tenant holds in creates not yet done.
#[derive(Default)]
struct InFlight {
    sandboxes: u64,
    cpu_millis: u64,
    memory_bytes: u64,
}

#[derive(Default)]
struct TenantState {
    in_flight: InFlight,
    /// When its recent creates were admitted (the last minute's).
    recent: VecDeque<Instant>,
}

pub struct Quotas {
    default: Quota,
    tenants: HashMap<String, Quota>,
    state: Mutex<HashMap<String, TenantState>>,
}

const WINDOW: Duration = Duration::from_secs(60);

/// A create's admission: its share stays counted until this is dropped (its record exists by then,
/// or it failed).
pub struct Admission {
    quotas: std::sync::Arc<Quotas>,
    tenant: String,
    sandboxes: u64,
    cpu_millis: u64,
    memory_bytes: u64,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut state = self.quotas.lock();
        if let Some(t) = state.get_mut(&self.tenant) {
            t.in_flight.sandboxes = t.in_flight.sandboxes.saturating_sub(self.sandboxes);
            t.in_flight.cpu_millis = t.in_flight.cpu_millis.saturating_sub(self.cpu_millis);
            t.in_flight.memory_bytes = t.in_flight.memory_bytes.saturating_sub(self.memory_bytes);
        }
    }
}

fn over(quota: &str, message: String) -> SandboxError {
    SandboxError::new(
        ErrorKind::Forbidden,
        ErrorCode::QuotaExceeded,
        format!("quota {quota}: {message}"),
    )
}

impl Quotas {
    pub fn new(section: &QuotaSection) -> anyhow::Result<Self> {
        let mut tenants = HashMap::new();
        for (name, spec) in &section.tenants {
            crate::keys::check_tenant(name).map_err(anyhow::Error::msg)?;
            tenants.insert(
                name.clone(),
                spec.parse(&format!("[quotas.tenants.{name}]"))?,
            );
        }
        Ok(Self {
            default: section.default.parse("[quotas.default]")?,
            tenants,
            state: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, TenantState>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn quota(&self, tenant: &str) -> Quota {
        match self.tenants.get(tenant) {
            Some(q) => *q,
            None if tenant == DEFAULT_TENANT => Quota::default(),
            None => self.default,
        }
    }

    /// Admits a create of `limits` for `tenant`, whose live sandboxes are `live`, or says which
    /// quota it would pass. `new_sandbox`: it makes one (a claim from a warm pool does not);
    /// `rated`: it counts against the rate (once per request).
    pub fn admit(
        self: &std::sync::Arc<Self>,
        tenant: &str,
        limits: &ResourceLimits,
        live: &[SandboxRecord],
        new_sandbox: bool,
        rated: bool,
    ) -> Result<Admission, SandboxError> {
        let mut quota = self.quota(tenant);
        if !new_sandbox {
            (quota.sandboxes, quota.cpu_millis, quota.memory_bytes) = (None, None, None);
        }
        if !rated {
            quota.creates_per_minute = None;
        }
        let cpu = if new_sandbox {
            limits.cpu_millis.unwrap_or(0)
        } else {
            0
        };
        let mem = if new_sandbox {
            limits.memory_bytes.unwrap_or(0)
        } else {
            0
        };
        let mut state = self.lock();
        let t = state.entry(tenant.to_string()).or_default();
        let now = Instant::now();
        while t.recent.front().is_some_and(|at| now - *at >= WINDOW) {
            t.recent.pop_front();
        }
        let used = usage_of(live);
        if let Some(max) = quota.sandboxes {
            let have = used.0 + t.in_flight.sandboxes;
            if have + 1 > max {
                return Err(over(
                    "sandboxes",
                    format!("tenant {tenant} has {have} sandboxes (warm pool ones too) of {max}; delete some first"),
                ));
            }
        }
        if let Some(max) = quota.cpu_millis {
            if limits.cpu_millis.is_none() {
                return Err(over(
                    "cpu",
                    format!("tenant {tenant} has a CPU quota: a create must name its cpu"),
                ));
            }
            let have = used.1 + t.in_flight.cpu_millis;
            if have + cpu > max {
                return Err(over(
                    "cpu",
                    format!("tenant {tenant}'s sandboxes hold {have}m of {max}m CPU; this one asks {cpu}m"),
                ));
            }
        }
        if let Some(max) = quota.memory_bytes {
            if limits.memory_bytes.is_none() {
                return Err(over(
                    "memory",
                    format!("tenant {tenant} has a memory quota: a create must name its memory"),
                ));
            }
            let have = used.2 + t.in_flight.memory_bytes;
            if have + mem > max {
                return Err(over(
                    "memory",
                    format!("tenant {tenant}'s sandboxes hold {have} of {max} bytes of memory; this one asks {mem}"),
                ));
            }
        }
        if let Some(max) = quota.creates_per_minute {
            if t.recent.len() as u64 >= max {
                let wait = t
                    .recent
                    .front()
                    .map_or(WINDOW, |oldest| WINDOW.saturating_sub(now - *oldest));
                let mut e = SandboxError::new(
                    ErrorKind::Busy,
                    ErrorCode::QuotaExceeded,
                    format!("quota creates_per_minute: tenant {tenant} made {max} creates in the last minute"),
                );
                e.retry_after = Some(wait.as_secs_f64().ceil() as u64);
                return Err(e);
            }
        }
        if rated {
            t.recent.push_back(now);
        }
        let counted = u64::from(new_sandbox);
        t.in_flight.sandboxes += counted;
        t.in_flight.cpu_millis += cpu;
        t.in_flight.memory_bytes += mem;
        Ok(Admission {
            quotas: self.clone(),
            tenant: tenant.to_string(),
            sandboxes: counted,
            cpu_millis: cpu,
            memory_bytes: mem,
        })
    }

    /// Whether `tenant`, whose snapshots take `used` bytes, may have one more of `adds` bytes
    /// (`None`: before its capture, when only a quota already reached refuses it).
    pub fn admit_snapshot(
        &self,
        tenant: &str,
        used: u64,
        adds: Option<u64>,
    ) -> Result<(), SandboxError> {
        let Some(max) = self.quota(tenant).snapshot_bytes else {
            return Ok(());
        };
        match adds {
            None if used >= max => Err(over(
                "snapshot_storage",
                format!("tenant {tenant}'s snapshots take {used} of {max} bytes; delete some first"),
            )),
            Some(adds) if used + adds > max => Err(over(
                "snapshot_storage",
                format!("tenant {tenant}'s snapshots take {used} of {max} bytes; this one would add {adds}"),
            )),
            _ => Ok(()),
        }
    }

    /// What `tenant` uses (its live sandboxes: `live`; its snapshots: `snapshot_bytes`) and may use.
    pub fn usage(&self, tenant: &str, live: &[SandboxRecord], snapshot_bytes: u64) -> Usage {
        let (sandboxes, cpu, mem) = usage_of(live);
        let now = Instant::now();
        let recent = self.lock().get(tenant).map_or(0, |t| {
            t.recent.iter().filter(|at| now - **at < WINDOW).count()
        });
        let q = self.quota(tenant);
        Usage {
            tenant: tenant.to_string(),
            sandboxes,
            cpu_millis: cpu,
            memory_bytes: mem,
            creates_last_minute: recent as u64,
            snapshot_bytes,
            quota: QuotaInfo {
                sandboxes: q.sandboxes,
                cpu_millis: q.cpu_millis,
                memory_bytes: q.memory_bytes,
                creates_per_minute: q.creates_per_minute,
                snapshot_bytes: q.snapshot_bytes,
            },
        }
    }
}

/// (sandboxes, CPU millis, memory bytes) of these records.
fn usage_of(live: &[SandboxRecord]) -> (u64, u64, u64) {
    live.iter().fold((0, 0, 0), |(n, c, m), r| {
        (
            n + 1,
            c + r.limits.cpu_millis.unwrap_or(0),
            m + r.limits.memory_bytes.unwrap_or(0),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(cpu: u64, mem: u64) -> ResourceLimits {
        ResourceLimits {
            cpu_millis: Some(cpu),
            memory_bytes: Some(mem),
            pids: 64,
            disk_bytes: None,
        }
    }

    fn quotas(toml_text: &str) -> std::sync::Arc<Quotas> {
        std::sync::Arc::new(Quotas::new(&toml::from_str(toml_text).expect("toml")).expect("quotas"))
    }

    #[test]
    fn in_flight_creates_hold_their_share_until_done() {
        let q = quotas("[default]\nsandboxes = 2\ncpu = \"2\"\n");
        let a = q
            .admit("acme", &limits(1000, 1), &[], true, true)
            .expect("first");
        let _b = q
            .admit("acme", &limits(1000, 1), &[], true, true)
            .expect("second");
        let e = q
            .admit("acme", &limits(100, 1), &[], true, true)
            .err()
            .expect("third refused");
        assert_eq!(
            (e.kind, e.code.as_str()),
            (crate::error::ErrorKind::Forbidden, "QUOTA_EXCEEDED")
        );
        assert!(
            e.to_string().contains("quota sandboxes"),
            "{}",
            e.to_string()
        );
        drop(a);
        // Done (failed, or its record now counts it, which the caller passes as `live`): its share
        // is free again.
        assert!(q.admit("acme", &limits(1000, 1), &[], true, true).is_ok());
        // Another tenant, and the default tenant (no quota unless its own), are not affected.
        assert!(q.admit("globex", &limits(1000, 1), &[], true, true).is_ok());
        for _ in 0..5 {
            std::mem::forget(
                q.admit(DEFAULT_TENANT, &limits(9000, 1), &[], true, true)
                    .expect("default"),
            );
        }
    }

    #[test]
    fn snapshot_storage_refuses_before_a_capture_when_full_and_after_it_when_it_would_overflow() {
        let q = quotas("[default]\nsnapshot_storage = \"10Ki\"\n");
        let limit = 10 << 10;
        assert!(q.admit_snapshot("acme", limit - 1, None).is_ok());
        let e = q.admit_snapshot("acme", limit, None).expect_err("full");
        assert_eq!(e.kind, ErrorKind::Forbidden);
        assert!(
            e.to_string().starts_with("quota snapshot_storage:"),
            "{}",
            e.to_string()
        );
        assert!(q.admit_snapshot("acme", limit - 10, Some(10)).is_ok());
        assert!(q.admit_snapshot("acme", limit - 10, Some(11)).is_err());
        // The default tenant has no quota unless it is given one.
        assert!(q.admit_snapshot(DEFAULT_TENANT, u64::MAX, Some(1)).is_ok());
        assert!(Quotas::new(
            &toml::from_str("[default]\nsnapshot_storage = \"lots\"\n").expect("toml")
        )
        .is_err());
    }

    #[test]
    fn the_rate_says_when_to_come_back() {
        let q = quotas("[tenants.acme]\ncreates_per_minute = 2\n");
        drop(q.admit("acme", &limits(1, 1), &[], true, true));
        drop(q.admit("acme", &limits(1, 1), &[], true, true));
        let e = q
            .admit("acme", &limits(1, 1), &[], true, true)
            .err()
            .expect("refused");
        assert_eq!(e.kind, crate::error::ErrorKind::Busy);
        assert!(
            matches!(e.retry_after, Some(59 | 60)),
            "{:?}",
            e.retry_after
        );
        assert!(
            q.admit("globex", &limits(1, 1), &[], true, true).is_ok(),
            "no default quota set"
        );
    }

    #[test]
    fn a_cpu_quota_needs_creates_to_name_their_cpu() {
        let q = quotas("[default]\ncpu = \"1\"\nmemory = \"1Gi\"\n");
        let mut l = limits(500, 1 << 20);
        l.cpu_millis = None;
        assert!(q.admit("acme", &l, &[], true, true).is_err());
        let e = q
            .admit("acme", &limits(500, 2 << 30), &[], true, true)
            .err()
            .expect("memory");
        assert!(e.to_string().contains("quota memory"), "{}", e.to_string());
    }
}
