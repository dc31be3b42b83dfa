//! Emptying a runner over HTTP (the rules are in `control::drain`).
//! Admin: `GET /v1/admin/runners`, `POST /v1/admin/runners/{id}/drain`,
//! `…/preempt`, `…/undrain`. A runner's credential: `POST /v1/runner/preempt` (a
//! runner passing on its host's notice, e.g. on SIGUSR1).

use axum::extract::State;

use super::{AdminCaller, AppState, Json, Path, RunnerCaller};
use crate::control::drain::set_drain;
use crate::error::ControlError;
use crate::records::not_found;
use api::runners::{PreemptRequest, RunnerRecord};

#[utoipa::path(get, path = "/v1/admin/runners", tag = "admin", responses((status = 200, body = Vec<RunnerRecord>), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    _admin: AdminCaller,
) -> Result<axum::Json<Vec<RunnerRecord>>, ControlError> {
    Ok(axum::Json(crate::control::drain::list(&state).await?))
}

#[utoipa::path(post, path = "/v1/admin/runners/{id}/{action}", tag = "admin", params(("id" = String, Path), ("action" = inline(api::schema::RunnerAction), Path)), responses((status = 200, body = RunnerRecord), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn admin_action(
    State(state): State<AppState>,
    _admin: AdminCaller,
    Path((id, action)): Path<(String, String)>,
) -> Result<axum::Json<RunnerRecord>, ControlError> {
    let drain = match action.as_str() {
        "drain" => Some("drain"),
        "preempt" => Some("preempt"),
        "undrain" => None,
        _ => return Err(not_found("runner action")),
    };
    Ok(axum::Json(set_drain(&state, &id, drain).await?))
}

#[utoipa::path(post, path = "/v1/runner/preempt", tag = "runner", request_body = PreemptRequest, responses((status = 200, body = RunnerRecord), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn runner_preempt(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Json(request): Json<PreemptRequest>,
) -> Result<axum::Json<RunnerRecord>, ControlError> {
    runner.speaks_for(&request.runner_id)?;
    Ok(axum::Json(
        set_drain(&state, &request.runner_id, Some("preempt")).await?,
    ))
}
