//! The lifecycle state machine over raw HTTP, each scenario ending with a check that the host holds
//! nothing of the sandbox.

use std::time::Duration;

use reqwest::Method;
use serde_json::json;

use crate::harness::{assert_no_trace, wait_state, Server};

fn host(entrypoint: &[&str]) -> serde_json::Value {
    json!({"image": {"uri": "host"}, "timeout": 600, "resourceLimits": {"cpu": "500m", "memory": "256Mi"}, "entrypoint": entrypoint})
}

#[tokio::test]
async fn create_pause_resume_delete_leaves_nothing() {
    let server = Server::start();
    let c = server.client();
    let r = c.create(host(&["tail", "-f", "/dev/null"])).await;
    assert_eq!(r.status, 202, "{:?}", r.json);
    assert_eq!(r.json["status"]["state"], "Running");
    let id = r.json["id"].as_str().expect("id").to_string();

    // Ready means ready: the very first command works, and limits are in force.
    let (out, code) = c.exec(&id, "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max").await;
    assert_eq!(code, 0);
    assert_eq!(out.trim(), (256u64 << 20).to_string());

    assert_eq!(
        c.call(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None)
            .await
            .status,
        202
    );
    assert_eq!(
        c.call(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None)
            .await
            .status,
        409
    );
    let ep = c
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/endpoints/44772"),
            None,
        )
        .await;
    let token = ep.json["headers"]["X-Warren-Sandbox-Token"]
        .as_str()
        .expect("token")
        .to_string();
    let paused = c
        .http
        .get(format!(
            "http://{}/ping",
            ep.json["endpoint"].as_str().expect("ep")
        ))
        .header("X-Warren-Sandbox-Token", &token)
        .send()
        .await
        .expect("ping");
    assert_eq!(
        paused.status(),
        409,
        "a paused sandbox answers 409 through the proxy, not a hang"
    );
    assert_eq!(
        c.call(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None)
            .await
            .status,
        202
    );
    assert_eq!(c.exec(&id, "echo back").await, ("back\n".to_string(), 0));

    let no_token = c
        .http
        .get(format!(
            "http://{}/ping",
            ep.json["endpoint"].as_str().expect("ep")
        ))
        .send()
        .await
        .expect("ping");
    assert_eq!(no_token.status(), 401);

    assert_eq!(
        c.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await
            .status,
        204
    );
    let gone = c
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(
        gone.status, 404,
        "a deleted sandbox is gone at once, as in the reference"
    );
    let again = c
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(again.status, 404);
    assert!(again.json["code"].is_string() && again.json["message"].is_string());
    assert_no_trace(&server.data(), &id);
}

#[tokio::test]
async fn failed_create_leaves_nothing() {
    let server = Server::start();
    let c = server.client();
    let r = c.create(host(&["/no/such/entrypoint"])).await;
    assert!(r.status >= 400, "{:?}", r.json);
    assert!(r.json["code"].is_string() && r.json["message"].is_string());
    let message = r.json["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("/no/such/entrypoint") && message.contains("No such file"),
        "the error says what could not start and why: {message}"
    );
    let list = c.call(Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(
        list.json["items"].as_array().map(Vec::len),
        Some(0),
        "a failed create must not be listed"
    );
    let left: Vec<_> = std::fs::read_dir(server.data().join("sandboxes"))
        .expect("dir")
        .flatten()
        .collect();
    assert!(left.is_empty(), "sandbox folders left: {left:?}");
    let (records, _) = warren_store::Store::open(&server.data())
        .and_then(|s| s.load_all())
        .expect("records");
    assert!(records.is_empty(), "records left: {records:?}");
}

#[tokio::test]
async fn entrypoint_exit_marks_the_sandbox_and_releases_it() {
    let server = Server::start();
    let c = server.client();
    let r = c.create(host(&["sh", "-c", "sleep 0.3; exit 4"])).await;
    assert_eq!(r.status, 202, "{:?}", r.json);
    let id = r.json["id"].as_str().expect("id").to_string();
    let sb = wait_state(&c, &id, &["Failed"], Duration::from_secs(10)).await;
    assert!(
        sb["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains('4'),
        "{sb:?}"
    );
    assert_no_trace(&server.data(), &id);
}

#[tokio::test]
async fn restart_readopts_running_sandboxes_and_keeps_expiry() {
    let mut server = Server::start();
    let c = server.client();
    let r = c.create(host(&["tail", "-f", "/dev/null"])).await;
    let id = r.json["id"].as_str().expect("id").to_string();
    let soon = (chrono::Utc::now() + chrono::Duration::seconds(2)).to_rfc3339();
    let renew = c
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/renew-expiration"),
            Some(json!({"expiresAt": soon})),
        )
        .await;
    assert_eq!(renew.status, 200, "{:?}", renew.json);
    server.kill9();
    let dir = std::mem::replace(&mut server.dir, tempfile::tempdir().expect("tempdir"));
    drop(server);
    let server = Server::start_in(dir);
    let c = server.client();
    let sb = c
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(sb.json["status"]["state"], "Running", "{:?}", sb.json);
    assert_eq!(c.exec(&id, "echo alive").await.0, "alive\n");
    let sb = wait_state(&c, &id, &["Terminated"], Duration::from_secs(10)).await;
    assert_eq!(sb["status"]["reason"], "ttl_expiry");
    assert_no_trace(&server.data(), &id);
}

/// The server holds a descriptor or more per sandbox (a pidfd, parked proxy connections). Started
/// with a soft open-file limit of 128 — what many systems give is 1024 — it still runs more
/// sandboxes than that (it raises its soft limit to the hard one), while the sandboxes themselves
/// get the limit it started with. Before, creates failed with EMFILE at about 100 sandboxes here.
#[tokio::test]
async fn more_sandboxes_than_the_open_file_limit_it_started_with() {
    const SOFT: usize = 128;
    let mut hard = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    assert_eq!(
        // SAFETY: getrlimit fills the struct, which lives for the call.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard) },
        0
    );
    if (hard.rlim_max as usize) < 4 * SOFT {
        panic!(
            "the hard open-file limit ({}) is too low for this test",
            hard.rlim_max
        );
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let nofile = format!("--nofile={SOFT}:{}", hard.rlim_max);
    let server = Server::start_under(dir, &["prlimit", &nofile]);
    let soft_of = |pid: u32| -> String {
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .expect("open files line")
            .to_string();
        line.split_whitespace().nth(3).expect("soft").to_string()
    };
    assert_eq!(soft_of(server.child.id()), hard.rlim_max.to_string());

    let c = server.client();
    let mut ids = Vec::new();
    let mut failed = None;
    for n in 1..=SOFT + 32 {
        let r = c.create(host(&["tail", "-f", "/dev/null"])).await;
        if r.status != 202 {
            failed = Some(format!("create #{n}: {} {:?}", r.status, r.json));
            break;
        }
        ids.push(r.json["id"].as_str().expect("id").to_string());
    }
    // Every one answers through the proxy (which parks a connection per sandbox), with the limit
    // the server started with.
    let mut answers = Vec::new();
    if failed.is_none() {
        for id in ids.iter().step_by(8).chain(ids.last()) {
            answers.push((id.clone(), c.exec(id, "ulimit -Sn").await));
        }
    }
    // Deleted before any assertion, so a failure leaves no sandbox running.
    for id in &ids {
        let r = c
            .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await;
        assert_eq!(r.status, 204, "{:?}", r.json);
    }
    assert_eq!(failed, None);
    for (id, (out, code)) in answers {
        assert_eq!(
            (code, out.trim()),
            (0, SOFT.to_string().as_str()),
            "sandbox {id}"
        );
    }
    for id in &ids {
        assert_no_trace(&server.data(), id);
    }
}

/// Whether the command that prints it ran on execd's spare shell (whose command line is the
/// bootstrap, not `bash -c <command>`).
const SPARE_OR_FRESH: &str =
    r#"tr "\0" " " </proc/$$/cmdline | grep -q "__warren_[g]o" && echo spare || echo fresh"#;

/// `[runtime] spare_shell = false` turns execd's spare shell off in every sandbox, unless a create
/// sets `WARREN_SPARE_SHELL` itself; by default a command after a pause runs on the spare.
#[tokio::test]
async fn the_server_wide_spare_shell_switch_reaches_every_sandbox_and_a_create_can_override_it() {
    let after_a_pause = |server: &Server, env: serde_json::Value| {
        let c = server.client();
        let server_data = server.data();
        async move {
            let mut body = host(&["tail", "-f", "/dev/null"]);
            body["env"] = env;
            let r = c.create(body).await;
            assert_eq!(r.status, 202, "{:?}", r.json);
            let id = r.json["id"].as_str().expect("id").to_string();
            // Past execd's idle pause, so a spare shell is waiting where it is on.
            tokio::time::sleep(Duration::from_millis(600)).await;
            let (out, code) = c.exec(&id, SPARE_OR_FRESH).await;
            assert_eq!(code, 0, "{out}");
            let (env_out, _) = c.exec(&id, "echo \"[$WARREN_SPARE_SHELL]\"").await;
            assert_eq!(
                c.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
                    .await
                    .status,
                204
            );
            assert_no_trace(&server_data, &id);
            (out.trim().to_string(), env_out.trim().to_string())
        }
    };
    let default = Server::start();
    assert_eq!(
        after_a_pause(&default, json!({})).await,
        ("spare".to_string(), "[]".to_string())
    );
    let off = Server::start_configured("[runtime]\nspare_shell = false\n");
    assert_eq!(
        after_a_pause(&off, json!({})).await,
        ("fresh".to_string(), "[0]".to_string())
    );
    assert_eq!(
        after_a_pause(&off, json!({"WARREN_SPARE_SHELL": "1"})).await,
        ("spare".to_string(), "[1]".to_string()),
        "the create's own setting wins"
    );
}

/// `[limits] default_ephemeral_storage` bounds every sandbox whose create leaves the limit out: a
/// write past it fails inside the sandbox, which carries on; the bound's disk goes with the delete.
#[tokio::test]
async fn the_server_wide_disk_bound_reaches_creates_that_leave_it_out() {
    let server = Server::start_configured("[limits]\ndefault_ephemeral_storage = \"48Mi\"\n");
    let c = server.client();
    let r = c.create(host(&["tail", "-f", "/dev/null"])).await;
    assert_eq!(r.status, 202, "{:?}", r.json);
    let id = r.json["id"].as_str().expect("id").to_string();
    let (out, code) = c
        .exec(
            &id,
            "head -c 64M /dev/zero 2>&1 > /big; echo \"exit=$?\"; rm -f /big",
        )
        .await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("No space left on device") && out.contains("exit=1"),
        "{out}"
    );
    let (out, code) = c.exec(&id, "echo small > /small && cat /small").await;
    assert_eq!((code, out.trim()), (0, "small"));
    assert_eq!(
        c.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await
            .status,
        204
    );
    assert_no_trace(&server.data(), &id);
}
