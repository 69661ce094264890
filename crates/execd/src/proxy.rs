//! `ANY /proxy/{port}/{*path}`: reverse proxy to `127.0.0.1:{port}` inside the sandbox, so one published
//! execd port reaches every service. Bodies stream both ways; a WebSocket (any `Upgrade`) request is
//! forwarded and, once the upstream answers 101, both upgraded connections are spliced together.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::error::{code, ApiError};

/// Headers that describe one hop and must not be forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The most of a DevTools JSON answer that is rewritten.
const DEVTOOLS_JSON_MAX: usize = 4 << 20;

fn bad_gateway(msg: impl Into<String>) -> Response {
    ApiError::new(StatusCode::BAD_GATEWAY, code::RUNTIME_ERROR, msg).into_response()
}

/// Removes hop-by-hop headers, including those listed in `Connection`. For an upgrade the `Connection` and
/// `Upgrade` headers are the point of the request and are kept.
fn strip_hop_headers(headers: &mut HeaderMap, keep_upgrade: bool) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| {
            v.split(',')
                .map(|s| s.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter_map(|s| HeaderName::from_bytes(s.as_bytes()).ok())
        .collect();
    for name in listed {
        if !(keep_upgrade && name == header::UPGRADE) {
            headers.remove(&name);
        }
    }
    for name in HOP_BY_HOP {
        if keep_upgrade && (*name == "connection" || *name == "upgrade") {
            continue;
        }
        headers.remove(*name);
    }
}

/// Splits `/proxy/{port}/{rest}` into port and upstream path-and-query.
pub fn target(uri: &Uri) -> Option<(u16, String)> {
    let rest = uri.path().strip_prefix("/proxy/")?;
    let (port, path) = match rest.split_once('/') {
        Some((p, path)) => (p, format!("/{path}")),
        None => (rest, "/".to_string()),
    };
    let port = port.parse::<u16>().ok().filter(|p| *p != 0)?;
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    Some((port, pq))
}

pub async fn proxy(mut req: Request) -> Response {
    let Some((port, path_and_query)) = target(req.uri()) else {
        return ApiError::bad_body("proxy path must be /proxy/{port}/...").into_response();
    };
    let is_upgrade = req.headers().contains_key(header::UPGRADE);
    let client_upgrade = is_upgrade.then(|| hyper::upgrade::on(&mut req));

    let stream = match TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => s,
        Err(e) => return bad_gateway(format!("nothing reachable on port {port}: {e}")),
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream)).await {
            Ok(x) => x,
            Err(e) => return bad_gateway(format!("upstream handshake on port {port} failed: {e}")),
        };
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(port, error = %e, "upstream connection ended with error");
        }
    });

    let (mut parts, body) = req.into_parts();
    parts.uri = match path_and_query.parse() {
        Ok(u) => u,
        Err(e) => return ApiError::bad_body(format!("invalid proxy path: {e}")).into_response(),
    };
    parts.version = http::Version::HTTP_11;
    strip_hop_headers(&mut parts.headers, is_upgrade);
    // execd's credential is for execd: a program in the sandbox that saw it could call execd
    // from outside as the server does.
    parts.headers.remove(warren_api::EXECD_TOKEN_HEADER);
    if !parts.headers.contains_key(header::HOST) {
        if let Ok(v) = format!("127.0.0.1:{port}").parse() {
            parts.headers.insert(header::HOST, v);
        }
    }
    // DevTools' JSON answers carry WebSocket URLs for the caller to rewrite (see `browser`).
    let devtools_json = (port == warren_api::desktop::CDP_PORT
        && parts.uri.path().starts_with("/json"))
    .then(|| parts.headers.clone());
    if port == warren_api::desktop::CDP_PORT {
        // The caller's URL is execd's to use, not the browser's to see (it may hold a signed
        // URL's token).
        for name in warren_api::desktop::FORWARDED_HEADERS {
            parts.headers.remove(name);
        }
    }
    let upstream_req = Request::from_parts(parts, body);

    let mut resp = match sender.send_request(upstream_req).await {
        Ok(r) => r,
        Err(e) => return bad_gateway(format!("upstream on port {port} failed: {e}")),
    };

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return bad_gateway("upstream switched protocols without being asked to");
        };
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            match tokio::try_join!(client_upgrade, upstream_upgrade) {
                Ok((client, upstream)) => {
                    let mut client = TokioIo::new(client);
                    let mut upstream = TokioIo::new(upstream);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
                Err(e) => tracing::debug!(port, error = %e, "upgrade failed"),
            }
        });
        let (parts, _) = resp.into_parts();
        return Response::from_parts(parts, Body::empty());
    }

    let (mut parts, body) = resp.into_parts();
    strip_hop_headers(&mut parts.headers, false);
    if let Some(request) = devtools_json {
        // Small answers (a list of targets); one larger than DEVTOOLS_JSON_MAX is a 502.
        let limited = http_body_util::Limited::new(body, DEVTOOLS_JSON_MAX);
        let bytes = match http_body_util::BodyExt::collect(limited).await {
            Ok(b) => b.to_bytes(),
            Err(e) => return bad_gateway(format!("DevTools on port {port}: {e}")),
        };
        let out = crate::browser::rewrite_json(&bytes, &request).unwrap_or_else(|| bytes.to_vec());
        parts.headers.remove(header::CONTENT_LENGTH);
        return Response::from_parts(parts, Body::from(out));
    }
    Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let u: Uri = "/proxy/8080/a/b?x=1&y=2".parse().expect("uri");
        assert_eq!(target(&u), Some((8080, "/a/b?x=1&y=2".to_string())));
        let u: Uri = "/proxy/81".parse().expect("uri");
        assert_eq!(target(&u), Some((81, "/".to_string())));
        let u: Uri = "/proxy/x/a".parse().expect("uri");
        assert_eq!(target(&u), None);
    }

    #[test]
    fn strips_hop_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, x-custom".parse().expect("v"),
        );
        h.insert("x-custom", "1".parse().expect("v"));
        h.insert("keep-alive", "timeout=5".parse().expect("v"));
        h.insert("x-real", "1".parse().expect("v"));
        strip_hop_headers(&mut h, false);
        assert!(
            h.get("x-custom").is_none()
                && h.get("keep-alive").is_none()
                && h.get(header::CONNECTION).is_none()
        );
        assert!(h.get("x-real").is_some());
    }
}
