//! Commands as the control plane rules them: queued only in a sandbox that
//! is wanted running; a queued one is cancelled outright, a started one is
//! signalled through its runner.

use api::ErrorCode;
use api::commands::CreateCommandRequest;
use api::lifecycle::{Activity, CommandState, DesiredState, SandboxState};

use super::{AppState, idle};
use crate::db::WriteTx;
use crate::error::ControlError;
use crate::limits;
use crate::records::{self, CommandRow, not_found};

/// Every bound a command request must hold.
pub fn validate(request: &CreateCommandRequest) -> Result<(), ControlError> {
    limits::argv(&request.argv)?;
    limits::env("env", &request.env)?;
    if let Some(cwd) = &request.cwd {
        limits::absolute_path("cwd", cwd)?;
    }
    if let Some(tty) = request.tty
        && !tty.is_valid()
    {
        return Err(limits::invalid(
            "tty",
            format!("1 to {} rows and columns", api::commands::TtySize::MAX),
        ));
    }
    if let Some(timeout) = request.timeout
        && (timeout == 0 || timeout > limits::COMMAND_TIMEOUT_SECONDS_MAX)
    {
        return Err(limits::invalid(
            "timeout",
            format!(
                "seconds, between 1 and {}",
                limits::COMMAND_TIMEOUT_SECONDS_MAX
            ),
        ));
    }
    Ok(())
}

/// Queues a command in the org's sandbox (its visibility already checked
/// by the caller). A sandbox that is not running nor on its way (asleep,
/// stopped by hand, stopping) is woken first unless its `auto_wake` is
/// off; the command then waits queued, marked `waited_for_wake`, and runs
/// once the sandbox does.
pub async fn create(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    sandbox_id: &str,
    request: &CreateCommandRequest,
) -> Result<CommandRow, ControlError> {
    validate(request)?;
    // The activity first: its row lock orders this command with a sleep
    // decision on another server (a command arriving at the deadline either
    // cancels the sleep or sees it, and wakes the sandbox).
    idle::touch(tx, org_id, sandbox_id, Activity::Command).await?;
    let mut sandbox = records::load_sandbox(tx, sandbox_id)
        .await?
        .filter(|s| s.org_id == org_id)
        .ok_or_else(|| not_found("sandbox"))?;
    if sandbox.quarantined {
        return Err(ControlError::new(
            ErrorCode::Quarantined,
            "the sandbox is quarantined by an administrator",
        ));
    }
    if sandbox.state.is_terminal()
        || matches!(
            sandbox.desired,
            DesiredState::Deleted | DesiredState::Terminated
        )
    {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "the sandbox is {} (desired {}): it cannot run commands",
                sandbox.state, sandbox.desired
            ),
        ));
    }
    let id = records::new_id("cmd")?;
    let woke = idle::needs_wake(&sandbox);
    if woke {
        sandbox = idle::wake_for_command(state, tx, &sandbox, &id).await?;
    }
    // It waits for a wake: its own, or one another command began.
    let waits = woke
        || (sandbox.state != SandboxState::Running
            && sandbox.desired_reason.as_deref() == Some(idle::WOKEN_BY_COMMAND));
    Ok(records::commands::insert(tx, &id, &sandbox, request, waits).await?)
}

/// A signal name a command may be sent (checked before the command is
/// looked up, so a bad request is 400 whatever it names).
pub fn check_signal(signal: &str) -> Result<(), ControlError> {
    if !api::commands::SIGNALS.contains(&signal) {
        return Err(limits::invalid(
            "signal",
            format!("one of {}", api::commands::SIGNALS.join(", ")),
        ));
    }
    Ok(())
}

/// Asks a command to end: a queued one never starts (`not_launched`), a
/// started one is signalled by its runner, which reports the end.
pub async fn signal(
    tx: &mut WriteTx,
    command: &CommandRow,
    signal: &str,
) -> Result<CommandRow, ControlError> {
    check_signal(signal)?;
    if command.ended() {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("the command has already ended ({})", command.state),
        ));
    }
    let updated = if command.state == CommandState::Queued {
        records::commands::cancel_queued(tx, &command.id).await?
    } else {
        records::commands::request_signal(tx, &command.id, signal).await?
    };
    if !updated {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            "the command changed state meanwhile; read it and retry",
        ));
    }
    if let Some(sandbox) = records::load_sandbox(tx, &command.sandbox_id).await?
        && let Some(runner) = &sandbox.runner_id
    {
        tx.changed(&format!("runner:{runner}"));
    }
    records::commands::load(tx, &command.id)
        .await?
        .ok_or_else(|| not_found("command"))
}
