//! Where a Warren server on this machine keeps what local clients need to find it without being told:
//! its default address, its data dir, and the API key it generated when none was configured.

use std::path::{Path, PathBuf};

/// The address `warren serve` listens on by default.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// The file in the data dir holding a generated API key (0600).
pub const API_KEY_FILE: &str = "api-key";

/// The data dir when none is configured: `/var/lib/warren` for root, else `$XDG_DATA_HOME/warren`,
/// else `~/.local/share/warren`. `env` looks up an environment variable.
pub fn default_data_dir(env: impl Fn(&str) -> Option<String>) -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/warren");
    }
    if let Some(x) = env("XDG_DATA_HOME") {
        return Path::new(&x).join("warren");
    }
    env("HOME")
        .map(|h| Path::new(&h).join(".local/share/warren"))
        .unwrap_or_else(|| PathBuf::from(".warren"))
}

/// Where a server started on `data_dir` without a configured key stores the one it generated.
pub fn key_file(data_dir: &Path) -> PathBuf {
    data_dir.join(API_KEY_FILE)
}

/// The key a server started on `data_dir` generated, if there is one and it is readable.
pub fn stored_key(data_dir: &Path) -> Option<String> {
    std::fs::read_to_string(key_file(data_dir))
        .ok()
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
}
