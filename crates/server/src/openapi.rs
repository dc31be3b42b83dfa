//! The OpenAPI document served at `/v1/openapi.json`, generated from the
//! wire types (`api` crate) and the handlers' path annotations.

use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "roost",
        description = "Sandboxes for AI coding agents whose homes persist."
    ),
    components(schemas(
        api::ErrorBody,
        api::ErrorDetail,
        api::ErrorCode,
        api::orgs::CreateOrgRequest,
        api::orgs::CreateOrgResponse,
        api::orgs::RunnerTokenResponse,
        api::sandboxes::CreateSandboxRequest,
        api::sandboxes::Sandbox,
        api::sandboxes::SandboxList,
        api::sandboxes::Event,
        api::sandboxes::EventList,
        api::sandboxes::QuarantineRequest,
        api::commands::CreateCommandRequest,
        api::commands::Command,
        api::commands::CommandList,
        api::commands::SignalRequest,
        api::runners::RegisterRequest,
        api::runners::RegisterResponse,
        api::runners::HeartbeatRequest,
        api::runners::HeartbeatResponse,
        api::runners::Assignments,
        api::runners::SandboxReport,
        api::runners::CommandReport,
    ))
)]
struct Doc;

pub fn document() -> utoipa::openapi::OpenApi {
    Doc::openapi()
}
