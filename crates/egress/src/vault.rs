//! The credential vault of one sandbox: named secrets, and bindings that say on which requests
//! (scheme, host, port, method, path) which secret goes into which header. The sandbox never holds a
//! secret: the vault lives in the server, and the MITM proxy injects headers on the wire. The API
//! answers only sanitized state (names, types, revisions), never values.
//!
//! Why one file: ~245 of its lines are tests. The rest is the vault's wire schema and one `Vault`
//! whose create, patch, matching and injection share private parsers and matchers, with the
//! `Redactor` that masks the same secrets in the answers the proxy relays.

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VaultError {
    #[error("{0}")]
    Invalid(String),
    #[error("revision conflict: the vault is at revision {current}, not {expected}")]
    Conflict { current: u64, expected: u64 },
    #[error("{0} not found")]
    NotFound(String),
    /// A create-only call (the lifecycle API's `POST`) over a vault that exists.
    #[error(
        "the sandbox has a credential vault already: change it with PATCH, or DELETE it first"
    )]
    Exists,
}

/// A secret. Its value is never printed, serialized or logged.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(…)")
    }
}

#[derive(Debug, Clone)]
struct Credential {
    value: Secret,
    revision: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Match {
    #[serde(default = "https")]
    pub schemes: Vec<String>,
    /// Without any: each scheme's own (443 for https, 80 for http).
    #[serde(default)]
    pub ports: Vec<u16>,
    pub hosts: Vec<String>,
    #[serde(default = "methods")]
    pub methods: Vec<String>,
    #[serde(default = "all_paths")]
    pub paths: Vec<String>,
}

impl Match {
    /// Whether it takes `scheme` on `port`, for some host.
    fn takes(&self, scheme: &str, port: u16) -> bool {
        self.schemes.iter().any(|s| s == scheme) && self.ports.contains(&port)
    }

    /// Whether it takes connections to `host:port` over `scheme`.
    fn reaches(&self, scheme: &str, host: &str, port: u16) -> bool {
        self.takes(scheme, port) && self.hosts.iter().any(|h| host_matches(h, host))
    }

    /// Whether it takes `method` requests to `host:port` over `scheme`, on any path.
    fn serves(&self, scheme: &str, host: &str, port: u16, method: &str) -> bool {
        self.reaches(scheme, host, port)
            && self.methods.iter().any(|x| x.eq_ignore_ascii_case(method))
    }
}

fn https() -> Vec<String> {
    vec!["https".into()]
}
fn methods() -> Vec<String> {
    ["GET", "POST", "PUT", "PATCH", "DELETE"]
        .map(String::from)
        .to_vec()
}
fn all_paths() -> Vec<String> {
    vec!["/*".into()]
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRef {
    pub name: String,
    pub credential: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum Auth {
    Bearer {
        credential: String,
    },
    /// The credential is `user:password`; it is base64-encoded on the wire.
    Basic {
        credential: String,
    },
    ApiKey {
        name: String,
        credential: String,
    },
    CustomHeaders {
        headers: Vec<HeaderRef>,
    },
    /// No header of the vault's: the request goes as written, but for its `substitutions`.
    Passthrough {},
}

/// Where a substitution's placeholder is replaced by its credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Place {
    Body,
    Header,
    Path,
    Query,
}

/// A placeholder the sandbox writes in a request, replaced on the wire by a credential.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Substitution {
    pub credential: String,
    pub placeholder: String,
    #[serde(rename = "in")]
    pub places: Vec<Place>,
}

/// What the proxy does to a request one binding takes: headers to set, and placeholders to replace
/// (each with its secret and where).
#[derive(Debug, Default)]
pub struct Injection {
    /// The binding that matched (a name the vault's owner chose; never a secret).
    pub binding: String,
    pub headers: Vec<(String, String)>,
    pub substitutions: Vec<(String, String, Vec<Place>)>,
}

impl Auth {
    fn credentials(&self) -> Vec<&str> {
        match self {
            Self::Bearer { credential }
            | Self::Basic { credential }
            | Self::ApiKey { credential, .. } => {
                vec![credential]
            }
            Self::CustomHeaders { headers } => {
                headers.iter().map(|h| h.credential.as_str()).collect()
            }
            Self::Passthrough {} => Vec::new(),
        }
    }

    fn sanitized(&self) -> Value {
        match self {
            Self::Bearer { .. } => serde_json::json!({"type": "bearer"}),
            Self::Basic { .. } => serde_json::json!({"type": "basic"}),
            Self::ApiKey { name, .. } => serde_json::json!({"type": "apiKey", "name": name}),
            Self::CustomHeaders { headers } => serde_json::json!({"type": "customHeaders",
                "headers": headers.iter().map(|h| serde_json::json!({"name": h.name})).collect::<Vec<_>>()}),
            Self::Passthrough {} => serde_json::json!({"type": "passthrough"}),
        }
    }
}

#[derive(Debug, Clone)]
struct Binding {
    matcher: Match,
    auth: Auth,
    substitutions: Vec<Substitution>,
    revision: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Vault {
    revision: u64,
    credentials: BTreeMap<String, Credential>,
    bindings: BTreeMap<String, Binding>,
}

fn invalid(m: impl Into<String>) -> VaultError {
    VaultError::Invalid(m.into())
}

fn parse_credential(v: &Value) -> Result<(String, Secret), VaultError> {
    let name = v["name"]
        .as_str()
        .filter(|n| !n.trim().is_empty())
        .ok_or_else(|| invalid("a credential needs a non-empty name"))?;
    let source = &v["source"];
    match source["type"].as_str() {
        Some("inline") | None => {}
        Some(other) => {
            return Err(invalid(format!(
                "credential {name}: source type {other:?} is not supported (inline)"
            )))
        }
    }
    let value = source["value"]
        .as_str()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| invalid(format!("credential {name}: source.value is required")))?;
    Ok((name.to_string(), Secret(value.to_string())))
}

fn parse_binding(v: &Value) -> Result<(String, Match, Auth, Vec<Substitution>), VaultError> {
    let name = v["name"]
        .as_str()
        .filter(|n| !n.trim().is_empty())
        .ok_or_else(|| invalid("a binding needs a non-empty name"))?;
    let mut matcher: Match = serde_json::from_value(v["match"].clone())
        .map_err(|e| invalid(format!("binding {name}: match: {e}")))?;
    if matcher.hosts.is_empty() {
        return Err(invalid(format!("binding {name}: match.hosts is required")));
    }
    for s in &matcher.schemes {
        if s != "https" && s != "http" {
            return Err(invalid(format!(
                "binding {name}: scheme {s:?} (http or https)"
            )));
        }
    }
    if matcher.ports.is_empty() {
        matcher.ports = matcher
            .schemes
            .iter()
            .map(|s| if s == "http" { 80 } else { 443 })
            .collect();
        matcher.ports.dedup();
    }
    let auth: Auth = serde_json::from_value(v["auth"].clone())
        .map_err(|e| invalid(format!("binding {name}: auth: {e}")))?;
    let substitutions: Vec<Substitution> = match &v["auth"]["substitutions"] {
        Value::Null => Vec::new(),
        list => serde_json::from_value(list.clone())
            .map_err(|e| invalid(format!("binding {name}: auth.substitutions: {e}")))?,
    };
    for sub in &substitutions {
        // Short placeholders would be found in ordinary text and replaced there too.
        if sub.placeholder.len() < 4 || sub.placeholder.len() > 256 {
            return Err(invalid(format!(
                "binding {name}: a substitution's placeholder is 4 to 256 characters"
            )));
        }
        if sub.places.is_empty() {
            return Err(invalid(format!(
                "binding {name}: a substitution needs `in` (body, header, path, query)"
            )));
        }
    }
    Ok((name.to_string(), matcher, auth, substitutions))
}

fn host_matches(pattern: &str, host: &str) -> bool {
    let (p, h) = (pattern.to_ascii_lowercase(), host.to_ascii_lowercase());
    match p.strip_prefix("*.") {
        Some(suffix) => h.len() > suffix.len() && h.ends_with(&format!(".{suffix}")),
        None => p == h,
    }
}

/// A binding's path pattern against a request's path as sent (its query cut): `prefix*` or the
/// whole path, nothing decoded, as the reference matches. What decoding could change is
/// [`Vault::refused_path`]'s to judge.
fn path_matches(pattern: &str, path: &str) -> bool {
    let path = path.split('?').next().unwrap_or(path);
    match pattern.strip_suffix('*') {
        Some(prefix) => path.starts_with(prefix),
        None => pattern == path,
    }
}

/// How many times a path is percent-decoded looking for what it may mean to a server.
const DECODINGS: usize = 10;

/// Whether `path` (no query) has a `..` segment.
fn has_dot_dot(path: &str) -> bool {
    path.split('/').any(|seg| seg == "..")
}

impl Vault {
    /// `POST /credential-vault`: a new vault (replacing any previous one).
    pub fn create(body: &Value) -> Result<Self, VaultError> {
        let mut v = Self {
            revision: 1,
            ..Default::default()
        };
        for c in body["credentials"].as_array().into_iter().flatten() {
            let (name, value) = parse_credential(c)?;
            v.credentials
                .insert(name, Credential { value, revision: 1 });
        }
        for b in body["bindings"].as_array().into_iter().flatten() {
            let (name, matcher, auth, substitutions) = parse_binding(b)?;
            v.bindings.insert(
                name,
                Binding {
                    matcher,
                    auth,
                    substitutions,
                    revision: 1,
                },
            );
        }
        v.check_references()?;
        Ok(v)
    }

    fn check_references(&self) -> Result<(), VaultError> {
        for (name, b) in &self.bindings {
            let substituted = b.substitutions.iter().map(|s| s.credential.as_str());
            for c in b.auth.credentials().into_iter().chain(substituted) {
                if !self.credentials.contains_key(c) {
                    return Err(invalid(format!(
                        "binding {name} names credential {c:?}, which the vault does not have"
                    )));
                }
            }
        }
        Ok(())
    }

    /// `PATCH /credential-vault`: `{expectedRevision?, credentials: {add, replace, delete}, bindings: {…}}`,
    /// all or nothing.
    pub fn patch(&mut self, body: &Value) -> Result<(), VaultError> {
        if let Some(expected) = body["expectedRevision"].as_u64() {
            if expected != self.revision {
                return Err(VaultError::Conflict {
                    current: self.revision,
                    expected,
                });
            }
        }
        let mut next = self.clone();
        let rev = self.revision + 1;
        let c = &body["credentials"];
        for (op, replace) in [("add", false), ("replace", true)] {
            for item in c[op].as_array().into_iter().flatten() {
                let (name, value) = parse_credential(item)?;
                if next.credentials.contains_key(&name) != replace {
                    return Err(invalid(format!(
                        "credentials.{op}: {name} {}",
                        if replace {
                            "does not exist"
                        } else {
                            "exists already"
                        }
                    )));
                }
                next.credentials.insert(
                    name,
                    Credential {
                        value,
                        revision: rev,
                    },
                );
            }
        }
        for item in c["delete"].as_array().into_iter().flatten() {
            let name = item
                .as_str()
                .ok_or_else(|| invalid("credentials.delete takes names"))?;
            next.credentials.remove(name);
        }
        let b = &body["bindings"];
        for (op, replace) in [("add", false), ("replace", true)] {
            for item in b[op].as_array().into_iter().flatten() {
                let (name, matcher, auth, substitutions) = parse_binding(item)?;
                if next.bindings.contains_key(&name) != replace {
                    return Err(invalid(format!(
                        "bindings.{op}: {name} {}",
                        if replace {
                            "does not exist"
                        } else {
                            "exists already"
                        }
                    )));
                }
                next.bindings.insert(
                    name,
                    Binding {
                        matcher,
                        auth,
                        substitutions,
                        revision: rev,
                    },
                );
            }
        }
        for item in b["delete"].as_array().into_iter().flatten() {
            let name = item
                .as_str()
                .ok_or_else(|| invalid("bindings.delete takes names"))?;
            next.bindings.remove(name);
        }
        next.check_references()?;
        next.revision = rev;
        *self = next;
        Ok(())
    }

    pub fn credentials_json(&self) -> Value {
        serde_json::json!({"revision": self.revision, "credentials": self.credentials.iter()
            .map(|(n, c)| serde_json::json!({"name": n, "sourceType": "inline", "revision": c.revision})).collect::<Vec<_>>()})
    }

    pub fn bindings_json(&self) -> Value {
        serde_json::json!({"revision": self.revision, "bindings": self.bindings.iter()
            .map(|(n, b)| serde_json::json!({"name": n, "revision": b.revision, "match": b.matcher, "auth": b.auth.sanitized()}))
            .collect::<Vec<_>>()})
    }

    /// Sanitized state: names, types and revisions; never a value.
    pub fn state_json(&self) -> Value {
        serde_json::json!({"revision": self.revision,
            "credentials": self.credentials_json()["credentials"],
            "bindings": self.bindings_json()["bindings"]})
    }

    pub fn credential_json(&self, name: &str) -> Result<Value, VaultError> {
        let c = self
            .credentials
            .get(name)
            .ok_or_else(|| VaultError::NotFound(format!("credential {name}")))?;
        Ok(serde_json::json!({"name": name, "sourceType": "inline", "revision": c.revision}))
    }

    pub fn binding_json(&self, name: &str) -> Result<Value, VaultError> {
        let b = self
            .bindings
            .get(name)
            .ok_or_else(|| VaultError::NotFound(format!("binding {name}")))?;
        Ok(
            serde_json::json!({"name": name, "revision": b.revision, "match": b.matcher, "auth": b.auth.sanitized()}),
        )
    }

    /// Whether any binding takes `scheme` on `port`, for some host.
    pub fn takes_scheme_on(&self, scheme: &str, port: u16) -> bool {
        self.bindings
            .values()
            .any(|b| b.matcher.takes(scheme, port))
    }

    /// Whether some binding could apply to connections to `host:port` over `scheme` (then they are
    /// intercepted; all others are tunnelled untouched).
    pub fn wants(&self, scheme: &str, host: &str, port: u16) -> bool {
        self.bindings
            .values()
            .any(|b| b.matcher.reaches(scheme, host, port))
    }

    /// Why a request a binding matches must not get a credential, if it must not: its path could
    /// mean another to the server (a `..` segment, as sent or once decoded; a backslash; a path
    /// that keeps decoding), or an encoded slash in it changes which bindings match once decoded
    /// (`/pkg%2fadmin` past a binding for `/pkg/admin/*`). An encoded slash that changes nothing
    /// is fine: npm's scoped packages (`/@scope%2fname`) are paths of that kind. As the reference
    /// judges; answered 403 by the proxy, never sent on.
    pub fn refused_path(
        &self,
        scheme: &str,
        host: &str,
        port: u16,
        method: &str,
        path: &str,
    ) -> Option<String> {
        let raw = path.split('?').next().unwrap_or(path);
        let candidates: Vec<(&String, &Binding)> = self
            .bindings
            .iter()
            .filter(|(_, b)| b.matcher.serves(scheme, host, port, method))
            .collect();
        let on = |p: &str| -> Vec<&String> {
            candidates
                .iter()
                .filter(|(_, b)| b.matcher.paths.iter().any(|pat| path_matches(pat, p)))
                .map(|(name, _)| *name)
                .collect()
        };
        let matched = on(raw);
        if matched.is_empty() {
            return None;
        }
        let refuse = |why: &str| {
            Some(format!(
                "the request path {raw:?} {why}: no credential is sent where its binding may not reach"
            ))
        };
        if has_dot_dot(raw) {
            return refuse("has a `..` segment");
        }
        let mut current = raw.to_string();
        for _ in 0..DECODINGS {
            if current.contains('\\') || current.to_ascii_lowercase().contains("%5c") {
                return refuse("holds a backslash");
            }
            let decoded = percent_encoding::percent_decode_str(&current)
                .decode_utf8_lossy()
                .into_owned();
            if decoded == current {
                return None;
            }
            if has_dot_dot(&decoded) {
                return refuse("has a `..` segment once decoded");
            }
            if on(&decoded) != matched {
                return refuse("matches other bindings once decoded");
            }
            current = decoded;
        }
        refuse("keeps decoding")
    }

    /// What to do to a request, when exactly one binding matches it: its auth's headers, and its
    /// substitutions' placeholders with their secrets.
    pub fn injections(
        &self,
        scheme: &str,
        host: &str,
        port: u16,
        method: &str,
        path: &str,
    ) -> Option<Injection> {
        let mut matching = self.bindings.iter().filter(|(_, b)| {
            b.matcher.serves(scheme, host, port, method)
                && b.matcher.paths.iter().any(|p| path_matches(p, path))
        });
        let (binding, b) = matching.next()?;
        if matching.next().is_some() {
            return None;
        }
        let secret = |name: &str| self.credentials.get(name).map(|c| c.value.0.clone());
        let substitutions = b
            .substitutions
            .iter()
            .map(|s| {
                Some((
                    s.placeholder.clone(),
                    secret(&s.credential)?,
                    s.places.clone(),
                ))
            })
            .collect::<Option<Vec<_>>>()?;
        let headers = match &b.auth {
            Auth::Bearer { credential } => vec![(
                "authorization".into(),
                format!("Bearer {}", secret(credential)?),
            )],
            Auth::Basic { credential } => vec![(
                "authorization".into(),
                format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(secret(credential)?)
                ),
            )],
            Auth::ApiKey { name, credential } => vec![(name.clone(), secret(credential)?)],
            Auth::CustomHeaders { headers } => headers
                .iter()
                .map(|h| Some((h.name.clone(), secret(&h.credential)?)))
                .collect::<Option<Vec<_>>>()?,
            Auth::Passthrough {} => Vec::new(),
        };
        Some(Injection {
            binding: binding.clone(),
            headers,
            substitutions,
        })
    }

    /// Every form a secret may come back in (as is, and base64 as in basic auth), longest first.
    pub fn redactions(&self) -> Vec<Vec<u8>> {
        let mut out: Vec<Vec<u8>> = Vec::new();
        for c in self.credentials.values() {
            out.push(c.value.0.as_bytes().to_vec());
            out.push(
                base64::engine::general_purpose::STANDARD
                    .encode(&c.value.0)
                    .into_bytes(),
            );
        }
        out.retain(|s| s.len() >= 4);
        out.sort_by_key(|s| std::cmp::Reverse(s.len()));
        out
    }
}

/// Replaces every occurrence of the secrets in a stream of chunks with `[REDACTED]`, including
/// occurrences split across chunks (it holds back the last `longest - 1` bytes of each chunk).
pub struct Redactor {
    secrets: Vec<Vec<u8>>,
    hold: Vec<u8>,
}

pub const REDACTED: &[u8] = b"[REDACTED]";

impl Redactor {
    pub fn new(secrets: Vec<Vec<u8>>) -> Self {
        Self {
            secrets,
            hold: Vec::new(),
        }
    }

    fn keep(&self) -> usize {
        self.secrets
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(1)
            .saturating_sub(1)
    }

    fn replace_all(&self, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len());
        let mut i = 0;
        'outer: while i < data.len() {
            for s in &self.secrets {
                if data[i..].starts_with(s) {
                    out.extend_from_slice(REDACTED);
                    i += s.len();
                    continue 'outer;
                }
            }
            out.push(data[i]);
            i += 1;
        }
        out
    }

    /// Feeds a chunk; returns what can be released now.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.secrets.is_empty() {
            return chunk.to_vec();
        }
        self.hold.extend_from_slice(chunk);
        let pending = std::mem::take(&mut self.hold);
        let replaced = self.replace_all(&pending);
        let keep = self.keep().min(replaced.len());
        // Do not cut inside a marker we just wrote: hold back only raw tail bytes.
        let split = replaced.len() - keep;
        self.hold = replaced[split..].to_vec();
        replaced[..split].to_vec()
    }

    pub fn finish(&mut self) -> Vec<u8> {
        let rest = std::mem::take(&mut self.hold);
        self.replace_all(&rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vault() -> Vault {
        Vault::create(&json!({
            "credentials": [{"name": "gh", "source": {"type": "inline", "value": "ghp_SECRET123"}},
                            {"name": "user", "source": {"type": "inline", "value": "bob:hunter22"}}],
            "bindings": [
                {"name": "github", "match": {"hosts": ["api.github.test"]}, "auth": {"type": "bearer", "credential": "gh"}},
                {"name": "any-wild", "match": {"hosts": ["*.wild.test"], "paths": ["/v1/*"], "methods": ["GET"]},
                 "auth": {"type": "basic", "credential": "user"}},
                {"name": "both", "match": {"hosts": ["x.both.test"]}, "auth": {"type": "apiKey", "name": "X-Key", "credential": "gh"}},
                {"name": "both2", "match": {"hosts": ["x.both.test"]}, "auth": {"type": "apiKey", "name": "X-Other", "credential": "gh"}}
            ]})).expect("vault")
    }

    #[test]
    fn encoded_slashes_inject_unless_they_change_the_binding() {
        let v = Vault::create(&json!({
            "credentials": [{"name": "t", "source": {"value": "tok-SECRET"}}],
            "bindings": [
                {"name": "registry", "match": {"hosts": ["npm.test"]}, "auth": {"type": "bearer", "credential": "t"}},
                {"name": "gitlab", "match": {"hosts": ["gl.test"], "paths": ["/api/v8/*"]},
                 "auth": {"type": "apiKey", "name": "Private-Token", "credential": "t"}},
                {"name": "narrow", "match": {"hosts": ["gl.test"], "paths": ["/api/v8/projects/123%2f*"]},
                 "auth": {"type": "apiKey", "name": "X-Narrow", "credential": "t"}},
                {"name": "pkg", "match": {"hosts": ["pkg.test"], "paths": ["/pkg/admin/*"]},
                 "auth": {"type": "bearer", "credential": "t"}},
                {"name": "pkg-enc", "match": {"hosts": ["pkg.test"], "paths": ["/pkg%252Fadmin%252F*"]},
                 "auth": {"type": "bearer", "credential": "t"}}
            ]})).expect("vault");
        let refused = |host: &str, path: &str| v.refused_path("https", host, 443, "GET", path);
        // npm's scoped packages: an encoded slash that changes nothing.
        for path in [
            "/@ali%2forion-claude-plugin",
            "/@ali%2Forion",
            "/@ali%252forion",
        ] {
            assert_eq!(refused("npm.test", path), None, "{path}");
            assert!(
                v.injections("https", "npm.test", 443, "GET", path)
                    .is_some(),
                "{path}"
            );
        }
        assert_eq!(
            refused("gl.test", "/api/v8/groups/1%2fnested/variables"),
            None
        );
        // Dot segments, as sent or encoded; backslashes, as sent or encoded.
        for path in [
            "/api/v8/projects/123/%2f..%2f456/variables",
            "/api/v8/../admin",
            "/api/v8/x/..",
            "/api/v8/%2e%2e/admin",
            "/api/v8/%252e%252e/admin",
            "/@ali%5cx",
            "/api/v8/a\\b",
        ] {
            let host = if path.starts_with("/@") {
                "npm.test"
            } else {
                "gl.test"
            };
            assert!(refused(host, path).is_some(), "{path}");
        }
        // An encoded slash that moves the path under (or out of) another binding.
        assert!(refused("gl.test", "/api/v8/projects/123%2fescape/variables").is_some());
        assert!(refused("pkg.test", "/pkg%252Fadmin%252Fsecrets").is_some());
        // A query is not the path; a path no binding matches is not the vault's to judge.
        assert_eq!(
            refused("gl.test", "/api/v8/projects/1/variables?ref=../../main"),
            None
        );
        assert_eq!(refused("gl.test", "/other/../x"), None);
        assert_eq!(refused("nowhere.test", "/a/../b"), None);
    }

    #[test]
    fn exactly_one_binding_injects() {
        let v = vault();
        assert_eq!(
            v.injections("https", "api.github.test", 443, "POST", "/repos")
                .map(|i| i.headers),
            Some(vec![(
                "authorization".into(),
                "Bearer ghp_SECRET123".into()
            )])
        );
        let basic = v
            .injections("https", "a.wild.test", 443, "GET", "/v1/x?y=1")
            .expect("basic");
        assert_eq!(
            basic.headers[0].1,
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode("bob:hunter22")
            )
        );
        assert!(
            v.injections("https", "a.wild.test", 443, "POST", "/v1/x")
                .is_none(),
            "method"
        );
        assert!(
            v.injections("https", "a.wild.test", 443, "GET", "/v2/x")
                .is_none(),
            "path"
        );
        assert!(
            v.injections("http", "api.github.test", 443, "GET", "/")
                .is_none(),
            "scheme"
        );
        assert!(
            v.injections("https", "api.github.test", 8443, "GET", "/")
                .is_none(),
            "port"
        );
        assert!(
            v.injections("https", "x.both.test", 443, "GET", "/")
                .is_none(),
            "two bindings: none"
        );
        assert!(v.wants("https", "x.both.test", 443));
        assert!(!v.wants("https", "example.test", 443));
    }

    #[test]
    fn ports_default_to_each_schemes_own() {
        let v = Vault::create(&json!({
            "credentials": [{"name": "k", "source": {"type": "inline", "value": "v1"}}],
            "bindings": [
                {"name": "plain", "match": {"hosts": ["a.test"], "schemes": ["http"]}, "auth": {"type": "bearer", "credential": "k"}},
                {"name": "both", "match": {"hosts": ["b.test"], "schemes": ["http", "https"]}, "auth": {"type": "bearer", "credential": "k"}},
                {"name": "odd", "match": {"hosts": ["c.test"], "schemes": ["http"], "ports": [8080]}, "auth": {"type": "bearer", "credential": "k"}}
            ]})).expect("vault");
        assert!(v.injections("http", "a.test", 80, "GET", "/").is_some());
        assert!(v.injections("http", "a.test", 443, "GET", "/").is_none());
        assert!(v.injections("https", "a.test", 443, "GET", "/").is_none());
        assert!(v.injections("http", "b.test", 80, "GET", "/").is_some());
        assert!(v.injections("https", "b.test", 443, "GET", "/").is_some());
        assert!(v.injections("http", "c.test", 80, "GET", "/").is_none());
        assert!(v.takes_scheme_on("http", 80) && v.takes_scheme_on("http", 8080));
        assert!(
            !vault().takes_scheme_on("http", 80),
            "https-only bindings take no plain HTTP"
        );
    }

    #[test]
    fn state_never_shows_values() {
        let v = vault();
        let text = v.state_json().to_string() + &v.bindings_json().to_string() + &format!("{v:?}");
        assert!(
            !text.contains("SECRET123") && !text.contains("hunter22"),
            "{text}"
        );
        assert_eq!(v.state_json()["revision"], 1);
    }

    #[test]
    fn patches_are_all_or_nothing_and_revisioned() {
        let mut v = vault();
        let err = v
            .patch(&json!({"expectedRevision": 7}))
            .expect_err("conflict");
        assert_eq!(
            err,
            VaultError::Conflict {
                current: 1,
                expected: 7
            }
        );
        let err = v
            .patch(&json!({"credentials": {"delete": ["gh"]}}))
            .expect_err("dangling");
        assert!(err.to_string().contains("gh"), "{err}");
        assert_eq!(v.state_json()["revision"], 1, "nothing changed");
        v.patch(&json!({"expectedRevision": 1, "credentials": {"replace": [{"name": "gh", "source": {"value": "new-token-9"}}]}}))
            .expect("replace");
        assert_eq!(v.state_json()["revision"], 2);
        assert_eq!(
            v.injections("https", "api.github.test", 443, "GET", "/")
                .expect("inj")
                .headers[0]
                .1,
            "Bearer new-token-9"
        );
    }

    #[test]
    fn passthrough_and_substitutions() {
        let v = Vault::create(&json!({
            "credentials": [{"name": "key", "source": {"type": "inline", "value": "s3cret/&x"}}],
            "bindings": [{"name": "p", "match": {"hosts": ["api.test"]},
                          "auth": {"type": "passthrough", "substitutions": [
                              {"credential": "key", "placeholder": "__KEY__", "in": ["header", "query", "body"]}]}}]
        }))
        .expect("vault");
        let inj = v
            .injections("https", "api.test", 443, "POST", "/v1")
            .expect("taken");
        assert!(inj.headers.is_empty(), "passthrough adds no header");
        assert_eq!(
            inj.substitutions,
            vec![(
                "__KEY__".into(),
                "s3cret/&x".into(),
                vec![Place::Header, Place::Query, Place::Body]
            )]
        );
        assert_eq!(
            v.bindings_json()["bindings"][0]["auth"]["type"],
            "passthrough"
        );
        for bad in [
            json!({"credential": "key", "placeholder": "k", "in": ["body"]}),
            json!({"credential": "key", "placeholder": "__KEY__", "in": []}),
            json!({"credential": "key", "placeholder": "__KEY__", "in": ["cookie"]}),
            json!({"credential": "nope", "placeholder": "__KEY__", "in": ["body"]}),
            json!({"credential": "key", "placeholder": "__KEY__", "in": ["body"], "encode": true}),
        ] {
            let body = json!({
                "credentials": [{"name": "key", "source": {"value": "v"}}],
                "bindings": [{"name": "p", "match": {"hosts": ["api.test"]},
                              "auth": {"type": "bearer", "credential": "key", "substitutions": [bad.clone()]}}]
            });
            assert!(Vault::create(&body).is_err(), "{bad}");
        }
    }

    #[test]
    fn redaction_across_chunks() {
        let mut r = Redactor::new(vault().redactions());
        let mut out = r.push(b"token=ghp_SEC");
        out.extend(r.push(b"RET123 and more"));
        out.extend(r.finish());
        assert_eq!(String::from_utf8_lossy(&out), "token=[REDACTED] and more");
        let mut r = Redactor::new(vec![]);
        assert_eq!(r.push(b"plain"), b"plain");
    }
}
