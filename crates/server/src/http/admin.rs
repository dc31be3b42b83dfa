//! Admin endpoints: organisations and runner tokens.

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

#[utoipa::path(post, path = "/v1/admin/runner-tokens", tag = "admin", responses((status = 201, body = api::orgs::RunnerTokenResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create_runner_token(
    State(state): State<AppState>,
    _admin: AdminCaller,
) -> Result<(StatusCode, axum::Json<RunnerTokenResponse>), ControlError> {
    let token = auth::new_token("runner")?;
    auth::store_token(&state.db, &token, "runner", None).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(RunnerTokenResponse { token }),
    ))
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
