//! `warren audit`: the audit log of a server's data dir (see `warren_server::audit_log`), oldest first,
//! filtered by tenant, sandbox and time.

use std::io::BufRead;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use chrono::{DateTime, Utc};
use warren_server::audit_log::{files, AuditEntry};

use crate::output::{self, or_dash, OutputArgs};

#[derive(clap::Args)]
pub struct AuditArgs {
    #[arg(long)]
    tenant: Option<String>,
    #[arg(long)]
    sandbox: Option<String>,
    /// From this time on: RFC 3339 (2026-12-06T10:00:00Z) or an age (90s, 15m, 2h, 1d).
    #[arg(long)]
    since: Option<String>,
    /// Up to this time (same forms).
    #[arg(long)]
    until: Option<String>,
    #[command(flatten)]
    out: OutputArgs,
}

/// An RFC 3339 time, or that long ago.
fn when(text: &str, now: DateTime<Utc>) -> anyhow::Result<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let (n, unit) = text.split_at(text.len().saturating_sub(1));
    let n: i64 = n
        .parse()
        .with_context(|| format!("{text:?} is neither RFC 3339 nor an age like 15m"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => anyhow::bail!("{text:?}: an age ends in s, m, h or d"),
    };
    Ok(now - chrono::Duration::seconds(secs))
}

pub fn run(args: AuditArgs, data_dir: &Path) -> anyhow::Result<ExitCode> {
    let now = Utc::now();
    let since = args.since.as_deref().map(|t| when(t, now)).transpose()?;
    let until = args.until.as_deref().map(|t| when(t, now)).transpose()?;
    let mut entries = Vec::new();
    for f in files(data_dir) {
        let file = std::fs::File::open(&f).with_context(|| format!("{}", f.display()))?;
        for line in std::io::BufReader::new(file).lines() {
            // A line cut short by a crash is skipped.
            let Ok(e) = serde_json::from_str::<AuditEntry>(&line?) else {
                continue;
            };
            let keep = args
                .tenant
                .as_ref()
                .is_none_or(|t| e.tenant.as_ref() == Some(t))
                && args
                    .sandbox
                    .as_ref()
                    .is_none_or(|s| e.sandbox.as_ref() == Some(s))
                && since.is_none_or(|t| e.time >= t)
                && until.is_none_or(|t| e.time <= t);
            if keep {
                entries.push(e);
            }
        }
    }
    output::emit(args.out.output.unwrap_or_default(), &entries, |entries| {
        let mut t = output::Table::new(&[
            "TIME", "TENANT", "KEY", "ACTION", "SANDBOX", "OBJECT", "STATUS", "CLIENT",
        ]);
        for e in entries {
            t.row(vec![
                e.time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                or_dash(e.tenant.as_deref()),
                or_dash(e.key_id.as_deref()),
                e.action.clone(),
                or_dash(e.sandbox.as_deref()),
                or_dash(e.object.as_deref()),
                e.status.to_string(),
                or_dash(e.client.as_deref()),
            ]);
        }
        t
    })?;
    Ok(ExitCode::SUCCESS)
}
