//! Starts `warren serve` on a free loopback port with its own data dir; stops it by PID on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn warren_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_warren"))
}

pub struct Server {
    pub child: Child,
    pub port: u16,
    pub key: String,
    pub dir: tempfile::TempDir,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

impl Server {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in(dir)
    }

    pub fn start_in(dir: tempfile::TempDir) -> Self {
        Self::start_under(dir, &[])
    }

    /// Started through `wrapper` (a command that execs the rest, e.g. `prlimit --nofile=…`).
    pub fn start_under(dir: tempfile::TempDir, wrapper: &[&str]) -> Self {
        Self::start_with(dir, wrapper, "")
    }

    /// With `config` (TOML sections) added to the test configuration.
    pub fn start_configured(config: &str) -> Self {
        Self::start_with(tempfile::tempdir().expect("tempdir"), &[], config)
    }

    fn start_with(dir: tempfile::TempDir, wrapper: &[&str], extra: &str) -> Self {
        let key = format!("it-{}", std::process::id());
        let port = free_port();
        let config = dir.path().join("config.toml");
        // Tests never reach a real resolver or registry: no DNS upstream, no pulls.
        std::fs::write(
            &config,
            format!(
                "[network]\ndns_upstream = \"127.0.0.1:9\"\n[images]\npull = \"never\"\n{extra}"
            ),
        )
        .expect("config");
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(warren_bin());
                c
            }
            None => Command::new(warren_bin()),
        };
        let child = cmd
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--config",
            ])
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env("WARREN_API_KEY", &key)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("server.log")).expect("log"))
            .spawn()
            .expect("spawn warren serve");
        let server = Self {
            child,
            port,
            key,
            dir,
        };
        server.wait_healthy();
        server
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if http_status(&format!("{}/health", self.base())).is_ok_and(|s| s == 200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "warren serve did not become healthy: {}",
            std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
        );
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn client(&self) -> Client {
        Client {
            base: self.base(),
            key: self.key.clone(),
            http: reqwest::Client::new(),
        }
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Only while unreaped: once waited for (a test stopped it), its pid may name another process.
        if matches!(self.child.try_wait(), Ok(None)) {
            if std::thread::panicking() {
                // A failed test's sandboxes would outlive the server (they do by design, for its
                // next start): deleted first, on a thread of their own, outside the test's runtime.
                let client = self.client();
                let _ = std::thread::spawn(move || {
                    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    else {
                        return;
                    };
                    rt.block_on(client.delete_all());
                })
                .join();
            }
            // SAFETY: signalling the child we spawned and have not reaped, by its pid.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let _ = self.child.wait();
        }
    }
}

pub struct Client {
    pub base: String,
    pub key: String,
    pub http: reqwest::Client,
}

pub struct Resp {
    pub status: u16,
    pub json: serde_json::Value,
}

impl Client {
    /// Deletes every sandbox the server lists (best effort).
    pub async fn delete_all(&self) {
        let listed = self
            .call(reqwest::Method::GET, "/v1/sandboxes?pageSize=1000", None)
            .await;
        for item in listed.json["items"].as_array().into_iter().flatten() {
            if let Some(id) = item["id"].as_str() {
                self.call(
                    reqwest::Method::DELETE,
                    &format!("/v1/sandboxes/{id}"),
                    None,
                )
                .await;
            }
        }
    }

    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Resp {
        let mut r = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("OPEN-SANDBOX-API-KEY", &self.key);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        Resp {
            status,
            json: serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        }
    }

    pub async fn create(&self, body: serde_json::Value) -> Resp {
        self.call(reqwest::Method::POST, "/v1/sandboxes", Some(body))
            .await
    }

    /// Runs a command through the endpoint proxy; returns (stdout, exit code).
    pub async fn exec(&self, id: &str, command: &str) -> (String, i32) {
        let ep = self
            .call(
                reqwest::Method::GET,
                &format!("/v1/sandboxes/{id}/endpoints/44772"),
                None,
            )
            .await;
        assert_eq!(ep.status, 200, "{:?}", ep.json);
        let endpoint = ep.json["endpoint"].as_str().expect("endpoint").to_string();
        let mut req = self
            .http
            .post(format!("http://{endpoint}/command"))
            .json(&serde_json::json!({"command": command}));
        for (k, v) in ep.json["headers"].as_object().expect("headers") {
            req = req.header(k, v.as_str().expect("header value"));
        }
        let text = req
            .send()
            .await
            .expect("command")
            .text()
            .await
            .expect("body");
        let mut out = String::new();
        let mut code = None;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let ev: serde_json::Value = serde_json::from_str(line).expect("event json");
            match ev["type"].as_str() {
                // one event per line, its terminator removed; an empty line comes as "\n"
                Some("stdout") => match ev["text"].as_str().unwrap_or_default() {
                    "\n" => out.push('\n'),
                    line => {
                        out.push_str(line);
                        out.push('\n');
                    }
                },
                Some("execution_complete") => code = Some(0),
                Some("error") => code = ev["error"]["evalue"].as_str().and_then(|v| v.parse().ok()),
                _ => {}
            }
        }
        (out, code.expect("a terminal event"))
    }
}

/// Host resources a sandbox may hold; all must be gone after it ends.
pub fn assert_no_trace(data: &Path, id: &str) {
    assert!(
        !data.join("sandboxes").join(id).exists(),
        "sandbox folder of {id} left behind"
    );
    for entry in std::fs::read_dir("/sys/fs/cgroup")
        .expect("cgroup root")
        .flatten()
    {
        let dir = entry.path().join("warren").join(id);
        assert!(!dir.exists(), "cgroup {} left behind", dir.display());
    }
    let unified = Path::new("/sys/fs/cgroup/warren").join(id);
    assert!(
        !unified.exists(),
        "cgroup {} left behind",
        unified.display()
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(!mounts.contains(id), "a mount of {id} is left on the host");
    // A sandbox disk's loop device (its backing file reads "... (deleted)" once removed) clears
    // itself when its file system's last mount goes, which may follow the sandbox's end by a moment.
    let loop_of = |id: &str| {
        std::fs::read_dir("/sys/block")
            .expect("/sys/block")
            .flatten()
            .map(|dev| {
                std::fs::read_to_string(dev.path().join("loop/backing_file")).unwrap_or_default()
            })
            .find(|backing| backing.contains(id))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while loop_of(id).is_some() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    if let Some(backing) = loop_of(id) {
        panic!(
            "a loop device is left for {id}, backed by {}",
            backing.trim()
        );
    }
    for p in std::fs::read_dir("/proc").expect("proc").flatten() {
        if let Ok(cmd) = std::fs::read(p.path().join("cmdline")) {
            assert!(
                !String::from_utf8_lossy(&cmd).contains(id),
                "a process mentioning {id} is left: {}",
                p.path().display()
            );
        }
    }
}

/// Waits for a sandbox's state to satisfy `want`.
pub async fn wait_state(
    c: &Client,
    id: &str,
    want: &[&str],
    within: Duration,
) -> serde_json::Value {
    let deadline = Instant::now() + within;
    loop {
        let r = c
            .call(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await;
        if r.status == 200 && want.contains(&r.json["status"]["state"].as_str().unwrap_or_default())
        {
            return r.json;
        }
        assert!(
            Instant::now() < deadline,
            "sandbox {id} never reached {want:?}: {:?}",
            r.json
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A blocking status probe over plain TCP, for waiting on start-up outside an async runtime.
pub fn http_status(url: &str) -> std::io::Result<u16> {
    use std::io::{Read, Write};
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{p}")))
        .unwrap_or((rest, "/".into()));
    let mut s = std::net::TcpStream::connect(host)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    Ok(buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0))
}
