//! `warren egress-sidecar`: the container beside a sandbox that holds its egress policy in the
//! network namespace they share (a Kubernetes Pod's; see `warren_egress::sidecar`). The Kubernetes
//! runtime writes its command line; nobody runs it by hand.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use warren_egress::sidecar::{resolv_conf_upstream, Kept, Sidecar, SidecarConfig};
use warren_egress::NetworkPolicy;

#[derive(clap::Args)]
pub struct SidecarArgs {
    /// The control port's address.
    #[arg(long)]
    listen: SocketAddr,
    /// SHA-256 (hex) of the credential the control port accepts (execd's).
    #[arg(long = "access-token-sha256")]
    verifier: String,
    /// A port whose answers to connections made to the Pod may leave (execd's); repeatable.
    #[arg(long = "inbound-port")]
    inbound_ports: Vec<u16>,
    /// The policy in force at start, as the protocol writes it.
    #[arg(long)]
    policy: String,
    /// Where the policy in force and the DNS upstream are kept, so a restarted sidecar starts from
    /// them, not from `--policy` and resolv.conf.
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Where allowed DNS queries go; default: the first nameserver of /etc/resolv.conf.
    #[arg(long)]
    dns_upstream: Option<SocketAddr>,
}

fn parse_policy(text: &str) -> anyhow::Result<NetworkPolicy> {
    let value: serde_json::Value = serde_json::from_str(text).context("the policy is not JSON")?;
    Ok(NetworkPolicy::from_json(&value)?.unwrap_or_else(NetworkPolicy::deny_all))
}

pub fn run(args: SidecarArgs) -> anyhow::Result<ExitCode> {
    let digest = hex::decode(args.verifier.trim()).context("--access-token-sha256 is not hex")?;
    let verifier: [u8; 32] = digest
        .try_into()
        .map_err(|_| anyhow::anyhow!("--access-token-sha256 is not 64 hex digits"))?;
    let kept = starting_point(&args)?;
    let cfg = SidecarConfig {
        listen: args.listen,
        verifier,
        upstream: kept.upstream,
        inbound_ports: args.inbound_ports,
        policy: kept.policy,
        state_file: args.state_file,
    };
    tokio::runtime::Runtime::new()?.block_on(Sidecar::run(cfg))?;
    Ok(ExitCode::SUCCESS)
}

/// What the sidecar starts with: what it kept, when it ran before in this Pod (the latest policy,
/// never the older one of its command line; the upstream it found then, never resolv.conf again,
/// which the sandbox may have written since); else its command line and resolv.conf, kept at once.
fn starting_point(args: &SidecarArgs) -> anyhow::Result<Kept> {
    if let Some(file) = &args.state_file {
        // A file that cannot be read stops the sidecar (the rules in force stay): never a fallback.
        if let Some(kept) = Kept::load(file).with_context(|| format!("{}", file.display()))? {
            return Ok(kept);
        }
    }
    let kept = Kept {
        policy: parse_policy(&args.policy).context("--policy")?,
        upstream: args
            .dns_upstream
            .or_else(resolv_conf_upstream)
            .context("no DNS upstream: --dns-upstream, or a nameserver in /etc/resolv.conf")?,
    };
    if let Some(file) = &args.state_file {
        kept.save(file)
            .with_context(|| format!("keeping the starting point in {}", file.display()))?;
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: SidecarArgs,
    }

    fn args(dir: &std::path::Path, policy: &str, upstream: &str) -> SidecarArgs {
        Cli::parse_from([
            "x",
            "--listen",
            "127.0.0.1:44774",
            "--access-token-sha256",
            &"ab".repeat(32),
            "--policy",
            policy,
            "--dns-upstream",
            upstream,
            "--state-file",
            dir.join("state.json").to_str().expect("utf-8"),
        ])
        .args
    }

    #[test]
    fn a_restart_resumes_what_was_kept_not_its_command_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let wide = r#"{"defaultAction": "allow", "egress": []}"#;
        let first = starting_point(&args(dir.path(), wide, "10.96.0.10:53")).expect("first");
        assert_eq!(first.upstream, "10.96.0.10:53".parse().expect("addr"));
        // Narrowed since (what `set_policy` keeps), and the upstream it found is kept: a restart
        // takes neither the wide policy nor another upstream.
        Kept {
            policy: NetworkPolicy::deny_all(),
            upstream: first.upstream,
        }
        .save(&dir.path().join("state.json"))
        .expect("save");
        let again = starting_point(&args(dir.path(), wide, "127.0.0.1:53")).expect("again");
        assert_eq!(again.policy, NetworkPolicy::deny_all());
        assert_eq!(again.upstream, first.upstream);
        // A damaged file stops it rather than falling back.
        std::fs::write(dir.path().join("state.json"), "{").expect("write");
        assert!(starting_point(&args(dir.path(), wide, "127.0.0.1:53")).is_err());
    }
}
