//! An async Rust client for Warren — and for any server speaking the OpenSandbox Sandbox Protocol.
//!
//! A [`Client`] talks to the lifecycle API; [`Client::create`] and [`Client::connect`] give a
//! [`Sandbox`] handle whose methods reach execd inside the sandbox through the server's endpoint
//! proxy: commands as a stream of events ([`Sandbox::stream`]) or collected ([`Sandbox::run`]),
//! background commands, bash sessions, interactive terminals over WebSocket, files with streaming
//! upload and download, code contexts, the sandbox's egress policy and its credential vault.
//!
//! ```no_run
//! use warren_sdk::{Client, CreateSandboxRequest, ImageSpec};
//!
//! # async fn demo() -> warren_sdk::Result<()> {
//! // OPEN_SANDBOX_DOMAIN / OPEN_SANDBOX_API_KEY, or the key of a server on this machine.
//! let client = Client::from_env();
//! let sandbox = client
//!     .create(&CreateSandboxRequest {
//!         image: Some(ImageSpec { uri: "host".into(), auth: None }),
//!         timeout: Some(600),
//!         ..Default::default()
//!     })
//!     .await?;
//! let out = sandbox.run("echo hello from $(hostname)").await?;
//! assert_eq!(out.exit_code, 0);
//! sandbox.write("/tmp/data.txt", "42\n").await?;
//! assert_eq!(sandbox.read_to_string("/tmp/data.txt").await?, "42\n");
//! sandbox.kill().await?;
//! # Ok(())
//! # }
//! ```
//!
//! Streaming a command's output as it happens:
//!
//! ```no_run
//! use futures::StreamExt;
//! use warren_sdk::{EventKind, RunCommandRequest, Sandbox};
//!
//! # async fn demo(sandbox: Sandbox) -> warren_sdk::Result<()> {
//! let mut events = sandbox
//!     .stream(&RunCommandRequest { command: Some("for i in 1 2 3; do echo $i; sleep 1; done".into()), ..Default::default() })
//!     .await?;
//! while let Some(ev) = events.next().await {
//!     let ev = ev?;
//!     if ev.kind == EventKind::Stdout {
//!         print!("{}", ev.text.unwrap_or_default());
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! `examples/quickstart.rs` is a complete program; the CLI's integration tests run it against a real
//! server.

mod client;
mod code;
mod commands;
mod desktop;
mod egress;
mod error;
mod files;
mod pty;
mod sandbox;
mod stream;
mod timeline;
mod vault;

pub use client::{Client, Config, ListQuery};
pub use code::CodeTarget;
pub use commands::{Logs, Session};
pub use desktop::Region;
pub use egress::{NetworkPolicy, NetworkRule, PolicyStatus};
pub use error::{Error, Result};
pub use files::{ByteStream, Ownership};
pub use pty::{Pty, PtyEvent, PtyOptions, PtyReader, PtyStatus, PtyWriter};
pub use sandbox::Sandbox;
pub use stream::{EventStream, Output};
pub use timeline::Timeline;
pub use vault::{BindingMeta, CredentialMeta, VaultState};

pub use warren_api::execd::{
    CodeContext, CommandStatus, EventKind, ExecError, FileInfo, Metrics, RunCommandRequest,
    StreamEvent,
};
pub use warren_api::lifecycle::{
    CreateSandboxRequest, Endpoint, ImageSpec, ListSandboxesResponse, Sandbox as SandboxInfo,
    SandboxState,
};
