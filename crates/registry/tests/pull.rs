//! Pull behaviour that needs a registry misbehaving on cue: a connection cut mid-blob (resumed with
//! `Range`), a registry that cannot resume, ten concurrent pulls of one image, and a Bearer-token
//! challenge. The registry here is a small in-process stand-in on loopback speaking the distribution
//! API; the end-to-end suite (tests/e2e/test_registry.py) pulls from Debian's real `docker-registry`.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};
use warren_image::ImageStore;
use warren_registry::{Client, Credentials, PullErrorKind, Puller, RegistriesConfig};

fn digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// A gzipped layer with one file of `size` pseudo-random bytes (incompressible, so the blob is big).
fn layer(size: usize) -> (Vec<u8>, Vec<u8>) {
    let mut data = vec![0u8; size];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let mut builder = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(size as u64);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h.set_cksum();
    builder
        .append_data(&mut h, "data.bin", &data[..])
        .expect("tar");
    let tar = builder.into_inner().expect("tar");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&tar).expect("gzip");
    (tar, gz.finish().expect("gzip"))
}

#[derive(Default)]
struct Behaviour {
    /// Cut the first blob response after this many bytes.
    cut_after: Option<usize>,
    /// Answer `Range` requests with 206 (else with the whole blob, 200).
    ranges: bool,
    /// Demand a Bearer token from `/token` (basic auth `u:p`).
    token: bool,
    /// Follow the layer's bytes with zeros that never end.
    endless: bool,
}

struct Fake {
    blobs: HashMap<String, Vec<u8>>,
    manifest: Vec<u8>,
    behaviour: Behaviour,
    blob_gets: AtomicUsize,
    manifest_gets: AtomicUsize,
    /// Manifest requests being answered now, and the most at once.
    manifests_now: AtomicUsize,
    manifests_peak: AtomicUsize,
    range_requests: Mutex<Vec<String>>,
    port: u16,
}

async fn start(behaviour: Behaviour) -> (Arc<Fake>, String, Vec<u8>) {
    let (tar, blob) = layer(3 << 20);
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["FROM_CONFIG=1"]},
        "rootfs": {"type": "layers", "diff_ids": [digest(&tar)]},
    }))
    .expect("json");
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(&config), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest(&blob), "size": blob.len()}],
    }))
    .expect("json");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let fake = Arc::new(Fake {
        blobs: HashMap::from([(digest(&config), config), (digest(&blob), blob.clone())]),
        manifest,
        behaviour,
        blob_gets: AtomicUsize::new(0),
        manifest_gets: AtomicUsize::new(0),
        manifests_now: AtomicUsize::new(0),
        manifests_peak: AtomicUsize::new(0),
        range_requests: Mutex::new(Vec::new()),
        port,
    });
    let app = Router::new()
        .route("/token", get(token))
        .route("/v2/test/img/manifests/{reference}", get(manifest_get))
        .route("/v2/test/img/blobs/{digest}", get(blob_get))
        .with_state(fake.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (fake, format!("127.0.0.1:{port}"), blob)
}

/// The 401 challenge to answer with, if the request lacks the token this registry wants.
fn challenge(fake: &Fake, headers: &HeaderMap) -> Option<Response> {
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !fake.behaviour.token || auth == Some("Bearer t0ken") {
        return None;
    }
    let value = format!(
        "Bearer realm=\"http://127.0.0.1:{}/token\",service=\"fake\",scope=\"repository:test/img:pull\"",
        fake.port
    );
    Some(
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, value)],
        )
            .into_response(),
    )
}

async fn token(headers: HeaderMap) -> Response {
    // "u:p"
    if headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        == Some("Basic dTpw")
    {
        axum::Json(serde_json::json!({"token": "t0ken"})).into_response()
    } else {
        StatusCode::UNAUTHORIZED.into_response()
    }
}

async fn manifest_get(State(fake): State<Arc<Fake>>, headers: HeaderMap) -> Response {
    if let Some(r) = challenge(&fake, &headers) {
        return r;
    }
    fake.manifest_gets.fetch_add(1, Ordering::SeqCst);
    let now = fake.manifests_now.fetch_add(1, Ordering::SeqCst) + 1;
    fake.manifests_peak.fetch_max(now, Ordering::SeqCst);
    // Slow enough that concurrent pulls overlap.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    fake.manifests_now.fetch_sub(1, Ordering::SeqCst);
    (
        [(
            header::CONTENT_TYPE,
            "application/vnd.oci.image.manifest.v1+json",
        )],
        fake.manifest.clone(),
    )
        .into_response()
}

async fn blob_get(
    State(fake): State<Arc<Fake>>,
    Path(digest): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = challenge(&fake, &headers) {
        return r;
    }
    let Some(data) = fake.blobs.get(&digest).cloned() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let n = fake.blob_gets.fetch_add(1, Ordering::SeqCst);
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.strip_suffix('-'))
        .and_then(|v| v.parse::<usize>().ok());
    if let Some(from) = range {
        fake.range_requests
            .lock()
            .expect("lock")
            .push(format!("{digest} from {from}"));
        if fake.behaviour.ranges {
            let total = data.len();
            return (
                StatusCode::PARTIAL_CONTENT,
                [(
                    header::CONTENT_RANGE,
                    format!("bytes {from}-{}/{total}", total - 1),
                )],
                data[from..].to_vec(),
            )
                .into_response();
        }
    }
    match fake.behaviour.cut_after {
        // Only the big layer (the config is tiny), and only on its first request.
        Some(cut) if data.len() > cut && n <= 1 && range.is_none() => {
            let head = data[..cut].to_vec();
            let stream = futures::stream::iter(vec![
                Ok::<_, std::io::Error>(bytes::Bytes::from(head)),
                Err(std::io::Error::other("cut")),
            ]);
            (
                [(header::CONTENT_LENGTH, data.len().to_string())],
                Body::from_stream(stream),
            )
                .into_response()
        }
        _ if fake.behaviour.endless && data.len() > 1 << 20 => {
            let zeros = futures::stream::repeat_with(|| {
                Ok::<_, std::io::Error>(bytes::Bytes::from_static(&[0u8; 65536]))
            });
            let stream = futures::StreamExt::chain(
                futures::stream::once(
                    async move { Ok::<_, std::io::Error>(bytes::Bytes::from(data)) },
                ),
                zeros,
            );
            Body::from_stream(stream).into_response()
        }
        _ => data.into_response(),
    }
}

fn puller(host: &str) -> (tempfile::TempDir, Puller) {
    puller_of(host, 4)
}

fn puller_of(host: &str, max_pulls: usize) -> (tempfile::TempDir, Puller) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(ImageStore::open(dir.path()).expect("store"));
    let config: RegistriesConfig =
        serde_json::from_value(serde_json::json!({ host: {"insecure": true} })).expect("config");
    (dir, Puller::new(Client::new(config), store, max_pulls))
}

fn tmp_is_empty(dir: &tempfile::TempDir) -> bool {
    std::fs::read_dir(dir.path().join("images/tmp"))
        .expect("tmp")
        .next()
        .is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_is_resumed_with_range() {
    let (fake, host, blob) = start(Behaviour {
        cut_after: Some(1 << 20),
        ranges: true,
        token: false,
        endless: false,
    })
    .await;
    let (dir, puller) = puller(&host);
    let record = puller
        .pull(&format!("{host}/test/img:v1"), None, None)
        .await
        .expect("pull");
    assert_eq!(record.layers.len(), 1);
    let ranges = fake.range_requests.lock().expect("lock").clone();
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    let resumed_at: usize = ranges[0]
        .rsplit(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("offset");
    assert!(resumed_at > 0 && resumed_at < blob.len(), "{ranges:?}");
    assert!(tmp_is_empty(&dir));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_without_range_support_fails_cleanly() {
    let (_fake, host, _) = start(Behaviour {
        cut_after: Some(1 << 20),
        ranges: false,
        token: false,
        endless: false,
    })
    .await;
    let (dir, puller) = puller(&host);
    let err = puller
        .pull(&format!("{host}/test/img:v1"), None, None)
        .await
        .expect_err("must fail");
    assert_eq!(err.kind(), PullErrorKind::Upstream, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("cannot resume") && text.contains("test/img:v1"),
        "{text}"
    );
    assert!(tmp_is_empty(&dir));
    let layers = std::fs::read_dir(dir.path().join("images/layers")).expect("layers");
    assert_eq!(layers.count(), 0, "nothing cached");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_pulls_share_one() {
    let (fake, host, _) = start(Behaviour::default()).await;
    let (_dir, puller) = puller(&host);
    let name = format!("{host}/test/img:v1");
    let pulls = (0..10).map(|_| {
        let puller = puller.clone();
        let name = name.clone();
        tokio::spawn(async move { puller.pull(&name, None, None).await })
    });
    let results = futures::future::join_all(pulls).await;
    let ids: Vec<String> = results
        .into_iter()
        .map(|r| r.expect("join").expect("pull").id)
        .collect();
    assert!(ids.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(fake.manifest_gets.load(Ordering::SeqCst), 1);
    assert_eq!(
        fake.blob_gets.load(Ordering::SeqCst),
        2,
        "config + layer, once each"
    );
    // Pulled again later: the manifest is asked, no layer is fetched.
    puller.pull(&name, None, None).await.expect("re-pull");
    assert_eq!(
        fake.blob_gets.load(Ordering::SeqCst),
        3,
        "only the config again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_tokens_are_fetched_with_the_credentials() {
    let (_fake, host, _) = start(Behaviour {
        token: true,
        ..Default::default()
    })
    .await;
    let (_dir, puller) = puller(&host);
    let name = format!("{host}/test/img:v1");
    let denied = puller.pull(&name, None, None).await.expect_err("anonymous");
    assert_eq!(denied.kind(), PullErrorKind::Denied, "{denied}");
    let wrong = Credentials {
        username: "u".into(),
        password: "nope".into(),
    };
    let denied = puller
        .pull(&name, Some(wrong), None)
        .await
        .expect_err("wrong password");
    assert_eq!(denied.kind(), PullErrorKind::Denied, "{denied}");
    assert!(!denied.to_string().contains("nope"));
    let right = Credentials {
        username: "u".into(),
        password: "p".into(),
    };
    puller
        .pull(&name, Some(right), None)
        .await
        .expect("pull with token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_longer_than_its_manifest_says_is_cut_off() {
    let (_fake, host, _) = start(Behaviour {
        endless: true,
        ..Default::default()
    })
    .await;
    let (dir, puller) = puller(&host);
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        puller.pull(&format!("{host}/test/img:v1"), None, None),
    )
    .await
    .expect("ends, though the registry never does")
    .expect_err("must fail");
    assert_eq!(err.kind(), PullErrorKind::Upstream, "{err}");
    assert!(
        err.to_string()
            .contains("more bytes than the manifest says"),
        "{err}"
    );
    assert!(tmp_is_empty(&dir));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_images_wait_for_a_pull_slot() {
    for (max_pulls, most_at_once) in [(1, 1), (4, 3)] {
        let (fake, host, _) = start(Behaviour::default()).await;
        let (_dir, puller) = puller_of(&host, max_pulls);
        // three tags: three different pulls (one image behind them)
        let pulls = ["v1", "v2", "v3"].map(|tag| {
            let puller = puller.clone();
            let name = format!("{host}/test/img:{tag}");
            tokio::spawn(async move { puller.pull(&name, None, None).await })
        });
        for r in futures::future::join_all(pulls).await {
            r.expect("join").expect("pull");
        }
        assert_eq!(
            fake.manifests_peak.load(Ordering::SeqCst),
            most_at_once,
            "with {max_pulls} slots"
        );
    }
}
