//! The HTTP layer, over the registry: the router and its middleware, the routes, auth and the
//! audit middleware, the endpoint proxy with signed and host endpoints, TLS and the front door,
//! the API's documents, and the edge where a [`crate::error::SandboxError`] becomes a response.
//! Nothing below it imports it.

pub mod admin;
pub mod audit;
pub mod auth;
pub mod diagnostics;
pub mod docs;
pub mod error;
pub mod front;
pub mod metrics;
pub mod openapi;
pub mod policy;
pub mod proxy;
pub mod recorder;
pub mod router;
pub mod routes;
pub mod signed;
pub mod state;
pub mod tls;

pub use router::router;
pub use state::AppState;
