//! `POST /command` foreground and background, status, logs, interrupt, disconnect.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;

use crate::support::*;

#[tokio::test]
async fn foreground_streams_in_order_with_exact_framing() {
    let execd = Execd::start().await;
    let resp = execd
        .post_json("/command", json!({"command": "echo a; sleep 0.2; echo b"}))
        .await;
    assert_eq!(resp.status(), 200);
    let h = resp.headers();
    assert_eq!(h["content-type"], "text/event-stream");
    assert_eq!(h["cache-control"], "no-cache");
    assert_eq!(h["x-accel-buffering"], "no");
    assert!(h.get("content-length").is_none(), "must be chunked");
    let events = parse_events(&resp.text().await.expect("body"));
    assert_eq!(
        kinds(&events),
        ["init", "stdout", "stdout", "execution_complete"]
    );
    assert!(!events[0]["text"].as_str().expect("init text").is_empty());
    assert_eq!(events[1]["text"], "a");
    assert_eq!(events[2]["text"], "b");
    let t = events[3]["execution_time"]
        .as_i64()
        .expect("execution_time");
    assert!((150..5000).contains(&t), "execution_time {t}");
    assert!(events[3].get("error").is_none());
}

#[tokio::test]
async fn nonzero_exit_ends_with_error_event() {
    let execd = Execd::start().await;
    let events = execd.run(json!({"command": "echo oops >&2; exit 7"})).await;
    assert_eq!(kinds(&events), ["init", "stderr", "error"]);
    assert_eq!(events[1]["text"], "oops");
    let err = &events[2]["error"];
    assert_eq!(err["ename"], "CommandExecError");
    assert_eq!(err["evalue"], "7");
    assert_eq!(err["traceback"], json!(["exit status 7"]));
}

#[tokio::test]
async fn env_cwd_env_file_and_argv() {
    let execd = Execd::start().await;
    std::fs::create_dir(execd.work().join("sub")).expect("mkdir");
    let events = execd
        .run(json!({"command": "echo $FOO $FROM_FILE; pwd", "cwd": "sub", "envs": {"FOO": "bar"}}))
        .await;
    assert_eq!(
        kinds(&events).last().map(String::as_str),
        Some("execution_complete")
    );
    let expected = format!("bar yes\n{}\n", execd.work().join("sub").display());
    assert_eq!(text_of(&events, "stdout"), expected);

    let events = execd
        .run(json!({"argv": ["/bin/echo", "a  b", "$HOME"]}))
        .await;
    assert_eq!(text_of(&events, "stdout"), "a  b $HOME\n");
}

#[tokio::test]
async fn body_ends_when_command_ends_even_if_a_grandchild_holds_the_pipe() {
    let execd = Execd::start().await;
    let started = Instant::now();
    let events = execd
        .run(json!({"command": "sleep 3 & echo started"}))
        .await;
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(kinds(&events), ["init", "stdout", "execution_complete"]);
}

#[tokio::test]
async fn timeout_kills_the_group() {
    let execd = Execd::start().await;
    let pidfile = execd.dir.path().join("bg.pid");
    let started = Instant::now();
    let events = execd
        .run(json!({"command": format!("sleep 30 & echo $! > {}; wait", pidfile.display()), "timeout": 300}))
        .await;
    assert!(started.elapsed() < Duration::from_secs(3));
    let last = events.last().expect("events");
    assert_eq!(last["type"], "error");
    assert_eq!(last["error"]["evalue"], "-1");
    let pid = read_pid(&pidfile).await;
    assert!(
        wait_gone(pid, Duration::from_secs(2)).await,
        "grandchild {pid} survived the timeout"
    );
}

#[tokio::test]
async fn start_failures_are_error_events() {
    let execd = Execd::start().await;
    let events = execd
        .run(json!({"command": "true", "cwd": "/definitely/not/here"}))
        .await;
    assert_eq!(kinds(&events), ["init", "error"]);
    assert!(events[1]["error"]["evalue"]
        .as_str()
        .expect("evalue")
        .contains("/definitely/not/here"));

    let events = execd.run(json!({"argv": ["/no/such/binary"]})).await;
    assert_eq!(kinds(&events), ["init", "error"]);
    assert!(events[1]["error"]["evalue"]
        .as_str()
        .expect("evalue")
        .contains("No such file"));
}

#[tokio::test]
async fn invalid_requests_are_400_with_error_body() {
    let execd = Execd::start().await;
    let resp = execd
        .http
        .post(execd.url("/command"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("req");
    let (status, body) = error_body(resp).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("INVALID_REQUEST_BODY"))
    );

    let (status, body) =
        error_body(execd.post_json("/command", json!({"command": "  "})).await).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("INVALID_REQUEST_BODY"))
    );

    let (status, _) = error_body(
        execd
            .post_json("/command", json!({"command": "id", "gid": 0}))
            .await,
    )
    .await;
    assert_eq!(status, 400);

    let (status, _) = error_body(execd.post_json("/command", json!({"command": 5})).await).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn background_status_and_logs_with_cursor() {
    let execd = Execd::start().await;
    let started = Instant::now();
    let events = execd
        .run(
            json!({"command": "echo one; echo two >&2; sleep 0.4; echo three", "background": true}),
        )
        .await;
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "background must return at once"
    );
    assert_eq!(kinds(&events), ["init", "execution_complete"]);
    let id = events[0]["text"].as_str().expect("id").to_string();

    let st: serde_json::Value = execd
        .get(&format!("/command/status/{id}"))
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(st["running"], true);
    assert_eq!(st["id"], id.as_str());
    assert!(st["started_at"].is_string());

    let deadline = Instant::now() + Duration::from_secs(5);
    let st = loop {
        let st: serde_json::Value = execd
            .get(&format!("/command/status/{id}"))
            .await
            .json()
            .await
            .expect("json");
        if st["running"] == false {
            break st;
        }
        assert!(Instant::now() < deadline, "never finished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(st["exit_code"], 0);
    assert!(st["finished_at"].is_string());

    // the cursor is a byte offset, as in the reference: 3 lines of 4, 4 and 6 bytes
    let resp = execd.get(&format!("/command/{id}/logs?cursor=0")).await;
    assert_eq!(resp.headers()["EXECD-COMMANDS-TAIL-CURSOR"], "14");
    assert!(resp.headers()["content-type"]
        .to_str()
        .expect("ct")
        .starts_with("text/plain"));
    let mut lines: Vec<String> = resp
        .text()
        .await
        .expect("text")
        .lines()
        .map(String::from)
        .collect();
    lines[..2].sort();
    assert_eq!(lines, ["one", "two", "three"]);

    let resp = execd.get(&format!("/command/{id}/logs?cursor=8")).await;
    assert_eq!(resp.headers()["EXECD-COMMANDS-TAIL-CURSOR"], "14");
    assert_eq!(resp.text().await.expect("text"), "three\n");

    let resp = execd.get("/command/status/nope").await;
    assert_eq!(resp.status(), 404);
}

#[tokio::test]
async fn interrupt_kills_the_whole_group() {
    let execd = Execd::start().await;
    let (leader, child) = (
        execd.dir.path().join("leader"),
        execd.dir.path().join("child"),
    );
    let cmd = format!(
        "echo $$ > {}; sleep 60 & echo $! > {}; wait",
        leader.display(),
        child.display()
    );
    let events = execd.run(json!({"command": cmd, "background": true})).await;
    let id = events[0]["text"].as_str().expect("id").to_string();
    let (lp, cp) = (read_pid(&leader).await, read_pid(&child).await);
    assert!(pid_alive(lp) && pid_alive(cp));

    let resp = execd
        .http
        .delete(execd.url(&format!("/command?id={id}")))
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 200);
    assert!(
        wait_gone(lp, Duration::from_secs(3)).await,
        "leader survived"
    );
    assert!(
        wait_gone(cp, Duration::from_secs(3)).await,
        "group member survived"
    );
    let st: serde_json::Value = execd
        .get(&format!("/command/status/{id}"))
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(st["running"], false);

    let (status, body) = error_body(
        execd
            .http
            .delete(execd.url("/command"))
            .send()
            .await
            .expect("req"),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("MISSING_QUERY"))
    );
    let resp = execd
        .http
        .delete(execd.url("/command?id=unknown"))
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 404);
}

#[tokio::test]
async fn client_disconnect_kills_the_command() {
    let execd = Execd::start().await;
    let (leader, child) = (
        execd.dir.path().join("leader"),
        execd.dir.path().join("child"),
    );
    let cmd = format!(
        "echo $$ > {}; sleep 60 & echo $! > {}; echo ready; wait",
        leader.display(),
        child.display()
    );
    let resp = execd.post_json("/command", json!({"command": cmd})).await;
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("ready") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .expect("output")
            .expect("chunk");
        seen.push_str(&String::from_utf8_lossy(&chunk.expect("bytes")));
    }
    let (lp, cp) = (read_pid(&leader).await, read_pid(&child).await);
    drop(body);
    // Detection may take until the next keep-alive write (3 s).
    assert!(
        wait_gone(lp, Duration::from_secs(6)).await,
        "leader survived the disconnect"
    );
    assert!(
        wait_gone(cp, Duration::from_secs(2)).await,
        "group member survived the disconnect"
    );
}

#[tokio::test]
async fn pings_while_running() {
    let execd = Execd::start().await;
    let events = execd.run(json!({"command": "sleep 3.3; echo done"})).await;
    assert_eq!(
        kinds(&events),
        ["init", "ping", "stdout", "execution_complete"]
    );
    assert_eq!(events[1]["text"], "pong");
}

#[tokio::test]
async fn utf8_split_across_reads_is_preserved() {
    let execd = Execd::start().await;
    let events = execd
        .run(json!({"command": "printf '\\303'; sleep 0.1; printf '\\251\\n'"}))
        .await;
    assert_eq!(text_of(&events, "stdout"), "é\n");
}

/// The reference's framing, byte for byte: one event per line without its terminator (`\n`, `\r`,
/// `\r\n`), an empty line as "\n", a last line without terminator at the end, a line that pauses
/// midway still one event, a long line in pieces, bytes that are not UTF-8 as U+FFFD.
#[tokio::test]
async fn output_is_one_event_per_line_as_the_reference_frames_it() {
    let execd = Execd::start().await;
    let events = execd
        .run(json!({"command": concat!(
            "printf 'a\\nb\\r\\nc\\rd\\n\\n\\r\\n'; printf 'Name: '; sleep 0.2; echo ann; ",
            "printf 'e1\\ne2\\n' >&2; printf '\\377ok\\n'; printf 'last'; printf 'tail' >&2"
        )}))
        .await;
    assert_eq!(
        kinds(&events).last().map(String::as_str),
        Some("execution_complete")
    );
    assert_eq!(
        lines_of(&events, "stdout"),
        [
            "a",
            "b",
            "c",
            "d",
            "\n",
            "\n",
            "Name: ann",
            "\u{FFFD}ok",
            "last"
        ]
    );
    assert_eq!(lines_of(&events, "stderr"), ["e1", "e2", "tail"]);

    let long = warren_execd::lines::MAX_LINE * 2 + 10;
    let events = execd
        .run(json!({"command": format!("head -c {long} /dev/zero | tr '\\0' x; echo; echo end")}))
        .await;
    let lines = lines_of(&events, "stdout");
    assert_eq!(
        lines.iter().map(String::len).collect::<Vec<_>>(),
        [
            warren_execd::lines::MAX_LINE,
            warren_execd::lines::MAX_LINE,
            10,
            3
        ]
    );
}

/// A background command's logs stay the bytes it wrote (`GET /command/{id}/logs` is text, not
/// events).
#[tokio::test]
async fn background_logs_keep_the_output_as_written() {
    let execd = Execd::start().await;
    let events = execd
        .run(json!({"command": "printf 'a\\r\\n\\nb\\rlast'", "background": true}))
        .await;
    let id = events[0]["text"].as_str().expect("id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let body = execd
            .get(&format!("/command/{id}/logs?cursor=0"))
            .await
            .text()
            .await
            .expect("logs");
        if body == "a\r\n\nb\rlast" {
            break;
        }
        assert!(Instant::now() < deadline, "logs were {body:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
