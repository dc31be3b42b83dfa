//! Placing a sandbox on a runner, or recording why it waits or cannot run;
//! and putting a sandbox that stopped while wanted running back in line
//! for placement.

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

/// Moves a sandbox that is wanted running but was just reported `stopped`
/// (moved off a runner being emptied, or started again while it stopped)
/// back to `pending`, and tries to place it, as `start` does for a
/// stopped one: a durable home was secured, so it leaves its runner (the
/// scheduler prefers that runner unless it drains); a standard home stays
/// on its runner, which keeps it assigned meanwhile.
pub async fn place_again(
    tx: &mut WriteTx,
    id: &str,
    reason: &str,
    message: &str,
) -> Result<(), ControlError> {
    let Some(row) = load_sandbox(tx, id).await? else {
        return Ok(());
    };
    if row.state != SandboxState::Stopped || row.desired != DesiredState::Running {
        return Ok(());
    }
    let keep = match row.storage_class {
        StorageClass::Durable => None,
        StorageClass::Standard => row.runner_id.as_deref(),
    };
    let to = Transition {
        state: SandboxState::Pending,
        reason: Some(reason),
        message: Some(message),
    };
    set_sandbox_state(tx, &row, to, keep, row.epoch).await?;
    if let Some(row) = load_sandbox(tx, id).await? {
        place_or_wait(tx, &row).await?;
    }
    Ok(())
}
