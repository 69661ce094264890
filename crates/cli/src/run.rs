//! `warren run`: the shortest path from nothing to output. Uses a running server when one is
//! configured or answering on the default address; otherwise starts one in-process for the duration
//! of the command (so a fresh machine needs no daemon).

use std::process::ExitCode;

use anyhow::Context;
use tokio::signal::unix::{signal, Signal, SignalKind};
use warren_api::execd::RunCommandRequest;
use warren_api::lifecycle::{CreateSandboxRequest, ImageSpec};
use warren_server::config::{self, EnvSource, ProcessEnv};

use warren_local::stored_key;
use warren_sdk::{Client, Config};

use crate::client::{env_map, Explain};

#[derive(clap::Args)]
pub struct RunArgs {
    /// Image to run (an imported name, or the built-in `host`).
    #[arg(long, default_value = "host")]
    image: String,
    /// Environment variables, KEY=VALUE (repeatable).
    #[arg(long = "env", short = 'e')]
    env: Vec<String>,
    /// Working directory inside the sandbox.
    #[arg(long)]
    workdir: Option<String>,
    /// Resource limits, e.g. --cpu 0.5 --memory 512Mi.
    #[arg(long)]
    cpu: Option<String>,
    #[arg(long)]
    memory: Option<String>,
    /// Server address (host:port) [env: OPEN_SANDBOX_DOMAIN]; without it, a local server is used or
    /// started in-process.
    #[arg(long)]
    domain: Option<String>,
    /// API key [env: OPEN_SANDBOX_API_KEY, WARREN_API_KEY]
    #[arg(long)]
    api_key: Option<String>,
    /// Data dir for the in-process server [env: WARREN_DATA_DIR]
    #[arg(long)]
    data_dir: Option<std::path::PathBuf>,
    /// The command; one argument is run by the shell, several are quoted and joined.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

pub async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    // Listened for from the start: the sandbox runs in a session of its own, so a Ctrl-C reaches
    // only us, and without this we would die at once and leave it running.
    let mut stop = StopSignals::listen()?;
    let env = ProcessEnv;
    let api_key = args
        .api_key
        .clone()
        .or_else(|| env.get("OPEN_SANDBOX_API_KEY"))
        .or_else(|| env.get(warren_env::EnvVars::WARREN_API_KEY));
    let domain = args
        .domain
        .clone()
        .or_else(|| env.get("OPEN_SANDBOX_DOMAIN"));
    let data_dir = args
        .data_dir
        .clone()
        .or_else(|| {
            env.get(warren_env::EnvVars::WARREN_DATA_DIR)
                .map(Into::into)
        })
        .unwrap_or_else(|| config::default_data_dir(&env));

    let mut embedded = None;
    let client = match domain {
        Some(d) => client_for(&d, api_key.or_else(|| stored_key(&data_dir))),
        None => {
            let probe = Client::new(Config::new(config::DEFAULT_LISTEN));
            if probe.health().await.is_ok()
                && (api_key.is_some() || stored_key(&data_dir).is_some())
            {
                client_for(
                    config::DEFAULT_LISTEN,
                    api_key.or_else(|| stored_key(&data_dir)),
                )
            } else {
                let overrides = config::Overrides {
                    listen: Some("127.0.0.1:0".into()),
                    data_dir: Some(data_dir.clone()),
                    config: None,
                    insecure_no_auth: false,
                    tls_self_signed: false,
                };
                let mut cfg = warren_server::ServerConfig::load(&overrides, &env)?;
                crate::runtimes::check_sections(
                    &cfg.docker,
                    &cfg.kubernetes,
                    cfg.config_file.as_deref(),
                )?;
                cfg.api_key = Some(random_key());
                let key = cfg.api_key.clone();
                let server = warren_server::Server::bind(cfg, crate::runtimes::make_runtime)
                    .await
                    .context("starting an in-process Warren server")?;
                let addr = server.local_addr();
                let sandboxes = server.state.sandboxes.clone();
                let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
                let handle = tokio::spawn(server.run(async move {
                    let _ = stop_rx.await;
                }));
                embedded = Some((stop_tx, handle, sandboxes));
                client_for(&addr.to_string(), key)
            }
        }
    };

    let mut limits = std::collections::BTreeMap::new();
    if let Some(c) = &args.cpu {
        limits.insert("cpu".to_string(), c.clone());
    }
    if let Some(m) = &args.memory {
        limits.insert("memory".to_string(), m.clone());
    }
    let req = CreateSandboxRequest {
        image: Some(ImageSpec {
            uri: args.image.clone(),
            auth: None,
        }),
        timeout: Some(3600),
        resource_limits: (!limits.is_empty()).then_some(limits),
        env: Some(env_map(&args.env)?),
        ..Default::default()
    };
    let result = async {
        let create = client.create(&req);
        tokio::pin!(create);
        let (created, stopped) = tokio::select! {
            created = &mut create => (created, None),
            // A create already sent still makes a sandbox: let it finish, then delete it.
            signal = stop.next() => (create.await, Some(signal)),
        };
        let sb = created.explain("creating the sandbox")?;
        let command = if args.command.len() == 1 {
            args.command[0].clone()
        } else {
            shell_join(&args.command)
        };
        let cmd = RunCommandRequest {
            command: Some(command),
            cwd: args.workdir.clone(),
            ..Default::default()
        };
        let outcome = match stopped {
            Some(signal) => Ok(stopped_by(signal)),
            None => tokio::select! {
                outcome = async {
                    let events = sb.stream(&cmd).await.explain("running the command")?;
                    crate::command::stream_to_terminal(events, "running the command").await
                } => outcome,
                // Dropping the stream closes its connection, which interrupts the command.
                signal = stop.next() => Ok(stopped_by(signal)),
            },
        };
        let deleted = sb.kill().await.explain("deleting the sandbox");
        let code = outcome?;
        deleted?;
        anyhow::Ok(code)
    }
    .await;
    if let Some((stop, handle, sandboxes)) = embedded {
        sandboxes.delete_all().await;
        let _ = stop.send(());
        let _ = handle.await;
    }
    let code = result?;
    Ok(ExitCode::from(
        u8::try_from(code.clamp(0, 255)).unwrap_or(1),
    ))
}

/// Says so, and gives the exit code a shell gives a command a signal ended (128 + its number).
fn stopped_by(signal: i32) -> i32 {
    eprintln!("warren: stopped by signal {signal}; deleting the sandbox");
    128 + signal
}

/// SIGINT (Ctrl-C), SIGTERM and SIGHUP, caught for as long as `warren run` lives: once its sandbox
/// exists it must be deleted before we exit, and a second Ctrl-C during that is ignored.
struct StopSignals {
    interrupt: Signal,
    terminate: Signal,
    hangup: Signal,
}

impl StopSignals {
    fn listen() -> anyhow::Result<Self> {
        let on = |kind| signal(kind).context("installing a signal handler");
        Ok(Self {
            interrupt: on(SignalKind::interrupt())?,
            terminate: on(SignalKind::terminate())?,
            hangup: on(SignalKind::hangup())?,
        })
    }

    /// The number of the next signal to arrive.
    async fn next(&mut self) -> i32 {
        tokio::select! {
            _ = self.interrupt.recv() => libc::SIGINT,
            _ = self.terminate.recv() => libc::SIGTERM,
            _ = self.hangup.recv() => libc::SIGHUP,
        }
    }
}

fn client_for(domain: &str, key: Option<String>) -> Client {
    let mut config = Config::new(domain);
    config.api_key = key;
    Client::new(config)
}

fn random_key() -> String {
    let mut bytes = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut bytes);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// POSIX-shell quoting so `warren run -- echo "a b"` means what it says.
pub fn shell_join(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::shell_join;

    #[test]
    fn quoting() {
        assert_eq!(
            shell_join(&["echo".into(), "a b".into(), "it's".into()]),
            "echo 'a b' 'it'\\''s'"
        );
        assert_eq!(
            shell_join(&["ls".into(), "-la".into(), "/tmp".into()]),
            "ls -la /tmp"
        );
    }
}
