//! A create request checked and normalised as the reference does it (defaults filled in, so a
//! session's state echoes what it really is), and turned into the helper's mounts and the
//! session's environment.

use axum::http::StatusCode;
use warren_api::isolated::{BindMount, CreateSessionRequest, EnvPassthrough, OverlaySpec};

use super::channel::{mount_path_problem, Mount};
use crate::error::{code, ApiError};

/// Mounts a session takes at most (workspace and overlays together).
pub const MAX_MOUNTS: usize = 16;
/// Where `extra_writable` and `binds` may come from (and, resolved, stay inside).
pub const ALLOWLIST: [&str; 4] = ["/workspace", "/mnt", "/media", "/data"];
/// Variables a session does not inherit unless asked (`env_passthrough` omitted), any case.
const BLACKLIST_SUFFIXES: [&str; 4] = ["_API_KEY", "_TOKEN", "_SECRET", "_PASSWORD"];
const BLACKLIST_PREFIXES: [&str; 5] = ["AWS_", "ALI_", "ALIYUN_", "K8S_", "KUBE_"];

/// A create request, valid and with every default filled in.
#[derive(Debug, Clone)]
pub struct Options {
    pub profile: String,
    pub overlays: Vec<OverlaySpec>,
    pub extra_writable: Vec<String>,
    pub binds: Vec<BindMount>,
    pub share_net: bool,
    pub env_passthrough: EnvPassthrough,
    pub uid: u32,
    pub gid: u32,
    pub uid_mode: String,
    pub idle_timeout_seconds: i64,
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_body(message)
}

/// See [`mount_path_problem`].
fn check_path(what: &str, path: &str) -> Result<(), ApiError> {
    match mount_path_problem(path) {
        Some(why) => Err(bad(format!("{what} {path:?} {why}"))),
        None => Ok(()),
    }
}

/// `path` resolved (symlinks followed: what is mounted is what was checked) and inside the
/// allowlist.
fn allowed(what: &str, path: &str) -> Result<String, ApiError> {
    check_path(what, path)?;
    let real = std::fs::canonicalize(path)
        .map_err(|_| bad(format!("{what} {path:?} must be an existing path")))?;
    if !ALLOWLIST.iter().any(|root| real.starts_with(root)) {
        return Err(bad(format!(
            "{what} {path:?} not in allowlist ({})",
            ALLOWLIST.join(", ")
        )));
    }
    let real = real.to_string_lossy().into_owned();
    check_path(what, &real)?;
    Ok(real)
}

pub fn normalize(req: CreateSessionRequest) -> Result<Options, ApiError> {
    let profile = req.profile.unwrap_or_else(|| "strict".into());
    if !matches!(profile.as_str(), "strict" | "balanced") {
        return Err(bad(format!(
            "unknown isolation profile {profile:?} (strict or balanced)"
        )));
    }
    let mut overlays: Vec<OverlaySpec> = Vec::new();
    if let Some(ws) = req.workspace {
        overlays.push(OverlaySpec {
            path: ws.path,
            mode: ws.mode,
            persist: None,
        });
    }
    overlays.extend(req.overlays.unwrap_or_default());
    if overlays.is_empty() {
        return Err(bad("workspace or overlays is required"));
    }
    if overlays.len() > MAX_MOUNTS {
        return Err(bad(format!("at most {MAX_MOUNTS} mounts are allowed")));
    }
    for o in overlays.iter_mut() {
        check_path("mount path", &o.path)?;
        let mode = o.mode.clone().unwrap_or_else(|| "overlay".into());
        if !matches!(mode.as_str(), "rw" | "ro" | "overlay") {
            return Err(bad(format!(
                "unknown mode {mode:?} for {} (rw, ro or overlay)",
                o.path
            )));
        }
        if mode != "overlay" && o.persist.is_some() {
            return Err(bad("persist applies only to mode \"overlay\""));
        }
        if mode == "overlay" {
            o.persist = Some(o.persist.unwrap_or(true));
        }
        o.mode = Some(mode);
    }
    let mut seen = std::collections::HashSet::new();
    for o in &overlays {
        if !seen.insert(o.path.clone()) {
            return Err(bad(format!("duplicate mount path {}", o.path)));
        }
    }
    let extra_writable = req
        .extra_writable
        .unwrap_or_default()
        .iter()
        .map(|p| allowed("extra_writable", p))
        .collect::<Result<Vec<_>, _>>()?;
    let binds = req
        .binds
        .unwrap_or_default()
        .into_iter()
        .map(|b| {
            let source = allowed("bind source", &b.source)?;
            let dest = b.dest.unwrap_or_else(|| b.source.clone());
            check_path("bind dest", &dest)?;
            Ok(BindMount {
                source,
                dest: Some(dest),
                readonly: Some(b.readonly.unwrap_or(false)),
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let env_passthrough = match req.env_passthrough {
        None
        | Some(EnvPassthrough {
            mode: None,
            keys: _,
        }) => EnvPassthrough {
            mode: Some("deny".into()),
            keys: Some(Vec::new()),
        },
        Some(EnvPassthrough {
            mode: Some(mode),
            keys,
        }) => {
            if !matches!(mode.as_str(), "allow" | "deny") {
                return Err(bad(format!(
                    "unknown env_passthrough mode {mode:?} (allow or deny)"
                )));
            }
            EnvPassthrough {
                mode: Some(mode),
                keys: Some(keys.unwrap_or_default()),
            }
        }
    };
    let uid_mode = req.uid_mode.unwrap_or_else(|| "setpriv".into());
    match uid_mode.as_str() {
        "setpriv" => {}
        "userns" => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code::NOT_SUPPORTED,
                "uid_mode \"userns\" is not available: sessions take their identity as setpriv \
                 does (the sandbox is already a user namespace of its own)",
            ))
        }
        other => {
            return Err(bad(format!(
                "unknown uid_mode {other:?} (setpriv or userns)"
            )))
        }
    }
    let idle_timeout_seconds = req.idle_timeout_seconds.unwrap_or(0);
    if idle_timeout_seconds < 0 {
        return Err(bad("idle_timeout_seconds cannot be negative"));
    }
    // SAFETY: getuid/getgid cannot fail.
    let (own_uid, own_gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let (uid, gid) = (req.uid.unwrap_or(own_uid), req.gid.unwrap_or(own_gid));
    for (what, id, map) in [
        ("uid", uid, "/proc/self/uid_map"),
        ("gid", gid, "/proc/self/gid_map"),
    ] {
        if !mapped(id, map) {
            return Err(bad(format!(
                "{what} {id} is not an id of this sandbox (see {map})"
            )));
        }
    }
    Ok(Options {
        profile,
        overlays,
        extra_writable,
        binds,
        share_net: req.share_net.unwrap_or(true),
        env_passthrough,
        uid,
        gid,
        uid_mode,
        idle_timeout_seconds,
    })
}

impl Options {
    /// The helper's mounts, in order: overlays, then extra writable paths, then binds.
    pub fn mounts(&self) -> Vec<Mount> {
        let mut mounts: Vec<Mount> = self
            .overlays
            .iter()
            .map(|o| {
                // Mounted where the path leads (the helper takes canonical paths only).
                let path = std::fs::canonicalize(&o.path)
                    .ok()
                    .and_then(|p| p.to_str().map(str::to_owned))
                    .unwrap_or_else(|| o.path.clone());
                match o.mode.as_deref() {
                    Some("rw") => Mount::Writable { path },
                    Some("ro") => Mount::ReadOnly { path },
                    _ => Mount::Overlay { path },
                }
            })
            .collect();
        mounts.extend(
            self.extra_writable
                .iter()
                .map(|p| Mount::Writable { path: p.clone() }),
        );
        mounts.extend(self.binds.iter().map(|b| Mount::Bind {
            source: b.source.clone(),
            dest: b.dest.clone().unwrap_or_else(|| b.source.clone()),
            readonly: b.readonly.unwrap_or(false),
        }));
        mounts
    }

    /// The session's environment, from execd's own (the sandbox's).
    pub fn env(&self, base: impl Iterator<Item = (String, String)>) -> Vec<String> {
        let keys = self.env_passthrough.keys.clone().unwrap_or_default();
        let allow = self.env_passthrough.mode.as_deref() == Some("allow");
        base.filter(|(k, _)| {
            if allow {
                keys.contains(k)
            } else if keys.is_empty() {
                !blacklisted(k)
            } else {
                !keys.contains(k)
            }
        })
        .map(|(k, v)| format!("{k}={v}"))
        .collect()
    }

    /// Where runs start: the first mount.
    pub fn workdir(&self) -> &str {
        &self.overlays[0].path
    }
}

/// Whether `id` is one of this process's user namespace (`u32::MAX` never is: to setresuid it
/// means "unchanged").
fn mapped(id: u32, map_file: &str) -> bool {
    if id == u32::MAX {
        return false;
    }
    let Ok(map) = std::fs::read_to_string(map_file) else {
        return true;
    };
    map.lines().any(|l| {
        let f: Vec<u64> = l
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        matches!(f[..], [inner, _, count] if (inner..inner + count).contains(&u64::from(id)))
    })
}

fn blacklisted(key: &str) -> bool {
    let upper = key.to_ascii_uppercase();
    BLACKLIST_SUFFIXES.iter().any(|s| upper.ends_with(s))
        || BLACKLIST_PREFIXES.iter().any(|p| upper.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_api::isolated::WorkspaceSpec;

    fn ws(path: &str) -> CreateSessionRequest {
        CreateSessionRequest {
            workspace: Some(WorkspaceSpec {
                path: path.into(),
                mode: None,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_are_filled_in() {
        let o = normalize(ws("/workspace")).expect("valid");
        assert_eq!(o.profile, "strict");
        assert_eq!(o.overlays[0].mode.as_deref(), Some("overlay"));
        assert_eq!(o.overlays[0].persist, Some(true));
        assert_eq!(o.uid_mode, "setpriv");
        assert!(o.share_net);
        assert_eq!(o.env_passthrough.mode.as_deref(), Some("deny"));
        assert_eq!(
            o.mounts(),
            vec![Mount::Overlay {
                path: "/workspace".into()
            }]
        );
    }

    #[test]
    fn refuses_what_the_reference_refuses_and_what_cannot_be_mounted() {
        for path in [
            "workspace",
            "/a/",
            "/a/../b",
            "/a/./b",
            "//a",
            "/",
            "/proc",
            "/proc/sys",
            "/dev/x",
            "/sys",
            "/a,b",
            "/a:b",
        ] {
            let err = normalize(ws(path)).expect_err(path);
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{path}");
        }
        assert!(normalize(CreateSessionRequest::default()).is_err());
        let mut dup = ws("/w");
        dup.overlays = Some(vec![OverlaySpec {
            path: "/w".into(),
            mode: None,
            persist: None,
        }]);
        assert!(normalize(dup).is_err());
        let mut many = ws("/w");
        many.overlays = Some(
            (0..MAX_MOUNTS)
                .map(|i| OverlaySpec {
                    path: format!("/o{i}"),
                    mode: None,
                    persist: None,
                })
                .collect(),
        );
        assert!(normalize(many).is_err());
        let mut persist = ws("/w");
        persist.workspace.as_mut().expect("ws").mode = Some("rw".into());
        persist.overlays = Some(vec![OverlaySpec {
            path: "/x".into(),
            mode: Some("rw".into()),
            persist: Some(true),
        }]);
        assert!(normalize(persist).is_err());
        let mut outside = ws("/w");
        outside.extra_writable = Some(vec!["/etc".into()]);
        assert!(normalize(outside).is_err());
        let mut minus_one = ws("/w");
        minus_one.uid = Some(u32::MAX);
        assert!(
            normalize(minus_one).is_err(),
            "-1 would leave setresuid unchanged"
        );
        let mut userns = ws("/w");
        userns.uid_mode = Some("userns".into());
        assert_eq!(
            normalize(userns).expect_err("userns").status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    #[test]
    fn environment_passthrough() {
        let base = || {
            [
                ("PATH", "/bin"),
                ("OPENAI_API_KEY", "k"),
                ("github_token", "t"),
                ("AWS_REGION", "r"),
                ("HOME", "/root"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
        };
        let o = normalize(ws("/w")).expect("valid");
        assert_eq!(o.env(base()), vec!["PATH=/bin", "HOME=/root"]);
        let mut allow = ws("/w");
        allow.env_passthrough = Some(EnvPassthrough {
            mode: Some("allow".into()),
            keys: Some(vec!["AWS_REGION".into()]),
        });
        assert_eq!(
            normalize(allow).expect("valid").env(base()),
            vec!["AWS_REGION=r"]
        );
        let mut deny = ws("/w");
        deny.env_passthrough = Some(EnvPassthrough {
            mode: Some("deny".into()),
            keys: Some(vec!["HOME".into()]),
        });
        assert_eq!(
            normalize(deny).expect("valid").env(base()).len(),
            4,
            "deny with keys removes those keys only"
        );
    }
}
