//! Calls from the server to a sandbox's execd: reading and writing a file inside the sandbox (so
//! every path is resolved inside the sandbox, never on the host; used to put the credential vault's
//! CA into the sandbox's trust store), and reading the output execd keeps (diagnostics).

use crate::execd_conns::ExecdEndpoint;
use axum::body::Body;
use http_body_util::BodyExt;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// One request to execd, bounded in time and in answer size (the sandbox is not trusted).
async fn call(endpoint: &ExecdEndpoint, req: http::Request<Body>) -> Result<(u16, Vec<u8>), Error> {
    tokio::time::timeout(
        std::time::Duration::from_secs(15),
        call_unbounded(endpoint, req),
    )
    .await
    .map_err(|_| "the sandbox's execd did not answer in time")?
}

/// Sends `req` to execd over a connection of its own; the answer's body is left to read.
async fn send(
    endpoint: &ExecdEndpoint,
    req: http::Request<Body>,
) -> Result<http::Response<hyper::body::Incoming>, Error> {
    let mut sender = crate::execd_conns::open(endpoint).await?;
    Ok(sender.send_request(req).await?)
}

async fn call_unbounded(
    endpoint: &ExecdEndpoint,
    req: http::Request<Body>,
) -> Result<(u16, Vec<u8>), Error> {
    let resp = send(endpoint, req).await?;
    let status = resp.status().as_u16();
    let body = http_body_util::Limited::new(resp.into_body(), 8 << 20)
        .collect()
        .await?
        .to_bytes()
        .to_vec();
    Ok((status, body))
}

fn encode(path: &str) -> String {
    form_urlencoded::byte_serialize(path.as_bytes()).collect()
}

/// The file's bytes, or `None` when it does not exist.
pub async fn read(endpoint: &ExecdEndpoint, path: &str) -> Result<Option<Vec<u8>>, Error> {
    let req = http::Request::get(format!("/files/download?path={}", encode(path)))
        .header(http::header::HOST, "localhost")
        .body(Body::empty())?;
    match call(endpoint, req).await? {
        (200, body) => Ok(Some(body)),
        (404, _) => Ok(None),
        (status, body) => Err(format!(
            "reading {path}: HTTP {status}: {}",
            String::from_utf8_lossy(&body)
        )
        .into()),
    }
}

/// Writes (creates or replaces) a file, mode 644.
pub async fn write(endpoint: &ExecdEndpoint, path: &str, data: &[u8]) -> Result<(), Error> {
    let boundary = "warren-server-upload";
    let meta = serde_json::json!({"path": path, "mode": 644});
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\
         Content-Type: application/json\r\n\r\n{meta}\r\n--{boundary}\r\nContent-Disposition: form-data; \
         name=\"file\"; filename=\"file\"\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(data);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let req = http::Request::post("/files/upload")
        .header(http::header::HOST, "localhost")
        .header(
            http::header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(Body::from(body))?;
    match call(endpoint, req).await? {
        (200, _) => Ok(()),
        (status, body) => Err(format!(
            "writing {path}: HTTP {status}: {}",
            String::from_utf8_lossy(&body)
        )
        .into()),
    }
}

/// What the entrypoint and execd printed (execd's bounded ring), and how many older bytes the ring
/// dropped.
pub async fn output(endpoint: &ExecdEndpoint) -> Result<(Vec<u8>, u64), Error> {
    let req = http::Request::get("/logs")
        .header(http::header::HOST, "localhost")
        .body(Body::empty())?;
    let call = async {
        let resp = send(endpoint, req).await?;
        let status = resp.status().as_u16();
        let dropped = resp
            .headers()
            .get("x-warren-dropped-bytes")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        // execd keeps 1 MiB; more is not its answer
        let body = http_body_util::Limited::new(resp.into_body(), 2 << 20)
            .collect()
            .await?
            .to_bytes()
            .to_vec();
        Ok::<_, Error>((status, body, dropped))
    };
    let (status, body, dropped) = tokio::time::timeout(std::time::Duration::from_secs(15), call)
        .await
        .map_err(|_| "the sandbox's execd did not answer in time")??;
    if status != 200 {
        return Err(format!("execd answered HTTP {status}").into());
    }
    Ok((body, dropped))
}

/// Whether something inside the sandbox accepts connections on its loopback `port`: execd's proxy
/// answers at once that nothing is reachable there, or goes on to talk to whatever listens.
pub async fn port_open(endpoint: &ExecdEndpoint, port: u16) -> Result<bool, Error> {
    let req = http::Request::get(format!("/proxy/{port}/"))
        .header(http::header::HOST, "localhost")
        .body(Body::empty())?;
    match tokio::time::timeout(
        std::time::Duration::from_secs(2),
        call_unbounded(endpoint, req),
    )
    .await
    {
        // Connected, and whatever listens has not answered an HTTP request (it need not speak HTTP).
        Err(_) => Ok(true),
        Ok(Ok((502, body))) => Ok(!String::from_utf8_lossy(&body).contains("nothing reachable")),
        Ok(Ok(_)) => Ok(true),
        Ok(Err(e)) => Err(e),
    }
}

/// `GET path` on execd (a `/proxy/{port}/…` path reaches a port inside the sandbox): the status
/// and up to 64 KiB of the answer. Bounded in time by the caller.
pub async fn get(endpoint: &ExecdEndpoint, path: &str) -> Result<(u16, Vec<u8>), Error> {
    let req = http::Request::get(path)
        .header(http::header::HOST, "localhost")
        .body(Body::empty())?;
    let resp = send(endpoint, req).await?;
    let status = resp.status().as_u16();
    let body = http_body_util::Limited::new(resp.into_body(), 64 * 1024)
        .collect()
        .await?
        .to_bytes()
        .to_vec();
    Ok((status, body))
}

/// Runs `command` in the sandbox (`sh -c`, as execd runs commands) and returns its exit code
/// (-1 when it ended without one), answered within 15 s.
pub async fn run(endpoint: &ExecdEndpoint, command: &str) -> Result<i32, Error> {
    let ran = tokio::time::timeout(
        std::time::Duration::from_secs(15),
        run_request(endpoint, serde_json::json!({"command": command})),
    )
    .await
    .map_err(|_| "the sandbox's execd did not answer in time")??;
    Ok(ran.exit_code.unwrap_or(-1))
}

/// How a command run by [`run_argv`] ended, and the end of what it printed.
pub struct Ran {
    /// `None`: it ended without an exit code (killed at its timeout, a signal).
    pub exit_code: Option<i32>,
    pub error: Option<String>,
    /// stdout and stderr as they came, the last 64 KiB of them.
    pub output: String,
}

/// Runs the argument list `argv` in the sandbox, as it is (no shell), for at most `timeout` (execd
/// kills its process group then), reading its output as it comes and keeping the end of it.
pub async fn run_argv(
    endpoint: &ExecdEndpoint,
    argv: &[String],
    timeout: std::time::Duration,
) -> Result<Ran, Error> {
    let body = serde_json::json!({"argv": argv, "timeout": timeout.as_millis() as u64});
    run_request(endpoint, body).await
}

/// Sends a `POST /command` body and reads its event stream as it comes: the output's end, and
/// how the command ended.
async fn run_request(endpoint: &ExecdEndpoint, body: serde_json::Value) -> Result<Ran, Error> {
    const KEPT: usize = 64 * 1024;
    let body = body.to_string();
    let req = http::Request::post("/command")
        .header(http::header::HOST, "localhost")
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))?;
    let resp = send(endpoint, req).await?;
    let status = resp.status().as_u16();
    if status != 200 {
        let text = http_body_util::Limited::new(resp.into_body(), 64 * 1024)
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        return Err(format!("execd answered HTTP {status}: {}", text.trim()).into());
    }
    let mut body = resp.into_body();
    let mut pending: Vec<u8> = Vec::new();
    let mut ran = Ran {
        exit_code: None,
        error: None,
        output: String::new(),
    };
    let mut ended = false;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        pending.extend_from_slice(&data);
        while let Some(i) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim().trim_start_matches("data:").trim();
            let Ok(ev) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            match ev["type"].as_str() {
                Some("stdout") | Some("stderr") => {
                    if let Some(t) = ev["text"].as_str() {
                        ran.output.push_str(t);
                        if !t.ends_with('\n') {
                            ran.output.push('\n');
                        }
                        if ran.output.len() > 2 * KEPT {
                            let mut cut = ran.output.len() - KEPT;
                            while !ran.output.is_char_boundary(cut) {
                                cut += 1;
                            }
                            ran.output.drain(..cut);
                        }
                    }
                }
                Some("execution_complete") => {
                    ran.exit_code = Some(0);
                    ended = true;
                }
                Some("error") => {
                    let value = ev["error"]["evalue"].as_str().unwrap_or_default();
                    match value.parse::<i32>() {
                        Ok(c) if c >= 0 => ran.exit_code = Some(c),
                        _ => {
                            let why: Vec<&str> = ev["error"]["traceback"]
                                .as_array()
                                .map(|t| t.iter().filter_map(|l| l.as_str()).collect())
                                .unwrap_or_default();
                            ran.error = Some(if why.is_empty() {
                                format!("ended without an exit code ({value})")
                            } else {
                                why.join("; ")
                            });
                        }
                    }
                    ended = true;
                }
                _ => {}
            }
        }
    }
    if !ended {
        return Err("the command's stream ended without its exit code".into());
    }
    Ok(ran)
}
