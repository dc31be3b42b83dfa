//! A sandbox's lifecycle as its org drives it: stop, start and delete
//! change what is wanted (with an event saying who asked); a sandbox with
//! no compute to give back moves at once, others when their runner reports.

use api::ErrorCode;
use api::lifecycle::{DesiredState, SandboxState, StorageClass};

use super::AppState;
use super::admission::check_quotas;
use super::placement::place_or_wait;
use crate::db::WriteTx;
use crate::error::ControlError;
use crate::records::{self, SandboxRow, Transition, load_sandbox, not_found, set_sandbox_state};

/// The sandbox as this transaction now sees it (after its own writes).
pub async fn reload(tx: &mut WriteTx, id: &str) -> Result<SandboxRow, ControlError> {
    load_sandbox(tx, id)
        .await?
        .ok_or_else(|| not_found("sandbox"))
}

/// Loads the caller's sandbox inside a write transaction, refusing a
/// quarantined one.
pub async fn load_mutable(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
) -> Result<SandboxRow, ControlError> {
    let row = load_sandbox(tx, id)
        .await?
        .filter(|row| row.org_id == org_id)
        .filter(|row| {
            row.ended_at_ms
                .is_none_or(|ended| ended > state.retained_since_ms())
        })
        .ok_or_else(|| not_found("sandbox"))?;
    if row.quarantined {
        return Err(ControlError::new(
            ErrorCode::Quarantined,
            "the sandbox is quarantined by an administrator",
        ));
    }
    Ok(row)
}

fn invalid_state(row: &SandboxRow, action: &str) -> ControlError {
    ControlError::new(
        ErrorCode::InvalidState,
        format!("cannot {action} a sandbox that is {}", row.state),
    )
    .with_details(serde_json::json!({ "state": row.state, "desired": row.desired }))
}

/// Stop asks for no compute. A sandbox not yet placed has none, so it is
/// stopped at once; a placed one stops when its runner reports it.
pub async fn stop(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
) -> Result<SandboxRow, ControlError> {
    let row = load_mutable(state, tx, org_id, id).await?;
    if row.state.is_terminal() || row.desired == DesiredState::Deleted {
        return Err(invalid_state(&row, "stop"));
    }
    // A stop asked after a command that waits for a wake is the last word:
    // the command never runs.
    records::commands::end_queued_waiting(tx, id, "stop_requested").await?;
    if row.start_after_stop {
        records::sandboxes::clear_start_after_stop(
            tx,
            &row,
            "stop_requested",
            "the start asked while it stopped is dropped: stopped as asked",
        )
        .await?;
    }
    if row.desired != DesiredState::Stopped {
        records::sandboxes::set_desired(tx, &row, DesiredState::Stopped, "stop_requested").await?;
        if row.runner_id.is_none() && row.state.awaits_placement() {
            let to = Transition {
                state: SandboxState::Stopped,
                reason: Some("stop_requested"),
                message: None,
            };
            set_sandbox_state(tx, &row, to, None, row.epoch).await?;
        }
    }
    reload(tx, id).await
}

/// Start asks for compute again: a stopped sandbox goes back to `pending`
/// and is placed (a standard one only on the runner that holds its home).
pub async fn start(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
) -> Result<SandboxRow, ControlError> {
    let row = load_mutable(state, tx, org_id, id).await?;
    // The runner may be acting on the stop already: wanting the sandbox
    // running now would let a command reach a runner that is stopping it.
    // The stop goes on, and the start follows it (`resume_after_stop`).
    if super::idle::stop_under_way(&row) {
        if !row.start_after_stop {
            records::sandboxes::set_start_after_stop(
                tx,
                &row,
                "start asked while the sandbox stops: it starts again once the stop is done",
            )
            .await?;
        }
        return reload(tx, id).await;
    }
    let why = Why {
        reason: "start_requested",
        message: None,
    };
    resume(state, tx, &row, &why).await
}

/// Why a sandbox is wanted running again: a start, or a wake (the reason
/// and message its events carry).
pub struct Why {
    pub reason: &'static str,
    /// What woke it (`woken by command cmd_…`); none for a start.
    pub message: Option<String>,
}

/// Wants the sandbox (loaded in `tx`, the caller's) running again, placing
/// it if it needs compute: what `start` does, for any cause.
pub async fn resume(
    state: &AppState,
    tx: &mut WriteTx,
    row: &SandboxRow,
    why: &Why,
) -> Result<SandboxRow, ControlError> {
    let id = row.id.as_str();
    if row.state.is_terminal()
        || row.desired == DesiredState::Deleted
        || row.desired == DesiredState::Terminated
    {
        return Err(invalid_state(row, "start"));
    }
    // Stopped while wanted running (the workload ended itself) also needs
    // compute again.
    let needs_compute = row.state == SandboxState::Stopped;
    if row.desired != DesiredState::Running || needs_compute {
        check_quotas(state, tx, &row.org_id, None).await?;
        if row.desired != DesiredState::Running {
            records::sandboxes::set_desired_saying(
                tx,
                row,
                DesiredState::Running,
                why.reason,
                why.message.as_deref().unwrap_or("desired running"),
            )
            .await?;
        }
        // A sandbox recovering while nobody wanted it running (its runner
        // was lost during a stop) is placed now, from its last save.
        if !needs_compute && row.state.awaits_placement() && row.runner_id.is_none() {
            let row = reload(tx, id).await?;
            place_or_wait(tx, &row).await?;
        }
        if needs_compute {
            let row = reload(tx, id).await?;
            // A standard home stays on its runner, which keeps it assigned
            // while the sandbox waits to be placed there again.
            let keep = (row.storage_class == StorageClass::Standard)
                .then_some(row.runner_id.as_deref())
                .flatten();
            let to = Transition {
                state: SandboxState::Pending,
                reason: Some(why.reason),
                message: why.message.as_deref(),
            };
            set_sandbox_state(tx, &row, to, keep, row.epoch).await?;
            let row = reload(tx, id).await?;
            place_or_wait(tx, &row).await?;
        }
    }
    reload(tx, id).await
}

/// Delete is idempotent by outcome: accepted once while the sandbox holds
/// anything (failed and terminated included), then `not_found`.
pub async fn delete(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
) -> Result<SandboxRow, ControlError> {
    let row = load_mutable(state, tx, org_id, id).await?;
    if row.desired == DesiredState::Deleted || row.state == SandboxState::Deleted {
        return Err(not_found("sandbox"));
    }
    records::sandboxes::set_desired(tx, &row, DesiredState::Deleted, "delete_requested").await?;
    let runner_alive = match &row.runner_id {
        Some(runner) => {
            let live: Option<(String,)> =
                sqlx::query_as("SELECT id FROM runners WHERE id = $1 AND state = 'live'")
                    .bind(runner)
                    .fetch_optional(&mut *tx.tx)
                    .await?;
            live.is_some()
        }
        None => false,
    };
    // With no runner holding anything, nothing is left to release.
    let to = if runner_alive {
        Transition {
            state: SandboxState::Deleting,
            reason: Some("delete_requested"),
            message: None,
        }
    } else {
        Transition {
            state: SandboxState::Deleted,
            reason: Some("delete_requested"),
            message: None,
        }
    };
    let runner = if runner_alive {
        row.runner_id.as_deref()
    } else {
        None
    };
    set_sandbox_state(tx, &row, to, runner, row.epoch).await?;
    reload(tx, id).await
}
