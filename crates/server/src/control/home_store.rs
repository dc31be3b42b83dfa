//! The home store as the control plane uses it: the deployment's store
//! (or a refusal), blocking work off the async threads, store failures as
//! answers, and the names homes and orgs take in it.

use store::{Digest, HomeName, OrgId, Store};

use super::AppState;
use crate::error::ControlError;
use crate::limits;
use api::ErrorCode;

/// The store, or 422 when this deployment has none.
pub fn store_of(state: &AppState) -> Result<std::sync::Arc<Store>, ControlError> {
    state.store.clone().ok_or_else(|| {
        ControlError::new(
            ErrorCode::UnsupportedCapability,
            "this deployment has no content store (roost server --store)",
        )
        .with_details(serde_json::json!({ "missing": ["store"] }))
    })
}

/// Runs blocking store work off the async threads.
pub async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> store::Result<T> + Send + 'static,
) -> Result<store::Result<T>, ControlError> {
    tokio::task::spawn_blocking(work).await.map_err(|err| {
        tracing::error!(%err, "store task failed");
        ControlError::new(ErrorCode::Internal, "internal error")
    })
}

/// A store failure as an answer: the backend out of reach is 503 (retry),
/// anything else 500; both logged here.
pub fn store_error(err: store::Error) -> ControlError {
    tracing::error!(%err, "store error");
    if err.is_out_of_space() {
        // The cause, without the server's paths: they are not the caller's.
        return ControlError::new(
            ErrorCode::InsufficientStorage,
            "the content store is full (no space left on device): what it could not store is still missing; retry once space is freed",
        );
    }
    match err {
        store::Error::Backend { .. } | store::Error::StoreBusy { .. } => {
            ControlError::new(ErrorCode::Unavailable, "the content store is unavailable")
                .with_retry_after(1)
        }
        _ => ControlError::new(ErrorCode::Internal, "internal error"),
    }
}

/// The store homes of sandbox `id`: its committed save and the one being
/// committed.
pub fn home_names(id: &str) -> Result<(HomeName, HomeName), ControlError> {
    let internal = |_| ControlError::new(ErrorCode::Internal, "internal error");
    Ok((
        id.parse().map_err(internal)?,
        format!("{id}-next").parse().map_err(internal)?,
    ))
}

pub fn store_org(org: &str) -> Result<OrgId, ControlError> {
    org.parse()
        .map_err(|_| ControlError::new(ErrorCode::Internal, "internal error"))
}

/// A tree root named in a request: 64 hex digits, else 400 naming `root`.
pub fn parse_root(root: Option<&str>) -> Result<Digest, ControlError> {
    root.unwrap_or("")
        .parse()
        .map_err(|_| limits::invalid("root", "a 64-digit hex digest"))
}

/// Checks that the tree `root` is complete in `org`'s store and points
/// `home` at it (under the store's commit lock). Incomplete → 409.
pub async fn pin_tree(
    state: &AppState,
    org: &str,
    home: HomeName,
    root: Digest,
) -> Result<store::push::TreeSummary, ControlError> {
    let store = store_of(state)?;
    let org = store_org(org)?;
    match blocking(move || store::push::commit_uploaded(&store, &org, &home, &root)).await? {
        Ok(summary) => Ok(summary),
        Err(store::Error::IncompleteTree { missing, .. }) => Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("{missing} objects of tree {root} are not in the store; upload them first"),
        )
        .with_details(serde_json::json!({ "missing_objects": missing }))),
        Err(store::Error::Corrupt { .. } | store::Error::MalformedTree { .. }) => {
            Err(ControlError::new(
                ErrorCode::InvalidRequest,
                format!("tree {root} has a malformed or corrupt object"),
            ))
        }
        Err(err) => Err(store_error(err)),
    }
}

/// Points the store home `home` of `org` at `root` (removes it for
/// `None`), writing nothing when it already names that.
pub async fn point_home_at(
    state: &AppState,
    org: &str,
    home: HomeName,
    root: Option<Digest>,
) -> Result<(), ControlError> {
    let store = store_of(state)?;
    let org = store_org(org)?;
    blocking(move || {
        let current = store.read_home(&org, &home)?;
        match root {
            Some(root) if current != Some(root) => store.write_home(&org, &home, &root),
            None if current.is_some() => store.delete_home(&org, &home),
            _ => Ok(()),
        }
    })
    .await?
    .map_err(store_error)
}

/// Turns on this server for the work that moves a record's store pointers
/// (a sandbox's saves, an image's commits and deletes): each reads the
/// record, moves the pointers and the record in turn, so no two leave the
/// pointers naming roots other than the record's. Striped by key: two
/// keys sharing a stripe only take turns.
pub struct PointerTurns([tokio::sync::Mutex<()>; POINTER_TURN_STRIPES]);

const POINTER_TURN_STRIPES: usize = 64;

impl Default for PointerTurns {
    fn default() -> PointerTurns {
        PointerTurns(std::array::from_fn(|_| tokio::sync::Mutex::new(())))
    }
}

impl PointerTurns {
    pub async fn take(&self, key: &str) -> tokio::sync::MutexGuard<'_, ()> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(key);
        self.0[hash as usize % POINTER_TURN_STRIPES].lock().await
    }
}
