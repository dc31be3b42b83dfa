//! Snapshots: a receipt whose `durability` moves `pending` → `local` (the
//! runner captured the home) → `replicated` (the runner uploaded it and the
//! server found the whole tree in the store and pinned it as the store home
//! named after the snapshot), or ends `failed`: past its deadline (see
//! [`expire`]), `sandbox_ended`, or what the runner reported. A sandbox no
//! runner holds is snapshotted from its last completed save at once. A
//! salvage (`control::kept::salvage`) is a snapshot of a kept copy: the
//! runner holding the copy, not the placement, uploads and reports it.

use sqlx::Row;

use super::AppState;
use super::home_store::{
    blocking, parse_root, pin_tree, point_home_at, store_error, store_of, store_org,
};
use super::runner_protocol::{check_placement, live_runner};
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::limits;
use crate::records::snapshots::{self, ENDED, Reached, SnapshotRow, load};
use crate::records::{self, load_sandbox, not_found};
use api::ErrorCode;
use api::runners::SnapshotReport;
use api::snapshots::CreateSnapshotRequest;
use store::{Digest, HomeName};

/// Fails snapshots that can no longer keep their promise: past the
/// deadline without the requested durability, whose sandbox ended before
/// its runner captured them, or (a salvage, which an ended sandbox does
/// not stop: its copy is elsewhere) whose copy's runner is no longer
/// live. Returns how many.
pub async fn expire(state: &AppState) -> Result<u64, sqlx::Error> {
    let now = now_ms();
    let mut tx = state.db.write().await?;
    let mut failed: Vec<(String, String)> = Vec::new();
    let rows = sqlx::query(&format!(
        "SELECT s.id AS id, CASE WHEN s.deadline_at_ms IS NOT NULL AND s.deadline_at_ms < $1
                AND NOT (s.requested = 'local' AND s.durability = 'local')
                THEN 'durability_deadline_exceeded' ELSE 'sandbox_ended' END AS reason
         FROM snapshots s JOIN sandboxes b ON b.id = s.sandbox_id
         WHERE s.durability IN ('pending', 'local')
         AND ((s.deadline_at_ms IS NOT NULL AND s.deadline_at_ms < $1
               AND NOT (s.requested = 'local' AND s.durability = 'local'))
              OR (s.kept_copy_id IS NULL AND b.state IN {}))",
        records::terminal_states_sql()
    ))
    .bind(now)
    .fetch_all(&mut *tx.tx)
    .await?;
    for row in &rows {
        failed.push((row.try_get("id")?, row.try_get("reason")?));
    }
    let orphaned = sqlx::query(
        "SELECT s.id AS id, s.kept_runner_id AS runner_id FROM snapshots s
         LEFT JOIN runners r ON r.id = s.kept_runner_id
         WHERE s.kept_copy_id IS NOT NULL AND s.durability IN ('pending', 'local')
         AND (r.id IS NULL OR r.state <> 'live')",
    )
    .fetch_all(&mut *tx.tx)
    .await?;
    for row in &orphaned {
        let runner: String = row.try_get("runner_id")?;
        failed.push((
            row.try_get("id")?,
            format!(
                "runner_lost: runner {runner} holding the kept copy was lost before it uploaded it; the copy stays listed, salvage it again once the runner is back"
            ),
        ));
    }
    for (id, reason) in &failed {
        snapshots::fail_unfinished(&mut tx, id, reason).await?;
        tracing::info!(snapshot_id = %id, %reason, "snapshot failed");
    }
    tx.commit().await?;
    Ok(failed.len() as u64)
}

/// Longest deadline a snapshot may be given, in seconds.
const DEADLINE_SECONDS_MAX: u64 = 24 * 3600;
/// The store home that pins a snapshot's tree.
pub(crate) fn snapshot_home(id: &str) -> Result<HomeName, ControlError> {
    id.parse()
        .map_err(|_| ControlError::new(ErrorCode::Internal, "internal error"))
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

/// The durability a snapshot request asks for, once its bounds hold and
/// the deployment has a store to keep it in.
pub fn check_request(
    state: &AppState,
    request: &CreateSnapshotRequest,
) -> Result<String, ControlError> {
    let requested = request
        .durability
        .clone()
        .unwrap_or_else(|| "replicated".to_owned());
    if !["local", "replicated"].contains(&requested.as_str()) {
        return Err(limits::invalid("durability", "local or replicated"));
    }
    check_deadline(request.deadline)?;
    store_of(state)?;
    Ok(requested)
}

/// A snapshot's `deadline` (seconds from now), once within its bounds.
pub fn check_deadline(deadline: Option<u64>) -> Result<Option<u64>, ControlError> {
    if let Some(deadline) = deadline
        && !(1..=DEADLINE_SECONDS_MAX).contains(&deadline)
    {
        return Err(limits::invalid(
            "deadline",
            format!("seconds, between 1 and {DEADLINE_SECONDS_MAX}"),
        ));
    }
    Ok(deadline)
}

/// Takes a snapshot of the org's sandbox: `pending` while its runner
/// captures the home, or `replicated` at once from its last completed save
/// when no runner holds it.
pub async fn create(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    sandbox_id: &str,
    request: &CreateSnapshotRequest,
) -> Result<SnapshotRow, ControlError> {
    let requested = check_request(state, request)?;
    let now = now_ms();
    let id = records::new_id("snp")?;
    let sandbox = load_sandbox(tx, sandbox_id)
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
        let (store, org, home) = (store_of(state)?, store_org(org_id)?, snapshot_home(&id)?);
        blocking(move || store.write_home(&org, &home, &digest))
            .await?
            .map_err(store_error)?;
    }
    let new = snapshots::New {
        id: &id,
        org_id,
        sandbox_id,
        requested: &requested,
        durability,
        deadline_at_ms: request.deadline.map(|d| now + d as i64 * 1000),
        root: root.as_deref(),
        captured_at_ms: captured_at,
        reason: None,
        kept: None,
    };
    snapshots::insert(tx, new).await?;
    if let Some(runner) = &sandbox.runner_id {
        tx.changed(&format!("runner:{runner}"));
    }
    load(tx, &id).await?.ok_or_else(|| not_found("snapshot"))
}

/// Deletes the snapshot and releases its pin on the tree (which stays
/// while anything else, a child's home say, still names it).
pub async fn delete(state: &AppState, snapshot: &SnapshotRow) -> Result<(), ControlError> {
    let store = store_of(state)?;
    // Not while a report of it pins a tree on this server.
    let _turn = state
        .pointer_turns
        .take(&format!("snapshot:{}", snapshot.id))
        .await;
    let (org, home) = (store_org(&snapshot.org_id)?, snapshot_home(&snapshot.id)?);
    let mut tx = state.db.write().await?;
    snapshots::delete(&mut tx, &snapshot.id).await?;
    crate::idempotency::resource_ended(&mut tx, &snapshot.org_id, &snapshot.id).await?;
    blocking(move || store.delete_home(&org, &home))
        .await?
        .map_err(store_error)?;
    tx.commit().await?;
    Ok(())
}

/// The snapshot, checked to be of a sandbox at the report's placement,
/// or, for a salvage, of a kept copy the reporting runner holds and is to
/// keep (any other runner, or a copy let go, is told there is no such
/// snapshot: a runner learns nothing of another's copies).
async fn at_placement(
    tx: &mut WriteTx,
    id: &str,
    report: &SnapshotReport,
) -> Result<SnapshotRow, ControlError> {
    live_runner(tx, &report.runner_id).await?;
    let snapshot = load(tx, id).await?.ok_or_else(|| not_found("snapshot"))?;
    if let Some(kept) = &snapshot.kept {
        let holds = kept.runner_id == report.runner_id
            && crate::records::kept::load(tx, &snapshot.sandbox_id, &kept.copy_id)
                .await?
                .is_some_and(|copy| {
                    copy.runner_id == report.runner_id && copy.state == crate::records::kept::KEPT
                });
        if !holds {
            return Err(not_found("snapshot"));
        }
        return Ok(snapshot);
    }
    let sandbox = load_sandbox(tx, &snapshot.sandbox_id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    check_placement(&sandbox, &report.runner_id, report.epoch)?;
    Ok(snapshot)
}

/// Records a runner's snapshot report: `local` once captured,
/// `replicated` once the whole tree is in the store and pinned, or
/// `failed`; an ended snapshot stays as it is.
///
/// A snapshot's store home names the tree its record names: a report
/// (and a delete) of one snapshot takes a turn on this server
/// (`AppState::pointer_turns`), a `replicated` one pinning its tree and
/// recording it within it, and a report that finds the
/// snapshot replicated already (by another report, of another tree: a
/// runner that captured again after its first report was lost, two
/// reports racing on two servers) points the home back at the record's
/// tree, so gc never takes the tree the record names.
pub async fn report(
    state: &AppState,
    id: &str,
    report: &SnapshotReport,
) -> Result<SnapshotRow, ControlError> {
    // Every report: one finding the snapshot ended may point its pin,
    // which must not race a delete removing it.
    let _turn = state.pointer_turns.take(&format!("snapshot:{id}")).await;
    let snapshot = {
        let mut tx = state.db.write().await?;
        at_placement(&mut tx, id, report).await?
    };
    if ENDED.contains(&snapshot.durability.as_str()) {
        // Replicated already, or failed (a deadline passed): final.
        point_at_record(state, &snapshot).await?;
        return Ok(snapshot);
    }
    let now = now_ms();
    let mut summary = None;
    match report.durability.as_str() {
        "local" | "failed" => {}
        "replicated" => {
            let root = parse_root(report.root.as_deref())?;
            summary = Some((
                root,
                pin_tree(state, &snapshot.org_id, snapshot_home(id)?, root).await?,
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
    let current = at_placement(&mut tx, id, report).await?;
    if ENDED.contains(&current.durability.as_str()) {
        drop(tx);
        point_at_record(state, &current).await?;
        return Ok(current);
    }
    let captured = report.captured_at_ms.map(|at| at.min(now));
    let reached = match (report.durability.as_str(), summary) {
        ("replicated", Some((root, summary))) => Reached::Replicated {
            root: root.to_hex(),
            files: report.files.map(|f| f as i64),
            logical_bytes: summary.logical_bytes as i64,
            captured_at_ms: captured,
        },
        ("failed", _) => {
            let message = report.message.as_deref().map_or_else(
                || "snapshot failed".to_owned(),
                |m| limits::truncated(m, limits::RUNNER_TEXT_BYTES_MAX),
            );
            Reached::Failed {
                reason: format!("runner_error: {message}"),
            }
        }
        _ => Reached::Local {
            captured_at_ms: captured.unwrap_or(now),
        },
    };
    snapshots::set_durability(&mut tx, id, reached).await?;
    let record = load(&mut tx, id)
        .await?
        .ok_or_else(|| not_found("snapshot"))?;
    tx.commit().await?;
    Ok(record)
}

/// Points a replicated snapshot's store home at the tree its record
/// names (a failed one's is left: nothing reads it, and it only keeps
/// objects from gc until the snapshot is deleted).
async fn point_at_record(state: &AppState, snapshot: &SnapshotRow) -> Result<(), ControlError> {
    let Some(root) = snapshot
        .root
        .as_deref()
        .filter(|_| snapshot.durability == "replicated")
    else {
        return Ok(());
    };
    let root = parse_root(Some(root))?;
    point_home_at(
        state,
        &snapshot.org_id,
        snapshot_home(&snapshot.id)?,
        Some(root),
    )
    .await
}
