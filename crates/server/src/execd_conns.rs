//! Keep-alive HTTP/1 connections from the server to each sandbox's execd, for the endpoint proxy.
//!
//! A fresh connection per proxied request costs a connect, a handshake task on each side and an extra
//! wake-up of execd before the request can be read: about a tenth of a millisecond per request on a
//! loaded 2-core machine, a quarter of a proxied `/ping`. So a connection whose response has been read
//! to its end is parked here, keyed by sandbox, and the next request to that sandbox takes it; a
//! pool's warm sandbox gets one parked as soon as it runs, so even a claim's first request skips the
//! connect.
//!
//! Rules that keep reuse safe:
//! - Only a connection hyper reports ready (previous response complete, peer not gone) is parked, and
//!   only while its sandbox is live; `forget` drops a sandbox's connections when it stops, under the
//!   same lock, so nothing is parked for a sandbox after it ended.
//! - Upgraded connections (WebSocket) are never parked: they belong to their upgrade.
//! - A connection parked longer than [`MAX_IDLE`] is closed (a sweep every half of that), and a
//!   sandbox keeps at most [`MAX_PER_SANDBOX`]; the rest are closed.
//! - A request that a parked connection could not carry (execd closed it at that moment) comes back
//!   unsent from hyper and the proxy sends it once more on a fresh connection.
//!
//! Every connection to execd, the proxy's or the server's own calls, is opened here ([`open`]):
//! to a Unix socket on this host, or over TCP, where each request carries the sandbox's execd
//! credential ([`Sender`] adds it, so no caller can forget it).
//!
//! Why one file: ~290 of its lines are tests against a real HTTP upstream, which call the private
//! `sweep` and `parked`; the pool and the connections it opens are one job.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::HeaderValue;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::client::conn::TrySendError;
use hyper_util::rt::TokioIo;
use warren_core::ExecdAddress;

/// Idle connections kept per sandbox: enough for a client with a few requests in flight.
pub const MAX_PER_SANDBOX: usize = 4;
/// A parked connection older than this is closed rather than reused.
pub const MAX_IDLE: Duration = Duration::from_secs(60);

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Where and how the server reaches one sandbox's execd.
#[derive(Clone)]
pub struct ExecdEndpoint {
    pub address: ExecdAddress,
    /// Sent with every request over TCP (`X-EXECD-ACCESS-TOKEN`).
    credential: Option<HeaderValue>,
}

impl std::fmt::Debug for ExecdEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecdEndpoint")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl ExecdEndpoint {
    /// `address`, with the credential of the sandbox whose secret is `secret` where the transport
    /// needs one.
    pub fn new(address: ExecdAddress, secret: &str) -> Self {
        let credential = match address {
            ExecdAddress::Unix(_) => None,
            ExecdAddress::Tcp(_) | ExecdAddress::Relayed { .. } => {
                let mut value = HeaderValue::from_str(&crate::tokens::execd_credential(secret))
                    .unwrap_or_else(|_| unreachable!("hex is a valid header value"));
                value.set_sensitive(true);
                Some(value)
            }
        };
        Self {
            address,
            credential,
        }
    }
}

/// An HTTP/1 connection to execd that sends the credential with every request.
pub struct Sender {
    inner: SendRequest<Body>,
    credential: Option<HeaderValue>,
}

impl Sender {
    fn authorize(&self, req: &mut http::Request<Body>) {
        // Whatever a client sent in this header is replaced (or, over a Unix socket, dropped).
        match &self.credential {
            Some(c) => req
                .headers_mut()
                .insert(warren_api::EXECD_TOKEN_HEADER, c.clone()),
            None => req.headers_mut().remove(warren_api::EXECD_TOKEN_HEADER),
        };
    }

    pub async fn send_request(
        &mut self,
        mut req: http::Request<Body>,
    ) -> hyper::Result<http::Response<Incoming>> {
        self.authorize(&mut req);
        self.inner.send_request(req).await
    }

    /// As [`SendRequest::try_send_request`]: a request the connection could not take comes back.
    pub async fn try_send_request(
        &mut self,
        mut req: http::Request<Body>,
    ) -> Result<http::Response<Incoming>, TrySendError<http::Request<Body>>> {
        self.authorize(&mut req);
        self.inner.try_send_request(req).await
    }

    fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }

    fn is_ready(&self) -> bool {
        self.inner.is_ready()
    }

    async fn ready(&mut self) -> hyper::Result<()> {
        self.inner.ready().await
    }
}

struct Parked {
    sender: Sender,
    since: Instant,
    /// Opened ahead of use for a pool's warm sandbox, which may wait for its claim far longer than
    /// [`MAX_IDLE`]: kept until used (at most one per such sandbox, so pools bound their number).
    ahead: bool,
}

impl Parked {
    fn fresh(&self, max_idle: Duration) -> bool {
        (self.ahead || self.since.elapsed() < max_idle) && !self.sender.is_closed()
    }
}

#[derive(Default)]
pub struct ExecdConns {
    idle: Mutex<HashMap<String, Vec<Parked>>>,
    /// Whether the task that closes connections idle past [`MAX_IDLE`] runs (started on first park).
    sweeping: AtomicBool,
}

impl ExecdConns {
    fn idle(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Parked>>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A parked connection to `id`'s execd that is still usable, if there is one.
    pub fn take(&self, id: &str) -> Option<Sender> {
        let mut idle = self.idle();
        let list = idle.get_mut(id)?;
        let mut found = None;
        while let Some(p) = list.pop() {
            if p.fresh(MAX_IDLE) && p.sender.is_ready() {
                found = Some(p.sender);
                break;
            }
        }
        if list.is_empty() {
            idle.remove(id);
        }
        found
    }

    /// Parks `sender` for `id` once its current response has been read to the end, if `live()` still
    /// holds then (checked under the lock `forget` takes, so a sandbox that stopped gets nothing).
    pub fn put_back(
        self: &Arc<Self>,
        id: String,
        mut sender: Sender,
        live: impl FnOnce() -> bool + Send + 'static,
    ) {
        let this = self.clone();
        tokio::spawn(async move {
            // Resolves when the connection can carry another request; an error means it closed
            // (the response was cut short, the client went away, execd exited).
            if sender.ready().await.is_err() {
                return;
            }
            this.park(id, sender, false, live);
        });
    }

    fn park(
        self: &Arc<Self>,
        id: String,
        sender: Sender,
        ahead: bool,
        live: impl FnOnce() -> bool,
    ) {
        self.keep_swept();
        let mut idle = self.idle();
        if !live() {
            return;
        }
        let list = idle.entry(id).or_default();
        list.retain(|p| p.fresh(MAX_IDLE));
        if list.len() < MAX_PER_SANDBOX {
            list.push(Parked {
                sender,
                since: Instant::now(),
                ahead,
            });
        }
    }

    /// Opens a connection to execd at `endpoint` and parks it for `id`: the sandbox's first
    /// proxied request then finds one ready.
    pub fn prewarm(
        self: &Arc<Self>,
        id: String,
        endpoint: ExecdEndpoint,
        live: impl FnOnce() -> bool + Send + 'static,
    ) {
        let this = self.clone();
        tokio::spawn(async move {
            match open(&endpoint).await {
                Ok(sender) => this.park(id, sender, true, live),
                Err(e) => tracing::debug!(sandbox_id = %id, error = %e, "no connection to park"),
            }
        });
    }

    /// Starts, once, the task that closes connections parked longer than [`MAX_IDLE`]: without it a
    /// sandbox used once and then left idle would hold its connection (memory on both sides) until
    /// its next request or its end.
    fn keep_swept(self: &Arc<Self>) {
        if self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(MAX_IDLE / 2);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match this.upgrade() {
                    Some(conns) => conns.sweep(MAX_IDLE),
                    None => return,
                }
            }
        });
    }

    /// Closes the connections parked longer than `max_idle` (except those opened ahead of use), and
    /// those execd closed.
    fn sweep(&self, max_idle: Duration) {
        let stale: Vec<Parked> = {
            let mut idle = self.idle();
            let mut stale = Vec::new();
            idle.retain(|_, list| {
                let (keep, old): (Vec<Parked>, Vec<Parked>) = std::mem::take(list)
                    .into_iter()
                    .partition(|p| p.fresh(max_idle));
                *list = keep;
                stale.extend(old);
                !list.is_empty()
            });
            stale
        };
        // Dropped outside the lock: closing is the connection tasks' business.
        drop(stale);
    }

    /// Closes `id`'s parked connections; call once the sandbox is no longer live.
    pub fn forget(&self, id: &str) {
        let gone = self.idle().remove(id);
        drop(gone);
    }

    /// Parked connections for `id` (tests).
    #[cfg(test)]
    fn parked(&self, id: &str) -> usize {
        self.idle().get(id).map_or(0, Vec::len)
    }
}

/// A fresh HTTP/1 connection to execd; upgrades (WebSocket) stay possible on it.
pub async fn open(endpoint: &ExecdEndpoint) -> Result<Sender, Error> {
    let inner = match &endpoint.address {
        ExecdAddress::Unix(socket) => {
            // `_handle` keeps the socket's /proc/self/fd path alive until the connect completes;
            // it never follows a symlink the sandbox may have put in the socket's place (see
            // `socket_connect_path`).
            let (_handle, reachable) = warren_core::socket_connect_path(socket)?;
            let stream = tokio::net::UnixStream::connect(&reachable).await?;
            handshake(stream).await?
        }
        ExecdAddress::Tcp(addr) => {
            let stream =
                tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
                    .await
                    .map_err(|_| format!("connecting to execd at {addr} timed out"))??;
            // Event streams are many small writes; see execd's own listener.
            stream.set_nodelay(true)?;
            handshake(stream).await?
        }
        ExecdAddress::Relayed { relay, target } => {
            use tokio::io::AsyncWriteExt;
            let mut stream =
                tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(relay))
                    .await
                    .map_err(|_| format!("connecting to the relay at {relay} timed out"))??;
            stream.set_nodelay(true)?;
            // The relay's one line, then the connection is execd's.
            stream
                .write_all(format!("{}{target}\n", warren_api::RELAY_PREAMBLE).as_bytes())
                .await?;
            handshake(stream).await?
        }
    };
    Ok(Sender {
        inner,
        credential: endpoint.credential.clone(),
    })
}

/// How long a TCP connect to execd may take (a pod whose node went away never answers).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

async fn handshake<S>(stream: S) -> Result<SendRequest<Body>, Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "execd connection ended");
        }
    });
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;

    /// A tiny execd stand-in on a Unix socket: counts accepted connections; `/close` answers and
    /// then closes its connection, `/stream` sends a body in two parts with a pause between.
    struct Upstream {
        _dir: tempfile::TempDir,
        socket: std::path::PathBuf,
        accepted: Arc<AtomicUsize>,
        open: Arc<AtomicUsize>,
    }

    impl Upstream {
        fn endpoint(&self) -> ExecdEndpoint {
            ExecdEndpoint::new(ExecdAddress::Unix(self.socket.clone()), "secret")
        }
    }

    /// Answers every request with the `X-EXECD-ACCESS-TOKEN` it carried ("-" for none).
    async fn echo_credential<S>(stream: S)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let svc = hyper::service::service_fn(|req: http::Request<Incoming>| async move {
            let seen = req
                .headers()
                .get(warren_api::EXECD_TOKEN_HEADER)
                .map_or("-".to_string(), |v| v.to_str().unwrap_or("?").to_string());
            Ok::<_, std::convert::Infallible>(http::Response::new(Body::from(seen)))
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), svc)
            .await;
    }

    async fn credential_seen(endpoint: &ExecdEndpoint, sent: Option<&str>) -> String {
        let mut sender = open(endpoint).await.expect("connect");
        let mut req = http::Request::get("/").header(http::header::HOST, "localhost");
        if let Some(v) = sent {
            req = req.header(warren_api::EXECD_TOKEN_HEADER, v);
        }
        let resp = sender
            .send_request(req.body(Body::empty()).expect("request"))
            .await
            .expect("send");
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        String::from_utf8(body.to_vec()).expect("utf-8")
    }

    #[tokio::test]
    async fn over_tcp_every_request_carries_the_credential_and_never_a_client_s() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.expect("accept");
                tokio::spawn(echo_credential(stream));
            }
        });
        let endpoint = ExecdEndpoint::new(ExecdAddress::Tcp(addr), "secret");
        let credential = crate::tokens::execd_credential("secret");
        assert_eq!(credential_seen(&endpoint, None).await, credential);
        assert_eq!(credential_seen(&endpoint, Some("forged")).await, credential);
        // The credential never shows in logs through the endpoint's Debug.
        assert!(!format!("{endpoint:?}").contains(&credential));

        // Over a Unix socket nothing is added, and what a client sent is dropped.
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("execd.sock");
        let unix = tokio::net::UnixListener::bind(&socket).expect("bind");
        tokio::spawn(async move {
            loop {
                let (stream, _) = unix.accept().await.expect("accept");
                tokio::spawn(echo_credential(stream));
            }
        });
        let endpoint = ExecdEndpoint::new(ExecdAddress::Unix(socket), "secret");
        assert_eq!(credential_seen(&endpoint, Some("forged")).await, "-");
    }

    async fn upstream() -> Upstream {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("execd.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        let accepted = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let (a, o) = (accepted.clone(), open.clone());
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.expect("accept");
                a.fetch_add(1, Ordering::SeqCst);
                o.fetch_add(1, Ordering::SeqCst);
                let o = o.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|req: http::Request<_>| async move {
                        let mut resp = match req.uri().path() {
                            "/stream" => {
                                // "a" at once, "b" after a pause, then the end.
                                let parts = futures::stream::unfold(0, |i| async move {
                                    let data = match i {
                                        0 => "a",
                                        1 => {
                                            tokio::time::sleep(Duration::from_millis(300)).await;
                                            "b"
                                        }
                                        _ => return None,
                                    };
                                    let frame = hyper::body::Frame::data(bytes::Bytes::from(data));
                                    Some((Ok::<_, std::convert::Infallible>(frame), i + 1))
                                });
                                http::Response::new(Body::new(http_body_util::StreamBody::new(
                                    parts,
                                )))
                            }
                            _ => http::Response::new(Body::from("ok")),
                        };
                        if req.uri().path() == "/close" {
                            resp.headers_mut().insert(
                                http::header::CONNECTION,
                                http::HeaderValue::from_static("close"),
                            );
                        }
                        Ok::<_, std::convert::Infallible>(resp)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Upstream {
            _dir: dir,
            socket,
            accepted,
            open,
        }
    }

    fn get(path: &str) -> http::Request<Body> {
        http::Request::get(path)
            .header(http::header::HOST, "localhost")
            .body(Body::empty())
            .expect("request")
    }

    /// What the proxy does: a parked connection or a new one, then back to the pool.
    async fn call(conns: &Arc<ExecdConns>, up: &Upstream, path: &str) -> String {
        let mut sender = match conns.take("sb") {
            Some(s) => s,
            None => open(&up.endpoint()).await.expect("connect"),
        };
        let resp = sender.send_request(get(path)).await.expect("response");
        conns.put_back("sb".into(), sender, || true);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        String::from_utf8(body.to_vec()).expect("utf-8")
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    #[tokio::test]
    async fn sequential_requests_share_one_connection() {
        let up = upstream().await;
        let conns = Arc::new(ExecdConns::default());
        for _ in 0..5 {
            assert_eq!(call(&conns, &up, "/ping").await, "ok");
            settle().await;
        }
        assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
        assert_eq!(conns.parked("sb"), 1);
    }

    #[tokio::test]
    async fn a_connection_the_peer_closed_is_not_reused() {
        let up = upstream().await;
        let conns = Arc::new(ExecdConns::default());
        assert_eq!(call(&conns, &up, "/close").await, "ok");
        settle().await;
        assert_eq!(
            conns.parked("sb"),
            0,
            "a closing connection must not be parked"
        );
        assert_eq!(call(&conns, &up, "/ping").await, "ok");
        assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_response_dropped_before_its_end_does_not_park_the_connection() {
        let up = upstream().await;
        let conns = Arc::new(ExecdConns::default());
        let mut sender = open(&up.endpoint()).await.expect("connect");
        let resp = sender.send_request(get("/stream")).await.expect("response");
        conns.put_back("sb".into(), sender, || true);
        let mut body = resp.into_body();
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().expect("data"), "a");
        drop(body);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(conns.parked("sb"), 0);
        assert!(conns.take("sb").is_none());
        assert_eq!(
            up.open.load(Ordering::SeqCst),
            0,
            "the cut connection was closed"
        );
    }

    #[tokio::test]
    async fn a_stream_read_to_its_end_parks_the_connection_afterwards() {
        let up = upstream().await;
        let conns = Arc::new(ExecdConns::default());
        assert_eq!(call(&conns, &up, "/stream").await, "ab");
        settle().await;
        assert_eq!(conns.parked("sb"), 1);
        assert_eq!(call(&conns, &up, "/ping").await, "ok");
        assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn nothing_is_parked_for_a_sandbox_that_is_not_live_and_forget_closes() {
        let up = upstream().await;
        let conns = Arc::new(ExecdConns::default());
        let sender = open(&up.endpoint()).await.expect("connect");
        conns.put_back("sb".into(), sender, || false);
        settle().await;
        assert_eq!(conns.parked("sb"), 0);
        settle().await;
        assert_eq!(up.open.load(Ordering::SeqCst), 0);

        conns.prewarm("sb".into(), up.endpoint(), || true);
        settle().await;
        assert_eq!(conns.parked("sb"), 1);
        assert_eq!(up.open.load(Ordering::SeqCst), 1);
        conns.forget("sb");
        settle().await;
        assert_eq!(conns.parked("sb"), 0);
        assert_eq!(
            up.open.load(Ordering::SeqCst),
            0,
            "forget closes the connections"
        );
    }

    #[tokio::test]
    async fn a_sweep_closes_connections_parked_too_long_but_not_those_opened_ahead() {
        let up = upstream().await;
        let conns = Arc::new(ExecdConns::default());
        conns.prewarm("warm".into(), up.endpoint(), || true);
        assert_eq!(call(&conns, &up, "/ping").await, "ok"); // parks one for "sb"
        settle().await;
        conns.sweep(Duration::from_secs(60));
        assert_eq!(conns.parked("sb"), 1, "a fresh connection stays");
        conns.sweep(Duration::ZERO);
        assert_eq!(conns.parked("sb"), 0);
        assert_eq!(
            conns.parked("warm"),
            1,
            "one opened ahead waits for its first use"
        );
        settle().await;
        assert_eq!(
            up.open.load(Ordering::SeqCst),
            1,
            "the swept one was closed"
        );
    }

    #[tokio::test]
    async fn at_most_max_per_sandbox_are_kept() {
        let up = upstream().await;
        let conns = Arc::new(ExecdConns::default());
        for _ in 0..MAX_PER_SANDBOX + 2 {
            let sender = open(&up.endpoint()).await.expect("connect");
            conns.put_back("sb".into(), sender, || true);
        }
        settle().await;
        assert_eq!(conns.parked("sb"), MAX_PER_SANDBOX);
        settle().await;
        assert_eq!(up.open.load(Ordering::SeqCst), MAX_PER_SANDBOX);
    }
}
