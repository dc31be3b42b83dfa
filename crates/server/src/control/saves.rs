//! Saves of durable homes, reported by the runner that holds the sandbox.
//!
//! A save counts only once complete in the store and committed, and only
//! from the sandbox's current placement:
//!
//! 1. the placement (runner, epoch) is checked: a stale one is `fenced`
//!    before anything is written;
//! 2. the store home `{id}` is made to name the record's root, should an
//!    earlier step 4 not have run (a store outage, a server killed); then,
//!    under the store's commit lock, the tree is checked present (its root:
//!    the block service takes a tree only with its children) and the store
//!    home `{id}-next` is pointed at it (so gc keeps it whatever happens
//!    next);
//! 3. a compare-and-swap on the record, guarded by the epoch, makes it the
//!    sandbox's `home_root` (a placement that moved on meanwhile is
//!    `fenced` and the record keeps the previous save), unless the record
//!    holds a later capture of this same placement: a save whose commit
//!    waited behind a later one never moves the home back (answered as
//!    the record stands: the later save holds everything it does);
//! 4. the store home `{id}` is pointed at the record's root, read after
//!    the commit.
//!
//! Steps 2 to 4 of one sandbox's saves take turns on this server
//! (`AppState::pointer_turns`), so `{id}` and `{id}-next` between them
//! always name the record's root.
//!
//! A stop's securing that commits says so in the sandbox's history
//! (`securing_committed`): should its runner be lost before it reports
//! `stopped`, the lease watcher knows the home was secured.
//!
//! Every root the record can name is pinned by `{id}` or `{id}-next`, so
//! gc never takes what a recovery would restore.

use super::AppState;
use super::home_store::{home_names, parse_root, pin_tree, point_home_at};
use super::runner_protocol::{check_placement, fenced, live_runner};
use crate::db::now_ms;
use crate::error::ControlError;
use crate::limits;
use crate::records::sandboxes::{
    SaveOutcome, SaveRecorded, record_save, record_securing_committed,
};
use crate::records::{SandboxRow, load_sandbox, not_found};
use api::ErrorCode;
use api::lifecycle::SandboxState;
use api::runners::SaveReport;

/// Records a runner's save report in the four steps above; answers the
/// sandbox as recorded.
pub async fn report_save(
    state: &AppState,
    id: &str,
    report: &SaveReport,
) -> Result<SandboxRow, ControlError> {
    let now = now_ms();
    let error = report
        .error
        .as_deref()
        .map(|e| limits::truncated(e, limits::RUNNER_TEXT_BYTES_MAX));
    // Taken before the record is read: it stands while this save commits.
    let _turn = match report.outcome.as_str() {
        "completed" => Some(state.pointer_turns.take(&format!("save:{id}")).await),
        _ => None,
    };
    // 1. The placement, before anything is written.
    let row = {
        let mut tx = state.db.write().await?;
        live_runner(&mut tx, &report.runner_id).await?;
        let row = load_sandbox(&mut tx, id)
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
    let (committed_home, next_home) = home_names(id)?;
    let mut committed_root = None;
    match report.outcome.as_str() {
        "progress" | "failed" => {}
        "unchanged" => {
            let root = parse_root(report.root.as_deref())?;
            if row.home.root.as_deref() != Some(root.to_hex().as_str()) {
                return Err(ControlError::new(
                    ErrorCode::InvalidState,
                    "only the last completed save can be found unchanged: this root is not it",
                ));
            }
        }
        "completed" => {
            let root = parse_root(report.root.as_deref())?;
            // 2. `{id}` names the record's root before `{id}-next` moves
            // on from it; then the new tree, complete and pinned.
            point_at_record(state, &row, committed_home.clone()).await?;
            pin_tree(state, &row.org_id, next_home, root).await?;
            committed_root = Some(root);
        }
        other => {
            return Err(limits::invalid(
                "outcome",
                format!("{other:?}: use progress, completed, unchanged or failed"),
            ));
        }
    }
    // 3. The compare-and-swap on the record.
    let mut tx = state.db.write().await?;
    let current = load_sandbox(&mut tx, id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    check_placement(&current, &report.runner_id, report.epoch)?;
    // When the runner says it captured the home: not before the sandbox
    // existed (less a runner clock behind the server's), not after now. A
    // runner's figure feeds the deployment's published ones, and a wild
    // one would wrap their arithmetic.
    let captured_at_ms = report.captured_at_ms.unwrap_or(now).clamp(
        current
            .created_at_ms
            .saturating_sub(RUNNER_CLOCK_BEHIND_MS_MAX)
            .min(now),
        now,
    );
    let outcome = match (report.outcome.as_str(), committed_root) {
        ("completed", Some(root)) => SaveOutcome::Completed {
            root: root.to_hex(),
            captured_at_ms,
        },
        ("unchanged", _) => SaveOutcome::Unchanged {
            root: report.root.clone().unwrap_or_default(),
            captured_at_ms,
        },
        ("failed", _) => SaveOutcome::Failed {
            error: error.unwrap_or_else(|| "save failed".to_owned()),
            bytes_pending: report.bytes_pending.map(|b| b as i64),
        },
        _ => SaveOutcome::Progress {
            bytes_pending: report.bytes_pending.map(|b| b as i64),
        },
    };
    let epoch = report.epoch as i64;
    let unchanged = report.outcome == "unchanged";
    match record_save(&mut tx, id, epoch, &report.runner_id, outcome).await? {
        SaveRecorded::Recorded => {}
        SaveRecorded::PlacementMoved if unchanged => {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                "the home's last completed save is no longer this root",
            ));
        }
        SaveRecorded::PlacementMoved => {
            return Err(fenced(
                "the placement moved on while the save was committed",
            ));
        }
        SaveRecorded::Superseded => {
            tracing::info!(
                sandbox_id = %id,
                epoch = report.epoch,
                root = report.root.as_deref().unwrap_or(""),
                "a save committed after a later one of its placement: the record keeps the later"
            );
            drop(tx);
            return Ok(current);
        }
    }
    // A stop's securing committed: the home is secured from here on,
    // whether or not its runner lives to report `stopped` (the lease
    // watcher reads this event).
    if let Some(root) = committed_root
        && report.securing
        && current.state == SandboxState::Securing
    {
        record_securing_committed(&mut tx, &current, &root.to_hex()).await?;
    }
    let record = load_sandbox(&mut tx, id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    tx.commit().await?;
    if let Some(root) = committed_root {
        // Counted as the record commits, before any later await: a runner
        // that goes away now drops this request, and the save stays
        // committed all the same.
        state.metrics.save_completed(
            std::time::Duration::from_millis((now_ms() - captured_at_ms).max(0) as u64),
            report.snapshot_ms,
            report.uploaded_bytes,
        );
        tracing::info!(sandbox_id = %id, epoch = report.epoch, %root, "home save committed");
        // 4. The committed pointer, at the record's root as it now stands.
        point_at_record(state, &record, committed_home).await?;
    }
    Ok(record)
}

/// Points the store home `{id}` at the root the record names (nothing when
/// it names none or `{id}` already does).
async fn point_at_record(
    state: &AppState,
    record: &SandboxRow,
    committed_home: store::HomeName,
) -> Result<(), ControlError> {
    let Some(root) = record.home.root.as_deref() else {
        return Ok(());
    };
    let root = parse_root(Some(root))?;
    point_home_at(state, &record.org_id, committed_home, Some(root)).await
}

/// How far behind the server's a runner's clock may be when it says when
/// it captured a home.
const RUNNER_CLOCK_BEHIND_MS_MAX: i64 = 10 * 60 * 1000;
