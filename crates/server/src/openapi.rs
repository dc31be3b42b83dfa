//! The OpenAPI document served at `/v1/openapi.json`, generated from the
//! wire types (`api` crate) and the handlers' path annotations.

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    modifiers(&Security),
    paths(
        crate::http::admin::create_org,
        crate::http::admin::list_orgs,
        crate::http::admin::counts,
        crate::http::admin::create_runner_token,
        crate::http::admin::create_org_token,
        crate::http::admin::revoke_token,
        crate::http::admin::quarantine,
        crate::http::admin::release_quarantine,
        crate::http::admin::bind_filesystem,
        crate::http::admin::unbind_filesystem,
        crate::http::admin::list_filesystems,
        crate::http::drain::list,
        crate::http::drain::admin_action,
        crate::http::drain::runner_preempt,
        crate::http::sandboxes::create,
        crate::http::sandboxes::get,
        crate::http::sandboxes::list,
        crate::http::sandboxes::events,
        crate::http::sandboxes::stop,
        crate::http::sandboxes::start,
        crate::http::sandboxes::update,
        crate::http::sandboxes::keepalive,
        crate::http::sandboxes::delete,
        crate::http::commands::create,
        crate::http::commands::get,
        crate::http::commands::list,
        crate::http::commands::output,
        crate::http::commands::signal,
        crate::http::commands::stdin,
        crate::http::commands::resize,
        crate::http::commands::attach,
        crate::http::files::read,
        crate::http::files::write,
        crate::http::files::remove,
        crate::http::files::list,
        crate::http::files::rename,
        crate::http::files::mkdir,
        crate::http::files::tar_read,
        crate::http::files::tar_write,
        crate::http::runner::register,
        crate::http::runner::heartbeat,
        crate::http::runner::assignments,
        crate::http::runner::report_sandbox,
        crate::http::runner::report_command,
        crate::http::runner::append_output,
        crate::http::snapshots::create,
        crate::http::snapshots::get,
        crate::http::snapshots::list,
        crate::http::snapshots::delete,
        crate::http::snapshots::report,
        crate::http::homes::report_save,
        crate::http::kept::report,
        crate::http::kept::discard,
        crate::http::kept::admin_discard,
        crate::http::kept::salvage,
        crate::http::kept::admin_salvage,
        crate::http::secrets::set,
        crate::http::secrets::list,
        crate::http::secrets::delete,
        crate::http::secrets::for_runner,
        crate::http::images::commit,
        crate::http::images::get,
        crate::http::images::list,
        crate::http::images::delete,
        crate::http::blocks::missing,
        crate::http::blocks::put,
        crate::http::blocks::batch,
        crate::http::blocks::get,
        crate::http::blocks::fetch,
        crate::http::meta::whoami,
        crate::http::meta::deployment,
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
        api::lifecycle::SandboxState,
        api::lifecycle::DesiredState,
        api::lifecycle::CommandState,
        api::lifecycle::StorageClass,
        api::lifecycle::Network,
        api::lifecycle::Placement,
        api::orgs::CreateOrgRequest,
        api::orgs::CreateOrgResponse,
        api::orgs::RunnerTokenResponse,
        api::orgs::OrgTokenResponse,
        api::orgs::RevokeTokenRequest,
        api::orgs::RevokedToken,
        api::orgs::OrgList,
        api::orgs::OrgUsage,
        api::orgs::CountsCheck,
        api::orgs::CountDrift,
        api::filesystems::BindFilesystemRequest,
        api::filesystems::FilesystemBinding,
        api::filesystems::FilesystemBindingList,
        api::sandboxes::Mount,
        api::sandboxes::CreateSandboxRequest,
        api::sandboxes::UpdateSandboxRequest,
        api::lifecycle::Activity,
        api::sandboxes::Sandbox,
        api::sandboxes::SandboxList,
        api::sandboxes::Event,
        api::sandboxes::EventList,
        api::sandboxes::QuarantineRequest,
        api::commands::CreateCommandRequest,
        api::commands::Command,
        api::commands::CommandList,
        api::commands::SignalRequest,
        api::commands::TtySize,
        api::runners::RegisterRequest,
        api::runners::RegisterResponse,
        api::runners::HeartbeatRequest,
        api::runners::HeartbeatResponse,
        api::runners::PreemptRequest,
        api::runners::WakeReport,
        api::runners::RunnerRecord,
        api::runners::Assignments,
        api::runners::SandboxReport,
        api::runners::CommandReport,
        api::runners::ReportedOutput,
        api::orgs::Whoami,
        api::deployment::Deployment,
        api::deployment::Configured,
        api::deployment::StoreLocation,
        api::deployment::Bounds,
        api::deployment::AfterHostLoss,
        api::deployment::Observed,
        api::deployment::Figure,
        api::sandboxes::SaveStatus,
        api::sandboxes::Recovery,
        api::sandboxes::KeptCopy,
        api::runners::KeptAssignment,
        api::runners::KeptCopyReport,
        api::runners::KeptCopyAnswer,
        api::snapshots::CreateSnapshotRequest,
        api::snapshots::Snapshot,
        api::snapshots::SnapshotList,
        api::snapshots::SalvageRequest,
        api::snapshots::SalvagedFrom,
        api::runners::SaveReport,
        api::runners::SnapshotReport,
        api::runners::SnapshotAssignment,
        api::images::CommitImageRequest,
        api::images::Image,
        api::images::ImageList,
        api::secrets::SetSecretRequest,
        api::secrets::SecretRecord,
        api::secrets::SecretList,
        api::sandboxes::Secret,
        api::runners::SecretsRequest,
        api::runners::SecretValues,
        api::runners::SecretValue,
        api::blocks::MissingRequest,
        api::blocks::MissingResponse,
        api::blocks::FetchRequest,
        api::files::FileType,
        api::files::FileEntry,
        api::files::FileList,
        api::files::FileWritten,
        api::files::FileRemoved,
        api::files::MoveRequest,
        api::files::FileMoved,
        api::files::MkdirRequest,
        api::files::DirectoryMade,
        api::files::TarSummary,
    ))
)]
struct Doc;

/// The bearer tokens (all `Authorization: Bearer TOKEN`; they differ in
/// who holds them and what they reach).
pub const ADMIN_TOKEN: &str = "admin_token";
pub const ORG_TOKEN: &str = "org_token";
pub const RUNNER_TOKEN: &str = "runner_token";
pub const RUNNER_CREDENTIAL: &str = "runner_credential";
pub const METRICS_TOKEN: &str = "metrics_token";

/// Which tokens an operation takes, by its path: the same rule the
/// router's extractors (`http::{AdminCaller, OrgCaller, RunnerCaller,
/// RegistrantCaller, BlocksCaller, MetricsCaller, Caller}`) enforce. Every other token is
/// answered 404 there, so a caller learns nothing of an endpoint it may
/// not use. An empty list: no token at all.
pub fn tokens_for(path: &str) -> &'static [&'static str] {
    match path {
        "/healthz" | "/v1/openapi.json" => &[],
        "/metrics" => &[ADMIN_TOKEN, METRICS_TOKEN],
        "/v1/whoami" | "/v1/deployment" => {
            &[ADMIN_TOKEN, ORG_TOKEN, RUNNER_TOKEN, RUNNER_CREDENTIAL]
        }
        "/v1/runner/register" => &[RUNNER_TOKEN, RUNNER_CREDENTIAL],
        _ if path.starts_with("/v1/admin/") => &[ADMIN_TOKEN],
        _ if path.starts_with("/v1/runner/") => &[RUNNER_CREDENTIAL],
        _ if path.starts_with("/v1/blocks/") => &[ORG_TOKEN, RUNNER_CREDENTIAL],
        _ => &[ORG_TOKEN],
    }
}

struct Security;

impl Modify for Security {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        let schemes = [
            (ADMIN_TOKEN, "the deployment's admin token"),
            (ORG_TOKEN, "an org's token, from `POST /v1/admin/orgs`"),
            (
                RUNNER_TOKEN,
                "a runner token, from `POST /v1/admin/runner-tokens`: it only registers runners",
            ),
            (
                RUNNER_CREDENTIAL,
                "one runner's own credential, issued when it registers",
            ),
            (
                METRICS_TOKEN,
                "the deployment's metrics token (`roost server --metrics-token-file`): it only reads `/metrics`",
            ),
        ];
        for (name, description) in schemes {
            let mut http = Http::new(HttpAuthScheme::Bearer);
            http.description = Some(description.to_owned());
            components.add_security_scheme(name, SecurityScheme::Http(http));
        }
        for (path, item) in doc.paths.paths.iter_mut() {
            let tokens = tokens_for(path);
            let operations = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ];
            for operation in operations.into_iter().flatten() {
                // Alternatives: any one of the listed tokens will do;
                // `[]` says the operation takes none.
                operation.security = Some(
                    tokens
                        .iter()
                        .map(|name| SecurityRequirement::new(*name, Vec::<String>::new()))
                        .collect(),
                );
            }
        }
    }
}

pub fn document() -> utoipa::openapi::OpenApi {
    Doc::openapi()
}
