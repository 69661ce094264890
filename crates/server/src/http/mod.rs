//! The HTTP layer: what turns requests into calls on the registry and its answers into responses.

pub mod error;
