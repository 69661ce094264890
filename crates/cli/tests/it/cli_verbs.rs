//! The `warren` verbs that mirror `osb` (sandbox, command, file, config), driven as a person would,
//! against a real server; and snapshots of the help text so changes to the CLI's surface are seen in
//! review (insta: `INSTA_UPDATE=always` or `cargo insta review` accepts a change).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::harness::{assert_no_trace, warren_bin, Server};

struct Cli<'a> {
    server: &'a Server,
    config: PathBuf,
}

impl<'a> Cli<'a> {
    fn new(server: &'a Server) -> Self {
        Self {
            server,
            config: server.dir.path().join("cli.toml"),
        }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(warren_bin());
        c.args(args)
            .env("WARREN_CLI_CONFIG", &self.config)
            .env("OPEN_SANDBOX_DOMAIN", self.server.base())
            .env("OPEN_SANDBOX_API_KEY", &self.server.key)
            .env_remove("WARREN_API_KEY")
            .stdin(Stdio::null());
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("run warren")
    }

    /// Runs and expects success; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "warren {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        // Before the leaf: a command's trailing words would take a `-o` after them as theirs.
        let mut all = vec![args[0], "-o", "json"];
        all.extend(&args[1..]);
        let text = self.ok(&all);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?} -o json: {e}: {text}"))
    }
}

#[test]
fn sandbox_command_and_file_verbs() {
    let server = Server::start();
    let cli = Cli::new(&server);
    let created = cli.json(&[
        "sandbox",
        "create",
        "--metadata",
        "owner=cli",
        "--resource",
        "memory=256Mi",
        "--env",
        "GREETING=hi",
        "--entrypoint",
        "tail",
        "--entrypoint",
        "-f",
        "--entrypoint",
        "/dev/null",
    ]);
    let id = created["id"].as_str().expect("id").to_string();
    assert_eq!(created["status"]["state"], "Running");

    // Table output by default, YAML on request.
    let table = cli.ok(&["sandbox", "get", &id]);
    assert!(
        table.contains("STATE") && table.contains("Running"),
        "{table}"
    );
    let yaml = cli.ok(&["sandbox", "list", "--metadata", "owner=cli", "-o", "yaml"]);
    assert!(yaml.contains(&format!("id: {id}")), "{yaml}");
    let listed = cli.json(&["sandbox", "list", "--state", "paused"]);
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(0));

    // Commands: output streamed, exit code passed through, argv quoted.
    let out = cli.run(&[
        "command",
        "run",
        &id,
        "echo $GREETING; echo oops >&2; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    assert_eq!(
        cli.ok(&["command", "run", &id, "echo", "a  b", "it's"]),
        "a  b it's\n"
    );
    let bg = cli.json(&[
        "command",
        "run",
        &id,
        "--background",
        "echo started; sleep 600",
    ]);
    let exec = bg["id"].as_str().expect("execution id").to_string();
    let status = cli.json(&["command", "status", &id, &exec]);
    assert_eq!(status["running"], true);
    cli.ok(&["command", "interrupt", &id, &exec]);

    let session = cli.json(&["command", "session", "create", &id, "--workdir", "/tmp"]);
    let sid = session["session_id"].as_str().expect("session").to_string();
    cli.ok(&[
        "command",
        "session",
        "run",
        &id,
        &sid,
        "export N=5; cd /etc",
    ]);
    assert_eq!(
        cli.ok(&["command", "session", "run", &id, &sid, "echo $N $PWD"]),
        "5 /etc\n"
    );
    cli.ok(&["command", "session", "delete", &id, &sid]);

    // Files.
    cli.ok(&[
        "file",
        "write",
        &id,
        "/tmp/w/a.txt",
        "--content",
        "one two one\n",
        "--mode",
        "600",
    ]);
    assert_eq!(
        cli.ok(&["file", "cat", &id, "/tmp/w/a.txt"]),
        "one two one\n"
    );
    let info = cli.json(&["file", "info", &id, "/tmp/w/a.txt"]);
    assert_eq!(info[0]["mode"], 600);
    let replaced = cli.json(&[
        "file",
        "replace",
        &id,
        "/tmp/w/a.txt",
        "--old",
        "one",
        "--new",
        "1",
    ]);
    assert_eq!(replaced["replacedCount"], 2);
    let local = server.dir.path().join("up.bin");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&local, &data).expect("local file");
    cli.ok(&[
        "file",
        "upload",
        &id,
        local.to_str().expect("path"),
        "/tmp/w/up.bin",
    ]);
    let back = server.dir.path().join("down.bin");
    cli.ok(&[
        "file",
        "download",
        &id,
        "/tmp/w/up.bin",
        back.to_str().expect("path"),
    ]);
    assert!(
        std::fs::read(&back).expect("downloaded") == data,
        "bytes differ"
    );
    cli.ok(&["file", "mkdir", &id, "/tmp/w/d/e"]);
    cli.ok(&["file", "mv", &id, "/tmp/w/a.txt", "/tmp/w/d/b.txt"]);
    cli.ok(&["file", "chmod", &id, "/tmp/w/d/b.txt", "--mode", "640"]);
    let found = cli.json(&["file", "search", &id, "/tmp/w", "--pattern", "**/*.txt"]);
    assert_eq!(found[0]["path"], "/tmp/w/d/b.txt");
    assert_eq!(found[0]["mode"], 640);
    let listed = cli.json(&["file", "ls", &id, "/tmp/w"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    cli.ok(&["file", "rm", &id, "/tmp/w/d/b.txt"]);
    cli.ok(&["file", "rmdir", &id, "/tmp/w"]);
    let gone = cli.run(&["file", "cat", &id, "/tmp/w/d/b.txt"]);
    assert_eq!(gone.status.code(), Some(1));

    // Egress policy.
    assert_eq!(cli.json(&["egress", "get", &id])["defaultAction"], "deny");
    let patched = cli.json(&[
        "egress",
        "patch",
        &id,
        "--rule",
        "allow=pypi.org",
        "--rule",
        "deny=*.example.com",
    ]);
    assert_eq!(patched["egress"][0]["target"], "pypi.org");
    let table = cli.ok(&["egress", "get", &id]);
    assert!(table.contains("(everything else)"), "{table}");
    assert_eq!(
        cli.json(&["egress", "delete", &id, "pypi.org", "*.example.com"])["egress"],
        serde_json::json!([])
    );
    let bad = cli.run(&["egress", "patch", &id, "--rule", "maybe=x.com"]);
    assert_eq!(bad.status.code(), Some(1));

    // Lifecycle verbs.
    let paused = cli.json(&["sandbox", "pause", &id]);
    assert_eq!(paused["status"]["state"], "Paused");
    let resumed = cli.json(&["sandbox", "resume", &id]);
    assert_eq!(resumed["status"]["state"], "Running");
    let renewed = cli.json(&["sandbox", "renew", &id, "--timeout", "7200"]);
    assert!(renewed["expiresAt"].is_string());
    let ep = cli.json(&["sandbox", "endpoint", &id, "--port", "8080"]);
    assert!(
        ep["endpoint"]
            .as_str()
            .is_some_and(|e| e.ends_with("/proxy/8080")),
        "{ep}"
    );
    assert!(cli.json(&["sandbox", "health", &id])["healthy"] == true);
    let metrics = cli.json(&["sandbox", "metrics", &id]);
    assert_eq!(metrics["mem_total_mib"], 256.0);
    assert!(cli.ok(&["sandbox", "kill", &id]).contains(&id));

    let gone = cli.run(&["sandbox", "get", &id]);
    assert_eq!(
        gone.status.code(),
        Some(1),
        "a killed sandbox is gone at once"
    );
    assert_no_trace(&server.data(), &id);

    // Errors: one line, non-zero.
    let out = cli.run(&["sandbox", "get", "no-such-sandbox"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("no-such-sandbox"), "{err}");
    let out = cli.run(&["command", "run", &id, "true"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a command in a deleted sandbox fails"
    );
}

#[test]
fn config_settings_are_used_and_checked() {
    let server = Server::start();
    let cli = Cli::new(&server);
    cli.ok(&["config", "init"]);
    assert_eq!(
        cli.run(&["config", "init"]).status.code(),
        Some(1),
        "init refuses to overwrite"
    );
    cli.ok(&["config", "set", "output.format", "json"]);
    cli.ok(&["config", "set", "connection.api_key", "from-config"]);
    let shown = cli.ok(&["config", "show"]);
    assert!(
        shown.contains("format = \"json\"") && !shown.contains("from-config"),
        "{shown}"
    );
    let bad = cli.run(&["config", "set", "output.format", "xml"]);
    assert_eq!(bad.status.code(), Some(1));
    // The config's format applies; the environment's key wins over the config's.
    let listed = cli.ok(&["sandbox", "list"]);
    assert!(
        serde_json::from_str::<serde_json::Value>(&listed).is_ok(),
        "{listed}"
    );
    let mode = std::fs::metadata(&cli.config).map(|m| {
        use std::os::unix::fs::PermissionsExt;
        m.permissions().mode() & 0o777
    });
    assert_eq!(
        mode.ok(),
        Some(0o600),
        "the settings file may hold a key: private"
    );
    // With only the config's (wrong) key the server refuses, with a hint.
    let out = cli
        .cmd(&["sandbox", "list"])
        .env_remove("OPEN_SANDBOX_API_KEY")
        .env("WARREN_DATA_DIR", server.dir.path().join("no-such-data"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("hint"));
}

#[test]
fn completions_are_generated() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(warren_bin())
            .args(["completions", shell])
            .output()
            .expect("completions");
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("sandbox") && text.contains("upload"),
            "{shell}"
        );
    }
}

/// Compares `text` with the snapshot `name` in tests/snapshots (insta: `INSTA_UPDATE=always` or
/// `cargo insta review` accepts a change).
fn check_snapshot(name: &str, text: &str) {
    insta::with_settings!({
        snapshot_path => snapshot_dir(),
        prepend_module_to_snapshot => false,
        omit_expression => true,
    }, {
        insta::assert_snapshot!(name, text);
    });
}

/// Table output of a few verbs, with what changes from run to run (ids, times) replaced.
#[test]
fn table_output_matches_snapshots() {
    let server = Server::start();
    let cli = Cli::new(&server);
    let id = cli.json(&[
        "sandbox",
        "create",
        "--metadata",
        "team=docs",
        "--entrypoint",
        "sleep",
        "--entrypoint",
        "infinity",
    ])["id"]
        .as_str()
        .expect("id")
        .to_string();
    let normalize = |text: String| -> String {
        text.replace(&id, "<id>")
            .lines()
            .map(|l| {
                let key = l.split_whitespace().next().unwrap_or("");
                if ["CREATED", "EXPIRES", "MODIFIED"].contains(&key) {
                    format!("{key}  <time>")
                } else if l.starts_with("/tmp/snap/") {
                    // PATH TYPE SIZE MODE OWNER MODIFIED: drop the time column
                    l.rsplit_once("  ")
                        .map(|(a, _)| a.trim_end().to_string())
                        .unwrap_or_default()
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
            + "\n"
    };
    // Owned by ids no host names (the `host` image shows the host's /etc/passwd, whose names for
    // uid 0 differ from one machine to the next).
    cli.ok(&[
        "file",
        "write",
        &id,
        "/tmp/snap/a.txt",
        "--content",
        "hello\n",
        "--mode",
        "640",
        "--owner",
        "4242",
        "--group",
        "4242",
    ]);
    cli.ok(&[
        "file",
        "mkdir",
        &id,
        "/tmp/snap/sub",
        "--owner",
        "4242",
        "--group",
        "4242",
    ]);
    let outputs: Vec<_> = [
        ("output-sandbox-get", vec!["sandbox", "get", id.as_str()]),
        (
            "output-file-ls",
            vec!["file", "ls", id.as_str(), "/tmp/snap"],
        ),
        ("output-egress-get", vec!["egress", "get", id.as_str()]),
    ]
    .into_iter()
    .map(|(name, args)| (name, normalize(cli.ok(&args))))
    .collect();
    cli.ok(&["sandbox", "kill", &id]);
    for (name, text) in outputs {
        check_snapshot(name, &text);
    }
}

fn snapshot_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots")
}

/// `warren … --help` for every group and a few leaves, compared with the files in tests/snapshots.
#[test]
fn help_matches_snapshots() {
    let paths: &[&[&str]] = &[
        &[],
        &["sandbox"],
        &["sandbox", "create"],
        &["command"],
        &["command", "run"],
        &["file"],
        &["config"],
        &["egress"],
        &["code", "run"],
        &["run"],
        &["image"],
        &["key"],
        &["desktop"],
    ];
    for p in paths {
        let mut args: Vec<&str> = p.to_vec();
        args.push("--help");
        let out = Command::new(warren_bin())
            .args(&args)
            .env("COLUMNS", "100")
            .output()
            .expect("help");
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let name = if p.is_empty() {
            "warren".to_string()
        } else {
            p.join("-")
        };
        check_snapshot(&format!("help-{name}"), &text);
    }
}

#[test]
fn shell_runs_a_script_from_stdin_and_exits_with_its_code() {
    let server = Server::start();
    let cli = Cli::new(&server);
    let created = cli.json(&["sandbox", "create"]);
    let id = created["id"].as_str().expect("id").to_string();
    let mut child = cli
        .cmd(&["shell", &id])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("warren shell");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(b"echo $((6*7))x; tty\nexit 3\n")
            .expect("script");
    }
    let out = child.wait_with_output().expect("wait");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("42x") && stdout.contains("/dev/pts/"),
        "{stdout}"
    );
    cli.ok(&["sandbox", "kill", &id]);
}

/// A sandbox that expires while a command runs, and one deleted during an upload: one clear line
/// each and a non-zero exit, not a hang or a backtrace.
#[test]
fn interrupted_work_fails_with_one_line() {
    let server = Server::start();
    let cli = Cli::new(&server);
    let id = cli.json(&["sandbox", "create"])["id"]
        .as_str()
        .expect("id")
        .to_string();
    // Expire it two seconds from now, mid-command.
    let soon = (chrono::Utc::now() + chrono::Duration::seconds(2)).to_rfc3339();
    let status = std::process::Command::new("curl")
        .args([
            "-sf",
            "-o",
            "/dev/null",
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "-H",
            &format!("OPEN-SANDBOX-API-KEY: {}", server.key),
            "-d",
            &format!("{{\"expiresAt\": \"{soon}\"}}"),
            &format!("{}/v1/sandboxes/{id}/renew-expiration", server.base()),
        ])
        .status()
        .expect("curl");
    assert!(status.success());
    let started = std::time::Instant::now();
    let out = cli.run(&["command", "run", &id, "sleep 60"]);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "the CLI noticed the end"
    );
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("ended") || err.contains("broke off"), "{err}");

    let id = cli.json(&["sandbox", "create"])["id"]
        .as_str()
        .expect("id")
        .to_string();
    let big = server.dir.path().join("big.sparse");
    std::fs::File::create(&big)
        .and_then(|f| f.set_len(4 << 30))
        .expect("sparse file");
    let upload = cli
        .cmd(&[
            "file",
            "upload",
            &id,
            big.to_str().expect("path"),
            "/tmp/big",
        ])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("upload");
    std::thread::sleep(std::time::Duration::from_millis(400));
    cli.ok(&["sandbox", "kill", &id]);
    let out = upload.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("uploading to /tmp/big"), "{err}");
}
