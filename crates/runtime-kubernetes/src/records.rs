//! The sandboxes' records on their Pods, for replicas that serve one set of sandboxes (`[kubernetes]
//! shared_key_file`): each Pod carries its sandbox's record in an annotation, written with the Pod
//! (no extra write per create) and patched when the record changes; every replica follows the
//! instance's Pods through its one watch, so each learns of the others' sandboxes and changes from
//! the events it already receives. A sandbox's secret is derived from the replicas' shared key and
//! its id, so it is stored nowhere, not even in the cluster.

use std::sync::Arc;

use futures::stream::BoxStream;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use warren_core::{RecordEvent, RuntimeError, RuntimeState, SharedPhase, SharedRecords};

use crate::client::Client;
use crate::pod::{PodView, ANNOTATION_RECORD};
use crate::watch::{PodWatch, Seen};
use crate::PodState;

pub struct PodRecords {
    pub(crate) client: Arc<Client>,
    pub(crate) pods: Arc<PodWatch>,
    pub(crate) pods_path: String,
    pub(crate) key: Vec<u8>,
    pub(crate) lease: Arc<crate::lease::Lease>,
    /// `/api/v1/namespaces/{ns}/secrets`: shared documents are Secrets there.
    pub(crate) secrets_path: String,
    /// The instance's name: documents are `warren-{instance}-{name}`.
    pub(crate) instance: String,
}

/// How many times a compare-and-swap reads and tries again when the Pod changed in between for
/// another reason (its status).
const CAS_TRIES: usize = 5;

impl PodRecords {
    fn event(name: &str, seen: Seen) -> Option<RecordEvent> {
        match seen {
            Seen::Unknown => None,
            Seen::Gone => Some(RecordEvent::Gone {
                id: name.strip_prefix("warren-")?.to_string(),
            }),
            Seen::Present(view) => {
                let id = view.sandbox.clone()?;
                Some(RecordEvent::Seen {
                    record: view
                        .record
                        .as_deref()
                        .and_then(|r| serde_json::from_str(r).ok()),
                    state: serde_json::to_value(PodState {
                        pod: name.to_string(),
                        uid: view.uid.clone(),
                        ip: view.ip.clone().unwrap_or_default(),
                        pull_secret: view.pull_secret,
                    })
                    .unwrap_or_default(),
                    phase: phase(&view),
                    id,
                })
            }
        }
    }
}

fn phase(view: &PodView) -> SharedPhase {
    match view.exit() {
        Some(exit) => SharedPhase::Ended(exit),
        None if view.phase == "Running" && view.ip.is_some() => SharedPhase::Running,
        None => SharedPhase::Starting,
    }
}

#[async_trait::async_trait]
impl SharedRecords for PodRecords {
    fn secret(&self, id: &str) -> String {
        sandbox_secret(&self.key, id)
    }

    fn endpoint_signing_key(&self) -> Vec<u8> {
        signing_key(&self.key)
    }

    async fn put(
        &self,
        id: &str,
        state: &RuntimeState,
        record: &Value,
    ) -> Result<(), RuntimeError> {
        let name = crate::pod_of(id, state);
        let patch = json!({"metadata": {"annotations": {ANNOTATION_RECORD: record.to_string()}}});
        self.client
            .merge_patch(&format!("{}/{name}", self.pods_path), &patch)
            .await
            .map(|_| ())
            .map_err(|e| match e.status() {
                Some(404) => RuntimeError::NotFound(format!("the sandbox's Pod {name} is gone")),
                _ => crate::map_error("writing the sandbox's record on its Pod", e),
            })
    }

    async fn put_if(
        &self,
        id: &str,
        state: &RuntimeState,
        record: &Value,
        still: &(dyn for<'v> Fn(&'v Value) -> bool + Sync),
    ) -> Result<bool, RuntimeError> {
        let path = format!("{}/{}", self.pods_path, crate::pod_of(id, state));
        for _ in 0..CAS_TRIES {
            let pod = match self.client.get(&path).await {
                Ok(pod) => pod,
                Err(e) if e.status() == Some(404) => return Ok(false),
                Err(e) => return Err(crate::map_error("reading the sandbox's Pod", e)),
            };
            let current = pod["metadata"]["annotations"][ANNOTATION_RECORD]
                .as_str()
                .and_then(|r| serde_json::from_str::<Value>(r).ok());
            if !current.as_ref().is_some_and(still) {
                return Ok(false);
            }
            // The version read is the precondition: a Pod changed since (another server's claim)
            // is refused with 409, and read again.
            let patch = json!({"metadata": {
                "resourceVersion": pod["metadata"]["resourceVersion"],
                "annotations": {ANNOTATION_RECORD: record.to_string()},
            }});
            match self.client.merge_patch(&path, &patch).await {
                Ok(_) => return Ok(true),
                Err(e) if e.status() == Some(409) => continue,
                Err(e) if e.status() == Some(404) => return Ok(false),
                Err(e) => return Err(crate::map_error("writing the sandbox's record", e)),
            }
        }
        Err(RuntimeError::Unavailable(format!(
            "the sandbox's Pod kept changing while its record was written ({CAS_TRIES} tries)"
        )))
    }

    fn leads(&self) -> bool {
        self.lease.held()
    }

    fn follow(&self) -> BoxStream<'static, RecordEvent> {
        let rx = self.pods.follow();
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            loop {
                match rx.recv().await? {
                    None => return Some((RecordEvent::Synced, rx)),
                    Some((name, seen)) => {
                        if let Some(event) = Self::event(&name, seen) {
                            return Some((event, rx));
                        }
                    }
                }
            }
        });
        Box::pin(stream)
    }

    async fn read_document(&self, name: &str) -> Result<Option<(String, Vec<u8>)>, RuntimeError> {
        use base64::Engine;
        let secret = match self.client.get(&self.document_path(name)).await {
            Ok(s) => s,
            Err(e) if e.status() == Some(404) => return Ok(None),
            Err(e) => return Err(crate::map_error("reading a shared document", e)),
        };
        let version = secret["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let bytes = match secret["data"][DOCUMENT_KEY].as_str() {
            Some(b64) => base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| RuntimeError::backend(format!("shared document {name}: {e}")))?,
            None => Vec::new(),
        };
        Ok(Some((version, bytes)))
    }

    async fn write_document(
        &self,
        name: &str,
        version: Option<&str>,
        bytes: &[u8],
    ) -> Result<bool, RuntimeError> {
        use base64::Engine;
        let data = json!({ DOCUMENT_KEY: base64::engine::general_purpose::STANDARD.encode(bytes) });
        let written = match version {
            None => {
                let secret = json!({
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "type": "Opaque",
                    "metadata": {
                        "name": self.document_name(name),
                        "labels": { "app.kubernetes.io/managed-by": "warren" },
                    },
                    "data": data,
                });
                self.client.create(&self.secrets_path, &secret).await
            }
            // The version in the patch is a precondition: 409 when the Secret moved on.
            Some(v) => {
                let patch = json!({ "metadata": { "resourceVersion": v }, "data": data });
                self.client
                    .merge_patch(&self.document_path(name), &patch)
                    .await
            }
        };
        match written {
            Ok(_) => Ok(true),
            Err(e) if e.status() == Some(409) => Ok(false),
            Err(e) => Err(crate::map_error("writing a shared document", e)),
        }
    }
}

/// The key of a document's bytes in its Secret.
const DOCUMENT_KEY: &str = "document";

impl PodRecords {
    fn document_name(&self, name: &str) -> String {
        format!("warren-{}-{name}", self.instance)
    }

    fn document_path(&self, name: &str) -> String {
        format!("{}/{}", self.secrets_path, self.document_name(name))
    }
}

/// Sandbox `id`'s secret under the replicas' shared `key`.
fn sandbox_secret(key: &[u8], id: &str) -> String {
    // An HMAC takes a key of any length; `new_from_slice` cannot fail for it.
    let mut mac = <Hmac<Sha256>>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    mac.update(b"warren-sandbox-secret-v1:");
    mac.update(id.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// The endpoint signing key of replicas holding `key`: hex, so it reads like a key written in a
/// signing-keys file.
fn signing_key(key: &[u8]) -> Vec<u8> {
    let mut mac = <Hmac<Sha256>>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    mac.update(b"warren-endpoint-signing-v1");
    hex::encode(mac.finalize().into_bytes()).into_bytes()
}

/// Checks a shared key as read from its file: long enough to be a key, not a password.
pub fn check_key(key: &[u8]) -> Result<(), String> {
    if key.len() < 32 {
        return Err(format!(
            "the shared key is {} bytes; it needs at least 32 (e.g. `head -c 32 /dev/urandom | base64`)",
            key.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_s_view_is_the_sandbox_s_record_and_phase() {
        let pod = json!({
            "metadata": {
                "name": "warren-abc", "uid": "u1",
                "labels": {crate::pod::LABEL_SANDBOX: "abc"},
                "annotations": {ANNOTATION_RECORD: "{\"id\":\"abc\",\"state\":\"Pending\"}"},
            },
            "spec": {"imagePullSecrets": [{"name": "warren-abc-pull"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.7"},
        });
        let event =
            PodRecords::event("warren-abc", Seen::Present(PodView::of(&pod))).expect("an event");
        let RecordEvent::Seen {
            id,
            record,
            state,
            phase,
        } = event
        else {
            panic!("{event:?}")
        };
        assert_eq!(id, "abc");
        assert_eq!(record.expect("a record")["state"], "Pending");
        assert_eq!(phase, SharedPhase::Running);
        assert_eq!(state["ip"], "10.0.0.7");
        assert_eq!(state["pull_secret"], true);

        let mut deleting = pod.clone();
        deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        let event = PodRecords::event("warren-abc", Seen::Present(PodView::of(&deleting)))
            .expect("an event");
        assert!(
            matches!(event, RecordEvent::Seen { phase: SharedPhase::Ended(ref e), .. } if e.vanished),
            "{event:?}"
        );
        assert_eq!(
            PodRecords::event("warren-abc", Seen::Gone),
            Some(RecordEvent::Gone { id: "abc".into() })
        );
    }

    #[test]
    fn secrets_are_per_sandbox_and_per_key() {
        let (a, b) = ([1; 32], [2; 32]);
        assert_eq!(sandbox_secret(&a, "x"), sandbox_secret(&a, "x"));
        assert_ne!(sandbox_secret(&a, "x"), sandbox_secret(&a, "y"));
        assert_ne!(sandbox_secret(&a, "x"), sandbox_secret(&b, "x"));
        assert_eq!(sandbox_secret(&a, "x").len(), 64);
        assert!(check_key(&[0; 31]).is_err() && check_key(&[0; 32]).is_ok());
    }

    /// Replicas holding one key sign alike, and alike across versions (a URL signed before an
    /// upgrade still opens: the value is pinned); another key signs otherwise.
    #[test]
    fn the_signing_key_derives_from_the_shared_one() {
        assert_eq!(
            String::from_utf8(signing_key(&[1; 32])).expect("hex"),
            "f6cae3fa8ac392b068c28b824710359dafb7a9218a6e4677cd316da92b14fac2"
        );
        assert_ne!(signing_key(&[1; 32]), signing_key(&[2; 32]));
        assert_ne!(
            signing_key(&[1; 32]),
            sandbox_secret(&[1; 32], "").into_bytes()
        );
    }
}
