//! The policy and credential-vault calls, as the lifecycle API and a sandbox's 18080 surface
//! make them: a method and a body in, a status and a JSON answer out, over the sandbox's
//! [`Network`] and egress policy.

use axum::http::{Method, StatusCode};
use warren_api::ErrorCode;

use crate::error::{ErrorKind, SandboxError};
use crate::network::{parse_policy, parse_rules, parse_targets, Network, PolicyStatus};
use crate::sandboxes::Sandboxes;

/// A JSON body that may be empty.
fn body_json(body: &[u8]) -> Result<serde_json::Value, SandboxError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(serde_json::Value::Null);
    }
    serde_json::from_slice(body)
        .map_err(|e| SandboxError::invalid(format!("invalid JSON body: {e}")))
}

/// One call on a sandbox's policy: `GET`, `PUT`/`POST` (replace; an empty body or `null` goes back
/// to the server's default), `PATCH` (merge rules), `DELETE` (remove rules by target).
pub async fn policy_call(
    sandboxes: &Sandboxes,
    id: &str,
    method: &Method,
    body: &[u8],
) -> Result<PolicyStatus, SandboxError> {
    let policy = match *method {
        Method::GET => sandboxes.network_policy(id)?,
        Method::PUT | Method::POST => {
            let new = parse_policy(&body_json(body)?)?;
            let fallback = sandboxes.default_network_policy();
            sandboxes
                .update_network_policy(id, |p| *p = new.unwrap_or(fallback))
                .await?
        }
        Method::PATCH => {
            let rules = parse_rules(&body_json(body)?)?;
            sandboxes
                .update_network_policy(id, |p| p.merge(rules))
                .await?
        }
        Method::DELETE => {
            let targets = parse_targets(&body_json(body)?)?;
            sandboxes
                .update_network_policy(id, |p| p.remove(&targets))
                .await?
        }
        _ => {
            return Err(SandboxError::new(
                ErrorKind::MethodNotAllowed,
                ErrorCode::InvalidParameter,
                "use GET, PUT, POST, PATCH or DELETE",
            ))
        }
    };
    Ok(PolicyStatus::of(policy))
}

/// Which API a vault call came through: the two agree on what the vault holds and differ in codes,
/// as the protocol's two specs do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VaultSurface {
    /// Port 18080, the reference sidecar's API: `POST` replaces a vault, a stale revision is 409,
    /// a sandbox without the credential proxy is 412, errors are plain text.
    Sidecar,
    /// `/sandboxes/{id}/credential-vault` on the lifecycle API: `POST` only creates (409 over an
    /// existing vault), a stale revision is 412, reading a sandbox without a vault shows an empty
    /// one, and the first create starts the credential proxy (see
    /// `Sandboxes::enable_credential_proxy`).
    Lifecycle,
}

/// The credential vault API: `/credential-vault` (POST creates, GET, PATCH, DELETE) and
/// `/credential-vault/credentials[/{name}]`, `/credential-vault/bindings[/{name}]`, on either
/// [`VaultSurface`]. Answers only sanitized state.
pub async fn vault_call(
    network: &Network,
    id: &str,
    method: &Method,
    sub: &str,
    body: &[u8],
    surface: VaultSurface,
) -> Result<(StatusCode, Option<serde_json::Value>), SandboxError> {
    use warren_egress::vault::{Vault, VaultError};
    let lifecycle = surface == VaultSurface::Lifecycle;
    let parts: Vec<&str> = sub.split('/').filter(|p| !p.is_empty()).collect();
    let proxy_on = network
        .started()
        .is_some_and(|e| e.has_credential_proxy(id));
    if lifecycle && !proxy_on && parts.is_empty() {
        // No vault was ever possible here: reads show an empty one, a delete has nothing to do.
        match *method {
            Method::GET => return Ok((StatusCode::OK, Some(Vault::default().state_json()))),
            Method::DELETE => return Ok((StatusCode::NO_CONTENT, None)),
            _ => {}
        }
    }
    let not_enabled = |message: String| {
        SandboxError::new(
            ErrorKind::PreconditionFailed,
            ErrorCode::VaultNotEnabled,
            message,
        )
    };
    let Some(egress) = network.started() else {
        return Err(not_enabled(
            "the credential proxy is not running for this sandbox".to_string(),
        ));
    };
    let json = || -> Result<serde_json::Value, SandboxError> { body_json(body) };
    let result = match (method.clone(), parts.as_slice()) {
        (Method::POST, []) | (Method::PUT, []) => {
            let v = Vault::create(&json()?);
            egress.with_vault(id, move |slot| {
                let v = v?;
                if lifecycle && slot.is_some() {
                    return Err(VaultError::Exists);
                }
                let state = v.state_json();
                *slot = Some(v);
                Ok((StatusCode::CREATED, Some(state)))
            })
        }
        (Method::PATCH, []) if lifecycle => {
            let b = json()?;
            egress.with_vault(id, move |slot| match slot {
                Some(v) => {
                    v.patch(&b)?;
                    Ok((StatusCode::OK, Some(v.state_json())))
                }
                None => Err(VaultError::NotFound("credential vault".into())),
            })
        }
        (Method::GET, []) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(
                    slot.as_ref()
                        .map(|v| v.state_json())
                        .unwrap_or_else(|| Vault::default().state_json()),
                ),
            ))
        }),
        (Method::PATCH, []) => {
            let b = json()?;
            egress.with_vault(id, move |slot| {
                let v = slot.get_or_insert_with(Vault::default);
                v.patch(&b)?;
                Ok((StatusCode::OK, Some(v.state_json())))
            })
        }
        (Method::DELETE, []) => egress.with_vault(id, |slot| {
            *slot = None;
            Ok((StatusCode::NO_CONTENT, None))
        }),
        (Method::GET, ["credentials"]) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(slot.clone().unwrap_or_default().credentials_json()),
            ))
        }),
        (Method::GET, ["bindings"]) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(slot.clone().unwrap_or_default().bindings_json()),
            ))
        }),
        (Method::GET, ["credentials", name]) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(slot.clone().unwrap_or_default().credential_json(name)?),
            ))
        }),
        (Method::GET, ["bindings", name]) => egress.with_vault(id, |slot| {
            Ok((
                StatusCode::OK,
                Some(slot.clone().unwrap_or_default().binding_json(name)?),
            ))
        }),
        _ => {
            return Err(SandboxError::new(
                ErrorKind::NotFound,
                ErrorCode::VaultNotFound,
                format!("no credential-vault route {method} /{sub}"),
            ))
        }
    };
    result.map_err(|e| {
        let (kind, code) = match &e {
            warren_egress::EgressError::Vault(VaultError::Exists) => {
                (ErrorKind::Conflict, ErrorCode::VaultExists)
            }
            // The lifecycle spec's code for a stale revision; the sidecar's is 409.
            warren_egress::EgressError::Vault(VaultError::Conflict { .. }) if lifecycle => (
                ErrorKind::PreconditionFailed,
                ErrorCode::VaultRevisionMismatch,
            ),
            warren_egress::EgressError::Vault(VaultError::Conflict { .. }) => {
                (ErrorKind::Conflict, ErrorCode::VaultRevisionMismatch)
            }
            warren_egress::EgressError::Vault(VaultError::NotFound(_)) => {
                (ErrorKind::NotFound, ErrorCode::VaultNotFound)
            }
            warren_egress::EgressError::Vault(VaultError::Invalid(_)) => {
                (ErrorKind::Invalid, ErrorCode::InvalidParameter)
            }
            warren_egress::EgressError::NoCredentialProxy(_) => {
                return not_enabled(e.to_string());
            }
            other => {
                tracing::error!(sandbox_id = id, error = %warren_core::error_chain(other), "credential vault");
                return SandboxError::new(
                    ErrorKind::Failed,
                    ErrorCode::Unknown,
                    "internal error; the server's log has the cause",
                );
            }
        };
        SandboxError::new(kind, code, e.to_string())
    })
}
