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

/// Creates `data_dir` if needed and makes it 0700. A sandbox without a user namespace (opted out,
/// or a runtime that has none): a file root in that sandbox makes setuid (in its writable layer, a volume, or a snapshot's layer) is a setuid-root
/// file on the host, which any local user could run if they could reach it; nobody but root can
/// inside a 0700 data dir. An existing data dir is tightened too.
pub fn prepare_data_dir(data_dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(data_dir)?;
    let mode = std::fs::metadata(data_dir)?.permissions().mode() & 0o7777;
    if mode != 0o700 {
        std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_dir_is_made_private_and_an_open_one_tightened() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().expect("tmp");
        let fresh = t.path().join("a/b");
        prepare_data_dir(&fresh).expect("fresh");
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777;
        assert_eq!(mode(&fresh), 0o700);
        let open = t.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        prepare_data_dir(&open).expect("existing");
        assert_eq!(mode(&open), 0o700);
    }
}
