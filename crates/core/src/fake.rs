//! An in-memory runtime, for tests of the server's state machine without root or a machine that can
//! run sandboxes (as youki and firecracker test theirs): a sandbox is an entry in a map. A test ends
//! one (its main process exits), makes one vanish (removed behind Warren's back), makes any step
//! fail, and reads back what the server asked for. Built with the `fake` feature (and in this crate's
//! own tests); never part of a server.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use futures::channel::oneshot;
use futures::future::{BoxFuture, FutureExt, Shared};

use crate::runtime::{
    ExecdTransport, ExitInfo, ImageSource, Liveness, Runtime, RuntimeCapabilities, RuntimeError,
    RuntimeState, SandboxSpec,
};

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

/// What the fake runtime says it can do (pause only): for other test runtimes too.
pub const CAPABILITIES: RuntimeCapabilities = RuntimeCapabilities {
    execd_transport: ExecdTransport::Unix,
    pause: true,
    snapshots: false,
    egress_policy: false,
    egress_addresses: false,
    disk_bound: false,
    user_namespaces: false,
    isolated_sessions: false,
    host_volumes: crate::HostVolumes::Server,
};

/// See the module documentation.
#[derive(Default)]
pub struct FakeRuntime {
    inner: Mutex<Inner>,
}

impl FakeRuntime {
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
    }

    fn finish(&self, id: &str, info: ExitInfo) {
        if let Some(end) = self.lock().sandboxes.get_mut(id).and_then(|s| s.end.take()) {
            let _ = end.send(info);
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

    fn capabilities(&self) -> RuntimeCapabilities {
        CAPABILITIES
    }

    fn image_source(&self) -> ImageSource {
        // The spec carries the reference; no image store is needed.
        ImageSource::Engine
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
        Ok(())
    }

    async fn liveness(&self, id: &str, _state: &RuntimeState) -> Liveness {
        match self.lock().sandboxes.get(id) {
            Some(s) if s.paused => Liveness::Paused,
            Some(s) if s.end.is_some() => Liveness::Running,
            _ => Liveness::Gone,
        }
    }
}
