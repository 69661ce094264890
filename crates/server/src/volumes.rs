//! Validating `volumes` of a create request into mounts a runtime can trust.
//!
//! Host folders are mounted only from under `[storage] allowed_host_paths` (empty by default, so none),
//! after resolving symlinks and `subPath`, and never when they contain or sit inside Warren's own data
//! dir or config file (that would hand a sandbox the API key). Mount targets are absolute, without
//! `..`, and not over `/`, `/proc`, `/sys`, `/dev` or Warren's `/.warren`.

use std::path::{Component, Path, PathBuf};

use warren_api::lifecycle::Volume;
use warren_api::ErrorCode;
use warren_core::{HostVolumes, VolumeMount, VolumeSource};

use crate::error::{ErrorKind, SandboxError};

const MAX_VOLUMES: usize = 32;
/// Targets a volume may not cover or sit under.
const RESERVED_TARGETS: [&str; 4] = ["/proc", "/sys", "/dev", "/.warren"];

/// What the server allows.
#[derive(Debug, Clone)]
pub struct StoragePolicy {
    /// Whose folders `host` volumes are (the runtime's capability).
    pub host_volumes: HostVolumes,
    /// Folders under which `host` volumes may be mounted: canonical ones of this host, or (for
    /// [`HostVolumes::Node`]) plain absolute names of the nodes' folders.
    pub allowed_host_paths: Vec<PathBuf>,
    /// Host paths no volume may reach (the data dir, the config file).
    pub protected: Vec<PathBuf>,
}

impl Default for StoragePolicy {
    fn default() -> Self {
        Self {
            host_volumes: HostVolumes::Server,
            allowed_host_paths: Vec::new(),
            protected: Vec::new(),
        }
    }
}

/// `path` when it is absolute and plain (no `.` or `..`, no doubled slashes kept), else `None`.
pub fn plain_absolute(path: &Path) -> Option<PathBuf> {
    if !path.is_absolute() {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::RootDir => {}
            Component::Normal(p) => out.push(p),
            _ => return None,
        }
    }
    Some(out)
}

/// The allowed folders, for messages.
fn allowed_list(policy: &StoragePolicy) -> String {
    policy
        .allowed_host_paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn not_allowed(message: String) -> SandboxError {
    SandboxError::new(ErrorKind::Forbidden, ErrorCode::HostPathNotAllowed, message)
}

pub fn validate(
    volumes: &[Volume],
    policy: &StoragePolicy,
) -> Result<Vec<VolumeMount>, SandboxError> {
    if volumes.len() > MAX_VOLUMES {
        return Err(SandboxError::invalid(format!(
            "at most {MAX_VOLUMES} volumes per sandbox"
        )));
    }
    let mut names = std::collections::HashSet::new();
    let mut mounts: Vec<VolumeMount> = Vec::with_capacity(volumes.len());
    for v in volumes {
        let name = v.name.trim();
        if name.is_empty() || !names.insert(name.to_string()) {
            return Err(SandboxError::invalid(format!(
                "volume names must be non-empty and unique (got {:?})",
                v.name
            )));
        }
        let target = mount_target(&v.mount_path).map_err(|why| {
            SandboxError::invalid(format!("volume {name}: mountPath {:?} {why}", v.mount_path))
        })?;
        if mounts.iter().any(|m| m.target == target) {
            return Err(SandboxError::invalid(format!(
                "volume {name}: another volume is already mounted at {target}"
            )));
        }
        let sub_path = match v.sub_path.as_deref().filter(|s| !s.is_empty()) {
            Some(s) => Some(relative(s).map_err(|why| {
                SandboxError::invalid(format!("volume {name}: subPath {s:?} {why}"))
            })?),
            None => None,
        };
        let backends = [v.host.is_some(), v.pvc.is_some(), v.ossfs.is_some()];
        if backends.iter().filter(|b| **b).count() != 1 {
            return Err(SandboxError::invalid(format!(
                "volume {name}: exactly one of host, pvc or ossfs is required"
            )));
        }
        let source = if let Some(host) = &v.host {
            VolumeSource::Host(host_source(name, &host.path, sub_path.as_deref(), policy)?)
        } else if let Some(pvc) = &v.pvc {
            let claim = pvc.claim_name.trim();
            if !valid_claim(claim) {
                return Err(SandboxError::invalid(format!(
                    "volume {name}: claimName {claim:?} must be 1-63 letters, digits, '.', '_' or '-', \
                     starting with a letter or digit"
                )));
            }
            VolumeSource::Named {
                claim: claim.to_string(),
                sub_path,
                create_if_missing: pvc.create_if_not_exists,
                delete_on_termination: pvc.delete_on_sandbox_termination,
            }
        } else {
            return Err(SandboxError::new(
                ErrorKind::Invalid,
                ErrorCode::ApiNotSupported,
                format!("volume {name}: ossfs volumes are not supported by Warren"),
            ));
        };
        mounts.push(VolumeMount {
            target,
            read_only: v.read_only,
            source,
        });
    }
    Ok(mounts)
}

/// An absolute, normalised path that is not `/` and not in a reserved place.
fn mount_target(p: &str) -> Result<String, &'static str> {
    if !p.starts_with('/') || p.len() > 4096 || p.contains('\0') {
        return Err("must be an absolute path");
    }
    let mut parts = Vec::new();
    for c in Path::new(p).components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(s) => parts.push(s.to_string_lossy().to_string()),
            Component::ParentDir | Component::Prefix(_) => return Err("must not contain '..'"),
        }
    }
    if parts.is_empty() {
        return Err("must not be '/'");
    }
    let target = format!("/{}", parts.join("/"));
    if RESERVED_TARGETS
        .iter()
        .any(|r| target == *r || target.starts_with(&format!("{r}/")))
    {
        return Err("is reserved (/proc, /sys, /dev, /.warren)");
    }
    Ok(target)
}

/// A relative path without `..`, normalised.
fn relative(p: &str) -> Result<String, &'static str> {
    let mut parts = Vec::new();
    for c in Path::new(p).components() {
        match c {
            Component::CurDir => {}
            Component::Normal(s) => parts.push(s.to_string_lossy().to_string()),
            _ => return Err("must be a relative path without '..'"),
        }
    }
    if parts.is_empty() {
        return Err("is empty");
    }
    Ok(parts.join("/"))
}

fn valid_claim(c: &str) -> bool {
    !c.is_empty()
        && c.len() <= 63
        && c.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && c.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn host_source(
    name: &str,
    path: &str,
    sub_path: Option<&str>,
    policy: &StoragePolicy,
) -> Result<PathBuf, SandboxError> {
    if !path.starts_with('/') {
        return Err(SandboxError::invalid(format!(
            "volume {name}: host.path {path:?} must be absolute"
        )));
    }
    match policy.host_volumes {
        HostVolumes::Server => {}
        HostVolumes::None => {
            return Err(SandboxError::new(
                ErrorKind::Unsupported,
                ErrorCode::ApiNotSupported,
                format!(
                    "volume {name}: this server's runtime mounts no host folders (its sandboxes \
                     run on another host); use a pvc volume"
                ),
            ))
        }
        HostVolumes::Node => return node_source(name, path, sub_path, policy),
    }
    if policy.allowed_host_paths.is_empty() {
        return Err(not_allowed(format!(
            "volume {name}: host folders cannot be mounted on this server (its [storage] \
             allowed_host_paths is empty)"
        )));
    }
    let base = std::fs::canonicalize(path)
        .map_err(|e| SandboxError::invalid(format!("volume {name}: host.path {path}: {e}")))?;
    let allowed = |p: &Path| policy.allowed_host_paths.iter().any(|a| p.starts_with(a));
    if !allowed(&base) {
        return Err(not_allowed(format!(
            "volume {name}: host.path {path} is not under an allowed host path ({})",
            allowed_list(policy)
        )));
    }
    let resolved = match sub_path {
        Some(s) => {
            let joined = base.join(s);
            let r = std::fs::canonicalize(&joined).map_err(|e| {
                SandboxError::invalid(format!("volume {name}: {}: {e}", joined.display()))
            })?;
            // a symlink inside the folder must not lead out of it
            if !r.starts_with(&base) {
                return Err(not_allowed(format!(
                    "volume {name}: subPath {s:?} leads outside {path}"
                )));
            }
            r
        }
        None => base,
    };
    if policy
        .protected
        .iter()
        .any(|p| p.starts_with(&resolved) || resolved.starts_with(p))
    {
        return Err(not_allowed(format!(
            "volume {name}: {} holds or is inside Warren's own data or configuration",
            resolved.display()
        )));
    }
    Ok(resolved)
}

/// A folder of the node that runs the sandbox: checked by name against the allow list (the
/// runtime mounts the allowed folder and has the node resolve the rest safely).
fn node_source(
    name: &str,
    path: &str,
    sub_path: Option<&str>,
    policy: &StoragePolicy,
) -> Result<PathBuf, SandboxError> {
    let mut full = plain_absolute(Path::new(path)).ok_or_else(|| {
        SandboxError::invalid(format!(
            "volume {name}: host.path {path:?} must be absolute, without . or .."
        ))
    })?;
    if let Some(s) = sub_path {
        full.push(s); // already relative and plain
    }
    if policy.allowed_host_paths.is_empty() {
        return Err(not_allowed(format!(
            "volume {name}: host folders cannot be mounted on this server (its [kubernetes] \
             allowed_host_paths is empty)"
        )));
    }
    if !policy
        .allowed_host_paths
        .iter()
        .any(|a| full.starts_with(a))
    {
        return Err(not_allowed(format!(
            "volume {name}: host.path {path} is not under an allowed node folder ({})",
            allowed_list(policy)
        )));
    }
    Ok(full)
}

/// The runtime's name for `tenant`'s named volume `claim`: `<tenant>.<claim>`, the default
/// tenant's under its plain claim (volumes made before tenants keep their names). Tenant names
/// hold no `.`; a default-tenant claim may hold none either, or the default tenant's `alpha.data`
/// would be tenant alpha's `data`. A tenant's own claims may: `alpha.x.y` is
/// still only alpha's.
pub fn volume_name(tenant: &str, claim: &str) -> Result<String, SandboxError> {
    if tenant != warren_store::DEFAULT_TENANT {
        return Ok(format!("{tenant}.{claim}"));
    }
    if claim.contains('.') {
        return Err(SandboxError::invalid(format!(
            "claimName {claim:?}: the default tenant's claim names hold no '.' (a tenant's volumes are kept as <tenant>.<claim>, so a dotted name would be another tenant's)"
        )));
    }
    Ok(claim.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_api::lifecycle::{HostVolume, PvcVolume};

    fn host(name: &str, path: &str, target: &str) -> Volume {
        Volume {
            name: name.into(),
            mount_path: target.into(),
            read_only: false,
            sub_path: None,
            host: Some(HostVolume { path: path.into() }),
            pvc: None,
            ossfs: None,
        }
    }

    fn pvc(name: &str, claim: &str, target: &str) -> Volume {
        Volume {
            host: None,
            pvc: Some(PvcVolume {
                claim_name: claim.into(),
                create_if_not_exists: true,
                delete_on_sandbox_termination: false,
                storage_class: None,
                storage: None,
                access_modes: None,
            }),
            ..host(name, "", target)
        }
    }

    #[test]
    fn node_folders_are_checked_by_name() {
        let policy = StoragePolicy {
            host_volumes: HostVolumes::Node,
            allowed_host_paths: vec!["/srv/shared".into()],
            protected: Vec::new(),
        };
        let one = |path: &str, sub: Option<&str>| {
            let mut v = host("v", path, "/data");
            v.sub_path = sub.map(str::to_string);
            validate(&[v], &policy)
        };
        let ok = one("/srv/shared/team", Some("a")).expect("allowed");
        assert_eq!(
            ok[0].source,
            VolumeSource::Host("/srv/shared/team/a".into())
        );
        assert_eq!(
            one("/srv/sharedx", None)
                .map(drop)
                .expect_err("refused")
                .kind,
            crate::error::ErrorKind::Forbidden
        );
        assert_eq!(
            one("/srv/shared/../etc", None)
                .map(drop)
                .expect_err("refused")
                .kind,
            crate::error::ErrorKind::Invalid
        );
        assert_eq!(
            one("/srv/shared", Some("../x"))
                .map(drop)
                .expect_err("refused")
                .kind,
            crate::error::ErrorKind::Invalid
        );
        let none = StoragePolicy {
            host_volumes: HostVolumes::None,
            ..policy
        };
        let e = validate(&[host("v", "/srv/shared", "/data")], &none).expect_err("refused");
        assert_eq!(e.kind, crate::error::ErrorKind::Unsupported);
        assert_eq!(plain_absolute(Path::new("/a//b/")), Some("/a/b".into()));
        assert_eq!(plain_absolute(Path::new("/a/../b")), None);
        assert_eq!(plain_absolute(Path::new("a/b")), None);
    }

    #[test]
    fn targets() {
        assert_eq!(mount_target("/data//x/./y").as_deref(), Ok("/data/x/y"));
        assert!(mount_target("relative").is_err());
        assert!(mount_target("/").is_err());
        assert!(mount_target("/a/../etc").is_err());
        assert!(mount_target("/proc/x").is_err());
        assert!(mount_target("/.warren").is_err());
        assert!(mount_target("/devices").is_ok());
        assert_eq!(relative("a/./b").as_deref(), Ok("a/b"));
        assert!(relative("../x").is_err());
        assert!(relative("/abs").is_err());
    }

    #[test]
    fn host_paths_need_the_allow_list_and_stay_inside_it() {
        let t = tempfile::tempdir().expect("tmp");
        let allowed = t.path().join("allowed");
        let data = t.path().join("allowed/warren-data");
        std::fs::create_dir_all(allowed.join("a/b")).expect("mkdir");
        std::fs::create_dir_all(&data).expect("mkdir");
        std::os::unix::fs::symlink("/etc", allowed.join("a/escape")).expect("symlink");
        let none = StoragePolicy::default();
        let e = validate(&[host("v", allowed.to_str().expect("utf8"), "/mnt")], &none)
            .expect_err("empty list");
        assert_eq!(e.kind, ErrorKind::Forbidden);
        let policy = StoragePolicy {
            allowed_host_paths: vec![std::fs::canonicalize(&allowed).expect("canon")],
            protected: vec![std::fs::canonicalize(&data).expect("canon")],
            ..StoragePolicy::default()
        };
        let ok = validate(
            &[host(
                "v",
                allowed.join("a").to_str().expect("utf8"),
                "/mnt/a",
            )],
            &policy,
        )
        .expect("allowed");
        assert!(matches!(&ok[0].source, VolumeSource::Host(p) if p.ends_with("allowed/a")));
        let mut sub = host("v", allowed.join("a").to_str().expect("utf8"), "/mnt");
        sub.sub_path = Some("b".into());
        assert!(
            matches!(&validate(&[sub.clone()], &policy).expect("sub")[0].source, VolumeSource::Host(p) if p.ends_with("a/b"))
        );
        sub.sub_path = Some("escape".into());
        assert_eq!(
            validate(&[sub], &policy).expect_err("symlink out").kind,
            ErrorKind::Forbidden
        );
        assert_eq!(
            validate(&[host("v", "/etc", "/mnt")], &policy)
                .expect_err("outside")
                .kind,
            ErrorKind::Forbidden
        );
        // the allowed folder contains the data dir: mounting it would expose the API key
        assert_eq!(
            validate(
                &[host("v", allowed.to_str().expect("utf8"), "/mnt")],
                &policy
            )
            .expect_err("protected")
            .kind,
            ErrorKind::Forbidden
        );
        assert_eq!(
            validate(&[host("v", "/no/such/dir", "/mnt")], &policy)
                .expect_err("missing")
                .kind,
            ErrorKind::Invalid
        );
    }

    #[test]
    fn names_claims_and_backends() {
        let p = StoragePolicy::default();
        let ok = validate(&[pvc("a", "models_1.x", "/m")], &p).expect("pvc");
        assert!(
            matches!(&ok[0].source, VolumeSource::Named { claim, create_if_missing: true, .. } if claim == "models_1.x")
        );
        assert!(validate(&[pvc("a", "-bad", "/m")], &p).is_err());
        assert!(
            validate(&[pvc("a", "ok", "/m"), pvc("a", "ok2", "/n")], &p).is_err(),
            "duplicate name"
        );
        assert!(
            validate(&[pvc("a", "ok", "/m"), pvc("b", "ok2", "/m")], &p).is_err(),
            "duplicate target"
        );
        let mut both = pvc("a", "ok", "/m");
        both.host = Some(HostVolume { path: "/x".into() });
        assert!(validate(&[both], &p).is_err());
        let mut oss = pvc("a", "ok", "/m");
        oss.pvc = None;
        oss.ossfs = Some(serde_json::json!({}));
        assert_eq!(
            validate(&[oss], &p).expect_err("ossfs").code,
            ErrorCode::ApiNotSupported.as_str()
        );
    }
}
