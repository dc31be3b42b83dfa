//! Emptying a runner: `drain` (maintenance) and `preempt` (its host is
//! going away: a spot instance's interruption notice). Either way nothing
//! new is placed on it, and each durable sandbox on it that should run is
//! handed to the runner as desired `stopped`: the runner secures the home
//! in the store (`stopping` → `securing` → `stopped`, the reason saying
//! why), and the stopped report puts the sandbox back in `pending`, from
//! where the scheduler places it on another runner, restoring the home it
//! just secured. Standard sandboxes cannot move (their home lives on the
//! runner): they keep running until they end, and on a preempted host they
//! end `failed`/`node_lost` with it.

use api::lifecycle::{DesiredState, SandboxState, StorageClass};

use super::AppState;
use crate::error::ControlError;
use crate::records::sandboxes::{MOVED_BY_DRAIN, MOVED_BY_PREEMPTION};
use crate::records::{SandboxRow, not_found, runners};
use api::ErrorCode;
use api::runners::RunnerRecord;

/// The desired state a runner is handed for `sandbox`: a durable sandbox
/// that should run on a runner being emptied is to be stopped (secured)
/// there, so it can run elsewhere.
pub fn desired_on(sandbox: &SandboxRow, drain: Option<&str>) -> DesiredState {
    if drain.is_some()
        && sandbox.storage_class == StorageClass::Durable
        && sandbox.desired == DesiredState::Running
    {
        DesiredState::Stopped
    } else {
        sandbox.desired
    }
}

/// The state reason a move off a runner being emptied shows.
pub fn reason_of(drain: &str) -> &'static str {
    if drain == "preempt" {
        MOVED_BY_PREEMPTION
    } else {
        MOVED_BY_DRAIN
    }
}

/// After a runner reported `reported` for a sandbox it is being emptied
/// of: the reason is the drain's, not a stop request's; once `stopped`
/// (home secured), the sandbox leaves the runner and waits to be placed
/// elsewhere. Returns the reason to record instead of the runner's.
pub fn drain_reason(
    row: &SandboxRow,
    reported: SandboxState,
    drain: Option<&str>,
) -> Option<&'static str> {
    let drain = drain?;
    let moving = row.storage_class == StorageClass::Durable
        && row.desired == DesiredState::Running
        && matches!(
            reported,
            SandboxState::Stopping | SandboxState::Securing | SandboxState::Stopped
        );
    moving.then(|| reason_of(drain))
}

/// Every runner not retired, as an administrator sees it.
pub async fn list(state: &AppState) -> Result<Vec<RunnerRecord>, ControlError> {
    Ok(runners::records(&state.db.pool).await?)
}

/// Sets or clears the runner's drain and wakes it (its assignments
/// change). Preempting an `on_demand` runner is refused: only spot
/// capacity is preempted; drain it instead.
pub async fn set_drain(
    state: &AppState,
    id: &str,
    drain: Option<&str>,
) -> Result<RunnerRecord, ControlError> {
    let mut tx = state.db.write().await?;
    let current = runners::record(&mut tx, id)
        .await?
        .ok_or_else(|| not_found("runner"))?;
    if drain == Some("preempt") && current.placement_class != "spot" {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "runner {id} is {}: only spot runners are preempted; drain it for maintenance",
                current.placement_class
            ),
        ));
    }
    // A preemption outranks a drain; a drain does not soften a preemption.
    let keep = current.drain.as_deref() == Some("preempt") && drain == Some("drain");
    if !keep {
        runners::set_drain(&mut tx, id, drain).await?;
    }
    tx.changed(&format!("runner:{id}"));
    let record = runners::record(&mut tx, id)
        .await?
        .ok_or_else(|| not_found("runner"))?;
    tx.commit().await?;
    if current.drain.as_deref() != record.drain.as_deref() {
        tracing::warn!(runner_id = %id, drain = ?record.drain, "runner drain changed");
    }
    Ok(record)
}
