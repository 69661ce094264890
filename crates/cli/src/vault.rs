//! `warren credential-vault …`: a sandbox's credential vault (mirrors `osb credential-vault`). Bodies
//! come from a JSON file (`--file`, `-` for stdin) so secrets never sit on a command line.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use warren_sdk::{Client, VaultState};

use crate::client::Explain;
use crate::output::{emit, Format, Table};

#[derive(clap::Subcommand)]
pub enum VaultCommand {
    /// Create (or replace) the vault from a JSON file: {"credentials": [...], "bindings": [...]}.
    Create {
        id: String,
        #[arg(long)]
        file: PathBuf,
    },
    /// Show the vault (names, types and revisions; never a value).
    Get { id: String },
    /// Apply a JSON patch file: {"expectedRevision"?, "credentials": {add, replace, delete}, "bindings": {...}}.
    Patch {
        id: String,
        #[arg(long)]
        file: PathBuf,
    },
    /// Delete the vault (nothing is injected any more).
    Delete { id: String },
}

fn read_body(file: &PathBuf) -> anyhow::Result<serde_json::Value> {
    let text = if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading stdin")?;
        s
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?
    };
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))
}

fn table(v: &VaultState) -> Table {
    let mut t = Table::new(&["KIND", "NAME", "DETAIL", "REVISION"]);
    for c in &v.credentials {
        t.row(vec![
            "credential".into(),
            c.name.clone(),
            c.source_type.clone(),
            c.revision.to_string(),
        ]);
    }
    for b in &v.bindings {
        let hosts = b.matcher["hosts"].as_array().map(|h| {
            h.iter()
                .filter_map(|x| x.as_str())
                .collect::<Vec<_>>()
                .join(",")
        });
        t.row(vec![
            "binding".into(),
            b.name.clone(),
            format!(
                "{} on {}",
                b.auth["type"].as_str().unwrap_or("?"),
                hosts.unwrap_or_default()
            ),
            b.revision.to_string(),
        ]);
    }
    t
}

fn state_json(v: &VaultState) -> serde_json::Value {
    serde_json::json!({
        "revision": v.revision,
        "credentials": v.credentials.iter().map(|c| serde_json::json!({"name": c.name, "sourceType": c.source_type, "revision": c.revision})).collect::<Vec<_>>(),
        "bindings": v.bindings.iter().map(|b| serde_json::json!({"name": b.name, "revision": b.revision, "match": b.matcher, "auth": b.auth})).collect::<Vec<_>>(),
    })
}

pub async fn run(
    command: VaultCommand,
    client: &Client,
    format: Format,
) -> anyhow::Result<ExitCode> {
    let state = match command {
        VaultCommand::Create { id, file } => {
            let body = read_body(&file)?;
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            sb.create_vault(&body).await.explain("creating the vault")?
        }
        VaultCommand::Get { id } => {
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            sb.vault().await.explain("reading the vault")?
        }
        VaultCommand::Patch { id, file } => {
            let body = read_body(&file)?;
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            sb.patch_vault(&body).await.explain("patching the vault")?
        }
        VaultCommand::Delete { id } => {
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            sb.delete_vault().await.explain("deleting the vault")?;
            println!("deleted the vault of {id}");
            return Ok(ExitCode::SUCCESS);
        }
    };
    emit(format, &state_json(&state), |_| table(&state))?;
    Ok(ExitCode::SUCCESS)
}
