//! A sandbox's flight recorder (`GET /v1/sandboxes/{id}/timeline`): its events, one JSON object
//! each, as the server keeps them; following, new ones as they are recorded until the sandbox ends.

use bytes::{Buf, BytesMut};

use crate::client::{send, Client};
use crate::error::{Error, Result};

/// The events of one timeline, read as they arrive.
pub struct Timeline {
    resp: reqwest::Response,
    url: String,
    buf: BytesMut,
}

impl Client {
    /// Sandbox `id`'s timeline after event `after` (0: from the first kept); `follow` keeps it
    /// open for new events until the sandbox ends (no request timeout then).
    pub async fn timeline(&self, id: &str, follow: bool, after: u64) -> Result<Timeline> {
        let (mut r, url) =
            self.lifecycle(reqwest::Method::GET, &format!("/sandboxes/{id}/timeline"));
        if follow {
            // A follow lasts as long as the sandbox, not a request timeout.
            r = r.timeout(std::time::Duration::from_secs(365 * 24 * 3600));
        }
        let r = r.query(&[("follow", follow.to_string()), ("after", after.to_string())]);
        let resp = send(r, &url).await?;
        Ok(Timeline {
            resp,
            url,
            buf: BytesMut::new(),
        })
    }
}

impl Timeline {
    /// The next event, or `None` at the end.
    pub async fn next(&mut self) -> Result<Option<serde_json::Value>> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line = self.buf.split_to(i + 1);
                let line = &line[..i];
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return serde_json::from_slice(line)
                    .map(Some)
                    .map_err(|e| Error::Protocol(format!("a timeline line is not JSON: {e}")));
            }
            match self
                .resp
                .chunk()
                .await
                .map_err(|e| Error::transport(&self.url, e))?
            {
                Some(chunk) => self.buf.extend_from_slice(chunk.chunk()),
                None if self.buf.is_empty() => return Ok(None),
                // A last line without its newline.
                None => self.buf.extend_from_slice(b"\n"),
            }
        }
    }
}
