//! Where the registry keeps its records: this server's journal, or the runtime's backend, shared
//! by the replicas of one service (see `shared`). The registry asks this one seam what to do with
//! a record instead of branching on which it has.

use std::sync::Arc;

use serde_json::Value;
use warren_core::{RuntimeError, SharedRecords};
use warren_store::{SandboxRecord, Store, StoreError};

use super::shared::wire_form;
use crate::error::SandboxError;

#[async_trait::async_trait]
pub(super) trait Records: Send + Sync {
    /// A new sandbox's secret (shared: derived from the service's key, so every replica knows it).
    fn secret(&self, id: &str) -> String;

    /// What a create hands the runtime to keep with the sandbox, if anything.
    fn runtime_copy(&self, rec: &SandboxRecord) -> Option<Value>;

    /// The record changed: kept where it lives (shared records were written by `share` first).
    fn persist(&self, rec: &SandboxRecord);

    /// The sandbox is forgotten.
    fn remove(&self, id: &str);

    /// Writes `rec` where the other replicas read it, before this server takes it as the
    /// sandbox's record, so a failure changes nothing.
    async fn share(&self, rec: &SandboxRecord) -> Result<(), SandboxError>;

    /// Hands warm sandbox `rec` over as `claimed` if no other replica claimed it first (`false`).
    async fn claim(
        &self,
        rec: &SandboxRecord,
        claimed: &SandboxRecord,
    ) -> Result<bool, RuntimeError>;

    /// The records a restarted server starts from (shared: none, the feed brings them).
    fn load(&self) -> Result<(Vec<SandboxRecord>, Vec<StoreError>), StoreError>;

    /// The shared records' feed, which tells this server of every change (its own sandboxes'
    /// ends included); `None`: the journal, and the server watches its sandboxes' ends itself.
    fn feed(&self) -> Option<Arc<dyn SharedRecords>>;

    /// Whether this server does the common chores (expiry, the pools' warm sandboxes).
    fn leads(&self) -> bool;
}

/// This server's own journal.
pub(super) struct Journal(pub(super) Store);

#[async_trait::async_trait]
impl Records for Journal {
    fn secret(&self, _id: &str) -> String {
        crate::tokens::new_secret()
    }

    fn runtime_copy(&self, _rec: &SandboxRecord) -> Option<Value> {
        None
    }

    fn persist(&self, rec: &SandboxRecord) {
        if let Err(e) = self.0.save(rec) {
            tracing::error!(sandbox_id = %rec.id, error = %e, "persisting sandbox record failed");
        }
    }

    fn remove(&self, id: &str) {
        let _ = self.0.remove(id);
    }

    async fn share(&self, _rec: &SandboxRecord) -> Result<(), SandboxError> {
        Ok(())
    }

    async fn claim(&self, _: &SandboxRecord, _: &SandboxRecord) -> Result<bool, RuntimeError> {
        Ok(true)
    }

    fn load(&self) -> Result<(Vec<SandboxRecord>, Vec<StoreError>), StoreError> {
        self.0.load_all()
    }

    fn feed(&self) -> Option<Arc<dyn SharedRecords>> {
        None
    }

    fn leads(&self) -> bool {
        true
    }
}

/// The runtime's backend, shared with the other replicas.
pub(super) struct Shared(pub(super) Arc<dyn SharedRecords>);

#[async_trait::async_trait]
impl Records for Shared {
    fn secret(&self, id: &str) -> String {
        self.0.secret(id)
    }

    fn runtime_copy(&self, rec: &SandboxRecord) -> Option<Value> {
        Some(wire_form(rec))
    }

    fn persist(&self, _rec: &SandboxRecord) {}

    fn remove(&self, _id: &str) {}

    async fn share(&self, rec: &SandboxRecord) -> Result<(), SandboxError> {
        self.0
            .put(&rec.id, &rec.runtime_state, &wire_form(rec))
            .await
            .map_err(|e| SandboxError::from_runtime("writing the sandbox's record", e))
    }

    async fn claim(
        &self,
        rec: &SandboxRecord,
        claimed: &SandboxRecord,
    ) -> Result<bool, RuntimeError> {
        let pool = rec.warm_pool.clone();
        let still_warm = move |r: &Value| r["warm_pool"].as_str() == pool.as_deref();
        self.0
            .put_if(
                &rec.id,
                &rec.runtime_state,
                &wire_form(claimed),
                &still_warm,
            )
            .await
    }

    fn load(&self) -> Result<(Vec<SandboxRecord>, Vec<StoreError>), StoreError> {
        Ok((Vec::new(), Vec::new()))
    }

    fn feed(&self) -> Option<Arc<dyn SharedRecords>> {
        Some(self.0.clone())
    }

    fn leads(&self) -> bool {
        self.0.leads()
    }
}
