//! Placing a sandbox on a runner, or recording why it waits or cannot run;
//! and putting a secured durable sandbox that is wanted running back in
//! line for placement.

use api::lifecycle::{DesiredState, SandboxState, StorageClass};

use crate::db::WriteTx;
use crate::error::ControlError;
use crate::records::{SandboxRow, Transition, load_sandbox, set_sandbox_state};
use crate::scheduler::{self, Placed};

/// Places the sandbox, or records why it waits or cannot run.
pub async fn place_or_wait(tx: &mut WriteTx, row: &SandboxRow) -> Result<(), ControlError> {
    match scheduler::place(tx, row).await? {
        Placed::On(_) | Placed::Raced => {}
        // A recovering sandbox keeps saying why it is recovering.
        Placed::Waiting(_) if row.state != SandboxState::Pending => {}
        Placed::Waiting(reason) => {
            crate::records::sandboxes::set_waiting_reason(tx, row, reason).await?;
        }
        Placed::HomeLost => {
            let to = Transition {
                state: SandboxState::Failed,
                reason: Some("node_lost"),
                message: Some("the runner holding this standard home is gone"),
            };
            set_sandbox_state(tx, row, to, None, row.epoch).await?;
        }
    }
    Ok(())
}

/// Moves a durable sandbox that is wanted running but was just secured and
/// reported `stopped` (moved off a runner being emptied, or started again
/// while it was securing) back to `pending` with no runner, and tries to
/// place it: the scheduler prefers its last runner unless that one drains.
pub async fn place_secured(
    tx: &mut WriteTx,
    id: &str,
    reason: &str,
    message: &str,
) -> Result<(), ControlError> {
    let Some(row) = load_sandbox(tx, id).await? else {
        return Ok(());
    };
    if row.state != SandboxState::Stopped
        || row.desired != DesiredState::Running
        || row.storage_class != StorageClass::Durable
    {
        return Ok(());
    }
    let to = Transition {
        state: SandboxState::Pending,
        reason: Some(reason),
        message: Some(message),
    };
    set_sandbox_state(tx, &row, to, None, row.epoch).await?;
    if let Some(row) = load_sandbox(tx, id).await? {
        place_or_wait(tx, &row).await?;
    }
    Ok(())
}
