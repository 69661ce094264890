//! The `warren` binary: argument parsing and wiring only; behaviour lives in the library crates.

mod audit;
mod client;
mod code;
mod command;
mod desktop;
mod egress;
mod egress_sidecar;
mod file;
mod image;
mod key;
mod output;
mod run;
mod runtimes;
mod sandbox;
mod settings;
mod shell;
mod telemetry;
mod timeline;
mod usage;
mod vault;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use warren_server::config::{self, EnvSource, ProcessEnv};

#[derive(Parser)]
#[command(
    name = "warren",
    version,
    about = "Self-hosted sandboxes for AI agents (OpenSandbox protocol)"
)]
struct Cli {
    #[command(subcommand)]
    command: Verb,
}

#[derive(Subcommand)]
enum Verb {
    /// Start the lifecycle server.
    Serve {
        /// Address to listen on [env: WARREN_LISTEN] [default: 127.0.0.1:8080]
        #[arg(long)]
        listen: Option<String>,
        /// State, images and sandboxes [env: WARREN_DATA_DIR] [default: /var/lib/warren as root]
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// TOML configuration file [env: WARREN_CONFIG]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Serve without an API key (loopback addresses only).
        #[arg(long)]
        insecure_no_auth: bool,
        /// Serve HTTPS with a development certificate made in the data dir (clients trust its
        /// tls/ca.pem), as `[tls] self_signed = true`.
        #[arg(long)]
        tls_self_signed: bool,
    },
    /// Create a sandbox, run one command in it, stream its output, delete it; exits with its code.
    Run(run::RunArgs),
    /// The egress sidecar beside a sandbox on Kubernetes (started by the Kubernetes runtime).
    #[command(name = "egress-sidecar", hide = true)]
    EgressSidecar(egress_sidecar::SidecarArgs),
    /// Run code in a sandbox's code contexts (Jupyter kernels).
    Code {
        #[command(subcommand)]
        command: code::CodeCommand,
    },
    /// Sandboxes: create, list, get, kill, pause, resume, renew, endpoint, health, metrics.
    Sandbox {
        #[command(subcommand)]
        command: sandbox::SandboxCommand,
        #[command(flatten)]
        server: client::ServerArgs,
        #[command(flatten)]
        out: output::OutputArgs,
    },
    /// Commands and bash sessions in a sandbox.
    Command {
        #[command(subcommand)]
        command: command::CommandCommand,
        #[command(flatten)]
        server: client::ServerArgs,
        #[command(flatten)]
        out: output::OutputArgs,
    },
    /// Files and directories in a sandbox.
    File {
        #[command(subcommand)]
        command: file::FileCommand,
        #[command(flatten)]
        server: client::ServerArgs,
        #[command(flatten)]
        out: output::OutputArgs,
    },
    /// An interactive terminal in a sandbox (exits with the shell's code).
    Shell {
        #[command(flatten)]
        args: shell::ShellArgs,
        #[command(flatten)]
        server: client::ServerArgs,
    },
    /// An MCP server with tools for sandboxes, commands, files and code (stdio or streamable HTTP).
    Mcp {
        #[command(flatten)]
        args: warren_mcp::McpArgs,
        #[command(flatten)]
        server: client::ServerArgs,
    },
    /// A sandbox's network policy: what it may reach.
    Egress {
        #[command(subcommand)]
        command: egress::EgressCommand,
        #[command(flatten)]
        server: client::ServerArgs,
        #[command(flatten)]
        out: output::OutputArgs,
    },
    /// A sandbox's desktop (made with `extensions.desktop`): screenshots, mouse, keyboard, windows.
    Desktop {
        #[command(subcommand)]
        command: desktop::DesktopCommand,
        #[command(flatten)]
        server: client::ServerArgs,
        #[command(flatten)]
        out: output::OutputArgs,
    },
    /// What the key's tenant uses and may use: sandboxes, CPU, memory, creates, snapshot storage.
    Usage {
        /// Another tenant's (admin keys only)
        #[arg(long)]
        tenant: Option<String>,
        #[command(flatten)]
        server: client::ServerArgs,
        #[command(flatten)]
        out: output::OutputArgs,
    },
    /// A sandbox's credential vault (with credentialProxy enabled): secrets injected on the wire.
    #[command(name = "credential-vault")]
    CredentialVault {
        #[command(subcommand)]
        command: vault::VaultCommand,
        #[command(flatten)]
        server: client::ServerArgs,
        #[command(flatten)]
        out: output::OutputArgs,
    },
    /// The CLI's own settings (server, key, output format, defaults).
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Print a shell completion script: warren completions bash > /etc/bash_completion.d/warren
    Completions { shell: clap_complete::Shell },
    /// The audit log in the data dir: who changed what, and what the proxy took.
    Audit {
        #[command(flatten)]
        args: audit::AuditArgs,
        /// State, images and sandboxes [env: WARREN_DATA_DIR]
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Tenants' API keys in the data dir: create, ls, revoke, rotate.
    Key {
        #[command(subcommand)]
        command: key::KeyCommand,
        /// State, images and sandboxes [env: WARREN_DATA_DIR]
        #[arg(long, global = true)]
        data_dir: Option<PathBuf>,
    },
    /// Manage the local image store.
    Image {
        #[command(subcommand)]
        command: image::ImageCommand,
        /// State, images and sandboxes [env: WARREN_DATA_DIR]
        #[arg(long, global = true)]
        data_dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Write a settings file with the defaults (--force to overwrite one).
    Init {
        #[arg(long)]
        force: bool,
    },
    /// Set one key: connection.domain, connection.api_key, connection.request_timeout,
    /// output.format, defaults.image, defaults.timeout.
    Set { key: String, value: String },
    /// Print the settings (the key hidden) and where they are.
    Show,
}

/// The settings file, a client of the server they (with the flags and environment) name, and the
/// output format: what every verb that talks to a server starts from.
fn remote(
    server: &client::ServerArgs,
    out: &output::OutputArgs,
) -> anyhow::Result<(settings::Settings, warren_sdk::Client, output::Format)> {
    let settings = settings::Settings::load()?;
    let client = server.client_with(&settings);
    let format = out.output.or(settings.output.format).unwrap_or_default();
    Ok((settings, client, format))
}

fn main() -> ExitCode {
    // Modes below the data dir are Warren's to decide, not the invoking shell's: a sandbox folder's
    // `upper` is the sandbox's `/`, and under a hardened root's umask (077, say) it was made 0700,
    // so no user but root in the sandbox could run anything. Nothing is exposed by 022: the data
    // dir itself is kept 0700. Set before the setup helpers and the zygote start (they inherit it).
    // SAFETY: umask(2) only swaps the process's file-creation mask.
    unsafe { libc::umask(0o022) };
    // The sandbox setup helper must run before any thread exists: dispatch before parsing or starting
    // a runtime.
    match std::env::args().nth(1).as_deref() {
        Some(warren_runtime_native::INIT_SUBCOMMAND) => warren_runtime_native::init::main(),
        Some(warren_runtime_native::zygote::ZYGOTE_SUBCOMMAND) => {
            warren_runtime_native::zygote::main()
        }
        _ => {}
    }
    let cli = Cli::parse();
    // Traces are the server's: a client verb exports none.
    let _telemetry = telemetry::init(matches!(cli.command, Verb::Serve { .. }));
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("warren: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Verb::Serve {
            listen,
            data_dir,
            config: config_file,
            insecure_no_auth,
            tls_self_signed,
        } => {
            let overrides = config::Overrides {
                listen,
                data_dir,
                config: config_file,
                insecure_no_auth,
                tls_self_signed,
            };
            let cfg = warren_server::ServerConfig::load(&overrides, &ProcessEnv)?;
            runtimes::check_sections(&cfg.docker, &cfg.kubernetes, cfg.config_file.as_deref())?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(serve(cfg))?;
            Ok(ExitCode::SUCCESS)
        }
        Verb::EgressSidecar(args) => egress_sidecar::run(args),
        Verb::Run(args) => {
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(run::run(args))
        }
        Verb::Code { command } => {
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(code::run(command))
        }
        Verb::Sandbox {
            command,
            server,
            out,
        } => {
            let (settings, client, format) = remote(&server, &out)?;
            tokio::runtime::Runtime::new()?
                .block_on(sandbox::run(command, &client, &settings, format))
        }
        Verb::Command {
            command,
            server,
            out,
        } => {
            let (_, client, format) = remote(&server, &out)?;
            tokio::runtime::Runtime::new()?.block_on(command::run(command, &client, format))
        }
        Verb::File {
            command,
            server,
            out,
        } => {
            let (_, client, format) = remote(&server, &out)?;
            tokio::runtime::Runtime::new()?.block_on(file::run(command, &client, format))
        }
        Verb::Shell { args, server } => {
            let client = server.client()?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(shell::run(args, &client))
        }
        Verb::Mcp { args, server } => {
            let client = server.client()?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(warren_mcp::run(args, client))?;
            Ok(ExitCode::SUCCESS)
        }
        Verb::Egress {
            command,
            server,
            out,
        } => {
            let (_, client, format) = remote(&server, &out)?;
            tokio::runtime::Runtime::new()?.block_on(egress::run(command, &client, format))
        }
        Verb::Desktop {
            command,
            server,
            out,
        } => {
            let (_, client, format) = remote(&server, &out)?;
            tokio::runtime::Runtime::new()?.block_on(desktop::run(command, &client, format))
        }
        Verb::Usage {
            tenant,
            server,
            out,
        } => {
            let (_, client, format) = remote(&server, &out)?;
            tokio::runtime::Runtime::new()?.block_on(usage::run(tenant.as_deref(), &client, format))
        }
        Verb::CredentialVault {
            command,
            server,
            out,
        } => {
            let (_, client, format) = remote(&server, &out)?;
            tokio::runtime::Runtime::new()?.block_on(vault::run(command, &client, format))
        }
        Verb::Config { command } => {
            match command {
                ConfigCommand::Init { force } => {
                    let path = settings::path();
                    if path.exists() && !force {
                        anyhow::bail!("{} exists (hint: --force to overwrite it)", path.display());
                    }
                    let mut s = settings::Settings::default();
                    s.connection.domain = Some(config::DEFAULT_LISTEN.into());
                    s.output.format = Some(output::Format::Table);
                    s.defaults.image = Some("host".into());
                    s.defaults.timeout = Some(600);
                    println!("wrote {}", s.save()?.display());
                }
                ConfigCommand::Set { key, value } => {
                    let mut s = settings::Settings::load()?;
                    s.set(&key, &value)?;
                    println!("{key} set in {}", s.save()?.display());
                }
                ConfigCommand::Show => {
                    let s = settings::Settings::load()?;
                    println!("# {}", settings::path().display());
                    print!("{}", toml::to_string_pretty(&s.redacted())?);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Verb::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "warren", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Verb::Audit { args, data_dir } => audit::run(args, &local_data_dir(data_dir)),
        Verb::Key { command, data_dir } => key::run(command, &local_data_dir(data_dir)),
        Verb::Image { command, data_dir } => image::run(command, &local_data_dir(data_dir)),
    }
}

/// The data dir a local command works on: `--data-dir`, else `WARREN_DATA_DIR`, else the default.
fn local_data_dir(given: Option<PathBuf>) -> PathBuf {
    given
        .or_else(|| {
            ProcessEnv
                .get(warren_env::EnvVars::WARREN_DATA_DIR)
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| config::default_data_dir(&ProcessEnv))
}

async fn serve(cfg: warren_server::ServerConfig) -> anyhow::Result<()> {
    let server = warren_server::Server::bind(cfg, runtimes::make_runtime).await?;
    eprintln!(
        "warren: listening on {}://{} (runtime {})",
        if server.state.tls.is_some() {
            "https"
        } else {
            "http"
        },
        server.local_addr(),
        server.state.sandboxes.runtime().name()
    );
    server
        .run(async {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
            // SIGHUP is not a stop: the server reads its certificate and signing keys again
            // (and so outlives the terminal it was started from, as a daemon does).
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
            eprintln!("warren: shutting down; sandboxes keep running and are re-adopted at the next start");
        })
        .await
}

fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < units.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    /// clap checks the whole command tree (clashing flags, bad defaults) only when asked: a
    /// clash would otherwise be a panic at run time, in the one verb that has it.
    #[test]
    fn the_command_tree_is_sound() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
