//! Admin endpoints: organisations (and their quota use), org and runner
//! tokens and their revocation, quarantine and filesystem bindings.

use axum::extract::State;
use axum::http::StatusCode;

use super::{AdminCaller, AppState, Json, Path};
use crate::auth;
use crate::error::ControlError;
use api::orgs::{CreateOrgRequest, CreateOrgResponse, RunnerTokenResponse};

#[utoipa::path(post, path = "/v1/admin/orgs", tag = "admin", request_body = api::orgs::CreateOrgRequest, responses((status = 201, body = api::orgs::CreateOrgResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create_org(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Json(request): Json<CreateOrgRequest>,
) -> Result<(StatusCode, axum::Json<CreateOrgResponse>), ControlError> {
    let created = crate::control::orgs::create(&state, &request).await?;
    Ok((StatusCode::CREATED, axum::Json(created)))
}

/// Every org with its quotas and what it uses of them (the dashboard's
/// admin view).
#[utoipa::path(get, path = "/v1/admin/orgs", tag = "admin", responses((status = 200, body = api::orgs::OrgList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list_orgs(
    State(state): State<AppState>,
    _admin: AdminCaller,
) -> Result<axum::Json<api::orgs::OrgList>, ControlError> {
    let orgs = crate::records::orgs::usage(&state.db.pool).await?;
    Ok(axum::Json(api::orgs::OrgList { orgs }))
}

/// The kept counts recomputed from the records: each one that differs.
/// A scan of every sandbox (a check, never on a request's path).
#[utoipa::path(get, path = "/v1/admin/counts", tag = "admin", responses((status = 200, body = api::orgs::CountsCheck), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn counts(
    State(state): State<AppState>,
    _admin: AdminCaller,
) -> Result<axum::Json<api::orgs::CountsCheck>, ControlError> {
    let (scopes, drift) = crate::records::counts::drift(&state.db.pool).await?;
    Ok(axum::Json(api::orgs::CountsCheck {
        scopes: scopes as u64,
        drift: drift
            .into_iter()
            .map(|d| api::orgs::CountDrift {
                scope: d.scope,
                count: d.count,
                kept: d.stored,
                recomputed: d.recomputed,
            })
            .collect(),
    }))
}

/// A token runners enrol with, shown once. The body (optional) is what
/// the runners it enrols may declare (`api::orgs::RunnerProfile`).
#[utoipa::path(post, path = "/v1/admin/runner-tokens", tag = "admin", request_body(content = Option<api::orgs::RunnerProfile>, description = "optional: what the runners it enrols may declare"), responses((status = 201, body = api::orgs::RunnerTokenResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create_runner_token(
    State(state): State<AppState>,
    _admin: AdminCaller,
    body: axum::body::Bytes,
) -> Result<(StatusCode, axum::Json<RunnerTokenResponse>), ControlError> {
    // A body left out (older clients send none) allows anything.
    let profile: api::orgs::RunnerProfile = if body.iter().all(u8::is_ascii_whitespace) {
        api::orgs::RunnerProfile::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ControlError::new(
                api::ErrorCode::InvalidRequest,
                format!("runner profile: {e}"),
            )
        })?
    };
    crate::control::runner_protocol::validate_profile(&profile)?;
    let token = auth::new_token("runner")?;
    auth::store_runner_token(&state.db, &token, &profile).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(RunnerTokenResponse { token, profile }),
    ))
}

/// Another token for an org (by id or name), shown once: rotate a token by
/// making a new one, moving clients to it, then revoking the old one.
#[utoipa::path(post, path = "/v1/admin/orgs/{org}/tokens", tag = "admin", params(("org" = String, Path, description = "org id or name")), responses((status = 201, body = api::orgs::OrgTokenResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create_org_token(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Path(org): Path<String>,
) -> Result<(StatusCode, axum::Json<api::orgs::OrgTokenResponse>), ControlError> {
    let created = crate::control::orgs::create_token(&state, &org).await?;
    Ok((StatusCode::CREATED, axum::Json(created)))
}

/// Revokes an org token or a runner enrolment token, named by its value.
/// This server refuses it at once, every server within
/// `refused_everywhere_within_ms`. Revoking again answers the same.
#[utoipa::path(post, path = "/v1/admin/tokens/revoke", tag = "admin", request_body = api::orgs::RevokeTokenRequest, responses((status = 200, body = api::orgs::RevokedToken), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn revoke_token(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Json(request): Json<api::orgs::RevokeTokenRequest>,
) -> Result<axum::Json<api::orgs::RevokedToken>, ControlError> {
    let revoked = crate::control::orgs::revoke_token(&state, &request).await?;
    Ok(axum::Json(revoked))
}

/// Quarantine: an administrator freezes a sandbox's record for forensics.
/// It refuses delete, stop, start and new commands (409 `quarantined`)
/// until released.
#[utoipa::path(post, path = "/v1/admin/sandboxes/{id}/quarantine", tag = "admin", params(("id" = String, Path, description = "sandbox id")), request_body = api::sandboxes::QuarantineRequest, responses((status = 200, body = api::sandboxes::Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn quarantine(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Path(id): Path<String>,
    Json(request): Json<api::sandboxes::QuarantineRequest>,
) -> Result<axum::Json<api::sandboxes::Sandbox>, ControlError> {
    set_quarantine(&state, &id, Some(&request.reason)).await
}

#[utoipa::path(delete, path = "/v1/admin/sandboxes/{id}/quarantine", tag = "admin", params(("id" = String, Path, description = "sandbox id")), responses((status = 200, body = api::sandboxes::Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn release_quarantine(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Path(id): Path<String>,
) -> Result<axum::Json<api::sandboxes::Sandbox>, ControlError> {
    set_quarantine(&state, &id, None).await
}

async fn set_quarantine(
    state: &AppState,
    id: &str,
    reason: Option<&str>,
) -> Result<axum::Json<api::sandboxes::Sandbox>, ControlError> {
    if reason.is_some_and(|r| r.is_empty() || r.len() > 1024) {
        return Err(crate::limits::invalid("reason", "1 to 1024 bytes"));
    }
    let mut tx = state.db.write().await?;
    if !crate::records::sandboxes::set_quarantine(&mut tx, id, reason).await? {
        return Err(crate::records::not_found("sandbox"));
    }
    let row = crate::records::load_sandbox(&mut tx, id)
        .await?
        .ok_or_else(|| crate::records::not_found("sandbox"))?;
    tx.commit().await?;
    tracing::warn!(sandbox_id = %id, quarantined = reason.is_some(), "quarantine changed");
    Ok(axum::Json(row.to_api()))
}

/// Binds a shared filesystem to an org (by id or name): its sandboxes may
/// mount it, read-only whatever they ask if `read_only`.
#[utoipa::path(put, path = "/v1/admin/filesystems/{id}/orgs/{org}", tag = "admin", params(("id" = String, Path, pattern = "^[a-z0-9][a-z0-9_-]{0,63}$", description = "filesystem id"), ("org" = String, Path, description = "org id or name")), request_body = api::filesystems::BindFilesystemRequest, responses((status = 200, body = api::filesystems::FilesystemBinding), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn bind_filesystem(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Path((id, org)): Path<(String, String)>,
    Json(request): Json<api::filesystems::BindFilesystemRequest>,
) -> Result<axum::Json<api::filesystems::FilesystemBinding>, ControlError> {
    let binding = crate::control::filesystems::bind(&state, &id, &org, &request).await?;
    Ok(axum::Json(binding))
}

/// Removes a binding: the binding removed.
#[utoipa::path(delete, path = "/v1/admin/filesystems/{id}/orgs/{org}", tag = "admin", params(("id" = String, Path, pattern = "^[a-z0-9][a-z0-9_-]{0,63}$", description = "filesystem id"), ("org" = String, Path, description = "org id or name")), responses((status = 200, body = api::filesystems::FilesystemBinding), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn unbind_filesystem(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Path((id, org)): Path<(String, String)>,
) -> Result<axum::Json<api::filesystems::FilesystemBinding>, ControlError> {
    let removed = crate::control::filesystems::unbind(&state, &id, &org).await?;
    Ok(axum::Json(removed))
}

#[utoipa::path(get, path = "/v1/admin/filesystems", tag = "admin", responses((status = 200, body = api::filesystems::FilesystemBindingList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list_filesystems(
    State(state): State<AppState>,
    _admin: AdminCaller,
) -> Result<axum::Json<api::filesystems::FilesystemBindingList>, ControlError> {
    Ok(axum::Json(crate::control::filesystems::list(&state).await?))
}
