//! Saves of durable homes, reported by the runner that holds the sandbox.
//!
//! A save counts only once complete in the store and committed, and only
//! from the sandbox's current placement:
//!
//! 1. the placement (runner, epoch) is checked: a stale one is `fenced`
//!    before anything is written;
//! 2. under the store's commit lock the tree is checked present (its root:
//!    the block service takes a tree only with its children) and the store
//!    home `{id}-next` is pointed at it (so gc keeps it whatever happens
//!    next);
//! 3. a compare-and-swap on the record, guarded by the epoch, makes it the
//!    sandbox's `home_root` (a placement that moved on meanwhile is
//!    `fenced` and the record keeps the previous save);
//! 4. the store home `{id}` is pointed at it.
//!
//! Every root the record can name is pinned by `{id}` or `{id}-next`, so
//! gc never takes what a recovery would restore.

use crate::control::home_store::{home_names, store_org};
use axum::extract::{Path, State};

use super::runner::{check_placement, fenced, live_runner};
use super::{AppState, Caller, Json};
use crate::control::home_store::{blocking, store_error, store_of};
use crate::db::now_ms;
use crate::error::ControlError;
use crate::limits;
use crate::records::{load_sandbox, not_found};
use api::ErrorCode;
use api::runners::SaveReport;
use store::{Digest, HomeName};

/// Longest error text kept on the record.
const SAVE_ERROR_CHARS_MAX: usize = 1024;

/// A tree root named in a request: 64 hex digits, else 400 naming `root`.
pub fn parse_root(root: Option<&str>) -> Result<Digest, ControlError> {
    root.unwrap_or("")
        .parse()
        .map_err(|_| limits::invalid("root", "a 64-digit hex digest"))
}

/// Checks that the tree `root` is complete in `org`'s store and points
/// `home` at it (under the store's commit lock). Incomplete → 409.
pub async fn pin_tree(
    state: &AppState,
    org: &str,
    home: HomeName,
    root: Digest,
) -> Result<store::push::TreeSummary, ControlError> {
    let store = store_of(state)?;
    let org = store_org(org)?;
    match blocking(move || store::push::commit_uploaded(&store, &org, &home, &root)).await? {
        Ok(summary) => Ok(summary),
        Err(store::Error::IncompleteTree { missing, .. }) => Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("{missing} objects of tree {root} are not in the store; upload them first"),
        )
        .with_details(serde_json::json!({ "missing_objects": missing }))),
        Err(store::Error::Corrupt { .. } | store::Error::MalformedTree { .. }) => {
            Err(ControlError::new(
                ErrorCode::InvalidRequest,
                format!("tree {root} has a malformed or corrupt object"),
            ))
        }
        Err(err) => Err(store_error(err)),
    }
}

#[utoipa::path(post, path = "/v1/runner/sandboxes/{id}/saves", tag = "runner", params(("id" = String, Path, description = "sandbox id")), request_body = SaveReport, responses((status = 200, body = api::sandboxes::Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report_save(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(report): Json<SaveReport>,
) -> Result<axum::Json<api::sandboxes::Sandbox>, ControlError> {
    caller.runner()?;
    let now = now_ms();
    // 1. The placement, before anything is written.
    let row = {
        let mut tx = state.db.write().await?;
        live_runner(&mut tx, &report.runner_id).await?;
        let row = load_sandbox(&mut tx, &id)
            .await?
            .ok_or_else(|| not_found("sandbox"))?;
        check_placement(&row, &report.runner_id, report.epoch)?;
        row
    };
    if row.home.save_interval_s.is_none() {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            "only durable sandboxes are saved",
        ));
    }
    let (committed_home, next_home) = home_names(&id)?;
    let mut committed_root = None;
    match report.outcome.as_str() {
        "progress" | "failed" => {}
        "completed" => {
            let root = parse_root(report.root.as_deref())?;
            // 2. Complete in the store, and pinned.
            pin_tree(&state, &row.org_id, next_home, root).await?;
            committed_root = Some(root);
        }
        other => {
            return Err(limits::invalid(
                "outcome",
                format!("{other:?}: use progress, completed or failed"),
            ));
        }
    }
    // 3. The compare-and-swap on the record.
    let mut tx = state.db.write().await?;
    let current = load_sandbox(&mut tx, &id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    check_placement(&current, &report.runner_id, report.epoch)?;
    let error = report.error.as_deref().map(|e| {
        let mut e = e.to_owned();
        e.truncate(SAVE_ERROR_CHARS_MAX);
        e
    });
    let updated = match (report.outcome.as_str(), committed_root) {
        ("completed", Some(root)) => {
            sqlx::query(
                "UPDATE sandboxes SET home_root = $1, home_saved_at_ms = $2, save_attempt_at_ms = $3,
                 save_error = NULL, save_bytes_pending = 0, updated_at_ms = $3
                 WHERE id = $4 AND epoch = $5 AND runner_id = $6",
            )
            .bind(root.to_hex())
            .bind(report.captured_at_ms.unwrap_or(now).min(now))
            .bind(now)
            .bind(&id)
            .bind(report.epoch as i64)
            .bind(&report.runner_id)
            .execute(&mut *tx.tx)
            .await?
        }
        ("failed", _) => {
            sqlx::query(
                "UPDATE sandboxes SET save_attempt_at_ms = $1, save_error = $2, save_bytes_pending = $3, updated_at_ms = $1
                 WHERE id = $4 AND epoch = $5 AND runner_id = $6",
            )
            .bind(now)
            .bind(error.unwrap_or_else(|| "save failed".to_owned()))
            .bind(report.bytes_pending.map(|b| b as i64))
            .bind(&id)
            .bind(report.epoch as i64)
            .bind(&report.runner_id)
            .execute(&mut *tx.tx)
            .await?
        }
        _ => {
            sqlx::query(
                "UPDATE sandboxes SET save_attempt_at_ms = $1, save_bytes_pending = $2
                 WHERE id = $3 AND epoch = $4 AND runner_id = $5",
            )
            .bind(now)
            .bind(report.bytes_pending.map(|b| b as i64))
            .bind(&id)
            .bind(report.epoch as i64)
            .bind(&report.runner_id)
            .execute(&mut *tx.tx)
            .await?
        }
    };
    if updated.rows_affected() == 0 {
        return Err(fenced(
            "the placement moved on while the save was committed",
        ));
    }
    tx.changed(&id).await?;
    let record = load_sandbox(&mut tx, &id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    tx.commit().await?;
    // 4. The committed pointer.
    if let Some(root) = committed_root {
        let store = store_of(&state)?;
        let org = store_org(&row.org_id)?;
        blocking(move || store.write_home(&org, &committed_home, &root))
            .await?
            .map_err(store_error)?;
        let captured_at = report.captured_at_ms.unwrap_or(now).min(now);
        state.metrics.save_completed(
            std::time::Duration::from_millis((now_ms() - captured_at).max(0) as u64),
            report.snapshot_ms,
            report.uploaded_bytes,
        );
        tracing::info!(sandbox_id = %id, epoch = report.epoch, %root, "home save committed");
    }
    Ok(axum::Json(record.to_api()))
}
