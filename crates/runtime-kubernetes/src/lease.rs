//! Which replica does the common chores (expiring sandboxes, making the pools' warm sandboxes): the
//! holder of one `coordination.k8s.io` Lease per service, as Kubernetes' own controllers elect a
//! leader. A replica takes the Lease when there is none or when its holder stopped renewing it for
//! its duration, with the Lease's `resourceVersion` as the precondition, so two replicas never both
//! take it; the holder renews it every third of the duration, and leads only until two thirds of
//! the duration after its last renewal began: a holder whose renewals are late (a stalled process,
//! a slow API server) stops leading before another may take the Lease, so two replicas never lead
//! at once. A replica that dies leaves it to the others after one duration.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::{json, Value};

use crate::client::{Client, KubeError};

pub struct Lease {
    /// Until when this replica leads (`None`: it does not).
    until: Mutex<Option<Instant>>,
}

impl Lease {
    /// Starts taking and keeping Lease `name` in `namespace` as `identity`.
    pub fn start(
        client: Arc<Client>,
        namespace: &str,
        name: String,
        identity: String,
        duration: Duration,
    ) -> Arc<Self> {
        let this = Arc::new(Self {
            until: Mutex::new(None),
        });
        let weak = Arc::downgrade(&this);
        let path = format!("/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases");
        tokio::spawn(async move {
            let every = (duration / 3).max(Duration::from_millis(200));
            loop {
                let Some(this) = weak.upgrade() else { return };
                // Measured from before the request: the Lease's renewTime is no earlier.
                let began = Instant::now();
                let held = match try_hold(&client, &path, &name, &identity, duration).await {
                    Ok(held) => held,
                    Err(e) => {
                        tracing::warn!(lease = %name, error = %e, "keeping the replicas' Lease");
                        false
                    }
                };
                let was = this.held();
                *this.until.lock().unwrap_or_else(|p| p.into_inner()) =
                    held.then(|| began + duration * 2 / 3);
                if was != held {
                    tracing::info!(lease = %name, %identity, held, "the replicas' Lease changed hands");
                }
                drop(this);
                tokio::time::sleep(every).await;
            }
        });
        this
    }

    /// Whether this replica holds the Lease now.
    pub fn held(&self) -> bool {
        self.until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|t| Instant::now() < t)
    }
}

fn micro_time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// One round: takes, renews or leaves the Lease; whether it is this replica's after.
async fn try_hold(
    client: &Client,
    path: &str,
    name: &str,
    identity: &str,
    duration: Duration,
) -> Result<bool, KubeError> {
    let now = Utc::now();
    let spec = |transitions: i64, acquired: &Value| {
        json!({
            "holderIdentity": identity,
            "leaseDurationSeconds": duration.as_secs().max(1),
            "acquireTime": acquired,
            "renewTime": micro_time(now),
            "leaseTransitions": transitions,
        })
    };
    let lease = match client.get(&format!("{path}/{name}")).await {
        Ok(lease) => lease,
        Err(e) if e.status() == Some(404) => {
            let body = json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "warren"}},
                "spec": spec(0, &json!(micro_time(now))),
            });
            return match client.create(path, &body).await {
                Ok(_) => Ok(true),
                Err(e) if e.status() == Some(409) => Ok(false),
                Err(e) => Err(e),
            };
        }
        Err(e) => return Err(e),
    };
    let s = &lease["spec"];
    let holder = s["holderIdentity"].as_str().unwrap_or_default();
    let renewed = s["renewTime"]
        .as_str()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc));
    let lasts = chrono::Duration::seconds(s["leaseDurationSeconds"].as_i64().unwrap_or(15));
    let expired = renewed.is_none_or(|t| t + lasts < now);
    if holder != identity && !expired {
        return Ok(false);
    }
    let transitions = s["leaseTransitions"].as_i64().unwrap_or(0);
    let spec = if holder == identity {
        spec(transitions, &s["acquireTime"])
    } else {
        spec(transitions + 1, &json!(micro_time(now)))
    };
    let patch = json!({
        "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
        "spec": spec,
    });
    match client.merge_patch(&format!("{path}/{name}"), &patch).await {
        Ok(_) => Ok(true),
        // Another replica renewed or took it in between.
        Err(e) if e.status() == Some(409) => Ok(false),
        Err(e) => Err(e),
    }
}
