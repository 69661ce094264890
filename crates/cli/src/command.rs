//! `warren command …`: commands and bash sessions in a running sandbox, mirroring `osb command`.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use futures::StreamExt;
use warren_sdk::{Client, EventKind, EventStream, RunCommandRequest, Sandbox};

use crate::client::{env_map, Explain};
use crate::output::{emit, or_dash, Format, Table};

#[derive(clap::Subcommand)]
pub enum CommandCommand {
    /// Run a command; streams its output and exits with its exit code (or prints the id with
    /// --background).
    Run {
        id: String,
        /// The command; one argument is run by bash as is, several are quoted and joined.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
        #[arg(long)]
        background: bool,
        #[arg(long, short = 'w')]
        workdir: Option<String>,
        /// Seconds before the command is killed.
        #[arg(long)]
        timeout: Option<f64>,
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
    },
    /// Whether a background command is running, and its exit code.
    Status { id: String, execution: String },
    /// Output of a background command.
    Logs {
        id: String,
        execution: String,
        /// Only output after this byte offset (the cursor a previous call printed on stderr).
        #[arg(long)]
        cursor: Option<u64>,
    },
    /// Interrupt a command (its whole process group).
    Interrupt { id: String, execution: String },
    /// Persistent bash sessions.
    Session {
        #[command(subcommand)]
        command: SessionCommand,
    },
}

#[derive(clap::Subcommand)]
pub enum SessionCommand {
    /// Start a bash whose state (cwd, variables) survives between runs; prints its id.
    Create {
        id: String,
        #[arg(long, short = 'w')]
        workdir: Option<String>,
    },
    /// Run a command in a session.
    Run {
        id: String,
        session: String,
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
        #[arg(long)]
        timeout: Option<f64>,
    },
    /// End a session.
    Delete { id: String, session: String },
}

/// Copies a stream's output to ours as it arrives; returns the exit code.
pub async fn stream_to_terminal(mut events: EventStream, what: &str) -> anyhow::Result<i32> {
    let mut output = warren_sdk::Output::default();
    while let Some(ev) = events.next().await {
        let ev = ev.explain(what)?;
        match ev.kind {
            EventKind::Stdout => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(ev.text.as_deref().unwrap_or_default().as_bytes());
                let _ = out.flush();
            }
            EventKind::Stderr => {
                let mut err = std::io::stderr().lock();
                let _ = err.write_all(ev.text.as_deref().unwrap_or_default().as_bytes());
            }
            // An error that is not an exit code: the command could not run at all.
            EventKind::Error => {
                if let Some(e) = ev
                    .error
                    .as_ref()
                    .filter(|e| e.evalue.parse::<i32>().is_err())
                {
                    eprintln!("warren: {}: {}", e.ename, e.evalue);
                }
            }
            _ => {}
        }
        if output.absorb(&ev) {
            return Ok(output.exit_code);
        }
    }
    anyhow::bail!("{what}: the output ended without a result; the sandbox may have ended meanwhile")
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}

/// One argument is a shell command as is; several are quoted so they mean what they say.
pub fn command_line(args: &[String]) -> String {
    if args.len() == 1 {
        args[0].clone()
    } else {
        crate::run::shell_join(args)
    }
}

async fn connect(client: &Client, id: &str) -> anyhow::Result<Sandbox> {
    client.connect(id).await.explain(&format!("sandbox {id}"))
}

pub async fn run(
    command: CommandCommand,
    client: &Client,
    format: Format,
) -> anyhow::Result<ExitCode> {
    match command {
        CommandCommand::Run {
            id,
            command,
            background,
            workdir,
            timeout,
            env,
        } => {
            let sb = connect(client, &id).await?;
            let req = RunCommandRequest {
                command: Some(command_line(&command)),
                cwd: workdir,
                background,
                timeout: timeout.map(|s| (s * 1000.0).max(1.0) as u64),
                envs: if env.is_empty() {
                    None
                } else {
                    Some(env_map(&env)?)
                },
                ..Default::default()
            };
            if background {
                let exec = sb.spawn(&req).await.explain("starting the command")?;
                emit(format, &serde_json::json!({ "id": exec }), |_| {
                    Table::pairs(vec![("EXECUTION", exec.clone())])
                })?;
                return Ok(ExitCode::SUCCESS);
            }
            let events = sb.stream(&req).await.explain("running the command")?;
            Ok(exit(
                stream_to_terminal(events, "running the command").await?,
            ))
        }
        CommandCommand::Status { id, execution } => {
            let sb = connect(client, &id).await?;
            let st = sb
                .status(&execution)
                .await
                .explain(&format!("command {execution}"))?;
            emit(format, &st, |st| {
                Table::pairs(vec![
                    ("EXECUTION", st.id.clone()),
                    ("COMMAND", st.content.clone()),
                    ("RUNNING", st.running.to_string()),
                    (
                        "EXIT CODE",
                        or_dash(st.exit_code.map(|c| c.to_string()).as_deref()),
                    ),
                    ("ERROR", or_dash(st.error.as_deref())),
                    ("STARTED", st.started_at.clone()),
                    ("FINISHED", or_dash(st.finished_at.as_deref())),
                ])
            })?;
            Ok(ExitCode::SUCCESS)
        }
        CommandCommand::Logs {
            id,
            execution,
            cursor,
        } => {
            let sb = connect(client, &id).await?;
            let logs = sb
                .logs(&execution, cursor)
                .await
                .explain(&format!("command {execution}"))?;
            match format {
                Format::Table => {
                    print!("{}", logs.text);
                    if let Some(c) = logs.cursor {
                        eprintln!("[cursor {c}]");
                    }
                }
                _ => emit(
                    format,
                    &serde_json::json!({ "output": logs.text, "cursor": logs.cursor }),
                    |_| Table::new(&[]),
                )?,
            }
            Ok(ExitCode::SUCCESS)
        }
        CommandCommand::Interrupt { id, execution } => {
            let sb = connect(client, &id).await?;
            sb.interrupt(&execution)
                .await
                .explain(&format!("interrupting command {execution}"))?;
            println!("interrupted {execution}");
            Ok(ExitCode::SUCCESS)
        }
        CommandCommand::Session { command } => match command {
            SessionCommand::Create { id, workdir } => {
                let sb = connect(client, &id).await?;
                let s = sb
                    .session(workdir.as_deref())
                    .await
                    .explain("starting a session")?;
                emit(format, &serde_json::json!({ "session_id": s.id() }), |_| {
                    Table::pairs(vec![("SESSION", s.id().to_string())])
                })?;
                Ok(ExitCode::SUCCESS)
            }
            SessionCommand::Run {
                id,
                session,
                command,
                timeout,
            } => {
                let sb = connect(client, &id).await?;
                let s = sb.attach_session(&session);
                let events = s
                    .stream(
                        &command_line(&command),
                        timeout.map(|t| (t * 1000.0).max(1.0) as u64),
                    )
                    .await
                    .explain(&format!("session {session}"))?;
                Ok(exit(
                    stream_to_terminal(events, "running the command").await?,
                ))
            }
            SessionCommand::Delete { id, session } => {
                let sb = connect(client, &id).await?;
                sb.attach_session(&session)
                    .close()
                    .await
                    .explain(&format!("session {session}"))
                    .context("ending the session")?;
                println!("deleted {session}");
                Ok(ExitCode::SUCCESS)
            }
        },
    }
}
