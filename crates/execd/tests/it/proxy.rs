//! `/proxy/{port}/...` to a loopback test server: plain HTTP with a body, WebSocket-style upgrade, and 502.

use std::time::Duration;

use axum::routing::any;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

async fn echo_server() -> u16 {
    let app = axum::Router::new().route(
        "/{*rest}",
        any(
            |method: axum::http::Method,
             uri: axum::http::Uri,
             headers: axum::http::HeaderMap,
             body: String| async move {
                let x = headers
                    .get("x-test")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                format!("{method} {uri} x={x} body={body}")
            },
        ),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = l.local_addr().expect("addr").port();
    tokio::spawn(async move { axum::serve(l, app).await });
    port
}

/// Accepts one upgrade request, answers 101 and then echoes bytes.
async fn upgrade_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = l.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.expect("accept");
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut b).await.expect("read");
            head.push(b[0]);
        }
        let head = String::from_utf8_lossy(&head).to_lowercase();
        assert!(
            head.contains("upgrade: websocket"),
            "upgrade header not forwarded: {head}"
        );
        s.write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 1024];
        loop {
            let n = s.read(&mut buf).await.expect("read");
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).await.expect("echo");
        }
    });
    port
}

#[tokio::test]
async fn proxies_http_with_path_query_headers_and_body() {
    let execd = Execd::start().await;
    let port = echo_server().await;
    let resp = execd
        .http
        .post(execd.url(&format!("/proxy/{port}/some/path?q=1&r=two")))
        .header("x-test", "yes")
        .body("payload")
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.text().await.expect("t"),
        "POST /some/path?q=1&r=two x=yes body=payload"
    );
}

#[tokio::test]
async fn proxies_upgrades_bidirectionally() {
    let execd = Execd::start().await;
    let port = upgrade_server().await;
    let addr = execd.base.trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "GET /proxy/{port}/ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut b))
            .await
            .expect("timely")
            .expect("read");
        head.push(b[0]);
    }
    assert!(
        String::from_utf8_lossy(&head).starts_with("HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    for msg in [&b"hello"[..], b"second frame"] {
        s.write_all(msg).await.expect("write");
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
            .await
            .expect("timely")
            .expect("read");
        assert_eq!(got, msg);
    }
}

#[tokio::test]
async fn nothing_listening_is_502() {
    let execd = Execd::start().await;
    let port = free_port();
    let resp = execd.get(&format!("/proxy/{port}/x")).await;
    let (status, _) = error_body(resp).await;
    assert_eq!(status, 502);
}
