//! What the egress layer tells its user, sandbox by sandbox, as it decides (the server writes it on
//! each sandbox's timeline): names asked for, connections the interception let through or refused,
//! and credentials put into requests (the binding's name, never the secret).

use std::net::SocketAddrV4;

pub trait Observer: Send + Sync + 'static {
    /// The DNS filter answered `name` for `sandbox`: allowed (forwarded upstream) or denied.
    fn name(&self, sandbox: &str, name: &str, allowed: bool);
    /// The interception decided on a connection of `sandbox`'s to `dst`.
    fn connection(&self, sandbox: &str, dst: SocketAddrV4, allowed: bool);
    /// A vault binding put its credential into a request of `sandbox`'s to `host`.
    fn injection(&self, sandbox: &str, binding: &str, host: &str);
}
