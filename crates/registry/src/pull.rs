//! A pull: manifest (through an index to this host's platform), config, then every layer the
//! store lacks, streamed from the registry straight into the unpacker (a few at a time), and one
//! commit. Concurrent pulls of the same image (and credentials) share one run.

use std::collections::HashMap;
use std::future::Future;
use std::io::{self, Read};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::future::{FutureExt, Shared};
use futures::stream::{self, StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use warren_image::oci::{self, ConfigFile};
use warren_image::{ImageConfig, ImageRecord, ImageStore, Reference, StagedLayer};

use crate::client::{parse_document, Chunk, Client, Session};
use crate::config::Credentials;
use crate::error::PullError;

/// Layers downloaded and unpacked at the same time.
const PARALLEL_LAYERS: usize = 3;
/// Chunks in flight between a download and its unpacker.
const CHANNEL_CHUNKS: usize = 32;
const MAX_INDEX_DEPTH: usize = 4;

/// One layer of the image being pulled, as announced to [`PullProgress::started`].
#[derive(Debug, Clone)]
pub struct LayerInfo {
    /// The blob digest (`sha256:...` of the compressed bytes).
    pub digest: String,
    /// Compressed size from the manifest (0 when the manifest leaves it out).
    pub size: u64,
    /// Already in the store: nothing to fetch.
    pub cached: bool,
}

/// Where a pull reports what it does (the CLI draws progress bars from it).
pub trait PullProgress: Send + Sync {
    /// The manifest is read: these are the layers, lowest first.
    fn started(&self, _image: &str, _layers: &[LayerInfo]) {}
    /// `bytes` more of layer `index` arrived.
    fn advanced(&self, _index: usize, _bytes: u64) {}
    /// Layer `index` is unpacked and verified.
    fn finished(&self, _index: usize) {}
}

type SharedPull = Shared<Pin<Box<dyn Future<Output = Result<ImageRecord, Arc<PullError>>> + Send>>>;

/// Pulls images into one store. Cheap to clone; clones share in-flight pulls.
#[derive(Clone)]
pub struct Puller {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    store: Arc<ImageStore>,
    inflight: Mutex<HashMap<String, SharedPull>>,
    /// One permit per pull that may download and unpack at once; more wait their turn. Each pull
    /// holds disk, bandwidth and a few unpack threads, so a caller naming many images cannot
    /// start them all together.
    slots: tokio::sync::Semaphore,
}

impl Puller {
    /// A puller into `store` running at most `max_pulls` different pulls at once (at least one).
    pub fn new(client: Client, store: Arc<ImageStore>, max_pulls: usize) -> Self {
        Puller {
            inner: Arc::new(Inner {
                client,
                store,
                inflight: Mutex::new(HashMap::new()),
                slots: tokio::sync::Semaphore::new(max_pulls.max(1)),
            }),
        }
    }

    pub fn store(&self) -> &Arc<ImageStore> {
        &self.inner.store
    }

    /// Pulls `name` (with `auth` for its registry, else the configured credentials) and names it in
    /// the store. Callers asking for the same name with the same credentials while a pull runs wait
    /// for that pull instead of starting another.
    pub async fn pull(
        &self,
        name: &str,
        auth: Option<Credentials>,
        progress: Option<Arc<dyn PullProgress>>,
    ) -> Result<ImageRecord, Arc<PullError>> {
        let reference = Reference::parse(name).map_err(|e| {
            Arc::new(PullError::InvalidName {
                name: name.to_owned(),
                reason: e.to_string(),
            })
        })?;
        if reference.is_host() {
            return Err(Arc::new(PullError::InvalidName {
                name: name.to_owned(),
                reason: "host is the built-in image; it cannot be pulled".into(),
            }));
        }
        let key = pull_key(&reference, auth.as_ref());
        let shared = {
            let mut inflight = self
                .inner
                .inflight
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            match inflight.get(&key) {
                Some(running) => running.clone(),
                None => {
                    // The pull runs on its own task, so callers that give up do not cancel it for
                    // the others, and it leaves the in-flight map when it ends whether or not
                    // anyone still waits (a later caller then starts afresh, never reads a stale
                    // result). It takes the map's lock only after this insert releases it.
                    let me = self.clone();
                    let key2 = key.clone();
                    let image = reference.to_string();
                    let task = tokio::spawn(async move {
                        let out = me
                            .pull_now(&reference, auth.as_ref(), progress)
                            .await
                            .map_err(Arc::new);
                        me.inner
                            .inflight
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&key2);
                        out
                    });
                    let fut: Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(async move {
                        match task.await {
                            Ok(r) => r,
                            Err(e) => Err(Arc::new(PullError::Store {
                                image,
                                detail: format!("pull task failed: {e}"),
                            })),
                        }
                    });
                    let shared = fut.shared();
                    inflight.insert(key, shared.clone());
                    shared
                }
            }
        };
        shared.await
    }

    async fn pull_now(
        &self,
        reference: &Reference,
        auth: Option<&Credentials>,
        progress: Option<Arc<dyn PullProgress>>,
    ) -> Result<ImageRecord, PullError> {
        let image = reference.to_string();
        // Never closed; were it, pulling without a slot is still correct.
        let _slot = self.inner.slots.acquire().await.ok();
        let (registry, repository) = reference.registry();
        let endpoints = self
            .inner
            .client
            .config()
            .endpoints(registry)
            .map_err(|reason| PullError::InvalidName {
                name: image.clone(),
                reason,
            })?;
        let mut last = None;
        for endpoint in &endpoints {
            let session = self
                .inner
                .client
                .session(&image, endpoint, &repository, auth)?;
            match self.resolve(&session, reference).await {
                Ok(plan) => return self.fetch(&session, &image, plan, progress).await,
                Err(e) => {
                    if endpoint.mirror {
                        tracing::info!(mirror = %endpoint.base, "mirror failed, trying the next source: {e}");
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| PullError::NotFound {
            image,
            registry: registry.to_owned(),
        }))
    }

    /// Manifest (through indexes) and config.
    async fn resolve(&self, session: &Session, reference: &Reference) -> Result<Plan, PullError> {
        let image = reference.to_string();
        let invalid = |detail: String| PullError::Invalid {
            image: image.clone(),
            detail,
        };
        let bad = |detail: String| PullError::Registry {
            image: image.clone(),
            registry: session.registry().to_owned(),
            detail,
        };
        let mut fetched = session.manifest(reference.manifest_reference()).await?;
        let top_digest = fetched.digest.clone();
        for _ in 0..MAX_INDEX_DEPTH {
            let doc = parse_document(&fetched.body).map_err(&bad)?;
            if let Some(manifests) = &doc.manifests {
                let chosen = oci::pick_manifest(manifests, None).map_err(&invalid)?;
                fetched = session.manifest(&chosen.digest).await?;
                continue;
            }
            if doc.schema_version == Some(1) || fetched.media_type.contains("v1+prettyjws") {
                return Err(invalid(
                    "Docker schema 1 manifests are not supported (push the image again with a current client)".into(),
                ));
            }
            let config_desc = doc.manifest_config().cloned().ok_or_else(|| {
                bad(format!(
                    "unsupported manifest type {:?}",
                    fetched.media_type
                ))
            })?;
            let raw = session.small_blob(&config_desc.digest).await?;
            let config: ConfigFile = serde_json::from_slice(&raw)
                .map_err(|e| bad(format!("bad image config JSON: {e}")))?;
            let diff_ids = config.diff_ids().to_vec();
            if diff_ids.len() != doc.layers.len() {
                return Err(invalid(format!(
                    "config lists {} diff_ids for {} layers",
                    diff_ids.len(),
                    doc.layers.len()
                )));
            }
            let mut layers = Vec::with_capacity(doc.layers.len());
            for (desc, diff_id) in doc.layers.iter().zip(diff_ids) {
                oci::check_layer_media_type(&desc.media_type).map_err(&invalid)?;
                // The download is held to this size: without it a registry could send for ever.
                let size = desc.size.ok_or_else(|| {
                    invalid(format!("layer {} has no size in the manifest", desc.digest))
                })?;
                layers.push(PlannedLayer {
                    digest: desc.digest.clone(),
                    size,
                    diff_id,
                });
            }
            return Ok(Plan {
                id: config_desc.digest,
                config: config.image_config(),
                // The digest a user would pin: the index's when the tag names one.
                digest: top_digest,
                layers,
            });
        }
        Err(invalid("image indexes nested too deeply".into()))
    }

    /// Downloads and unpacks what the store lacks, then commits. Retries once, fetching everything,
    /// if a layer it meant to reuse was collected in the meantime.
    async fn fetch(
        &self,
        session: &Session,
        image: &str,
        plan: Plan,
        progress: Option<Arc<dyn PullProgress>>,
    ) -> Result<ImageRecord, PullError> {
        let store_err = |e| PullError::from_store(image, session.registry(), e);
        for reuse in [true, false] {
            let store = self.inner.store.clone();
            let staging = Arc::new(blocking(move || store.staging()).await.map_err(store_err)?);
            let mut layers: Vec<Option<StagedLayer>> = Vec::with_capacity(plan.layers.len());
            let mut first_index: HashMap<&str, usize> = HashMap::new();
            let mut todo = Vec::new();
            for (i, layer) in plan.layers.iter().enumerate() {
                let existing = if reuse {
                    let store = self.inner.store.clone();
                    let diff_id = layer.diff_id.clone();
                    blocking(move || Ok(store.existing_layer(&diff_id)))
                        .await
                        .map_err(store_err)?
                } else {
                    None
                };
                if existing.is_none() && !first_index.contains_key(layer.diff_id.as_str()) {
                    first_index.insert(&layer.diff_id, i);
                    todo.push(i);
                }
                layers.push(existing);
            }
            if let Some(p) = &progress {
                let infos: Vec<LayerInfo> = plan
                    .layers
                    .iter()
                    .zip(&layers)
                    .map(|(l, have)| LayerInfo {
                        digest: l.digest.clone(),
                        size: l.size,
                        cached: have.is_some(),
                    })
                    .collect();
                p.started(image, &infos);
            }
            let fetched: Vec<(usize, StagedLayer)> = stream::iter(todo)
                .map(|i| {
                    let layer = &plan.layers[i];
                    let staging = staging.clone();
                    let progress = progress.clone();
                    async move {
                        let staged = self
                            .fetch_layer(session, image, i, layer, staging, progress.clone())
                            .await?;
                        if let Some(p) = &progress {
                            p.finished(i);
                        }
                        Ok::<_, PullError>((i, staged))
                    }
                })
                .buffer_unordered(PARALLEL_LAYERS)
                .try_collect()
                .await?;
            for (i, staged) in fetched {
                layers[i] = Some(staged);
            }
            // A layer listed twice is unpacked once; the commit finds it in place the second time.
            for (i, layer) in plan.layers.iter().enumerate() {
                if layers[i].is_none() {
                    let first = first_index[layer.diff_id.as_str()];
                    layers[i] = layers[first].as_ref().map(StagedLayer::duplicate);
                }
            }
            let layers: Vec<StagedLayer> = layers.into_iter().flatten().collect();
            let store = self.inner.store.clone();
            let (name, id, config, digest) = (
                image.to_owned(),
                plan.id.clone(),
                plan.config.clone(),
                plan.digest.clone(),
            );
            let committed = blocking(move || {
                let out = store.commit_pulled(&name, &id, config, &digest, &layers);
                drop(staging);
                out
            })
            .await
            .map_err(store_err)?;
            if let Some(record) = committed {
                return Ok(record);
            }
        }
        Err(PullError::Store {
            image: image.to_owned(),
            detail: "layers were removed while the pull ran; try again".into(),
        })
    }

    /// One layer: the download feeds a channel that a blocking unpacker reads from.
    async fn fetch_layer(
        &self,
        session: &Session,
        image: &str,
        index: usize,
        layer: &PlannedLayer,
        staging: Arc<warren_image::Staging>,
        progress: Option<Arc<dyn PullProgress>>,
    ) -> Result<StagedLayer, PullError> {
        let (tx, rx) = mpsc::channel::<Chunk>(CHANNEL_CHUNKS);
        let label = PathBuf::from(format!("{}@{}", image, layer.digest));
        let (digest, diff_id) = (layer.digest.clone(), layer.diff_id.clone());
        let unpack = tokio::task::spawn_blocking(move || {
            let reader = ChannelReader {
                rx,
                current: Bytes::new(),
                ended: false,
            };
            staging.unpack_layer(index, reader, &label, &digest, &diff_id)
        });
        let on_bytes = move |n: u64| {
            if let Some(p) = &progress {
                p.advanced(index, n);
            }
        };
        let download = session
            .stream_blob(&layer.digest, layer.size, &tx, &on_bytes)
            .await;
        // Tell the unpacker how the stream ended: a clean end, or a failure that must not pass
        // for one (a cut tar could otherwise look complete up to its digest check).
        let _ = match &download {
            Ok(_) => tx.send(Chunk::End).await,
            Err(e) => tx.send(Chunk::Failed(e.to_string())).await,
        };
        drop(tx);
        let unpacked = unpack.await.map_err(|e| PullError::Store {
            image: image.to_owned(),
            detail: format!("unpack task failed: {e}"),
        })?;
        // The network's error explains an unpack failure that follows from it.
        download?;
        unpacked.map_err(|e| PullError::from_store(image, session.registry(), e))
    }
}

/// The chosen manifest, reduced to what the fetch needs.
struct Plan {
    /// Config digest: the image id.
    id: String,
    config: ImageConfig,
    digest: String,
    layers: Vec<PlannedLayer>,
}

struct PlannedLayer {
    digest: String,
    size: u64,
    diff_id: String,
}

/// The unpacker's side of the channel, as a blocking `Read`.
struct ChannelReader {
    rx: mpsc::Receiver<Chunk>,
    current: Bytes,
    ended: bool,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.ended {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Chunk::Data(b)) => self.current = b,
                Some(Chunk::End) => self.ended = true,
                Some(Chunk::Failed(e)) => return Err(io::Error::other(e)),
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "download stopped",
                    ))
                }
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// Runs store work (file system, locks) off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, warren_image::ImageError> + Send + 'static,
) -> Result<T, warren_image::ImageError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(warren_image::ImageError::Io {
            op: "store task",
            path: PathBuf::new(),
            source: io::Error::other(e.to_string()),
        }),
    }
}

/// Same image, same credentials: same pull. The password is hashed, never kept in the key.
fn pull_key(reference: &Reference, auth: Option<&Credentials>) -> String {
    match auth {
        None => reference.to_string(),
        Some(c) => {
            let mut h = Sha256::new();
            h.update(c.username.as_bytes());
            h.update([0]);
            h.update(c.password.as_bytes());
            format!("{reference}#{}", hex::encode(&h.finalize()[..8]))
        }
    }
}
