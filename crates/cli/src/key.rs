//! `warren key`: tenants' API keys in a server's data dir — create, list, revoke, rotate. Works on
//! the key store directly, whether or not a server runs on it: a server sees each change on its
//! next request (see `warren_server::keys`). A key's text is printed once, when it is made or
//! rotated, and kept nowhere.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use warren_api::admin::{IssuedKey, KeyInfo};
use warren_server::keys::{KeyStore, Role};

use crate::output::{self, or_dash, OutputArgs};

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Make a key for TENANT (its text is printed this once).
    Create {
        tenant: String,
        /// admin (every tenant, and keys), full (its tenant's everything) or read-only.
        #[arg(long, default_value = "full")]
        role: String,
        /// A label to tell keys apart.
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// List the keys (never their secrets), revoked ones too.
    Ls {
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Revoke keys by id: they stop working at once.
    Revoke {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Give key ID a new secret (same tenant and role); the old text stops working at once.
    Rotate {
        id: String,
        #[command(flatten)]
        out: OutputArgs,
    },
}

fn issued(out: &OutputArgs, key: &IssuedKey) -> anyhow::Result<()> {
    output::emit(out.output.unwrap_or_default(), key, |k| {
        output::Table::pairs(vec![
            ("id", k.info.id.clone()),
            ("tenant", k.info.tenant.clone()),
            ("role", k.info.role.clone()),
            ("key", k.key.clone()),
        ])
    })?;
    eprintln!("warren: the key is shown this once; it is not stored");
    Ok(())
}

pub fn run(command: KeyCommand, data_dir: &Path) -> anyhow::Result<ExitCode> {
    if warren_server::keys::is_shared(data_dir) {
        anyhow::bail!(
            "the server on {} is a replica: its keys are the replicas' shared store, not this data dir's; use the admin API (/v1/admin/keys)",
            data_dir.display()
        );
    }
    let store = KeyStore::open(data_dir);
    match command {
        KeyCommand::Create {
            tenant,
            role,
            name,
            out,
        } => {
            let role = Role::parse(&role).map_err(anyhow::Error::msg)?;
            let (entry, key) = store
                .create(&tenant, role, name)
                .context("creating the key")?;
            issued(&out, &entry.issued(key))?;
        }
        KeyCommand::Ls { tenant, out } => {
            let keys: Vec<KeyInfo> = store
                .list()
                .iter()
                .filter(|k| tenant.as_ref().is_none_or(|t| &k.tenant == t))
                .map(|k| k.to_wire())
                .collect();
            output::emit(out.output.unwrap_or_default(), &keys, |keys| {
                let mut t =
                    output::Table::new(&["ID", "TENANT", "ROLE", "NAME", "CREATED", "REVOKED"]);
                for k in keys {
                    t.row(vec![
                        k.id.clone(),
                        k.tenant.clone(),
                        k.role.clone(),
                        or_dash(k.name.as_deref()),
                        k.created_at.clone(),
                        or_dash(k.revoked_at.as_deref()),
                    ]);
                }
                t
            })?;
        }
        KeyCommand::Revoke { ids } => {
            for id in ids {
                let k = store
                    .revoke(&id)
                    .with_context(|| format!("revoking {id}"))?;
                println!("revoked {} (tenant {})", k.id, k.tenant);
            }
        }
        KeyCommand::Rotate { id, out } => {
            let (entry, key) = store
                .rotate(&id)
                .with_context(|| format!("rotating {id}"))?;
            issued(&out, &entry.issued(key))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
