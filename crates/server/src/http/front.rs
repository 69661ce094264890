//! The API's front door: accepts connections and serves the router on them, with the bounds a
//! server facing unknown callers needs. `axum::serve` has none: its hyper connections run without
//! a timer, so a client that sent half a request's headers held its connection (and a descriptor)
//! for ever — 20 such stayed open past 75 s — and nothing capped how many were open.
//!
//! Here a connection has [`Limits::header_timeout`] to send each request's headers, which also
//! bounds how long it may sit idle between requests (hyper starts that clock whenever it waits for
//! a request head); at most [`Limits::max_connections`] are served at once, the rest wait in the
//! kernel's listen queue. A request being answered (an event stream, a proxied WebSocket) is never
//! cut short. On shutdown, connections finish their requests and close, as with `axum::serve`.
//!
//! With TLS, the handshake happens in the connection's own task, within the same header timeout:
//! a client that stalls it holds one slot for that long, as a slow plain request would.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_timeout: Duration,
    pub max_connections: usize,
}

/// Serves `app` on `listener` until `shutdown` resolves, then until every connection has finished.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Dropped when shutdown starts: every connection task sees it and closes gracefully.
    let (stop_tx, stop_rx) = watch::channel(());
    // Held by every connection task; closed when the last one ends.
    let (done_tx, done_rx) = watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of descriptors, say: waiting lets connections close; busy-looping would not.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Event streams are many small writes: without TCP_NODELAY each one can wait ~40 ms for
        // the peer's delayed ACK (Nagle), which would dominate a command's latency.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        let service =
            TowerToHyperService::new(app.clone().map_request(move |req: Request<Incoming>| {
                let mut req = req.map(axum::body::Body::new);
                req.extensions_mut()
                    .insert(crate::http::audit::ClientAddr(peer));
                req
            }));
        let stop = stop_rx.clone();
        let done = done_rx.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_connection(tcp, service, limits, stop).await,
                Some(acceptor) => {
                    match tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => serve_connection(tls, service, limits, stop).await,
                        Ok(Err(e)) => tracing::debug!(error = %e, %peer, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
            drop(slot);
            drop(done);
        });
    }
    drop(listener);
    drop(stop_tx);
    drop(done_rx);
    done_tx.closed().await;
}

/// Serves HTTP/1.1 or HTTP/2 (with upgrades) on one connection until it ends, closing it
/// gracefully when `stop` changes.
async fn serve_connection<I, S>(io: I, service: S, limits: Limits, mut stop: watch::Receiver<()>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = axum::response::Response>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: std::error::Error + Send + Sync + 'static,
{
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        // (WebSockets over HTTP/2)
        .enable_connect_protocol()
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(limits.header_timeout);
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::trace!(error = %e, "connection ended");
                }
                break;
            }
            _ = stop.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}
