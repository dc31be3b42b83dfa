//! The runner protocol (runner token). Runners register, renew a lease by
//! heartbeat, long-poll their assignments (level-triggered: the whole
//! desired state each time) and report what they observe. A report whose
//! runner or epoch is not the sandbox's current placement is 409 `fenced`
//! and changes nothing.

use api::lifecycle::{CommandState, DesiredState, SandboxState, StorageClass};
use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use sqlx::Row;

use super::commands::{COMMAND_COLUMNS, CommandRow};
use super::sandboxes::wait_timeout;
use super::{AppState, Caller, Json};
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::limits;
use crate::records::{
    self, SANDBOX_COLUMNS, SandboxRow, Transition, load_sandbox, not_found, set_sandbox_state,
};
use crate::scheduler::{RUNNER_COLUMNS, RunnerRow};
use api::ErrorCode;
use api::runners::{
    Assignments, CommandAssignment, CommandReport, HeartbeatRequest, HeartbeatResponse,
    RegisterRequest, RegisterResponse, SandboxAssignment, SandboxReport, SnapshotAssignment,
};

const CAPABILITIES_MAX: usize = 64;

pub(crate) fn fenced(message: impl Into<String>) -> ControlError {
    ControlError::new(ErrorCode::Fenced, message)
}

#[utoipa::path(post, path = "/v1/runner/register", tag = "runner", request_body = RegisterRequest, responses((status = 200, body = RegisterResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn register(
    State(state): State<AppState>,
    caller: Caller,
    Json(request): Json<RegisterRequest>,
) -> Result<(StatusCode, axum::Json<RegisterResponse>), ControlError> {
    caller.runner()?;
    limits::name("name", &request.name)?;
    if !["spot", "on_demand"].contains(&request.placement_class.as_str()) {
        return Err(limits::invalid("placement_class", "spot or on_demand"));
    }
    limits::labels(&request.labels)?;
    if request.capabilities.len() > CAPABILITIES_MAX {
        return Err(limits::invalid(
            "capabilities",
            format!("more than {CAPABILITIES_MAX}"),
        ));
    }
    for capability in &request.capabilities {
        limits::name("capabilities", capability)?;
    }
    let capacity = &request.capacity;
    if !(capacity.cpus.is_finite() && capacity.cpus >= 0.0) {
        return Err(limits::invalid("capacity.cpus", "a number of CPUs"));
    }
    let now = now_ms();
    let lease_ms = state.config.lease_ttl.as_millis() as i64;
    let labels = serde_json::to_string(&request.labels).unwrap_or_default();
    let capabilities = serde_json::to_string(&request.capabilities).unwrap_or_default();
    let millicpus = (capacity.cpus * 1000.0).round() as i64;
    let mut tx = state.db.write().await?;
    let existing = match &request.runner_id {
        Some(id) => sqlx::query("SELECT id FROM runners WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *tx.tx)
            .await?
            .map(|_| id.clone()),
        None => None,
    };
    let runner_id = match existing {
        Some(id) => {
            sqlx::query(
                "UPDATE runners SET name = $1, placement_class = $2, labels = $3, capabilities = $4, capacity_sandboxes = $5, capacity_memory_mib = $6, capacity_millicpus = $7, capacity_pids = $8, state = 'live', lease_expires_at_ms = $9 WHERE id = $10",
            )
            .bind(&request.name)
            .bind(&request.placement_class)
            .bind(&labels)
            .bind(&capabilities)
            .bind(capacity.sandboxes as i64)
            .bind(capacity.memory_mib as i64)
            .bind(millicpus)
            .bind(capacity.pids as i64)
            .bind(now + lease_ms)
            .bind(&id)
            .execute(&mut *tx.tx)
            .await?;
            id
        }
        None => {
            let id = records::new_id("rnr")?;
            sqlx::query(
                "INSERT INTO runners (id, name, placement_class, labels, capabilities, capacity_sandboxes, capacity_memory_mib, capacity_millicpus, capacity_pids, state, lease_expires_at_ms, registered_at_ms, placements)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'live', $10, $11, 0)",
            )
            .bind(&id)
            .bind(&request.name)
            .bind(&request.placement_class)
            .bind(&labels)
            .bind(&capabilities)
            .bind(capacity.sandboxes as i64)
            .bind(capacity.memory_mib as i64)
            .bind(millicpus)
            .bind(capacity.pids as i64)
            .bind(now + lease_ms)
            .bind(now)
            .execute(&mut *tx.tx)
            .await?;
            id
        }
    };
    tx.commit().await?;
    tracing::info!(%runner_id, name = %request.name, "runner registered");
    // New capacity: place what has been waiting for it.
    crate::reconcile::schedule_pending(&state).await?;
    Ok((
        StatusCode::OK,
        axum::Json(RegisterResponse {
            runner_id,
            lease_ttl_ms: lease_ms as u64,
            heartbeat_interval_ms: (lease_ms / 3) as u64,
            freeze_after_ms: crate::freeze_after(state.config.lease_ttl).as_millis() as u64,
        }),
    ))
}

pub(crate) async fn live_runner(
    tx: &mut WriteTx,
    runner_id: &str,
) -> Result<RunnerRow, ControlError> {
    let row = sqlx::query(&format!(
        "SELECT {RUNNER_COLUMNS} FROM runners WHERE id = $1"
    ))
    .bind(runner_id)
    .fetch_optional(&mut *tx.tx)
    .await?
    .ok_or_else(|| not_found("runner"))?;
    let runner = RunnerRow::from_row(&row)?;
    if runner.state != "live" {
        return Err(fenced(
            "this runner's lease expired and its sandboxes were taken from it; register again",
        ));
    }
    Ok(runner)
}

#[utoipa::path(post, path = "/v1/runner/heartbeat", tag = "runner", request_body = HeartbeatRequest, responses((status = 200, body = HeartbeatResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn heartbeat(
    State(state): State<AppState>,
    caller: Caller,
    Json(request): Json<HeartbeatRequest>,
) -> Result<axum::Json<HeartbeatResponse>, ControlError> {
    caller.runner()?;
    let lease_ms = state.config.lease_ttl.as_millis() as i64;
    let mut tx = state.db.write().await?;
    live_runner(&mut tx, &request.runner_id).await?;
    // Renewed only while still live: a lease the watcher has expired
    // stays expired (the runner must register again).
    let renewed =
        sqlx::query("UPDATE runners SET lease_expires_at_ms = $1 WHERE id = $2 AND state = 'live'")
            .bind(now_ms() + lease_ms)
            .bind(&request.runner_id)
            .execute(&mut *tx.tx)
            .await?;
    if renewed.rows_affected() == 0 {
        return Err(fenced("lease expired; register again"));
    }
    tx.commit().await?;
    Ok(axum::Json(HeartbeatResponse {
        lease_expires_in_ms: lease_ms as u64,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignmentsQuery {
    runner_id: String,
    #[serde(default)]
    etag: String,
    timeout: Option<u64>,
}

#[utoipa::path(get, path = "/v1/runner/assignments", tag = "runner", params(("runner_id" = String, Query), ("etag" = Option<String>, Query), ("timeout" = Option<u64>, Query)), responses((status = 200, body = Assignments), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn assignments(
    State(state): State<AppState>,
    caller: Caller,
    Query(query): Query<AssignmentsQuery>,
) -> Result<axum::Json<Assignments>, ControlError> {
    caller.runner()?;
    let timeout = match query.timeout {
        None | Some(0) => std::time::Duration::ZERO,
        Some(t) => wait_timeout(Some(t))?,
    };
    let watch = state.db.hub.watch(&format!("runner:{}", query.runner_id));
    let assignments = crate::hub::wait_until(
        &watch,
        timeout,
        || read_assignments(&state, &query.runner_id),
        |a: &Assignments| a.etag != query.etag,
    )
    .await?;
    Ok(axum::Json(assignments))
}

/// Everything placed on the runner. Queued commands of running sandboxes
/// are handed over here (`starting`, with the sandbox's epoch); they stay
/// in every answer until the runner reports them, so a lost answer loses
/// nothing.
async fn read_assignments(state: &AppState, runner_id: &str) -> Result<Assignments, ControlError> {
    let mut tx = state.db.write().await?;
    let runner = live_runner(&mut tx, runner_id).await?;
    let handed = sqlx::query(
        "UPDATE commands SET state = 'starting', epoch = (SELECT epoch FROM sandboxes s WHERE s.id = commands.sandbox_id)
         WHERE state = 'queued' AND sandbox_id IN (SELECT id FROM sandboxes WHERE runner_id = $1 AND state = 'running' AND desired = 'running') RETURNING id",
    )
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    for row in &handed {
        let id: String = row.try_get("id")?;
        tx.changed(&id).await?;
    }
    let sandboxes = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE runner_id = $1 AND state <> 'deleted' ORDER BY id"
    ))
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    let mut snapshots: BTreeMap<String, Vec<SnapshotAssignment>> = BTreeMap::new();
    let pending = sqlx::query(
        "SELECT id, sandbox_id, durability FROM snapshots WHERE durability IN ('pending', 'local')
         AND sandbox_id IN (SELECT id FROM sandboxes WHERE runner_id = $1) ORDER BY id",
    )
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    for row in &pending {
        snapshots
            .entry(row.try_get("sandbox_id")?)
            .or_default()
            .push(SnapshotAssignment {
                snapshot_id: row.try_get("id")?,
                durability: row.try_get("durability")?,
            });
    }
    let sandboxes: Vec<SandboxAssignment> = sandboxes
        .iter()
        .map(|row| {
            let s = SandboxRow::from_row(row)?;
            Ok(SandboxAssignment {
                sandbox_id: s.id.clone(),
                org_id: s.org_id.clone(),
                epoch: s.epoch as u64,
                desired: super::drain::desired_on(&s, runner.drain.as_deref()),
                state: s.state,
                image: s.image.clone(),
                image_root: s.image_root.clone(),
                storage_class: s.storage_class,
                resources: s.resources(),
                network: s.network,
                env: records::json_map(&s.env),
                home_root: s.home.root.clone(),
                save_interval_s: s.home.save_interval_s.map(|i| i as u64),
                snapshots: snapshots.remove(&s.id).unwrap_or_default(),
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    let commands = sqlx::query(&format!(
        "SELECT {COMMAND_COLUMNS} FROM commands WHERE state IN {}
         AND sandbox_id IN (SELECT id FROM sandboxes WHERE runner_id = $1) ORDER BY id",
        CommandState::sql_in(CommandState::on_runner)
    ))
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    let commands: Vec<CommandAssignment> = commands
        .iter()
        .map(|row| {
            let c = CommandRow::from_row(row)?;
            Ok(CommandAssignment {
                command_id: c.id.clone(),
                sandbox_id: c.sandbox_id.clone(),
                epoch: c.epoch.unwrap_or(0) as u64,
                argv: c.argv(),
                env: records::json_map(&c.env),
                cwd: c.cwd.clone(),
                timeout: c.timeout_s.map(|t| t as u64),
                signal: c.signal_requested.clone(),
                state: c.state,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    tx.commit().await?;
    let body = serde_json::to_vec(&(&sandboxes, &commands)).unwrap_or_default();
    Ok(Assignments {
        etag: blake3::hash(&body).to_hex()[..32].to_owned(),
        sandboxes,
        commands,
    })
}

/// Checks the report is from the sandbox's current placement.
pub(crate) fn check_placement(
    row: &SandboxRow,
    runner_id: &str,
    epoch: u64,
) -> Result<(), ControlError> {
    if row.runner_id.as_deref() != Some(runner_id) || row.epoch as u64 != epoch {
        return Err(fenced(format!(
            "stale placement: the sandbox is at epoch {} on {}; this report is for epoch {epoch} on {runner_id}",
            row.epoch,
            row.runner_id.as_deref().unwrap_or("no runner")
        ))
        .with_details(serde_json::json!({ "current_epoch": row.epoch })));
    }
    Ok(())
}

#[utoipa::path(post, path = "/v1/runner/sandboxes/{id}/report", tag = "runner", params(("id" = String, Path, description = "sandbox id")), request_body = SandboxReport, responses((status = 200, body = api::sandboxes::Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report_sandbox(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(report): Json<SandboxReport>,
) -> Result<axum::Json<api::sandboxes::Sandbox>, ControlError> {
    caller.runner()?;
    if let Some(reason) = &report.reason {
        limits::name("reason", reason)?;
    }
    let message = report.message.as_deref().map(|m| {
        let mut m = m.to_owned();
        m.truncate(1024);
        m
    });
    let mut tx = state.db.write().await?;
    let runner = live_runner(&mut tx, &report.runner_id).await?;
    let row = load_sandbox(&mut tx, &id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    check_placement(&row, &report.runner_id, report.epoch)?;
    let drain_reason = super::drain::drain_reason(&row, report.state, runner.drain.as_deref());
    // What a wake cost, counted once the move to `running` is committed.
    let mut woke = None;
    if row.state != report.state {
        if !row.state.runner_may_report(report.state, row.desired) {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                format!(
                    "a runner cannot move a sandbox from {} to {}",
                    row.state, report.state
                ),
            ));
        }
        // A deleted sandbox no longer holds anything on its runner.
        let runner_drain = runner.drain.clone();
        let runner = (report.state != SandboxState::Deleted).then_some(report.runner_id.as_str());
        let to = Transition {
            state: report.state,
            reason: drain_reason.or(report.reason.as_deref()),
            message: message.as_deref(),
        };
        if !set_sandbox_state(&mut tx, &row, to, runner, row.epoch).await? {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                "the sandbox changed meanwhile; read the assignments and report again",
            ));
        }
        if report.state == SandboxState::Deleted {
            tx.changed(&format!("runner:{}", report.runner_id)).await?;
        }
        if report.state == SandboxState::Running {
            woke = report.wake.clone();
        }
        // Wanted running once its home is secured: moved off a runner
        // being emptied, or started again while it was securing.
        if report.state == SandboxState::Stopped
            && row.storage_class == StorageClass::Durable
            && row.desired == DesiredState::Running
        {
            let again = match (&runner_drain, report.reason.as_deref()) {
                (Some(drain), _) => Some((
                    super::drain::reason_of(drain),
                    "home secured; placing it on another runner",
                )),
                (None, Some("stop_requested")) => {
                    Some(("start_requested", "home secured; started again"))
                }
                _ => None,
            };
            if let Some((reason, message)) = again {
                crate::control::placement::place_secured(&mut tx, &id, reason, message).await?;
            }
        }
    }
    let record = load_sandbox(&mut tx, &id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    tx.commit().await?;
    if let Some(wake) = woke {
        state
            .metrics
            .woke(wake.downloaded_bytes, wake.from_own_copy);
    }
    Ok(axum::Json(record.to_api()))
}

/// The command and its sandbox, checked to be this runner's at `epoch`.
async fn runner_command(
    tx: &mut WriteTx,
    id: &str,
    runner_id: &str,
    epoch: u64,
) -> Result<CommandRow, ControlError> {
    live_runner(tx, runner_id).await?;
    let row = sqlx::query(&format!(
        "SELECT {COMMAND_COLUMNS} FROM commands WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?
    .ok_or_else(|| not_found("command"))?;
    let command = CommandRow::from_row(&row)?;
    let sandbox = load_sandbox(tx, &command.sandbox_id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    check_placement(&sandbox, runner_id, epoch)?;
    if command.epoch != Some(epoch as i64) {
        return Err(fenced("the command was handed over under another epoch"));
    }
    Ok(command)
}

#[utoipa::path(post, path = "/v1/runner/commands/{id}/report", tag = "runner", params(("id" = String, Path)), request_body = CommandReport, responses((status = 200, body = api::commands::Command), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report_command(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(report): Json<CommandReport>,
) -> Result<axum::Json<api::commands::Command>, ControlError> {
    caller.runner()?;
    if let Some(reason) = &report.reason {
        limits::name("reason", reason)?;
    }
    if let Some(signal) = &report.signal
        && !api::commands::SIGNALS.contains(&signal.as_str())
    {
        return Err(limits::invalid(
            "signal",
            format!("one of {}", api::commands::SIGNALS.join(", ")),
        ));
    }
    let mut tx = state.db.write().await?;
    let command = runner_command(&mut tx, &id, &report.runner_id, report.epoch).await?;
    let to = report.state;
    if command.state != to {
        if !command.state.runner_may_report(to) {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                format!("a command cannot go from {} to {to}", command.state),
            ));
        }
        if to == CommandState::Exited && report.exit_code.is_none() {
            return Err(limits::invalid("exit_code", "an exited command has one"));
        }
        let now = now_ms();
        let ended = to.is_end().then_some(now);
        let updated = sqlx::query(
            "UPDATE commands SET state = $1, state_reason = $2, exit_code = $3, signal = $4, started_at_ms = COALESCE(started_at_ms, $5), ended_at_ms = $6 WHERE id = $7 AND state = $8",
        )
        .bind(to.as_str())
        .bind(&report.reason)
        .bind(report.exit_code.map(i64::from))
        .bind(&report.signal)
        .bind((to == CommandState::Running).then_some(now))
        .bind(ended)
        .bind(&id)
        .bind(command.state.as_str())
        .execute(&mut *tx.tx)
        .await?;
        if updated.rows_affected() == 0 {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                "the command changed meanwhile",
            ));
        }
        tx.changed(&id).await?;
        tx.changed(&format!("runner:{}", report.runner_id)).await?;
    }
    let row = sqlx::query(&format!(
        "SELECT {COMMAND_COLUMNS} FROM commands WHERE id = $1"
    ))
    .bind(&id)
    .fetch_one(&mut *tx.tx)
    .await?;
    tx.commit().await?;
    Ok(axum::Json(CommandRow::from_row(&row)?.to_api()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputAppend {
    runner_id: String,
    epoch: u64,
    offset: u64,
}

/// Appends output at `offset` (the stream's length as the runner knows it).
/// A retry of bytes already stored is accepted and skipped; a gap is 409.
/// Output is complete once the command has ended (readers are told so),
/// so a runner appends everything before it reports the end; bytes for an
/// ended command are refused (409) unless they are a retry.
#[utoipa::path(put, path = "/v1/runner/commands/{id}/output/{stream}", tag = "runner", params(("id" = String, Path), ("stream" = String, Path), ("runner_id" = String, Query), ("epoch" = u64, Query), ("offset" = u64, Query)), request_body(content = Vec<u8>, content_type = "application/octet-stream"), responses((status = 200, description = "the stream length"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn append_output(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, stream)): Path<(String, String)>,
    Query(query): Query<OutputAppend>,
    body: Bytes,
) -> Result<axum::Json<BTreeMap<String, u64>>, ControlError> {
    caller.runner()?;
    let column = match stream.as_str() {
        "stdout" => "stdout_bytes",
        "stderr" => "stderr_bytes",
        _ => return Err(not_found("stream")),
    };
    let mut tx = state.db.write().await?;
    let command = runner_command(&mut tx, &id, &query.runner_id, query.epoch).await?;
    let length = if column == "stdout_bytes" {
        command.stdout_bytes
    } else {
        command.stderr_bytes
    } as u64;
    if query.offset > length {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "offset {} leaves a gap: the stream has {length} bytes",
                query.offset
            ),
        )
        .with_details(serde_json::json!({ "length": length })));
    }
    let skip = (length - query.offset) as usize;
    if skip < body.len() && command.ended() {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "the command has ended ({}); its output is complete",
                command.state
            ),
        ));
    }
    if skip < body.len() {
        let fresh = &body[skip..];
        sqlx::query(
            "INSERT INTO command_output (command_id, stream, start_offset, data) VALUES ($1, $2, $3, $4)",
        )
        .bind(&id)
        .bind(&stream)
        .bind(length as i64)
        .bind(fresh.to_vec())
        .execute(&mut *tx.tx)
        .await?;
        sqlx::query(&format!(
            "UPDATE commands SET {column} = {column} + $1 WHERE id = $2"
        ))
        .bind(fresh.len() as i64)
        .bind(&id)
        .execute(&mut *tx.tx)
        .await?;
        tx.changed(&id).await?;
    }
    tx.commit().await?;
    let new_length = length.max(query.offset + body.len() as u64);
    Ok(axum::Json(BTreeMap::from([(
        "length".to_owned(),
        new_length,
    )])))
}
