//! Docker-like image references (`python:3.11`, `library/debian:bookworm`, `localhost:5000/x/y:tag`,
//! `repo@sha256:...`). Names are only ever keys in the store's name map, never paths, but they are
//! still validated strictly so that they print and round-trip cleanly.

use crate::ImageError;

/// The repository name of the built-in image; any tag of it is reserved.
pub const HOST_IMAGE: &str = "host";
/// Where a name without a registry host lives.
pub const DOCKER_HUB: &str = "docker.io";
/// Spellings of Docker Hub in names; all are dropped when a name is normalised.
const DOCKER_HUB_ALIASES: [&str; 3] = ["docker.io/", "index.docker.io/", "registry-1.docker.io/"];

const MAX_LEN: usize = 255;
const MAX_TAG_LEN: usize = 128;

/// A parsed, normalised reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl Reference {
    /// Parses and normalises `name`: a name with neither tag nor digest gets `:latest`.
    pub fn parse(name: &str) -> Result<Self, ImageError> {
        let invalid = |reason: &'static str| ImageError::InvalidName {
            name: name.to_owned(),
            reason,
        };
        if name.is_empty() {
            return Err(invalid("empty"));
        }
        if name.len() > MAX_LEN {
            return Err(invalid("longer than 255 characters"));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._/:@-".contains(&b))
        {
            return Err(invalid("only [a-zA-Z0-9._/:@-] are allowed"));
        }

        let (name_part, digest) = match name.split_once('@') {
            Some((n, d)) => {
                validate_digest(d).map_err(invalid)?;
                (n, Some(d.to_owned()))
            }
            None => (name, None),
        };
        let last_slash = name_part.rfind('/');
        let (repository, tag) = match name_part.rfind(':') {
            Some(colon) if last_slash.is_none_or(|s| colon > s) => {
                (&name_part[..colon], Some(&name_part[colon + 1..]))
            }
            _ => (name_part, None),
        };
        if let Some(tag) = tag {
            validate_tag(tag).map_err(invalid)?;
        }
        validate_repository(repository).map_err(invalid)?;
        let repository = familiar(repository);
        validate_repository(repository).map_err(invalid)?;

        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_owned()),
            (None, None) => Some("latest".to_owned()),
            (None, Some(_)) => None,
        };
        Ok(Reference {
            repository: repository.to_owned(),
            tag,
            digest,
        })
    }

    /// The registry host and the repository's path on it: `("docker.io", "library/python")` for
    /// `python`, `("127.0.0.1:5000", "x/y")` for `127.0.0.1:5000/x/y`.
    pub fn registry(&self) -> (&str, String) {
        match self.repository.split_once('/') {
            Some((first, rest)) if is_host(first) => (first, rest.to_owned()),
            _ if self.repository.contains('/') => (DOCKER_HUB, self.repository.clone()),
            _ => (DOCKER_HUB, format!("library/{}", self.repository)),
        }
    }

    /// What a registry's manifest endpoint is asked for: the digest if there is one, else the tag.
    pub fn manifest_reference(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }

    /// True for the reserved built-in `host` image, whatever the tag.
    pub fn is_host(&self) -> bool {
        self.repository == HOST_IMAGE
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// Docker's rule: the first path component names a registry if it looks like a host.
fn is_host(component: &str) -> bool {
    component.contains(['.', ':']) || component == "localhost"
}

/// Docker Hub names in their short form: `docker.io/library/python` is `python`, `docker.io/x/y` is `x/y`.
fn familiar(repo: &str) -> &str {
    let mut repo = repo;
    for alias in DOCKER_HUB_ALIASES {
        if let Some(rest) = repo.strip_prefix(alias) {
            repo = rest;
            break;
        }
    }
    match repo.strip_prefix("library/") {
        Some(rest) if !rest.contains('/') => rest,
        _ => repo,
    }
}

fn validate_digest(d: &str) -> Result<(), &'static str> {
    let (alg, hex) = d.split_once(':').ok_or("digest must be algorithm:hex")?;
    let alg_ok = !alg.is_empty()
        && alg
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    let hex_ok = hex.len() >= 32
        && hex
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    if alg_ok && hex_ok {
        Ok(())
    } else {
        Err("digest must be algorithm:hex")
    }
}

fn validate_tag(tag: &str) -> Result<(), &'static str> {
    let first_ok = tag
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !first_ok || tag.len() > MAX_TAG_LEN || tag.contains(['/', ':', '@']) {
        return Err("tag must be 1-128 of [a-zA-Z0-9_.-], not starting with . or -");
    }
    Ok(())
}

fn validate_repository(repo: &str) -> Result<(), &'static str> {
    if repo.is_empty() {
        return Err("empty repository");
    }
    let components: Vec<&str> = repo.split('/').collect();
    for (i, c) in components.iter().enumerate() {
        if c.is_empty() {
            return Err("empty path component");
        }
        if *c == "." || *c == ".." {
            return Err("path component . or ..");
        }
        if c.starts_with(['.', '-', ':']) || c.ends_with(['.', '-', ':']) {
            return Err("path component must start and end with a letter or digit");
        }
        // Only a registry host (`localhost:5000/...`) may carry a port.
        if c.contains(':') && (i != 0 || components.len() == 1) {
            return Err("':' only allowed before the tag or in a registry host");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(s: &str) -> String {
        match Reference::parse(s) {
            Ok(r) => r.to_string(),
            Err(e) => panic!("{s}: {e}"),
        }
    }

    #[test]
    fn adds_latest_when_untagged() {
        assert_eq!(norm("debian"), "debian:latest");
        assert_eq!(norm("library/debian"), "debian:latest");
        assert_eq!(norm("localhost:5000/x/y"), "localhost:5000/x/y:latest");
    }

    #[test]
    fn keeps_tags_and_digests() {
        assert_eq!(norm("python:3.11"), "python:3.11");
        assert_eq!(norm("library/debian:bookworm"), "debian:bookworm");
        assert_eq!(norm("docker.io/library/debian:12"), "debian:12");
        assert_eq!(norm("index.docker.io/someorg/x:1"), "someorg/x:1");
        assert_eq!(
            norm("localhost:5000/library/x"),
            "localhost:5000/library/x:latest"
        );
        assert_eq!(norm("localhost:5000/x/y:tag"), "localhost:5000/x/y:tag");
        let d = format!("x@sha256:{}", "a".repeat(64));
        assert_eq!(norm(&d), d);
        let td = format!("x:1@sha256:{}", "b".repeat(64));
        assert_eq!(norm(&td), td);
    }

    #[test]
    fn rejects_bad_names() {
        for bad in [
            "",
            "/abs",
            "a//b",
            "a/../b",
            "../x",
            "./x",
            "a/",
            "a b",
            "a\\b",
            "x:",
            "x:.tag",
            "UPPER?",
            "x@sha256:short",
            "a/b:c:d",
            "é",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Reference::parse(&"a".repeat(256)).is_err());
        assert!(Reference::parse(&"a".repeat(255)).is_ok());
    }

    #[test]
    fn splits_registry_and_repository() {
        let split = |s: &str| {
            let r = Reference::parse(s).expect("ref");
            let (host, repo) = r.registry();
            (host.to_owned(), repo, r.manifest_reference().to_owned())
        };
        assert_eq!(
            split("python:3.12"),
            ("docker.io".into(), "library/python".into(), "3.12".into())
        );
        assert_eq!(
            split("someorg/x"),
            ("docker.io".into(), "someorg/x".into(), "latest".into())
        );
        assert_eq!(
            split("127.0.0.1:5000/a/b:t"),
            ("127.0.0.1:5000".into(), "a/b".into(), "t".into())
        );
        assert_eq!(
            split("localhost/a"),
            ("localhost".into(), "a".into(), "latest".into())
        );
        assert_eq!(
            split("ghcr.io/o/r:1"),
            ("ghcr.io".into(), "o/r".into(), "1".into())
        );
        let d = format!("sha256:{}", "c".repeat(64));
        assert_eq!(split(&format!("x:1@{d}")).2, d);
    }

    #[test]
    fn host_is_recognised_with_any_tag() {
        for h in ["host", "host:latest", "host:v2"] {
            assert!(
                Reference::parse(h).map(|r| r.is_host()).unwrap_or(false),
                "{h}"
            );
        }
        assert!(!Reference::parse("hostile")
            .map(|r| r.is_host())
            .unwrap_or(true));
        assert!(!Reference::parse("x/host")
            .map(|r| r.is_host())
            .unwrap_or(true));
    }
}
