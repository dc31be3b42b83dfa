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
//! - `POST /v1/blocks/{org}/batch`: many objects in one body of frames
//!   (`api::blocks` documents the format), checked as the PUT checks one
//!   and stored in the order given, so a tree may follow its children in
//!   the same batch. This is how clients upload: one request per object
//!   cost more than the work itself on a small change;
//! - `GET` the same path: the stored bytes (the client verifies them too);
//! - `POST /v1/blocks/{org}/fetch` `{"objects": […]}`: many objects' stored
//!   bytes in one answer of frames (`api::blocks` documents it). This is
//!   how runners download: one request per object was most of a wake.
//!
//! Who may use an org's objects: that org's token, and runner tokens
//! (a runner serves every org's sandboxes). Anyone else: 404.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{AppState, Caller, Json, RawBody};
use crate::auth::Principal;
use crate::control::home_store::{blocking, store_error, store_of};
use crate::error::ControlError;
use crate::limits;
use api::ErrorCode;
use api::blocks::{
    FETCH_ANSWER_BYTES, FETCH_OBJECTS_MAX, FetchRequest, MissingRequest, MissingResponse,
    absent_header, batch_header, object_name,
};
use store::store::{MISSING_CHECK_BATCH_MAX, ObjectId, ObjectKind};
use store::{Digest, Objects, OrgId};

/// Largest object body: an 8 MiB block, its frame byte and zstd's worst
/// case expansion of incompressible data, with room to spare.
pub const OBJECT_BODY_BYTES_MAX: usize = 9 * 1024 * 1024;

/// The org whose objects `caller` may use, or 404.
fn org_for(caller: &Caller, org: &str) -> Result<OrgId, ControlError> {
    let allowed = match &caller.0 {
        Principal::Org { org_id } => org_id == org,
        Principal::Runner => true,
        Principal::Admin => false,
    };
    let not_found = || ControlError::new(ErrorCode::NotFound, "no such org");
    if !allowed {
        return Err(not_found());
    }
    org.parse().map_err(|_| not_found())
}

fn parse_object(kind: &str, hex: &str) -> Result<ObjectId, ControlError> {
    let digest: Digest = hex.parse().map_err(|_| {
        ControlError::new(
            ErrorCode::InvalidRequest,
            format!("{hex:?} is not a 64-digit hex digest"),
        )
    })?;
    match kind {
        "blocks" => Ok(ObjectId::block(digest)),
        "trees" => Ok(ObjectId::tree(digest)),
        _ => Err(ControlError::new(
            ErrorCode::NotFound,
            format!("no object kind {kind:?} (blocks or trees)"),
        )),
    }
}

/// A request body's `objects` (`blocks/HEX`, `trees/HEX`); anything else
/// is 400 naming the field.
fn parse_names(names: &[String]) -> Result<Vec<ObjectId>, ControlError> {
    names
        .iter()
        .map(|name| {
            let (kind, hex) = name.split_once('/').unwrap_or(("", name));
            parse_object(kind, hex).map_err(|_| {
                limits::invalid(
                    "objects",
                    format!("{name:?} is not blocks/HEX or trees/HEX"),
                )
            })
        })
        .collect()
}

#[utoipa::path(post, path = "/v1/blocks/{org}/missing", tag = "blocks", params(("org" = String, Path)), request_body = api::blocks::MissingRequest, responses((status = 200, body = api::blocks::MissingResponse), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn missing(
    State(state): State<AppState>,
    caller: Caller,
    Path(org): Path<String>,
    Json(request): Json<MissingRequest>,
) -> Result<axum::Json<MissingResponse>, ControlError> {
    let org = org_for(&caller, &org)?;
    let store = store_of(&state)?;
    if request.objects.len() > MISSING_CHECK_BATCH_MAX {
        return Err(ControlError::new(
            ErrorCode::InvalidRequest,
            format!("at most {MISSING_CHECK_BATCH_MAX} objects per request"),
        ));
    }
    let objects = parse_names(&request.objects)?;
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
    RawBody(body): RawBody,
) -> Result<StatusCode, ControlError> {
    let org = org_for(&caller, &org)?;
    let object = parse_object(&kind, &hex)?;
    let store = store_of(&state)?;
    let size = body.len() as u64;
    let stored = blocking(move || match object.kind {
        ObjectKind::Block => store.put_encoded(&org, &object, &body),
        ObjectKind::Tree => {
            store::objects::put_tree_checked(store.as_ref(), &org, &object.digest, &body)
        }
    })
    .await?;
    match stored {
        Ok(()) => {
            state.metrics.block_transfer("in", 1, size);
            Ok(StatusCode::NO_CONTENT)
        }
        Err(err) => Err(upload_refused(err, &[object], "nothing stored")),
    }
}

/// Stores several objects in one request.
///
/// The body is a sequence of frames, nothing before, between or after
/// them: a header line `KIND/HEX LENGTH\n` (ASCII; KIND `blocks` or
/// `trees`, HEX the 64 lowercase hex digits of the digest, LENGTH 1 to 10
/// decimal digits), then exactly LENGTH bytes: the object's stored bytes,
/// as the single PUT carries them. At most 1024 objects and 9 MiB. Every
/// object is checked as the PUT checks it (its digest; a tree's children
/// present in the org's store or earlier in this batch) before any is
/// stored; then they are stored in the order given. A refusal (4xx)
/// stores nothing of the batch.
#[utoipa::path(post, path = "/v1/blocks/{org}/batch", tag = "blocks", params(("org" = String, Path)), request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "frames: `KIND/HEX LENGTH\\n` then LENGTH stored bytes, repeated"), responses((status = 204, description = "every object stored"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn batch(
    State(state): State<AppState>,
    caller: Caller,
    Path(org): Path<String>,
    RawBody(body): RawBody,
) -> Result<StatusCode, ControlError> {
    let org = org_for(&caller, &org)?;
    let store = store_of(&state)?;
    let frames =
        api::blocks::parse_batch(&body).map_err(|err| limits::invalid("body", err.to_string()))?;
    let objects: Vec<(ObjectId, Bytes)> = frames
        .into_iter()
        .map(|frame| (frame.object, body.slice(frame.data)))
        .collect();
    let ids: Vec<ObjectId> = objects.iter().map(|(object, _)| *object).collect();
    let size: u64 = objects.iter().map(|(_, data)| data.len() as u64).sum();
    // Checks every object before storing any. Only a store failure
    // part-way (503) leaves some of the batch stored: verified,
    // content-addressed objects that name nothing absent, which a retry
    // finds present and gc collects if nothing ever refers to them.
    let stored =
        blocking(move || store::objects::put_batch_checked(store.as_ref(), &org, &objects)).await?;
    match stored {
        Ok(()) => {
            state.metrics.block_transfer("in", ids.len() as u64, size);
            Ok(StatusCode::NO_CONTENT)
        }
        Err(err) => Err(upload_refused(
            err,
            &ids,
            "nothing of this batch was stored",
        )),
    }
}

/// An upload the store refused, as an answer naming the object (the first
/// of `objects` with the digest the error names).
fn upload_refused(err: store::Error, objects: &[ObjectId], stored: &str) -> ControlError {
    let name = |digest: &Digest| {
        let kind = objects
            .iter()
            .find(|o| o.digest == *digest)
            .map_or(ObjectKind::Block, |o| o.kind);
        object_name(kind, &digest.to_hex())
    };
    match err {
        store::Error::IncompleteTree { root, missing } => ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "tree {} names {missing} objects this org's store lacks: upload them first; {stored}",
                root.to_hex()
            ),
        )
        .with_details(serde_json::json!({ "missing_objects": missing, "object": name(&root) })),
        store::Error::MalformedTree { digest, reason } => ControlError::new(
            ErrorCode::InvalidRequest,
            format!("{} is not a valid tree: {reason}; {stored}", name(&digest)),
        ),
        store::Error::Corrupt { digest, .. } => {
            let name = name(&digest);
            ControlError::new(
                ErrorCode::InvalidRequest,
                format!("the uploaded bytes do not decode to {name}: hash mismatch, {stored}"),
            )
            .with_details(serde_json::json!({ "digest_mismatch": name }))
        }
        err => store_error(err),
    }
}

#[utoipa::path(get, path = "/v1/blocks/{org}/{kind}/{hex}", tag = "blocks", params(("org" = String, Path), ("kind" = String, Path, description = "blocks or trees"), ("hex" = String, Path)), responses((status = 200, description = "the stored bytes", content_type = "application/octet-stream"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path((org, kind, hex)): Path<(String, String, String)>,
) -> Result<Response, ControlError> {
    let org = org_for(&caller, &org)?;
    let object = parse_object(&kind, &hex)?;
    let store = store_of(&state)?;
    match blocking(move || store.get_encoded(&org, &object)).await? {
        Ok(bytes) => {
            state.metrics.block_transfer("out", 1, bytes.len() as u64);
            Ok((
                [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
                bytes,
            )
                .into_response())
        }
        Err(store::Error::MissingObject { .. }) => Err(ControlError::new(
            ErrorCode::NotFound,
            format!("no object {kind}/{hex} in this org's store"),
        )),
        Err(err) => Err(store_error(err)),
    }
}

/// Most objects read from the store per call while a fetch answer is
/// built (a store a round trip away, S3, reads them concurrently). Fewer
/// once the objects' sizes are known, so that an answer near its size
/// reads little more than it sends.
const FETCH_READ_GROUP: usize = 64;
/// Objects read by the first call, before any size is known.
const FETCH_FIRST_GROUP: usize = 8;

/// Hands out several objects in one answer: frames in request order (the
/// batch format; an absent object is its header with `-` for a length),
/// stopping after the frame that brings the answer to about 8 MiB. The
/// client asks again for the rest.
#[utoipa::path(post, path = "/v1/blocks/{org}/fetch", tag = "blocks", params(("org" = String, Path)), request_body = api::blocks::FetchRequest, responses((status = 200, description = "frames: `KIND/HEX LENGTH\\n` then LENGTH stored bytes, or `KIND/HEX -\\n` for an absent object; a prefix of the objects asked for", content_type = "application/octet-stream"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn fetch(
    State(state): State<AppState>,
    caller: Caller,
    Path(org): Path<String>,
    Json(request): Json<FetchRequest>,
) -> Result<Response, ControlError> {
    let org = org_for(&caller, &org)?;
    let store = store_of(&state)?;
    if request.objects.is_empty() || request.objects.len() > FETCH_OBJECTS_MAX {
        return Err(limits::invalid(
            "objects",
            format!("1 to {FETCH_OBJECTS_MAX} objects per request"),
        ));
    }
    let objects = parse_names(&request.objects)?;
    let answer = blocking(move || {
        let mut body = Vec::new();
        let (mut served, mut bytes, mut at, mut group_len) = (0u64, 0u64, 0, FETCH_FIRST_GROUP);
        while at < objects.len() {
            let group = &objects[at..objects.len().min(at + group_len)];
            at += group.len();
            for (object, stored) in group.iter().zip(store.get_batch(&org, group)?) {
                match stored {
                    Some(data) => {
                        body.extend_from_slice(batch_header(object, data.len()).as_bytes());
                        body.extend_from_slice(&data);
                        served += 1;
                        bytes += data.len() as u64;
                    }
                    None => body.extend_from_slice(absent_header(object).as_bytes()),
                }
                if body.len() >= FETCH_ANSWER_BYTES {
                    return Ok((body, served, bytes));
                }
            }
            let average = (bytes / served.max(1)).max(1);
            let room = (FETCH_ANSWER_BYTES - body.len()) as u64;
            group_len = (room / average).clamp(1, FETCH_READ_GROUP as u64) as usize;
        }
        Ok((body, served, bytes))
    })
    .await?;
    let (body, served, bytes) = answer.map_err(store_error)?;
    state.metrics.block_transfer("out", served, bytes);
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        body,
    )
        .into_response())
}
