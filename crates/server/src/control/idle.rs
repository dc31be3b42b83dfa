//! Sleeping when idle and waking on use (README "Idle sandboxes").
//!
//! A running sandbox whose idle deadline passes with no command queued or
//! running is stopped (`idle`): an ordinary stop, so a durable home is
//! secured before it is `stopped`. A command sent to a stopped sandbox
//! (asleep or stopped by hand) wakes it unless `auto_wake` is off: the
//! sandbox is wanted running again under the same id, the command waits
//! queued and runs once it is. Activity is only what
//! `api::lifecycle::Activity` lists.

use api::ErrorCode;
use api::lifecycle::{Activity, DesiredState, SandboxState};
use api::sandboxes::UpdateSandboxRequest;

use super::AppState;
use super::sandboxes::{Why, load_mutable, reload, resume};
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::limits;
use crate::records::activity::{self, Claim};
use crate::records::{self, SandboxRow};

/// Sandboxes the idle pass decides on per transaction batch.
const BATCH: i64 = 100;

/// The reason of a sleep, on the desired change, the stop's states and
/// their events.
pub const IDLE: &str = "idle";
/// The reason of a wake by a command.
pub const WOKEN_BY_COMMAND: &str = "woken_by_command";

/// An idle timeout as asked (`None`: the deployment's default), checked
/// against the deployment's bounds: `0` (never) or within them.
pub fn timeout_s(state: &AppState, asked: Option<u64>) -> Result<i64, ControlError> {
    let config = &state.config;
    let timeout = asked.unwrap_or_else(|| config.idle_timeout.as_secs());
    let (min, max) = (
        config.idle_timeout_min.as_secs(),
        config.idle_timeout_max.as_secs(),
    );
    if timeout != 0 && !(min..=max).contains(&timeout) {
        return Err(limits::invalid(
            "idle_timeout_s",
            format!("seconds: 0 (never) or between {min} and {max} in this deployment"),
        ));
    }
    Ok(timeout as i64)
}

/// `PATCH /v1/sandboxes/{id}`: a new idle policy (absent fields stay).
pub async fn update(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
    request: &UpdateSandboxRequest,
) -> Result<SandboxRow, ControlError> {
    let timeout = request
        .idle_timeout_s
        .map(|asked| timeout_s(state, Some(asked)))
        .transpose()?;
    let row = load_mutable(state, tx, org_id, id).await?;
    if row.state.is_terminal() || row.desired == DesiredState::Deleted {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("the sandbox is {}: nothing to change", row.state),
        ));
    }
    let timeout = timeout.unwrap_or(row.idle.timeout_s);
    let auto_wake = request.auto_wake.unwrap_or(row.idle.auto_wake);
    activity::set_policy(tx, id, timeout, auto_wake).await?;
    reload(tx, id).await
}

/// `POST /v1/sandboxes/{id}/keepalive`: activity, nothing else. It does
/// not wake a stopped sandbox (a command does): refused with 409 then.
pub async fn keepalive(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
) -> Result<SandboxRow, ControlError> {
    // The activity first: its row lock orders it with a sleep decision.
    touch(tx, org_id, id, Activity::Keepalive).await?;
    let row = load_mutable(state, tx, org_id, id).await?;
    if row.desired == DesiredState::Deleted || row.state == SandboxState::Deleted {
        return Err(records::not_found("sandbox"));
    }
    if row.desired != DesiredState::Running || row.state.is_terminal() {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "the sandbox is {} (desired {}): a keepalive does not wake it; send a command or start it",
                row.state, row.desired
            ),
        ));
    }
    reload(tx, id).await
}

/// Records `activity` on the org's sandbox in `tx`. An activity is written
/// before anything else is decided in its transaction: its row lock
/// orders it with any sleep decision (`records::activity`).
pub async fn touch(
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
    activity: Activity,
) -> Result<(), ControlError> {
    if !activity::touch_org_row(tx, org_id, id, activity, now_ms()).await? {
        return Err(records::not_found("sandbox"));
    }
    Ok(())
}

/// Records `activity` in a transaction of its own (a stream opened, a file
/// call): for requests that write nothing else.
pub async fn record(
    state: &AppState,
    org_id: &str,
    id: &str,
    activity: Activity,
) -> Result<(), ControlError> {
    let mut tx = state.db.write().await?;
    touch(&mut tx, org_id, id, activity).await?;
    tx.commit().await?;
    Ok(())
}

/// Whether a command sent to `row` must first wake it: it is not running
/// and not on its way to running.
pub fn needs_wake(row: &SandboxRow) -> bool {
    row.desired != DesiredState::Running || row.state == SandboxState::Stopped
}

/// Whether a stop of the sandbox is decided but not done: it is wanted
/// stopped and its runner still holds its compute (it may not have read
/// the stop yet). A command must not reach that runner now: it waits for
/// the stop to finish, then wakes the sandbox (`resume_after_stop`).
pub fn stop_under_way(row: &SandboxRow) -> bool {
    row.desired == DesiredState::Stopped
        && row.runner_id.is_some()
        && matches!(
            row.state,
            SandboxState::Starting
                | SandboxState::Running
                | SandboxState::Stopping
                | SandboxState::Securing
        )
}

/// Wakes the sandbox for `command_id` (in the caller's transaction), or
/// refuses as `invalid_state` when its `auto_wake` is off. While a stop is
/// under way the wake waits for it (the command stays queued): the runner
/// may be acting on the stop already, and a command handed over now would
/// be cut short by it.
pub async fn wake_for_command(
    state: &AppState,
    tx: &mut WriteTx,
    row: &SandboxRow,
    command_id: &str,
) -> Result<SandboxRow, ControlError> {
    if !row.idle.auto_wake {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "the sandbox is {} (desired {}) and its auto_wake is off: start it before running commands",
                row.state, row.desired
            ),
        )
        .with_details(serde_json::json!({ "state": row.state, "desired": row.desired })));
    }
    if stop_under_way(row) {
        records::sandboxes::note_wake_requested(
            tx,
            row,
            &format!("command {command_id} arrived while the sandbox stops: it starts again once the stop is done"),
        )
        .await?;
        return reload(tx, &row.id).await;
    }
    let why = Why {
        reason: WOKEN_BY_COMMAND,
        message: Some(format!("woken by command {command_id}")),
    };
    let woken = resume(state, tx, row, &why).await?;
    state.metrics.woken("command");
    Ok(woken)
}

/// After a stop ended (`stopped`, or `recovering` once its runner was
/// lost): a start asked meanwhile, or commands waiting for a wake, start
/// the sandbox now. Should that be refused (a quota), the waiting commands
/// end `not_launched` saying why and the refusal is in the history;
/// nothing else of the caller's change is undone.
pub async fn resume_after_stop(
    state: &AppState,
    tx: &mut WriteTx,
    sandbox_id: &str,
) -> Result<(), ControlError> {
    let row = reload(tx, sandbox_id).await?;
    if row.desired != DesiredState::Stopped || row.state.is_terminal() {
        return Ok(());
    }
    let why = if row.start_after_stop {
        Why {
            reason: "start_requested",
            message: Some("started as asked while it stopped".to_owned()),
        }
    } else {
        let Some(command_id) = records::commands::first_waiting_for_wake(tx, sandbox_id).await?
        else {
            return Ok(());
        };
        if !row.idle.auto_wake {
            records::commands::end_queued(tx, sandbox_id, "auto_wake_off").await?;
            return Ok(());
        }
        Why {
            reason: WOKEN_BY_COMMAND,
            message: Some(format!(
                "woken by command {command_id}, which arrived while it stopped"
            )),
        }
    };
    match resume(state, tx, &row, &why).await {
        Ok(_) => {
            if why.reason == WOKEN_BY_COMMAND {
                state.metrics.woken("command");
            }
            Ok(())
        }
        Err(refused) if refused.code == ErrorCode::QuotaExceeded => {
            if row.start_after_stop {
                records::sandboxes::clear_start_after_stop(
                    tx,
                    &row,
                    "start_refused",
                    &refused.message,
                )
                .await?;
            }
            records::commands::end_queued(tx, sandbox_id, "wake_refused_quota").await?;
            Ok(())
        }
        Err(other) => Err(other),
    }
}

/// The idle pass: every sandbox whose deadline passed by `now` is decided
/// on in a transaction of its own (see `records::activity::claim_sleep`):
/// stopped with reason `idle` when nothing is queued or running, else its
/// deadline moves on. Servers running it at once decide each sandbox once.
pub async fn sleep_due(state: &AppState, now: i64) -> Result<usize, ControlError> {
    let mut slept = 0;
    for id in activity::due(&state.db.pool, now, BATCH).await? {
        let mut tx = state.db.write().await?;
        if activity::claim_sleep(&mut tx, &id, now).await? != Claim::Idle {
            tx.commit().await?;
            continue;
        }
        let row = reload(&mut tx, &id).await?;
        let idle_s = row.idle.timeout_s;
        let message = match (&row.idle.last_activity, row.idle.last_activity_at_ms) {
            (Some(what), Some(at)) => format!(
                "no activity for {idle_s}s (the last: {what} at {}): going to sleep",
                records::rfc3339(at)
            ),
            _ => format!("no activity for {idle_s}s: going to sleep"),
        };
        records::sandboxes::set_desired_saying(
            &mut tx,
            &row,
            DesiredState::Stopped,
            IDLE,
            &message,
        )
        .await?;
        tx.commit().await?;
        state.metrics.idle_decided();
        tracing::info!(sandbox_id = %id, idle_s, "idle: going to sleep");
        slept += 1;
    }
    Ok(slept)
}
