//! File and directory routes, including a 50 MiB chunked upload and streamed download.

use std::os::unix::fs::PermissionsExt;

use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::support::*;

const BOUNDARY: &str = "opensandbox_0123abcd_1700000000";

fn part_header(name: &str, filename: &str, ctype: &str) -> String {
    format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{filename}\"\r\nContent-Type: {ctype}\r\n\r\n"
    )
}

/// Deterministic pseudo-random bytes (xorshift), so the checksum covers real content.
fn data(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Uploads `files` (path, mode, content) as one chunked multipart body.
async fn upload(execd: &Execd, files: Vec<(String, u32, Bytes)>) -> reqwest::Response {
    upload_to(execd, "/files/upload", files).await
}

/// [`upload`] to `route` (the plain one, or one with an identity).
async fn upload_to(
    execd: &Execd,
    route: &str,
    files: Vec<(String, u32, Bytes)>,
) -> reqwest::Response {
    let mut chunks: Vec<Bytes> = Vec::new();
    for (path, mode, content) in files {
        let meta = json!({"path": path, "owner": null, "group": null, "mode": mode}).to_string();
        chunks.push(Bytes::from(
            part_header("metadata", "metadata", "application/json") + &meta + "\r\n",
        ));
        chunks.push(Bytes::from(part_header(
            "file",
            "blob",
            "application/octet-stream",
        )));
        let mut off = 0;
        while off < content.len() {
            let end = (off + 64 * 1024).min(content.len());
            chunks.push(content.slice(off..end));
            off = end;
        }
        chunks.push(Bytes::from_static(b"\r\n"));
    }
    chunks.push(Bytes::from(format!("--{BOUNDARY}--\r\n")));
    let body = reqwest::Body::wrap_stream(futures::stream::iter(
        chunks.into_iter().map(Ok::<_, std::io::Error>),
    ));
    execd
        .http
        .post(execd.url(route))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(body)
        .send()
        .await
        .expect("upload")
}

#[tokio::test]
async fn upload_and_download_50_mib_checksummed() {
    let execd = Execd::start().await;
    let content = Bytes::from(data(50 * 1024 * 1024 + 123));
    let want = hex::encode(Sha256::digest(&content));
    let target = execd.work().join("deep/dir/big.bin");
    let resp = upload(
        &execd,
        vec![
            (target.display().to_string(), 600, content.clone()),
            ("small.txt".to_string(), 755, Bytes::from_static(b"hello\n")),
        ],
    )
    .await;
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    let meta = std::fs::metadata(&target).expect("uploaded");
    assert_eq!(meta.len(), content.len() as u64);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let small = execd.work().join("small.txt");
    assert_eq!(std::fs::read(&small).expect("small"), b"hello\n");
    assert_eq!(
        std::fs::metadata(&small).expect("m").permissions().mode() & 0o777,
        0o755
    );

    let resp = execd
        .http
        .get(execd.url("/files/download"))
        .query(&[("path", target.display().to_string())])
        .send()
        .await
        .expect("download");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-length"],
        content.len().to_string().as_str()
    );
    assert!(resp.headers()["content-disposition"]
        .to_str()
        .expect("cd")
        .contains("big.bin"));
    let mut hasher = Sha256::new();
    let mut n = 0usize;
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("chunk");
        n += chunk.len();
        hasher.update(&chunk);
    }
    assert_eq!(n, content.len());
    assert_eq!(hex::encode(hasher.finalize()), want);
}

#[tokio::test]
async fn upload_rejects_file_without_metadata() {
    let execd = Execd::start().await;
    let body = format!(
        "{}data\r\n--{BOUNDARY}--\r\n",
        part_header("file", "x", "text/plain")
    );
    let resp = execd
        .http
        .post(execd.url("/files/upload"))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(body)
        .send()
        .await
        .expect("req");
    let (status, body) = error_body(resp).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("INVALID_FILE_METADATA"))
    );
}

#[tokio::test]
async fn ranges_and_line_mode() {
    let execd = Execd::start().await;
    let f = execd.work().join("r.txt");
    std::fs::write(&f, "l1\nl2\nl3\nl4\nl5").expect("write");
    let get = |range: Option<&'static str>, query: Vec<(&'static str, String)>| {
        let mut q = vec![("path", f.display().to_string())];
        q.extend(query);
        let mut req = execd.http.get(execd.url("/files/download")).query(&q);
        if let Some(r) = range {
            req = req.header("range", r);
        }
        req.send()
    };
    let resp = get(Some("bytes=3-7"), vec![]).await.expect("req");
    assert_eq!(resp.status(), 206);
    assert_eq!(resp.headers()["content-range"], "bytes 3-7/14");
    assert_eq!(resp.text().await.expect("t"), "l2\nl3");
    let resp = get(Some("bytes=-2"), vec![]).await.expect("req");
    assert_eq!(resp.status(), 206);
    assert_eq!(resp.text().await.expect("t"), "l5");
    let resp = get(Some("bytes=14-"), vec![]).await.expect("req");
    assert_eq!(resp.status(), 416);
    assert_eq!(resp.headers()["content-range"], "bytes */14");

    let resp = get(None, vec![("offset", "2".into()), ("limit", "2".into())])
        .await
        .expect("req");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .expect("ct")
        .starts_with("text/plain"));
    // joined, with no newline after the last line, as the reference answers
    assert_eq!(resp.text().await.expect("t"), "l2\nl3");
    let resp = get(None, vec![("offset", "4".into())]).await.expect("req");
    assert_eq!(resp.text().await.expect("t"), "l4\nl5");

    let resp = execd.get("/files/download?path=/no/such/file").await;
    let (status, body) = error_body(resp).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("FILE_NOT_FOUND"))
    );
    let resp = execd.get("/files/download").await;
    let (status, body) = error_body(resp).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("MISSING_QUERY"))
    );
}

#[tokio::test]
async fn info_permissions_mv_replace_search_delete() {
    let execd = Execd::start().await;
    let w = execd.work();
    std::fs::write(w.join("a.txt"), "foo bar foo\n").expect("write");
    std::fs::set_permissions(w.join("a.txt"), std::fs::Permissions::from_mode(0o640))
        .expect("chmod");

    let info: Value = execd
        .get("/files/info?path=a.txt&path=")
        .await
        .json()
        .await
        .expect("json");
    let a = &info["a.txt"];
    assert_eq!(a["type"], "file");
    assert_eq!(a["size"], 12);
    assert_eq!(a["mode"], 640);
    assert_eq!(a["path"], w.join("a.txt").display().to_string());
    for k in ["modified_at", "created_at", "owner", "group"] {
        assert!(a[k].is_string(), "{k} in {a}");
    }
    assert!(chrono::DateTime::parse_from_rfc3339(a["modified_at"].as_str().expect("s")).is_ok());

    let resp = execd
        .post_json("/files/permissions", json!({"a.txt": {"mode": 600}}))
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        std::fs::metadata(w.join("a.txt"))
            .expect("m")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let resp = execd
        .post_json("/files/permissions", json!({"a.txt": {"mode": 999}}))
        .await;
    assert_eq!(resp.status(), 400);

    let resp = execd
        .post_json(
            "/files/replace?verbose=true",
            json!({"a.txt": {"old": "foo", "new": "baz"}}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.json::<Value>().await.expect("json"),
        json!({"a.txt": {"replacedCount": 2}})
    );
    assert_eq!(
        std::fs::read_to_string(w.join("a.txt")).expect("r"),
        "baz bar baz\n"
    );
    let resp = execd
        .post_json("/files/replace", json!({"a.txt": {"old": "", "new": "x"}}))
        .await;
    assert_eq!(resp.status(), 400);

    std::fs::create_dir(w.join("d")).expect("mkdir");
    let resp = execd
        .post_json("/files/mv", json!([{"src": "a.txt", "dest": "d/b.txt"}]))
        .await;
    assert_eq!(resp.status(), 200);
    assert!(!w.join("a.txt").exists() && w.join("d/b.txt").exists());
    let resp = execd
        .post_json(
            "/files/mv",
            json!([{"src": "d/b.txt", "dest": "nodir/c.txt"}]),
        )
        .await;
    assert_eq!(resp.status(), 404);

    std::fs::write(w.join("d/c.log"), "").expect("write");
    std::fs::create_dir(w.join("d/e")).expect("mkdir");
    std::fs::write(w.join("d/e/f.txt"), "").expect("write");
    let found: Vec<Value> = execd
        .http
        .get(execd.url(&format!(
            "/files/search?path={}&pattern=*.txt",
            w.join("d").display()
        )))
        .send()
        .await
        .expect("req")
        .json()
        .await
        .expect("json");
    let paths: Vec<&str> = found
        .iter()
        .map(|f| f["path"].as_str().expect("p"))
        .collect();
    assert_eq!(
        paths,
        [
            w.join("d/b.txt").display().to_string(),
            w.join("d/e/f.txt").display().to_string()
        ]
    );
    let all: Vec<Value> = execd
        .get("/files/search?path=d")
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(all.len(), 3, "default pattern ** finds every file: {all:?}");

    let resp = execd
        .http
        .delete(execd.url("/files?path=d/b.txt&path=d/c.log"))
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 200);
    assert!(!w.join("d/b.txt").exists() && !w.join("d/c.log").exists());
    let resp = execd
        .http
        .delete(execd.url("/files?path=d"))
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 400, "a directory is not a file");

    let resp = execd.get("/files/info?path=missing").await;
    let (status, body) = error_body(resp).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("FILE_NOT_FOUND"))
    );
}

#[tokio::test]
async fn directories_mkdir_list_rm() {
    let execd = Execd::start().await;
    let w = execd.work();
    let resp = execd
        .post_json(
            "/directories",
            json!({"x/y/z": {"mode": 700}, "q": {"mode": 755}}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        std::fs::metadata(w.join("x/y/z"))
            .expect("m")
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    std::fs::write(w.join("x/file"), "1").expect("write");
    std::os::unix::fs::symlink(w.join("q"), w.join("x/link")).expect("symlink");

    let list: Vec<Value> = execd
        .get("/directories/list?path=x")
        .await
        .json()
        .await
        .expect("json");
    let got: Vec<(String, String)> = list
        .iter()
        .map(|f| {
            (
                f["path"].as_str().expect("p").to_string(),
                f["type"].as_str().expect("t").to_string(),
            )
        })
        .collect();
    let p = |s: &str| w.join(s).display().to_string();
    assert_eq!(
        got,
        [
            (p("x/file"), "file".into()),
            (p("x/link"), "symlink".into()),
            (p("x/y"), "directory".into())
        ]
    );
    let deep: Vec<Value> = execd
        .get("/directories/list?path=x&depth=3")
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(deep.len(), 4);
    let none: Vec<Value> = execd
        .get("/directories/list?path=x&depth=0")
        .await
        .json()
        .await
        .expect("json");
    assert!(none.is_empty(), "depth 0 lists nothing: {none:?}");
    // a folder's contents come right after it, as the reference walks
    std::fs::write(w.join("x/y.txt"), "").expect("write");
    let order: Vec<String> = execd
        .get("/directories/list?path=x&depth=2")
        .await
        .json::<Vec<Value>>()
        .await
        .expect("json")
        .iter()
        .map(|f| f["path"].as_str().expect("p").to_string())
        .collect();
    assert_eq!(
        order,
        [p("x/file"), p("x/link"), p("x/y"), p("x/y/z"), p("x/y.txt")]
    );

    let resp = execd.get("/directories/list?path=x/link").await;
    assert_eq!(resp.status(), 400, "symlinked directory is refused");

    let resp = execd
        .http
        .delete(execd.url("/directories?path=x"))
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 200);
    assert!(!w.join("x").exists());
    assert!(w.join("q").exists(), "symlink target must survive rm -rf");

    let resp = execd
        .http
        .post(execd.url("/directories"))
        .header("content-type", "application/json")
        .body("[1,2")
        .send()
        .await
        .expect("req");
    let (status, body) = error_body(resp).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("INVALID_REQUEST_BODY"))
    );
}

/// A tree deeper than any thread's stack could walk recursively (std's `remove_dir_all` recursed
/// once per level and aborted execd): made by descriptor, since its paths pass `PATH_MAX`.
fn deep_tree(root: &std::path::Path, levels: usize) {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    std::fs::create_dir(root).expect("root");
    let mut fd = OwnedFd::from(std::fs::File::open(root).expect("open root"));
    for _ in 0..levels {
        // SAFETY: mkdirat/openat on an open folder with a NUL-terminated name; the new
        // descriptor is owned at once.
        unsafe {
            assert_eq!(libc::mkdirat(fd.as_raw_fd(), c"d".as_ptr(), 0o755), 0);
            let child = libc::openat(
                fd.as_raw_fd(),
                c"d".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            );
            assert!(child >= 0, "open level");
            fd = OwnedFd::from_raw_fd(child);
        }
    }
}

#[tokio::test]
async fn a_directory_deeper_than_any_stack_is_deleted() {
    let execd = Execd::start().await;
    deep_tree(&execd.work().join("deep"), 100_000);
    let resp = execd
        .http
        .delete(execd.url("/directories?path=deep"))
        .send()
        .await
        .expect("execd answers, not aborts");
    assert_eq!(resp.status(), 200);
    assert!(!execd.work().join("deep").exists());
    assert_eq!(execd.get("/ping").await.status(), 200, "execd still serves");
}

/// `/v1/filesystem/{uid}/{gid}/…`: the same routes, with the kernel checking every permission as
/// that user and group, and what they make theirs.
#[tokio::test]
async fn files_with_an_identity_are_that_users() {
    use std::os::unix::fs::MetadataExt;
    let execd = Execd::start().await;
    let w = execd.work();
    std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let private = w.join("private");
    std::fs::create_dir(&private).expect("mkdir");
    std::fs::write(private.join("secret.txt"), "only 41001").expect("write");
    std::fs::set_permissions(
        private.join("secret.txt"),
        std::fs::Permissions::from_mode(0o600),
    )
    .expect("chmod");
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    for p in [private.clone(), private.join("secret.txt")] {
        std::os::unix::fs::chown(&p, Some(41001), Some(41000)).expect("chown");
    }
    let secret = private.join("secret.txt").display().to_string();
    let download = |who: &str| format!("/v1/filesystem/{who}/files/download?path={secret}");

    let owner = execd.get(&download("41001/41000")).await;
    assert_eq!(owner.status(), 200);
    assert_eq!(owner.text().await.expect("body"), "only 41001");
    let other = execd.get(&download("41002/41000")).await;
    assert_eq!(other.status(), 403, "another user may not read it");
    let root = execd.get(&download("0/0")).await;
    assert_eq!(root.status(), 200, "identity 0 is root's");

    // What the identity makes is its own; where it may not write, nothing is made.
    let resp = upload_to(
        &execd,
        "/v1/filesystem/41001/41000/files/upload",
        vec![(
            private.join("new.txt").display().to_string(),
            644,
            Bytes::from_static(b"mine"),
        )],
    )
    .await;
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    let meta = std::fs::metadata(private.join("new.txt")).expect("made");
    assert_eq!((meta.uid(), meta.gid()), (41001, 41000));
    let resp = upload_to(
        &execd,
        "/v1/filesystem/41002/41000/files/upload",
        vec![(
            private.join("theirs.txt").display().to_string(),
            644,
            Bytes::from_static(b"x"),
        )],
    )
    .await;
    assert!(resp.status().is_client_error(), "{}", resp.status());
    assert!(!private.join("theirs.txt").exists());
    let resp = execd
        .post_json(
            "/v1/filesystem/41002/41000/directories",
            json!({private.join("d").display().to_string(): {"mode": 755}}),
        )
        .await;
    assert!(resp.status().is_client_error(), "{}", resp.status());
    assert!(!private.join("d").exists());
    let listed = execd
        .get(&format!(
            "/v1/filesystem/41002/41000/directories/list?path={}",
            private.display()
        ))
        .await;
    assert_eq!(listed.status(), 403);

    // Bad ids and routes that take no identity are refused.
    for path in [
        "/v1/filesystem/4294967295/0/files/info?path=/".to_string(),
        "/v1/filesystem/x/0/files/info?path=/".to_string(),
    ] {
        assert_eq!(execd.get(&path).await.status(), 400, "{path}");
    }
    assert_eq!(
        execd
            .get("/v1/filesystem/0/0/command/status/x")
            .await
            .status(),
        404
    );
}
