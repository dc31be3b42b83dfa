//! Kept copies of homes: a runner reports one (runner token); the
//! sandbox's org, or an admin, discards one. Parse, call
//! `control::kept`, render.

use axum::extract::State;

use super::{AdminCaller, AppState, Json, OrgCaller, Path, RunnerCaller};
use crate::error::ControlError;
use api::runners::{KeptCopyAnswer, KeptCopyReport};
use api::sandboxes::Sandbox;

#[utoipa::path(post, path = "/v1/runner/kept", tag = "runner", request_body = KeptCopyReport, responses((status = 200, body = KeptCopyAnswer), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Json(report): Json<KeptCopyReport>,
) -> Result<axum::Json<KeptCopyAnswer>, ControlError> {
    runner.speaks_for(&report.runner_id)?;
    Ok(axum::Json(
        crate::control::kept::report(&state, &report).await?,
    ))
}

/// Discards a kept copy of the sandbox's home: its runner deletes it.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/kept/{copy}/discard", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id"), ("copy" = String, Path, description = "kept copy id")), responses((status = 200, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn discard(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path((id, copy)): Path<(String, String)>,
) -> Result<axum::Json<Sandbox>, ControlError> {
    discard_as(&state, Some(&org_id), &id, &copy).await
}

/// The same, for an administrator (any org's sandbox).
#[utoipa::path(post, path = "/v1/admin/sandboxes/{id}/kept/{copy}/discard", tag = "admin", params(("id" = String, Path, description = "sandbox id"), ("copy" = String, Path, description = "kept copy id")), responses((status = 200, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn admin_discard(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Path((id, copy)): Path<(String, String)>,
) -> Result<axum::Json<Sandbox>, ControlError> {
    discard_as(&state, None, &id, &copy).await
}

async fn discard_as(
    state: &AppState,
    org_id: Option<&str>,
    id: &str,
    copy: &str,
) -> Result<axum::Json<Sandbox>, ControlError> {
    let mut tx = state.db.write().await?;
    let row = crate::control::kept::discard(state, &mut tx, org_id, id, copy).await?;
    tx.commit().await?;
    Ok(axum::Json(row.to_api()))
}
