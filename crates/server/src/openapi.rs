//! The OpenAPI document served at `/v1/openapi.json`, generated from the
//! wire types (`api` crate) and the handlers' path annotations.

use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    paths(
        crate::http::admin::create_org,
        crate::http::admin::create_runner_token,
        crate::http::admin::quarantine,
        crate::http::admin::release_quarantine,
        crate::http::sandboxes::create,
        crate::http::sandboxes::get,
        crate::http::sandboxes::list,
        crate::http::sandboxes::events,
        crate::http::sandboxes::stop,
        crate::http::sandboxes::start,
        crate::http::sandboxes::delete,
        crate::http::commands::create,
        crate::http::commands::get,
        crate::http::commands::list,
        crate::http::commands::output,
        crate::http::commands::signal,
        crate::http::runner::register,
        crate::http::runner::heartbeat,
        crate::http::runner::assignments,
        crate::http::runner::report_sandbox,
        crate::http::runner::report_command,
        crate::http::runner::append_output,
        crate::http::images::commit,
        crate::http::images::get,
        crate::http::images::list,
        crate::http::images::delete,
        crate::http::blocks::missing,
        crate::http::blocks::put,
        crate::http::blocks::get,
        crate::http::meta::whoami,
        crate::http::meta::metrics,
        crate::http::meta::openapi,
        crate::http::meta::health,
    ),
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
        api::orgs::Whoami,
        api::images::CommitImageRequest,
        api::images::Image,
        api::images::ImageList,
        api::blocks::MissingRequest,
        api::blocks::MissingResponse,
    ))
)]
struct Doc;

pub fn document() -> utoipa::openapi::OpenApi {
    Doc::openapi()
}
