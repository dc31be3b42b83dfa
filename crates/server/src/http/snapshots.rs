//! `/v1/sandboxes/{id}/snapshots`, `/v1/snapshots` and the runner's
//! snapshot reports over HTTP; the durability rules are in
//! `control::snapshots`.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::sandboxes::{visible_sandbox, wait_timeout};
use super::{AppState, Json, OrgCaller, Path, Query, RunnerCaller};
use crate::control;
use crate::error::ControlError;
use crate::idempotency;
use crate::limits;
use crate::records::snapshots::SnapshotRow;
use crate::records::{self, not_found};
use api::runners::SnapshotReport;
use api::snapshots::{CreateSnapshotRequest, Snapshot, SnapshotList};

async fn visible(state: &AppState, org_id: &str, id: &str) -> Result<SnapshotRow, ControlError> {
    records::snapshots::visible(&state.db.pool, org_id, id)
        .await?
        .ok_or_else(|| not_found("snapshot"))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots", params(("id" = String, Path, description = "sandbox id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$", description = "1-255 visible ASCII characters; replays the original answer for a retried request")), request_body = CreateSnapshotRequest, responses((status = 201, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    headers: HeaderMap,
    Path(sandbox_id): Path<String>,
    Json(request): Json<CreateSnapshotRequest>,
) -> Result<Response, ControlError> {
    let key =
        idempotency::Key::from_request(&headers, &org_id, "snapshots", &sandbox_id, &request)?;
    if let Some(key) = &key
        && let Some(replayed) = idempotency::replay(&state.db, key).await?
    {
        return Ok(replayed);
    }
    visible_sandbox(&state, &org_id, &sandbox_id).await?;
    let mut tx = state.db.write().await?;
    let snapshot =
        control::snapshots::create(&state, &mut tx, &org_id, &sandbox_id, &request).await?;
    let id = snapshot.id.clone();
    let record = snapshot.to_api();
    let replayed = idempotency::commit_created(tx, &state.db, key.as_ref(), &record, &id).await?;
    if let Some(replayed) = replayed {
        return Ok(replayed);
    }
    tracing::info!(snapshot_id = %id, %sandbox_id, durability = %record.durability, "snapshot requested");
    Ok((StatusCode::CREATED, axum::Json(record)).into_response())
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SnapshotWait {
    /// Long-poll until this durability (or a stronger one), or `failed`.
    #[param(schema_with = api::schema::snapshot_wait_for)]
    wait_for: Option<String>,
    /// Seconds to wait, at most 25 (the default).
    #[param(minimum = 0, maximum = 25)]
    timeout: Option<u64>,
}

#[utoipa::path(get, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path), SnapshotWait), responses((status = 200, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(id): Path<String>,
    Query(query): Query<SnapshotWait>,
) -> Result<axum::Json<Snapshot>, ControlError> {
    let Some(target) = query.wait_for else {
        return Ok(axum::Json(visible(&state, &org_id, &id).await?.to_api()));
    };
    if !["pending", "local", "replicated", "failed"].contains(&target.as_str()) {
        return Err(limits::invalid(
            "wait_for",
            "pending, local, replicated or failed",
        ));
    }
    let timeout = wait_timeout(query.timeout)?;
    let watch = state.db.hub.watch(&id);
    let row = crate::hub::wait_until(
        &watch,
        timeout,
        || visible(&state, &org_id, &id),
        |row| api::snapshots::wait_is_over(&row.durability, &target),
    )
    .await?;
    Ok(axum::Json(row.to_api()))
}

#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots", params(("sandbox_id" = Option<String>, Query, description = "only this sandbox's snapshots"), ("limit" = Option<u32>, Query, minimum = 1, maximum = 200, description = "at most 200; default 50"), ("cursor" = Option<String>, Query, pattern = "^(snp_[0-9a-f]{1,64})?$", description = "the next_cursor of the previous page")), responses((status = 200, body = SnapshotList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<axum::Json<SnapshotList>, ControlError> {
    let mut limit = limits::LIST_LIMIT_DEFAULT;
    let mut cursor = String::new();
    let mut sandbox_id: Option<String> = None;
    for (name, value) in query {
        match name.as_str() {
            "limit" => limit = limits::list_limit(&value)?,
            "cursor" => cursor = limits::cursor(&value, "snp")?,
            "sandbox_id" => sandbox_id = Some(value),
            other => return Err(limits::invalid(other, "unknown query parameter")),
        }
    }
    let (snapshots, next_cursor) = records::snapshots::list(
        &state.db.pool,
        &org_id,
        sandbox_id.as_deref(),
        &cursor,
        limit,
    )
    .await?;
    Ok(axum::Json(SnapshotList {
        snapshots: snapshots.iter().map(SnapshotRow::to_api).collect(),
        next_cursor,
    }))
}

/// Forgets the snapshot; its tree becomes collectable by gc unless a home
/// (a child's, say) still names it.
#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path)), responses((status = 200, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(id): Path<String>,
) -> Result<axum::Json<Snapshot>, ControlError> {
    let snapshot = visible(&state, &org_id, &id).await?;
    control::snapshots::delete(&state, &snapshot).await?;
    Ok(axum::Json(snapshot.to_api()))
}

#[utoipa::path(post, path = "/v1/runner/snapshots/{id}/report", tag = "runner", params(("id" = String, Path)), request_body = SnapshotReport, responses((status = 200, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Path(id): Path<String>,
    Json(report): Json<SnapshotReport>,
) -> Result<axum::Json<Snapshot>, ControlError> {
    runner.speaks_for(&report.runner_id)?;
    let snapshot = control::snapshots::report(&state, &id, &report).await?;
    Ok(axum::Json(snapshot.to_api()))
}
