//! The registry with a runtime that panics: a bug in one sandbox's create or watch fails that
//! sandbox alone. Also `plan` and `sandboxes`, the fixtures other test modules use.

use super::*;
use crate::validate::CreatePlan;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use warren_core::{ExitInfo, RuntimeState};
use warren_core::{Liveness, RuntimeError, SandboxSpec};

/// A runtime that panics while it makes a sandbox (`in_create`) or else while it waits for
/// one to end, counting the clean-ups the server asks of it.
#[derive(Default)]
struct PanickingRuntime {
    in_create: bool,
    destroyed: AtomicU32,
}

#[async_trait::async_trait]
impl Runtime for PanickingRuntime {
    fn name(&self) -> String {
        "panicking".into()
    }
    fn features(&self) -> warren_core::RuntimeFeatures {
        warren_core::fake::FEATURES
    }
    async fn create(&self, _spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError> {
        if self.in_create {
            panic!("a bug while making the sandbox")
        }
        Ok(serde_json::json!({"made": true}))
    }
    fn execd_address(&self, id: &str, _: &RuntimeState) -> warren_core::ExecdAddress {
        warren_core::ExecdAddress::Unix(PathBuf::from(format!("/nonexistent/{id}")))
    }
    fn wait_exit(
        &self,
        _: &str,
        _: &RuntimeState,
    ) -> futures::future::BoxFuture<'static, ExitInfo> {
        Box::pin(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            panic!("a bug while watching the sandbox")
        })
    }
    async fn pause(&self, _: &str, _: &RuntimeState) -> Result<(), RuntimeError> {
        Ok(())
    }
    async fn resume(&self, _: &str, _: &RuntimeState) -> Result<(), RuntimeError> {
        Ok(())
    }
    async fn destroy(&self, _: &str, _: &RuntimeState) -> Result<(), RuntimeError> {
        self.destroyed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    async fn liveness(&self, _: &str, _: &RuntimeState) -> Liveness {
        Liveness::Gone
    }
}

/// A create of the smallest kind, for a runtime that takes image references.
pub(crate) fn plan() -> CreatePlan {
    CreatePlan {
        image: "any:latest".into(),
        snapshot_id: None,
        warm_pool: None,
        image_auth: None,
        volumes: Vec::new(),
        entrypoint: Some(vec!["true".into()]),
        timeout_seconds: Some(60),
        limits: warren_core::ResourceLimits {
            cpu_millis: None,
            memory_bytes: None,
            pids: 64,
            disk_bytes: None,
        },
        env: BTreeMap::new(),
        metadata: BTreeMap::new(),
        extensions: BTreeMap::new(),
        network_policy: None,
        credential_proxy: false,
        hooks: Default::default(),
        tenant: warren_store::default_tenant(),
    }
}

/// Sandboxes over `runtime`, with everything else in `dir`.
pub(crate) fn sandboxes(dir: &Path, runtime: Arc<dyn Runtime>) -> Sandboxes {
    Sandboxes::new(
        dir,
        runtime,
        Store::open(dir).expect("store"),
        ImageStore::open(dir).expect("images"),
        Arc::new(Network::new(&crate::config::NetworkSection::default(), dir).expect("network")),
        Options {
            retention_seconds: 3600,
            registries: None,
            max_pulls: 1,
            default_env: BTreeMap::new(),
            floor: None,
            caps: Caps {
                sandboxes: 10,
                creates_in_flight: 10,
            },
            timeline: Default::default(),
        },
    )
}

#[tokio::test]
async fn a_panic_while_creating_fails_that_sandbox_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = Arc::new(PanickingRuntime {
        in_create: true,
        ..Default::default()
    });
    let sandboxes = sandboxes(dir.path(), runtime.clone());
    for _ in 0..2 {
        let err = tokio::spawn({
            let sandboxes = sandboxes.clone();
            async move { sandboxes.create(plan()).await }
        })
        .await
        .expect("the panic stays inside the create")
        .expect_err("the create fails");
        assert_eq!(err.kind, ErrorKind::Failed);
    }
    let records = sandboxes.all();
    assert_eq!(records.len(), 2, "both kept to say why: {records:?}");
    for r in &records {
        assert_eq!(r.state, SandboxState::Failed);
        assert_eq!(r.reason.as_deref(), Some("internal_error"));
    }
    assert_eq!(
        runtime.destroyed.load(Ordering::SeqCst),
        2,
        "each cleaned up"
    );
    // the records on disk say the same: a restart does not find them Pending
    let (stored, _) = Store::open(dir.path())
        .expect("reopen")
        .load_all()
        .expect("load");
    assert!(
        stored.iter().all(|r| r.state == SandboxState::Failed),
        "{stored:?}"
    );
}

#[tokio::test]
async fn a_panic_while_watching_fails_that_sandbox_and_cleans_it_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = Arc::new(PanickingRuntime::default());
    let sandboxes = sandboxes(dir.path(), runtime.clone());
    let rec = sandboxes.create(plan()).await.expect("made");
    assert_eq!(rec.state, SandboxState::Running);
    let failed = async {
        loop {
            match sandboxes.get(&rec.id) {
                Some(r) if r.state == SandboxState::Failed => return r,
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    };
    let r = tokio::time::timeout(Duration::from_secs(10), failed)
        .await
        .expect("marked Failed");
    assert_eq!(r.reason.as_deref(), Some("internal_error"));
    assert_eq!(
        runtime.destroyed.load(Ordering::SeqCst),
        1,
        "its sandbox removed"
    );
}
