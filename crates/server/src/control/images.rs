//! Images: root filesystems imported into an org's content store.
//!
//! `roost image import` uploads the tree through the block service, then
//! commits it, in the order a sandbox's save commits (`super::saves`):
//!
//! 1. the store home `image-{hash of name}` is made to name the record's
//!    root (or nothing, with no record), should an earlier commit have
//!    died before its step 4;
//! 2. under the store's commit lock the new root is found (the block
//!    service took each tree only with its children, so the root proves
//!    the whole tree) and `image-{hash}-next` is pointed at it;
//! 3. the record is written;
//! 4. `image-{hash}` is pointed at the record's root, read after the
//!    commit.
//!
//! A delete removes the record, then both pointers. One image's commits
//! and deletes take turns on this server (`AppState::pointer_turns`), so at
//! every step the record's root is pinned by one of the two pointers, and
//! gc never takes an image's recorded tree, whatever commit died where.
//! A sandbox created with `image: NAME` pins that root; runners
//! materialise it from the store.

use super::AppState;
use super::home_store::{parse_root, pin_tree, point_home_at};
use crate::db::now_ms;
use crate::error::ControlError;
use crate::limits;
use crate::records::images::{self, Committed};
use api::ErrorCode;
use api::images::{CommitImageRequest, Image};
use store::HomeName;

/// The store home that holds an image's recorded tree. Image names allow
/// more characters than home names, so the home is named by a hash of it.
pub(crate) fn image_home(name: &str) -> Result<HomeName, ControlError> {
    home_named(name, "")
}

/// The store home that holds the tree an image commit is recording.
fn image_next_home(name: &str) -> Result<HomeName, ControlError> {
    home_named(name, "-next")
}

fn home_named(name: &str, suffix: &str) -> Result<HomeName, ControlError> {
    let hash = blake3::hash(name.as_bytes()).to_hex();
    format!("image-{}{suffix}", &hash[..32])
        .parse()
        .map_err(|_| ControlError::new(ErrorCode::Internal, "internal error"))
}

fn validate_name(name: &str) -> Result<(), ControlError> {
    limits::name("name", name)?;
    if name == "default" {
        return Err(limits::invalid(
            "name",
            "\"default\" is the runner host's own system and cannot be replaced",
        ));
    }
    Ok(())
}

pub fn not_found(name: &str) -> ControlError {
    ControlError::new(ErrorCode::NotFound, format!("no image {name:?}"))
}

/// Commits the uploaded tree as the org's image `name`, in the steps
/// above.
pub async fn commit(
    state: &AppState,
    org: &str,
    name: &str,
    request: &CommitImageRequest,
) -> Result<Image, ControlError> {
    validate_name(name)?;
    let root = parse_root(Some(&request.root))?;
    let _turn = state.pointer_turns.take(&turn_key(org, name)).await;
    // 1. `image-{hash}` names the record's root before `-next` moves on.
    point_at_record(state, org, name).await?;
    // 2. The new tree, complete and pinned.
    let summary = pin_tree(state, org, image_next_home(name)?, root).await?;
    state.config.failpoint.hit("image:after_pin");
    // 3. The record.
    let mut tx = state.db.write().await?;
    let hex = root.to_hex();
    let committed = Committed {
        root: &hex,
        files: request.files.unwrap_or(0) as i64,
        logical_bytes: summary.logical_bytes as i64,
        at_ms: now_ms(),
    };
    images::upsert(&mut tx, org, name, committed).await?;
    tx.commit().await?;
    tracing::info!(%org, image = %name, %root, "image committed");
    // 4. The committed pointer, at the record's root as it now stands.
    point_at_record(state, org, name)
        .await?
        .ok_or_else(|| not_found(name))
}

/// Forgets the image; its tree becomes collectable by gc. Sandboxes that
/// already run it keep their materialised copy.
pub async fn delete(state: &AppState, org: &str, name: &str) -> Result<Image, ControlError> {
    // A deployment without a store refuses before anything is deleted.
    super::home_store::store_of(state)?;
    let _turn = state.pointer_turns.take(&turn_key(org, name)).await;
    let image = images::read(&state.db.pool, org, name)
        .await?
        .ok_or_else(|| not_found(name))?;
    let mut tx = state.db.write().await?;
    images::delete(&mut tx, org, name).await?;
    tx.commit().await?;
    // The record first: a delete that dies now leaves pins, which the
    // image's next commit or delete moves or removes, never a record
    // without one.
    point_home_at(state, org, image_next_home(name)?, None).await?;
    point_at_record(state, org, name).await?;
    Ok(image)
}

fn turn_key(org: &str, name: &str) -> String {
    format!("image:{org}/{name}")
}

/// Points `image-{hash}` at the root the image's record names, or removes
/// it when there is no record; answers the record.
async fn point_at_record(
    state: &AppState,
    org: &str,
    name: &str,
) -> Result<Option<Image>, ControlError> {
    let image = images::read(&state.db.pool, org, name).await?;
    let root = match &image {
        Some(image) => Some(parse_root(Some(&image.root))?),
        None => None,
    };
    point_home_at(state, org, image_home(name)?, root).await?;
    Ok(image)
}
