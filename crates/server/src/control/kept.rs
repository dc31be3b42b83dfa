//! Kept copies of homes (DESIGN.md §7, "never destroy the newest copy"):
//! a runner that finds a home it no longer has assigned sets it aside and
//! reports it here; these rules say whether it keeps it and why, when it
//! may go, and let the sandbox's org (or an admin) discard it or salvage
//! it into a snapshot (which the runner holding it uploads).

use api::ErrorCode;
use api::lifecycle::{DesiredState, SandboxState, StorageClass};
use api::runners::{KeptAssignment, KeptCopyAnswer, KeptCopyReport};
use api::snapshots::SalvageRequest;

use super::AppState;
use super::home_store::store_of;
use super::runner_protocol::live_runner;
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::limits;
use crate::records::kept::{self, KEPT, KeptRow};
use crate::records::snapshots::{KeptSource, SnapshotRow};
use crate::records::{self, SandboxRow, load_sandbox, not_found};

/// A durable home that may hold writes no completed save has.
pub const UNSAVED_WRITES: &str = "unsaved_writes";
/// A durable home equal to the last completed save, kept until the
/// sandbox has run again from the store (the store's copy may be bad).
pub const AWAITING_NEW_PLACEMENT: &str = "awaiting_new_placement";
/// A standard home whose runner was lost: the only copy there is.
pub const NODE_LOST: &str = "node_lost";

/// Copies of one sandbox's home one runner keeps at once, and all runners
/// together. A runner sets a home aside each time it finds one it no
/// longer has assigned (lost and back, or the sandbox moved off it), and
/// a copy goes once its sandbox runs again from the store, is deleted, or
/// the retention window passes: a sandbox has one or two, and these
/// bounds are far past what losses and moves make within that window. Each
/// new copy rewrites the record's list of them under the write lock,
/// which without a bound a runner could make quadratic by reporting
/// copies without end. A new copy past them is refused (`quota_exceeded`,
/// which the runner logs): it stays on the runner's disk, nothing is
/// deleted, and the runner reports it again at its next sync, once some
/// have gone. A copy already recorded is answered as before.
pub const KEPT_COPIES_PER_RUNNER_MAX: i64 = 8;
pub const KEPT_COPIES_PER_SANDBOX_MAX: i64 = 32;

/// Why a runner keeps the copy it reports, from what the sandbox's record
/// says: a standard home is the only copy; a durable one is the newest
/// copy unless it is exactly the tree the record's last save names.
pub fn reason_to_keep(sandbox: &SandboxRow, secured_root: Option<&str>) -> &'static str {
    match sandbox.storage_class {
        StorageClass::Standard => NODE_LOST,
        StorageClass::Durable
            if secured_root.is_some() && secured_root == sandbox.home.root.as_deref() =>
        {
            AWAITING_NEW_PLACEMENT
        }
        StorageClass::Durable => UNSAVED_WRITES,
    }
}

/// Whether a copy kept for `reason` since `kept_at_ms` is still to be
/// kept: `Err` carries why it may go. It goes with its sandbox (deleted,
/// or no longer known), after the retention window, and, when it only
/// duplicates the last completed save, once a placement restored the home
/// from the store and runs it. While it is being salvaged (`salvaging`)
/// neither of the last two lets it go: the salvage ends first.
pub fn still_kept(
    sandbox: Option<&SandboxRow>,
    reason: &str,
    kept_at_ms: i64,
    retained_since_ms: i64,
    salvaging: bool,
) -> Result<(), &'static str> {
    let Some(sandbox) = sandbox else {
        return Err("sandbox_deleted");
    };
    if sandbox.desired == DesiredState::Deleted
        || matches!(
            sandbox.state,
            SandboxState::Deleting | SandboxState::Deleted
        )
    {
        return Err("sandbox_deleted");
    }
    if salvaging {
        return Ok(());
    }
    if kept_at_ms < retained_since_ms {
        return Err("expired");
    }
    if reason == AWAITING_NEW_PLACEMENT && sandbox.state == SandboxState::Running {
        return Err("restored");
    }
    Ok(())
}

/// A runner reports a home it set aside. Idempotent: the same copy again
/// gets the same answer (or, once it may go, `keep: false`).
pub async fn report(
    state: &AppState,
    report: &KeptCopyReport,
) -> Result<KeptCopyAnswer, ControlError> {
    limits::name("name", &report.name)?;
    limits::name("sandbox_id", &report.sandbox_id)?;
    if let Some(root) = &report.secured_root {
        limits::name("secured_root", root)?;
    }
    let mut tx = state.db.write().await?;
    live_runner(&mut tx, &report.runner_id).await?;
    let sandbox = load_sandbox(&mut tx, &report.sandbox_id).await?;
    let retained_since = state.retained_since_ms();
    let existing = kept::find(&mut tx, &report.runner_id, &report.sandbox_id, &report.name).await?;
    let answer = match existing {
        Some(copy) if copy.state != KEPT => KeptCopyAnswer {
            copy_id: Some(copy.id.clone()),
            keep: false,
            reason: copy.ended_reason.unwrap_or_else(|| "discarded".to_owned()),
        },
        Some(copy) => match still_kept(
            sandbox.as_ref(),
            &copy.reason,
            copy.kept_at_ms,
            retained_since,
            salvaging(&mut tx, &copy).await?,
        ) {
            Ok(()) => KeptCopyAnswer {
                copy_id: Some(copy.id.clone()),
                keep: true,
                reason: copy.reason.clone(),
            },
            Err(why) => {
                kept::discard(&mut tx, &copy, why).await?;
                KeptCopyAnswer {
                    copy_id: Some(copy.id.clone()),
                    keep: false,
                    reason: why.to_owned(),
                }
            }
        },
        None => keep_new(&mut tx, report, sandbox, retained_since).await?,
    };
    tx.commit().await?;
    Ok(answer)
}

/// A copy reported for the first time: recorded and kept, unless it may
/// go already (its sandbox is gone, or it only duplicates a save that a
/// placement has restored and runs).
async fn keep_new(
    tx: &mut WriteTx,
    report: &KeptCopyReport,
    sandbox: Option<SandboxRow>,
    retained_since: i64,
) -> Result<KeptCopyAnswer, ControlError> {
    let kept_at_ms = report.kept_at_ms.min(now_ms());
    let Some(sandbox) = sandbox else {
        return Ok(KeptCopyAnswer {
            copy_id: None,
            keep: false,
            reason: "sandbox_deleted".to_owned(),
        });
    };
    // A runner reports copies of homes it ran, never another's sandbox.
    if !records::sandboxes::was_placed_on(tx, &sandbox.id, &report.runner_id).await? {
        return Err(crate::control::runner_protocol::no_such_runner());
    }
    let reason = reason_to_keep(&sandbox, report.secured_root.as_deref());
    if let Err(why) = still_kept(Some(&sandbox), reason, kept_at_ms, retained_since, false) {
        return Ok(KeptCopyAnswer {
            copy_id: None,
            keep: false,
            reason: why.to_owned(),
        });
    }
    let (on_runner, on_all) = kept::count_kept(tx, &sandbox.id, &report.runner_id).await?;
    for (metric, current, limit) in [
        (
            "kept_copies_per_runner",
            on_runner,
            KEPT_COPIES_PER_RUNNER_MAX,
        ),
        (
            "kept_copies_per_sandbox",
            on_all,
            KEPT_COPIES_PER_SANDBOX_MAX,
        ),
    ] {
        if current >= limit {
            return Err(ControlError::new(
                ErrorCode::QuotaExceeded,
                format!(
                    "quota {metric} reached ({current} of {limit}): the copy stays on the runner; report it again once some have gone"
                ),
            )
            .with_details(serde_json::json!({
                "quota": { "metric": metric, "limit": limit, "current": current }
            })));
        }
    }
    let copy = KeptRow {
        id: records::new_id("kpt")?,
        sandbox_id: sandbox.id.clone(),
        org_id: sandbox.org_id.clone(),
        runner_id: report.runner_id.clone(),
        name: report.name.clone(),
        bytes: report.bytes.min(i64::MAX as u64) as i64,
        kept_at_ms,
        reason: reason.to_owned(),
        state: KEPT.to_owned(),
        ended_reason: None,
    };
    kept::insert(tx, &copy).await?;
    tracing::warn!(sandbox_id = %sandbox.id, copy_id = %copy.id, runner_id = %copy.runner_id, bytes = copy.bytes, reason, "a runner keeps a copy of a home aside");
    Ok(KeptCopyAnswer {
        copy_id: Some(copy.id),
        keep: true,
        reason: reason.to_owned(),
    })
}

/// The copies the runner is to go on keeping (for its assignments); those
/// that may go now are discarded on the way, so the runner, not finding
/// them listed, reports them and is told to delete them.
pub async fn kept_assignments(
    state: &AppState,
    tx: &mut WriteTx,
    runner_id: &str,
) -> Result<Vec<KeptAssignment>, ControlError> {
    let retained_since = state.retained_since_ms();
    let mut kept = Vec::new();
    for copy in kept::kept_on_runner(tx, runner_id).await? {
        let sandbox = load_sandbox(tx, &copy.sandbox_id).await?;
        let salvage = records::snapshots::pending_salvages(tx, &copy.id).await?;
        match still_kept(
            sandbox.as_ref(),
            &copy.reason,
            copy.kept_at_ms,
            retained_since,
            !salvage.is_empty(),
        ) {
            Ok(()) => kept.push(KeptAssignment {
                copy_id: copy.id.clone(),
                sandbox_id: copy.sandbox_id.clone(),
                name: copy.name.clone(),
                org_id: copy.org_id.clone(),
                salvage,
            }),
            Err(why) => {
                kept::discard(tx, &copy, why).await?;
            }
        }
    }
    Ok(kept)
}

/// Whether a salvage of the copy is under way.
async fn salvaging(tx: &mut WriteTx, copy: &KeptRow) -> Result<bool, ControlError> {
    Ok(!records::snapshots::pending_salvages(tx, &copy.id)
        .await?
        .is_empty())
}

/// The caller's sandbox (`org_id`; any, for an admin), still visible, and
/// its copy `copy_id` still kept; anything else is 404.
async fn visible_copy(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: Option<&str>,
    sandbox_id: &str,
    copy_id: &str,
) -> Result<(SandboxRow, KeptRow), ControlError> {
    let sandbox = load_sandbox(tx, sandbox_id)
        .await?
        .filter(|row| org_id.is_none_or(|org| row.org_id == org))
        .filter(|row| {
            row.ended_at_ms
                .is_none_or(|ended| ended > state.retained_since_ms())
        })
        .ok_or_else(|| not_found("sandbox"))?;
    let copy = kept::load(tx, sandbox_id, copy_id)
        .await?
        .filter(|copy| copy.state == KEPT)
        .ok_or_else(|| not_found("kept copy"))?;
    Ok((sandbox, copy))
}

/// The sandbox's org (`None`: an admin) salvages a kept copy: a snapshot
/// of the sandbox whose content is the copy. It is `pending` until the
/// runner holding the copy has uploaded it through the block service and
/// reported its root (`control::snapshots::report` checks the tree and
/// pins it), or `failed` at once when that runner is not live. The copy
/// stays (until discarded or expired) whatever becomes of the snapshot.
pub async fn salvage(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: Option<&str>,
    sandbox_id: &str,
    copy_id: &str,
    request: &SalvageRequest,
) -> Result<SnapshotRow, ControlError> {
    let deadline = super::snapshots::check_deadline(request.deadline)?;
    store_of(state)?;
    let (sandbox, copy) = visible_copy(state, tx, org_id, sandbox_id, copy_id).await?;
    // Past the retention window (the expiry has not run yet), or letting
    // go of a copy the sandbox no longer needs: not to be salvaged.
    if let Err(why) = still_kept(
        Some(&sandbox),
        &copy.reason,
        copy.kept_at_ms,
        state.retained_since_ms(),
        salvaging(tx, &copy).await?,
    ) {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("the kept copy {copy_id} is being let go ({why}): there is nothing to salvage"),
        ));
    }
    let live = records::runners::load(tx, &copy.runner_id)
        .await?
        .is_some_and(|runner| runner.state == "live");
    let reason = (!live).then(|| {
        format!(
            "runner_lost: runner {} holding the copy is not live; the copy stays listed, salvage it again once the runner is back",
            copy.runner_id
        )
    });
    let id = records::new_id("snp")?;
    let source = KeptSource {
        copy_id: copy.id.clone(),
        runner_id: copy.runner_id.clone(),
        kept_at_ms: copy.kept_at_ms,
    };
    let new = records::snapshots::New {
        id: &id,
        org_id: &sandbox.org_id,
        sandbox_id,
        requested: "replicated",
        durability: if live { "pending" } else { "failed" },
        deadline_at_ms: deadline.map(|d| now_ms() + d as i64 * 1000),
        root: None,
        // What the copy holds was last written before it was set aside.
        captured_at_ms: Some(copy.kept_at_ms),
        reason: reason.as_deref(),
        kept: Some(&source),
    };
    records::snapshots::insert(tx, new).await?;
    if live {
        tx.changed(&format!("runner:{}", copy.runner_id));
    }
    records::snapshots::load(tx, &id)
        .await?
        .ok_or_else(|| not_found("snapshot"))
}

/// The sandbox's org (`None`: an admin) discards a kept copy: its runner
/// deletes it. Answers the sandbox as it now is.
pub async fn discard(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: Option<&str>,
    sandbox_id: &str,
    copy_id: &str,
) -> Result<SandboxRow, ControlError> {
    let (_, copy) = visible_copy(state, tx, org_id, sandbox_id, copy_id).await?;
    if !kept::discard(tx, &copy, "discarded").await? {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            "the kept copy changed meanwhile; read the sandbox again",
        ));
    }
    load_sandbox(tx, sandbox_id)
        .await?
        .ok_or_else(|| not_found("sandbox"))
}

/// Discards kept copies older than the retention window, so the record
/// stops listing them even while their runner is away.
pub async fn expire(state: &AppState) -> Result<(), ControlError> {
    let mut tx = state.db.write().await?;
    for copy in kept::kept_before(&mut tx, state.retained_since_ms(), 100).await? {
        kept::discard(&mut tx, &copy, "expired").await?;
    }
    tx.commit().await?;
    Ok(())
}
