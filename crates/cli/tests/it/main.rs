//! End-to-end tests of the `warren` binary over raw HTTP: auth and key handling, the lifecycle state
//! machine, limits, and — after every scenario — that nothing is left on the host (sandbox folder,
//! cgroup, process). These need root (namespaces, cgroups), as the whole project does; the official-SDK
//! suite in `tests/e2e` covers the protocol surface in depth.

mod cli_verbs;
mod harness;
mod lifecycle;
mod sdk;
mod serve;
mod zygote;
