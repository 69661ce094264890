//! Starting execd for a test and talking to it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_warren-execd");

pub struct Execd {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub base: String,
    pub socket: PathBuf,
    pub http: reqwest::Client,
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

impl Execd {
    pub async fn start() -> Self {
        Self::start_with_env(&[]).await
    }

    /// [`Execd::start`] with more variables in execd's environment.
    pub async fn start_with_env(env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let work = dir.path().join("work");
        std::fs::create_dir(&work).expect("mkdir work");
        std::fs::write(dir.path().join("envs"), "FROM_FILE=yes\n# comment\n").expect("env file");
        let socket = dir.path().join("execd.sock");
        let port = free_port();
        let child = Command::new(BIN)
            .arg("--socket")
            .arg(&socket)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--workdir")
            .arg(&work)
            .env("EXECD_ENVS", dir.path().join("envs"))
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn execd");
        let execd = Self {
            child,
            dir,
            base: format!("http://127.0.0.1:{port}"),
            socket,
            http: reqwest::Client::builder().build().expect("client"),
        };
        execd.wait_ready().await;
        execd
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = self.http.get(self.url("/ping")).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "execd did not become ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn work(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// `GET path`, panicking if the request cannot be sent.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http.get(self.url(path)).send().await.expect("req")
    }

    pub async fn post_json(&self, path: &str, body: Value) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .expect("request")
    }

    /// Runs a command to completion and returns its events.
    pub async fn run(&self, body: Value) -> Vec<Value> {
        let resp = self.post_json("/command", body).await;
        assert_eq!(resp.status(), 200);
        parse_events(&resp.text().await.expect("body"))
    }
}

impl Drop for Execd {
    fn drop(&mut self) {
        // SIGTERM lets execd kill what it started; then make sure it is gone.
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Splits an execd stream body into events, asserting the exact framing: one single-line JSON object
/// followed by a blank line, an integer `timestamp` on each.
pub fn parse_events(body: &str) -> Vec<Value> {
    assert!(
        body.is_empty() || body.ends_with("\n\n"),
        "body must end with a blank line: {body:?}"
    );
    body.split_terminator("\n\n")
        .map(|chunk| {
            assert!(!chunk.contains('\n'), "event spans lines: {chunk:?}");
            let v: Value =
                serde_json::from_str(chunk).unwrap_or_else(|e| panic!("bad event {chunk:?}: {e}"));
            assert!(
                v["timestamp"].is_i64(),
                "timestamp must be an integer: {chunk}"
            );
            assert!(v["type"].is_string(), "type missing: {chunk}");
            v
        })
        .collect()
}

pub fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("").to_string())
        .collect()
}

/// Concatenated text of the events of one kind.
/// The texts of the `kind` events, as sent.
pub fn lines_of(events: &[Value], kind: &str) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["type"] == kind)
        .filter_map(|e| e["text"].as_str().map(str::to_owned))
        .collect()
}

/// A command's or session's output put back together from its line events: each line with a
/// `\n` (an empty line is sent as `"\n"` already).
pub fn text_of(events: &[Value], kind: &str) -> String {
    lines_of(events, kind)
        .into_iter()
        .map(|l| if l == "\n" { l } else { l + "\n" })
        .collect()
}

pub fn pid_alive(pid: i32) -> bool {
    // A zombie still has a /proc entry; it counts as gone.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|s| s != "Z"),
        Err(_) => false,
    }
}

pub async fn wait_gone(pid: i32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if !pid_alive(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    !pid_alive(pid)
}

pub async fn read_pid(path: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if let Ok(p) = s.trim().parse() {
                return p;
            }
        }
        assert!(
            Instant::now() < deadline,
            "pid file {} never written",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn error_body(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.expect("error body is JSON");
    assert!(
        v["code"].is_string() && v["message"].is_string(),
        "error body shape: {v}"
    );
    (status, v)
}
