//! The runner protocol over HTTP (a runner's credential; a runner token
//! only registers): check the runner named is the caller, parse, call
//! `control::runner_protocol`, render. Assignments are long-polled: the
//! answer comes when its etag differs from the runner's.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;

use super::sandboxes::wait_timeout;
use super::{AppState, Json, Path, Query, RegistrantCaller, RunnerCaller};
use crate::control::runner_protocol::{self, OutputAt};
use crate::error::ControlError;
use crate::records::commands::Stream;
use crate::records::not_found;
use api::runners::{
    Assignments, CommandReport, HeartbeatRequest, HeartbeatResponse, RegisterRequest,
    RegisterResponse, SandboxReport,
};

#[utoipa::path(post, path = "/v1/runner/register", tag = "runner", request_body = RegisterRequest, responses((status = 200, body = RegisterResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn register(
    State(state): State<AppState>,
    RegistrantCaller(registrant): RegistrantCaller,
    Json(request): Json<RegisterRequest>,
) -> Result<(StatusCode, axum::Json<RegisterResponse>), ControlError> {
    let registered = runner_protocol::register(&state, &registrant, &request).await?;
    Ok((StatusCode::OK, axum::Json(registered)))
}

#[utoipa::path(post, path = "/v1/runner/heartbeat", tag = "runner", request_body = HeartbeatRequest, responses((status = 200, body = HeartbeatResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn heartbeat(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Json(request): Json<HeartbeatRequest>,
) -> Result<axum::Json<HeartbeatResponse>, ControlError> {
    runner.speaks_for(&request.runner_id)?;
    Ok(axum::Json(
        runner_protocol::heartbeat(&state, &request).await?,
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignmentsQuery {
    runner_id: String,
    #[serde(default)]
    etag: String,
    timeout: Option<u64>,
    /// The runner takes `unchanged: true` for an answer.
    #[serde(default)]
    unchanged: bool,
}

#[utoipa::path(get, path = "/v1/runner/assignments", tag = "runner", params(("runner_id" = String, Query), ("etag" = Option<String>, Query), ("timeout" = Option<u64>, Query, minimum = 0, maximum = 25, description = "seconds to wait for a change past etag, at most 25"), ("unchanged" = Option<bool>, Query, description = "an answer at the timeout whose set is still etag's may be `unchanged: true` with empty lists")), responses((status = 200, body = Assignments), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn assignments(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Query(query): Query<AssignmentsQuery>,
) -> Result<axum::Json<Assignments>, ControlError> {
    runner.speaks_for(&query.runner_id)?;
    let timeout = match query.timeout {
        None | Some(0) => std::time::Duration::ZERO,
        Some(t) => wait_timeout(Some(t))?,
    };
    let key = format!("runner:{}", query.runner_id);
    let hub = &state.db.hub;
    let watch = hub.watch(&key);
    let deadline = tokio::time::Instant::now() + timeout;
    // Like `hub::wait_until`, but a runner whose set this server read
    // since the last write to it is not read again, neither when its next
    // poll begins nor at its timeout: a fleet costs reads only of the sets
    // that change (`Hub::unchanged_since`).
    loop {
        let notified = watch.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let empty = runner_protocol::empty_set_etag();
        if query.etag != empty && hub.unchanged_since(&key, empty) {
            // Known empty (a runner just registered, or one whose set was
            // read empty), and nothing written to it since: the answer
            // needs no read.
            state.metrics.assignments_answered(false);
            return Ok(axum::Json(Assignments {
                etag: empty.to_owned(),
                unchanged: false,
                sandboxes: Vec::new(),
                commands: Vec::new(),
                kept: Vec::new(),
            }));
        }
        let unread = query.unchanged && hub.unchanged_since(&key, &query.etag);
        if !unread {
            // This runner's own turn first, then one of the server's
            // (never closed: it lives as long as the state).
            let _runner_turn = state.runner_reads.take(&query.runner_id).await;
            let turn = state.assignment_reads.acquire().await;
            let start = hub.read_start();
            let assignments =
                Box::pin(runner_protocol::read_assignments(&state, &query.runner_id)).await?;
            drop(turn);
            hub.remember(&key, &assignments.etag, read_from(&assignments), start);
            state.metrics.assignments_answered(true);
            if assignments.etag != query.etag || tokio::time::Instant::now() >= deadline {
                return Ok(axum::Json(assignments));
            }
        } else if tokio::time::Instant::now() >= deadline {
            state.metrics.assignments_answered(false);
            return Ok(axum::Json(Assignments {
                etag: query.etag,
                unchanged: true,
                sandboxes: Vec::new(),
                commands: Vec::new(),
                kept: Vec::new(),
            }));
        }
        tokio::select! {
            () = &mut notified => {}
            () = tokio::time::sleep_until(deadline) => {}
        }
    }
}

/// The records a runner's set was read from, besides the runner's own
/// record: a write to any of them notifies its key (`hub` module doc).
fn read_from(assignments: &Assignments) -> Vec<String> {
    let sandboxes = assignments.sandboxes.iter().flat_map(|s| {
        std::iter::once(s.sandbox_id.clone()).chain(
            s.snapshots
                .iter()
                .map(|snapshot| snapshot.snapshot_id.clone()),
        )
    });
    let commands = assignments.commands.iter().map(|c| c.command_id.clone());
    let kept = assignments.kept.iter().flat_map(|k| {
        // Whether a copy is still kept depends on its sandbox too.
        [k.copy_id.clone(), k.sandbox_id.clone()]
            .into_iter()
            .chain(k.salvage.iter().cloned())
    });
    sandboxes.chain(commands).chain(kept).collect()
}

#[utoipa::path(post, path = "/v1/runner/sandboxes/{id}/report", tag = "runner", params(("id" = String, Path, description = "sandbox id")), request_body = SandboxReport, responses((status = 200, body = api::sandboxes::Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report_sandbox(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Path(id): Path<String>,
    Json(report): Json<SandboxReport>,
) -> Result<axum::Json<api::sandboxes::Sandbox>, ControlError> {
    runner.speaks_for(&report.runner_id)?;
    let record = runner_protocol::report_sandbox(&state, &id, &report).await?;
    Ok(axum::Json(record.to_api()))
}

#[utoipa::path(post, path = "/v1/runner/commands/{id}/report", tag = "runner", params(("id" = String, Path)), request_body = CommandReport, responses((status = 200, body = api::commands::Command), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report_command(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Path(id): Path<String>,
    Json(report): Json<CommandReport>,
) -> Result<axum::Json<api::commands::Command>, ControlError> {
    runner.speaks_for(&report.runner_id)?;
    let command = runner_protocol::report_command(&state, &id, &report).await?;
    Ok(axum::Json(command.to_api()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputAppend {
    runner_id: String,
    epoch: u64,
    offset: u64,
}

/// Appends output at `offset`; see `runner_protocol::append_output`.
#[utoipa::path(put, path = "/v1/runner/commands/{id}/output/{stream}", tag = "runner", params(("id" = String, Path), ("stream" = String, Path), ("runner_id" = String, Query), ("epoch" = u64, Query), ("offset" = u64, Query)), request_body(content = Vec<u8>, content_type = "application/octet-stream"), responses((status = 200, description = "the stream length"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn append_output(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Path((id, stream)): Path<(String, String)>,
    Query(query): Query<OutputAppend>,
    body: Bytes,
) -> Result<axum::Json<BTreeMap<String, u64>>, ControlError> {
    runner.speaks_for(&query.runner_id)?;
    let stream = Stream::parse(&stream).ok_or_else(|| not_found("stream"))?;
    let at = OutputAt {
        runner_id: query.runner_id,
        epoch: query.epoch,
        offset: query.offset,
    };
    let length = runner_protocol::append_output(&state, &id, stream, &at, &body).await?;
    Ok(axum::Json(BTreeMap::from([("length".to_owned(), length)])))
}
