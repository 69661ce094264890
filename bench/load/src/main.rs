//! `warren-load`: runs create → first output of a command → delete cycles against a server through
//! `warren-sdk`, `--concurrency` at a time, and prints the create → first output times as JSON.
//!
//! It exists so the benchmark can measure the server without a Python client's CPU in the way: on a
//! 2-core machine the httpx client alone costs about a third of each cycle's CPU. One thread, so the
//! client's own share stays small and measurable.

use std::time::Instant;

use clap::Parser;
use futures::StreamExt;
use warren_sdk::{Client, Config, CreateSandboxRequest, EventKind, ImageSpec, RunCommandRequest};

#[derive(Parser)]
struct Args {
    /// Server address (host:port).
    #[arg(long)]
    domain: String,
    #[arg(long)]
    api_key: String,
    #[arg(long, default_value = "host")]
    image: String,
    #[arg(long, default_value = "echo hi")]
    command: String,
    /// Cycles to run.
    #[arg(long, default_value_t = 50)]
    n: usize,
    /// Cycles in flight at once.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Instead of `--n` cycles: keep `--concurrency` cycles in flight for this many seconds (a
    /// sustained-rate run; cycles started before the deadline finish and count).
    #[arg(long)]
    seconds: Option<f64>,
    /// Wait this long after each cycle before the next one starts (with `--concurrency 1`: claims
    /// from idle, after the previous cycle's delete and the pool's refill are done).
    #[arg(long, default_value_t = 0)]
    pause_ms: u64,
}

/// One cycle's times, in milliseconds.
struct Times {
    /// Create → first stdout: the number the harness reports.
    first_output: f64,
    /// The create request's own part of it.
    created: f64,
    /// The delete request (not part of `first_output`; the client waits for it before its next
    /// cycle, so it decides how many cycles are past their delete at once).
    deleted: f64,
}

/// One cycle: create, the command until its stream ends, delete.
async fn cycle(
    client: &Client,
    req: &CreateSandboxRequest,
    command: &str,
) -> anyhow::Result<Times> {
    let t0 = Instant::now();
    let sb = client.create(req).await?;
    let created = t0.elapsed().as_secs_f64() * 1000.0;
    let outcome = async {
        let mut events = sb
            .stream(&RunCommandRequest {
                command: Some(command.to_string()),
                ..Default::default()
            })
            .await?;
        let mut first = None;
        while let Some(ev) = events.next().await {
            let ev = ev?;
            match ev.kind {
                EventKind::Stdout if first.is_none() => {
                    first = Some(t0.elapsed().as_secs_f64() * 1000.0)
                }
                EventKind::Error => anyhow::bail!("command failed: {:?}", ev.error),
                _ => {}
            }
        }
        first.ok_or_else(|| anyhow::anyhow!("no output"))
    }
    .await;
    let t_delete = Instant::now();
    let deleted = sb.kill().await;
    let deleted_ms = t_delete.elapsed().as_secs_f64() * 1000.0;
    let first_output = outcome?;
    deleted?;
    Ok(Times {
        first_output,
        created,
        deleted: deleted_ms,
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = Client::new(Config::new(&args.domain).with_api_key(&args.api_key));
    let req = CreateSandboxRequest {
        image: Some(ImageSpec {
            uri: args.image.clone(),
            auth: None,
        }),
        timeout: Some(600),
        resource_limits: Some(
            [("cpu", "1"), ("memory", "2Gi")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        entrypoint: Some(vec!["tail".into(), "-f".into(), "/dev/null".into()]),
        ..Default::default()
    };
    let started = Instant::now();
    let deadline = args
        .seconds
        .map(|s| started + std::time::Duration::from_secs_f64(s));
    // Without a deadline, exactly `n` cycles; with one, as many as start before it.
    let count = if deadline.is_some() {
        usize::MAX
    } else {
        args.n
    };
    let results: Vec<anyhow::Result<Times>> = futures::stream::iter(0..count)
        .take_while(|_| std::future::ready(deadline.is_none_or(|d| Instant::now() < d)))
        .map(|_| async {
            let out = cycle(&client, &req, &args.command).await;
            if args.pause_ms > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(args.pause_ms)).await;
            }
            out
        })
        .buffer_unordered(args.concurrency.max(1))
        .collect()
        .await;
    let mut times = Vec::new();
    let mut creates = Vec::new();
    let mut deletes = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(t) => {
                times.push(t.first_output);
                creates.push(t.created);
                deletes.push(t.deleted);
            }
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "times_ms": times,
            // Per cycle, in the order of `times_ms`: how much of it was the create request.
            "create_ms": creates,
            "delete_ms": deletes,
            "errors": errors,
            "wall_s": started.elapsed().as_secs_f64(),
        })
    );
    Ok(())
}
