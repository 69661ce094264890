//! The daemon itself: Unix socket, metrics, zombie reaping, entrypoint exit code and SIGTERM forwarding.

use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::*;

#[tokio::test]
async fn serves_on_the_unix_socket() {
    let execd = Execd::start().await;
    let mut s = std::os::unix::net::UnixStream::connect(&execd.socket).expect("connect");
    s.write_all(b"GET /ping HTTP/1.1\r\nHost: execd\r\nConnection: close\r\n\r\n")
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
}

#[tokio::test]
async fn metrics_and_watch() {
    let execd = Execd::start().await;
    let m: Value = execd.get("/metrics").await.json().await.expect("json");
    for k in ["cpu_count", "cpu_used_pct", "mem_total_mib", "mem_used_mib"] {
        assert!(m[k].is_number(), "{k} missing in {m}");
    }
    assert!(m["timestamp"].is_i64());
    assert!(m["cpu_count"].as_f64().expect("n") > 0.0);
    assert!(m["mem_total_mib"].as_f64().expect("n") >= m["mem_used_mib"].as_f64().expect("n"));
    let pct = m["cpu_used_pct"].as_f64().expect("n");
    assert!((0.0..=100.0).contains(&pct));

    let resp = execd.get("/metrics/watch").await;
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    use futures::StreamExt;
    let chunk = tokio::time::timeout(Duration::from_secs(3), stream.next())
        .await
        .expect("first event")
        .expect("chunk");
    let text = String::from_utf8(chunk.expect("bytes").to_vec()).expect("utf8");
    let ev: Value = serde_json::from_str(text.trim()).expect("json");
    assert!(ev["mem_total_mib"].is_number());
}

fn zombie_children(ppid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| stat[i + 1..].to_string()) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.first() == Some(&"Z") && f.get(1).and_then(|p| p.parse::<i32>().ok()) == Some(ppid) {
            out.push(pid);
        }
    }
    out
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
}

#[tokio::test]
async fn orphans_are_reparented_to_execd_and_reaped() {
    let execd = Execd::start().await;
    let pidfile = execd.dir.path().join("orphan");
    // The sleeps are orphaned when the shell exits and get reparented to execd (a subreaper here).
    let cmd = format!(
        "for i in 1 2 3 4; do sleep 0.3 & done; sleep 0.6 & echo $! > {}; exit 0",
        pidfile.display()
    );
    let events = execd.run(json!({"command": cmd})).await;
    assert_eq!(
        kinds(&events).last().map(String::as_str),
        Some("execution_complete")
    );
    let orphan = read_pid(&pidfile).await;
    assert_eq!(
        parent_of(orphan),
        Some(execd.pid()),
        "orphan not reparented to execd"
    );
    assert!(wait_gone(orphan, Duration::from_secs(3)).await);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        zombie_children(execd.pid()),
        Vec::<i32>::new(),
        "execd left zombies"
    );
    assert!(
        std::fs::metadata(format!("/proc/{orphan}")).is_err(),
        "orphan {orphan} not reaped"
    );
}

#[test]
fn exits_with_the_entrypoint_code() {
    let dir = tempfile::tempdir().expect("tmp");
    let started = Instant::now();
    let status = Command::new(BIN)
        .arg("--socket")
        .arg(dir.path().join("s.sock"))
        .args(["--workdir", "/", "--", "/bin/sh", "-c", "exit 5"])
        .env("RUST_LOG", "warn")
        .status()
        .expect("run");
    assert_eq!(status.code(), Some(5));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        !dir.path().join("s.sock").exists(),
        "socket file left behind"
    );
}

#[test]
fn sigterm_is_forwarded_to_the_entrypoint() {
    let dir = tempfile::tempdir().expect("tmp");
    let marker = dir.path().join("got-term");
    let script = format!(
        "trap 'echo term > {}; exit 9' TERM; while true; do sleep 0.05; done",
        marker.display()
    );
    let mut child = Command::new(BIN)
        .arg("--socket")
        .arg(dir.path().join("s.sock"))
        .args(["--", "/bin/sh", "-c", &script])
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !dir.path().join("s.sock").exists() {
        assert!(Instant::now() < deadline, "never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("kill");
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("execd did not stop after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(9));
    assert_eq!(
        std::fs::read_to_string(&marker).expect("entrypoint saw TERM"),
        "term\n"
    );
}

#[tokio::test]
#[ignore = "needs root: switches users (scripts/test runs it as root)"]
async fn runs_commands_as_another_user() {
    let execd = Execd::start().await;
    let events = execd
        .run(json!({"command": "id -u; id -g", "uid": 65534, "gid": 65533}))
        .await;
    assert_eq!(text_of(&events, "stdout"), "65534\n65533\n");
}

/// execd as a real PID 1 (in a fresh pid namespace): it must reap orphans that the kernel reparents to it
/// and still exit with the entrypoint's code.
#[tokio::test]
#[ignore = "needs root: runs execd in a fresh pid namespace with unshare (scripts/test runs it as root)"]
async fn as_pid1_reaps_orphans_and_exits_with_entrypoint() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let stop = dir.path().join("stop");
    let entry = format!(
        "while [ ! -e {} ]; do sleep 0.05; done; exit 4",
        stop.display()
    );
    let mut child = tokio::process::Command::new("/usr/bin/unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(BIN)
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--",
            "/bin/sh",
            "-c",
            &entry,
        ])
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("unshare");
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while http
        .get(format!("{base}/ping"))
        .send()
        .await
        .map(|r| r.status() != 200)
        .unwrap_or(true)
    {
        assert!(
            Instant::now() < deadline,
            "execd in pid namespace never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cmd = "tr '\\0' ' ' < /proc/1/cmdline; echo; \
               for i in 1 2 3; do (sleep 0.1 &); done; sleep 0.6; \
               for f in /proc/[0-9]*/stat; do cat $f 2>/dev/null; echo; done | awk '$3 == \"Z\"' | wc -l";
    let resp = http
        .post(format!("{base}/command"))
        .json(&json!({"command": cmd}))
        .send()
        .await
        .expect("req");
    let events = parse_events(&resp.text().await.expect("body"));
    let out = text_of(&events, "stdout");
    let mut lines = out.lines();
    assert!(
        lines.next().unwrap_or("").contains("warren-execd"),
        "execd is not PID 1: {out}"
    );
    assert_eq!(
        lines.next().map(str::trim),
        Some("0"),
        "zombies left in the namespace: {out}"
    );

    std::fs::write(&stop, "").expect("stop");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exit")
        .expect("status");
    assert_eq!(status.code(), Some(4));
}

/// `--ready-fd`: execd closes it once it listens, and nothing it starts holds a copy, so its other
/// end sees EOF exactly when the sandbox can be used, while the entrypoint runs on.
#[test]
fn ready_fd_closes_once_listening_and_stays_out_of_the_entrypoint() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;

    let dir = tempfile::tempdir().expect("tmp");
    let socket = dir.path().join("s.sock");
    // Close-on-exec here, so that only this execd (as its fd 3) gets the write end, not children
    // other tests start meanwhile.
    let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
    let raw = write_end.as_raw_fd();
    let mut cmd = Command::new(BIN);
    cmd.arg("--socket")
        .arg(&socket)
        .args(["--ready-fd", "3", "--", "/bin/sleep", "30"])
        .env("RUST_LOG", "warn");
    // SAFETY: dup2 is async-signal-safe; it runs in the forked child just before exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(raw, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn");
    drop(write_end);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut rest = Vec::new();
        let _ = std::fs::File::from(read_end).read_to_end(&mut rest);
        let _ = tx.send(());
    });
    let closed = rx.recv_timeout(Duration::from_secs(10)).is_ok();
    let listening = std::os::unix::net::UnixStream::connect(&socket).is_ok();
    let running = child.try_wait().expect("try_wait").is_none();
    // SIGTERM, which execd forwards to the entrypoint, so that no `sleep` outlives the test.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    assert!(
        closed,
        "the ready descriptor was never closed (or the entrypoint holds it)"
    );
    assert!(
        listening,
        "the ready descriptor closed before execd listened"
    );
    assert!(running, "execd should still run with its entrypoint");
}
