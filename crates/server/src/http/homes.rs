//! A runner's save reports over HTTP (a runner's credential): parse, call
//! `control::saves`, render.

use axum::extract::State;

use super::{AppState, Json, Path, RunnerCaller};
use crate::error::ControlError;
use api::runners::SaveReport;

#[utoipa::path(post, path = "/v1/runner/sandboxes/{id}/saves", tag = "runner", params(("id" = String, Path, description = "sandbox id")), request_body = SaveReport, responses((status = 200, body = api::sandboxes::Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn report_save(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Path(id): Path<String>,
    Json(report): Json<SaveReport>,
) -> Result<axum::Json<api::sandboxes::Sandbox>, ControlError> {
    runner.speaks_for(&report.runner_id)?;
    let record = crate::control::saves::report_save(&state, &id, &report).await?;
    Ok(axum::Json(record.to_api()))
}
