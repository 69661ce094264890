//! `GET /metrics` and `GET /metrics/watch`: the sandbox's own resource use, read from its cgroup (v2 or
//! v1; inside the sandbox `/sys/fs/cgroup` is the sandbox's cgroup), falling back to `/proc` when the
//! cgroup sets no limit or is not mounted.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::Json;
use warren_api::execd::Metrics;

use crate::sse::now_ms;
use crate::AppState;

const MIB: f64 = 1024.0 * 1024.0;
/// Window over which `GET /metrics` measures CPU use.
pub const CPU_WINDOW: Duration = Duration::from_millis(100);
pub const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// Where cgroup and proc files are read from (a temp dir in tests).
#[derive(Debug, Clone)]
pub struct Sources {
    pub cgroup: PathBuf,
    pub proc: PathBuf,
}

impl Default for Sources {
    fn default() -> Self {
        Self {
            cgroup: PathBuf::from("/sys/fs/cgroup"),
            proc: PathBuf::from("/proc"),
        }
    }
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

fn read_u64(p: &Path) -> Option<u64> {
    read_trim(p)?.parse().ok()
}

/// A v1 "no limit" is a huge number close to `i64::MAX` rounded to pages.
const V1_UNLIMITED: u64 = 1 << 60;

impl Sources {
    /// How many processes the kernel's OOM killer has killed in this cgroup so far (v2
    /// `memory.events`, v1 `memory.oom_control`); `None` when neither is readable.
    pub fn oom_kills(&self) -> Option<u64> {
        let cg = &self.cgroup;
        let text = read_trim(&cg.join("memory.events"))
            .or_else(|| read_trim(&cg.join("memory/memory.oom_control")))?;
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
    }

    /// `(total, used)` bytes.
    pub fn memory(&self) -> (f64, f64) {
        let cg = &self.cgroup;
        let limits = if let Some(used) = read_u64(&cg.join("memory.current")) {
            let max = read_trim(&cg.join("memory.max")).and_then(|m| m.parse::<u64>().ok());
            Some((max, used))
        } else if let Some(used) = read_u64(&cg.join("memory/memory.usage_in_bytes")) {
            let max =
                read_u64(&cg.join("memory/memory.limit_in_bytes")).filter(|m| *m < V1_UNLIMITED);
            Some((max, used))
        } else {
            None
        };
        let (mem_total, mem_avail) = self.meminfo();
        match limits {
            Some((Some(max), used)) => (max as f64, used as f64),
            // Unlimited cgroup: the machine is the limit, the cgroup's own use is still the right "used".
            Some((None, used)) => (mem_total, used as f64),
            None => (mem_total, (mem_total - mem_avail).max(0.0)),
        }
    }

    /// `(MemTotal, MemAvailable)` in bytes.
    fn meminfo(&self) -> (f64, f64) {
        let text = std::fs::read_to_string(self.proc.join("meminfo")).unwrap_or_default();
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
                .map(|kb| kb * 1024.0)
                .unwrap_or(0.0)
        };
        (field("MemTotal:"), field("MemAvailable:"))
    }

    pub fn cpu_count(&self) -> f64 {
        let cg = &self.cgroup;
        if let Some(max) = read_trim(&cg.join("cpu.max")) {
            let mut it = max.split_whitespace();
            if let (Some(q), Some(p)) = (it.next(), it.next()) {
                if let (Ok(q), Ok(p)) = (q.parse::<f64>(), p.parse::<f64>()) {
                    if p > 0.0 {
                        return q / p;
                    }
                }
            }
        } else if let (Some(q), Some(p)) = (
            read_trim(&cg.join("cpu/cpu.cfs_quota_us")).and_then(|s| s.parse::<i64>().ok()),
            read_u64(&cg.join("cpu/cpu.cfs_period_us")),
        ) {
            if q > 0 && p > 0 {
                return q as f64 / p as f64;
            }
        }
        std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0)
    }

    fn sample(&self) -> CpuSample {
        let cg = &self.cgroup;
        let cgroup_secs = read_trim(&cg.join("cpu.stat"))
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("usage_usec "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .map(|us| us / 1e6)
            .or_else(|| read_u64(&cg.join("cpuacct/cpuacct.usage")).map(|ns| ns as f64 / 1e9));
        let (busy, total) = read_trim(&self.proc.join("stat"))
            .and_then(|s| {
                let line = s.lines().next()?.strip_prefix("cpu ")?.to_string();
                let v: Vec<u64> = line
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                let total: u64 = v.iter().take(8).sum();
                let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
                Some((total - idle, total))
            })
            .unwrap_or((0, 0));
        CpuSample {
            at: Instant::now(),
            cgroup_secs,
            busy,
            total,
        }
    }

    /// Percentage of the sandbox's CPU allowance used between two samples (0–100).
    fn cpu_pct(a: &CpuSample, b: &CpuSample, cpu_count: f64) -> f64 {
        let pct = match (a.cgroup_secs, b.cgroup_secs) {
            (Some(x), Some(y)) => {
                let wall = b.at.duration_since(a.at).as_secs_f64();
                if wall <= 0.0 || cpu_count <= 0.0 {
                    0.0
                } else {
                    (y - x) / (wall * cpu_count) * 100.0
                }
            }
            _ => {
                let total = b.total.saturating_sub(a.total);
                if total == 0 {
                    0.0
                } else {
                    b.busy.saturating_sub(a.busy) as f64 / total as f64 * 100.0
                }
            }
        };
        pct.clamp(0.0, 100.0)
    }

    fn metrics(&self, a: &CpuSample, b: &CpuSample) -> Metrics {
        let cpu_count = self.cpu_count();
        let (total, used) = self.memory();
        Metrics {
            cpu_count,
            cpu_used_pct: (Self::cpu_pct(a, b, cpu_count) * 100.0).round() / 100.0,
            mem_total_mib: (total / MIB * 100.0).round() / 100.0,
            mem_used_mib: (used / MIB * 100.0).round() / 100.0,
            timestamp: now_ms(),
        }
    }
}

#[derive(Debug, Clone)]
struct CpuSample {
    at: Instant,
    cgroup_secs: Option<f64>,
    busy: u64,
    total: u64,
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> Json<Metrics> {
    let src = app.metrics.clone();
    let a = src.sample();
    tokio::time::sleep(CPU_WINDOW).await;
    let b = src.sample();
    Json(src.metrics(&a, &b))
}

pub async fn watch(State(app): State<Arc<AppState>>) -> Response {
    let src = app.metrics.clone();
    let first = src.sample();
    let stream = futures::stream::unfold((src, first), |(src, prev)| async move {
        tokio::time::sleep(WATCH_INTERVAL).await;
        let next = src.sample();
        let m = src.metrics(&prev, &next);
        let mut line = serde_json::to_vec(&m).unwrap_or_default();
        line.extend_from_slice(b"\n\n");
        Some((Ok::<_, std::convert::Infallible>(line), (src, next)))
    });
    crate::sse::event_stream_response(Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, rel: &str, text: &str) {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
    }

    #[test]
    fn cgroup_v2_limits() {
        let dir = tempfile::tempdir().expect("tmp");
        write(dir.path(), "cg/memory.current", "104857600\n");
        write(dir.path(), "cg/memory.max", "209715200\n");
        write(dir.path(), "cg/cpu.max", "150000 100000\n");
        write(
            dir.path(),
            "proc/meminfo",
            "MemTotal: 1024 kB\nMemAvailable: 512 kB\n",
        );
        let s = Sources {
            cgroup: dir.path().join("cg"),
            proc: dir.path().join("proc"),
        };
        assert_eq!(s.memory(), (209715200.0, 104857600.0));
        assert_eq!(s.cpu_count(), 1.5);
    }

    #[test]
    fn unlimited_falls_back_to_meminfo() {
        let dir = tempfile::tempdir().expect("tmp");
        write(dir.path(), "cg/memory.current", "1048576\n");
        write(dir.path(), "cg/memory.max", "max\n");
        write(dir.path(), "cg/cpu.max", "max 100000\n");
        write(
            dir.path(),
            "proc/meminfo",
            "MemTotal: 2048 kB\nMemAvailable: 512 kB\n",
        );
        let s = Sources {
            cgroup: dir.path().join("cg"),
            proc: dir.path().join("proc"),
        };
        assert_eq!(s.memory(), (2048.0 * 1024.0, 1048576.0));
        assert!(s.cpu_count() >= 1.0);
    }

    #[test]
    fn v1_and_proc_fallback() {
        let dir = tempfile::tempdir().expect("tmp");
        write(dir.path(), "cg/memory/memory.usage_in_bytes", "100\n");
        write(
            dir.path(),
            "cg/memory/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        write(dir.path(), "cg/cpu/cpu.cfs_quota_us", "200000\n");
        write(dir.path(), "cg/cpu/cpu.cfs_period_us", "100000\n");
        write(
            dir.path(),
            "proc/meminfo",
            "MemTotal: 4 kB\nMemAvailable: 1 kB\n",
        );
        let s = Sources {
            cgroup: dir.path().join("cg"),
            proc: dir.path().join("proc"),
        };
        assert_eq!(s.memory(), (4096.0, 100.0));
        assert_eq!(s.cpu_count(), 2.0);
        let empty = Sources {
            cgroup: dir.path().join("none"),
            proc: dir.path().join("proc"),
        };
        assert_eq!(empty.memory(), (4096.0, 3072.0));
        assert_eq!(empty.oom_kills(), None);
        write(
            dir.path(),
            "cg/memory/memory.oom_control",
            "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        );
        assert_eq!(s.oom_kills(), Some(3));
        write(
            dir.path(),
            "v2/memory.events",
            "low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n",
        );
        let v2 = Sources {
            cgroup: dir.path().join("v2"),
            proc: dir.path().join("proc"),
        };
        assert_eq!(v2.oom_kills(), Some(2));
    }
}
