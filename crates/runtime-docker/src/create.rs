//! Create: the image on the daemon, the container's body (limits, mounts, security options,
//! execd's delivery), and the wait until execd answers.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::delivery::{execd_volume_name, Delivery, RelayedExecd};
use crate::mounts::Mounts;
use crate::{client, DockerError, DockerRuntime, EXECD_DIR, LABEL_OWNER, LABEL_SANDBOX};
use base64::Engine;
use hyper::Method;
use serde_json::{json, Value};
use warren_core::{
    policy, RuntimeError, SandboxImage, SandboxSpec, EXECD_IN_SANDBOX, EXECD_SOCKET_NAME,
    SOCKET_DIR_IN_SANDBOX,
};

/// How a create sees that execd is up.
pub(crate) enum Probe<'a> {
    /// Its Unix socket accepts.
    Socket(&'a Path),
    /// It answers HTTP through the relay. A connection alone proves nothing: the relay (and the
    /// daemon's port proxy before it) accepts before execd listens. Any answer will do (a 401: the
    /// probe has no credential).
    Relayed(RelayedExecd),
}

impl Probe<'_> {
    async fn answers(&self) -> bool {
        match self {
            Self::Socket(socket) => match warren_core::socket_connect_path(socket) {
                Ok((_handle, reachable)) => {
                    tokio::net::UnixStream::connect(&reachable).await.is_ok()
                }
                Err(_) => false,
            },
            Self::Relayed(e) => {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let probe = async {
                    let mut s = tokio::net::TcpStream::connect(e.relay).await.ok()?;
                    let request = format!(
                        "{}{}\nGET /ping HTTP/1.1\r\nHost: execd\r\nConnection: close\r\n\r\n",
                        warren_api::RELAY_PREAMBLE,
                        e.ip
                    );
                    s.write_all(request.as_bytes()).await.ok()?;
                    let mut head = [0u8; 8];
                    s.read_exact(&mut head).await.ok()?;
                    Some(head.starts_with(b"HTTP/1."))
                };
                tokio::time::timeout(Duration::from_secs(2), probe)
                    .await
                    .ok()
                    .flatten()
                    .unwrap_or(false)
            }
        }
    }

    fn interval(&self) -> Duration {
        match self {
            Self::Socket(_) => Duration::from_millis(2),
            Self::Relayed(_) => Duration::from_millis(20),
        }
    }

    fn checks_per_inspect(&self) -> u32 {
        match self {
            Self::Socket(_) => 25,
            Self::Relayed(_) => 3,
        }
    }
}

/// `no-new-privileges` always. Under gVisor, Warren's own deny-list profile instead of Docker's default
/// one: gVisor cannot evaluate the default profile's argument rules for `clone` (no thread could start).
pub(crate) fn security_opts(oci_runtime: Option<&str>) -> Vec<String> {
    let mut opts = vec!["no-new-privileges".to_string()];
    if oci_runtime.is_some_and(|r| r.contains("runsc") || r.contains("gvisor")) {
        opts.push(format!("seccomp={}", policy::oci_seccomp(true)));
    }
    opts
}

pub(crate) fn bind_mount(source: &Path, target: &str, read_only: bool) -> Value {
    json!({"Type": "bind", "Source": source, "Target": target, "ReadOnly": read_only})
}

/// Docker's log stream without a TTY is framed: 8-byte headers (stream, 0, 0, 0, big-endian length).
pub(crate) fn demux_logs(bytes: &[u8]) -> String {
    let mut out = Vec::new();
    let mut rest = bytes;
    while rest.len() >= 8 {
        let len = u32::from_be_bytes([rest[4], rest[5], rest[6], rest[7]]) as usize;
        let end = (8 + len).min(rest.len());
        out.extend_from_slice(&rest[8..end]);
        rest = &rest[end..];
    }
    String::from_utf8_lossy(&out).to_string()
}

impl DockerRuntime {
    /// The image's config, pulling it first when the daemon does not have it.
    pub(crate) async fn ensure_image(
        &self,
        name: &str,
        auth: Option<&warren_api::lifecycle::ImageAuth>,
    ) -> Result<Value, RuntimeError> {
        let path = format!("/images/{}/json", client::encode(name));
        match self.client.call::<Value>(Method::GET, &path, None).await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(self.map_err(&format!("inspecting image {name}"), e)),
        }
        if !self.config.pull {
            return Err(RuntimeError::ImageNotFound(format!(
                "image {name:?} is not on the Docker host, and this server does not pull ([docker] pull = \"never\")"
            )));
        }
        // The daemon connects wherever a create's name points; a caller must not make it reach
        // the host's own or private services, nor learn from its errors which ports are open.
        warren_registry::delegated_pull_allowed(&self.config.registries, name)
            .await
            .map_err(|why| {
                RuntimeError::ImageNotFound(format!(
                    "image {name:?} is not on the Docker host, and it is not pulled: {why}"
                ))
            })?;
        let registry_auth = auth.map(|a| {
            let json = json!({"username": a.username, "password": a.password});
            base64::engine::general_purpose::URL_SAFE.encode(json.to_string())
        });
        tracing::info!(image = name, "pulling");
        self.client
            .pull(name, registry_auth)
            .await
            .map_err(|e| match e {
                DockerError::Api { message, .. } => RuntimeError::ImageNotFound(format!(
                    "image {name:?} is not on the Docker host and pulling it failed: {message}"
                )),
                e => self.map_err(&format!("pulling image {name}"), e),
            })?;
        self.client
            .call::<Value>(Method::GET, &path, None)
            .await
            .map_err(|e| self.map_err(&format!("inspecting image {name}"), e))
    }

    pub(crate) fn create_body(
        &self,
        spec: &SandboxSpec,
        image: &str,
        image_config: &Value,
        volumes: &[Value],
        delivery: &Delivery,
    ) -> Value {
        let workdir = image_config["Config"]["WorkingDir"]
            .as_str()
            .filter(|w| w.starts_with('/'))
            .unwrap_or("/");
        let mut entrypoint = match delivery {
            Delivery::Local => vec![
                EXECD_IN_SANDBOX.to_string(),
                "--socket".into(),
                format!("{SOCKET_DIR_IN_SANDBOX}/{EXECD_SOCKET_NAME}"),
            ],
            Delivery::Remote { .. } => vec![
                format!("{EXECD_DIR}/warren-execd"),
                "--listen".into(),
                format!("0.0.0.0:{}", warren_api::EXECD_PORT),
                // only the verifier: the credential itself never enters the sandbox
                "--access-token-sha256".into(),
                spec.execd_verifier.clone(),
            ],
        };
        if let Some(floor) = &spec.hardening {
            entrypoint.extend(["--floor".into(), serde_json::json!(floor).to_string()]);
        }
        entrypoint.extend(["--workdir".into(), workdir.to_string(), "--".into()]);
        entrypoint.extend(spec.entrypoint.iter().cloned());
        // Docker adds the image's own env; ours (and the request's) win.
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        env.insert("HOME".into(), "/root".into());
        env.insert("LANG".into(), "C.UTF-8".into());
        if let Some(image_env) = image_config["Config"]["Env"].as_array() {
            for kv in image_env.iter().filter_map(|v| v.as_str()) {
                if let Some((k, v)) = kv.split_once('=') {
                    env.insert(k.into(), v.into());
                }
            }
        }
        env.extend(spec.env.clone());
        let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        // Structured mounts, not `Binds` strings: a `:` in a path cannot be misread.
        let mut mounts = match delivery {
            Delivery::Local => vec![
                bind_mount(&self.config.execd_path, EXECD_IN_SANDBOX, true),
                bind_mount(&self.run_dir(&spec.id), SOCKET_DIR_IN_SANDBOX, false),
            ],
            Delivery::Remote { volume, .. } => vec![json!({
                "Type": "volume", "Source": volume, "Target": EXECD_DIR, "ReadOnly": true,
                "VolumeOptions": {"NoCopy": true},
            })],
        };
        mounts.extend(volumes.iter().cloned());
        let network = match delivery {
            Delivery::Local => "none",
            Delivery::Remote { network, .. } => network,
        };
        let mut host = json!({
            "Mounts": mounts,
            "NetworkMode": network,
            "CapDrop": ["ALL"],
            "CapAdd": policy::KEPT_CAPABILITIES,
            "SecurityOpt": security_opts(self.config.oci_runtime.as_deref()),
            "PidsLimit": spec.limits.pids,
            "RestartPolicy": {"Name": "no"},
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}},
        });
        if let Some(m) = spec.limits.cpu_millis {
            host["NanoCpus"] = json!(m * 1_000_000);
        }
        if let Some(b) = spec.limits.memory_bytes {
            host["Memory"] = json!(b);
            host["MemorySwap"] = json!(b);
        }
        if let Some(b) = spec.limits.disk_bytes {
            // Docker bounds a container's writable layer only on some storage drivers (overlay2
            // over XFS with `pquota`, say); elsewhere the create fails and `create` says why.
            host["StorageOpt"] = json!({"size": b.to_string()});
        }
        if let Some(r) = &self.config.oci_runtime {
            host["Runtime"] = json!(r);
        }
        // Open files per process, as native sandboxes get them (`[limits] open_files`), not the
        // daemon's own limit.
        if let Some((soft, hard)) = warren_core::fd_limit::for_children() {
            host["Ulimits"] = json!([{"Name": "nofile", "Soft": soft, "Hard": hard}]);
        }
        json!({
            "Image": image,
            "Entrypoint": entrypoint,
            "Cmd": [],
            "Env": env,
            "User": "0:0",
            "Hostname": spec.id.chars().take(12).collect::<String>(),
            "WorkingDir": workdir,
            "Labels": {LABEL_SANDBOX: spec.id, LABEL_OWNER: self.owner},
            "HostConfig": host,
        })
    }

    /// The container's id, and where execd is when it is reached through the relay.
    pub(crate) async fn try_create(
        &self,
        spec: &SandboxSpec,
        name: &str,
        volumes: &Mounts,
    ) -> Result<(String, Option<RelayedExecd>), RuntimeError> {
        let SandboxImage::Reference { name: image, auth } = &spec.image else {
            return Err(RuntimeError::Unsupported(
                "the Docker runtime runs images from the Docker host; the built-in `host` image and \
                 imported images need the native runtime"
                    .into(),
            ));
        };
        if image == "host" {
            return Err(RuntimeError::Unsupported(
                "the built-in `host` image needs the native runtime".into(),
            ));
        }
        let image_config = self.ensure_image(image, auth.as_ref()).await?;
        let run_dir = self.run_dir(&spec.id);
        let mut subnet = String::new();
        let delivery = if self.local {
            warren_core::mount_socket_dir(&run_dir).map_err(|e| {
                RuntimeError::backend_with(
                    format!("mounting the socket folder {}", run_dir.display()),
                    e,
                )
            })?;
            Delivery::Local
        } else {
            let (network, net) = self.sandbox_network().await?;
            subnet = net;
            Delivery::Remote {
                volume: execd_volume_name(&self.execd_build(image).await?),
                network,
            }
        };
        let body = self.create_body(spec, image, &image_config, &volumes.mounts, &delivery);
        let created: Value = self
            .client
            .call(
                Method::POST,
                &format!("/containers/create?name={}", client::encode(name)),
                Some(&body),
            )
            .await
            .map_err(|e| match e {
                DockerError::Api { .. }
                    if spec.limits.disk_bytes.is_some() && e.to_string().contains("storage-opt") =>
                {
                    RuntimeError::Unsupported(format!(
                        "ephemeral-storage: this Docker daemon cannot bound a container's writes ({e})"
                    ))
                }
                e => self.map_err("creating the container", e),
            })?;
        let container = created["Id"]
            .as_str()
            .ok_or_else(|| RuntimeError::backend("Docker returned no container id"))?
            .to_string();
        self.client
            .call::<Value>(
                Method::POST,
                &format!("/containers/{container}/start"),
                None,
            )
            .await
            .map_err(|e| self.map_err("starting the container", e))?;
        let execd = match delivery {
            Delivery::Local => {
                let socket = run_dir.join(EXECD_SOCKET_NAME);
                self.wait_ready(&container, &Probe::Socket(&socket)).await?;
                None
            }
            Delivery::Remote { network, .. } => {
                let info = self.inspect(&container).await?;
                let ip = info["NetworkSettings"]["Networks"][network.as_str()]["IPAddress"]
                    .as_str()
                    .and_then(|a| a.parse::<std::net::IpAddr>().ok())
                    .ok_or_else(|| {
                        RuntimeError::backend(format!("the container has no address on {network}"))
                    })?;
                let relay = self.relay(image, &subnet).await?;
                let execd = RelayedExecd { relay, ip };
                self.wait_ready(&container, &Probe::Relayed(execd)).await?;
                Some(execd)
            }
        };
        Ok((container, execd))
    }

    pub(crate) async fn wait_ready(
        &self,
        container: &str,
        probe: &Probe<'_>,
    ) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + self.config.ready_timeout;
        let mut checks = 0u32;
        loop {
            if probe.answers().await {
                return Ok(());
            }
            checks += 1;
            // Every ~50 ms (TCP: every check) also ask the daemon whether the container is still up.
            if checks.is_multiple_of(probe.checks_per_inspect()) {
                let state = self.inspect(container).await?;
                if state["State"]["Running"] != json!(true) {
                    // The caller's to read, as on the native runtime: their image, their logs.
                    return Err(RuntimeError::StartFailed(format!(
                        "the container exited during start (exit code {}): {}",
                        state["State"]["ExitCode"],
                        self.logs_tail(container).await
                    )));
                }
            }
            if Instant::now() > deadline {
                return Err(RuntimeError::StartFailed(format!(
                    "execd did not become ready within {:?}: {}",
                    self.config.ready_timeout,
                    self.logs_tail(container).await
                )));
            }
            tokio::time::sleep(probe.interval()).await;
        }
    }

    /// The container's init pid (with its start time), when the daemon runs on this host.
    pub(crate) async fn init_pid(&self, container: &str) -> Option<(i32, u64)> {
        if !self.local_daemon() {
            return None;
        }
        let info = self.inspect(container).await.ok()?;
        let pid = i32::try_from(info["State"]["Pid"].as_i64()?)
            .ok()
            .filter(|p| *p > 1)?;
        Some((pid, warren_core::process_start_time(pid)?))
    }

    /// The container's last log lines (execd's own messages), for error messages.
    pub(crate) async fn logs_tail(&self, container: &str) -> String {
        use http_body_util::BodyExt;
        let path = format!("/containers/{container}/logs?stdout=1&stderr=1&tail=20");
        let Ok((_, body)) = self.client.send(Method::GET, &path, None, &[]).await else {
            return String::new();
        };
        let Ok(bytes) = body.collect().await.map(|b| b.to_bytes()) else {
            return String::new();
        };
        demux_logs(&bytes).trim().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::Delivery;
    use crate::{DockerConfig, DockerRuntime, SANDBOX_NETWORK};
    use warren_core::{SandboxImage, EXECD_IN_SANDBOX};

    #[test]
    fn log_frames() {
        let mut b = vec![1, 0, 0, 0, 0, 0, 0, 3];
        b.extend_from_slice(b"ab\n");
        b.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 2]);
        b.extend_from_slice(b"c\n");
        assert_eq!(demux_logs(&b), "ab\nc\n");
    }

    #[test]
    fn create_body_has_isolation_and_limits() {
        let rt = DockerRuntime::new(DockerConfig {
            host: Some("unix:///nonexistent".into()),
            oci_runtime: Some("runsc".into()),
            pull: false,
            registries: Default::default(),
            data_dir: std::env::temp_dir().join("warren-docker-unit"),
            execd_path: "/opt/warren-execd".into(),
            ready_timeout: Duration::from_secs(1),
            tls: None,
            sandbox_host: None,
            network: None,
        })
        .expect("runtime");
        let spec = SandboxSpec {
            id: "abc".into(),
            image: SandboxImage::Reference {
                name: "img".into(),
                auth: None,
            },
            entrypoint: vec!["tail".into(), "-f".into(), "/dev/null".into()],
            execd_verifier: String::new(),
            record: None,
            egress: None,
            hardening: None,
            env: [("A".to_string(), "1".to_string())].into_iter().collect(),
            limits: warren_core::ResourceLimits {
                cpu_millis: Some(500),
                memory_bytes: Some(1 << 30),
                pids: 100,
                disk_bytes: None,
            },
            volumes: Vec::new(),
            background: Default::default(),
            isolation: false,
        };
        let b = rt.create_body(
            &spec,
            "img",
            &json!({"Config": {"Env": ["PATH=/bin", "A=0"], "WorkingDir": "/work"}}),
            &[json!({"Type": "volume", "Source": "vol", "Target": "/data", "ReadOnly": true})],
            &Delivery::Local,
        );
        assert_eq!(b["HostConfig"]["Mounts"][2]["Source"], "vol");
        assert_eq!(b["Entrypoint"][0], EXECD_IN_SANDBOX);
        assert_eq!(b["Entrypoint"][4], "/work");
        assert_eq!(b["Entrypoint"][6], "tail");
        assert!(b["Env"].as_array().expect("env").contains(&json!("A=1")));
        assert!(b["Env"]
            .as_array()
            .expect("env")
            .contains(&json!("PATH=/bin")));
        let h = &b["HostConfig"];
        assert_eq!(h["NetworkMode"], "none");
        assert_eq!(h["CapDrop"], json!(["ALL"]));
        assert_eq!(h["SecurityOpt"][0], "no-new-privileges");
        assert!(h["SecurityOpt"][1]
            .as_str()
            .expect("seccomp")
            .starts_with("seccomp={"));
        assert_eq!(security_opts(Some("runc")), ["no-new-privileges"]);
        assert_eq!(h["NanoCpus"], 500_000_000);
        assert_eq!(h["Memory"], h["MemorySwap"]);
        assert_eq!(h["PidsLimit"], 100);
        assert_eq!(h["Runtime"], "runsc");
        assert_eq!(h["Mounts"][0]["Source"], "/opt/warren-execd");
        assert_eq!(h["Mounts"][0]["Target"], EXECD_IN_SANDBOX);
        assert_eq!(h["Mounts"][0]["ReadOnly"], true);
        assert_eq!(b["Labels"][LABEL_SANDBOX], "abc");
        assert!(h.get("PortBindings").is_none());

        // A remote daemon: execd from its volume, on TCP with only the verifier, nothing published.
        let spec = SandboxSpec {
            execd_verifier: "ab".repeat(32),
            ..spec
        };
        let remote = Delivery::Remote {
            volume: "warren-execd-0123".into(),
            network: SANDBOX_NETWORK.into(),
        };
        let b = rt.create_body(&spec, "img", &json!({}), &[], &remote);
        let h = &b["HostConfig"];
        assert_eq!(b["Entrypoint"][0], "/.warren/bin/warren-execd");
        assert_eq!(b["Entrypoint"][1], "--listen");
        assert_eq!(b["Entrypoint"][3], "--access-token-sha256");
        assert_eq!(b["Entrypoint"][4], "ab".repeat(32));
        assert_eq!(h["Mounts"][0]["Type"], "volume");
        assert_eq!(h["Mounts"][0]["Source"], "warren-execd-0123");
        assert_eq!(h["Mounts"][0]["ReadOnly"], true);
        assert_eq!(h["Mounts"].as_array().map(Vec::len), Some(1));
        assert_eq!(h["NetworkMode"], SANDBOX_NETWORK);
        // nothing published: the relay is the way in
        assert!(h.get("PortBindings").is_none() && b.get("ExposedPorts").is_none());

        // Hardening on: execd is told the floor before the entrypoint.
        let spec = SandboxSpec {
            hardening: Some(Default::default()),
            ..spec
        };
        let b = rt.create_body(&spec, "img", &json!({}), &[], &remote);
        let args: Vec<&str> = b["Entrypoint"]
            .as_array()
            .expect("entrypoint")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let at = args.iter().position(|a| *a == "--floor").expect("--floor");
        assert_eq!(args[at + 1], "{}");
        assert!(at < args.iter().position(|a| *a == "--").expect("--"));
    }
}
