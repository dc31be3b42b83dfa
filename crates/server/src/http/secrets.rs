//! Secrets over HTTP: `PUT /v1/secrets/{name}` `{"value": …}` sets one,
//! then list and delete (never a value back); the runner of a sandbox's
//! placement fetches the values it asked for. Rules: `control::secrets`.

use axum::extract::State;

use super::{AppState, Json, OrgCaller, Path, RunnerCaller};
use crate::control::secrets;
use crate::error::ControlError;
use crate::records;
use api::runners::{SecretValues, SecretsRequest};
use api::secrets::{SecretList, SecretRecord, SetSecretRequest};

#[utoipa::path(put, path = "/v1/secrets/{name}", tag = "secrets", params(("name" = String, Path, pattern = "^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$", description = "secret name")), request_body = api::secrets::SetSecretRequest, responses((status = 200, body = api::secrets::SecretRecord), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn set(
    State(state): State<AppState>,
    OrgCaller(org): OrgCaller,
    Path(name): Path<String>,
    Json(request): Json<SetSecretRequest>,
) -> Result<axum::Json<SecretRecord>, ControlError> {
    Ok(axum::Json(
        secrets::set(&state, &org, &name, &request).await?,
    ))
}

#[utoipa::path(get, path = "/v1/secrets", tag = "secrets", responses((status = 200, body = api::secrets::SecretList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    OrgCaller(org): OrgCaller,
) -> Result<axum::Json<SecretList>, ControlError> {
    secrets::key_of(&state)?;
    let secrets = records::secrets::list(&state.db.pool, &org).await?;
    Ok(axum::Json(SecretList { secrets }))
}

#[utoipa::path(delete, path = "/v1/secrets/{name}", tag = "secrets", params(("name" = String, Path, pattern = "^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$", description = "secret name")), responses((status = 200, body = api::secrets::SecretRecord), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    OrgCaller(org): OrgCaller,
    Path(name): Path<String>,
) -> Result<axum::Json<SecretRecord>, ControlError> {
    secrets::key_of(&state)?;
    Ok(axum::Json(secrets::delete(&state, &org, &name).await?))
}

#[utoipa::path(post, path = "/v1/runner/sandboxes/{id}/secrets", tag = "runner", params(("id" = String, Path, description = "sandbox id")), request_body = SecretsRequest, responses((status = 200, body = api::runners::SecretValues), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn for_runner(
    State(state): State<AppState>,
    runner: RunnerCaller,
    Path(id): Path<String>,
    Json(request): Json<SecretsRequest>,
) -> Result<axum::Json<SecretValues>, ControlError> {
    runner.speaks_for(&request.runner_id)?;
    Ok(axum::Json(
        secrets::values_for_runner(&state, &runner.0, &id, &request).await?,
    ))
}
