//! `warren egress …`: a sandbox's network policy (mirrors `osb egress`, plus `delete` and `set`).

use std::process::ExitCode;

use anyhow::Context;
use warren_sdk::{Client, NetworkPolicy, NetworkRule, PolicyStatus};

use crate::client::Explain;
use crate::output::{emit, Format, Table};

#[derive(clap::Subcommand)]
pub enum EgressCommand {
    /// Show a sandbox's policy.
    Get { id: String },
    /// Add or replace rules: --rule allow=pypi.org --rule deny=*.example.com (repeatable)
    ///
    /// A rule limited to TCP ports names them after `@`: --rule allow=10.0.0.5@443,8443 (an
    /// address on those ports), --rule deny=@25 (a port, to every destination).
    Patch {
        id: String,
        #[arg(long = "rule", required = true)]
        rules: Vec<String>,
    },
    /// Remove the rules for these targets.
    Delete {
        id: String,
        #[arg(required = true)]
        targets: Vec<String>,
    },
    /// Replace the whole policy: a default action and rules.
    Set {
        id: String,
        /// allow or deny.
        #[arg(long, default_value = "deny")]
        default_action: String,
        #[arg(long = "rule")]
        rules: Vec<String>,
    },
}

fn parse_rules(rules: &[String]) -> anyhow::Result<Vec<NetworkRule>> {
    rules
        .iter()
        .map(|r| {
            let (action, rest) = r.split_once('=').with_context(|| {
                format!("--rule {r:?} is not ACTION=TARGET[@PORT,…] (allow=pypi.org, allow=10.0.0.5@443, deny=@25)")
            })?;
            let (target, ports) = match rest.split_once('@') {
                None => (rest, None),
                Some((target, ports)) => (
                    target,
                    Some(
                        ports
                            .split(',')
                            .map(|p| p.trim().parse::<u16>())
                            .collect::<Result<Vec<u16>, _>>()
                            .with_context(|| format!("--rule {r:?}: ports are TCP port numbers"))?,
                    ),
                ),
            };
            let rule = match action {
                "allow" => NetworkRule::allow(target),
                "deny" => NetworkRule::deny(target),
                _ => anyhow::bail!("--rule {r:?}: the action is allow or deny"),
            };
            Ok(match ports {
                Some(ports) => rule.on_ports(ports),
                None => rule,
            })
        })
        .collect()
}

fn table(s: &PolicyStatus) -> Table {
    let mut t = Table::new(&["ACTION", "TARGET", "PORTS"]);
    for r in &s.policy.egress {
        let target = if r.target.is_empty() {
            "(every destination)".to_string()
        } else {
            r.target.clone()
        };
        let ports = r.ports.as_ref().map_or_else(
            || "all".to_string(),
            |p| p.iter().map(u16::to_string).collect::<Vec<_>>().join(","),
        );
        t.row(vec![r.action.clone(), target, ports]);
    }
    t.row(vec![
        s.policy.default_action.clone(),
        "(everything else)".to_string(),
        "all".to_string(),
    ]);
    t
}

pub async fn run(
    command: EgressCommand,
    client: &Client,
    format: Format,
) -> anyhow::Result<ExitCode> {
    let status = match command {
        EgressCommand::Get { id } => {
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            let st = sb.egress_policy().await.explain("reading the policy")?;
            st
        }
        EgressCommand::Patch { id, rules } => {
            let rules = parse_rules(&rules)?;
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            let st = sb
                .patch_egress_rules(&rules)
                .await
                .explain("changing the policy")?;
            st
        }
        EgressCommand::Delete { id, targets } => {
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            let refs: Vec<&str> = targets.iter().map(String::as_str).collect();
            let st = sb
                .delete_egress_rules(&refs)
                .await
                .explain("changing the policy")?;
            st
        }
        EgressCommand::Set {
            id,
            default_action,
            rules,
        } => {
            let policy = NetworkPolicy {
                default_action,
                egress: parse_rules(&rules)?,
            };
            let sb = client
                .connect(&id)
                .await
                .explain(&format!("sandbox {id}"))?;
            let st = sb
                .set_egress_policy(&policy)
                .await
                .explain("setting the policy")?;
            st
        }
    };
    emit(format, &status.policy, |_| table(&status))?;
    Ok(ExitCode::SUCCESS)
}
