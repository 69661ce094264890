//! Files and directories (`/files…`, `/directories…`). Uploads and downloads stream: neither side holds
//! a whole file in memory.

use std::collections::BTreeMap;
use std::path::Path;

use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use serde::Deserialize;
use warren_api::execd::FileInfo;

use crate::client::{json, send};
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

/// Who owns an uploaded file or a new directory, and its permission (`0o644`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ownership {
    pub mode: Option<u32>,
    pub owner: Option<String>,
    pub group: Option<String>,
}

impl Ownership {
    pub fn mode(mode: u32) -> Self {
        Self {
            mode: Some(mode),
            ..Default::default()
        }
    }

    /// The wire form: the octal permission written as a decimal number (`0o644` → `644`).
    fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        if let Some(mode) = self.mode {
            let wire: u32 = format!("{:o}", mode & 0o7777).parse().unwrap_or(0);
            m.insert("mode".into(), wire.into());
        }
        if let Some(o) = &self.owner {
            m.insert("owner".into(), o.clone().into());
        }
        if let Some(g) = &self.group {
            m.insert("group".into(), g.clone().into());
        }
        serde_json::Value::Object(m)
    }
}

/// A byte stream of a download.
pub type ByteStream = std::pin::Pin<Box<dyn Stream<Item = Result<Bytes>> + Send>>;

impl Sandbox {
    /// Reads a whole file.
    pub async fn read(&self, path: &str) -> Result<Bytes> {
        let (r, url) = self.execd(reqwest::Method::GET, "/files/download");
        send(r.query(&[("path", path)]), &url)
            .await?
            .bytes()
            .await
            .map_err(Error::Broken)
    }

    /// Reads a whole file as UTF-8 (lossy).
    pub async fn read_to_string(&self, path: &str) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.read(path).await?).into_owned())
    }

    /// Streams a file, or the byte range `start..=end` of it (`end` None = to the end).
    pub async fn download(
        &self,
        path: &str,
        range: Option<(u64, Option<u64>)>,
    ) -> Result<ByteStream> {
        let (mut r, url) = self.execd(reqwest::Method::GET, "/files/download");
        r = r.query(&[("path", path)]);
        if let Some((start, end)) = range {
            let end = end.map(|e| e.to_string()).unwrap_or_default();
            r = r.header(reqwest::header::RANGE, format!("bytes={start}-{end}"));
        }
        let resp = send(r, &url).await?;
        Ok(Box::pin(resp.bytes_stream().map_err(Error::Broken)))
    }

    /// Downloads a file into a local one.
    pub async fn download_to(&self, path: &str, local: &Path) -> Result<u64> {
        use tokio::io::AsyncWriteExt;
        let mut stream = self.download(path, None).await?;
        let mut file = tokio::fs::File::create(local).await?;
        let mut n = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            n += chunk.len() as u64;
            file.write_all(&chunk).await?;
        }
        file.flush().await?;
        Ok(n)
    }

    /// Writes `data` to `path`, creating parent folders.
    pub async fn write(&self, path: &str, data: impl Into<Bytes>) -> Result<()> {
        let data: Bytes = data.into();
        let body = futures::stream::once(async move { Ok::<_, std::io::Error>(data) });
        self.upload_stream(path, body, &Ownership::default()).await
    }

    /// Uploads a local file to `path`, streamed.
    pub async fn upload(&self, local: &Path, path: &str, owner: &Ownership) -> Result<()> {
        let file = tokio::fs::File::open(local).await?;
        let body = tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024);
        self.upload_stream(path, body, owner).await
    }

    /// Uploads a stream of bytes to `path` as one multipart `metadata` + `file` pair, sent chunked.
    pub async fn upload_stream<S>(&self, path: &str, data: S, owner: &Ownership) -> Result<()>
    where
        S: Stream<Item = std::io::Result<Bytes>> + Send + 'static,
    {
        let boundary = format!("warren-{:032x}", rand::random::<u128>());
        let mut meta = owner.to_json();
        if let serde_json::Value::Object(m) = &mut meta {
            m.insert("path".into(), path.into());
        }
        let name = path.rsplit('/').next().unwrap_or("file").replace('"', "");
        let head = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\
             Content-Type: application/json\r\n\r\n{meta}\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        );
        let tail = format!("\r\n--{boundary}--\r\n");
        let body = futures::stream::once(async move { Ok(Bytes::from(head)) })
            .chain(data)
            .chain(futures::stream::once(async move { Ok(Bytes::from(tail)) }));
        let (r, url) = self.execd(reqwest::Method::POST, "/files/upload");
        send(
            r.header(
                reqwest::header::CONTENT_TYPE,
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(reqwest::Body::wrap_stream(body)),
            &url,
        )
        .await?;
        Ok(())
    }

    /// Metadata of one path.
    pub async fn stat(&self, path: &str) -> Result<FileInfo> {
        let (r, url) = self.execd_call(reqwest::Method::GET, "/files/info");
        let mut m: BTreeMap<String, FileInfo> =
            json(send(r.query(&[("path", path)]), &url).await?).await?;
        m.remove(path)
            .or_else(|| m.into_values().next())
            .ok_or_else(|| Error::Protocol(format!("no info for {path}")))
    }

    /// Deletes files (not directories).
    pub async fn remove_files(&self, paths: &[&str]) -> Result<()> {
        let q: Vec<(&str, &str)> = paths.iter().map(|p| ("path", *p)).collect();
        let (r, url) = self.execd_call(reqwest::Method::DELETE, "/files");
        send(r.query(&q), &url).await?;
        Ok(())
    }

    /// `mkdir -p` with a mode and owner.
    pub async fn mkdir(&self, path: &str, owner: &Ownership) -> Result<()> {
        let mut o = owner.clone();
        o.mode.get_or_insert(0o755);
        let (r, url) = self.execd_call(reqwest::Method::POST, "/directories");
        send(r.json(&serde_json::json!({ path: o.to_json() })), &url).await?;
        Ok(())
    }

    /// `rm -rf` of a directory.
    pub async fn remove_dir(&self, path: &str) -> Result<()> {
        let (r, url) = self.execd_call(reqwest::Method::DELETE, "/directories");
        send(r.query(&[("path", path)]), &url).await?;
        Ok(())
    }

    /// Entries under `path`, `depth` levels deep, in lexical order; symlinks are not followed.
    pub async fn list_dir(&self, path: &str, depth: u32) -> Result<Vec<FileInfo>> {
        let (r, url) = self.execd_call(reqwest::Method::GET, "/directories/list");
        json(
            send(
                r.query(&[("path", path), ("depth", &depth.to_string())]),
                &url,
            )
            .await?,
        )
        .await
    }

    /// Renames `src` to `dest` (the target's folder must exist).
    pub async fn mv(&self, src: &str, dest: &str) -> Result<()> {
        let (r, url) = self.execd_call(reqwest::Method::POST, "/files/mv");
        send(
            r.json(&serde_json::json!([{ "src": src, "dest": dest }])),
            &url,
        )
        .await?;
        Ok(())
    }

    /// Sets mode and/or owner of a path.
    pub async fn chmod(&self, path: &str, owner: &Ownership) -> Result<()> {
        let (r, url) = self.execd_call(reqwest::Method::POST, "/files/permissions");
        send(r.json(&serde_json::json!({ path: owner.to_json() })), &url).await?;
        Ok(())
    }

    /// Replaces every `old` with `new` in a file; returns how many were replaced.
    pub async fn replace(&self, path: &str, old: &str, new: &str) -> Result<u64> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Replaced {
            replaced_count: u64,
        }
        let (r, url) = self.execd_call(reqwest::Method::POST, "/files/replace");
        let body = serde_json::json!({ path: { "old": old, "new": new } });
        let mut m: BTreeMap<String, Replaced> =
            json(send(r.query(&[("verbose", "true")]).json(&body), &url).await?).await?;
        Ok(m.remove(path).map(|r| r.replaced_count).unwrap_or(0))
    }

    /// Files under `root` matching a glob (`**/*.py`).
    pub async fn search(&self, root: &str, pattern: &str) -> Result<Vec<FileInfo>> {
        let (r, url) = self.execd_call(reqwest::Method::GET, "/files/search");
        json(send(r.query(&[("path", root), ("pattern", pattern)]), &url).await?).await
    }
}
