//! Jupyter messages on the wire (jupyter-client.readthedocs.io, "Messaging in Jupyter", protocol 5.3):
//! `[identities…, "<IDS|MSG>", hmac, header, parent_header, metadata, content, buffers…]`, signed with
//! HMAC-SHA256 over the four JSON frames using the key from the connection file.

use bytes::Bytes;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

const DELIMITER: &[u8] = b"<IDS|MSG>";
pub const PROTOCOL_VERSION: &str = "5.3";

/// A decoded message (buffers are not used by anything execd forwards).
#[derive(Debug, Clone)]
pub struct Message {
    pub header: Value,
    pub parent_header: Value,
    pub content: Value,
}

impl Message {
    pub fn msg_type(&self) -> &str {
        self.header["msg_type"].as_str().unwrap_or_default()
    }

    pub fn parent_id(&self) -> &str {
        self.parent_header["msg_id"].as_str().unwrap_or_default()
    }
}

/// Signs and checks messages of one kernel connection.
#[derive(Clone)]
pub struct Codec {
    key: Vec<u8>,
    session: String,
}

impl Codec {
    pub fn new(key: &str, session: String) -> Self {
        Self {
            key: key.as_bytes().to_vec(),
            session,
        }
    }

    /// A new request: returns its `msg_id` and the frames to send.
    pub fn request(&self, msg_type: &str, content: &Value) -> (String, Vec<Bytes>) {
        let msg_id = uuid::Uuid::new_v4().simple().to_string();
        let header = json!({
            "msg_id": msg_id,
            "session": self.session,
            "username": "warren",
            "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            "msg_type": msg_type,
            "version": PROTOCOL_VERSION,
        });
        let frames = [header, json!({}), json!({}), content.clone()]
            .map(|v| Bytes::from(serde_json::to_vec(&v).unwrap_or_default()));
        let signature = self.sign(&frames);
        let mut parts = Vec::with_capacity(6);
        parts.push(Bytes::from_static(DELIMITER));
        parts.push(Bytes::from(signature));
        parts.extend(frames);
        (msg_id, parts)
    }

    /// Decodes `parts`; `None` for anything malformed or wrongly signed (dropped: it cannot be from the
    /// kernel we started, which holds the key).
    pub fn decode(&self, parts: &[Bytes]) -> Option<Message> {
        let at = parts.iter().position(|p| p.as_ref() == DELIMITER)?;
        let signature = parts.get(at + 1)?;
        let frames = parts.get(at + 2..at + 6)?;
        if !self.key.is_empty() && !self.verify(frames, signature) {
            tracing::warn!("dropping a kernel message with a bad signature");
            return None;
        }
        let parse = |b: &Bytes| serde_json::from_slice::<Value>(b).ok();
        Some(Message {
            header: parse(&frames[0])?,
            parent_header: parse(&frames[1])?,
            content: parse(&frames[3])?,
        })
    }

    fn mac(&self, frames: &[Bytes]) -> Hmac<Sha256> {
        // HMAC accepts keys of any length; new_from_slice cannot fail for it.
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("hmac takes any key length");
        for f in frames {
            mac.update(f);
        }
        mac
    }

    fn sign(&self, frames: &[Bytes]) -> String {
        if self.key.is_empty() {
            return String::new();
        }
        hex::encode(self.mac(frames).finalize().into_bytes())
    }

    fn verify(&self, frames: &[Bytes], signature: &[u8]) -> bool {
        let Ok(expected) = hex::decode(signature) else {
            return false;
        };
        self.mac(frames).verify_slice(&expected).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_tampering_is_caught() {
        let codec = Codec::new("secret", "s1".into());
        let (id, mut parts) = codec.request("execute_request", &json!({"code": "1+1"}));
        let msg = codec.decode(&parts).expect("decodes");
        assert_eq!(msg.header["msg_id"], id);
        assert_eq!(msg.msg_type(), "execute_request");
        assert_eq!(msg.content["code"], "1+1");
        // identities before the delimiter are skipped
        parts.insert(0, Bytes::from_static(b"routing-id"));
        assert!(codec.decode(&parts).is_some());
        // a changed content frame no longer matches the signature
        let last = parts.len() - 1;
        parts[last] = Bytes::from_static(br#"{"code":"evil"}"#);
        assert!(codec.decode(&parts).is_none());
        // a different key
        let (_, parts) = Codec::new("other", "s".into()).request("x", &json!({}));
        assert!(codec.decode(&parts).is_none());
    }

    #[test]
    fn known_signature() {
        // hmac.new(b"key", b"{}{}{}{}", hashlib.sha256).hexdigest() in Python
        let codec = Codec::new("key", String::new());
        let frames: Vec<Bytes> = (0..4).map(|_| Bytes::from_static(b"{}")).collect();
        assert_eq!(
            codec.sign(&frames),
            "ca767b02c5bc061ed184a9a029e7f93a7f2f7ed4e8fe74120fc1212f0b008fa3"
        );
    }
}
