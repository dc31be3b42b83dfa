//! Images over HTTP: `PUT /v1/images/{name}` `{"root": HEX}` commits an
//! uploaded tree, then get, list, delete; the rules are in
//! `control::images`.

use axum::extract::State;

use super::{AppState, Json, OrgCaller, Path};
use crate::control::images::{self, not_found};
use crate::error::ControlError;
use crate::records;
use api::images::{CommitImageRequest, Image, ImageList};

#[utoipa::path(put, path = "/v1/images/{name}", tag = "images", params(("name" = String, Path, pattern = "^[A-Za-z0-9._:@-]{1,128}$", description = "image name")), request_body = api::images::CommitImageRequest, responses((status = 200, body = api::images::Image), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn commit(
    State(state): State<AppState>,
    OrgCaller(org): OrgCaller,
    Path(name): Path<String>,
    Json(request): Json<CommitImageRequest>,
) -> Result<axum::Json<Image>, ControlError> {
    Ok(axum::Json(
        images::commit(&state, &org, &name, &request).await?,
    ))
}

#[utoipa::path(get, path = "/v1/images/{name}", tag = "images", params(("name" = String, Path, pattern = "^[A-Za-z0-9._:@-]{1,128}$", description = "image name")), responses((status = 200, body = api::images::Image), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    OrgCaller(org): OrgCaller,
    Path(name): Path<String>,
) -> Result<axum::Json<Image>, ControlError> {
    records::images::read(&state.db.pool, &org, &name)
        .await?
        .map(axum::Json)
        .ok_or_else(|| not_found(&name))
}

#[utoipa::path(get, path = "/v1/images", tag = "images", responses((status = 200, body = api::images::ImageList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    OrgCaller(org): OrgCaller,
) -> Result<axum::Json<ImageList>, ControlError> {
    let images = records::images::list(&state.db.pool, &org).await?;
    Ok(axum::Json(ImageList { images }))
}

#[utoipa::path(delete, path = "/v1/images/{name}", tag = "images", params(("name" = String, Path, pattern = "^[A-Za-z0-9._:@-]{1,128}$", description = "image name")), responses((status = 200, body = api::images::Image), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    OrgCaller(org): OrgCaller,
    Path(name): Path<String>,
) -> Result<axum::Json<Image>, ControlError> {
    Ok(axum::Json(images::delete(&state, &org, &name).await?))
}
