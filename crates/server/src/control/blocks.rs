//! The block service's rules: an org's objects in the content store,
//! reached through the control plane (runners and CLIs hold no store
//! credentials).
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
//! Who may use an org's objects: that org's token, and a runner (by its
//! own credential) while it holds a sandbox of that org: one placed on it
//! and not deleted, which covers its home, its image and its snapshots.
//! Anyone else, runner tokens and the admin included: 404, as if the org
//! did not exist. The rule is checked on every request, so a runner loses
//! an org's objects as soon as its last sandbox of the org is deleted or
//! placed elsewhere.

use super::AppState;
use super::home_store::{blocking, store_error, store_of};
use crate::auth::Principal;
use crate::error::ControlError;
use crate::limits;
use api::ErrorCode;
use api::blocks::{
    FETCH_ANSWER_BYTES, FETCH_OBJECTS_MAX, absent_header, batch_header, object_name,
};
use store::store::{MISSING_CHECK_BATCH_MAX, ObjectId, ObjectKind};
use store::{Digest, Objects, OrgId};

/// The org whose objects `principal` may use, or 404.
pub async fn org_for(
    state: &AppState,
    principal: &Principal,
    org: &str,
) -> Result<OrgId, ControlError> {
    let not_found = || ControlError::new(ErrorCode::NotFound, "no such org");
    let parsed: OrgId = org.parse().map_err(|_| not_found())?;
    let allowed = match principal {
        Principal::Org { org_id } => org_id == org,
        Principal::Runner { runner_id } => {
            crate::records::runners::holds_org(&state.db.pool, runner_id, org).await?
        }
        Principal::Admin | Principal::RunnerEnrolment => false,
    };
    if !allowed {
        return Err(not_found());
    }
    Ok(parsed)
}

pub fn parse_object(kind: &str, hex: &str) -> Result<ObjectId, ControlError> {
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

/// Which of `names` the org's store lacks, by name.
pub async fn missing(
    state: &AppState,
    org: OrgId,
    names: &[String],
) -> Result<Vec<String>, ControlError> {
    let store = store_of(state)?;
    if names.len() > MISSING_CHECK_BATCH_MAX {
        return Err(ControlError::new(
            ErrorCode::InvalidRequest,
            format!("at most {MISSING_CHECK_BATCH_MAX} objects per request"),
        ));
    }
    let objects = parse_names(names)?;
    let missing = blocking(move || store.missing(&org, &objects))
        .await?
        .map_err(store_error)?;
    Ok(missing
        .iter()
        .map(|o| object_name(o.kind, &o.digest.to_hex()))
        .collect())
}

/// Stores one object's stored bytes once they decode to its digest (a
/// tree only once every object it names is present).
pub async fn put(
    state: &AppState,
    org: OrgId,
    object: ObjectId,
    body: Vec<u8>,
) -> Result<(), ControlError> {
    let store = store_of(state)?;
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
            Ok(())
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
pub async fn put_batch(state: &AppState, org: OrgId, body: Vec<u8>) -> Result<(), ControlError> {
    let store = store_of(state)?;
    let frames =
        api::blocks::parse_batch(&body).map_err(|err| limits::invalid("body", err.to_string()))?;
    let ids: Vec<ObjectId> = frames.iter().map(|frame| frame.object).collect();
    let size: u64 = frames.iter().map(|frame| frame.data.len() as u64).sum();
    // Checks every object before storing any. Only a store failure
    // part-way (503) leaves some of the batch stored: verified,
    // content-addressed objects that name nothing absent, which a retry
    // finds present and gc collects if nothing ever refers to them.
    let stored = blocking(move || {
        let objects: Vec<(ObjectId, &[u8])> = frames
            .iter()
            .map(|frame| (frame.object, &body[frame.data.clone()]))
            .collect();
        store::objects::put_batch_checked(store.as_ref(), &org, &objects)
    })
    .await?;
    match stored {
        Ok(()) => {
            state.metrics.block_transfer("in", ids.len() as u64, size);
            Ok(())
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
        store::Error::Corrupt { digest, reason, .. } => {
            let name = name(&digest);
            let details = match reason {
                store::Corruption::HashMismatch => serde_json::json!({ "digest_mismatch": name }),
                _ => serde_json::json!({ "undecodable": name, "reason": reason.to_string() }),
            };
            ControlError::new(
                ErrorCode::InvalidRequest,
                format!("the uploaded bytes do not decode to {name}: {reason}, {stored}"),
            )
            .with_details(details)
        }
        err => store_error(err),
    }
}

/// One object's stored bytes (404 naming it when absent).
pub async fn get(state: &AppState, org: OrgId, object: ObjectId) -> Result<Vec<u8>, ControlError> {
    let store = store_of(state)?;
    match blocking(move || store.get_encoded(&org, &object)).await? {
        Ok(bytes) => {
            state.metrics.block_transfer("out", 1, bytes.len() as u64);
            Ok(bytes)
        }
        Err(store::Error::MissingObject { .. }) => Err(ControlError::new(
            ErrorCode::NotFound,
            format!(
                "no object {} in this org's store",
                object_name(object.kind, &object.digest.to_hex())
            ),
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
pub async fn fetch(
    state: &AppState,
    org: OrgId,
    names: &[String],
) -> Result<Vec<u8>, ControlError> {
    let store = store_of(state)?;
    if names.is_empty() || names.len() > FETCH_OBJECTS_MAX {
        return Err(limits::invalid(
            "objects",
            format!("1 to {FETCH_OBJECTS_MAX} objects per request"),
        ));
    }
    let objects = parse_names(names)?;
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
    Ok(body)
}
