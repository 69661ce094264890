//! IPv4 forwarding, turned on while some Warren server on this host has sandbox links and put back
//! as it was when the last one lets go.
//!
//! Forwarding cannot be enabled for the sandbox links alone: Linux decides per *incoming*
//! interface, so the replies coming back on the host's uplink need it there too, which is as wide
//! as the host-wide switch. What Warren can do is not leave it behind: each server (one firewall
//! table each) holds it with a file named for its table under [`RUN_DIR`]; the first holder writes
//! down the value it found, and the last one to release it writes that value back. A server that
//! stops with linked sandboxes left keeps holding it (they still route through the host) until it
//! starts again and releases it at a clean stop. `/run` is a tmpfs, like the sysctl: a reboot
//! resets both.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Where holders and the value found before the first one are kept.
pub const RUN_DIR: &str = "/run/warren/forwarding";
/// The host-wide switch.
pub const SYSCTL: &str = "/proc/sys/net/ipv4/ip_forward";

/// One server's hold on forwarding.
#[derive(Debug, Clone)]
pub struct Forwarding {
    dir: PathBuf,
    sysctl: PathBuf,
    holder: String,
}

impl Forwarding {
    /// The hold of the server whose firewall table is `table`.
    pub fn new(table: &str) -> Self {
        Self::at(Path::new(RUN_DIR), Path::new(SYSCTL), table)
    }

    /// The same with other paths (tests).
    pub fn at(dir: &Path, sysctl: &Path, table: &str) -> Self {
        Self {
            dir: dir.to_path_buf(),
            sysctl: sysctl.to_path_buf(),
            holder: format!("holder-{table}"),
        }
    }

    /// Turns forwarding on for this server, noting what it was if no one held it yet. Taking a hold
    /// this server already has (a restart after a crash) is fine.
    pub fn acquire(&self) -> io::Result<()> {
        let _lock = self.lock()?;
        let previous = self.dir.join("previous");
        // Kept if it exists: with no holder left, only a release cut short wrote it.
        if !previous.exists() {
            let now = fs::read_to_string(&self.sysctl)?;
            fs::write(&previous, now.trim())?;
        }
        fs::write(self.dir.join(&self.holder), b"")?;
        fs::write(&self.sysctl, "1")
    }

    /// Lets go of this server's hold; the last holder puts back the value found before the first.
    pub fn release(&self) -> io::Result<()> {
        let _lock = self.lock()?;
        match fs::remove_file(self.dir.join(&self.holder)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
        if self.any_holder()? {
            return Ok(());
        }
        let previous = self.dir.join("previous");
        let value = match fs::read_to_string(&previous) {
            Ok(v) => v,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if matches!(value.trim(), "0" | "1") {
            fs::write(&self.sysctl, value.trim())?;
        }
        fs::remove_file(previous)
    }

    fn any_holder(&self) -> io::Result<bool> {
        for entry in fs::read_dir(&self.dir)? {
            if entry?.file_name().to_string_lossy().starts_with("holder-") {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Serialises servers starting and stopping at once (an exclusive `flock`, released on drop).
    fn lock(&self) -> io::Result<File> {
        fs::create_dir_all(&self.dir)?;
        let f = File::create(self.dir.join("lock"))?;
        // SAFETY: flock on a descriptor we own; it is released when the file is closed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(initial: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
        let t = tempfile::tempdir().expect("tempdir");
        let sysctl = t.path().join("ip_forward");
        fs::write(&sysctl, format!("{initial}\n")).expect("write");
        let dir = t.path().join("run");
        (t, dir, sysctl)
    }

    fn value(p: &Path) -> String {
        fs::read_to_string(p).expect("read").trim().to_owned()
    }

    #[test]
    fn the_last_holder_puts_back_what_the_first_found() {
        let (_t, dir, sysctl) = setup("0");
        let a = Forwarding::at(&dir, &sysctl, "warren_a");
        let b = Forwarding::at(&dir, &sysctl, "warren_b");
        a.acquire().expect("a");
        assert_eq!(value(&sysctl), "1");
        b.acquire().expect("b");
        a.release().expect("a goes");
        assert_eq!(value(&sysctl), "1", "b still holds it");
        a.release().expect("releasing twice is harmless");
        assert_eq!(value(&sysctl), "1");
        b.release().expect("b goes");
        assert_eq!(value(&sysctl), "0", "put back as found");
        assert!(!dir.join("previous").exists());
    }

    #[test]
    fn forwarding_someone_else_turned_on_stays_on() {
        let (_t, dir, sysctl) = setup("1");
        let a = Forwarding::at(&dir, &sysctl, "warren_a");
        a.acquire().expect("a");
        a.release().expect("a goes");
        assert_eq!(value(&sysctl), "1");
    }

    #[test]
    fn a_server_back_from_a_crash_takes_its_own_hold_again() {
        let (_t, dir, sysctl) = setup("0");
        let a = Forwarding::at(&dir, &sysctl, "warren_a");
        a.acquire().expect("a");
        // crashed: no release; it starts again and holds once more
        a.acquire().expect("a again");
        assert_eq!(value(&dir.join("previous")), "0", "the first value is kept");
        a.release().expect("a goes");
        assert_eq!(value(&sysctl), "0");
    }
}
