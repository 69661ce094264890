//! Small state files of the data dir (the API key, pools, templates, snapshot records) replaced
//! whole: written beside the file, owner-only, synced, renamed over it, and the folder synced, so a
//! crash or power cut leaves the old file or the new one, never a torn or empty one.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Replaces `path` with `bytes` durably. Callers writing the same file from several tasks hold a
/// lock across taking their snapshot of the state and this call, so an older snapshot can never be
/// renamed over a newer one.
pub fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp_name);
    // A new file (a leftover of a crash is removed first), so its mode is the one asked for.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn replaces_the_whole_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pools.json");
        super::replace(&path, b"a longer first version").expect("first");
        super::replace(&path, b"second").expect("second");
        assert_eq!(std::fs::read(&path).expect("read"), b"second");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "owner-only");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["pools.json"]);
    }
}
