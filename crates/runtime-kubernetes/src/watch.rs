//! One watch on this Warren's Pods, shared by every sandbox: the list-then-watch loop of a
//! Kubernetes controller. Each Pod's latest view is published on a channel of its own, so a create
//! waiting for its Pod to run, or a sandbox waiting for its Pod to end, wakes only for its Pod, and
//! the API server serves one watch per Warren however many sandboxes it runs.
//!
//! The loop lists the Pods (the list's `resourceVersion` says from where to watch), then watches;
//! when the watch ends it resumes from the last version seen; when that version has been compacted
//! away (410 Gone) it lists again. Pods deleted meanwhile are found missing from the new list.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;

use crate::client::{Client, KubeError};
use crate::pod::PodView;

/// How long one watch request lasts before it is renewed.
const WATCH_SECONDS: Duration = Duration::from_secs(240);

/// What is known of one Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Not in any list or event yet.
    Unknown,
    Present(PodView),
    /// Deleted (or missing from a later list).
    Gone,
}

/// A follower's feed: each Pod's name and view, in the order the watch saw them.
pub type Follower = tokio::sync::mpsc::UnboundedSender<Option<(String, Seen)>>;

pub struct PodWatch {
    channels: Mutex<HashMap<String, watch::Sender<Seen>>>,
    /// Those following every Pod (shared records); `None` on a feed marks the first list's end.
    /// Sent to under the channels' lock, so a feed's order is the watch's.
    followers: Mutex<Vec<Follower>>,
    /// The first list is in: a Pod not in it is not there.
    synced: watch::Sender<bool>,
}

impl PodWatch {
    /// Starts the loop for Pods under `path` matching `selector`.
    pub fn start(client: Arc<Client>, path: String, selector: String) -> Arc<Self> {
        let this = Arc::new(Self {
            channels: Mutex::new(HashMap::new()),
            followers: Mutex::new(Vec::new()),
            synced: watch::Sender::new(false),
        });
        let weak = Arc::downgrade(&this);
        tokio::spawn(async move {
            loop {
                let Some(this) = weak.upgrade() else { return };
                if let Err(e) = this.run(&client, &path, &selector).await {
                    tracing::warn!(error = %e, "watching the sandboxes' Pods; trying again");
                }
                drop(this);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        this
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<Seen>>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The channel of Pod `name`'s views.
    pub fn subscribe(&self, name: &str) -> watch::Receiver<Seen> {
        self.channels()
            .entry(name.to_string())
            .or_insert_with(|| watch::Sender::new(Seen::Unknown))
            .subscribe()
    }

    /// Forgets Pod `name` (its sandbox is gone).
    pub fn forget(&self, name: &str) {
        self.channels().remove(name);
    }

    /// Resolves once the first list is in.
    pub async fn synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Every Pod's views from now on: first each Pod known now, then (once the first list is
    /// in) `None`, then each change.
    pub fn follow(
        self: &Arc<Self>,
    ) -> tokio::sync::mpsc::UnboundedReceiver<Option<(String, Seen)>> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        {
            let channels = self.channels();
            for (name, seen) in channels.iter() {
                let seen = seen.borrow().clone();
                if matches!(seen, Seen::Present(_)) {
                    let _ = tx.send(Some((name.clone(), seen)));
                }
            }
            self.followers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(tx.clone());
        }
        let this = self.clone();
        tokio::spawn(async move {
            this.synced().await;
            // Under the channels' lock: after every view the first list published.
            let _channels = this.channels();
            let _ = tx.send(None);
        });
        rx
    }

    fn publish(&self, name: &str, seen: Seen) {
        let mut channels = self.channels();
        let changed = match channels.get(name) {
            Some(tx) => tx.send_if_modified(|old| {
                let changed = *old != seen;
                *old = seen.clone();
                changed
            }),
            // Nobody asked about it yet: kept, so that a later subscriber starts from it.
            None => {
                if seen != Seen::Gone {
                    channels.insert(name.to_string(), watch::Sender::new(seen.clone()));
                }
                true
            }
        };
        if seen == Seen::Gone
            && channels
                .get(name)
                .is_some_and(|tx| tx.receiver_count() == 0)
        {
            // Nobody waits on it (another replica's sandbox, say): not kept for ever.
            channels.remove(name);
        }
        if changed {
            let mut followers = self.followers.lock().unwrap_or_else(|p| p.into_inner());
            followers.retain(|f| f.send(Some((name.to_string(), seen.clone()))).is_ok());
        }
    }

    async fn run(&self, client: &Client, path: &str, selector: &str) -> Result<(), KubeError> {
        let list = client.list(path, selector).await?;
        let mut version = list["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let listed: HashMap<String, Value> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p["metadata"]["name"].as_str()?.to_string(), p.clone())))
            .collect();
        let known: Vec<String> = self.channels().keys().cloned().collect();
        for name in known {
            if !listed.contains_key(&name) {
                self.publish(&name, Seen::Gone);
            }
        }
        for (name, pod) in &listed {
            self.publish(name, Seen::Present(PodView::of(pod)));
        }
        self.synced.send_replace(true);
        loop {
            let mut expired = false;
            let from = version.clone();
            client
                .watch(path, selector, &from, WATCH_SECONDS, |event| {
                    let name = event.object["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    if let Some(v) = event.object["metadata"]["resourceVersion"].as_str() {
                        version = v.to_string();
                    }
                    match event.kind.as_str() {
                        "ADDED" | "MODIFIED" => {
                            self.publish(&name, Seen::Present(PodView::of(&event.object)))
                        }
                        "DELETED" => self.publish(&name, Seen::Gone),
                        "ERROR" => {
                            // 410: the version is too old. Whatever it is, everything is
                            // listed again.
                            tracing::debug!(status = %event.object, "the Pods' watch ended with an error");
                            expired = true;
                            return false;
                        }
                        _ => {}
                    }
                    true
                })
                .await?;
            if expired {
                return Ok(());
            }
        }
    }
}
