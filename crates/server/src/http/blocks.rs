//! The block service: an org's objects in the content store, reached
//! through the control plane (runners and CLIs hold no store credentials).
//!
//! - `POST /v1/blocks/{org}/missing` `{"objects": ["blocks/HEX", …]}` →
//!   `{"missing": […]}`, at most [`MISSING_CHECK_BATCH_MAX`] per call;
//! - `PUT /v1/blocks/{org}/{blocks|trees}/{hex}`: the object's stored
//!   (framed, compressed) bytes; the server decodes them and checks the
//!   hash before storing, so a mismatching upload stores nothing (400); a
//!   tree is stored only once every object it names is there (409
//!   otherwise), so a present tree always has its whole subtree;
//! - `GET` the same path: the stored bytes (the client verifies them too).
//!
//! Who may use an org's objects: that org's token, and runner tokens
//! (a runner serves every org's sandboxes). Anyone else: 404.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{ApiError, AppState, Caller, Json};
use crate::auth::Principal;
use api::ErrorCode;
use api::blocks::{MissingRequest, MissingResponse, object_name};
use store::store::{MISSING_CHECK_BATCH_MAX, ObjectId, ObjectKind};
use store::{Digest, OrgId, Store};

/// Largest object body: an 8 MiB block, its frame byte and zstd's worst
/// case expansion of incompressible data, with room to spare.
pub const OBJECT_BODY_BYTES_MAX: usize = 9 * 1024 * 1024;

/// The store, or 422 when this deployment has none.
pub fn store_of(state: &AppState) -> Result<std::sync::Arc<Store>, ApiError> {
    state.store.clone().ok_or_else(|| {
        ApiError::new(
            ErrorCode::UnsupportedCapability,
            "this deployment has no content store (roost server --store)",
        )
        .with_details(serde_json::json!({ "missing": ["store"] }))
    })
}

/// The org whose objects `caller` may use, or 404.
fn org_for(caller: &Caller, org: &str) -> Result<OrgId, ApiError> {
    let allowed = match &caller.0 {
        Principal::Org { org_id } => org_id == org,
        Principal::Runner => true,
        Principal::Admin => false,
    };
    let not_found = || ApiError::new(ErrorCode::NotFound, "no such org");
    if !allowed {
        return Err(not_found());
    }
    org.parse().map_err(|_| not_found())
}

fn parse_object(kind: &str, hex: &str) -> Result<ObjectId, ApiError> {
    let digest: Digest = hex.parse().map_err(|_| {
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!("{hex:?} is not a 64-digit hex digest"),
        )
    })?;
    match kind {
        "blocks" => Ok(ObjectId::block(digest)),
        "trees" => Ok(ObjectId::tree(digest)),
        _ => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no object kind {kind:?} (blocks or trees)"),
        )),
    }
}

/// Runs blocking store work off the async threads.
pub async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> store::Result<T> + Send + 'static,
) -> Result<store::Result<T>, ApiError> {
    tokio::task::spawn_blocking(work).await.map_err(|err| {
        tracing::error!(%err, "store task failed");
        ApiError::new(ErrorCode::Internal, "internal error")
    })
}

/// A store failure as an answer: the backend out of reach is 503 (retry),
/// anything else 500; both logged here.
pub fn store_error(err: store::Error) -> ApiError {
    tracing::error!(%err, "store error");
    match err {
        store::Error::Backend { .. } | store::Error::StoreBusy { .. } => {
            ApiError::new(ErrorCode::Unavailable, "the content store is unavailable")
                .with_retry_after(1)
        }
        _ => ApiError::new(ErrorCode::Internal, "internal error"),
    }
}

#[utoipa::path(post, path = "/v1/blocks/{org}/missing", tag = "blocks", params(("org" = String, Path)), request_body = api::blocks::MissingRequest, responses((status = 200, body = api::blocks::MissingResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn missing(
    State(state): State<AppState>,
    caller: Caller,
    Path(org): Path<String>,
    Json(request): Json<MissingRequest>,
) -> Result<axum::Json<MissingResponse>, ApiError> {
    let org = org_for(&caller, &org)?;
    let store = store_of(&state)?;
    if request.objects.len() > MISSING_CHECK_BATCH_MAX {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!("at most {MISSING_CHECK_BATCH_MAX} objects per request"),
        ));
    }
    let objects = request
        .objects
        .iter()
        .map(|name| {
            let (kind, hex) = name.split_once('/').unwrap_or(("", name));
            parse_object(kind, hex)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let missing = blocking(move || store.missing(&org, &objects))
        .await?
        .map_err(store_error)?;
    let missing = missing
        .iter()
        .map(|o| object_name(o.kind, &o.digest.to_hex()))
        .collect();
    Ok(axum::Json(MissingResponse { missing }))
}

#[utoipa::path(put, path = "/v1/blocks/{org}/{kind}/{hex}", tag = "blocks", params(("org" = String, Path), ("kind" = String, Path, description = "blocks or trees"), ("hex" = String, Path)), request_body(content = Vec<u8>, content_type = "application/octet-stream"), responses((status = 204, description = "stored"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn put(
    State(state): State<AppState>,
    caller: Caller,
    Path((org, kind, hex)): Path<(String, String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let org = org_for(&caller, &org)?;
    let object = parse_object(&kind, &hex)?;
    let store = store_of(&state)?;
    let size = body.len() as u64;
    let stored = blocking(move || match object.kind {
        ObjectKind::Block => store.put_encoded(&org, &object, &body),
        ObjectKind::Tree => store::push::put_tree_checked(&store, &org, &object.digest, &body),
    })
    .await?;
    match stored {
        Ok(()) => {
            state.metrics.block_bytes("in", size);
            Ok(StatusCode::NO_CONTENT)
        }
        Err(store::Error::IncompleteTree { missing, .. }) => Err(ApiError::new(
            ErrorCode::InvalidState,
            format!("tree {hex} names {missing} objects this org's store lacks: upload them first"),
        )
        .with_details(serde_json::json!({ "missing_objects": missing }))),
        Err(store::Error::MalformedTree { reason, .. }) => Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!("trees/{hex} is not a valid tree: {reason}"),
        )),
        Err(store::Error::Corrupt { .. }) => Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!(
                "the uploaded bytes do not decode to {kind}/{hex}: hash mismatch, nothing stored"
            ),
        )
        .with_details(serde_json::json!({ "digest_mismatch": format!("{kind}/{hex}") }))),
        Err(err) => Err(store_error(err)),
    }
}

#[utoipa::path(get, path = "/v1/blocks/{org}/{kind}/{hex}", tag = "blocks", params(("org" = String, Path), ("kind" = String, Path, description = "blocks or trees"), ("hex" = String, Path)), responses((status = 200, description = "the stored bytes", content_type = "application/octet-stream"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path((org, kind, hex)): Path<(String, String, String)>,
) -> Result<Response, ApiError> {
    let org = org_for(&caller, &org)?;
    let object = parse_object(&kind, &hex)?;
    let store = store_of(&state)?;
    match blocking(move || store.get_encoded(&org, &object)).await? {
        Ok(bytes) => {
            state.metrics.block_bytes("out", bytes.len() as u64);
            Ok((
                [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
                bytes,
            )
                .into_response())
        }
        Err(store::Error::MissingObject { .. }) => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no object {kind}/{hex} in this org's store"),
        )),
        Err(err) => Err(store_error(err)),
    }
}
