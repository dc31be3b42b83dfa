//! Snapshots: `POST /v1/sandboxes/{id}/snapshots` returns a receipt whose
//! `durability` moves `pending` → `local` (the runner captured the home)
//! → `replicated` (the runner uploaded it and the server found the whole
//! tree in the store and pinned it as the store home named after the
//! snapshot), or ends `failed`: `durability_deadline_exceeded` when the
//! requested durability was not reached by the deadline (the reconciler
//! decides), `sandbox_ended`, or what the runner reported.
//!
//! A sandbox with no runner holding its home (a durable one waiting to be
//! placed) is snapshotted from its last completed save at once.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sqlx::Row;

use super::homes::{parse_root, pin_tree};
use super::runner::{check_placement, live_runner};
use super::sandboxes::{visible_sandbox, wait_timeout};
use super::{AppState, Caller, Json};
use crate::control::home_store::store_org;
use crate::control::home_store::{blocking, store_error, store_of};
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::idempotency;
use crate::limits;
use crate::records::{self, load_sandbox, not_found, rfc3339};
use api::ErrorCode;
use api::runners::SnapshotReport;
use api::snapshots::{CreateSnapshotRequest, Snapshot, SnapshotList};
use store::{Digest, HomeName};

/// Longest deadline a snapshot may be given, in seconds.
const DEADLINE_SECONDS_MAX: u64 = 24 * 3600;
pub const SNAPSHOT_COLUMNS: &str = "id, org_id, sandbox_id, requested, durability, reason, deadline_at_ms, root, files, logical_bytes, captured_at_ms, created_at_ms, updated_at_ms";
/// Durabilities nothing moves on from.
const ENDED: &[&str] = &["replicated", "failed"];

#[derive(Clone, Debug)]
pub struct SnapshotRow {
    pub id: String,
    pub org_id: String,
    pub sandbox_id: String,
    pub requested: String,
    pub durability: String,
    pub reason: Option<String>,
    pub deadline_at_ms: Option<i64>,
    pub root: Option<String>,
    pub files: Option<i64>,
    pub logical_bytes: Option<i64>,
    pub captured_at_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl SnapshotRow {
    fn from_row(row: &sqlx::any::AnyRow) -> Result<SnapshotRow, sqlx::Error> {
        Ok(SnapshotRow {
            id: row.try_get("id")?,
            org_id: row.try_get("org_id")?,
            sandbox_id: row.try_get("sandbox_id")?,
            requested: row.try_get("requested")?,
            durability: row.try_get("durability")?,
            reason: row.try_get("reason")?,
            deadline_at_ms: row.try_get("deadline_at_ms")?,
            root: row.try_get("root")?,
            files: row.try_get("files")?,
            logical_bytes: row.try_get("logical_bytes")?,
            captured_at_ms: row.try_get("captured_at_ms")?,
            created_at_ms: row.try_get("created_at_ms")?,
            updated_at_ms: row.try_get("updated_at_ms")?,
        })
    }

    pub fn to_api(&self) -> Snapshot {
        Snapshot {
            id: self.id.clone(),
            sandbox_id: self.sandbox_id.clone(),
            requested: self.requested.clone(),
            durability: self.durability.clone(),
            reason: self.reason.clone(),
            deadline: self.deadline_at_ms.map(rfc3339),
            root: self.root.clone(),
            files: self.files.map(|f| f.max(0) as u64),
            logical_bytes: self.logical_bytes.map(|b| b.max(0) as u64),
            captured_at: self.captured_at_ms.map(rfc3339),
            created_at: rfc3339(self.created_at_ms),
            updated_at: rfc3339(self.updated_at_ms),
        }
    }
}

/// The store home that pins a snapshot's tree.
fn snapshot_home(id: &str) -> Result<HomeName, ControlError> {
    id.parse()
        .map_err(|_| ControlError::new(ErrorCode::Internal, "internal error"))
}

async fn load(tx: &mut WriteTx, id: &str) -> Result<Option<SnapshotRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(SnapshotRow::from_row).transpose()
}

async fn visible(state: &AppState, org_id: &str, id: &str) -> Result<SnapshotRow, ControlError> {
    let row = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = $1 AND org_id = $2"
    ))
    .bind(id)
    .bind(org_id)
    .fetch_optional(&state.db.pool)
    .await?;
    match row {
        Some(row) => Ok(SnapshotRow::from_row(&row)?),
        None => Err(not_found("snapshot")),
    }
}

/// The root of an org's replicated snapshot, for a child created from it.
pub async fn replicated_root(
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
) -> Result<String, ControlError> {
    let snapshot = load(tx, id)
        .await?
        .filter(|s| s.org_id == org_id)
        .ok_or_else(|| limits::invalid("from_snapshot", format!("no snapshot {id:?}")))?;
    match (&snapshot.root, snapshot.durability.as_str()) {
        (Some(root), "replicated") => Ok(root.clone()),
        _ => Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "snapshot {id} is {}: a sandbox can start only from a replicated one",
                snapshot.durability
            ),
        )),
    }
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots", params(("id" = String, Path)), request_body = CreateSnapshotRequest, responses((status = 201, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(sandbox_id): Path<String>,
    Json(request): Json<CreateSnapshotRequest>,
) -> Result<Response, ControlError> {
    let org_id = caller.org()?;
    let key =
        idempotency::Key::from_request(&headers, &org_id, "snapshots", &sandbox_id, &request)?;
    if let Some(key) = &key
        && let Some(replayed) = idempotency::replay(&state.db, key).await?
    {
        return Ok(replayed);
    }
    let requested = request
        .durability
        .clone()
        .unwrap_or_else(|| "replicated".to_owned());
    if !["local", "replicated"].contains(&requested.as_str()) {
        return Err(limits::invalid("durability", "local or replicated"));
    }
    if let Some(deadline) = request.deadline
        && !(1..=DEADLINE_SECONDS_MAX).contains(&deadline)
    {
        return Err(limits::invalid(
            "deadline",
            format!("seconds, between 1 and {DEADLINE_SECONDS_MAX}"),
        ));
    }
    store_of(&state)?;
    visible_sandbox(&state, &org_id, &sandbox_id).await?;
    let now = now_ms();
    let id = records::new_id("snp")?;
    let mut tx = state.db.write().await?;
    let sandbox = load_sandbox(&mut tx, &sandbox_id)
        .await?
        .filter(|s| s.org_id == org_id)
        .ok_or_else(|| not_found("sandbox"))?;
    // Where the home is: on its runner (which captures it), or only in
    // the store (its last completed save, a snapshot at once).
    let on_runner = sandbox.runner_id.is_some() && !sandbox.state.is_terminal();
    let (durability, root, captured_at) = if on_runner {
        ("pending", None, None)
    } else if let Some(root) = &sandbox.home.root {
        ("replicated", Some(root.clone()), sandbox.home.saved_at_ms)
    } else {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "sandbox {sandbox_id} is {} and no runner holds its home: there is nothing to snapshot",
                sandbox.state
            ),
        ));
    };
    if let Some(root) = &root {
        // The sandbox's own pin was checked complete when the save was
        // committed; this one keeps the tree when the sandbox moves on.
        let digest: Digest = root
            .parse()
            .map_err(|_| ControlError::new(ErrorCode::Internal, "internal error"))?;
        let (store, org, home) = (store_of(&state)?, store_org(&org_id)?, snapshot_home(&id)?);
        blocking(move || store.write_home(&org, &home, &digest))
            .await?
            .map_err(store_error)?;
    }
    sqlx::query(&format!(
        "INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, NULL, $6, $7, NULL, NULL, $8, $9, $9)"
    ))
    .bind(&id)
    .bind(&org_id)
    .bind(&sandbox_id)
    .bind(&requested)
    .bind(durability)
    .bind(request.deadline.map(|d| now + d as i64 * 1000))
    .bind(&root)
    .bind(captured_at)
    .bind(now)
    .execute(&mut *tx.tx)
    .await?;
    if let Some(runner) = &sandbox.runner_id {
        tx.changed(&format!("runner:{runner}")).await?;
    }
    let record = load(&mut tx, &id)
        .await?
        .ok_or_else(|| not_found("snapshot"))?
        .to_api();
    if let Some(key) = &key
        && !idempotency::record(&mut tx, key, StatusCode::CREATED, &record, &id).await?
    {
        drop(tx);
        return idempotency::replay(&state.db, key)
            .await?
            .ok_or_else(|| ControlError::new(ErrorCode::Internal, "idempotency key vanished"));
    }
    tx.commit().await?;
    tracing::info!(snapshot_id = %id, %sandbox_id, durability, "snapshot requested");
    Ok((StatusCode::CREATED, axum::Json(record)).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotWait {
    wait_for: Option<String>,
    timeout: Option<u64>,
}

/// `wait_for` is reached at that durability or a stronger one; `failed`
/// makes any other unreachable, so it answers too.
fn reached(snapshot: &SnapshotRow, target: &str) -> bool {
    let rank = |d: &str| match d {
        "pending" => 0,
        "local" => 1,
        _ => 2,
    };
    snapshot.durability == target
        || snapshot.durability == "failed"
        || (target != "failed" && rank(&snapshot.durability) >= rank(target))
}

#[utoipa::path(get, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path), ("wait_for" = Option<String>, Query), ("timeout" = Option<u64>, Query)), responses((status = 200, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<SnapshotWait>,
) -> Result<axum::Json<Snapshot>, ControlError> {
    let org_id = caller.org()?;
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
        |row| reached(row, &target),
    )
    .await?;
    Ok(axum::Json(row.to_api()))
}

#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots", params(("sandbox_id" = Option<String>, Query), ("limit" = Option<u32>, Query), ("cursor" = Option<String>, Query)), responses((status = 200, body = SnapshotList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<axum::Json<SnapshotList>, ControlError> {
    let org_id = caller.org()?;
    let mut limit = limits::LIST_LIMIT_DEFAULT;
    let mut cursor = String::new();
    let mut sandbox_id: Option<String> = None;
    for (name, value) in query {
        match name.as_str() {
            "limit" => limit = limits::list_limit(&value)?,
            "cursor" => cursor = value,
            "sandbox_id" => sandbox_id = Some(value),
            other => return Err(limits::invalid(other, "unknown query parameter")),
        }
    }
    let rows = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE org_id = $1 AND id > $2
         AND ($3 = '' OR sandbox_id = $3) ORDER BY id LIMIT {}",
        limit + 1
    ))
    .bind(&org_id)
    .bind(&cursor)
    .bind(sandbox_id.unwrap_or_default())
    .fetch_all(&state.db.pool)
    .await?;
    let snapshots = rows
        .iter()
        .map(SnapshotRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    let (snapshots, next_cursor) = records::page(snapshots, limit, |s| &s.id);
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
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<Snapshot>, ControlError> {
    let org_id = caller.org()?;
    let snapshot = visible(&state, &org_id, &id).await?;
    let store = store_of(&state)?;
    let (org, home) = (store_org(&org_id)?, snapshot_home(&id)?);
    let mut tx = state.db.write().await?;
    sqlx::query("DELETE FROM snapshots WHERE id = $1")
        .bind(&id)
        .execute(&mut *tx.tx)
        .await?;
    blocking(move || store.delete_home(&org, &home))
        .await?
        .map_err(store_error)?;
    tx.changed(&id).await?;
    tx.commit().await?;
    Ok(axum::Json(snapshot.to_api()))
}

/// The snapshot, checked to be of a sandbox at the report's placement.
async fn at_placement(
    tx: &mut WriteTx,
    id: &str,
    report: &SnapshotReport,
) -> Result<SnapshotRow, ControlError> {
    live_runner(tx, &report.runner_id).await?;
    let snapshot = load(tx, id).await?.ok_or_else(|| not_found("snapshot"))?;
    let sandbox = load_sandbox(tx, &snapshot.sandbox_id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    check_placement(&sandbox, &report.runner_id, report.epoch)?;
    Ok(snapshot)
}

#[utoipa::path(post, path = "/v1/runner/snapshots/{id}/report", tag = "runner", params(("id" = String, Path)), request_body = SnapshotReport, responses((status = 200, body = Snapshot), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(report): Json<SnapshotReport>,
) -> Result<axum::Json<Snapshot>, ControlError> {
    caller.runner()?;
    let snapshot = {
        let mut tx = state.db.write().await?;
        at_placement(&mut tx, &id, &report).await?
    };
    if ENDED.contains(&snapshot.durability.as_str()) {
        // Replicated already, or failed (a deadline passed): final.
        return Ok(axum::Json(snapshot.to_api()));
    }
    let now = now_ms();
    let mut summary = None;
    match report.durability.as_str() {
        "local" | "failed" => {}
        "replicated" => {
            let root = parse_root(report.root.as_deref())?;
            summary = Some((
                root,
                pin_tree(&state, &snapshot.org_id, snapshot_home(&id)?, root).await?,
            ));
        }
        other => {
            return Err(limits::invalid(
                "durability",
                format!("{other:?}: use local, replicated or failed"),
            ));
        }
    }
    let mut tx = state.db.write().await?;
    let current = at_placement(&mut tx, &id, &report).await?;
    if ENDED.contains(&current.durability.as_str()) {
        return Ok(axum::Json(current.to_api()));
    }
    let captured = report.captured_at_ms.map(|at| at.min(now));
    match (report.durability.as_str(), summary) {
        ("replicated", Some((root, summary))) => {
            sqlx::query(
                "UPDATE snapshots SET durability = 'replicated', root = $1, files = $2, logical_bytes = $3,
                 captured_at_ms = COALESCE(captured_at_ms, $4), updated_at_ms = $5 WHERE id = $6",
            )
            .bind(root.to_hex())
            .bind(report.files.map(|f| f as i64))
            .bind(summary.logical_bytes as i64)
            .bind(captured)
            .bind(now)
            .bind(&id)
            .execute(&mut *tx.tx)
            .await?;
        }
        ("failed", _) => {
            let mut message = report
                .message
                .clone()
                .unwrap_or_else(|| "snapshot failed".to_owned());
            message.truncate(1024);
            sqlx::query(
                "UPDATE snapshots SET durability = 'failed', reason = $1, updated_at_ms = $2 WHERE id = $3",
            )
            .bind(format!("runner_error: {message}"))
            .bind(now)
            .bind(&id)
            .execute(&mut *tx.tx)
            .await?;
        }
        _ => {
            sqlx::query(
                "UPDATE snapshots SET durability = 'local', captured_at_ms = $1, updated_at_ms = $2
                 WHERE id = $3 AND durability = 'pending'",
            )
            .bind(captured.unwrap_or(now))
            .bind(now)
            .bind(&id)
            .execute(&mut *tx.tx)
            .await?;
        }
    }
    tx.changed(&id).await?;
    let record = load(&mut tx, &id)
        .await?
        .ok_or_else(|| not_found("snapshot"))?;
    tx.commit().await?;
    Ok(axum::Json(record.to_api()))
}
