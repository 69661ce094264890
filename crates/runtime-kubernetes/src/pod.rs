//! What a sandbox is on Kubernetes: the Pod Warren creates for it, and what Warren reads back from
//! a Pod's status.
//!
//! The sandbox's image runs as the Pod's one container, with execd (copied from Warren's own
//! image by an init container into a volume of the Pod) as its first process, listening on TCP for
//! the server and checking the per-sandbox credential whose verifier it is given. The container
//! gets the same confinement as a sandbox elsewhere: Docker's capabilities less `MKNOD`, no
//! privilege escalation, the runtime's default seccomp profile, no service account token, no
//! service links, cpu and memory bounds as requests and limits.
//!
//! With the egress sidecar (`PodSettings::egress`), a second container from Warren's image runs
//! `warren egress-sidecar` in the Pod's network namespace, before the sandbox's container starts (a
//! native sidecar: an init container that keeps running, whose start-up probe is its control port,
//! bound once its rules are in): it alone has `NET_ADMIN`, and the sandbox's container loses
//! `NET_RAW` too, without which it cannot mark its sockets as the sidecar's (see
//! `warren_egress::sidecar`).
//!
//! Why one file: ~285 of its lines are tests that check the manifests field by field. The rest is
//! the Pod and Secret manifests Warren writes and the `PodView` it reads back, which share the
//! labels, names and container names defined at the top.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use warren_core::{policy, ExitInfo, SandboxImage, SandboxSpec, VolumeSource};

/// Label carrying the sandbox id.
pub const LABEL_SANDBOX: &str = "io.warren.sandbox";
/// Label carrying the Warren instance that owns the Pod.
pub const LABEL_OWNER: &str = "io.warren.owner";
/// Annotation carrying the sandbox's record, when the cluster keeps the records (a shared key):
/// the server's record as JSON, without its secret, which every replica derives.
pub const ANNOTATION_RECORD: &str = "io.warren.record";
/// The Pod's container that runs the sandbox.
pub const SANDBOX_CONTAINER: &str = "sandbox";
/// Where execd's binary is in the Pod (the init container copies it there).
pub const EXECD_DIR: &str = "/.warren/bin";
const EXECD_VOLUME: &str = "warren-execd";
/// The egress sidecar's container, and its own volume (the policy in force, which it starts from
/// again if it restarts; the sandbox's container does not mount it).
pub const EGRESS_CONTAINER: &str = "warren-egress";
const EGRESS_VOLUME: &str = "warren-egress";
const EGRESS_DIR: &str = "/.warren/egress";

/// What a Pod template needs besides the sandbox's own spec.
#[derive(Debug, Clone)]
pub struct PodSettings {
    pub instance: String,
    /// An image holding execd's static binary at `execd_image_path`, and `cp`.
    pub execd_image: String,
    pub execd_image_path: String,
    pub runtime_class: Option<String>,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Value>,
    /// Secrets every sandbox Pod pulls with.
    pub image_pull_secrets: Vec<String>,
    /// Node folders `host` volumes may mount (each whole, as a hostPath; what lies under it through
    /// the kubelet's subPath, which does not follow a symlink out of the folder).
    pub allowed_host_paths: Vec<std::path::PathBuf>,
    /// The egress sidecar in every sandbox Pod, when on (`[kubernetes] egress_sidecar`).
    pub egress: Option<EgressSidecar>,
}

/// How the egress sidecar runs.
#[derive(Debug, Clone)]
pub struct EgressSidecar {
    /// The `warren` binary in `execd_image`.
    pub command: String,
    /// Where allowed DNS queries go (`ip:port`); `None`: the Pod's resolv.conf's first server.
    pub dns_upstream: Option<String>,
}

pub fn pod_name(id: &str) -> String {
    format!("warren-{id}")
}

/// The Secret holding a create's own registry credentials (`image.auth`).
pub fn pull_secret_name(id: &str) -> String {
    format!("warren-{id}-pull")
}

/// The registry an image reference names, as a `.dockerconfigjson` key: the first path component
/// when it looks like a host (a dot, a port, `localhost`), else Docker Hub.
pub fn registry_key(image: &str) -> String {
    match image.split_once('/') {
        Some((first, _)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            if matches!(
                first,
                "docker.io" | "index.docker.io" | "registry-1.docker.io"
            ) {
                "https://index.docker.io/v1/".into()
            } else {
                first.to_string()
            }
        }
        _ => "https://index.docker.io/v1/".into(),
    }
}

/// A `kubernetes.io/dockerconfigjson` Secret with `auth` for `image`'s registry, labelled as the
/// sandbox's (so a restarted server finds the ones left without a Pod).
pub fn pull_secret(
    spec: &SandboxSpec,
    image: &str,
    auth: &warren_api::lifecycle::ImageAuth,
    settings: &PodSettings,
) -> Value {
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let config = json!({"auths": {registry_key(image): {
        "username": auth.username,
        "password": auth.password,
        "auth": b64(&format!("{}:{}", auth.username, auth.password)),
    }}});
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/dockerconfigjson",
        "metadata": {
            "name": pull_secret_name(&spec.id),
            "labels": {
                LABEL_SANDBOX: spec.id,
                LABEL_OWNER: settings.instance,
                "app.kubernetes.io/managed-by": "warren",
            },
        },
        "data": {".dockerconfigjson": b64(&config.to_string())},
    })
}

/// The egress sidecar's container: a native sidecar (an init container that keeps running) that
/// the kubelet starts before the sandbox's container and waits for until its control port answers,
/// which it binds only once its rules are in force.
fn egress_sidecar(spec: &SandboxSpec, settings: &PodSettings, sidecar: &EgressSidecar) -> Value {
    let policy = spec.egress.as_ref().map_or_else(
        || json!({"defaultAction": "deny", "egress": []}),
        |p| p.rules.clone(),
    );
    let mut command = vec![
        sidecar.command.clone(),
        "egress-sidecar".to_string(),
        "--listen".to_string(),
        format!("0.0.0.0:{}", warren_api::EGRESS_SIDECAR_PORT),
        "--access-token-sha256".to_string(),
        spec.execd_verifier.clone(),
        "--inbound-port".to_string(),
        warren_api::EXECD_PORT.to_string(),
        "--policy".to_string(),
        policy.to_string(),
        "--state-file".to_string(),
        format!("{EGRESS_DIR}/policy.json"),
    ];
    if let Some(upstream) = &sidecar.dns_upstream {
        command.extend(["--dns-upstream".to_string(), upstream.clone()]);
    }
    json!({
        "name": EGRESS_CONTAINER,
        "image": settings.execd_image,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "command": command,
        "ports": [{"name": "egress", "containerPort": warren_api::EGRESS_SIDECAR_PORT, "protocol": "TCP"}],
        "startupProbe": {
            "tcpSocket": {"port": warren_api::EGRESS_SIDECAR_PORT},
            "periodSeconds": 1,
            "failureThreshold": 60,
        },
        "volumeMounts": [{"name": EGRESS_VOLUME, "mountPath": EGRESS_DIR}],
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "resources": {
            "limits": {"cpu": "200m", "memory": "64Mi"},
            "requests": {"cpu": "10m", "memory": "16Mi"},
        },
    })
}

/// The Pod for `spec`; `image` is the reference the cluster pulls.
pub fn manifest(spec: &SandboxSpec, image: &str, settings: &PodSettings) -> Result<Value, String> {
    let mut init = vec![json!({
        "name": "warren-execd",
        "image": settings.execd_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["cp", settings.execd_image_path, format!("{EXECD_DIR}/warren-execd")],
        "volumeMounts": [{"name": EXECD_VOLUME, "mountPath": EXECD_DIR}],
        "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
        "resources": {"limits": {"cpu": "100m", "memory": "64Mi"}},
    })];
    if let Some(sidecar) = &settings.egress {
        init.push(egress_sidecar(spec, settings, sidecar));
    }
    let execd = format!("{EXECD_DIR}/warren-execd");
    let mut command = vec![
        execd,
        "--listen".to_string(),
        format!("0.0.0.0:{}", warren_api::EXECD_PORT),
        "--access-token-sha256".to_string(),
        spec.execd_verifier.clone(),
    ];
    if let Some(floor) = &spec.hardening {
        command.extend(["--floor".to_string(), json!(floor).to_string()]);
    }
    command.push("--".to_string());
    command.extend(spec.entrypoint.iter().cloned());
    let env: Vec<Value> = spec
        .env
        .iter()
        .map(|(k, v)| json!({"name": k, "value": v}))
        .collect();
    let mut limits = serde_json::Map::new();
    if let Some(m) = spec.limits.cpu_millis {
        limits.insert("cpu".into(), json!(format!("{m}m")));
    }
    if let Some(b) = spec.limits.memory_bytes {
        limits.insert("memory".into(), json!(b.to_string()));
    }
    if let Some(b) = spec.limits.disk_bytes {
        // The kubelet evicts a Pod over it (rather than the write failing, as on a sandbox disk).
        limits.insert("ephemeral-storage".into(), json!(b.to_string()));
    }
    let mut volumes = vec![json!({"name": EXECD_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}})];
    if settings.egress.is_some() {
        volumes.push(json!({"name": EGRESS_VOLUME, "emptyDir": {"sizeLimit": "1Mi"}}));
    }
    let mut mounts = vec![json!({"name": EXECD_VOLUME, "mountPath": EXECD_DIR, "readOnly": true})];
    for (i, v) in spec.volumes.iter().enumerate() {
        let name = format!("volume-{i}");
        let sub_path = match &v.source {
            VolumeSource::Named {
                claim, sub_path, ..
            } => {
                volumes.push(json!({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": v.read_only}}));
                sub_path.clone()
            }
            VolumeSource::Host(path) => {
                // The allowed folder itself is the hostPath; the rest of the path is a subPath,
                // which the kubelet resolves without following a symlink out of the folder (one a
                // sandbox with that folder writable could have planted for the next).
                let (root, rest) = settings
                    .allowed_host_paths
                    .iter()
                    .filter(|a| path.starts_with(a))
                    .max_by_key(|a| a.components().count())
                    .and_then(|a| Some((a, path.strip_prefix(a).ok()?)))
                    .ok_or_else(|| {
                        format!(
                            "volume at {}: {} is not under a node folder in [kubernetes] allowed_host_paths",
                            v.target,
                            path.display()
                        )
                    })?;
                volumes
                    .push(json!({"name": name, "hostPath": {"path": root, "type": "Directory"}}));
                let rest = rest.to_string_lossy();
                (!rest.is_empty()).then(|| rest.to_string())
            }
        };
        let mut mount = json!({"name": name, "mountPath": v.target, "readOnly": v.read_only});
        if let Some(sub) = sub_path {
            mount["subPath"] = json!(sub);
        }
        mounts.push(mount);
    }
    let caps: Vec<&str> = policy::KEPT_CAPABILITIES
        .iter()
        .map(|c| c.trim_start_matches("CAP_"))
        // With NET_RAW a process may set SO_MARK, and so pass as the egress sidecar.
        .filter(|c| settings.egress.is_none() || *c != "NET_RAW")
        .collect();
    let mut pod_spec = json!({
        "restartPolicy": "Never",
        "automountServiceAccountToken": false,
        "enableServiceLinks": false,
        "terminationGracePeriodSeconds": 5,
        "hostname": spec.id.chars().take(12).collect::<String>(),
        "volumes": volumes,
        "initContainers": init,
        "containers": [{
            "name": SANDBOX_CONTAINER,
            "image": image,
            "command": command,
            "env": env,
            "ports": [{"name": "execd", "containerPort": warren_api::EXECD_PORT, "protocol": "TCP"}],
            "resources": {"limits": limits.clone(), "requests": limits},
            "volumeMounts": mounts,
            "securityContext": {
                "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"], "add": caps},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
        }],
    });
    if let Some(class) = &settings.runtime_class {
        pod_spec["runtimeClassName"] = json!(class);
    }
    if !settings.node_selector.is_empty() {
        pod_spec["nodeSelector"] = json!(settings.node_selector);
    }
    if !settings.tolerations.is_empty() {
        pod_spec["tolerations"] = json!(settings.tolerations);
    }
    let mut pull_secrets: Vec<Value> = settings
        .image_pull_secrets
        .iter()
        .map(|n| json!({"name": n}))
        .collect();
    if matches!(&spec.image, SandboxImage::Reference { auth: Some(_), .. }) {
        pull_secrets.push(json!({"name": pull_secret_name(&spec.id)}));
    }
    if !pull_secrets.is_empty() {
        pod_spec["imagePullSecrets"] = json!(pull_secrets);
    }
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(&spec.id),
            "labels": {
                LABEL_SANDBOX: spec.id,
                LABEL_OWNER: settings.instance,
                "app.kubernetes.io/managed-by": "warren",
            },
        },
        "spec": pod_spec,
    });
    if let Some(record) = &spec.record {
        pod["metadata"]["annotations"] = json!({ANNOTATION_RECORD: record.to_string()});
    }
    Ok(pod)
}

/// What Warren reads from a Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// The sandbox it is (its label).
    pub sandbox: Option<String>,
    /// Its record (the annotation, as written), when the cluster keeps the records.
    pub record: Option<String>,
    /// It pulls with a Secret of its sandbox's own (`image.auth`).
    pub pull_secret: bool,
    pub uid: String,
    pub phase: String,
    pub ip: Option<String>,
    pub deleting: bool,
    /// The sandbox container's end, when it ended: exit code, and the reason and message.
    pub exit: Option<(i32, String)>,
    /// Why the Pod failed as a whole (`Evicted`, …), with its message.
    pub reason: Option<String>,
}

impl PodView {
    pub fn of(pod: &Value) -> Self {
        let status = &pod["status"];
        let exit = status["containerStatuses"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["name"] == SANDBOX_CONTAINER)
            .and_then(|c| {
                let t = &c["state"]["terminated"];
                let code = i32::try_from(t["exitCode"].as_i64()?).ok()?;
                let why = [t["reason"].as_str(), t["message"].as_str()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(": ");
                Some((code, why))
            });
        let reason = status["reason"]
            .as_str()
            .map(|r| match status["message"].as_str() {
                Some(m) => format!("{r}: {m}"),
                None => r.to_string(),
            });
        let sandbox = pod["metadata"]["labels"][LABEL_SANDBOX]
            .as_str()
            .map(str::to_string);
        let pull_secret = sandbox.as_deref().is_some_and(|id| {
            let own = pull_secret_name(id);
            pod["spec"]["imagePullSecrets"]
                .as_array()
                .is_some_and(|l| l.iter().any(|s| s["name"] == own.as_str()))
        });
        Self {
            record: pod["metadata"]["annotations"][ANNOTATION_RECORD]
                .as_str()
                .map(str::to_string),
            sandbox,
            pull_secret,
            uid: pod["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            phase: status["phase"].as_str().unwrap_or("Pending").to_string(),
            ip: status["podIP"]
                .as_str()
                .filter(|ip| !ip.is_empty())
                .map(str::to_string),
            deleting: !pod["metadata"]["deletionTimestamp"].is_null(),
            exit,
            reason,
        }
    }

    /// The Pod will run no more.
    pub fn ended(&self) -> bool {
        matches!(self.phase.as_str(), "Succeeded" | "Failed")
    }

    /// How the sandbox ended, once its Pod will run no more (ended, or being deleted).
    pub fn exit(&self) -> Option<ExitInfo> {
        if self.deleting {
            return Some(ExitInfo {
                code: None,
                signal: None,
                vanished: true,
                detail: Some("the Pod is being deleted".into()),
            });
        }
        if !self.ended() {
            return None;
        }
        Some(ExitInfo {
            code: self.exit.as_ref().map(|(c, _)| *c),
            signal: None,
            vanished: false,
            // The Pod's own reason (an eviction) says more than the code.
            detail: self.reason.clone().or_else(|| {
                self.exit
                    .as_ref()
                    .map(|(_, why)| why.clone())
                    .filter(|w| !w.is_empty())
            }),
        })
    }

    /// Why a Pod that did not come up did not, for the caller.
    pub fn failure(&self) -> String {
        match (&self.exit, &self.reason) {
            (Some((code, why)), _) => format!("the sandbox's container exited ({code}) {why}"),
            (None, Some(r)) => format!("the Pod failed: {r}"),
            (None, None) => format!("the Pod is {}", self.phase),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_core::{Background, ResourceLimits, SandboxImage, VolumeMount};

    fn spec() -> SandboxSpec {
        SandboxSpec {
            id: "0123456789abcdef".into(),
            image: SandboxImage::Reference {
                name: "python:3.12".into(),
                auth: None,
            },
            entrypoint: vec!["sleep".into(), "infinity".into()],
            env: [("A".to_string(), "1".to_string())].into_iter().collect(),
            limits: ResourceLimits {
                cpu_millis: Some(500),
                memory_bytes: Some(1 << 30),
                pids: 100,
                disk_bytes: None,
            },
            volumes: Vec::new(),
            background: Background::default(),
            isolation: false,
            execd_verifier: "ab".repeat(32),
            record: None,
            egress: None,
            hardening: None,
        }
    }

    fn settings() -> PodSettings {
        PodSettings {
            instance: "warren-0".into(),
            execd_image: "warren:latest".into(),
            execd_image_path: "/usr/local/bin/warren-execd".into(),
            runtime_class: Some("gvisor".into()),
            node_selector: [("pool".to_string(), "sandboxes".to_string())].into(),
            tolerations: vec![
                json!({"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}),
            ],
            image_pull_secrets: vec!["regcred".into()],
            allowed_host_paths: vec!["/srv/shared".into(), "/srv/shared/deep".into()],
            egress: None,
        }
    }

    #[test]
    fn the_pod_runs_execd_first_with_only_the_verifier_and_no_token_of_the_cluster() {
        let pod = manifest(&spec(), "python:3.12", &settings()).expect("pod");
        assert_eq!(pod["metadata"]["name"], "warren-0123456789abcdef");
        assert_eq!(pod["metadata"]["labels"][LABEL_OWNER], "warren-0");
        let s = &pod["spec"];
        assert_eq!(s["automountServiceAccountToken"], false);
        assert_eq!(s["enableServiceLinks"], false);
        assert_eq!(s["restartPolicy"], "Never");
        assert_eq!(s["runtimeClassName"], "gvisor");
        assert_eq!(s["nodeSelector"]["pool"], "sandboxes");
        let c = &s["containers"][0];
        let cmd: Vec<&str> = c["command"]
            .as_array()
            .expect("command")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(
            cmd,
            [
                "/.warren/bin/warren-execd",
                "--listen",
                "0.0.0.0:44772",
                "--access-token-sha256",
                &"ab".repeat(32),
                "--",
                "sleep",
                "infinity"
            ]
        );
        assert_eq!(c["resources"]["limits"]["cpu"], "500m");
        assert_eq!(c["resources"]["limits"]["memory"], (1u64 << 30).to_string());
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
        let added = c["securityContext"]["capabilities"]["add"]
            .as_array()
            .expect("caps");
        assert!(!added.contains(&json!("MKNOD")) && !added.contains(&json!("SYS_ADMIN")));
        assert_eq!(
            s["initContainers"][0]["command"],
            json!([
                "cp",
                "/usr/local/bin/warren-execd",
                "/.warren/bin/warren-execd"
            ])
        );
        assert_eq!(c["volumeMounts"][0]["readOnly"], true);
        assert!(
            added.contains(&json!("NET_RAW")),
            "no sidecar: Docker's set"
        );
        assert_eq!(s["initContainers"].as_array().map(Vec::len), Some(1));

        // Hardening on: execd is told the floor before the entrypoint.
        let hardened = SandboxSpec {
            hardening: Some(warren_api::hardening::FloorPolicy {
                keep_capabilities: vec!["CAP_NET_RAW".into()],
                seccomp_deny: None,
            }),
            ..spec()
        };
        let pod = manifest(&hardened, "python:3.12", &settings()).expect("pod");
        let cmd = &pod["spec"]["containers"][0]["command"];
        assert_eq!(cmd[5], "--floor");
        assert_eq!(cmd[6], r#"{"keep_capabilities":["CAP_NET_RAW"]}"#);
        assert_eq!(cmd[7], "--");
    }

    #[test]
    fn the_egress_sidecar_starts_first_alone_with_net_admin_and_the_sandbox_loses_net_raw() {
        let mut set = settings();
        set.egress = Some(EgressSidecar {
            command: "/usr/local/bin/warren".into(),
            dns_upstream: Some("10.96.0.10:53".into()),
        });
        let mut sp = spec();
        let rules =
            json!({"defaultAction": "deny", "egress": [{"action": "allow", "target": "pypi.org"}]});
        sp.egress = Some(warren_core::EgressPolicy {
            rules: rules.clone(),
            addresses: None,
        });
        let pod = manifest(&sp, "python:3.12", &set).expect("pod");
        let s = &pod["spec"];
        let sidecar = &s["initContainers"][1];
        assert_eq!(sidecar["name"], EGRESS_CONTAINER);
        // A native sidecar, started before the sandbox and waited for.
        assert_eq!(sidecar["restartPolicy"], "Always");
        assert_eq!(sidecar["startupProbe"]["tcpSocket"]["port"], 44774);
        assert_eq!(
            sidecar["securityContext"]["capabilities"],
            json!({"drop": ["ALL"], "add": ["NET_ADMIN"]})
        );
        let cmd: Vec<&str> = sidecar["command"]
            .as_array()
            .expect("command")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(&cmd[..2], ["/usr/local/bin/warren", "egress-sidecar"]);
        let arg = |flag: &str| cmd[cmd.iter().position(|a| *a == flag).expect(flag) + 1];
        assert_eq!(arg("--access-token-sha256"), "ab".repeat(32));
        assert_eq!(arg("--dns-upstream"), "10.96.0.10:53");
        assert_eq!(
            serde_json::from_str::<Value>(arg("--policy")).expect("json"),
            rules
        );
        let c = &s["containers"][0];
        let added = c["securityContext"]["capabilities"]["add"]
            .as_array()
            .expect("caps");
        assert!(!added.contains(&json!("NET_RAW")) && !added.contains(&json!("NET_ADMIN")));
        // Its state volume is the sidecar's alone.
        assert!(c["volumeMounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .all(|m| m["name"] != "warren-egress"));
    }

    #[test]
    fn host_folders_are_refused_and_claims_are_mounted() {
        let mut s = spec();
        s.volumes = vec![VolumeMount {
            target: "/data".into(),
            read_only: false,
            source: VolumeSource::Named {
                claim: "work".into(),
                sub_path: Some("a/b".into()),
                create_if_missing: false,
                delete_on_termination: false,
            },
        }];
        let pod = manifest(&s, "img", &settings()).expect("pod");
        assert_eq!(
            pod["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"],
            "work"
        );
        assert_eq!(
            pod["spec"]["containers"][0]["volumeMounts"][1]["subPath"],
            "a/b"
        );
        s.volumes[0].source = VolumeSource::Host("/etc".into());
        assert!(manifest(&s, "img", &settings()).is_err());
        s.volumes[0].source = VolumeSource::Host("/srv/sharedx/a".into());
        assert!(manifest(&s, "img", &settings()).is_err());
        // an allowed node folder is the hostPath, the rest a subPath the kubelet resolves
        s.volumes[0].source = VolumeSource::Host("/srv/shared/team-a/x".into());
        let pod = manifest(&s, "img", &settings()).expect("pod");
        assert_eq!(
            pod["spec"]["volumes"][1]["hostPath"],
            json!({"path": "/srv/shared", "type": "Directory"})
        );
        assert_eq!(
            pod["spec"]["containers"][0]["volumeMounts"][1]["subPath"],
            "team-a/x"
        );
        // the deepest allowed folder that holds it
        s.volumes[0].source = VolumeSource::Host("/srv/shared/deep".into());
        let pod = manifest(&s, "img", &settings()).expect("pod");
        assert_eq!(
            pod["spec"]["volumes"][1]["hostPath"]["path"],
            "/srv/shared/deep"
        );
        assert!(pod["spec"]["containers"][0]["volumeMounts"][1]
            .get("subPath")
            .is_none());
    }

    #[test]
    fn a_create_s_registry_credentials_go_in_a_secret_of_its_own() {
        use base64::Engine;
        let mut s = spec();
        assert_eq!(
            manifest(&s, "img", &settings()).expect("pod")["spec"]["imagePullSecrets"],
            json!([{"name": "regcred"}])
        );
        let auth = warren_api::lifecycle::ImageAuth {
            username: "agent".into(),
            password: "s3cret:x".into(),
        };
        s.image = SandboxImage::Reference {
            name: "registry.example:5000/team/app:1".into(),
            auth: Some(auth.clone()),
        };
        let pod = manifest(&s, "registry.example:5000/team/app:1", &settings()).expect("pod");
        assert_eq!(
            pod["spec"]["imagePullSecrets"],
            json!([{"name": "regcred"}, {"name": "warren-0123456789abcdef-pull"}])
        );
        // the password is in the Secret only
        assert!(!pod.to_string().contains("s3cret"));
        let secret = pull_secret(&s, "registry.example:5000/team/app:1", &auth, &settings());
        assert_eq!(secret["type"], "kubernetes.io/dockerconfigjson");
        assert_eq!(secret["metadata"]["labels"][LABEL_OWNER], "warren-0");
        let b64 = base64::engine::general_purpose::STANDARD;
        let config: Value = serde_json::from_slice(
            &b64.decode(secret["data"][".dockerconfigjson"].as_str().expect("data"))
                .expect("base64"),
        )
        .expect("json");
        let entry = &config["auths"]["registry.example:5000"];
        assert_eq!(entry["username"], "agent");
        assert_eq!(
            b64.decode(entry["auth"].as_str().expect("auth"))
                .expect("b64"),
            b"agent:s3cret:x"
        );
        for (image, key) in [
            ("python:3.12", "https://index.docker.io/v1/"),
            ("library/python", "https://index.docker.io/v1/"),
            ("docker.io/library/python", "https://index.docker.io/v1/"),
            ("localhost/app", "localhost"),
            ("ghcr.io/o/app@sha256:00", "ghcr.io"),
        ] {
            assert_eq!(registry_key(image), key, "{image}");
        }
    }

    #[test]
    fn a_pod_s_status_is_read() {
        let pod = json!({
            "metadata": {"uid": "u1", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Failed", "podIP": "10.0.0.5", "reason": "Evicted",
                       "message": "low on memory",
                       "containerStatuses": [{"name": "sandbox", "state": {"terminated":
                           {"exitCode": 137, "reason": "OOMKilled"}}}]},
        });
        let v = PodView::of(&pod);
        assert!(v.ended() && v.deleting);
        assert_eq!(v.ip.as_deref(), Some("10.0.0.5"));
        assert_eq!(v.exit, Some((137, "OOMKilled".to_string())));
        assert_eq!(v.reason.as_deref(), Some("Evicted: low on memory"));
        let pending = PodView::of(&json!({"metadata": {}}));
        assert_eq!(pending.phase, "Pending");
        assert!(!pending.ended());
    }
}
