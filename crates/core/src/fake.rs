//! An in-memory runtime, for tests of the server's state machine without root or a machine that can
//! run sandboxes (as youki and firecracker test theirs): a sandbox is an entry in a map. A test ends
//! one (its main process exits), makes one vanish (removed behind Warren's back), makes any step
//! fail, and reads back what the server asked for. Built with the `fake` feature (and in this crate's
//! own tests); never part of a server.
//!
//! [`FakeRuntime::shared`] keeps the sandboxes' records as a cluster would ([`SharedRecords`]): one
//! such runtime given to several servers makes them replicas of one service.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use futures::channel::oneshot;
use futures::future::{BoxFuture, FutureExt, Shared};

use futures::channel::mpsc;
use serde_json::Value;

use crate::runtime::{
    ExecdTransport, ExitInfo, ImageSource, Liveness, Runtime, RuntimeError, RuntimeFeatures,
    RuntimeState, SandboxSpec,
};
use crate::{RecordEvent, SharedPhase, SharedRecords};

/// A step a test can make fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Step {
    Create,
    /// The sandbox comes up but fails its start (the runtime's StartFailed).
    Start,
    Pause,
    Resume,
    Destroy,
}

type Exit = Shared<oneshot::Receiver<ExitInfo>>;

struct Sandbox {
    paused: bool,
    /// Dropped (or sent) when the main process ends: every `wait_exit` resolves.
    end: Option<oneshot::Sender<ExitInfo>>,
    exit: Exit,
}

#[derive(Default)]
struct Inner {
    sandboxes: BTreeMap<String, Sandbox>,
    failing: BTreeSet<Step>,
    created: Vec<String>,
    destroyed: Vec<String>,
}

/// What the fake runtime says it can do (pause only, images by reference): for other test
/// runtimes too.
pub const FEATURES: RuntimeFeatures = RuntimeFeatures {
    execd_transport: ExecdTransport::Unix,
    pause: true,
    disk_bound: false,
    user_namespaces: false,
    isolated_sessions: false,
    host_volumes: crate::HostVolumes::Server,
    // The spec carries the reference; no image store is needed.
    image_source: ImageSource::Engine,
    create_parallelism: None,
};

/// See the module documentation.
#[derive(Default)]
pub struct FakeRuntime {
    inner: Mutex<Inner>,
    records: Option<std::sync::Arc<FakeRecords>>,
}

/// The records of a shared fake runtime, and those following them.
#[derive(Default)]
pub struct FakeRecords {
    inner: Mutex<RecordsInner>,
}

#[derive(Default)]
struct RecordsInner {
    records: BTreeMap<String, Value>,
    followers: Vec<mpsc::UnboundedSender<RecordEvent>>,
    /// Writes of records (puts that changed one), in order.
    writes: usize,
    /// Shared documents: (version, bytes).
    documents: BTreeMap<String, (u64, Vec<u8>)>,
}

impl FakeRecords {
    fn lock(&self) -> MutexGuard<'_, RecordsInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn emit(inner: &mut RecordsInner, event: &RecordEvent) {
        inner
            .followers
            .retain(|f| f.unbounded_send(event.clone()).is_ok());
    }

    fn seen(id: &str, record: Option<Value>, phase: SharedPhase) -> RecordEvent {
        RecordEvent::Seen {
            id: id.to_string(),
            record,
            state: serde_json::json!({ "fake": id }),
            phase,
        }
    }

    fn write(
        &self,
        inner: &mut RecordsInner,
        id: &str,
        record: &Value,
    ) -> Result<(), RuntimeError> {
        let Some(slot) = inner.records.get_mut(id) else {
            return Err(RuntimeError::NotFound(format!("sandbox {id} is gone")));
        };
        *slot = record.clone();
        inner.writes += 1;
        let event = Self::seen(id, Some(record.clone()), SharedPhase::Running);
        Self::emit(inner, &event);
        Ok(())
    }

    /// Sandbox `id`'s record as kept now.
    pub fn record(&self, id: &str) -> Option<Value> {
        self.lock().records.get(id).cloned()
    }

    /// How many record writes there were (creates carry theirs: not counted).
    pub fn writes(&self) -> usize {
        self.lock().writes
    }
}

#[async_trait::async_trait]
impl SharedRecords for FakeRecords {
    fn secret(&self, id: &str) -> String {
        format!("fake-secret-{id}")
    }

    fn endpoint_signing_key(&self) -> Vec<u8> {
        b"fake-endpoint-signing-key-shared-by-replicas".to_vec()
    }

    async fn put(
        &self,
        id: &str,
        _state: &RuntimeState,
        record: &Value,
    ) -> Result<(), RuntimeError> {
        self.write(&mut self.lock(), id, record)
    }

    async fn put_if(
        &self,
        id: &str,
        _state: &RuntimeState,
        record: &Value,
        still: &(dyn for<'v> Fn(&'v Value) -> bool + Sync),
    ) -> Result<bool, RuntimeError> {
        // Checked and written under one lock: no other write comes between.
        let mut inner = self.lock();
        if !inner.records.get(id).is_some_and(still) {
            return Ok(false);
        }
        self.write(&mut inner, id, record).map(|()| true)
    }

    fn leads(&self) -> bool {
        true
    }

    fn follow(&self) -> futures::stream::BoxStream<'static, RecordEvent> {
        let (tx, rx) = mpsc::unbounded();
        let mut inner = self.lock();
        for (id, record) in &inner.records {
            let _ = tx.unbounded_send(Self::seen(id, Some(record.clone()), SharedPhase::Running));
        }
        let _ = tx.unbounded_send(RecordEvent::Synced);
        inner.followers.push(tx);
        Box::pin(rx)
    }

    async fn read_document(&self, name: &str) -> Result<Option<(String, Vec<u8>)>, RuntimeError> {
        Ok(self
            .lock()
            .documents
            .get(name)
            .map(|(v, b)| (v.to_string(), b.clone())))
    }

    async fn write_document(
        &self,
        name: &str,
        version: Option<&str>,
        bytes: &[u8],
    ) -> Result<bool, RuntimeError> {
        let mut inner = self.lock();
        let now = inner.documents.get(name).map(|(v, _)| v.to_string());
        if now.as_deref() != version {
            return Ok(false);
        }
        let next = now.and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) + 1;
        inner
            .documents
            .insert(name.to_string(), (next, bytes.to_vec()));
        Ok(true)
    }
}

impl FakeRuntime {
    /// A runtime whose records are kept with its sandboxes and shared by every server it is
    /// given to.
    pub fn shared() -> Self {
        Self {
            inner: Mutex::default(),
            records: Some(std::sync::Arc::default()),
        }
    }

    /// The shared records, for a [`FakeRuntime::shared`] one.
    pub fn records(&self) -> Option<&FakeRecords> {
        self.records.as_deref()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on `step` fails (until [`FakeRuntime::heal`]).
    pub fn fail(&self, step: Step) {
        self.lock().failing.insert(step);
    }

    pub fn heal(&self, step: Step) {
        self.lock().failing.remove(&step);
    }

    fn failing(&self, step: Step) -> Result<(), RuntimeError> {
        if self.lock().failing.contains(&step) {
            return Err(RuntimeError::backend(format!("{step:?} failed (fake)")));
        }
        Ok(())
    }

    /// Sandbox `id`'s main process ends with `code`.
    pub fn end(&self, id: &str, code: i32) {
        self.finish(
            id,
            ExitInfo {
                code: Some(code),
                signal: None,
                vanished: false,
                detail: None,
            },
        );
    }

    /// Sandbox `id` is removed behind Warren's back (a container deleted by someone else).
    pub fn vanish(&self, id: &str) {
        self.finish(
            id,
            ExitInfo {
                code: None,
                signal: Some(9),
                vanished: true,
                detail: None,
            },
        );
        self.lock().sandboxes.remove(id);
        self.tell(id, |_| RecordEvent::Gone { id: id.to_string() });
    }

    fn finish(&self, id: &str, info: ExitInfo) {
        if let Some(end) = self.lock().sandboxes.get_mut(id).and_then(|s| s.end.take()) {
            let _ = end.send(info.clone());
        }
        self.tell(id, |record| {
            FakeRecords::seen(id, record, SharedPhase::Ended(info))
        });
    }

    /// Tells the shared records' followers about sandbox `id` (`event` gets its record).
    fn tell(&self, id: &str, event: impl FnOnce(Option<Value>) -> RecordEvent) {
        if let Some(records) = &self.records {
            let mut inner = records.lock();
            let event = event(inner.records.get(id).cloned());
            if let RecordEvent::Gone { .. } = event {
                inner.records.remove(id);
            }
            FakeRecords::emit(&mut inner, &event);
        }
    }

    /// Sandboxes that exist (made and not destroyed or vanished), by id.
    pub fn live(&self) -> Vec<String> {
        self.lock().sandboxes.keys().cloned().collect()
    }

    /// Whether `id` is paused; `None` if it does not exist.
    pub fn paused(&self, id: &str) -> Option<bool> {
        self.lock().sandboxes.get(id).map(|s| s.paused)
    }

    /// Every id ever created, in order.
    pub fn created(&self) -> Vec<String> {
        self.lock().created.clone()
    }

    /// Every id destroyed, in order (once per destroy asked for).
    pub fn destroyed(&self) -> Vec<String> {
        self.lock().destroyed.clone()
    }

    fn set_paused(&self, id: &str, paused: bool) -> Result<(), RuntimeError> {
        match self.lock().sandboxes.get_mut(id) {
            Some(s) => {
                s.paused = paused;
                Ok(())
            }
            None => Err(RuntimeError::NotFound(format!("sandbox {id} is gone"))),
        }
    }
}

#[async_trait::async_trait]
impl Runtime for FakeRuntime {
    fn name(&self) -> String {
        "fake".into()
    }

    fn features(&self) -> RuntimeFeatures {
        FEATURES
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError> {
        self.failing(Step::Create)?;
        if self.lock().failing.contains(&Step::Start) {
            // Made, then it did not come up: nothing is left behind, as the trait asks.
            return Err(RuntimeError::StartFailed(
                "the main process exited during its start (fake)".into(),
            ));
        }
        let (end, exit) = oneshot::channel();
        let mut inner = self.lock();
        inner.created.push(spec.id.clone());
        inner.sandboxes.insert(
            spec.id.clone(),
            Sandbox {
                paused: false,
                end: Some(end),
                exit: exit.shared(),
            },
        );
        drop(inner);
        if let (Some(records), Some(record)) = (&self.records, &spec.record) {
            let mut inner = records.lock();
            inner.records.insert(spec.id.clone(), record.clone());
            let event = FakeRecords::seen(&spec.id, Some(record.clone()), SharedPhase::Running);
            FakeRecords::emit(&mut inner, &event);
        }
        Ok(serde_json::json!({ "fake": spec.id }))
    }

    fn execd_address(&self, id: &str, _state: &RuntimeState) -> crate::ExecdAddress {
        crate::ExecdAddress::Unix(std::path::PathBuf::from(format!("/nonexistent/fake/{id}")))
    }

    fn wait_exit(&self, id: &str, _state: &RuntimeState) -> BoxFuture<'static, ExitInfo> {
        let exit = self.lock().sandboxes.get(id).map(|s| s.exit.clone());
        Box::pin(async move {
            let gone = ExitInfo {
                code: None,
                signal: None,
                vanished: true,
                detail: None,
            };
            match exit {
                // A dropped sender (destroyed) ends it as killed.
                Some(exit) => exit.await.unwrap_or(ExitInfo {
                    code: None,
                    signal: Some(9),
                    vanished: false,
                    detail: None,
                }),
                None => gone,
            }
        })
    }

    async fn pause(&self, id: &str, _state: &RuntimeState) -> Result<(), RuntimeError> {
        self.failing(Step::Pause)?;
        self.set_paused(id, true)
    }

    async fn resume(&self, id: &str, _state: &RuntimeState) -> Result<(), RuntimeError> {
        self.failing(Step::Resume)?;
        self.set_paused(id, false)
    }

    async fn destroy(&self, id: &str, _state: &RuntimeState) -> Result<(), RuntimeError> {
        self.failing(Step::Destroy)?;
        let mut inner = self.lock();
        inner.destroyed.push(id.to_owned());
        // Dropping the sender ends every wait (as killed).
        inner.sandboxes.remove(id);
        drop(inner);
        self.tell(id, |_| RecordEvent::Gone { id: id.to_string() });
        Ok(())
    }

    fn shared_records(&self) -> Option<std::sync::Arc<dyn SharedRecords>> {
        self.records
            .clone()
            .map(|r| r as std::sync::Arc<dyn SharedRecords>)
    }

    async fn liveness(&self, id: &str, _state: &RuntimeState) -> Liveness {
        match self.lock().sandboxes.get(id) {
            Some(s) if s.paused => Liveness::Paused,
            Some(s) if s.end.is_some() => Liveness::Running,
            _ => Liveness::Gone,
        }
    }
}
