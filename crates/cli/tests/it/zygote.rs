//! The zygote's cgroup v2 path, which this project's CI hosts (cgroup v1 with an empty cgroup2
//! mount beside it) would otherwise never run: a helper asked for with the cgroup's directory must
//! start inside it, not join afterwards. The empty cgroup2 mount suffices for that.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use warren_runtime_native::zygote::{Helper, Zygote};

fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
    })
}

/// Forks a setup helper from a fresh zygote (inside the cgroup folder `into`, if given), reads its
/// first line, runs `inspect` while the helper waits for its spec, then ends both.
fn with_ready_helper<T>(into: Option<&Path>, inspect: impl FnOnce(&Helper) -> T) -> (String, T) {
    let zygote = Zygote::new(Path::new(env!("CARGO_BIN_EXE_warren")));
    let null: OwnedFd = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .expect("/dev/null")
        .into();
    let mut helper = zygote.fork_helper(&[], into, &null).expect("fork a helper");
    let mut out = helper.stdout.take().expect("stdout");
    let mut first = Vec::new();
    let mut byte = [0u8; 1];
    while out.read(&mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
        first.push(byte[0]);
    }
    let seen = inspect(&helper);
    drop(helper.stdin.take());
    let mut rest = String::new();
    let _ = out.read_to_string(&mut rest);
    helper.wait();
    zygote.stop();
    (String::from_utf8_lossy(&first).into_owned(), seen)
}

#[test]
#[ignore = "needs root and a cgroup2 mount: makes a cgroup (scripts/test runs it as root)"]
fn a_helper_is_created_inside_its_v2_cgroup() {
    let root = cgroup2_mount().expect("a cgroup2 mount");
    let dir = root.join(format!("warren-zygote-test-{}", std::process::id()));
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    // Removed however the test ends (the helper is gone by then, or killed with the zygote).
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _cleanup = Cleanup(dir.clone());
    // No join files: a helper that was not created inside would stay outside. It reports itself in
    // its cgroup (what a standby helper is waited for), then waits for its spec on stdin; meanwhile
    // it is the cgroup's only member.
    let (first, members) = with_ready_helper(Some(&dir), |_| {
        std::fs::read_to_string(dir.join("cgroup.procs")).expect("cgroup.procs")
    });
    assert_eq!(first, warren_runtime_native::JOINED_LINE);
    assert_eq!(
        members.lines().count(),
        1,
        "expected the helper alone in {}, found {members:?}",
        dir.display()
    );
}

/// Huge pages are granted to an `madvise`d range unless THP is off altogether.
fn transparent_huge_pages_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
}

/// With THP on, the helper's code sits on huge pages; with it off, the move leaves none (and the
/// helper still starts): either way the test checks what this host should give.
#[test]
fn a_helper_inherits_the_binary_on_huge_pages() {
    // Once it has said it is ready it has run code from the moved range; its mappings now are what
    // every sandbox's PID 1 starts with.
    let (first, smaps) = with_ready_helper(None, |helper| {
        let pid = helper.pid().expect("the helper's pid");
        std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("smaps")
    });
    assert_eq!(first, warren_runtime_native::JOINED_LINE);
    // The executable mapping that the moved code sits in: anonymous now, so listed without a path,
    // and mapped through huge pages the helper did not fault in itself.
    let huge_exec: u64 = smaps
        .lines()
        .fold((false, 0u64), |(in_exec, sum), line| {
            if line.starts_with(|c: char| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()) {
                let perms = line.split_whitespace().nth(1).unwrap_or("");
                (perms == "r-xp", sum)
            } else if let (true, Some(kb)) = (in_exec, line.strip_prefix("AnonHugePages:")) {
                let kb: u64 = kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                (in_exec, sum + kb * 1024)
            } else {
                (in_exec, sum)
            }
        })
        .1;
    if transparent_huge_pages_enabled() {
        assert!(
            huge_exec >= 4 << 20,
            "expected the helper's code on huge pages, found {huge_exec} bytes"
        );
    } else {
        assert_eq!(huge_exec, 0, "THP is off, yet the code is on huge pages");
    }
}
