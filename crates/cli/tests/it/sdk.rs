//! `warren-sdk` against a real `warren serve`: every call of the SDK, its streaming, its errors, and
//! the quickstart example from its docs, run as written.
//!
//! Why one file: it covers one crate's whole surface against a real server, a test per area
//! (lifecycle, commands, files, errors, config, terminals, egress, vault), sharing the client and
//! request helpers at its top.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sha2::Digest;
use warren_sdk::{
    Client, CodeTarget, Config, CreateSandboxRequest, Error, EventKind, ImageSpec, ListQuery,
    Ownership, RunCommandRequest, SandboxState,
};

use crate::harness::{assert_no_trace, free_port, Server};

#[path = "../../../sdk/examples/quickstart.rs"]
mod quickstart;

fn sdk(server: &Server) -> Client {
    Client::new(Config::new(&server.base()).with_api_key(&server.key))
}

fn host() -> CreateSandboxRequest {
    CreateSandboxRequest {
        image: Some(ImageSpec {
            uri: "host".into(),
            auth: None,
        }),
        timeout: Some(600),
        entrypoint: Some(vec!["tail".into(), "-f".into(), "/dev/null".into()]),
        ..Default::default()
    }
}

async fn wait_for(client: &Client, id: &str, want: SandboxState) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = client.get(id).await.expect("get");
        if info.status.state == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{id} never became {want:?}: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn quickstart_example_runs_as_written() {
    let server = Server::start();
    let out = quickstart::quickstart(&sdk(&server))
        .await
        .expect("quickstart");
    assert!(out.starts_with("hello from the sandbox\n"), "{out:?}");
}

#[tokio::test]
async fn lifecycle_calls() {
    let server = Server::start();
    let client = sdk(&server);
    client.health().await.expect("health");
    let mut req = host();
    req.metadata = Some(BTreeMap::from([("team".into(), "sdk".into())]));
    let mut sb = client.create(&req).await.expect("create");
    assert_eq!(sb.info().status.state, SandboxState::Running);
    let id = sb.id().to_string();

    let other = client.create(&host()).await.expect("second create");
    let listed = client
        .list(&ListQuery {
            metadata: BTreeMap::from([("team".into(), "sdk".into())]),
            states: vec![SandboxState::Running],
            ..Default::default()
        })
        .await
        .expect("list");
    let ids: Vec<&str> = listed.items.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, vec![id.as_str()], "metadata filter");
    let paged = client
        .list(&ListQuery {
            page_size: 1,
            ..Default::default()
        })
        .await
        .expect("page");
    assert_eq!(paged.items.len(), 1);
    assert!(paged.pagination.has_next_page);

    let patched = client
        .patch_metadata(
            &id,
            &BTreeMap::from([
                ("team".to_string(), None),
                ("stage".to_string(), Some("two".to_string())),
            ]),
        )
        .await
        .expect("patch");
    assert_eq!(
        patched.metadata,
        BTreeMap::from([("stage".to_string(), "two".to_string())])
    );

    let before = sb.info().expires_at.clone().expect("expiry");
    let after = sb.renew(Duration::from_secs(3600)).await.expect("renew");
    assert!(after > before, "{after} after {before}");
    assert_eq!(sb.refresh().await.expect("refresh").expires_at, Some(after));

    sb.pause().await.expect("pause");
    wait_for(&client, &id, SandboxState::Paused).await;
    let err = sb.pause().await.expect_err("second pause");
    assert_eq!(err.status(), Some(409), "{err}");
    sb.resume().await.expect("resume");
    wait_for(&client, &id, SandboxState::Running).await;
    assert_eq!(sb.run("echo back").await.expect("run").stdout, "back\n");

    let ep = sb.endpoint(8000).await.expect("endpoint");
    assert!(
        ep.endpoint.contains(&format!("/sandboxes/{id}/proxy/8000")),
        "{ep:?}"
    );
    assert!(!ep.headers.is_empty(), "the endpoint carries its token");
    let metrics = sb.metrics().await.expect("metrics");
    assert!(metrics.cpu_count > 0.0);

    // Connecting by id gives an equivalent handle.
    let again = client.connect(&id).await.expect("connect");
    assert!(again.ping().await);

    sb.kill().await.expect("kill");
    other.kill().await.expect("kill other");
    assert_eq!(
        sb.kill().await.expect_err("double kill").status(),
        Some(404)
    );
    assert_no_trace(&server.data(), &id);
}

#[tokio::test]
async fn commands_stream_and_report_exit_codes() {
    let server = Server::start();
    let sb = sdk(&server).create(&host()).await.expect("create");

    let out = sb.run("echo out; echo err >&2; exit 3").await.expect("run");
    assert_eq!(
        (out.stdout.as_str(), out.stderr.as_str()),
        ("out\n", "err\n")
    );
    assert_eq!(out.exit_code, 3);
    assert!(!out.success());

    // Events arrive as they happen: the first line comes before the command ends.
    let started = Instant::now();
    let mut events = sb
        .stream(&RunCommandRequest {
            command: Some("echo one; sleep 1; echo two".into()),
            ..Default::default()
        })
        .await
        .expect("stream");
    let mut kinds = Vec::new();
    let mut first_out = None;
    while let Some(ev) = events.next().await {
        let ev = ev.expect("event");
        if ev.kind == EventKind::Stdout && first_out.is_none() {
            first_out = Some(started.elapsed());
        }
        kinds.push(ev.kind);
    }
    assert_eq!(kinds.first(), Some(&EventKind::Init));
    assert_eq!(kinds.last(), Some(&EventKind::ExecutionComplete));
    assert!(
        first_out.is_some_and(|t| t < Duration::from_millis(900)),
        "first output was not streamed: {first_out:?}"
    );

    let out = sb
        .stream(&RunCommandRequest {
            command: Some("echo $GREETING; pwd".into()),
            cwd: Some("/tmp".into()),
            envs: Some(BTreeMap::from([("GREETING".into(), "hi".into())])),
            ..Default::default()
        })
        .await
        .expect("stream")
        .collect_output()
        .await
        .expect("output");
    assert_eq!(out.stdout, "hi\n/tmp\n");

    // Background: status, logs with a cursor, interrupt.
    let id = sb
        .spawn(&RunCommandRequest {
            command: Some("echo a; echo b; sleep 600".into()),
            ..Default::default()
        })
        .await
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(10);
    let logs = loop {
        let logs = sb.logs(&id, None).await.expect("logs");
        if logs.text == "a\nb\n" || Instant::now() > deadline {
            break logs;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(logs.text, "a\nb\n");
    let tail = sb.logs(&id, logs.cursor).await.expect("logs after cursor");
    assert_eq!(tail.text, "", "nothing new after the cursor");
    assert!(sb.status(&id).await.expect("status").running);
    sb.interrupt(&id).await.expect("interrupt");
    let deadline = Instant::now() + Duration::from_secs(10);
    while sb.status(&id).await.expect("status").running {
        assert!(
            Instant::now() < deadline,
            "interrupt did not end the command"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(sb
        .status("no-such-command")
        .await
        .expect_err("unknown")
        .is_not_found());

    // Sessions keep shell state.
    let session = sb.session(Some("/tmp")).await.expect("session");
    session.run("cd /etc && X=42").await.expect("first");
    let out = session.run("echo $X $(pwd)").await.expect("second");
    assert_eq!(out.stdout, "42 /etc\n");
    session.close().await.expect("close");

    sb.kill().await.expect("kill");
}

#[tokio::test]
async fn files_stream_both_ways_and_keep_their_bytes() {
    let server = Server::start();
    let sb = sdk(&server).create(&host()).await.expect("create");
    let dir = tempfile::tempdir().expect("tempdir");

    // 24 MiB of non-repeating bytes, up and back down, checksummed on both sides.
    let local = dir.path().join("big.bin");
    let mut data = Vec::with_capacity(24 << 20);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while data.len() < 24 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&x.to_le_bytes());
    }
    std::fs::write(&local, &data).expect("write local");
    let want = hex::encode(sha2::Sha256::digest(&data));
    sb.upload(&local, "/tmp/up/big.bin", &Ownership::mode(0o600))
        .await
        .expect("upload");
    let inside = sb
        .run("sha256sum /tmp/up/big.bin")
        .await
        .expect("sha256sum");
    assert_eq!(inside.stdout.split_whitespace().next(), Some(want.as_str()));
    let info = sb.stat("/tmp/up/big.bin").await.expect("stat");
    assert_eq!((info.size, info.mode), (24 << 20, 600));
    let back = dir.path().join("back.bin");
    assert_eq!(
        sb.download_to("/tmp/up/big.bin", &back)
            .await
            .expect("download"),
        24 << 20
    );
    let got = std::fs::read(&back).expect("read back");
    assert_eq!(hex::encode(sha2::Sha256::digest(&got)), want);

    // A byte range.
    let mut part = Vec::new();
    let mut s = sb
        .download("/tmp/up/big.bin", Some((10, Some(19))))
        .await
        .expect("range");
    while let Some(c) = s.next().await {
        part.extend_from_slice(&c.expect("chunk"));
    }
    assert_eq!(part, data[10..20]);

    sb.write("/tmp/work/a.txt", "hello world, hello\n")
        .await
        .expect("write");
    assert_eq!(
        sb.replace("/tmp/work/a.txt", "hello", "bye")
            .await
            .expect("replace"),
        2
    );
    assert_eq!(
        sb.read_to_string("/tmp/work/a.txt").await.expect("read"),
        "bye world, bye\n"
    );
    sb.chmod("/tmp/work/a.txt", &Ownership::mode(0o640))
        .await
        .expect("chmod");
    assert_eq!(sb.stat("/tmp/work/a.txt").await.expect("stat").mode, 640);
    sb.mkdir("/tmp/work/sub/deeper", &Ownership::default())
        .await
        .expect("mkdir");
    sb.mv("/tmp/work/a.txt", "/tmp/work/sub/b.txt")
        .await
        .expect("mv");
    let found: Vec<String> = sb
        .search("/tmp/work", "**/*.txt")
        .await
        .expect("search")
        .into_iter()
        .map(|f| f.path)
        .collect();
    assert_eq!(found, vec!["/tmp/work/sub/b.txt".to_string()]);
    let listed: Vec<String> = sb
        .list_dir("/tmp/work/sub", 1)
        .await
        .expect("list")
        .into_iter()
        .map(|f| f.path)
        .collect();
    assert_eq!(listed, vec!["/tmp/work/sub/b.txt", "/tmp/work/sub/deeper"]);
    sb.remove_files(&["/tmp/work/sub/b.txt"]).await.expect("rm");
    assert!(sb
        .stat("/tmp/work/sub/b.txt")
        .await
        .expect_err("gone")
        .is_not_found());
    sb.remove_dir("/tmp/work").await.expect("rmdir");
    assert!(sb
        .read("/tmp/work/sub")
        .await
        .expect_err("gone")
        .is_not_found());

    sb.kill().await.expect("kill");
}

#[tokio::test]
async fn errors_are_told_apart() {
    let server = Server::start();

    let wrong = Client::new(Config::new(&server.base()).with_api_key("wrong"));
    let err = wrong
        .list(&ListQuery::default())
        .await
        .expect_err("wrong key");
    assert!(err.is_unauthorized(), "{err}");

    let nowhere = Client::new(Config::new(&format!("127.0.0.1:{}", free_port())));
    assert!(
        matches!(nowhere.health().await, Err(Error::Unreachable { .. })),
        "a closed port is unreachable"
    );

    let client = sdk(&server);
    let err = client
        .connect("no-such-sandbox")
        .await
        .expect_err("unknown");
    assert!(err.is_not_found(), "{err}");
    assert!(err.to_string().contains("no-such-sandbox"), "{err}");

    let mut bad = host();
    bad.image = Some(ImageSpec {
        uri: "no/such:image".into(),
        auth: None,
    });
    let err = client.create(&bad).await.expect_err("unknown image");
    assert_eq!(err.status(), Some(404), "{err}");
    assert_eq!(err.code(), Some("SANDBOX::IMAGE_NOT_FOUND"));

    // A handle on a sandbox that is gone fails with the server's answer, not a hang.
    let sb = client.create(&host()).await.expect("create");
    sb.kill().await.expect("kill");
    let err = sb.run("true").await.expect_err("run after kill");
    assert!(matches!(err, Error::Api { .. }), "{err}");

    // Code on an image whose kernels cannot start is a clear error too.
    let sb = client.create(&host()).await.expect("create");
    let err = sb
        .run_code("1+1", &CodeTarget::Language("no-such-language".into()))
        .await
        .expect_err("unknown language");
    assert_eq!(err.status(), Some(400), "{err}");
    sb.kill().await.expect("kill");
}

#[test]
fn config_finds_a_local_servers_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("api-key"), "generated\n").expect("key");
    let data = dir.path().display().to_string();
    let cfg = Config::from_lookup(|k| match k {
        "WARREN_DATA_DIR" => Some(data.clone()),
        _ => None,
    });
    assert_eq!(cfg.api_key.as_deref(), Some("generated"));
    assert_eq!(cfg.base_url, "http://127.0.0.1:8080");
    let cfg = Config::from_lookup(|k| match k {
        "OPEN_SANDBOX_DOMAIN" => Some("https://sandbox.example:9443/".into()),
        "OPEN_SANDBOX_API_KEY" => Some("explicit".into()),
        "WARREN_DATA_DIR" => Some(data.clone()),
        _ => None,
    });
    assert_eq!(cfg.api_key.as_deref(), Some("explicit"));
    assert_eq!(cfg.base_url, "https://sandbox.example:9443");
    assert!(
        !format!("{cfg:?}").contains("explicit"),
        "Debug hides the key"
    );
}

/// Reads terminal events until `want` shows up in the output; returns all output seen.
async fn read_until(reader: &mut warren_sdk::PtyReader, want: &str) -> String {
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while !seen.contains(want) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, reader.next()).await {
            Ok(Some(Ok(warren_sdk::PtyEvent::Output(b) | warren_sdk::PtyEvent::Stderr(b)))) => {
                seen.push_str(&String::from_utf8_lossy(&b))
            }
            Ok(Some(Ok(warren_sdk::PtyEvent::Replay { data, .. }))) => {
                seen.push_str(&String::from_utf8_lossy(&data))
            }
            Ok(Some(Ok(_))) => {}
            other => panic!("waiting for {want:?}: {other:?}; output so far: {seen:?}"),
        }
    }
    seen
}

#[tokio::test]
async fn terminals_are_real_ttys_that_resize_replay_and_move_between_clients() {
    use warren_sdk::{PtyEvent, PtyOptions};
    let server = Server::start();
    let sb = sdk(&server).create(&host()).await.expect("create");
    let id = sb.create_pty(Some("/tmp"), None).await.expect("pty");
    assert!(
        !sb.pty_status(&id).await.expect("status").running,
        "starts on first attach"
    );

    let (mut w, mut r) = sb
        .attach_pty(&id, &PtyOptions::default())
        .await
        .expect("attach")
        .split();
    w.resize(120, 40).await.expect("resize");
    w.write(b"tty; stty size; pwd; echo $((6*7))x\n")
        .await
        .expect("write");
    let out = read_until(&mut r, "42x").await;
    assert!(out.contains("/dev/pts/"), "a real terminal: {out:?}");
    assert!(out.contains("40 120"), "resized: {out:?}");
    assert!(out.contains("/tmp"), "cwd: {out:?}");

    // Ctrl-C reaches the foreground job through the signal control frame.
    w.write(b"sleep 600; echo after-sleep\n")
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.signal("SIGINT").await.expect("signal");
    w.write(b"echo interrupted-$((1+1))\n")
        .await
        .expect("write");
    let out = read_until(&mut r, "interrupted-2").await;
    assert!(
        !out.contains("\nafter-sleep"),
        "the sleep was interrupted, not finished: {out:?}"
    );

    // A second client is refused, unless it takes over; it can replay what it missed.
    let err = sb
        .attach_pty(&id, &PtyOptions::default())
        .await
        .err()
        .expect("second attach refused");
    assert_eq!(err.status(), Some(409), "{err}");
    let (mut w2, mut r2) = sb
        .attach_pty(
            &id,
            &PtyOptions {
                since: Some(0),
                takeover: true,
                ..Default::default()
            },
        )
        .await
        .expect("takeover")
        .split();
    let replayed = read_until(&mut r2, "42x").await;
    assert!(
        replayed.contains("/dev/pts/"),
        "replay from 0: {replayed:?}"
    );
    let mut evicted = false;
    while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_secs(5), r.next()).await {
        if matches!(ev, Ok(PtyEvent::TakenOver)) {
            evicted = true;
            break;
        }
    }
    assert!(evicted, "the first client is told it was taken over");

    w2.write(b"exit 5\n").await.expect("exit");
    let mut code = None;
    while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_secs(10), r2.next()).await {
        if let Ok(PtyEvent::Exit(c)) = ev {
            code = Some(c);
            break;
        }
    }
    assert_eq!(code, Some(5));
    let st = sb.pty_status(&id).await.expect("status");
    assert_eq!((st.running, st.exit_code), (false, Some(5)));
    sb.delete_pty(&id).await.expect("delete");
    assert!(sb.pty_status(&id).await.expect_err("gone").is_not_found());

    // Pipe mode keeps stderr apart.
    let id = sb
        .create_pty(None, Some("echo out; echo err >&2"))
        .await
        .expect("pty");
    let (_w, mut r) = sb
        .attach_pty(
            &id,
            &PtyOptions {
                pipe: true,
                ..Default::default()
            },
        )
        .await
        .expect("attach")
        .split();
    let (mut out, mut err, mut code) = (String::new(), String::new(), None);
    while let Ok(Some(Ok(ev))) = tokio::time::timeout(Duration::from_secs(10), r.next()).await {
        match ev {
            PtyEvent::Output(b) => out.push_str(&String::from_utf8_lossy(&b)),
            PtyEvent::Stderr(b) => err.push_str(&String::from_utf8_lossy(&b)),
            PtyEvent::Exit(c) => {
                code = Some(c);
                break;
            }
            _ => {}
        }
    }
    assert_eq!(
        (out.as_str(), err.as_str(), code),
        ("out\n", "err\n", Some(0))
    );

    // A session left running is ended with the sandbox.
    let left = sb.create_pty(None, None).await.expect("pty");
    let (_w, _r) = sb
        .attach_pty(&left, &PtyOptions::default())
        .await
        .expect("attach")
        .split();
    let sid = sb.id().to_string();
    sb.kill().await.expect("kill");
    assert_no_trace(&server.data(), &sid);
}

/// The egress policy through the SDK (no traffic is sent: only the policy and the link change).
#[tokio::test]
async fn egress_policy_calls() {
    use warren_sdk::NetworkRule;
    let server = Server::start();
    let sb = sdk(&server).create(&host()).await.expect("create");
    let st = sb.egress_policy().await.expect("get");
    assert_eq!(
        (st.mode.as_str(), st.policy.default_action.as_str()),
        ("deny_all", "deny")
    );
    let out = sb.run("ls /sys/class/net").await.expect("ls");
    assert_eq!(
        out.stdout.split_whitespace().collect::<Vec<_>>(),
        ["lo"],
        "deny-all: no link"
    );

    let st = sb
        .patch_egress_rules(&[
            NetworkRule::allow("pypi.org"),
            NetworkRule::deny("10.0.0.0/8"),
        ])
        .await
        .expect("patch");
    assert_eq!(st.mode, "rules");
    assert_eq!(st.policy.egress.len(), 2);
    let out = sb.run("ls /sys/class/net").await.expect("ls");
    assert!(
        out.stdout.contains("eth0"),
        "an allow rule gives the sandbox its link: {}",
        out.stdout
    );
    let st = sb.delete_egress_rules(&["pypi.org"]).await.expect("delete");
    assert_eq!(st.policy.egress, vec![NetworkRule::deny("10.0.0.0/8")]);
    // Rules limited to ports, with and without a target, read back as written.
    let scoped = [
        NetworkRule::allow("203.0.113.7").on_ports([443, 8443]),
        NetworkRule::deny("").on_ports([25]),
    ];
    let st = sb.patch_egress_rules(&scoped).await.expect("patch ports");
    assert_eq!(st.policy.egress[..2], scoped);
    let err = sb
        .patch_egress_rules(&[NetworkRule::allow("pypi.org").on_ports([443])])
        .await
        .expect_err("a name with ports");
    assert_eq!(err.status(), Some(400), "{err}");
    let err = sb
        .patch_egress_rules(&[NetworkRule::allow("not a name")])
        .await
        .expect_err("bad rule");
    assert_eq!(err.status(), Some(400), "{err}");
    sb.kill().await.expect("kill");
}

/// The credential vault's API through the SDK and the CLI (no traffic: what the vault holds and
/// shows, and the CA the sandbox now trusts).
#[tokio::test]
async fn credential_vault_calls() {
    let server = Server::start();
    let mut req = host();
    req.network_policy = Some(
        serde_json::json!({"defaultAction": "deny", "egress": [{"action": "allow", "target": "api.example.test"}]}),
    );
    req.credential_proxy = Some(serde_json::json!({"enabled": true}));
    let sb = sdk(&server).create(&req).await.expect("create");
    let secret = "sk-test-0123456789abcdef";
    let state = sb
        .create_vault(&serde_json::json!({
            "credentials": [{"name": "api", "source": {"type": "inline", "value": secret}}],
            "bindings": [{"name": "b", "match": {"hosts": ["api.example.test"]}, "auth": {"type": "apiKey", "name": "X-Key", "credential": "api"}}]
        }))
        .await
        .expect("create vault");
    assert_eq!(state.revision, 1);
    assert_eq!(
        sb.vault_credential("api")
            .await
            .expect("credential")
            .source_type,
        "inline"
    );
    assert_eq!(
        sb.vault_binding("b").await.expect("binding").auth["name"],
        "X-Key"
    );
    assert!(sb
        .vault_binding("nope")
        .await
        .expect_err("missing")
        .is_not_found());
    let err = sb
        .patch_vault(&serde_json::json!({"expectedRevision": 9}))
        .await
        .expect_err("stale");
    assert_eq!(err.status(), Some(409), "{err}");
    let err = sb
        .patch_vault(&serde_json::json!({"bindings": {"add": [{"name": "c", "match": {"hosts": ["x.test"]}, "auth": {"type": "bearer", "credential": "missing"}}]}}))
        .await
        .expect_err("dangling credential");
    assert_eq!(err.status(), Some(400), "{err}");

    // The CA is trusted inside; the secret is nowhere inside.
    let out = sb
        .run("echo $SSL_CERT_FILE; grep -c 'BEGIN CERTIFICATE' $SSL_CERT_FILE")
        .await
        .expect("env");
    let mut lines = out.stdout.lines();
    assert_eq!(lines.next(), Some("/opt/opensandbox/ca-bundle.crt"));
    assert!(
        lines
            .next()
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| n >= 1),
        "{}",
        out.stdout
    );
    let out = sb
        .run(&format!(
            "grep -rl '{secret}' /opt /tmp /root /proc/[0-9]*/environ 2>/dev/null | wc -l"
        ))
        .await
        .expect("grep");
    assert_eq!(out.stdout.trim(), "0");

    // The CLI shows the same, without values.
    let cli = std::process::Command::new(crate::harness::warren_bin())
        .args([
            "credential-vault",
            "-o",
            "json",
            "get",
            sb.id(),
            "--domain",
            &server.base(),
            "--api-key",
            &server.key,
        ])
        .env("WARREN_CLI_CONFIG", server.dir.path().join("cli.toml"))
        .output()
        .expect("cli");
    let text = String::from_utf8_lossy(&cli.stdout);
    assert!(
        cli.status.success() && text.contains("\"X-Key\"") && !text.contains(secret),
        "{text}"
    );

    sb.delete_vault().await.expect("delete");
    assert!(sb.vault().await.expect("get").bindings.is_empty());
    // Without the proxy on, the vault API says so.
    let plain = sdk(&server).create(&host()).await.expect("create");
    let err = plain.vault().await.expect_err("no proxy");
    assert_eq!(err.status(), Some(412), "{err}");
    plain.kill().await.expect("kill");
    sb.kill().await.expect("kill");
    let log = std::fs::read_to_string(server.dir.path().join("server.log")).unwrap_or_default();
    assert!(!log.contains(secret), "a secret reached the server's log");
}
