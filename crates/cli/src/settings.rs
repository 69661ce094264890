//! The CLI's own settings file (`warren config init|set|show`): where the server is and how to print,
//! so they need not be given on every call. Flags and environment variables win over it.
//!
//! `$WARREN_CLI_CONFIG`, else `$XDG_CONFIG_HOME/warren/cli.toml`, else `~/.config/warren/cli.toml`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::output::Format;

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    #[serde(default)]
    pub connection: Connection,
    #[serde(default)]
    pub output: Output,
    #[serde(default)]
    pub defaults: Defaults,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Connection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_timeout: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Output {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<Format>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Defaults {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

/// The keys `warren config set` accepts.
pub const KEYS: [&str; 6] = [
    "connection.domain",
    "connection.api_key",
    "connection.request_timeout",
    "output.format",
    "defaults.image",
    "defaults.timeout",
];

pub fn path() -> PathBuf {
    let env = warren_env::var;
    if let Some(p) = env("WARREN_CLI_CONFIG") {
        return p.into();
    }
    let base = env("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("warren").join("cli.toml")
}

impl Settings {
    /// The settings file, or defaults when there is none. A broken file is an error, not ignored.
    pub fn load() -> anyhow::Result<Self> {
        let p = path();
        match std::fs::read_to_string(&p) {
            Ok(text) => toml::from_str(&text).with_context(|| format!("reading {}", p.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }

    /// Writes the file, private (it may hold a key).
    pub fn save(&self) -> anyhow::Result<PathBuf> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let p = path();
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let tmp = p.with_extension("toml.tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        f.write_all(toml::to_string_pretty(self)?.as_bytes())?;
        std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))?;
        Ok(p)
    }

    pub fn set(&mut self, key: &str, value: &str) -> anyhow::Result<()> {
        let num = |v: &str| {
            v.parse::<i64>()
                .with_context(|| format!("{key} takes a number of seconds, not {v:?}"))
        };
        match key {
            "connection.domain" => self.connection.domain = Some(value.into()),
            "connection.api_key" => self.connection.api_key = Some(value.into()),
            "connection.request_timeout" => {
                self.connection.request_timeout = Some(num(value)?.max(1) as u64)
            }
            "output.format" => {
                self.output.format = Some(match value {
                    "table" => Format::Table,
                    "json" => Format::Json,
                    "yaml" => Format::Yaml,
                    _ => bail!("output.format is table, json or yaml, not {value:?}"),
                })
            }
            "defaults.image" => self.defaults.image = Some(value.into()),
            "defaults.timeout" => self.defaults.timeout = Some(num(value)?),
            _ => bail!("unknown key {key:?}; the keys are {}", KEYS.join(", ")),
        }
        Ok(())
    }

    /// The settings with the key hidden, for `config show`.
    pub fn redacted(&self) -> Self {
        let mut s = self.clone();
        if s.connection.api_key.is_some() {
            s.connection.api_key = Some("********".into());
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_checks_keys_and_values() {
        let mut s = Settings::default();
        s.set("connection.domain", "10.0.0.5:8080").expect("domain");
        s.set("output.format", "yaml").expect("format");
        s.set("defaults.timeout", "1800").expect("timeout");
        assert!(s.set("output.format", "xml").is_err());
        assert!(s.set("defaults.timeout", "soon").is_err());
        let err = s.set("nope", "1").expect_err("unknown key").to_string();
        assert!(err.contains("connection.domain"), "{err}");
        let text = toml::to_string_pretty(&s).expect("toml");
        assert_eq!(toml::from_str::<Settings>(&text).expect("parse"), s);
        s.set("connection.api_key", "secret").expect("key");
        assert!(!format!("{:?}", s.redacted()).contains("secret"));
    }
}
