//! Integration tests: each test starts the real `warren-execd` binary (as an ordinary process, not PID 1)
//! on a temp Unix socket and a loopback port, with a temp workdir, and drives it over HTTP.

mod commands;
mod files;
mod lifecycle;
mod proxy;
mod sessions;
mod spare;
mod support;
