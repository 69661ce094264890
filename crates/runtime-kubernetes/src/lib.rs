//! The Kubernetes runtime: each sandbox is a Pod in one namespace of a cluster (see `pod` for what
//! the Pod is). Warren reaches execd over the Pod network, on the Pod's IP, with the per-sandbox
//! credential execd checks; it follows its Pods through one shared watch (`watch`), so a create
//! waits for its Pod to run, and a Pod that ends, is evicted or is deleted behind Warren's back
//! shows as its sandbox's end.
//!
//! Sandboxes get no network but execd's port by default: one NetworkPolicy, made once per Warren
//! instance, denies their Pods all egress and lets in only execd's port (enforced where the cluster's
//! network plugin enforces NetworkPolicies). A sandbox whose egress policy lets addresses out gets a
//! NetworkPolicy of its own besides (`egress`). Rules naming hosts need the egress sidecar
//! (`PodSettings::egress`): then every sandbox Pod has it, it holds the whole policy, and a sandbox
//! whose policy lets anything out gets a NetworkPolicy letting every address out, the sidecar
//! deciding which. Pause and snapshots are not offered on Kubernetes.
//!
//! With a shared key, replicas of one service serve one set of sandboxes, whose records live on
//! their Pods (`records`).
//!
//! Why one file: the crate's other jobs have modules of their own; what stays is
//! `KubernetesRuntime` and its `Runtime` and `EgressEnforcer` impls, whose methods share private
//! API paths and clean-up steps (`delete_pod`, `delete_pull_secret`, `apply_egress`).

mod client;
mod egress;
mod lease;
pub mod pod;
mod records;
mod section;
mod watch;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::OnceCell;
use warren_core::{
    EgressEnforcer, ExecdAddress, ExecdTransport, ExitInfo, HostVolumes, ImageSource, Liveness,
    Runtime, RuntimeError, RuntimeFeatures, RuntimeState, SandboxImage, SandboxSpec,
};

pub use client::{Client, Connection, KubeError};
use pod::PodView;
pub use pod::{EgressSidecar, PodSettings, LABEL_OWNER, LABEL_SANDBOX};
pub use records::check_key;
use records::PodRecords;
pub use section::KubernetesSection;
use watch::{PodWatch, Seen};

#[derive(Debug, Clone)]
pub struct KubernetesConfig {
    pub connection: Connection,
    pub namespace: String,
    pub pod: PodSettings,
    pub ready_timeout: Duration,
    /// The key every replica of one service holds (`[kubernetes] shared_key_file`): with it the
    /// sandboxes' records live on their Pods and the replicas serve them all (see `records`).
    pub shared_key: Option<Vec<u8>>,
    /// With a shared key: how long the replicas' Lease lasts unrenewed (see `lease`).
    pub lease_duration: Duration,
}

/// What the server persists about a sandbox's Pod.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct PodState {
    pod: String,
    uid: String,
    ip: String,
    /// It pulled with a Secret of its own (`image.auth`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pull_secret: bool,
}

pub struct KubernetesRuntime {
    client: Arc<Client>,
    config: KubernetesConfig,
    pods: Arc<PodWatch>,
    /// The instance's default-deny NetworkPolicy exists (made before the first create).
    policy: OnceCell<()>,
    /// With a shared key: the records on the Pods.
    records: Option<Arc<PodRecords>>,
}

impl KubernetesRuntime {
    /// Starts watching the instance's Pods; needs a Tokio runtime.
    pub fn new(config: KubernetesConfig) -> Result<Self, RuntimeError> {
        let client = Arc::new(
            Client::new(config.connection.clone())
                .map_err(|e| RuntimeError::backend(e.to_string()))?,
        );
        let pods = PodWatch::start(
            client.clone(),
            pods_path(&config.namespace),
            instance_selector(&config.pod.instance),
        );
        let records = config.shared_key.clone().map(|key| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            let identity = format!(
                "{}-{}",
                host.trim(),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            );
            let lease = lease::Lease::start(
                client.clone(),
                &config.namespace,
                format!("warren-{}", config.pod.instance),
                identity,
                config.lease_duration,
            );
            Arc::new(PodRecords {
                client: client.clone(),
                pods: pods.clone(),
                pods_path: pods_path(&config.namespace),
                key,
                lease,
                secrets_path: format!("/api/v1/namespaces/{}/secrets", config.namespace),
                instance: config.pod.instance.clone(),
            })
        });
        Ok(Self {
            client,
            config,
            pods,
            policy: OnceCell::new(),
            records,
        })
    }

    fn pods_path(&self) -> String {
        pods_path(&self.config.namespace)
    }

    fn pod_path(&self, name: &str) -> String {
        format!("{}/{name}", self.pods_path())
    }

    fn network_policies_path(&self) -> String {
        format!(
            "/apis/networking.k8s.io/v1/namespaces/{}/networkpolicies",
            self.config.namespace
        )
    }

    /// Makes sandbox `id`'s own NetworkPolicy say `policy` (made, replaced, or removed when it
    /// lets nothing out). With the egress sidecar, a policy that lets anything out lets every
    /// address out here: the sidecar decides.
    async fn apply_egress(
        &self,
        id: &str,
        pod: &str,
        uid: &str,
        policy: Option<&warren_core::EgressPolicy>,
    ) -> Result<(), RuntimeError> {
        let path = format!(
            "{}/{}",
            self.network_policies_path(),
            egress::policy_name(id)
        );
        let open = warren_core::AddressPolicy {
            default_allow: true,
            rules: Vec::new(),
        };
        let addresses = match (&self.config.pod.egress, policy) {
            (_, None) => None,
            (Some(_), Some(_)) => Some(&open),
            (None, Some(p)) => Some(p.addresses.as_ref().ok_or_else(|| {
                RuntimeError::Invalid(
                    "rules naming hosts need the egress sidecar ([kubernetes] egress_sidecar)"
                        .into(),
                )
            })?),
        };
        let body = addresses
            .and_then(|p| egress::network_policy(id, &self.config.pod.instance, pod, uid, p));
        let Some(body) = body else {
            return self
                .client
                .delete(&path, 0)
                .await
                .map_err(|e| self.map_err("removing the sandbox's NetworkPolicy", e));
        };
        match self
            .client
            .create(&self.network_policies_path(), &body)
            .await
        {
            Ok(_) => Ok(()),
            // There already: its spec replaced (a merge patch replaces lists whole).
            Err(e) if e.status() == Some(409) => self
                .client
                .merge_patch(&path, &json!({"spec": body["spec"]}))
                .await
                .map(|_| ())
                .map_err(|e| self.map_err("updating the sandbox's NetworkPolicy", e)),
            Err(e) => Err(self.map_err("creating the sandbox's NetworkPolicy", e)),
        }
    }

    fn secrets_path(&self) -> String {
        format!("/api/v1/namespaces/{}/secrets", self.config.namespace)
    }

    /// Removes a sandbox's own pull Secret (one already gone is fine).
    async fn delete_pull_secret(&self, id: &str) {
        let path = format!("{}/{}", self.secrets_path(), pod::pull_secret_name(id));
        if let Err(e) = self.client.delete(&path, 0).await {
            tracing::warn!(sandbox_id = %id, error = %e, "could not delete the sandbox's pull Secret");
        }
    }

    fn selector(&self) -> String {
        instance_selector(&self.config.pod.instance)
    }

    fn map_err(&self, what: &str, e: KubeError) -> RuntimeError {
        map_error(what, e)
    }

    /// The NetworkPolicy that gives the instance's sandboxes no egress and only execd's port in.
    async fn ensure_policy(&self) -> Result<(), RuntimeError> {
        self.policy
            .get_or_try_init(|| async {
                let mut ingress = vec![json!({"protocol": "TCP", "port": warren_api::EXECD_PORT})];
                if self.config.pod.egress.is_some() {
                    ingress
                        .push(json!({"protocol": "TCP", "port": warren_api::EGRESS_SIDECAR_PORT}));
                }
                let body = json!({
                    "apiVersion": "networking.k8s.io/v1",
                    "kind": "NetworkPolicy",
                    "metadata": {
                        "name": format!("warren-sandboxes-{}", self.config.pod.instance),
                        "labels": {LABEL_OWNER: self.config.pod.instance},
                    },
                    "spec": {
                        "podSelector": {"matchLabels": {LABEL_OWNER: self.config.pod.instance}},
                        "policyTypes": ["Ingress", "Egress"],
                        "ingress": [{"ports": ingress}],
                        "egress": [],
                    },
                });
                match self
                    .client
                    .create(&self.network_policies_path(), &body)
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(e) if e.status() == Some(409) => Ok(()),
                    Err(e) => Err(self.map_err("creating the sandboxes' NetworkPolicy", e)),
                }
            })
            .await
            .map(|_| ())
    }

    /// Waits until Pod `name` runs with an IP and execd accepts connections there.
    async fn wait_ready(&self, name: &str, deadline: Instant) -> Result<PodView, RuntimeError> {
        let mut rx = self.pods.subscribe(name);
        loop {
            let seen = rx.borrow_and_update().clone();
            match seen {
                Seen::Present(view) if view.ended() || view.deleting => {
                    return Err(RuntimeError::StartFailed(view.failure()))
                }
                Seen::Present(view) if view.phase == "Running" => {
                    if let Some(ip) = view.ip.clone() {
                        if execd_listens(&ip).await {
                            return Ok(view);
                        }
                        // Running, but execd not listening yet: look again shortly.
                        let left = deadline.saturating_duration_since(Instant::now());
                        let _ =
                            tokio::time::timeout(left.min(Duration::from_millis(50)), rx.changed())
                                .await;
                        if Instant::now() >= deadline {
                            break;
                        }
                        continue;
                    }
                }
                Seen::Gone => {
                    return Err(RuntimeError::StartFailed(
                        "the Pod was deleted while it started".into(),
                    ))
                }
                _ => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, rx.changed()).await.is_err() {
                break;
            }
        }
        Err(RuntimeError::StartFailed(format!(
            "the Pod did not run with execd listening within the start timeout ({} s, [runtime] start_timeout_seconds)",
            self.config.ready_timeout.as_secs_f64()
        )))
    }

    /// Whether the API server still has Pod `name` (unsure counts as yes).
    async fn pod_exists(&self, name: &str) -> bool {
        !matches!(
            self.client.get(&self.pod_path(name)).await,
            Err(e) if e.status() == Some(404)
        )
    }

    async fn delete_pod(&self, name: &str) -> Result<(), RuntimeError> {
        self.client
            .delete(&self.pod_path(name), 0)
            .await
            .map_err(|e| self.map_err("deleting the Pod", e))
    }
}

/// The runtime's error for a failed API call.
pub(crate) fn map_error(what: &str, e: KubeError) -> RuntimeError {
    match e {
        KubeError::Unavailable { .. } => RuntimeError::Unavailable(format!("{what}: {e}")),
        KubeError::Api { status: 404, .. } => RuntimeError::NotFound(format!("{what}: {e}")),
        KubeError::Api { status: 409, .. } => RuntimeError::Conflict(format!("{what}: {e}")),
        // The API server refused the object (an invalid field, an admission rule). A 403
        // (RBAC, a quota) is the deployment's to fix: a server error, in the log.
        KubeError::Api {
            status: 400 | 422, ..
        } => RuntimeError::Invalid(format!("{what}: {e}")),
        e => RuntimeError::backend(format!("{what}: {e}")),
    }
}

/// Whether execd accepts a connection at `ip` (its port).
async fn execd_listens(ip: &str) -> bool {
    let Ok(ip) = ip.parse::<std::net::IpAddr>() else {
        return false;
    };
    let addr = SocketAddr::new(ip, warren_api::EXECD_PORT);
    matches!(
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

fn vanished(detail: &str) -> ExitInfo {
    ExitInfo {
        code: None,
        signal: None,
        vanished: true,
        detail: Some(detail.to_string()),
    }
}

fn state_of(state: &RuntimeState) -> Option<PodState> {
    serde_json::from_value(state.clone()).ok()
}

/// Where the Pods of `namespace` are.
fn pods_path(namespace: &str) -> String {
    format!("/api/v1/namespaces/{namespace}/pods")
}

/// The label selector of an instance's Pods.
fn instance_selector(instance: &str) -> String {
    client::selector(&[(LABEL_OWNER, instance)])
}

/// The name of sandbox `id`'s Pod: as recorded, else as Warren names it.
pub(crate) fn pod_of(id: &str, state: &RuntimeState) -> String {
    state_of(state)
        .map(|s| s.pod)
        .unwrap_or_else(|| pod::pod_name(id))
}

#[async_trait::async_trait]
impl EgressEnforcer for KubernetesRuntime {
    fn names(&self) -> bool {
        self.config.pod.egress.is_some()
    }

    async fn set_egress(
        &self,
        id: &str,
        state: &RuntimeState,
        policy: Option<&warren_core::EgressPolicy>,
        credential: &str,
    ) -> Result<(), RuntimeError> {
        let pod = state_of(state)
            .ok_or_else(|| RuntimeError::NotFound(format!("sandbox {id} has no Pod on record")))?;
        if self.config.pod.egress.is_some() {
            // The sidecar first: a NetworkPolicy that opens (none to some) opens to what it says.
            let rules = policy.map_or_else(
                || json!({"defaultAction": "deny", "egress": []}),
                |p| p.rules.clone(),
            );
            if let Err(e) = egress::push_to_sidecar(&pod.ip, credential, &rules).await {
                // Fail closed: without the sidecar's word, the sandbox's own NetworkPolicy goes,
                // and the Pod reaches nothing until a change goes through.
                let cut = self.apply_egress(id, &pod.pod, &pod.uid, None).await;
                return Err(RuntimeError::backend(format!(
                    "{e}; the sandbox's egress is {} until a policy change succeeds",
                    if cut.is_ok() {
                        "cut"
                    } else {
                        "unchanged (its NetworkPolicy could not be removed)"
                    }
                )));
            }
        }
        self.apply_egress(id, &pod.pod, &pod.uid, policy).await
    }
}

#[async_trait::async_trait]
impl Runtime for KubernetesRuntime {
    fn name(&self) -> String {
        match &self.config.pod.runtime_class {
            Some(class) => format!("kubernetes/{class}"),
            None => "kubernetes".into(),
        }
    }

    fn backend_identifiers(&self, id: &str) -> std::collections::BTreeMap<String, String> {
        [
            ("namespace".to_string(), self.config.namespace.clone()),
            ("pod".to_string(), pod::pod_name(id)),
        ]
        .into()
    }

    fn shared_records(&self) -> Option<Arc<dyn warren_core::SharedRecords>> {
        self.records
            .clone()
            .map(|r| r as Arc<dyn warren_core::SharedRecords>)
    }

    fn node_host_paths(&self) -> Vec<std::path::PathBuf> {
        self.config.pod.allowed_host_paths.clone()
    }

    fn features(&self) -> RuntimeFeatures {
        RuntimeFeatures {
            execd_transport: ExecdTransport::Tcp,
            pause: false,
            // `ephemeral-storage` is passed on as a limit, which the kubelet enforces by eviction.
            disk_bound: false,
            user_namespaces: false,
            isolated_sessions: false,
            host_volumes: if self.config.pod.allowed_host_paths.is_empty() {
                HostVolumes::None
            } else {
                HostVolumes::Node
            },
            image_source: ImageSource::Engine,
            create_parallelism: None,
        }
    }

    /// No link: sandboxes get no egress by default (the instance's NetworkPolicy), and a sandbox
    /// whose policy lets addresses out a NetworkPolicy of its own (rules naming hosts: the egress
    /// sidecar, when configured).
    fn enforcer(&self) -> Option<&dyn EgressEnforcer> {
        Some(self)
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<RuntimeState, RuntimeError> {
        let SandboxImage::Reference { name: image, auth } = &spec.image else {
            return Err(RuntimeError::Unsupported(
                "the Kubernetes runtime runs images the cluster pulls; imported images need the native runtime"
                    .into(),
            ));
        };
        if image == "host" {
            return Err(RuntimeError::Unsupported(
                "the built-in `host` image needs the native runtime".into(),
            ));
        }
        let manifest =
            pod::manifest(spec, image, &self.config.pod).map_err(RuntimeError::Invalid)?;
        self.ensure_policy().await?;
        let deadline = Instant::now() + self.config.ready_timeout;
        let name = pod::pod_name(&spec.id);
        // A create's own registry credentials: a Secret the Pod pulls with, made first (a kubelet
        // that found it missing would back off for seconds), then owned by the Pod so the
        // cluster removes it with the Pod, whoever deletes that.
        if let Some(auth) = auth {
            let secret = pod::pull_secret(spec, image, auth, &self.config.pod);
            self.client
                .create(&self.secrets_path(), &secret)
                .await
                .map_err(|e| self.map_err("creating the image pull Secret", e))?;
        }
        let created = match self.client.create(&self.pods_path(), &manifest).await {
            Ok(c) => c,
            Err(e) => {
                if auth.is_some() {
                    self.delete_pull_secret(&spec.id).await;
                }
                return Err(self.map_err("creating the Pod", e));
            }
        };
        let uid = created["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if let Some(policy) = &spec.egress {
            // Made after the Pod, which owns it: until it exists the Pod reaches nothing, never more
            // than its policy lets it.
            if let Err(e) = self.apply_egress(&spec.id, &name, &uid, Some(policy)).await {
                let _ = self.delete_pod(&name).await;
                self.pods.forget(&name);
                if auth.is_some() {
                    self.delete_pull_secret(&spec.id).await;
                }
                return Err(e);
            }
        }
        if auth.is_some() {
            let owner = json!({"metadata": {"ownerReferences": [{
                "apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid,
            }]}});
            let path = format!(
                "{}/{}",
                self.secrets_path(),
                pod::pull_secret_name(&spec.id)
            );
            if let Err(e) = self.client.merge_patch(&path, &owner).await {
                // Warren still removes it with the sandbox; only a Pod deleted behind its back
                // would leave it to the next start's sweep.
                tracing::warn!(sandbox_id = %spec.id, error = %e, "could not make the Pod own its pull Secret");
            }
        }
        match self.wait_ready(&name, deadline).await {
            Ok(view) => serde_json::to_value(PodState {
                pod: name,
                uid,
                ip: view.ip.unwrap_or_default(),
                pull_secret: auth.is_some(),
            })
            .map_err(|e| RuntimeError::backend_with("encoding state", e)),
            Err(e) => {
                // Nothing half-made: the Pod goes, and its Secret.
                let _ = self.delete_pod(&name).await;
                self.pods.forget(&name);
                if auth.is_some() {
                    self.delete_pull_secret(&spec.id).await;
                }
                Err(e)
            }
        }
    }

    fn execd_address(&self, _id: &str, state: &RuntimeState) -> ExecdAddress {
        let addr = state_of(state)
            .and_then(|s| s.ip.parse::<std::net::IpAddr>().ok())
            .map(|ip| SocketAddr::new(ip, warren_api::EXECD_PORT))
            // A record without an address reaches nothing (the discard port of nowhere).
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 9)));
        ExecdAddress::Tcp(addr)
    }

    fn wait_exit(&self, id: &str, state: &RuntimeState) -> BoxFuture<'static, ExitInfo> {
        let name = pod_of(id, state);
        let pods = self.pods.clone();
        let client = self.client.clone();
        let path = self.pod_path(&name);
        Box::pin(async move {
            pods.synced().await;
            let mut rx = pods.subscribe(&name);
            if matches!(*rx.borrow(), Seen::Unknown)
                && matches!(client.get(&path).await, Err(e) if e.status() == Some(404))
            {
                // Not in the watch's list, and not there.
                return vanished("the Pod was deleted");
            }
            loop {
                let seen = rx.borrow_and_update().clone();
                match seen {
                    Seen::Gone => return vanished("the Pod was deleted"),
                    Seen::Present(view) => {
                        if let Some(exit) = view.exit() {
                            return exit;
                        }
                    }
                    Seen::Unknown => {}
                }
                if rx.changed().await.is_err() {
                    // Forgotten: its sandbox was deleted.
                    return vanished("the Pod was deleted");
                }
            }
        })
    }

    async fn pause(&self, _id: &str, _state: &RuntimeState) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(
            "pause is not offered on Kubernetes: a Pod cannot be frozen through the Kubernetes API"
                .into(),
        ))
    }

    async fn resume(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError> {
        self.pause(id, state).await
    }

    async fn destroy(&self, id: &str, state: &RuntimeState) -> Result<(), RuntimeError> {
        let name = pod_of(id, state);
        // Followed from before the delete, so that the watch keeps its removal for this wait
        // (a Pod nobody waits on is not kept once gone).
        let mut rx = self.pods.subscribe(&name);
        if let Err(e) = self.delete_pod(&name).await {
            self.pods.forget(&name);
            return Err(e);
        }
        if state_of(state).is_some_and(|s| s.pull_secret) {
            self.delete_pull_secret(id).await;
        }
        // Gone from the API server (its containers stopped) before the delete answers, within
        // bounds: a node that went away leaves its Pods to the node controller. The watch says
        // when, usually within moments; a Pod it never saw (gone before this server started) is
        // looked up.
        let _ = tokio::time::timeout(
            Duration::from_millis(250),
            rx.wait_for(|s| matches!(s, Seen::Gone)),
        )
        .await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if matches!(*rx.borrow_and_update(), Seen::Gone) || !self.pod_exists(&name).await {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_secs(1), rx.changed()).await;
        }
        self.pods.forget(&name);
        Ok(())
    }

    async fn liveness(&self, id: &str, state: &RuntimeState) -> Liveness {
        let name = pod_of(id, state);
        match self.client.get(&self.pod_path(&name)).await {
            Ok(pod) => {
                let view = PodView::of(&pod);
                let same = state_of(state).is_none_or(|s| s.uid.is_empty() || s.uid == view.uid);
                if same && !view.ended() && !view.deleting {
                    Liveness::Running
                } else {
                    Liveness::Gone
                }
            }
            Err(e) if e.status() == Some(404) => Liveness::Gone,
            // Unknown (the API server is unreachable): assume it runs; its watch tells later.
            Err(e) => {
                tracing::warn!(sandbox_id = %id, error = %e, "could not look the Pod up");
                Liveness::Running
            }
        }
    }

    async fn sweep_orphans(&self, known: &[String]) {
        if self.records.is_some() {
            // The instance's Pods are every replica's: one this server has no record of may be
            // another's create in flight. Each Pod carries its record; a pull Secret is owned by
            // its Pod, and the cluster's garbage collector removes it with the Pod.
            return;
        }
        // Pull Secrets of sandboxes without a record (a create cut off between its Secret and
        // its Pod, say), then Pods.
        if let Ok(list) = self
            .client
            .list(&self.secrets_path(), &self.selector())
            .await
        {
            for s in list["items"].as_array().into_iter().flatten() {
                let id = s["metadata"]["labels"][LABEL_SANDBOX].as_str();
                if let Some(id) = id.filter(|id| !known.iter().any(|k| k == id)) {
                    tracing::info!(
                        sandbox_id = id,
                        "removing a pull Secret that has no sandbox record"
                    );
                    self.delete_pull_secret(id).await;
                }
            }
        }
        let Ok(list) = self.client.list(&self.pods_path(), &self.selector()).await else {
            return;
        };
        for p in list["items"].as_array().into_iter().flatten() {
            let Some(id) = p["metadata"]["labels"][LABEL_SANDBOX].as_str() else {
                continue;
            };
            if !known.iter().any(|k| k == id) {
                if let Some(name) = p["metadata"]["name"].as_str() {
                    tracing::info!(
                        pod = name,
                        "removing a Pod of this instance that has no sandbox record"
                    );
                    let _ = self.delete_pod(name).await;
                }
            }
        }
    }
}

/// The settings `[kubernetes]` leaves out: in a cluster, its own namespace; else `default`.
pub fn default_namespace() -> String {
    Connection::in_cluster_namespace().unwrap_or_else(|| "default".into())
}

/// The labels and selectors a config may set, checked as Kubernetes would.
pub fn check_label_value(what: &str, value: &str) -> Result<(), String> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && value.as_bytes()[0].is_ascii_alphanumeric()
        && value.as_bytes()[value.len() - 1].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} = {value:?}: a Kubernetes label value (at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit)"
        ))
    }
}

/// Tolerations as TOML gives them, for the Pod spec.
pub fn tolerations(values: &[BTreeMap<String, String>]) -> Vec<Value> {
    values.iter().map(|t| json!(t)).collect()
}
