//! Request validation: turns a create request into a `CreatePlan` or a precise 400. Pure functions,
//! tested directly.
//!
//! Why one file: ~270 of its lines are tests that feed whole requests to `create_plan`. The rest is
//! `create_plan` and the per-field checks it calls, kept together so that every rule a create must
//! pass reads in one place.

use std::collections::BTreeMap;

use warren_api::lifecycle::CreateSandboxRequest;
use warren_api::ErrorCode;
use warren_core::{parse_cpu_millis, parse_disk_bytes, parse_memory_bytes, ResourceLimits};

use crate::config::LimitsSection;
use crate::error::{ErrorKind, SandboxError};
use crate::volumes::StoragePolicy;

/// Reserved metadata prefix (as in the reference server).
const RESERVED_PREFIX: &str = "opensandbox.io/";
pub const MIN_TIMEOUT_SECONDS: i64 = 60;
const MAX_ENTRYPOINT_ARGS: usize = 4096;

/// Bounds on what a create may carry besides its body's 1 MiB: every field below is kept in the
/// sandbox's record (rewritten to the state journal at every transition) or handed to `execve`,
/// whose strings Linux caps at 128 KiB each (`MAX_ARG_STRLEN`). A 900 KB `extensions` value or
/// 40,000 variables were accepted and made every transition of that sandbox a megabyte's write.
pub mod bounds {
    /// One argument or environment value, as `execve` takes it.
    pub const MAX_STRING: usize = 128 << 10;
    /// The entrypoint's arguments together, and the environment's `NAME=value`s together.
    pub const MAX_TOTAL: usize = 256 << 10;
    pub const MAX_ENV_VARS: usize = 1024;
    pub const MAX_ENV_NAME: usize = 256;
    pub const MAX_METADATA: usize = 64;
    pub const MAX_EXTENSIONS: usize = 64;
    pub const MAX_EXTENSION_KEY: usize = 256;
    pub const MAX_EXTENSION_VALUE: usize = 4 << 10;
}

#[derive(Debug, Clone, PartialEq)]
pub struct CreatePlan {
    /// The image name; for a restore (`snapshot_id`), filled in from the snapshot by the route.
    pub image: String,
    /// `snapshotId`: restore the file system of that snapshot.
    pub snapshot_id: Option<String>,
    /// Set by the pool manager: a warm sandbox of this pool (hidden until claimed).
    pub warm_pool: Option<String>,
    /// Registry credentials for a runtime that pulls (Docker); refused by the image store.
    pub image_auth: Option<warren_api::lifecycle::ImageAuth>,
    pub volumes: Vec<warren_core::VolumeMount>,
    /// `None`: the image's own Entrypoint + Cmd (store images), else `tail -f /dev/null`.
    pub entrypoint: Option<Vec<String>>,
    pub timeout_seconds: Option<i64>,
    pub limits: ResourceLimits,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub extensions: BTreeMap<String, String>,
    /// `networkPolicy`; `None` means the server's default.
    pub network_policy: Option<warren_egress::NetworkPolicy>,
    /// `credentialProxy.enabled`: HTTPS goes through the credential vault's proxy.
    pub credential_proxy: bool,
    /// `lifecycle.preStart` and `lifecycle.periodic` (see `hooks`).
    pub hooks: crate::hooks::Hooks,
    /// Whose sandbox it is: the caller's tenant (set by the route).
    pub tenant: String,
}

impl CreatePlan {
    /// Makes the sandbox `tenant`'s. Its named volumes are that tenant's: another tenant's
    /// `claimName` is another volume (named by `volumes::volume_name`, so that no name of one
    /// tenant is ever another's). Host folders are the server's, not a tenant's: only the default
    /// tenant (the server's own key, and admins acting for no tenant) mounts them. What the plan
    /// names of stored images is resolved for the tenant afterwards (`stored::Stored::resolve`).
    pub fn set_tenant(&mut self, tenant: &str) -> Result<(), SandboxError> {
        self.tenant = tenant.to_string();
        for v in &mut self.volumes {
            match &mut v.source {
                warren_core::VolumeSource::Named { claim, .. } => {
                    *claim = crate::volumes::volume_name(tenant, claim)?;
                }
                warren_core::VolumeSource::Host(_) if tenant == warren_store::DEFAULT_TENANT => {}
                warren_core::VolumeSource::Host(_) => {
                    return Err(SandboxError::new(
                        ErrorKind::Forbidden,
                        ErrorCode::Forbidden,
                        format!(
                            "volume at {}: host folders are the server's; tenant {tenant} mounts only its own named volumes",
                            v.target
                        ),
                    ))
                }
            }
        }
        Ok(())
    }
}

pub fn create_plan(
    req: CreateSandboxRequest,
    defaults: &LimitsSection,
    max_timeout: Option<i64>,
    storage: &StoragePolicy,
) -> Result<CreatePlan, SandboxError> {
    if req.template_id.is_some() {
        return Err(SandboxError::invalid(
            "templateId cannot be used here (only on POST /sandboxes)",
        ));
    }
    let volumes = crate::volumes::validate(req.volumes.as_deref().unwrap_or_default(), storage)?;
    let network_policy = match &req.network_policy {
        Some(v) => crate::network::parse_policy(v)?,
        None => None,
    };
    let credential_proxy = match &req.credential_proxy {
        None | Some(serde_json::Value::Null) => false,
        Some(v) => match v.get("enabled") {
            Some(serde_json::Value::Bool(b)) => *b,
            None => false,
            Some(_) => {
                return Err(SandboxError::invalid(
                    "credentialProxy.enabled must be true or false",
                ))
            }
        },
    };
    if credential_proxy && network_policy.as_ref().is_none_or(|p| !p.allows_anything()) {
        return Err(SandboxError::invalid(
            "credentialProxy needs a networkPolicy that lets the sandbox reach something",
        ));
    }
    if req.secure_access == Some(true) {
        return Err(unsupported(
            "secureAccess (endpoints are always token-protected on Warren)",
        ));
    }
    let (renewal, hooks) = lifecycle(req.lifecycle.as_ref())?;
    if let Some(p) = &req.platform {
        if p.os != "linux" || !(p.arch == "amd64" || p.arch == "x86_64") {
            return Err(SandboxError::invalid(format!(
                "platform {}/{} is not available on this host (linux/amd64)",
                p.os, p.arch
            )));
        }
    }
    let (uri, image_auth, snapshot_id) = match (req.image, req.snapshot_id) {
        (Some(image), None) => {
            let uri = image.uri.trim().to_string();
            if uri.is_empty() || uri.len() > 255 {
                return Err(SandboxError::invalid(
                    "image.uri must be 1 to 255 characters",
                ));
            }
            (uri, image.auth, None)
        }
        (None, Some(snapshot)) => {
            if snapshot.is_empty() || snapshot.len() > 128 {
                return Err(SandboxError::invalid(
                    "snapshotId must be 1 to 128 characters",
                ));
            }
            (String::new(), None, Some(snapshot))
        }
        (Some(_), Some(_)) => {
            return Err(SandboxError::invalid(
                "give either image or snapshotId, not both",
            ))
        }
        (None, None) => return Err(SandboxError::invalid("image (or snapshotId) is required")),
    };
    // A restore keeps the sandbox up by default (as the reference does), whatever the image says.
    let entrypoint = req.entrypoint.or_else(|| {
        snapshot_id
            .is_some()
            .then(|| vec!["tail".into(), "-f".into(), "/dev/null".into()])
    });
    if let Some(entrypoint) = &entrypoint {
        if entrypoint.is_empty() || entrypoint[0].is_empty() {
            return Err(SandboxError::invalid(
                "entrypoint must have at least one non-empty element",
            ));
        }
        if entrypoint.len() > MAX_ENTRYPOINT_ARGS || entrypoint.iter().any(|a| a.contains('\0')) {
            return Err(SandboxError::invalid(format!(
                "entrypoint has a NUL byte or more than {MAX_ENTRYPOINT_ARGS} arguments"
            )));
        }
        if entrypoint.iter().any(|a| a.len() > bounds::MAX_STRING) {
            return Err(SandboxError::invalid(format!(
                "entrypoint: an argument is longer than {} bytes",
                bounds::MAX_STRING
            )));
        }
        let total: usize = entrypoint.iter().map(|a| a.len() + 1).sum();
        if total > bounds::MAX_TOTAL {
            return Err(SandboxError::invalid(format!(
                "entrypoint: {total} bytes of arguments, at most {} allowed",
                bounds::MAX_TOTAL
            )));
        }
    }
    if let Some(t) = req.timeout {
        if t < MIN_TIMEOUT_SECONDS {
            return Err(SandboxError::invalid(format!(
                "timeout must be at least {MIN_TIMEOUT_SECONDS} seconds, got {t}"
            )));
        }
        if let Some(max) = max_timeout {
            if t > max {
                return Err(SandboxError::invalid(format!(
                    "timeout {t} exceeds the server maximum of {max} seconds"
                )));
            }
        }
    }
    let limits = resource_limits(req.resource_limits.as_ref(), defaults)?;
    let mut env = req.env.unwrap_or_default();
    check_env(&env)?;
    let metadata = req.metadata.unwrap_or_default();
    if metadata.len() > bounds::MAX_METADATA {
        return Err(SandboxError::bad_request(
            ErrorCode::InvalidMetadataLabel,
            format!(
                "metadata: {} labels, at most {} allowed",
                metadata.len(),
                bounds::MAX_METADATA
            ),
        ));
    }
    validate_metadata(metadata.iter().map(|(k, v)| (k.as_str(), Some(v.as_str()))))?;
    let mut extensions = req.extensions.unwrap_or_default();
    check_extensions(&extensions)?;
    if let Some(v) = extensions
        .get(warren_api::desktop::DESKTOP_EXTENSION)
        .filter(|v| !v.eq_ignore_ascii_case("false"))
    {
        // A desktop for GUI agents: execd starts it (see `warren_execd::desktop`); commands find
        // it on DISPLAY unless the create names another.
        let (w, h) = warren_api::desktop::parse_size(v)
            .map_err(|e| SandboxError::invalid(format!("extensions.{e}")))?;
        env.insert(warren_api::desktop::DESKTOP_ENV.into(), format!("{w}x{h}"));
        env.entry("DISPLAY".into())
            .or_insert_with(|| DESKTOP_DISPLAY.into());
    }
    if let Some(v) = extensions.get(warren_api::desktop::BROWSER_EXTENSION) {
        // Chromium with its DevTools endpoint: execd starts it (see `warren_execd::browser`).
        let on = warren_api::desktop::parse_switch(warren_api::desktop::BROWSER_EXTENSION, v)
            .map_err(|e| SandboxError::invalid(format!("extensions.{e}")))?;
        if on {
            env.insert(warren_api::desktop::BROWSER_ENV.into(), "1".into());
        }
    }
    if let Some(seconds) = renewal {
        // The structured successor of the extension: one setting, stored as the extension that
        // renew on access reads (see `proxy`).
        match extensions.get(RENEW_ON_ACCESS) {
            Some(v) if v.parse::<i64>() != Ok(seconds) => {
                return Err(SandboxError::invalid(format!(
                    "lifecycle.renewalPolicy.extendSeconds ({seconds}) and extensions.{RENEW_ON_ACCESS} ({v:?}) disagree: give one, or the same value"
                )))
            }
            _ => {
                extensions.insert(RENEW_ON_ACCESS.to_string(), seconds.to_string());
            }
        }
    }
    Ok(CreatePlan {
        image: uri,
        snapshot_id,
        warm_pool: None,
        image_auth,
        volumes,
        entrypoint,
        timeout_seconds: req.timeout,
        limits,
        env,
        metadata,
        extensions,
        network_policy,
        credential_proxy,
        hooks,
        tenant: warren_store::default_tenant(),
    })
}

/// The display execd's desktop is (`warren_execd::desktop::DISPLAY`).
const DESKTOP_DISPLAY: &str = ":0";

/// Names `execve` takes, values within its bounds, and no more of them than [`bounds`] allows.
pub fn check_env(env: &BTreeMap<String, String>) -> Result<(), SandboxError> {
    if env.len() > bounds::MAX_ENV_VARS {
        return Err(SandboxError::invalid(format!(
            "env: {} variables, at most {} allowed",
            env.len(),
            bounds::MAX_ENV_VARS
        )));
    }
    let mut total = 0;
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(SandboxError::invalid(format!(
                "invalid environment variable name {k:?}"
            )));
        }
        if k.len() > bounds::MAX_ENV_NAME {
            return Err(SandboxError::invalid(format!(
                "env: a variable name is longer than {} bytes",
                bounds::MAX_ENV_NAME
            )));
        }
        if k.len() + 1 + v.len() > bounds::MAX_STRING {
            return Err(SandboxError::invalid(format!(
                "env: {k} is longer than {} bytes",
                bounds::MAX_STRING
            )));
        }
        total += k.len() + 1 + v.len() + 1;
    }
    if total > bounds::MAX_TOTAL {
        return Err(SandboxError::invalid(format!(
            "env: {total} bytes of variables, at most {} allowed",
            bounds::MAX_TOTAL
        )));
    }
    Ok(())
}

fn check_extensions(extensions: &BTreeMap<String, String>) -> Result<(), SandboxError> {
    if extensions.len() > bounds::MAX_EXTENSIONS {
        return Err(SandboxError::invalid(format!(
            "extensions: {} entries, at most {} allowed",
            extensions.len(),
            bounds::MAX_EXTENSIONS
        )));
    }
    for (k, v) in extensions {
        if k.len() > bounds::MAX_EXTENSION_KEY || v.len() > bounds::MAX_EXTENSION_VALUE {
            return Err(SandboxError::invalid(format!(
                "extensions: a key is at most {} bytes and a value at most {} ({:?} is {} and {})",
                bounds::MAX_EXTENSION_KEY,
                bounds::MAX_EXTENSION_VALUE,
                k.chars().take(40).collect::<String>(),
                k.len(),
                v.len()
            )));
        }
    }
    if let Some(v) = extensions.get(RENEW_ON_ACCESS) {
        if !v.parse::<i64>().is_ok_and(|s| (300..=86_400).contains(&s)) {
            return Err(SandboxError::invalid(format!(
                "extensions.{RENEW_ON_ACCESS}: {v:?} is not a whole number of seconds from 300 to 86400"
            )));
        }
    }
    Ok(())
}

/// Reads `lifecycle`: the renew-on-access window of `renewalPolicy` (OSEP-0009), if given, and
/// the hooks (`preStart`, `periodic`) and the idle policy. A field Warren does not know is
/// refused by name, never ignored.
fn lifecycle(
    v: Option<&serde_json::Value>,
) -> Result<(Option<i64>, crate::hooks::Hooks), SandboxError> {
    let obj = match v {
        None | Some(serde_json::Value::Null) => return Ok((None, Default::default())),
        Some(serde_json::Value::Object(o)) => o,
        Some(_) => return Err(SandboxError::invalid("lifecycle must be a JSON object")),
    };
    let mut renewal = None;
    for (key, value) in obj {
        match key.as_str() {
            "renewalPolicy" => renewal = renewal_policy(value)?,
            "preStart" | "periodic" | "idlePolicy" => {}
            other => {
                return Err(SandboxError::invalid(format!(
                    "lifecycle.{other:?} is not a lifecycle field (known: renewalPolicy, idlePolicy, preStart, periodic)"
                )))
            }
        }
    }
    let mut hooks = crate::hooks::parse(obj.get("preStart"), obj.get("periodic"))?;
    if let Some(v) = obj.get("idlePolicy") {
        hooks.idle = crate::idle::parse(v)?;
    }
    Ok((renewal, hooks))
}

fn renewal_policy(v: &serde_json::Value) -> Result<Option<i64>, SandboxError> {
    let bad = || {
        SandboxError::invalid(
            "lifecycle.renewalPolicy must be {\"extendSeconds\": a whole number of seconds from 300 to 86400}",
        )
    };
    let obj = match v {
        serde_json::Value::Null => return Ok(None),
        serde_json::Value::Object(o) => o,
        _ => return Err(bad()),
    };
    if obj.keys().any(|k| k != "extendSeconds") {
        return Err(bad());
    }
    obj.get("extendSeconds")
        .and_then(serde_json::Value::as_i64)
        .filter(|s| (300..=86_400).contains(s))
        .map(Some)
        .ok_or_else(bad)
}

/// OSEP-0009 renew on access: proxied traffic pushes the sandbox's expiry to this many seconds
/// from now (see `proxy`).
pub const RENEW_ON_ACCESS: &str = "access.renew.extend.seconds";

fn unsupported(what: &str) -> SandboxError {
    SandboxError::bad_request(
        ErrorCode::ApiNotSupported,
        format!("{what} is not supported by this Warren server"),
    )
}

pub fn resource_limits(
    map: Option<&BTreeMap<String, String>>,
    defaults: &LimitsSection,
) -> Result<ResourceLimits, SandboxError> {
    let bad = |e: warren_core::QuantityError| SandboxError::invalid(e.to_string());
    let mut limits = defaults.defaults().map_err(bad)?;
    for (k, v) in map.into_iter().flatten() {
        match k.as_str() {
            "cpu" => limits.cpu_millis = Some(parse_cpu_millis(v).map_err(bad)?),
            "memory" => limits.memory_bytes = Some(parse_memory_bytes(v).map_err(bad)?),
            "pids" => {
                limits.pids = v
                    .parse::<u64>()
                    .ok()
                    .filter(|p| (16..=1 << 22).contains(p))
                    .ok_or_else(|| {
                        SandboxError::invalid(format!(
                            "invalid pids limit {v:?}: expected an integer from 16 to 4194304"
                        ))
                    })?
            }
            "gpu" | "nvidia.com/gpu" => return Err(unsupported("gpu resources")),
            "ephemeral-storage" => limits.disk_bytes = Some(parse_disk_bytes(v).map_err(bad)?),
            other => {
                return Err(SandboxError::invalid(format!(
                    "unknown resource {other:?} (known: cpu, memory, ephemeral-storage, pids)"
                )))
            }
        }
    }
    Ok(limits)
}

/// Kubernetes label rules: optional DNS-subdomain prefix and `/`, a name of ≤63 chars of
/// `[A-Za-z0-9._-]` starting and ending alphanumeric; values the same charset, may be empty.
pub fn validate_metadata<'a>(
    entries: impl Iterator<Item = (&'a str, Option<&'a str>)>,
) -> Result<(), SandboxError> {
    let bad = |m: String| SandboxError::bad_request(ErrorCode::InvalidMetadataLabel, m);
    for (key, value) in entries {
        if key.starts_with(RESERVED_PREFIX) {
            return Err(bad(format!(
                "metadata key {key:?} uses the reserved prefix {RESERVED_PREFIX}"
            )));
        }
        let (prefix, name) = match key.rsplit_once('/') {
            Some((p, n)) => (Some(p), n),
            None => (None, key),
        };
        if let Some(p) = prefix {
            let ok = !p.is_empty()
                && p.len() <= 253
                && p.split('.').all(|part| {
                    !part.is_empty()
                        && part.len() <= 63
                        && label_chars(part, false)
                        && alnum_ends(part)
                });
            if !ok {
                return Err(bad(format!("metadata key {key:?} has an invalid prefix")));
            }
        }
        if name.is_empty() || name.len() > 63 || !label_chars(name, true) || !alnum_ends(name) {
            return Err(bad(format!("metadata key {key:?} is not a valid label name (≤63 of A-Z a-z 0-9 . _ -, alphanumeric at both ends)")));
        }
        if let Some(v) = value {
            if v.len() > 63 || (!v.is_empty() && (!label_chars(v, true) || !alnum_ends(v))) {
                return Err(bad(format!(
                    "metadata value {v:?} for {key:?} is not a valid label value"
                )));
            }
        }
    }
    Ok(())
}

fn label_chars(s: &str, allow_underscore_dot: bool) -> bool {
    s.bytes().all(|b| {
        b.is_ascii_alphanumeric() || b == b'-' || (allow_underscore_dot && (b == b'_' || b == b'.'))
    })
}

fn alnum_ends(s: &str) -> bool {
    s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_api::lifecycle::ImageSpec;

    fn req() -> CreateSandboxRequest {
        CreateSandboxRequest {
            image: Some(ImageSpec {
                uri: "host".into(),
                auth: None,
            }),
            timeout: Some(600),
            resource_limits: Some(
                [("cpu".into(), "1".into()), ("memory".into(), "2Gi".into())]
                    .into_iter()
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn plan_with(
        lifecycle: serde_json::Value,
        ext: Option<&str>,
    ) -> Result<CreatePlan, SandboxError> {
        let mut r = req();
        r.lifecycle = Some(lifecycle);
        r.extensions = ext.map(|v| [(RENEW_ON_ACCESS.to_string(), v.to_string())].into());
        create_plan(
            r,
            &LimitsSection::default(),
            None,
            &StoragePolicy::default(),
        )
    }

    #[test]
    fn lifecycle_fields_are_served_or_refused_by_name() {
        use serde_json::json;
        let plan = plan_with(json!({"renewalPolicy": {"extendSeconds": 600}}), None).expect("plan");
        assert_eq!(plan.extensions[RENEW_ON_ACCESS], "600");
        let plan = plan_with(
            json!({"renewalPolicy": {"extendSeconds": 600}}),
            Some("600"),
        );
        assert!(plan.is_ok(), "the same value twice");
        let e = plan_with(
            json!({"renewalPolicy": {"extendSeconds": 600}}),
            Some("900"),
        )
        .expect_err("disagree");
        assert!(e.to_string().contains("disagree"), "{}", e.to_string());
        for bad in [
            json!({"renewalPolicy": {"extendSeconds": 299}}),
            json!({"renewalPolicy": {"extendSeconds": 86_401}}),
            json!({"renewalPolicy": {"extendSeconds": "600"}}),
            json!({"renewalPolicy": {"extendSeconds": 600, "jitter": 1}}),
            json!({"renewalPolicy": {}}),
            json!({"renewal": {}}),
            json!([]),
        ] {
            let e = plan_with(bad.clone(), None).expect_err("refused");
            assert_eq!(e.kind, ErrorKind::Invalid, "{bad}");
        }
        let plan = plan_with(
            json!({"idlePolicy": {"idleTimeoutSeconds": 60, "onIdle": "pause"}}),
            None,
        )
        .expect("idle");
        assert_eq!(
            plan.hooks.idle.expect("idle").idle_timeout_seconds,
            Some(60)
        );
        let e = plan_with(json!({"idlePolicy": {"idleTimeoutSeconds": 60}}), None)
            .expect_err("refused");
        assert!(
            e.to_string().contains("lifecycle.idlePolicy.onIdle"),
            "{}",
            e.to_string()
        );
        let plan = plan_with(
            json!({"preStart": {"command": ["true"]},
                   "periodic": [{"name": "a", "schedule": "* * * * *", "command": ["true"]}]}),
            None,
        )
        .expect("hooks");
        assert!(plan.hooks.pre_start.is_some() && plan.hooks.periodic.len() == 1);
        let e = plan_with(json!({"preStart": {"command": []}}), None).expect_err("refused");
        assert!(
            e.to_string().contains("lifecycle.preStart.command"),
            "{}",
            e.to_string()
        );
        assert!(plan_with(json!({}), None).is_ok());
        assert!(plan_with(json!({"idlePolicy": null}), None).is_ok());
    }

    #[test]
    fn sdk_default_request_is_accepted() {
        let plan = create_plan(
            req(),
            &LimitsSection::default(),
            None,
            &StoragePolicy::default(),
        )
        .expect("plan");
        assert_eq!(plan.limits.cpu_millis, Some(1000));
        assert_eq!(plan.limits.memory_bytes, Some(2 << 30));
        assert_eq!(plan.limits.pids, 4096);
        assert_eq!(plan.limits.disk_bytes, None, "unbounded unless asked");
        assert_eq!(plan.entrypoint, None, "decided at create, from the image");
    }

    #[test]
    fn ephemeral_storage_is_the_disk_bound() {
        let with = |v: &str| {
            let mut r = req();
            r.resource_limits
                .as_mut()
                .expect("limits")
                .insert("ephemeral-storage".into(), v.into());
            create_plan(
                r,
                &LimitsSection::default(),
                None,
                &StoragePolicy::default(),
            )
        };
        assert_eq!(
            with("10Gi").expect("plan").limits.disk_bytes,
            Some(10 << 30)
        );
        for bad in ["banana", "1Mi", ""] {
            let err = with(bad).expect_err("must be refused");
            assert_eq!(err.kind, crate::error::ErrorKind::Invalid);
            assert!(
                err.to_string().contains("ephemeral-storage"),
                "{}",
                err.to_string()
            );
        }
    }

    #[test]
    fn bad_inputs_are_400s() {
        let mut r = req();
        r.resource_limits = Some([("memory".into(), "lots".into())].into_iter().collect());
        assert_eq!(
            create_plan(
                r,
                &LimitsSection::default(),
                None,
                &StoragePolicy::default()
            )
            .expect_err("must be refused")
            .kind,
            crate::error::ErrorKind::Invalid
        );
        let mut r = req();
        r.timeout = Some(5);
        assert!(create_plan(
            r,
            &LimitsSection::default(),
            None,
            &StoragePolicy::default()
        )
        .is_err());
        let mut r = req();
        r.metadata = Some([("bad key!".into(), "v".into())].into_iter().collect());
        assert_eq!(
            create_plan(
                r,
                &LimitsSection::default(),
                None,
                &StoragePolicy::default()
            )
            .expect_err("must be refused")
            .code,
            "SANDBOX::INVALID_METADATA_LABEL"
        );
        let mut r = req();
        r.entrypoint = Some(vec![]);
        assert!(create_plan(
            r,
            &LimitsSection::default(),
            None,
            &StoragePolicy::default()
        )
        .is_err());
        let mut r = req();
        r.image = None;
        assert!(create_plan(
            r,
            &LimitsSection::default(),
            None,
            &StoragePolicy::default()
        )
        .is_err());
    }

    #[test]
    fn oversized_fields_are_400s_naming_the_limit() {
        let refused = |r: CreateSandboxRequest| {
            create_plan(
                r,
                &LimitsSection::default(),
                None,
                &StoragePolicy::default(),
            )
            .expect_err("must be refused")
        };
        let accepted = |r: CreateSandboxRequest| {
            create_plan(
                r,
                &LimitsSection::default(),
                None,
                &StoragePolicy::default(),
            )
            .expect("accepted")
        };
        let many = |n: usize, v: &str| -> BTreeMap<String, String> {
            (0..n).map(|i| (format!("k{i}"), v.to_string())).collect()
        };
        let mut r = req();
        r.env = Some(many(40_000, "x"));
        let e = refused(r);
        assert_eq!(e.kind, crate::error::ErrorKind::Invalid);
        assert!(e.to_string().contains("at most 1024"), "{}", e.to_string());
        let mut r = req();
        r.env = Some(many(1, &"x".repeat(200 << 10)));
        assert!(refused(r).to_string().contains("longer than 131072"));
        let mut r = req();
        r.env = Some(many(10, &"x".repeat(100 << 10)));
        assert!(refused(r).to_string().contains("at most 262144"));
        let mut r = req();
        r.env = Some(many(1024, "value"));
        accepted(r);
        let mut r = req();
        r.extensions = Some(many(1, &"x".repeat(900_000)));
        let e = refused(r);
        assert!(
            e.to_string().starts_with("extensions:"),
            "{}",
            e.to_string()
        );
        let mut r = req();
        r.extensions = Some(many(65, "x"));
        assert!(refused(r).to_string().contains("at most 64"));
        let mut r = req();
        r.metadata = Some(many(65, "v"));
        assert_eq!(refused(r).code, "SANDBOX::INVALID_METADATA_LABEL");
        let mut r = req();
        r.entrypoint = Some(vec!["sh".into(), "x".repeat(200 << 10)]);
        assert!(refused(r).to_string().contains("longer than 131072"));
        let mut r = req();
        r.entrypoint = Some((0..4000).map(|_| "y".repeat(100)).collect());
        assert!(refused(r).to_string().contains("at most 262144"));
    }

    #[test]
    fn metadata_label_rules() {
        let ok = |k: &str, v: &str| validate_metadata([(k, Some(v))].into_iter()).is_ok();
        assert!(ok("project", "Apollo"));
        assert!(ok("example.com/team", "a-b_c.d"));
        assert!(ok("k", ""));
        assert!(!ok("opensandbox.io/x", "v"));
        assert!(!ok("-k", "v"));
        assert!(!ok("k", "v!"));
        assert!(!ok(&"k".repeat(64), "v"));
        assert!(!ok("k", &"v".repeat(64)));
        assert!(!ok("/k", "v"));
    }
}
