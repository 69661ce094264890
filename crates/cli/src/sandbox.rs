//! `warren sandbox …`: the lifecycle verbs, mirroring `osb sandbox`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use warren_sdk::{Client, CreateSandboxRequest, ImageSpec, ListQuery, SandboxInfo, SandboxState};

use crate::client::{env_map, Explain};
use crate::output::{emit, or_dash, Format, Table};
use crate::settings::Settings;

#[derive(clap::Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox and print it.
    Create(CreateArgs),
    /// List sandboxes.
    List {
        /// Only these states (repeatable: Running, Paused, …).
        #[arg(long)]
        state: Vec<String>,
        /// Only sandboxes with this metadata, KEY=VALUE (repeatable, all must match).
        #[arg(long)]
        metadata: Vec<String>,
        #[arg(long, default_value_t = 1)]
        page: u32,
        #[arg(long, default_value_t = 50)]
        page_size: u32,
    },
    /// Show one sandbox.
    Get { id: String },
    /// Delete sandboxes and everything in them.
    Kill {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Pause a sandbox (its processes stop using CPU).
    Pause {
        id: String,
        /// Return at once instead of waiting for Paused.
        #[arg(long)]
        no_wait: bool,
    },
    /// Resume a paused sandbox.
    Resume {
        id: String,
        #[arg(long)]
        no_wait: bool,
    },
    /// Move a sandbox's expiry to now + --timeout seconds.
    Renew {
        id: String,
        #[arg(long)]
        timeout: u64,
    },
    /// How to reach a port inside the sandbox.
    Endpoint {
        id: String,
        #[arg(long)]
        port: u16,
    },
    /// Whether execd inside the sandbox answers (exit 0 when it does).
    Health { id: String },
    /// What happened in the sandbox: its flight recorder (commands, files, network, states).
    ///
    /// State changes, each command with its exit code, file changes through the API, egress and
    /// vault decisions, endpoints and snapshots, one line each; `-o json` prints the server's
    /// JSON lines.
    Timeline {
        id: String,
        /// Keep printing new events as they are recorded, until the sandbox ends.
        #[arg(long, short = 'f')]
        follow: bool,
        /// Only events numbered after this one.
        #[arg(long, default_value_t = 0)]
        after: u64,
    },
    /// CPU and memory of the sandbox.
    Metrics {
        id: String,
        /// Print a line every --interval seconds until interrupted.
        #[arg(long)]
        watch: bool,
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
    },
}

#[derive(clap::Args)]
pub struct CreateArgs {
    /// Image [default: `defaults.image` of the CLI config, else host]
    #[arg(long)]
    image: Option<String>,
    /// Registry credentials for the image.
    #[arg(long, requires = "image_auth_password")]
    image_auth_username: Option<String>,
    #[arg(long)]
    image_auth_password: Option<String>,
    /// Seconds until the sandbox is deleted; 0 for never [default: 600 or `defaults.timeout`]
    #[arg(long)]
    timeout: Option<i64>,
    /// KEY=VALUE (repeatable).
    #[arg(long = "env", short = 'e')]
    env: Vec<String>,
    #[arg(long)]
    metadata: Vec<String>,
    /// Resource limits, KEY=VALUE: cpu=1, memory=2Gi (repeatable).
    #[arg(long)]
    resource: Vec<String>,
    #[arg(long)]
    extension: Vec<String>,
    /// The entrypoint, one argument per flag [default: the server's]
    #[arg(long, allow_hyphen_values = true)]
    entrypoint: Vec<String>,
    /// A networkPolicy JSON file.
    #[arg(long)]
    network_policy_file: Option<PathBuf>,
    /// A whole CreateSandboxRequest as JSON; flags given too override its fields.
    #[arg(long)]
    file: Option<PathBuf>,
}

fn pairs(flag: &str, items: &[String]) -> anyhow::Result<Option<BTreeMap<String, String>>> {
    if items.is_empty() {
        return Ok(None);
    }
    env_map(items)
        .map(Some)
        .with_context(|| format!("--{flag} takes KEY=VALUE"))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &PathBuf) -> anyhow::Result<T> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON for this", path.display()))
}

impl CreateArgs {
    fn request(&self, settings: &Settings) -> anyhow::Result<CreateSandboxRequest> {
        let mut req: CreateSandboxRequest = match &self.file {
            Some(f) => read_json(f)?,
            None => CreateSandboxRequest::default(),
        };
        if let Some(uri) = self.image.clone().or_else(|| {
            req.image.is_none().then(|| {
                settings
                    .defaults
                    .image
                    .clone()
                    .unwrap_or_else(|| "host".into())
            })
        }) {
            req.image = Some(ImageSpec { uri, auth: None });
        }
        if let (Some(u), Some(p), Some(img)) = (
            &self.image_auth_username,
            &self.image_auth_password,
            req.image.as_mut(),
        ) {
            img.auth = Some(warren_api::lifecycle::ImageAuth {
                username: u.clone(),
                password: p.clone(),
            });
        }
        match self.timeout.or(settings.defaults.timeout) {
            Some(0) => req.timeout = None,
            Some(t) if t < 0 => bail!("--timeout must be 0 (never) or a number of seconds"),
            Some(t) => req.timeout = Some(t),
            None if self.file.is_none() => req.timeout = Some(600),
            None => {}
        }
        if let Some(m) = pairs("env", &self.env)? {
            req.env = Some(m);
        }
        if let Some(m) = pairs("metadata", &self.metadata)? {
            req.metadata = Some(m);
        }
        if let Some(m) = pairs("resource", &self.resource)? {
            req.resource_limits = Some(m);
        }
        if let Some(m) = pairs("extension", &self.extension)? {
            req.extensions = Some(m);
        }
        if !self.entrypoint.is_empty() {
            req.entrypoint = Some(self.entrypoint.clone());
        }
        if let Some(f) = &self.network_policy_file {
            req.network_policy = Some(read_json(f)?);
        }
        Ok(req)
    }
}

fn sandbox_table(s: &SandboxInfo) -> Table {
    Table::pairs(vec![
        ("ID", s.id.clone()),
        ("STATE", s.status.state.as_str().to_string()),
        ("REASON", or_dash(s.status.reason.as_deref())),
        ("IMAGE", or_dash(s.image.as_ref().map(|i| i.uri.as_str()))),
        ("ENTRYPOINT", s.entrypoint.join(" ")),
        ("CREATED", s.created_at.clone()),
        ("EXPIRES", or_dash(s.expires_at.as_deref())),
        (
            "METADATA",
            or_dash(Some(
                &s.metadata
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(","),
            )),
        ),
    ])
}

fn parse_state(s: &str) -> anyhow::Result<SandboxState> {
    SandboxState::ALL
        .into_iter()
        .find(|st| st.as_str().eq_ignore_ascii_case(s))
        .with_context(|| {
            let all: Vec<&str> = SandboxState::ALL.iter().map(|s| s.as_str()).collect();
            format!("unknown state {s:?}; states are {}", all.join(", "))
        })
}

async fn wait_state(client: &Client, id: &str, want: SandboxState) -> anyhow::Result<SandboxInfo> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = client.get(id).await.explain(&format!("sandbox {id}"))?;
        if s.status.state == want {
            return Ok(s);
        }
        if s.status.state.is_terminal() || Instant::now() > deadline {
            bail!(
                "sandbox {id} is {} instead of {}{}",
                s.status.state.as_str(),
                want.as_str(),
                s.status
                    .message
                    .as_deref()
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn run(
    command: SandboxCommand,
    client: &Client,
    settings: &Settings,
    format: Format,
) -> anyhow::Result<ExitCode> {
    match command {
        SandboxCommand::Create(args) => {
            let req = args.request(settings)?;
            let sb = client.create(&req).await.explain("creating the sandbox")?;
            emit(format, sb.info(), sandbox_table)?;
        }
        SandboxCommand::List {
            state,
            metadata,
            page,
            page_size,
        } => {
            let q = ListQuery {
                states: state
                    .iter()
                    .map(|s| parse_state(s))
                    .collect::<anyhow::Result<_>>()?,
                metadata: env_map(&metadata).context("--metadata takes KEY=VALUE")?,
                page,
                page_size,
            };
            let list = client.list(&q).await.explain("listing sandboxes")?;
            emit(format, &list, |l| {
                let mut t = Table::new(&["ID", "STATE", "IMAGE", "CREATED", "EXPIRES"]);
                for s in &l.items {
                    t.row(vec![
                        s.id.clone(),
                        s.status.state.as_str().into(),
                        or_dash(s.image.as_ref().map(|i| i.uri.as_str())),
                        s.created_at.clone(),
                        or_dash(s.expires_at.as_deref()),
                    ]);
                }
                if l.pagination.has_next_page {
                    t.row(vec![format!(
                        "(page {} of {}; --page {} for more)",
                        l.pagination.page,
                        l.pagination.total_pages,
                        l.pagination.page + 1
                    )]);
                }
                t
            })?;
        }
        SandboxCommand::Get { id } => {
            let s = client.get(&id).await.explain(&format!("sandbox {id}"))?;
            emit(format, &s, sandbox_table)?;
        }
        SandboxCommand::Kill { ids } => {
            let mut failed = false;
            for id in &ids {
                match client
                    .delete(id)
                    .await
                    .explain(&format!("deleting sandbox {id}"))
                {
                    Ok(()) => println!("deleted {id}"),
                    Err(e) => {
                        eprintln!("warren: error: {e:#}");
                        failed = true;
                    }
                }
            }
            if failed {
                return Ok(ExitCode::from(1));
            }
        }
        SandboxCommand::Pause { id, no_wait } => {
            client
                .pause(&id)
                .await
                .explain(&format!("pausing sandbox {id}"))?;
            let s = if no_wait {
                client.get(&id).await.explain(&format!("sandbox {id}"))?
            } else {
                wait_state(client, &id, SandboxState::Paused).await?
            };
            emit(format, &s, sandbox_table)?;
        }
        SandboxCommand::Resume { id, no_wait } => {
            client
                .resume(&id)
                .await
                .explain(&format!("resuming sandbox {id}"))?;
            let s = if no_wait {
                client.get(&id).await.explain(&format!("sandbox {id}"))?
            } else {
                wait_state(client, &id, SandboxState::Running).await?
            };
            emit(format, &s, sandbox_table)?;
        }
        SandboxCommand::Renew { id, timeout } => {
            let at = client
                .renew(&id, Duration::from_secs(timeout))
                .await
                .explain(&format!("renewing sandbox {id}"))?;
            emit(
                format,
                &serde_json::json!({ "id": id, "expiresAt": at }),
                |_| Table::pairs(vec![("ID", id.clone()), ("EXPIRES", at.clone())]),
            )?;
        }
        SandboxCommand::Endpoint { id, port } => {
            let ep = client
                .endpoint(&id, port)
                .await
                .explain(&format!("sandbox {id}"))?;
            emit(format, &ep, |ep| {
                let mut rows = vec![("ENDPOINT", ep.endpoint.clone())];
                for (k, v) in &ep.headers {
                    rows.push(("HEADER", format!("{k}: {v}")));
                }
                Table::pairs(rows)
            })?;
        }
        SandboxCommand::Timeline { id, follow, after } => {
            let mut events = client
                .timeline(&id, follow, after)
                .await
                .explain(&format!("sandbox {id}'s timeline"))?;
            while let Some(event) = events.next().await.explain("reading the timeline")? {
                match format {
                    // One JSON object per line, as the server sends them.
                    Format::Json => println!("{event}"),
                    Format::Yaml => print!("---\n{}", serde_yaml::to_string(&event)?),
                    Format::Table => println!("{}", crate::timeline::line(&event)),
                }
            }
        }
        SandboxCommand::Health { id } => {
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            let healthy = sb.ping().await;
            emit(
                format,
                &serde_json::json!({ "id": id, "healthy": healthy }),
                |_| {
                    Table::pairs(vec![
                        ("ID", id.clone()),
                        ("HEALTHY", if healthy { "yes" } else { "no" }.into()),
                    ])
                },
            )?;
            if !healthy {
                return Ok(ExitCode::from(1));
            }
        }
        SandboxCommand::Metrics {
            id,
            watch,
            interval,
        } => {
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            let mut first = true;
            loop {
                let m = sb
                    .metrics()
                    .await
                    .explain(&format!("metrics of sandbox {id}"))?;
                if watch && format == Format::Table {
                    if first {
                        println!(
                            "{:<26}{:>8}{:>10}{:>14}",
                            "TIME", "CPUS", "CPU %", "MEMORY MiB"
                        );
                    }
                    let at = chrono::DateTime::from_timestamp_millis(m.timestamp)
                        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
                        .unwrap_or_default();
                    println!(
                        "{at:<26}{:>8}{:>10.1}{:>14}",
                        m.cpu_count,
                        m.cpu_used_pct,
                        format!("{:.1}/{:.0}", m.mem_used_mib, m.mem_total_mib)
                    );
                } else {
                    emit(format, &m, |m| {
                        Table::pairs(vec![
                            ("CPUS", m.cpu_count.to_string()),
                            ("CPU USED %", format!("{:.1}", m.cpu_used_pct)),
                            ("MEMORY USED MiB", format!("{:.1}", m.mem_used_mib)),
                            ("MEMORY TOTAL MiB", format!("{:.1}", m.mem_total_mib)),
                        ])
                    })?;
                }
                if !watch {
                    break;
                }
                first = false;
                tokio::time::sleep(Duration::from_secs_f64(interval.max(0.1))).await;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
