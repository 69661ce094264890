//! Every environment variable Warren's programs read, with what it means and its default, and the
//! only functions in the workspace that read the environment. `clippy.toml` forbids
//! `std::env::var` and its kin everywhere else, so a variable cannot be read without being named
//! here, and this file is the whole list an operator or a reviewer needs.
//!
//! Values are read as they are; an empty value counts as unset for [`var`], since a variable set
//! to nothing in a unit file or a `docker run -e` most often means "not configured".

#![allow(clippy::disallowed_methods)]

use std::ffi::OsString;

/// The names, one constant each. Grouped by who reads them.
pub struct EnvVars;

impl EnvVars {
    // ---- `warren serve` (beneath `--flags`, over the TOML file) ----
    /// The API's listen address (default `127.0.0.1:8080`).
    pub const WARREN_LISTEN: &'static str = "WARREN_LISTEN";
    /// The data dir (default `/var/lib/warren` for root, else `$XDG_DATA_HOME/warren`, else
    /// `~/.local/share/warren`).
    pub const WARREN_DATA_DIR: &'static str = "WARREN_DATA_DIR";
    /// The API key; unset: the TOML file's, else one generated into `<data_dir>/api-key`. Clients
    /// (CLI, Rust SDK) read it too, after `OPEN_SANDBOX_API_KEY`.
    pub const WARREN_API_KEY: &'static str = "WARREN_API_KEY";
    /// The TOML config file (default: none).
    pub const WARREN_CONFIG: &'static str = "WARREN_CONFIG";
    /// The execd binary put in sandboxes (default: the one built into `warren`).
    pub const WARREN_EXECD_PATH: &'static str = "WARREN_EXECD_PATH";
    /// The log filter, as `RUST_LOG` (default `info`).
    pub const WARREN_LOG: &'static str = "WARREN_LOG";
    /// `json`: log lines as JSON objects (one per line, with the span's fields such as the
    /// request id); default: text.
    pub const WARREN_LOG_FORMAT: &'static str = "WARREN_LOG_FORMAT";
    /// Where `warren serve` sends its traces over OTLP/HTTP (`http://collector:4318`; `/v1/traces`
    /// is added); unset (and no `..._TRACES_ENDPOINT`): no traces, at no cost. The OpenTelemetry
    /// SDK reads these itself, with its other `OTEL_*` settings (`OTEL_BSP_SCHEDULE_DELAY`, …).
    pub const OTEL_EXPORTER_OTLP_ENDPOINT: &'static str = "OTEL_EXPORTER_OTLP_ENDPOINT";
    /// The traces' own URL, used as it is.
    pub const OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: &'static str =
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
    /// `http/protobuf` (default) or `http/json`; gRPC is not built in.
    pub const OTEL_EXPORTER_OTLP_PROTOCOL: &'static str = "OTEL_EXPORTER_OTLP_PROTOCOL";
    /// The traces' `service.name` (default `warren`).
    pub const OTEL_SERVICE_NAME: &'static str = "OTEL_SERVICE_NAME";
    /// `0`: the zygote keeps its text file-backed instead of moving it onto huge pages.
    pub const WARREN_HUGE_TEXT: &'static str = "WARREN_HUGE_TEXT";

    // ---- clients: the CLI and the Rust SDK, as the official SDKs ----
    /// The server's address (default `127.0.0.1:8080`).
    pub const OPEN_SANDBOX_DOMAIN: &'static str = "OPEN_SANDBOX_DOMAIN";
    /// The API key (else `WARREN_API_KEY`, else the key a local server generated).
    pub const OPEN_SANDBOX_API_KEY: &'static str = "OPEN_SANDBOX_API_KEY";
    /// The CLI's settings file (default `$XDG_CONFIG_HOME/warren/cli.toml`).
    pub const WARREN_CLI_CONFIG: &'static str = "WARREN_CLI_CONFIG";

    // ---- the platform's own ----
    pub const HOME: &'static str = "HOME";
    pub const PATH: &'static str = "PATH";
    pub const XDG_DATA_HOME: &'static str = "XDG_DATA_HOME";
    pub const XDG_CONFIG_HOME: &'static str = "XDG_CONFIG_HOME";
    /// The Docker runtime's daemon when `[docker] host` is unset (default
    /// [`DEFAULT_DOCKER_HOST`]), with Docker's TLS pair below.
    pub const DOCKER_HOST: &'static str = "DOCKER_HOST";
    pub const DOCKER_TLS_VERIFY: &'static str = "DOCKER_TLS_VERIFY";
    /// Default `$HOME/.docker`.
    pub const DOCKER_CERT_PATH: &'static str = "DOCKER_CERT_PATH";
    /// Set by Kubernetes in every Pod: the API server the Kubernetes runtime talks to in a cluster.
    pub const KUBERNETES_SERVICE_HOST: &'static str = "KUBERNETES_SERVICE_HOST";
    /// Default [`DEFAULT_KUBERNETES_SERVICE_PORT`].
    pub const KUBERNETES_SERVICE_PORT: &'static str = "KUBERNETES_SERVICE_PORT";

    // ---- execd, in a sandbox: set by the server or by the image ----
    /// `WIDTHxHEIGHT`: execd starts a desktop; the server sets it from `extensions.desktop`.
    pub const WARREN_DESKTOP: &'static str = "WARREN_DESKTOP";
    /// Set: execd starts Chromium with DevTools; the server sets it from `extensions.browser`.
    pub const WARREN_BROWSER: &'static str = "WARREN_BROWSER";
    /// `0`: execd keeps no spare shell; the server sets it when `[runtime] spare_shell = false`.
    pub const WARREN_SPARE_SHELL: &'static str = "WARREN_SPARE_SHELL";
    /// The env file every command sources (default [`DEFAULT_EXECD_ENVS`]); the SDK's `set_env`
    /// appends to it.
    pub const EXECD_ENVS: &'static str = "EXECD_ENVS";
    /// The reference's hardening config (OSEP-0018), JSON.
    pub const EXECD_ISOLATION_CONFIG: &'static str = "EXECD_ISOLATION_CONFIG";
    /// execd's access token in the reference's images; never passed on to user code.
    pub const EXECD_ACCESS_TOKEN: &'static str = "EXECD_ACCESS_TOKEN";
    /// The Jupyter health port (default 54321 in execd); `0` turns it off.
    pub const JUPYTER_PORT: &'static str = "JUPYTER_PORT";
}

pub const DEFAULT_DOCKER_HOST: &str = "unix:///var/run/docker.sock";
pub const DEFAULT_KUBERNETES_SERVICE_PORT: &str = "443";
pub const DEFAULT_EXECD_ENVS: &str = "/opt/opensandbox/.env";

/// The variable's value, if it is set, not empty, and UTF-8.
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The variable's value as the OS holds it, if it is set (empty included).
pub fn var_os(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

/// Whether the variable is set at all (empty included).
pub fn is_set(name: &str) -> bool {
    std::env::var_os(name).is_some()
}

/// The whole environment, as processes started for user code inherit it (execd's children); pairs
/// that are not UTF-8 are left out, as the wire cannot carry them.
pub fn vars() -> impl Iterator<Item = (String, String)> {
    std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
}

/// The names of every variable set, as the OS holds them (to clear the environment).
pub fn names_os() -> impl Iterator<Item = OsString> {
    std::env::vars_os().map(|(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_value_is_unset_for_var_but_set_for_is_set() {
        // PATH is set in any test process; a made-up name is not.
        assert!(var(EnvVars::PATH).is_some());
        assert!(var("WARREN_ENV_TEST_SURELY_UNSET").is_none());
        assert!(!is_set("WARREN_ENV_TEST_SURELY_UNSET"));
        assert!(vars().any(|(k, _)| k == EnvVars::PATH));
    }
}
