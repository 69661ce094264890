//! Reaching a server from the CLI: where it is, which key, and SDK errors turned into one line a
//! person can act on. The HTTP work itself is `warren-sdk`'s.

use std::collections::BTreeMap;

use anyhow::Context;
use warren_env::EnvVars;
use warren_sdk::{Client, Config, Error};

/// Where a running server is: `--domain`, `OPEN_SANDBOX_DOMAIN`, the CLI config's `connection.domain`,
/// else the default address; the key from `--api-key`, `OPEN_SANDBOX_API_KEY`, `WARREN_API_KEY`, the
/// CLI config, else the one a server on this machine generated.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServerArgs {
    /// Server address (host:port or URL) [env: OPEN_SANDBOX_DOMAIN] [default: 127.0.0.1:8080]
    #[arg(long, global = true)]
    pub domain: Option<String>,
    /// API key [env: OPEN_SANDBOX_API_KEY, WARREN_API_KEY; else the key a local server generated]
    #[arg(long, global = true)]
    pub api_key: Option<String>,
    /// Data dir of a local server, to find its generated key [env: WARREN_DATA_DIR]
    #[arg(long, global = true)]
    pub data_dir: Option<std::path::PathBuf>,
    /// Seconds to wait for an answer to a call that is not a stream [default: 60]
    #[arg(long, global = true)]
    pub request_timeout: Option<u64>,
}

impl ServerArgs {
    pub fn client(&self) -> anyhow::Result<Client> {
        let settings = crate::settings::Settings::load()?;
        Ok(self.client_with(&settings))
    }

    pub fn client_with(&self, settings: &crate::settings::Settings) -> Client {
        let flags = self.clone();
        let conn = settings.connection.clone();
        let config = Config::from_lookup(move |k| {
            let env = || warren_env::var(k);
            match k {
                "OPEN_SANDBOX_DOMAIN" => flags.domain.clone().or_else(env).or(conn.domain.clone()),
                "OPEN_SANDBOX_API_KEY" => flags
                    .api_key
                    .clone()
                    .or_else(env)
                    .or_else(|| warren_env::var(EnvVars::WARREN_API_KEY))
                    .or(conn.api_key.clone()),
                "WARREN_DATA_DIR" => flags
                    .data_dir
                    .as_ref()
                    .map(|d| d.display().to_string())
                    .or_else(env),
                _ => env(),
            }
        });
        let mut config = config;
        if let Some(t) = self.request_timeout.or(settings.connection.request_timeout) {
            config.request_timeout = Some(std::time::Duration::from_secs(t.max(1)));
        }
        Client::new(config)
    }
}

/// Turns an SDK error into one line saying what failed, with a hint where one helps.
pub trait Explain<T> {
    fn explain(self, what: &str) -> anyhow::Result<T>;
}

impl<T> Explain<T> for Result<T, Error> {
    fn explain(self, what: &str) -> anyhow::Result<T> {
        self.map_err(|e| anyhow::anyhow!("{what}: {}", describe(&e)))
    }
}

fn describe(e: &Error) -> String {
    match e {
        Error::Unreachable { url, .. } => {
            let server = url.split("/v1/").next().unwrap_or(url);
            format!(
                "cannot reach the Warren server at {server} (hint: is `warren serve` running there? \
                 set --domain or OPEN_SANDBOX_DOMAIN)"
            )
        }
        Error::Timeout { url } => format!("{url} did not answer in time"),
        Error::Broken(err) => format!(
            "the connection broke off ({err}); the sandbox may have ended or expired meanwhile"
        ),
        Error::Api {
            status, message, ..
        } => {
            let hint = match status {
                401 | 403 => {
                    " (hint: pass the server's key with --api-key or OPEN_SANDBOX_API_KEY; a local \
                     server started without one keeps it in <data dir>/api-key)"
                }
                503 => " (hint: the server's runtime is unavailable; try again once it is back)",
                _ => "",
            };
            format!("{message}{hint}")
        }
        other => other.to_string(),
    }
}

pub fn env_map(pairs: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    pairs
        .iter()
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("--env {p:?} is not KEY=VALUE"))
        })
        .collect()
}
