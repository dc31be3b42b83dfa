//! Shared filesystems: an operator binds a filesystem id (one runners
//! declare with `--filesystem ID=…`) to an org, read-write or read-only;
//! admission lets the org's sandboxes mount only what is bound to it.

use super::AppState;
use crate::db::now_ms;
use crate::error::ControlError;
use crate::records;
use api::filesystems::{BindFilesystemRequest, FilesystemBinding, FilesystemBindingList};

fn check_id(filesystem: &str) -> Result<(), ControlError> {
    if super::admission::filesystem_id_ok(filesystem) {
        Ok(())
    } else {
        Err(crate::limits::invalid(
            "filesystem",
            "use 1-64 of a-z 0-9 - _, starting with a letter or digit",
        ))
    }
}

/// Binds `filesystem` to the org (named by id or name); binding again
/// changes `read_only` (for sandboxes created after it).
pub async fn bind(
    state: &AppState,
    filesystem: &str,
    org: &str,
    request: &BindFilesystemRequest,
) -> Result<FilesystemBinding, ControlError> {
    check_id(filesystem)?;
    let mut tx = state.db.write().await?;
    let org_id = records::filesystems::org_id_of(&mut tx, org)
        .await?
        .ok_or_else(|| records::not_found("org"))?;
    let binding =
        records::filesystems::bind(&mut tx, filesystem, &org_id, request.read_only, now_ms())
            .await?;
    tx.commit().await?;
    tracing::info!(%filesystem, %org_id, read_only = request.read_only, "filesystem bound");
    Ok(binding)
}

/// Removes the binding (404 if there is none). Sandboxes already mounting
/// the filesystem keep their mounts; new creates are refused.
pub async fn unbind(
    state: &AppState,
    filesystem: &str,
    org: &str,
) -> Result<FilesystemBinding, ControlError> {
    check_id(filesystem)?;
    let mut tx = state.db.write().await?;
    let org_id = records::filesystems::org_id_of(&mut tx, org)
        .await?
        .ok_or_else(|| records::not_found("org"))?;
    let removed = records::filesystems::unbind(&mut tx, filesystem, &org_id)
        .await?
        .ok_or_else(|| records::not_found("binding"))?;
    tx.commit().await?;
    tracing::info!(%filesystem, %org_id, "filesystem unbound");
    Ok(removed)
}

pub async fn list(state: &AppState) -> Result<FilesystemBindingList, ControlError> {
    Ok(FilesystemBindingList {
        bindings: records::filesystems::list(&state.db.pool).await?,
    })
}
