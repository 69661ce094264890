//! Persistent shell sessions.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::*;

async fn run(execd: &Execd, sid: &str, body: Value) -> Vec<Value> {
    let resp = execd.post_json(&format!("/session/{sid}/run"), body).await;
    assert_eq!(resp.status(), 200);
    parse_events(&resp.text().await.expect("body"))
}

#[tokio::test]
async fn session_keeps_state_and_separates_streams() {
    let execd = Execd::start().await;
    std::fs::create_dir(execd.work().join("sub")).expect("mkdir");
    let resp = execd
        .http
        .post(execd.url("/session"))
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 200);
    let sid = resp.json::<Value>().await.expect("json")["session_id"]
        .as_str()
        .expect("id")
        .to_string();

    let ev = run(
        &execd,
        &sid,
        json!({"command": "cd sub && export X=42 && f() { echo fn$1; }"}),
    )
    .await;
    assert_eq!(kinds(&ev), ["init", "execution_complete"]);
    assert_eq!(ev[0]["text"], sid.as_str());

    let ev = run(
        &execd,
        &sid,
        json!({"command": "echo $X; pwd; f 1; echo -n partial"}),
    )
    .await;
    assert_eq!(
        lines_of(&ev, "stdout"),
        [
            "42".to_owned(),
            execd.work().join("sub").display().to_string(),
            "fn1".to_owned(),
            "partial".to_owned()
        ]
    );

    // Framed as `/command` frames it: a line per event, whatever the terminator.
    let ev = run(
        &execd,
        &sid,
        json!({"command": "printf 'a\\r\\nb\\rc\\n\\nd'; printf 'x\\ny' >&2"}),
    )
    .await;
    assert_eq!(lines_of(&ev, "stdout"), ["a", "b", "c", "\n", "d"]);
    assert_eq!(lines_of(&ev, "stderr"), ["x", "y"]);
    assert_eq!(
        kinds(&ev).last().map(String::as_str),
        Some("execution_complete")
    );

    let ev = run(
        &execd,
        &sid,
        json!({"command": "echo 'it'\"'\"'s' ; echo err >&2; false"}),
    )
    .await;
    assert_eq!(text_of(&ev, "stdout"), "it's\n");
    assert_eq!(text_of(&ev, "stderr"), "err\n");
    assert_eq!(ev.last().expect("last")["error"]["evalue"], "1");

    // A syntax error must not desynchronise the shell.
    let ev = run(&execd, &sid, json!({"command": "if then"})).await;
    assert_eq!(ev.last().expect("last")["type"], "error");
    let ev = run(
        &execd,
        &sid,
        json!({"command": "echo $X", "cwd": execd.work().display().to_string()}),
    )
    .await;
    assert_eq!(text_of(&ev, "stdout"), "42\n");

    // A timeout kills the command but not the session.
    let started = Instant::now();
    let ev = run(&execd, &sid, json!({"command": "sleep 20", "timeout": 300})).await;
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(ev.last().expect("last")["type"], "error");
    let ev = run(&execd, &sid, json!({"command": "echo alive $X"})).await;
    assert_eq!(text_of(&ev, "stdout"), "alive 42\n");

    let resp = execd
        .http
        .delete(execd.url(&format!("/session/{sid}")))
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 200);
    let resp = execd
        .post_json(&format!("/session/{sid}/run"), json!({"command": "true"}))
        .await;
    assert_eq!(resp.status(), 404);
    let resp = execd
        .http
        .delete(execd.url(&format!("/session/{sid}")))
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 404);
}

#[tokio::test]
async fn session_with_cwd_and_bad_body() {
    let execd = Execd::start().await;
    let resp = execd
        .post_json(
            "/session",
            json!({"cwd": execd.dir.path().display().to_string()}),
        )
        .await;
    let sid = resp.json::<Value>().await.expect("json")["session_id"]
        .as_str()
        .expect("id")
        .to_string();
    let ev = run(&execd, &sid, json!({"command": "pwd"})).await;
    assert_eq!(
        text_of(&ev, "stdout"),
        format!("{}\n", execd.dir.path().display())
    );
    let resp = execd
        .http
        .post(execd.url(&format!("/session/{sid}/run")))
        .body("{\"cmd\":1}")
        .send()
        .await
        .expect("req");
    let (status, body) = error_body(resp).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("INVALID_REQUEST_BODY"))
    );
}
