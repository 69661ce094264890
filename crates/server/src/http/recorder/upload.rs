//! The paths an upload writes, read from its multipart body as it streams to execd: the body is
//! searched for its boundary delimiter (which a part's content cannot hold, by the format's
//! rule), each part's headers are read, and a `metadata` part's JSON is kept for its `path`. File
//! bytes are searched, never copied, so an 8 MiB upload costs the recorder a `memmem` pass.

use std::sync::{Arc, Mutex as StdMutex};

use bytes::Bytes;
use memchr::memmem::Finder;
use serde_json::Value;

use super::Watch;

/// A part's headers, at most.
const MAX_HEADERS: usize = 8 << 10;
/// A metadata part's JSON, at most.
const MAX_METADATA: usize = 64 << 10;

/// What the scan found; read once execd has answered (it answers an upload after its body).
#[derive(Debug, Default, Clone)]
pub(super) struct Scanned {
    pub(super) paths: Vec<String>,
    /// The scan did not see the whole body, or could not read a part.
    pub(super) incomplete: bool,
}

pub(super) struct UploadScan {
    /// `\r\n--{boundary}`: what ends every part (the first is preceded by the stream's start).
    delimiter: Finder<'static>,
    /// The last bytes searched, fewer than a delimiter: one may start there and end in the next chunk.
    carry: Vec<u8>,
    /// The headers or the metadata being gathered.
    gathered: Vec<u8>,
    state: State,
    found: Arc<StdMutex<Scanned>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Before the first delimiter, or in a part that is not metadata: looking for the next one.
    Seeking,
    /// Right after a delimiter: `--` (the end) or a part's headers up to a blank line.
    Headers,
    /// A metadata part's body, up to the next delimiter.
    Metadata,
    /// After the closing delimiter (or a part past the bounds): nothing more is read.
    Done,
}

impl UploadScan {
    pub(super) fn new(boundary: &str, found: Arc<StdMutex<Scanned>>) -> Self {
        let delimiter = Finder::new(format!("\r\n--{boundary}").as_bytes()).into_owned();
        Self {
            delimiter,
            // The body opens with `--{boundary}`, its own line: as if a line ended before it.
            carry: b"\r\n".to_vec(),
            gathered: Vec::new(),
            state: State::Seeking,
            found,
        }
    }

    fn found(&self) -> std::sync::MutexGuard<'_, Scanned> {
        self.found.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the next delimiter ends in `data` (searching across the seam with the last chunk);
    /// `None`: not in it, and the tail is kept for the next seam.
    fn seek(&mut self, data: &[u8]) -> Option<usize> {
        let n = self.delimiter.needle().len();
        let mut seam = std::mem::take(&mut self.carry);
        let kept = seam.len();
        seam.extend_from_slice(&data[..data.len().min(n - 1)]);
        if let Some(i) = self.delimiter.find(&seam) {
            return Some(i + n - kept);
        }
        if let Some(i) = self.delimiter.find(data) {
            return Some(i + n);
        }
        let from = seam.len().saturating_sub(n - 1);
        self.carry = if data.len() >= n - 1 {
            data[data.len() - (n - 1)..].to_vec()
        } else {
            seam[from..].to_vec()
        };
        None
    }

    fn scan(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            match self.state {
                State::Done => return,
                State::Seeking => match self.seek(data) {
                    Some(end) => {
                        data = &data[end..];
                        self.state = State::Headers;
                    }
                    None => return,
                },
                State::Headers => {
                    let before = self.gathered.len();
                    self.gathered.extend_from_slice(data);
                    if self.gathered.starts_with(b"--") {
                        self.state = State::Done;
                        return;
                    }
                    let Some(i) = memchr::memmem::find(&self.gathered, b"\r\n\r\n") else {
                        if self.gathered.len() > MAX_HEADERS {
                            self.give_up();
                        }
                        return;
                    };
                    let headers = std::mem::take(&mut self.gathered);
                    let body_at = i + 4 - before;
                    data = &data[body_at.min(data.len())..];
                    self.state = if is_metadata(&headers[..i]) {
                        State::Metadata
                    } else {
                        State::Seeking
                    };
                    // The part's body starts a fresh search: its first bytes may be the delimiter.
                    self.carry.clear();
                }
                State::Metadata => {
                    let before = self.gathered.len();
                    self.gathered.extend_from_slice(data);
                    let Some(i) = self.delimiter.find(&self.gathered) else {
                        if self.gathered.len() > MAX_METADATA {
                            self.give_up();
                        }
                        return;
                    };
                    let json = std::mem::take(&mut self.gathered);
                    let path = serde_json::from_slice::<Value>(&json[..i])
                        .ok()
                        .and_then(|v| v.get("path").and_then(Value::as_str).map(str::to_owned));
                    match path {
                        Some(p) => self.found().paths.push(p),
                        None => self.found().incomplete = true,
                    }
                    let end = i + self.delimiter.needle().len() - before;
                    data = &data[end.min(data.len())..];
                    self.state = State::Headers;
                }
            }
        }
    }

    fn give_up(&mut self) {
        self.found().incomplete = true;
        self.gathered = Vec::new();
        self.state = State::Done;
    }
}

/// Whether a part's headers name it `metadata`, read as multer (execd's parser) reads them: the
/// `Content-Disposition` header's `name` parameter, quoted or not, spaces around `=` allowed; a
/// `filename="metadata"` is a file, and other headers say nothing.
fn is_metadata(headers: &[u8]) -> bool {
    let text = String::from_utf8_lossy(headers);
    text.split("\r\n").any(|line| {
        let Some((name, value)) = line.split_once(':') else {
            return false;
        };
        name.trim().eq_ignore_ascii_case("content-disposition")
            && value.split(';').skip(1).any(|param| {
                param.split_once('=').is_some_and(|(k, v)| {
                    k.trim().eq_ignore_ascii_case("name")
                        && v.trim().trim_matches('"') == "metadata"
                })
            })
    })
}

impl Watch for UploadScan {
    fn data(&mut self, data: &Bytes) {
        self.scan(data);
    }

    fn ended(&mut self, _whole: bool) {
        if self.state != State::Done {
            // Cut short, or a body with no closing delimiter: what was found is kept, as partial.
            self.found().incomplete = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(boundary: &str, parts: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = Vec::new();
        for (name, content) in parts {
            let disposition = match *name {
                "metadata" => "form-data; name=\"metadata\"".to_string(),
                other => format!("form-data; name=\"file\"; filename=\"{other}\""),
            };
            b.extend_from_slice(
                format!("--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n").as_bytes(),
            );
            b.extend_from_slice(content);
            b.extend_from_slice(b"\r\n");
        }
        b.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        b
    }

    fn scan(body: &[u8], boundary: &str, chunk: usize) -> Scanned {
        let found = Arc::new(StdMutex::new(Scanned::default()));
        let mut s = UploadScan::new(boundary, found.clone());
        for c in body.chunks(chunk) {
            s.data(&Bytes::copy_from_slice(c));
        }
        s.ended(true);
        let out = found.lock().expect("lock").clone();
        out
    }

    #[test]
    fn every_metadata_path_is_found_whatever_the_chunks() {
        // A file whose content looks like a metadata part's headers and JSON: content, not a part.
        let forged = b"\r\n--not-it\r\nContent-Disposition: form-data; name=\"metadata\"\r\n\r\n{\"path\":\"/forged\"}";
        let big = vec![b'z'; 70_000];
        let b = body(
            "XyZ-42",
            &[
                ("metadata", br#"{"path":"/tmp/a.txt","mode":644}"#),
                ("a.txt", forged),
                ("metadata", "{\"path\":\"/etc/évil\"}".as_bytes()),
                ("evil", &big),
            ],
        );
        for chunk in [1, 2, 5, 13, 1000, 1 << 20] {
            let found = scan(&b, "XyZ-42", chunk);
            assert_eq!(found.paths, ["/tmp/a.txt", "/etc/évil"], "chunk {chunk}");
            assert!(!found.incomplete, "chunk {chunk}");
        }
    }

    #[test]
    fn a_cut_body_or_bad_metadata_is_incomplete() {
        let b = body("B", &[("metadata", br#"{"path":"/x"}"#), ("x", b"data")]);
        let cut = scan(&b[..b.len() - 8], "B", 7);
        assert_eq!(cut.paths, ["/x"]);
        assert!(cut.incomplete);
        let bad = scan(&body("B", &[("metadata", b"not json")]), "B", 3);
        assert!(bad.paths.is_empty() && bad.incomplete);
    }

    #[test]
    fn a_filename_called_metadata_is_a_file() {
        assert!(is_metadata(
            b"\r\nContent-Disposition: form-data; name=\"metadata\""
        ));
        assert!(is_metadata(
            b"\r\ncontent-disposition: form-data; name = \"metadata\""
        ));
        assert!(is_metadata(
            b"\r\nContent-Disposition: form-data; name=metadata"
        ));
        assert!(!is_metadata(
            b"\r\nContent-Disposition: form-data; name=\"file\"; filename=\"metadata\""
        ));
        // Another header naming it says nothing.
        assert!(!is_metadata(
            b"\r\nContent-Disposition: form-data; name=\"file\"\r\nX-Note: x; name=\"metadata\""
        ));
    }
}
