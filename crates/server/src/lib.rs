//! Warren's lifecycle server: the OpenSandbox `/v1` API (also served unprefixed), API-key auth, the
//! sandbox registry with durable state and expiry, and the endpoint proxy into sandboxes.

pub mod audit_log;
pub mod config;
mod disk_space;
pub mod error;
mod execd_conns;
mod hooks;
mod http;
mod idle;
pub mod keys;
mod metrics;
pub mod network;
mod pools;
mod quotas;
mod sandbox_files;
pub mod sandboxes;
mod signing;
mod snapshots;
mod state_file;
#[cfg(test)]
mod state_machine_tests;
mod stored;
mod supervise;
mod templates;
mod time;
pub mod timeline;
mod tokens;
mod validate;
pub mod volumes;

/// Entry points for the fuzz targets in `fuzz/`; not an API.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    use std::path::PathBuf;

    use crate::config::LimitsSection;
    use crate::volumes::StoragePolicy;

    /// Checks a `POST /v1/sandboxes` body as the route does, under the default `[limits]` and a
    /// host-volume allow list of `allowed`. `Err` is the answer's status and message; a body that
    /// is not a create request at all is `Ok(())` (the route's JSON extractor answers it).
    pub fn validate_create(body: &[u8], allowed: PathBuf) -> Result<(), (u16, String)> {
        let Ok(req) = serde_json::from_slice(body) else {
            return Ok(());
        };
        let storage = StoragePolicy {
            allowed_host_paths: vec![allowed],
            ..StoragePolicy::default()
        };
        crate::validate::create_plan(req, &LimitsSection::default(), Some(86_400), &storage)
            .map(drop)
            .map_err(|e| (e.status().as_u16(), e.public_message()))
    }
}

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use warren_core::{Runtime, RuntimeExt};
use warren_image::ImageStore;
use warren_store::Store;

pub use config::{Overrides, RuntimeKind, ServerConfig};
pub use http::AppState;
pub use sandboxes::Sandboxes;

/// A bound, ready server: recover state, then `run` to serve until the future is dropped.
pub struct Server {
    pub state: AppState,
    listener: tokio::net::TcpListener,
    /// `[metrics] listen`: `/metrics` alone, without a key.
    metrics_listener: Option<tokio::net::TcpListener>,
    reaper: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Binds the listen address, then builds the runtime with `make_runtime` (the `warren`
    /// binary wires the runtimes; the server knows only the `Runtime` trait) and recovers state.
    pub async fn bind(
        config: ServerConfig,
        make_runtime: impl FnOnce(&ServerConfig) -> anyhow::Result<Arc<dyn Runtime>>,
    ) -> anyhow::Result<Self> {
        // Descriptors per sandbox and per client: see `warren_core::fd_limit`.
        match warren_core::fd_limit::raise() {
            Ok((before, after)) if after > before => {
                tracing::info!(before, after, "raised the open-file limit");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
        }
        warren_core::fd_limit::cap_children(config.limits.open_files);
        supervise::log_panics();
        warren_local::prepare_data_dir(&config.data_dir)
            .with_context(|| format!("preparing data dir {}", config.data_dir.display()))?;
        let api_key: Option<Arc<str>> = if config.insecure_no_auth {
            tracing::warn!("serving WITHOUT authentication (--insecure-no-auth, loopback only)");
            None
        } else if let Some(k) = &config.api_key {
            Some(Arc::from(k.as_str()))
        } else {
            let (key, fresh) = http::auth::load_or_generate_key(&config.data_dir)
                .context("creating the API key file")?;
            let path = http::auth::key_file(&config.data_dir);
            if fresh {
                eprintln!(
                    "warren: generated an API key; it is stored (0600) in {}",
                    path.display()
                );
            } else {
                eprintln!("warren: using the API key stored in {}", path.display());
            }
            Some(Arc::from(key.as_str()))
        };
        if api_key.is_none() && !config.listen.ip().is_loopback() {
            anyhow::bail!("refusing to listen on {} without an API key", config.listen);
        }
        // Before anything starts: a certificate that does not load costs nothing to undo.
        let tls = http::tls::Tls::open(&config.tls, &config.data_dir, &tls_names(&config))
            .context("[tls]")?;
        if tls.is_some() && config.tls.self_signed {
            eprintln!(
                "warren: serving HTTPS with a development certificate; clients trust {}",
                http::tls::dev_ca_file(&config.data_dir).display()
            );
        }
        // Bound before anything that starts processes or makes cgroups (the runtime's standby
        // helpers, recovered sandboxes' watchers): a port already in use then costs nothing to undo.
        // Connections wait in the backlog until `run` serves them.
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        let local_addr = listener.local_addr()?;
        let runtime = make_runtime(&config)?;
        let mut config = config;
        config
            .limits
            .resolve_disk_default(runtime.capabilities().disk_bound);
        let mut images = ImageStore::open(&config.data_dir).context("opening the image store")?;
        images.set_unpack_limits(config.images.unpack_limits().context("[images]")?);
        let store = Store::open(&config.data_dir).context("opening the state store")?;
        let network = Arc::new(network::Network::new(&config.network, &config.data_dir)?);
        let sandboxes = Sandboxes::new(
            &config.data_dir,
            runtime,
            store,
            images,
            network,
            sandboxes::Options {
                retention_seconds: config.terminated_retention_seconds,
                registries: (config.images.pull == config::PullPolicy::Missing)
                    .then(|| config.registries.clone()),
                max_pulls: config.images.max_concurrent_pulls,
                default_env: default_env(&config),
                floor: config.runtime.floor()?,
                caps: sandboxes::Caps {
                    sandboxes: config.limits.max_sandboxes,
                    creates_in_flight: config.limits.max_creates_in_flight,
                },
                timeline: config.timeline.settings()?,
            },
        );
        sandboxes.recover().await.context("recovering sandboxes")?;
        let quotas = Arc::new(quotas::Quotas::new(&config.quotas).context("[quotas]")?);
        let snapshots =
            snapshots::Snapshots::open(&config.data_dir, sandboxes.clone(), quotas.clone())
                .context("opening the snapshot records")?;
        let reaper = sandboxes.spawn_reaper();
        let storage = Arc::new(storage_policy(
            &config,
            sandboxes.runtime().capabilities().host_volumes,
            sandboxes.runtime().node_host_paths(),
        )?);
        let stored = stored::Stored::new(snapshots.clone(), sandboxes.images().clone());
        let pools = pools::Pools::new(
            sandboxes.clone(),
            stored.clone(),
            quotas.clone(),
            config.limits.clone(),
            config.max_timeout_seconds,
            storage.clone(),
            &config.data_dir,
        );
        pools
            .start(&config.pools)
            .await
            .context("starting the pools")?;
        let templates = templates::Templates::open(
            &config.data_dir,
            sandboxes.clone(),
            snapshots.clone(),
            stored.clone(),
            config.limits.clone(),
            config.max_timeout_seconds,
            storage.clone(),
        )
        .context("opening the templates")?;
        let signing = Arc::new(
            signing::SigningKeys::open(
                &config.endpoints,
                &config.data_dir,
                sandboxes
                    .runtime()
                    .shared_records()
                    .map(|r| r.endpoint_signing_key()),
            )
            .context("[endpoints] signing keys")?,
        );
        let config_metrics = config.metrics.enabled;
        let metrics_listener = match &config.metrics.listen {
            Some(addr) if config.metrics.enabled => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("[metrics] listen {addr}"))?,
            ),
            Some(addr) => {
                tracing::warn!(%addr, "[metrics] listen is set but metrics are off: not served");
                None
            }
            None => None,
        };
        let state = AppState {
            signing,
            tls,
            storage,
            // Replicas sharing their sandboxes share their keys too (see `keys`).
            keys: Arc::new(match sandboxes.runtime().shared_records() {
                Some(records) => keys::KeyStore::shared(&config.data_dir, records),
                None => keys::KeyStore::open(&config.data_dir),
            }),
            quotas,
            audit: Arc::new(audit_log::AuditLog::new(
                &config.data_dir,
                config.audit.clone(),
            )),
            config: Arc::new(config),
            api_key,
            sandboxes,
            snapshots,
            pools,
            templates,
            stored,
            local_addr,
            metrics: config_metrics.then(http::metrics::install).flatten(),
        };
        Ok(Self {
            state,
            listener,
            metrics_listener,
            reaper,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.state.local_addr
    }

    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let app = http::router(self.state.clone());
        let http = &self.state.config.http;
        let limits = http::front::Limits {
            header_timeout: std::time::Duration::from_secs_f64(http.header_timeout_seconds),
            max_connections: http.max_connections,
        };
        // The handler is in place before the first request is served: a SIGHUP sent once the
        // server answers must never meet the default action, which ends the process.
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
        let reloads = tokio::spawn(reload_on_sighup(self.state.clone(), hup));
        let key_refresh = tokio::spawn(refresh_shared_keys(self.state.keys.clone()));
        let tls = self.state.tls.as_ref().map(|t| t.acceptor());
        let metrics = self.metrics_listener.map(|listener| {
            let app = http::metrics::router(self.state.clone());
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(error = %e, "[metrics] listen: the listener failed");
                }
            })
        });
        http::front::serve(self.listener, app, limits, tls, shutdown).await;
        if let Some(task) = metrics {
            task.abort();
        }
        reloads.abort();
        key_refresh.abort();
        self.reaper.abort();
        self.state.sandboxes.network_shutdown();
        // What the runtime keeps for sandboxes not yet asked for (standby setup helpers and their
        // cgroups, the zygote); the sandboxes themselves keep running.
        self.state.sandboxes.runtime().shutdown().await;
        Ok(())
    }
}

/// SIGHUP reads the TLS certificate and the endpoint signing keys again. A file that fails to
/// read is logged and the one in use stays.
async fn reload_on_sighup(state: AppState, hup: std::io::Result<tokio::signal::unix::Signal>) {
    let mut hup = match hup {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "no SIGHUP handler: certificates are read at start only");
            return;
        }
    };
    while hup.recv().await.is_some() {
        if let Some(tls) = &state.tls {
            match tls.reload() {
                Ok(()) => tracing::info!("SIGHUP: reloaded the TLS certificate"),
                Err(e) => {
                    tracing::error!(error = %format!("{e:#}"), "SIGHUP: TLS certificate not reloaded; still serving the previous one")
                }
            }
        }
        match state.signing.reload() {
            Ok(true) => tracing::info!("SIGHUP: reloaded the endpoint signing keys"),
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "SIGHUP: endpoint signing keys not reloaded; the previous ones stay")
            }
        }
    }
}

/// Replicas: reads the shared key store again every [`keys::SHARED_REFRESH`] (nothing to do for
/// a store in the data dir, which is read when it changes).
async fn refresh_shared_keys(keys: Arc<keys::KeyStore>) {
    let mut failing = false;
    loop {
        match keys.refresh().await {
            Ok(()) if failing => {
                tracing::info!("the shared key store is readable again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!(error = %e, "reading the shared key store");
                failing = true;
            }
            Err(_) => {}
        }
        tokio::time::sleep(keys::SHARED_REFRESH).await;
    }
}

/// The names a development certificate covers: loopback, the listen address, the public host and
/// the endpoint domain with its wildcard.
fn tls_names(config: &ServerConfig) -> Vec<String> {
    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    if !config.listen.ip().is_unspecified() {
        names.push(config.listen.ip().to_string());
    }
    let host_of = |h: &str| {
        let h = h.trim_start_matches('[');
        match h.rsplit_once(':') {
            Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => {
                host.trim_end_matches(']').to_string()
            }
            _ => h.trim_end_matches(']').to_string(),
        }
    };
    if let Some(p) = &config.public_host {
        names.push(host_of(p));
    }
    if let Some(d) = &config.endpoints.domain {
        let d = host_of(d);
        names.push(format!("*.{d}"));
        names.push(d);
    }
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// Canonical allowed folders (a missing one is a configuration error, not a silent no-op), and what
/// no volume may reach: the data dir and the config file. A runtime whose `host` volumes are its
/// nodes' folders has its own allow list, of names only.
fn storage_policy(
    config: &ServerConfig,
    host_volumes: warren_core::HostVolumes,
    node_host_paths: Vec<std::path::PathBuf>,
) -> anyhow::Result<volumes::StoragePolicy> {
    if host_volumes != warren_core::HostVolumes::Server {
        let allowed_host_paths = match host_volumes {
            warren_core::HostVolumes::Node => node_host_paths
                .iter()
                .map(|p| {
                    volumes::plain_absolute(p).ok_or_else(|| {
                        anyhow::anyhow!(
                            "[kubernetes] allowed_host_paths: {} must be absolute, without . or ..",
                            p.display()
                        )
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
            _ => Vec::new(),
        };
        return Ok(volumes::StoragePolicy {
            host_volumes,
            allowed_host_paths,
            protected: Vec::new(),
        });
    }
    let allowed_host_paths = config
        .storage
        .allowed_host_paths
        .iter()
        .map(|p| {
            std::fs::canonicalize(p)
                .with_context(|| format!("[storage] allowed_host_paths: {}", p.display()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let protected = [Some(config.data_dir.clone()), config.config_file.clone()]
        .into_iter()
        .flatten()
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
        .collect();
    Ok(volumes::StoragePolicy {
        host_volumes,
        allowed_host_paths,
        protected,
    })
}

/// What the server sets in every sandbox's environment unless the create sets it.
fn default_env(config: &ServerConfig) -> std::collections::BTreeMap<String, String> {
    let mut env = std::collections::BTreeMap::new();
    if !config.runtime.spare_shell {
        env.insert(
            warren_api::execd::SPARE_SHELL_ENV.to_owned(),
            "0".to_owned(),
        );
    }
    env
}
