//! Warren's OpenAPI document, generated from the handlers' annotations and the wire types' schemas,
//! served at `/openapi.json`.

use axum::Json;
use utoipa::OpenApi;
use warren_api::lifecycle::{
    CreateSandboxRequest, Endpoint, Health, ImageAuth, ImageSpec, ListSandboxesResponse,
    MetricsEvent, Pagination, Platform, RenewExpirationRequest, RenewExpirationResponse, Sandbox,
    SandboxState, SandboxStatus,
};
use warren_api::ErrorBody;

use crate::http::routes;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Warren lifecycle API",
        description = "OpenSandbox Sandbox Protocol, as served by Warren. Also served without the /v1 prefix. \
        Authenticate with the OPEN-SANDBOX-API-KEY header. Sandbox ports are reached at /sandboxes/{id}/proxy/{port}/… with the token \
        returned in an endpoint's headers."
    ),
    paths(
        routes::health,
        routes::create,
        routes::list,
        routes::get,
        routes::delete,
        routes::pause,
        routes::resume,
        routes::renew,
        routes::patch_metadata,
        routes::endpoint,
        routes::metrics_event,
        routes::create_snapshot,
        routes::list_snapshots,
        routes::get_snapshot,
        routes::delete_snapshot,
        routes::create_pool,
        routes::list_pools,
        routes::get_pool,
        routes::update_pool,
        routes::delete_pool,
        crate::http::routes::timeline,
        crate::http::diagnostics::logs,
        crate::http::diagnostics::events,
        crate::http::diagnostics::context,
        routes::create_template,
        routes::list_templates,
        routes::get_template,
        routes::delete_template
    ),
    components(schemas(
        CreateSandboxRequest,
        ImageSpec,
        ImageAuth,
        Platform,
        Sandbox,
        SandboxStatus,
        SandboxState,
        ListSandboxesResponse,
        Pagination,
        RenewExpirationRequest,
        RenewExpirationResponse,
        Endpoint,
        MetricsEvent,
        Health,
        warren_api::lifecycle::RuntimeInfo,
        warren_api::lifecycle::RuntimeCapabilities,
        warren_api::lifecycle::ExecdTransport,
        ErrorBody,
        warren_api::lifecycle::CreateSnapshotRequest,
        warren_api::lifecycle::Snapshot,
        warren_api::lifecycle::SnapshotStatus,
        warren_api::lifecycle::ListSnapshotsResponse,
        warren_api::lifecycle::CapacitySpec,
        warren_api::lifecycle::PoolSpec,
        warren_api::lifecycle::PoolStatus,
        warren_api::lifecycle::PoolUpdate,
        warren_api::lifecycle::Pool,
        warren_api::lifecycle::ListPoolsResponse,
        warren_api::lifecycle::DiagnosticContent,
        warren_api::lifecycle::DiagnosticContext,
        warren_api::lifecycle::CreateTemplateRequest,
        warren_api::lifecycle::TemplateReadiness,
        warren_api::lifecycle::TemplateStatus,
        warren_api::lifecycle::Template,
        warren_api::lifecycle::ListTemplatesResponse
    ))
)]
pub struct ApiDoc;

pub async fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn document_lists_every_lifecycle_route_with_exact_success_codes() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serialize");
        let paths = doc["paths"].as_object().expect("paths");
        for p in [
            "/v1/sandboxes",
            "/v1/sandboxes/{id}",
            "/v1/sandboxes/{id}/pause",
            "/v1/sandboxes/{id}/endpoints/{port}",
            "/v1/metrics/events",
        ] {
            assert!(paths.contains_key(p), "missing {p}");
        }
        assert!(doc["paths"]["/v1/sandboxes"]["post"]["responses"]["202"].is_object());
        assert!(doc["paths"]["/v1/sandboxes/{id}"]["delete"]["responses"]["204"].is_object());
        assert!(
            doc["components"]["schemas"]["CreateSandboxRequest"]["properties"]["resourceLimits"]
                .is_object()
        );
    }
}

#[cfg(test)]
mod snapshot {
    use super::*;

    /// The served OpenAPI document whole: any change to a route, a field or a status code shows
    /// up in review as a change to this snapshot (insta: `INSTA_UPDATE=always` or `cargo insta
    /// review` accepts it).
    #[test]
    fn the_served_document_matches_its_snapshot() {
        let doc = serde_json::to_string_pretty(&ApiDoc::openapi()).expect("serialize");
        insta::with_settings!({ prepend_module_to_snapshot => false, omit_expression => true }, {
            insta::assert_snapshot!("openapi", doc);
        });
    }
}
