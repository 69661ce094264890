//! `warren usage`: what a tenant uses beside its quotas (`GET /v1/usage`).

use std::process::ExitCode;

use warren_sdk::Client;

use crate::client::Explain;
use crate::human_bytes;
use crate::output::{emit, Format, Table};

pub async fn run(
    tenant: Option<&str>,
    client: &Client,
    format: Format,
) -> anyhow::Result<ExitCode> {
    let usage = client.usage(tenant).await.explain("reading the usage")?;
    emit(format, &usage, |u| {
        let of = |used: String, quota: Option<String>| match quota {
            Some(q) => format!("{used} of {q}"),
            None => format!("{used} (no quota)"),
        };
        let q = &u.quota;
        Table::pairs(vec![
            ("tenant", u.tenant.clone()),
            (
                "sandboxes",
                of(u.sandboxes.to_string(), q.sandboxes.map(|n| n.to_string())),
            ),
            (
                "cpu",
                of(
                    format!("{}m", u.cpu_millis),
                    q.cpu_millis.map(|n| format!("{n}m")),
                ),
            ),
            (
                "memory",
                of(human_bytes(u.memory_bytes), q.memory_bytes.map(human_bytes)),
            ),
            (
                "creates (last minute)",
                of(
                    u.creates_last_minute.to_string(),
                    q.creates_per_minute.map(|n| n.to_string()),
                ),
            ),
            (
                "snapshot storage",
                of(
                    human_bytes(u.snapshot_bytes),
                    q.snapshot_bytes.map(human_bytes),
                ),
            ),
        ])
    })?;
    Ok(ExitCode::SUCCESS)
}
