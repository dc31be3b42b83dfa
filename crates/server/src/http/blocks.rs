//! The block service over HTTP (`/v1/blocks/{org}/…`: `missing`, PUT and
//! GET of one object, `batch` uploads, `fetch` downloads); the rules, and
//! who may use an org's objects, are in `control::blocks`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{AppState, BlocksCaller, Json, Path, RawBody};
use crate::control::blocks::{self, org_for, parse_object};
use crate::error::ControlError;
use api::blocks::{FetchRequest, MissingRequest, MissingResponse};

/// Largest object body: an 8 MiB block, its frame byte and zstd's worst
/// case expansion of incompressible data, with room to spare.
pub const OBJECT_BODY_BYTES_MAX: usize = 9 * 1024 * 1024;

#[utoipa::path(post, path = "/v1/blocks/{org}/missing", tag = "blocks", params(("org" = String, Path)), request_body = api::blocks::MissingRequest, responses((status = 200, body = api::blocks::MissingResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn missing(
    State(state): State<AppState>,
    caller: BlocksCaller,
    Path(org): Path<String>,
    Json(request): Json<MissingRequest>,
) -> Result<axum::Json<MissingResponse>, ControlError> {
    let org = org_for(&state, &caller.0, &org).await?;
    let missing = blocks::missing(&state, org, &request.objects).await?;
    Ok(axum::Json(MissingResponse { missing }))
}

#[utoipa::path(put, path = "/v1/blocks/{org}/{kind}/{hex}", tag = "blocks", params(("org" = String, Path), ("kind" = inline(api::schema::ObjectKind), Path), ("hex" = String, Path, pattern = "^[0-9a-f]{64}$", description = "the object's digest")), request_body(content = Vec<u8>, content_type = "application/octet-stream"), responses((status = 204, description = "stored"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn put(
    State(state): State<AppState>,
    caller: BlocksCaller,
    Path((org, kind, hex)): Path<(String, String, String)>,
    RawBody(body): RawBody,
) -> Result<StatusCode, ControlError> {
    let org = org_for(&state, &caller.0, &org).await?;
    let object = parse_object(&kind, &hex)?;
    blocks::put(&state, org, object, body.into()).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Stores several objects in one request; see `control::blocks::put_batch`.
#[utoipa::path(post, path = "/v1/blocks/{org}/batch", tag = "blocks", params(("org" = String, Path)), request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "frames: `KIND/HEX LENGTH\\n` then LENGTH stored bytes, repeated"), responses((status = 204, description = "every object stored"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn batch(
    State(state): State<AppState>,
    caller: BlocksCaller,
    Path(org): Path<String>,
    RawBody(body): RawBody,
) -> Result<StatusCode, ControlError> {
    let org = org_for(&state, &caller.0, &org).await?;
    blocks::put_batch(&state, org, body.into()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/blocks/{org}/{kind}/{hex}", tag = "blocks", params(("org" = String, Path), ("kind" = inline(api::schema::ObjectKind), Path), ("hex" = String, Path, pattern = "^[0-9a-f]{64}$", description = "the object's digest")), responses((status = 200, description = "the stored bytes", content_type = "application/octet-stream"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: BlocksCaller,
    Path((org, kind, hex)): Path<(String, String, String)>,
) -> Result<Response, ControlError> {
    let org = org_for(&state, &caller.0, &org).await?;
    let object = parse_object(&kind, &hex)?;
    let bytes = blocks::get(&state, org, object).await?;
    Ok(octets(bytes))
}

/// Hands out several objects in one answer; see `control::blocks::fetch`.
#[utoipa::path(post, path = "/v1/blocks/{org}/fetch", tag = "blocks", params(("org" = String, Path)), request_body = api::blocks::FetchRequest, responses((status = 200, description = "frames: `KIND/HEX LENGTH\\n` then LENGTH stored bytes, or `KIND/HEX -\\n` for an absent object; a prefix of the objects asked for", content_type = "application/octet-stream"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn fetch(
    State(state): State<AppState>,
    caller: BlocksCaller,
    Path(org): Path<String>,
    Json(request): Json<FetchRequest>,
) -> Result<Response, ControlError> {
    let org = org_for(&state, &caller.0, &org).await?;
    let body = blocks::fetch(&state, org, &request.objects).await?;
    Ok(octets(body))
}

fn octets(body: Vec<u8>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        body,
    )
        .into_response()
}
