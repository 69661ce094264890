//! One intercepted request: the matching binding's headers and substituted values put in, the
//! request sent on to the real server over verified TLS (or plain HTTP when the binding says so),
//! and its answer relayed back with every secret value redacted; refusals answer in the
//! sandbox's own terms.

use std::net::SocketAddrV4;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;

use super::Target;
use super::{boxed, handshake, BoxError, ResponseBody, Upstream, HANDSHAKE_TIMEOUT};
use crate::vault::{Redactor, Vault};

/// A 400 answered by the proxy itself.
fn refusal(why: &'static str) -> hyper::Response<ResponseBody> {
    refused(hyper::StatusCode::BAD_REQUEST, why.to_string())
}

/// A 421 answered by the proxy itself, with a `{code, message}` body.
fn misdirected(why: &str) -> hyper::Response<ResponseBody> {
    json_refusal(
        hyper::StatusCode::MISDIRECTED_REQUEST,
        "EGRESS::HOST_NOT_PROVEN",
        why,
    )
}

/// An answer of the proxy's own with a `{code, message}` body.
fn json_refusal(status: hyper::StatusCode, code: &str, why: &str) -> hyper::Response<ResponseBody> {
    let text = serde_json::json!({"code": code, "message": why}).to_string();
    let mut resp = answered(status, text);
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// An answer of the proxy's own, in plain text.
pub(super) fn refused(status: hyper::StatusCode, why: String) -> hyper::Response<ResponseBody> {
    answered(status, format!("warren egress: {why}\n"))
}

fn answered(status: hyper::StatusCode, text: String) -> hyper::Response<ResponseBody> {
    let frame: Result<Frame<Bytes>, BoxError> = Ok(Frame::data(Bytes::from(text)));
    let body = futures::stream::iter([frame]).boxed();
    let mut resp = hyper::Response::new(StreamBody::new(body));
    *resp.status_mut() = status;
    resp
}

/// The largest body the vault rewrites for a substitution: a larger one is refused (413), never
/// sent on with the placeholder in place of what the binding promised.
const SUBSTITUTED_BODY_MAX: usize = 1 << 20;

/// Replaces `placeholder` by `secret` in the request's headers (but `Host`) and in its path or
/// query, as `places` says; in the path and the query the secret goes percent-encoded, so that a
/// `/`, `&` or `=` in it cannot change the request's shape.
fn substitute_head(
    headers: &mut hyper::HeaderMap,
    path: &mut String,
    placeholder: &str,
    secret: &str,
    places: &[crate::vault::Place],
) -> Result<(), BoxError> {
    use crate::vault::Place;
    if places.contains(&Place::Header) {
        let names: Vec<hyper::header::HeaderName> = headers
            .iter()
            .filter(|(n, v)| {
                *n != hyper::header::HOST
                    && v.as_bytes()
                        .windows(placeholder.len())
                        .any(|w| w == placeholder.as_bytes())
            })
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let values: Vec<String> = headers
                .get_all(&name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).replace(placeholder, secret))
                .collect();
            headers.remove(&name);
            for v in values {
                headers.append(name.clone(), hyper::header::HeaderValue::from_str(&v)?);
            }
        }
    }
    // RFC 3986's unreserved characters stay as they are; everything else is encoded.
    const ENCODED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    let encoded = percent_encoding::utf8_percent_encode(secret, ENCODED).to_string();
    let (p, q) = match path.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (path.clone(), None),
    };
    let p = if places.contains(&Place::Path) {
        p.replace(placeholder, &encoded)
    } else {
        p
    };
    let q = match q {
        Some(q) if places.contains(&Place::Query) => Some(q.replace(placeholder, &encoded)),
        other => other,
    };
    *path = match q {
        Some(q) => format!("{p}?{q}"),
        None => p,
    };
    Ok(())
}

/// The request body with `placeholder` replaced by `secret`, read whole (up to
/// [`SUBSTITUTED_BODY_MAX`]) and sent with its new length; `Err` says why it cannot be.
async fn substitute_body(
    headers: &mut hyper::HeaderMap,
    body: http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>,
    placeholder: &str,
    secret: &str,
) -> Result<http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>, String> {
    if headers
        .get(hyper::header::CONTENT_ENCODING)
        .is_some_and(|e| e.as_bytes() != b"identity")
    {
        return Err("the credential vault cannot substitute into a compressed request body".into());
    }
    let bytes = http_body_util::Limited::new(body, SUBSTITUTED_BODY_MAX)
        .collect()
        .await
        .map_err(|_| {
            format!(
                "a request body the credential vault substitutes into is at most {} bytes",
                SUBSTITUTED_BODY_MAX
            )
        })?
        .to_bytes();
    let replaced = replace_bytes(&bytes, placeholder.as_bytes(), secret.as_bytes());
    headers.remove(hyper::header::TRANSFER_ENCODING);
    headers.insert(hyper::header::CONTENT_LENGTH, replaced.len().into());
    Ok(http_body_util::Full::new(bytes::Bytes::from(replaced))
        .map_err(|never| match never {})
        .boxed())
}

fn replace_bytes(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut i = 0;
    while i < haystack.len() {
        if haystack[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(haystack[i]);
            i += 1;
        }
    }
    out
}

pub(super) async fn forward(
    req: hyper::Request<Incoming>,
    vault: Option<Arc<Vault>>,
    upstream: Upstream,
    target: Target,
    dst: SocketAddrV4,
    injected: super::Injected,
) -> Result<hyper::Response<ResponseBody>, BoxError> {
    // Answered by the proxy itself, whatever the destination.
    match &target {
        Target::Refused(why) => return Ok(refusal(why)),
        Target::Misdirected(why) => return Ok(misdirected(why)),
        _ => {}
    }
    let Some(vault) = vault else {
        return Err(boxed(std::io::Error::other(
            "the destination is no longer allowed",
        )));
    };
    let (mut parts, body) = req.into_parts();
    let mut path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    // Whether the vault takes this request at all: a plain request it does not take (another
    // host, or one whose Host is not proven) goes on as the sandbox wrote it.
    let (scheme, host, taken) = match &target {
        Target::Tls(_, host) => ("https", host.clone(), true),
        Target::Plain { host, proven, .. } => (
            "http",
            host.clone(),
            *proven && vault.wants("http", host, dst.port()),
        ),
        // (answered above; kept so that no arm can panic)
        Target::Refused(why) => return Ok(refusal(why)),
        Target::Misdirected(why) => return Ok(misdirected(why)),
    };
    if taken {
        // The request goes to the host the TLS session named or the answer proved, whatever Host
        // the client wrote (no fronting a credential to another origin behind the same address).
        let default_port = if scheme == "https" { 443 } else { 80 };
        let authority = if dst.port() == default_port {
            host.clone()
        } else {
            format!("{host}:{}", dst.port())
        };
        let authority = hyper::header::HeaderValue::from_str(&authority)?;
        parts.headers.insert(hyper::header::HOST, authority);
    }
    for hop in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    ] {
        parts.headers.remove(hop);
    }
    if taken {
        if let Some(why) =
            vault.refused_path(scheme, &host, dst.port(), parts.method.as_str(), &path)
        {
            return Ok(json_refusal(
                hyper::StatusCode::FORBIDDEN,
                "EGRESS::AMBIGUOUS_PATH",
                &why,
            ));
        }
    }
    let injections = match taken {
        true => vault.injections(scheme, &host, dst.port(), parts.method.as_str(), &path),
        false => None,
    };
    if injections.is_some() {
        // A secret echoed in pieces by ranged answers could not be redacted.
        parts.headers.remove(hyper::header::RANGE);
        parts.headers.remove(hyper::header::IF_RANGE);
    }
    let mut body = body.boxed();
    if let Some(injection) = injections {
        crate::metrics::vault_injection(&injection.binding);
        injected.report(&injection.binding, &host);
        for (k, v) in injection.headers {
            let name = hyper::header::HeaderName::from_bytes(k.as_bytes())?;
            parts
                .headers
                .insert(name, hyper::header::HeaderValue::from_str(&v)?);
        }
        for (placeholder, secret, places) in &injection.substitutions {
            substitute_head(&mut parts.headers, &mut path, placeholder, secret, places)?;
            if places.contains(&crate::vault::Place::Body) {
                body = match substitute_body(&mut parts.headers, body, placeholder, secret).await {
                    Ok(b) => b,
                    Err(why) => return Ok(refused(hyper::StatusCode::PAYLOAD_TOO_LARGE, why)),
                };
            }
        }
        if let Target::Plain { sent_secret, .. } = &target {
            sent_secret.store(true, Ordering::Relaxed);
        }
        tracing::debug!(%host, %path, "vault: credential injected");
    }
    // Answers to be scanned for secrets: every intercepted TLS answer, and on plain HTTP every
    // answer once a credential went up this connection (a server may echo it later).
    let scan = match &target {
        Target::Plain { sent_secret, .. } => sent_secret.load(Ordering::Relaxed),
        _ => true,
    };
    if scan || taken {
        // Compressed answers could not be redacted.
        parts.headers.remove(hyper::header::ACCEPT_ENCODING);
    }
    parts.uri = path.parse().map_err(boxed)?;
    let req = hyper::Request::from_parts(parts, body);
    let mut guard = upstream.lock().await;
    if guard.as_ref().is_none_or(|s| s.is_closed()) {
        let tcp = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(dst))
            .await
            .map_err(boxed)?
            .map_err(boxed)?;
        let _ = tcp.set_nodelay(true);
        let send = match target {
            Target::Tls(tls_cfg, host) => {
                let name = ServerName::try_from(host).map_err(boxed)?;
                let tls = tokio_rustls::TlsConnector::from(tls_cfg)
                    .connect(name, tcp)
                    .await?;
                handshake(tls).await?
            }
            _ => handshake(tcp).await?,
        };
        *guard = Some(send);
    }
    let send = guard
        .as_mut()
        .ok_or_else(|| boxed(std::io::Error::other("no upstream connection")))?;
    let resp = match send.ready().await {
        Ok(()) => send.send_request(req).await,
        Err(e) => Err(e),
    };
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            *guard = None; // a broken connection is not reused
            return Err(boxed(e));
        }
    };
    drop(guard);
    if !scan {
        let (parts, body) = resp.into_parts();
        let frames = body
            .into_data_stream()
            .map(|chunk| -> Result<Frame<Bytes>, BoxError> {
                chunk.map(Frame::data).map_err(|e| Box::new(e) as BoxError)
            })
            .boxed();
        return Ok(hyper::Response::from_parts(parts, StreamBody::new(frames)));
    }
    let secrets = vault.redactions();
    let (mut parts, body) = resp.into_parts();
    let encoded = parts
        .headers
        .get(hyper::header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded && !secrets.is_empty() {
        // Asked for no encoding, sent one anyway: it cannot be scanned for secrets.
        return Err(
            "the server answered with an encoded body, which cannot be checked for secrets".into(),
        );
    }
    for v in parts.headers.values_mut() {
        let bytes = v.as_bytes();
        if secrets
            .iter()
            .any(|s| bytes.windows(s.len()).any(|w| w == s.as_slice()))
        {
            let mut r = Redactor::new(secrets.clone());
            let mut out = r.push(bytes);
            out.extend(r.finish());
            *v = hyper::header::HeaderValue::from_bytes(&out).map_err(boxed)?;
        }
    }
    parts.headers.remove(hyper::header::CONTENT_LENGTH);
    let redactor = Arc::new(Mutex::new(Redactor::new(secrets)));
    let tail = redactor.clone();
    let frames = body
        .into_data_stream()
        .map(move |chunk| -> Result<Frame<Bytes>, BoxError> {
            let chunk = chunk?;
            let out = redactor
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(&chunk);
            Ok(Frame::data(Bytes::from(out)))
        })
        .chain(futures::stream::once(async move {
            let rest = tail.lock().unwrap_or_else(|e| e.into_inner()).finish();
            Ok(Frame::data(Bytes::from(rest)))
        }))
        .boxed();
    Ok(hyper::Response::from_parts(parts, StreamBody::new(frames)))
}
