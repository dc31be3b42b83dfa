//! Filesystem bindings: which org may mount which shared filesystem, and
//! whether only read-only. Written by the admin API alone.

use sqlx::Row;

use super::rfc3339;
use crate::db::WriteTx;
use api::filesystems::FilesystemBinding;

const BINDING_QUERY: &str =
    "SELECT b.filesystem_id, b.org_id, o.name AS org_name, b.read_only, b.bound_at_ms
     FROM filesystem_bindings b JOIN orgs o ON o.id = b.org_id";

fn binding_of(row: &sqlx::any::AnyRow) -> Result<FilesystemBinding, sqlx::Error> {
    Ok(FilesystemBinding {
        filesystem: row.try_get("filesystem_id")?,
        org_id: row.try_get("org_id")?,
        org_name: row.try_get("org_name")?,
        read_only: row.try_get::<i64, _>("read_only")? != 0,
        bound_at: rfc3339(row.try_get("bound_at_ms")?),
    })
}

/// The org's id, named by its id or its name; an id first (names shaped
/// like ids are refused at create, but an older org may have one).
pub async fn org_id_of(tx: &mut WriteTx, org: &str) -> Result<Option<String>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id FROM orgs WHERE id = $1 OR name = $1 \
         ORDER BY CASE WHEN id = $1 THEN 0 ELSE 1 END LIMIT 1",
    )
    .bind(org)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.map(|r| r.try_get("id")).transpose()
}

/// Binds (or rebinds, changing `read_only`) the filesystem to the org.
pub async fn bind(
    tx: &mut WriteTx,
    filesystem: &str,
    org_id: &str,
    read_only: bool,
    now_ms: i64,
) -> Result<FilesystemBinding, sqlx::Error> {
    sqlx::query("DELETE FROM filesystem_bindings WHERE filesystem_id = $1 AND org_id = $2")
        .bind(filesystem)
        .bind(org_id)
        .execute(&mut *tx.tx)
        .await?;
    sqlx::query(
        "INSERT INTO filesystem_bindings (filesystem_id, org_id, read_only, bound_at_ms) VALUES ($1, $2, $3, $4)",
    )
    .bind(filesystem)
    .bind(org_id)
    .bind(i64::from(read_only))
    .bind(now_ms)
    .execute(&mut *tx.tx)
    .await?;
    let found = binding(tx, filesystem, org_id).await?;
    found.ok_or(sqlx::Error::RowNotFound)
}

/// The binding, if the filesystem is bound to the org.
pub async fn binding(
    tx: &mut WriteTx,
    filesystem: &str,
    org_id: &str,
) -> Result<Option<FilesystemBinding>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "{BINDING_QUERY} WHERE b.filesystem_id = $1 AND b.org_id = $2"
    ))
    .bind(filesystem)
    .bind(org_id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(binding_of).transpose()
}

/// Whether `filesystem` is bound to the org (a read outside any
/// transaction: admission checks again inside its own).
pub async fn is_bound(
    pool: &sqlx::AnyPool,
    filesystem: &str,
    org_id: &str,
) -> Result<bool, sqlx::Error> {
    let row =
        sqlx::query("SELECT 1 FROM filesystem_bindings WHERE filesystem_id = $1 AND org_id = $2")
            .bind(filesystem)
            .bind(org_id)
            .fetch_optional(pool)
            .await?;
    Ok(row.is_some())
}

/// Removes the binding; the one removed, if there was one. Sandboxes that
/// mount the filesystem keep it while they run; none is placed with it
/// again (`scheduler::place` waits `filesystem_unbound`).
pub async fn unbind(
    tx: &mut WriteTx,
    filesystem: &str,
    org_id: &str,
) -> Result<Option<FilesystemBinding>, sqlx::Error> {
    let found = binding(tx, filesystem, org_id).await?;
    sqlx::query("DELETE FROM filesystem_bindings WHERE filesystem_id = $1 AND org_id = $2")
        .bind(filesystem)
        .bind(org_id)
        .execute(&mut *tx.tx)
        .await?;
    Ok(found)
}

/// Every binding, by filesystem then org.
pub async fn list(pool: &sqlx::AnyPool) -> Result<Vec<FilesystemBinding>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "{BINDING_QUERY} ORDER BY b.filesystem_id, b.org_id"
    ))
    .fetch_all(pool)
    .await?;
    rows.iter().map(binding_of).collect()
}
