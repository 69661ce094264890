//! `warren serve` start-up rules: key generation and storage, auth on every route, loopback-only
//! insecure mode.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::harness::{free_port, http_status, warren_bin};

#[test]
fn insecure_mode_is_refused_off_loopback() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(warren_bin())
        .args([
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--insecure-no-auth",
            "--data-dir",
        ])
        .arg(dir.path())
        .stdin(Stdio::null())
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback"), "unclear error: {err}");
}

/// A misspelt key in a backend's section (`[docker]`, `[kubernetes]`, read by their own crates)
/// stops `warren serve` as the file is read, naming the key and the file, whichever runtime is
/// chosen, and before anything is made: no key generated, nothing bound.
#[test]
fn a_misspelt_backend_key_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let config = dir.path().join("warren.toml");
    for (section, key) in [("docker", "hots"), ("kubernetes", "namespce")] {
        std::fs::write(&config, format!("[{section}]\n{key} = \"x\"\n")).expect("write");
        let out = Command::new(warren_bin())
            .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port())])
            .arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(&data)
            .stdin(Stdio::null())
            .output()
            .expect("run");
        assert!(!out.status.success(), "[{section}] {key} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(key)
                && err.contains(&format!("[{section}]"))
                && err.contains("warren.toml"),
            "unclear error: {err}"
        );
        assert!(
            !data.join("api-key").exists(),
            "a key was generated before the config was checked"
        );
    }
}

#[tokio::test]
async fn generated_key_is_stored_private_and_enforced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let mut child = Command::new(warren_bin())
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(dir.path())
        .env_remove("WARREN_API_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let key_file = dir.path().join("api-key");
    for _ in 0..400 {
        if http_status(&format!("http://127.0.0.1:{port}/health")).is_ok_and(|s| s == 200) {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let mode = std::fs::metadata(&key_file)
        .expect("key file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let key = std::fs::read_to_string(&key_file).expect("read key");
    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/v1/sandboxes");
    let none = http.get(&url).send().await.expect("get");
    assert_eq!(none.status(), 401);
    assert_eq!(
        none.json::<serde_json::Value>().await.expect("json")["code"],
        "MISSING_API_KEY"
    );
    let wrong = http
        .get(&url)
        .header("OPEN-SANDBOX-API-KEY", "nope")
        .send()
        .await
        .expect("get");
    assert_eq!(
        wrong.json::<serde_json::Value>().await.expect("json")["code"],
        "INVALID_API_KEY"
    );
    let ok = http
        .get(&url)
        .header("OPEN-SANDBOX-API-KEY", key.trim())
        .send()
        .await
        .expect("get");
    assert_eq!(ok.status(), 200);
    assert!(ok.headers().contains_key("x-request-id"));
    let doc = http
        .get(format!("http://127.0.0.1:{port}/openapi.json"))
        .send()
        .await
        .expect("openapi");
    assert_eq!(doc.status(), 200, "the OpenAPI document needs no key");
    // SAFETY: signalling the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    let stderr = std::io::read_to_string(child.stderr.take().expect("stderr")).unwrap_or_default();
    assert!(
        stderr.contains(&key_file.display().to_string()),
        "the server must say where the key is: {stderr}"
    );
    assert!(
        !stderr.contains(key.trim()),
        "the key itself must not be printed"
    );
}

#[test]
fn run_streams_output_and_exits_with_the_command_code() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(warren_bin())
        .args(["run", "--data-dir"])
        .arg(dir.path())
        .args(["--", "sh", "-c", "echo out; echo err >&2; exit 3"])
        .env_remove("OPEN_SANDBOX_DOMAIN")
        .stdin(Stdio::null())
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(3),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("err"));
    let left: Vec<_> = std::fs::read_dir(dir.path().join("sandboxes"))
        .expect("sandboxes dir")
        .collect();
    assert!(left.is_empty(), "warren run left sandboxes behind");
}

/// SIGHUP is a reload (the TLS certificate and the endpoint signing keys), never a stop: the
/// server answers after it, and SIGTERM then stops it cleanly.
#[test]
fn serve_reloads_on_hangup_and_stops_cleanly_on_term() {
    let mut server = crate::harness::Server::start();
    let pid = i32::try_from(server.child.id()).expect("pid");
    let log = |server: &crate::harness::Server| {
        std::fs::read_to_string(server.data().join("../server.log")).unwrap_or_default()
    };
    // SAFETY: kill(2) of the server this test spawned and has not waited for.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !log(&server).contains("reloaded the endpoint signing keys") {
        assert!(std::time::Instant::now() < deadline, "{}", log(&server));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        crate::harness::http_status(&format!("{}/health", server.base())).expect("health"),
        200
    );
    assert!(server.child.try_wait().expect("try_wait").is_none());
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = server.child.wait().expect("wait");
    assert!(status.success(), "{status}: {}", log(&server));
    assert!(log(&server).contains("shutting down"), "{}", log(&server));
}

/// Ctrl-C while `warren run` streams: the command is interrupted, the sandbox deleted with nothing
/// left of it, and the exit code is the shell's for SIGINT (130). The sandbox runs in a session of
/// its own, so before `warren run` caught the signal it died at once and left the sandbox running.
#[test]
fn run_stopped_by_ctrl_c_deletes_its_sandbox() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = Command::new(warren_bin())
        .args(["run", "--data-dir"])
        .arg(dir.path())
        .args(["--", "sh", "-c", "echo started; sleep 600"])
        .env_remove("OPEN_SANDBOX_DOMAIN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("first line");
    assert_eq!(line, "started\n");
    let ids: Vec<String> = std::fs::read_dir(dir.path().join("sandboxes"))
        .expect("sandboxes dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(ids.len(), 1, "one sandbox while the command runs: {ids:?}");

    let pid = i32::try_from(child.id()).expect("pid");
    // SAFETY: kill(2) of the child this test spawned and has not waited for.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "stderr: {stderr}");
    assert!(stderr.contains("stopped by signal 2"), "stderr: {stderr}");
    crate::harness::assert_no_trace(dir.path(), &ids[0]);
}

/// Client errors are one line saying what failed, with a hint, and a non-zero exit code.
#[test]
fn client_errors_are_one_clear_line() {
    let server = crate::harness::Server::start();
    let code_run = |domain: &str, key: &str, sandbox: &str| {
        let out = Command::new(warren_bin())
            .args([
                "code",
                "run",
                sandbox,
                "print(1)",
                "--domain",
                domain,
                "--api-key",
                key,
            ])
            .stdin(Stdio::null())
            .output()
            .expect("warren code run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let closed = format!("127.0.0.1:{}", free_port());
    let (code, err) = code_run(&closed, "k", "abc");
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("cannot reach the Warren server") && err.contains("hint"),
        "{err}"
    );

    let domain = server.base().trim_start_matches("http://").to_string();
    let (code, err) = code_run(&domain, "wrong-key", "abc");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--api-key"),
        "a wrong key says how to pass one: {err}"
    );

    let (code, err) = code_run(&domain, &server.key, "no-such-sandbox");
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("no-such-sandbox"), "{err}");
}

/// Warren in a container without a volume for its data dir puts it on overlayfs, which cannot hold
/// an overlay's upper folder: every create failed with "mount overlay at …". The server now refuses
/// to start, and says why and what to do, leaving nothing mounted or made in the data dir.
#[test]
fn a_data_dir_on_overlayfs_is_refused_at_start_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    for sub in ["lower", "upper", "work", "merged"] {
        std::fs::create_dir(dir.path().join(sub)).expect("mkdir");
    }
    let merged = dir.path().join("merged");
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        dir.path().join("lower").display(),
        dir.path().join("upper").display(),
        dir.path().join("work").display()
    );
    let mounted = Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o", &opts])
        .arg(&merged)
        .status()
        .expect("mount");
    assert!(mounted.success(), "mounting the test's overlay");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(merged.clone());

    let data = merged.join("data");
    refused_at_start(
        Command::new(warren_bin())
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{}", free_port()),
                "--data-dir",
            ])
            .arg(&data),
        &["cannot hold sandboxes' writable layers", "on overlayfs"],
    );
    let left: Vec<_> = std::fs::read_dir(&data)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        !left
            .iter()
            .any(|n| n.to_string_lossy().starts_with("overlay-probe")),
        "the probe was left behind: {left:?}"
    );
}

/// Warren in a container without `--privileged` sees its cgroups read-only; every create failed
/// with EROFS while the server looked healthy. It now refuses to start and says so. (A mount
/// namespace of the test's own with one hierarchy remounted read-only stands for the container.)
#[test]
fn read_only_cgroups_are_refused_at_start_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hierarchy = ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup"]
        .into_iter()
        .find(|h| std::path::Path::new(h).join("cgroup.procs").exists())
        .expect("a cgroup hierarchy");
    let script = format!(
        "mount --make-rprivate / && mount -o remount,bind,ro {hierarchy} && exec \"$0\" serve --listen 127.0.0.1:{} --data-dir \"$1\"",
        free_port()
    );
    refused_at_start(
        Command::new("unshare")
            .args(["-m", "sh", "-c", &script])
            .arg(warren_bin())
            .arg(dir.path().join("data")),
        &["cgroups are mounted read-only", "Read-only file system"],
    );
}

/// Not root: the first thing that fails is the cgroup probe, and the error says what is missing.
#[test]
fn a_server_that_is_not_root_says_it_needs_root() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    // Copies the user can reach (a clone in a 0700 folder would not let it exec the built ones),
    // execd beside the server as it is found.
    let bin = warren_bin();
    for name in ["warren", "warren-execd"] {
        std::fs::copy(bin.with_file_name(name), dir.path().join(name)).expect("copy");
    }
    refused_at_start(
        Command::new(dir.path().join("warren"))
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{}", free_port()),
                "--data-dir",
            ])
            .arg(dir.path().join("data"))
            .uid(65534)
            .gid(65534),
        &["needs root"],
    );
}

/// Runs a `warren serve` that must refuse to start, and checks that its error says each of `says`.
fn refused_at_start(serve: &mut Command, says: &[&str]) {
    let out = serve
        .env("WARREN_API_KEY", "k-refused-at-start")
        .stdin(Stdio::null())
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the server started: {err}");
    for said in says {
        assert!(err.contains(said), "unclear error (no {said:?}): {err}");
    }
}
