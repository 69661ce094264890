//! The zygote's cgroup v2 path, which this project's CI hosts (cgroup v1 with an empty cgroup2
//! mount beside it) would otherwise never run: a helper asked for with the cgroup's directory must
//! start inside it, not join afterwards. The empty cgroup2 mount suffices for that.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use warren_runtime_native::zygote::Zygote;

fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
    })
}

#[test]
fn a_helper_is_created_inside_its_v2_cgroup() {
    let Some(root) = cgroup2_mount() else {
        eprintln!("skipped: no cgroup2 mount");
        return;
    };
    let dir = root.join(format!("warren-zygote-test-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir(&dir) {
        eprintln!("skipped: cannot create {}: {e}", dir.display());
        return;
    }
    // Removed however the test ends (the helper is gone by then, or killed with the zygote).
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _cleanup = Cleanup(dir.clone());
    let zygote = Zygote::new(std::path::Path::new(env!("CARGO_BIN_EXE_warren")));
    let null: OwnedFd = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .expect("/dev/null")
        .into();
    // No join files: a helper that was not created inside would stay outside.
    let mut helper = zygote
        .fork_helper(&[], Some(&dir), &null)
        .expect("fork a helper");
    // It reports itself in its cgroup (what a standby helper is waited for), then waits for its
    // spec on stdin; meanwhile it is the cgroup's only member.
    let mut out = helper.stdout.take().expect("stdout");
    let mut first = Vec::new();
    let mut byte = [0u8; 1];
    while out.read(&mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
        first.push(byte[0]);
    }
    let members = std::fs::read_to_string(dir.join("cgroup.procs")).expect("cgroup.procs");
    drop(helper.stdin.take());
    let mut rest = String::new();
    let _ = out.read_to_string(&mut rest);
    helper.wait();
    zygote.stop();
    assert_eq!(
        String::from_utf8_lossy(&first),
        warren_runtime_native::JOINED_LINE
    );
    assert_eq!(
        members.lines().count(),
        1,
        "expected the helper alone in {}, found {members:?}",
        dir.display()
    );
}
