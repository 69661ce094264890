//! Egress control for sandboxes, enforced outside them: the policy model, a DNS filter that answers
//! for the sandbox (denied names get NXDOMAIN and never leave the host), and nftables rules that let
//! a sandbox reach only addresses learned from allowed answers or allowed CIDRs.

pub mod dns;
pub mod forwarding;
pub mod manager;
pub mod metrics;
pub mod mitm;
pub mod nft;
pub mod observe;
pub mod policy;
pub mod sidecar;
pub mod vault;

pub use manager::{Egress, EgressConfig, EgressError, Link};
pub use observe::Observer;
pub use policy::{Action, NetworkPolicy, NetworkRule, PolicyError, Target};
