//! How execd gets into a container: bind-mounted from this host, or, on a daemon elsewhere, from
//! a volume holding it, reached through the relay container on the daemon's host.

use std::path::Path;

use crate::{
    client, DockerError, DockerRuntime, EXECD_DIR, LABEL_EXECD, LABEL_OWNER, LABEL_RELAY,
    LABEL_RELAY_TO, RELAY_CONTAINER, SANDBOX_NETWORK,
};
use hyper::Method;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use warren_core::RuntimeError;

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct RelayedExecd {
    pub(crate) relay: std::net::SocketAddr,
    pub(crate) ip: std::net::IpAddr,
}

/// How execd gets into a container and is reached.
pub(crate) enum Delivery {
    /// Bind-mounted from this host; a Unix socket in a bind-mounted host folder.
    Local,
    /// From the named volume holding it; TCP, reached through the relay on the daemon's host.
    Remote { volume: String, network: String },
}

/// The volume holding execd build `build` (its short digest) on a remote daemon.
pub(crate) fn execd_volume_name(build: &str) -> String {
    format!("warren-execd-{build}")
}

/// execd as two tar archives for a volume: the binary, then a `ready` marker (its digest).
pub(crate) struct ExecdArchive {
    pub(crate) binary: bytes::Bytes,
    pub(crate) binary_len: usize,
    pub(crate) ready: bytes::Bytes,
}

/// execd's SHA-256 (hex) and its archives.
pub(crate) fn execd_archive(path: &Path) -> std::io::Result<(String, ExecdArchive)> {
    use sha2::Digest;
    let bin = std::fs::read(path)?;
    let digest = format!("{:x}", sha2::Sha256::digest(&bin));
    let tar_of = |name: &str, data: &[u8], mode: u32| -> std::io::Result<bytes::Bytes> {
        let mut b = tar::Builder::new(Vec::with_capacity(data.len() + 2048));
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append_data(&mut h, name, data)?;
        Ok(bytes::Bytes::from(b.into_inner()?))
    };
    let archive = ExecdArchive {
        binary: tar_of("warren-execd", &bin, 0o755)?,
        binary_len: bin.len(),
        ready: tar_of("ready", digest.as_bytes(), 0o644)?,
    };
    Ok((digest, archive))
}

/// A host name or address as an IP (a name is looked up once, when the runtime starts).
pub(crate) fn resolve(host: &str) -> Result<std::net::IpAddr, RuntimeError> {
    if let Ok(ip) = host.parse() {
        return Ok(ip);
    }
    use std::net::ToSocketAddrs;
    (host, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .map(|a| a.ip())
        .ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "[docker] the Docker host {host:?} does not resolve to an address"
            ))
        })
}

impl DockerRuntime {
    /// The relay's address, the relay made (or found, or made again) first. It runs
    /// `warren-execd relay` from an image of execd alone (imported once per execd build) in the
    /// daemon host's network namespace: the host reaches its bridges' containers, which containers
    /// of a network with traffic between them off cannot. One relay per daemon, shared by every
    /// server using it (any build's relay speaks the same).
    pub(crate) async fn relay(
        &self,
        image: &str,
        subnet: &str,
    ) -> Result<std::net::SocketAddr, RuntimeError> {
        // one server makes it at a time
        let _one = self.relay.lock().await;
        let addr = self
            .relay_addr()
            .ok_or_else(|| RuntimeError::backend("no address for the Docker host"))?;
        // Running, for this network: a network removed and made again (`docker network prune`)
        // may have another subnet, which the relay would refuse.
        let current = self.inspect(RELAY_CONTAINER).await.is_ok_and(|i| {
            i["State"]["Running"] == json!(true) && i["Config"]["Labels"][LABEL_RELAY_TO] == subnet
        });
        if !current {
            let build = self.execd_build(image).await?;
            self.ensure_relay(&build, subnet).await?;
        }
        Ok(addr)
    }

    pub(crate) fn relay_addr(&self) -> Option<std::net::SocketAddr> {
        self.sandbox_ip
            .map(|ip| std::net::SocketAddr::new(ip, warren_api::RELAY_PORT))
    }

    pub(crate) async fn running(&self, container: &str) -> bool {
        self.inspect(container)
            .await
            .is_ok_and(|i| i["State"]["Running"] == json!(true))
    }

    pub(crate) async fn ensure_relay(
        &self,
        digest: &str,
        subnet: &str,
    ) -> Result<(), RuntimeError> {
        let image = format!("warren-execd:{digest}");
        let path = format!("/images/{}/json", client::encode(&image));
        if let Err(e) = self.client.call::<Value>(Method::GET, &path, None).await {
            if !e.is_not_found() {
                return Err(self.map_err("looking up execd's image", e));
            }
            let execd_path = self.config.execd_path.clone();
            let (_, archive) = tokio::task::spawn_blocking(move || execd_archive(&execd_path))
                .await
                .map_err(|e| RuntimeError::backend_with("reading execd", e))?
                .map_err(|e| RuntimeError::backend(format!("reading execd: {e}")))?;
            self.client
                .import_image("warren-execd", digest, archive.binary)
                .await
                .map_err(|e| self.map_err("importing execd's image", e))?;
        }
        let _ = self.remove(RELAY_CONTAINER).await; // stopped, or for a network gone since
        let body = json!({
            "Image": image,
            "Entrypoint": ["/warren-execd", "relay",
                           "--listen", format!("0.0.0.0:{}", warren_api::RELAY_PORT),
                           "--to", subnet, "--port", warren_api::EXECD_PORT.to_string()],
            "Cmd": [],
            "User": "65534:65534",
            "Labels": {LABEL_RELAY: digest, LABEL_RELAY_TO: subnet},
            "HostConfig": {
                "NetworkMode": "host",
                "RestartPolicy": {"Name": "unless-stopped"},
                "ReadonlyRootfs": true,
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "LogConfig": {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}},
            },
        });
        let path = format!(
            "/containers/create?name={}",
            client::encode(RELAY_CONTAINER)
        );
        match self
            .client
            .call::<Value>(Method::POST, &path, Some(&body))
            .await
        {
            // another server made it meanwhile
            Ok(_) | Err(DockerError::Api { status: 409, .. }) => {}
            Err(e) => return Err(self.map_err("creating the relay", e)),
        }
        self.try_action(RELAY_CONTAINER, "start").await;
        if !self.running(RELAY_CONTAINER).await {
            return Err(RuntimeError::backend(format!(
                "the relay did not start: {}",
                self.logs_tail(RELAY_CONTAINER).await
            )));
        }
        Ok(())
    }

    /// This execd build's short digest, its volume on the remote daemon uploaded the first time
    /// (per server start, and per execd build: the volume, [`execd_volume_name`], is named for the
    /// binary's digest). Uploading needs a container to write through; one is created from `image`
    /// (already on the daemon), never started, and removed.
    pub(crate) async fn execd_build(&self, image: &str) -> Result<String, RuntimeError> {
        self.execd_build
            .get_or_try_init(|| self.upload_execd(image))
            .await
            .cloned()
    }

    pub(crate) async fn upload_execd(&self, image: &str) -> Result<String, RuntimeError> {
        let path = self.config.execd_path.clone();
        let (digest, archive) = tokio::task::spawn_blocking(move || execd_archive(&path))
            .await
            .map_err(|e| RuntimeError::backend_with("reading execd", e))?
            .map_err(|e| RuntimeError::backend(format!("reading execd: {e}")))?;
        let build = digest[..16].to_string();
        let volume = execd_volume_name(&build);
        // Shared by every server using this execd build on the daemon: no owner label, so no
        // server's sweep removes it from under another.
        let create = json!({"Name": volume, "Labels": {LABEL_EXECD: digest}});
        self.client
            .call::<Value>(Method::POST, "/volumes/create", Some(&create))
            .await
            .map_err(|e| self.map_err("creating execd's volume", e))?;
        let helper = format!(
            "warren-execd-upload-{}-{}",
            &digest[..12],
            std::process::id()
        );
        let body = json!({
            "Image": image,
            "Entrypoint": [format!("{EXECD_DIR}/warren-execd")],
            "Cmd": [],
            "Labels": {LABEL_OWNER: self.owner},
            "HostConfig": {
                "NetworkMode": "none",
                "Mounts": [{"Type": "volume", "Source": volume, "Target": EXECD_DIR,
                            "VolumeOptions": {"NoCopy": true}}],
            },
        });
        let _ = self.remove(&helper).await; // one left by a server that stopped mid-upload
        self.client
            .call::<Value>(
                Method::POST,
                &format!("/containers/create?name={}", client::encode(&helper)),
                Some(&body),
            )
            .await
            .map_err(|e| self.map_err("creating the container that uploads execd", e))?;
        let result = async {
            // `ready` is written after the binary: a volume that has it holds all of it
            let ready = format!(
                "/containers/{helper}/archive?path={}",
                client::encode(&format!("{EXECD_DIR}/ready"))
            );
            let (status, _) = self
                .client
                .send(Method::HEAD, &ready, None, &[])
                .await
                .map_err(|e| self.map_err("looking into execd's volume", e))?;
            if status.is_success() {
                return Ok(());
            }
            tracing::info!(volume = %volume, bytes = archive.binary_len, "uploading execd to the Docker host");
            for tar in [archive.binary, archive.ready] {
                self.client
                    .put_archive(&helper, EXECD_DIR, tar)
                    .await
                    .map_err(|e| self.map_err("uploading execd", e))?;
            }
            Ok(())
        }
        .await;
        let _ = self.remove(&helper).await;
        result.map(|()| build)
    }

    /// The sandboxes' network and its subnet: `[docker] network`, or Warren's own, internal (no
    /// route out) with traffic between containers off (made when missing; a racing server that
    /// made it first is fine). Looked up on every create: one removed meanwhile (`docker network
    /// prune` once no sandbox used it) is made again.
    pub(crate) async fn sandbox_network(&self) -> Result<(String, String), RuntimeError> {
        let name = self
            .config
            .network
            .clone()
            .unwrap_or_else(|| SANDBOX_NETWORK.to_string());
        let path = format!("/networks/{}", client::encode(&name));
        let info = match self.client.call::<Value>(Method::GET, &path, None).await {
            Ok(info) => info,
            Err(e) if e.is_not_found() && self.config.network.is_none() => {
                let body = json!({
                    "Name": name,
                    "Driver": "bridge",
                    "CheckDuplicate": true,
                    "Internal": true,
                    "Options": {"com.docker.network.bridge.enable_icc": "false"},
                    // shared by every server on the daemon, like execd's volume
                    "Labels": {"io.warren.network": "sandboxes"},
                });
                match self
                    .client
                    .call::<Value>(Method::POST, "/networks/create", Some(&body))
                    .await
                {
                    Ok(_) | Err(DockerError::Api { status: 409, .. }) => {}
                    Err(e) => return Err(self.map_err("creating the sandbox network", e)),
                }
                self.client
                    .call::<Value>(Method::GET, &path, None)
                    .await
                    .map_err(|e| self.map_err("looking up the sandbox network", e))?
            }
            Err(e) => return Err(self.map_err(&format!("looking up network {name}"), e)),
        };
        let subnet = info["IPAM"]["Config"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|c| c["Subnet"].as_str())
            .ok_or_else(|| RuntimeError::backend(format!("network {name} has no subnet")))?
            .to_string();
        Ok((name, subnet))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execd_archive_is_a_tar_of_the_binary_then_a_marker() {
        let dir =
            std::env::temp_dir().join(format!("warren-docker-archive-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let bin = dir.join("execd");
        std::fs::write(&bin, b"\x7fELF not really").expect("write");
        let (digest, a) = execd_archive(&bin).expect("archive");
        assert_eq!(digest.len(), 64);
        let mut t = tar::Archive::new(a.binary.as_ref());
        let mut entries = t.entries().expect("entries");
        let e = entries.next().expect("one").expect("entry");
        assert_eq!(e.path().expect("path").to_str(), Some("warren-execd"));
        assert_eq!(e.header().mode().expect("mode"), 0o755);
        assert_eq!(e.header().size().expect("size"), 15);
        let mut t = tar::Archive::new(a.ready.as_ref());
        let e = t
            .entries()
            .expect("entries")
            .next()
            .expect("one")
            .expect("entry");
        assert_eq!(e.path().expect("path").to_str(), Some("ready"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
