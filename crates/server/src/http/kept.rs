//! Kept copies of homes: a runner reports one (runner token); the
//! sandbox's org, or an admin, discards one or salvages it into a
//! snapshot. Parse, call `control::kept`, render.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{AdminCaller, AppState, Json, OrgCaller, Path, RunnerCaller};
use crate::error::ControlError;
use crate::idempotency;
use api::runners::{KeptCopyAnswer, KeptCopyReport};
use api::sandboxes::Sandbox;
use api::snapshots::{SalvageRequest, Snapshot};

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

/// Salvages a kept copy of the sandbox's home into a snapshot: `pending`
/// until the runner holding the copy has uploaded it.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/kept/{copy}/salvage", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id"), ("copy" = String, Path, description = "kept copy id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$", description = "1-255 visible ASCII characters; replays the original answer for a retried request")), request_body = SalvageRequest, responses((status = 201, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn salvage(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    headers: HeaderMap,
    Path((id, copy)): Path<(String, String)>,
    Json(request): Json<SalvageRequest>,
) -> Result<Response, ControlError> {
    salvage_as(&state, Some(&org_id), &headers, &id, &copy, &request).await
}

/// The same, for an administrator (any org's sandbox; the snapshot is
/// the sandbox's org's).
#[utoipa::path(post, path = "/v1/admin/sandboxes/{id}/kept/{copy}/salvage", tag = "admin", params(("id" = String, Path, description = "sandbox id"), ("copy" = String, Path, description = "kept copy id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$", description = "1-255 visible ASCII characters; replays the original answer for a retried request")), request_body = SalvageRequest, responses((status = 201, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn admin_salvage(
    State(state): State<AppState>,
    _admin: AdminCaller,
    headers: HeaderMap,
    Path((id, copy)): Path<(String, String)>,
    Json(request): Json<SalvageRequest>,
) -> Result<Response, ControlError> {
    salvage_as(&state, None, &headers, &id, &copy, &request).await
}

/// The admin's idempotency keys are kept apart from every org's.
const ADMIN_KEYS: &str = "admin";

async fn salvage_as(
    state: &AppState,
    org_id: Option<&str>,
    headers: &HeaderMap,
    id: &str,
    copy: &str,
    request: &SalvageRequest,
) -> Result<Response, ControlError> {
    let target = format!("{id}/{copy}");
    let keys = org_id.unwrap_or(ADMIN_KEYS);
    let key = idempotency::Key::from_request(headers, keys, "salvage", &target, request)?;
    if let Some(key) = &key
        && let Some(replayed) = idempotency::replay(&state.db, key).await?
    {
        return Ok(replayed);
    }
    let mut tx = state.db.write().await?;
    let snapshot = crate::control::kept::salvage(state, &mut tx, org_id, id, copy, request).await?;
    let record = snapshot.to_api();
    let replayed =
        idempotency::commit_created(tx, &state.db, key.as_ref(), &record, &snapshot.id).await?;
    if let Some(replayed) = replayed {
        return Ok(replayed);
    }
    tracing::info!(snapshot_id = %snapshot.id, sandbox_id = %id, copy_id = %copy, durability = %record.durability, "kept copy salvage requested");
    Ok((StatusCode::CREATED, axum::Json(record)).into_response())
}
