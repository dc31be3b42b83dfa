//! Images: root filesystems imported into an org's content store.
//!
//! `roost image import` uploads the tree through the block service, then
//! commits it: the server finds the root under the store's commit lock
//! (the block service took each tree only with its children, so the root
//! proves the whole tree), points the store's home `image-{hash of name}`
//! at it (which keeps it alive for gc) and records the image. A sandbox
//! created with `image: NAME` pins that root; runners materialise it from
//! the store.

use super::AppState;
use super::home_store::{blocking, parse_root, pin_tree, store_error, store_of, store_org};
use crate::db::now_ms;
use crate::error::ControlError;
use crate::limits;
use crate::records::images::{self, Committed};
use api::ErrorCode;
use api::images::{CommitImageRequest, Image};
use store::HomeName;

/// The store home that holds an image's tree. Image names allow more
/// characters than home names, so the home is named by a hash of it.
pub(crate) fn image_home(name: &str) -> Result<HomeName, ControlError> {
    let hash = blake3::hash(name.as_bytes()).to_hex();
    format!("image-{}", &hash[..32])
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

/// Commits the uploaded tree as the org's image `name`.
pub async fn commit(
    state: &AppState,
    org: &str,
    name: &str,
    request: &CommitImageRequest,
) -> Result<Image, ControlError> {
    validate_name(name)?;
    let root = parse_root(Some(&request.root))?;
    let summary = pin_tree(state, org, image_home(name)?, root).await?;
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
    images::read(&state.db.pool, org, name)
        .await?
        .ok_or_else(|| not_found(name))
}

/// Forgets the image; its tree becomes collectable by gc. Sandboxes that
/// already run it keep their materialised copy.
pub async fn delete(state: &AppState, org: &str, name: &str) -> Result<Image, ControlError> {
    let image = images::read(&state.db.pool, org, name)
        .await?
        .ok_or_else(|| not_found(name))?;
    let store = store_of(state)?;
    let home = image_home(name)?;
    let store_org = store_org(org)?;
    let mut tx = state.db.write().await?;
    images::delete(&mut tx, org, name).await?;
    blocking(move || store.delete_home(&store_org, &home))
        .await?
        .map_err(store_error)?;
    tx.commit().await?;
    Ok(image)
}
