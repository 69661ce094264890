//! Warren's domain: what a sandbox is asked to be (`SandboxSpec`), the limits it runs under, and the
//! `Runtime` trait that every backend (native, docker, …) implements. The server drives runtimes only
//! through this trait and maps `RuntimeError` kinds, never backend strings, onto API errors.

pub mod quantity;
pub mod runtime;

pub use quantity::{parse_cpu_millis, parse_memory_bytes, QuantityError};
pub use runtime::{ExitInfo, Liveness, ResourceLimits, Runtime, RuntimeError, RuntimeState, SandboxSpec};

/// Validated sandbox id: lowercase hex/uuid-ish, safe as a path component and a cgroup name.
pub fn is_valid_sandbox_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}
