//! Records kept by a runtime's backend, so several servers serve one set of sandboxes.
//!
//! A server keeps its sandboxes' records in a journal on its data dir, which makes each server the
//! only one that knows its sandboxes. A runtime whose backend can hold a record with each sandbox
//! (the Kubernetes runtime, on the sandbox's Pod) offers [`SharedRecords`]: the server then writes
//! the record there instead, derives each sandbox's secret from a key every replica holds (so no
//! secret is stored anywhere), and follows every replica's sandboxes through [`SharedRecords::follow`].

use futures::stream::BoxStream;

use crate::{ExitInfo, RuntimeError, RuntimeState};

/// Where a sandbox stands in the backend, as a follower sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedPhase {
    /// Made, not running yet (a create in flight on some server).
    Starting,
    Running,
    /// It will run no more: ended by itself, or being removed.
    Ended(ExitInfo),
}

/// One change of the backend's sandboxes, in the order the backend made them.
#[derive(Debug, Clone, PartialEq)]
pub enum RecordEvent {
    /// Sandbox `id` as it is now: its record (`None` when it carries none), what the runtime's
    /// calls need to reach it, and its phase.
    Seen {
        id: String,
        record: Option<serde_json::Value>,
        state: RuntimeState,
        phase: SharedPhase,
    },
    /// Sandbox `id` is no longer in the backend.
    Gone { id: String },
    /// Every sandbox that was there when following began has been sent.
    Synced,
}

#[async_trait::async_trait]
pub trait SharedRecords: Send + Sync {
    /// Sandbox `id`'s secret (its endpoint tokens and execd credential derive from it): the same
    /// on every server that shares these records, and stored nowhere.
    fn secret(&self, id: &str) -> String;

    /// The key endpoint URLs are signed with: the same on every server that shares these
    /// records (a URL one signed opens on every one), and stored nowhere.
    fn endpoint_signing_key(&self) -> Vec<u8>;

    /// Replaces sandbox `id`'s record with `record` (a sandbox gets its first with
    /// [`crate::SandboxSpec::record`]). `NotFound`: the sandbox is gone.
    async fn put(
        &self,
        id: &str,
        state: &RuntimeState,
        record: &serde_json::Value,
    ) -> Result<(), RuntimeError>;

    /// Replaces sandbox `id`'s record with `record` only if the record there now passes `still`,
    /// atomically (compare-and-swap): `false` when it does not, as when another server claimed a
    /// warm sandbox first.
    async fn put_if(
        &self,
        id: &str,
        state: &RuntimeState,
        record: &serde_json::Value,
        still: &(dyn for<'v> Fn(&'v serde_json::Value) -> bool + Sync),
    ) -> Result<bool, RuntimeError>;

    /// Whether this server is, for now, the one that does the servers' common chores: expiring
    /// sandboxes, and making the pools' warm sandboxes, which every server claims from.
    fn leads(&self) -> bool;

    /// Every sandbox there now, then [`RecordEvent::Synced`], then each change as it happens.
    fn follow(&self) -> BoxStream<'static, RecordEvent>;
    /// A small document every server shares (the tenants' key store): its version and bytes,
    /// `None` while there is none.
    async fn read_document(&self, name: &str) -> Result<Option<(String, Vec<u8>)>, RuntimeError>;
    /// Writes document `name` if it is still at `version` (`None`: if there is none yet),
    /// atomically: `false` when another server changed it first.
    async fn write_document(
        &self,
        name: &str,
        version: Option<&str>,
        bytes: &[u8],
    ) -> Result<bool, RuntimeError>;
}
