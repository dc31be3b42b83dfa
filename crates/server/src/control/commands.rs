//! Commands as the control plane rules them: queued only in a sandbox that
//! is wanted running; a queued one is cancelled outright, a started one is
//! signalled through its runner.

use api::ErrorCode;
use api::commands::CreateCommandRequest;
use api::lifecycle::{CommandState, DesiredState};

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

/// Queues a command in the org's sandbox (loaded in `tx`; its visibility
/// already checked by the caller).
pub async fn create(
    tx: &mut WriteTx,
    org_id: &str,
    sandbox_id: &str,
    request: &CreateCommandRequest,
) -> Result<CommandRow, ControlError> {
    validate(request)?;
    let sandbox = records::load_sandbox(tx, sandbox_id)
        .await?
        .filter(|s| s.org_id == org_id)
        .ok_or_else(|| not_found("sandbox"))?;
    if sandbox.quarantined {
        return Err(ControlError::new(
            ErrorCode::Quarantined,
            "the sandbox is quarantined by an administrator",
        ));
    }
    if sandbox.desired != DesiredState::Running || sandbox.state.is_terminal() {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "the sandbox is {} (desired {}): start it before running commands",
                sandbox.state, sandbox.desired
            ),
        ));
    }
    let id = records::new_id("cmd")?;
    Ok(records::commands::insert(tx, &id, &sandbox, request).await?)
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
        tx.changed(&format!("runner:{runner}")).await?;
    }
    records::commands::load(tx, &command.id)
        .await?
        .ok_or_else(|| not_found("command"))
}
