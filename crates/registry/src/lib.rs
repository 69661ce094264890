//! Pulling images from OCI / Docker registries into Warren's image store.
//!
//! [`Client`] speaks the distribution API (per-host TLS settings, Basic and Bearer-token auth,
//! mirrors, plain HTTP only where configured); [`Puller`] turns a name into a stored image: it reads
//! the manifest (picking this host's platform from an index), skips layers the store already has,
//! streams the others straight into the store's safe unpacker while hashing them, and publishes the
//! image only when every digest matched. Concurrent pulls of one image share a single run.

mod client;
mod config;
mod error;
mod guard;
mod pull;

pub use client::Client;
pub use config::{Credentials, Endpoint, HostConfig, RegistriesConfig};
pub use error::{PullError, PullErrorKind};
pub use guard::delegated_pull_allowed;
pub use pull::{LayerInfo, PullProgress, Puller};
