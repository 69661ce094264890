//! `warren egress-sidecar`: the container beside a sandbox that holds its egress policy in the
//! network namespace they share (a Kubernetes Pod's; see `warren_egress::sidecar`). The Kubernetes
//! runtime writes its command line; nobody runs it by hand.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use warren_egress::sidecar::{resolv_conf_upstream, Sidecar, SidecarConfig};
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
    /// Where the policy in force is kept, so a restarted sidecar starts from the latest one, not
    /// from `--policy`.
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
    // A restart resumes the latest policy pushed, never an older, wider one.
    let kept = args
        .state_file
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok());
    let policy = match &kept {
        Some(text) => parse_policy(text).context("the kept policy")?,
        None => parse_policy(&args.policy).context("--policy")?,
    };
    let upstream = args
        .dns_upstream
        .or_else(resolv_conf_upstream)
        .context("no DNS upstream: --dns-upstream, or a nameserver in /etc/resolv.conf")?;
    let cfg = SidecarConfig {
        listen: args.listen,
        verifier,
        upstream,
        inbound_ports: args.inbound_ports,
        policy,
        state_file: args.state_file,
    };
    tokio::runtime::Runtime::new()?.block_on(Sidecar::run(cfg))?;
    Ok(ExitCode::SUCCESS)
}
