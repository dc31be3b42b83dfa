//! The snapshot row: a receipt whose durability moves `pending` → `local`
//! → `replicated`, or ends `failed`.

use sqlx::AnyPool;
use sqlx::Row;

use super::rfc3339;
use crate::db::{WriteTx, now_ms};
use api::snapshots::{SalvagedFrom, Snapshot};

pub const SNAPSHOT_COLUMNS: &str = "id, org_id, sandbox_id, requested, durability, reason, deadline_at_ms, root, files, logical_bytes, captured_at_ms, created_at_ms, updated_at_ms, kept_copy_id, kept_runner_id, kept_at_ms";
/// Durabilities nothing moves on from.
pub const ENDED: &[&str] = &["replicated", "failed"];

#[derive(Clone, Debug)]
pub struct SnapshotRow {
    pub id: String,
    pub org_id: String,
    pub sandbox_id: String,
    pub requested: String,
    pub durability: String,
    pub reason: Option<String>,
    pub deadline_at_ms: Option<i64>,
    pub root: Option<String>,
    pub files: Option<i64>,
    pub logical_bytes: Option<i64>,
    pub captured_at_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// A salvage: the kept copy it holds, its runner, when it was kept.
    pub kept: Option<KeptSource>,
}

/// The kept copy a salvage snapshot is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptSource {
    pub copy_id: String,
    pub runner_id: String,
    pub kept_at_ms: i64,
}

impl SnapshotRow {
    pub fn from_row(row: &sqlx::any::AnyRow) -> Result<SnapshotRow, sqlx::Error> {
        Ok(SnapshotRow {
            id: row.try_get("id")?,
            org_id: row.try_get("org_id")?,
            sandbox_id: row.try_get("sandbox_id")?,
            requested: row.try_get("requested")?,
            durability: row.try_get("durability")?,
            reason: row.try_get("reason")?,
            deadline_at_ms: row.try_get("deadline_at_ms")?,
            root: row.try_get("root")?,
            files: row.try_get("files")?,
            logical_bytes: row.try_get("logical_bytes")?,
            captured_at_ms: row.try_get("captured_at_ms")?,
            created_at_ms: row.try_get("created_at_ms")?,
            updated_at_ms: row.try_get("updated_at_ms")?,
            kept: match (
                row.try_get::<Option<String>, _>("kept_copy_id")?,
                row.try_get::<Option<String>, _>("kept_runner_id")?,
            ) {
                (Some(copy_id), Some(runner_id)) => Some(KeptSource {
                    copy_id,
                    runner_id,
                    kept_at_ms: row.try_get::<Option<i64>, _>("kept_at_ms")?.unwrap_or(0),
                }),
                _ => None,
            },
        })
    }

    pub fn to_api(&self) -> Snapshot {
        Snapshot {
            id: self.id.clone(),
            sandbox_id: self.sandbox_id.clone(),
            requested: self.requested.clone(),
            durability: self.durability.clone(),
            reason: self.reason.clone(),
            deadline: self.deadline_at_ms.map(rfc3339),
            root: self.root.clone(),
            files: self.files.map(|f| f.max(0) as u64),
            logical_bytes: self.logical_bytes.map(|b| b.max(0) as u64),
            captured_at: self.captured_at_ms.map(rfc3339),
            created_at: rfc3339(self.created_at_ms),
            updated_at: rfc3339(self.updated_at_ms),
            salvaged_from: self.kept.as_ref().map(|kept| SalvagedFrom {
                copy_id: kept.copy_id.clone(),
                runner_id: kept.runner_id.clone(),
                kept_at: rfc3339(kept.kept_at_ms),
            }),
        }
    }
}

pub async fn load(tx: &mut WriteTx, id: &str) -> Result<Option<SnapshotRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(SnapshotRow::from_row).transpose()
}

/// The org's snapshot.
pub async fn visible(
    pool: &AnyPool,
    org_id: &str,
    id: &str,
) -> Result<Option<SnapshotRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = $1 AND org_id = $2"
    ))
    .bind(id)
    .bind(org_id)
    .fetch_optional(pool)
    .await?;
    row.as_ref().map(SnapshotRow::from_row).transpose()
}

/// One page of the org's snapshots (of one sandbox, if named) in id
/// order after `cursor`, and the next page's cursor.
pub async fn list(
    pool: &AnyPool,
    org_id: &str,
    sandbox_id: Option<&str>,
    cursor: &str,
    limit: usize,
) -> Result<(Vec<SnapshotRow>, Option<String>), sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE org_id = $1 AND id > $2
         AND ($3 = '' OR sandbox_id = $3) ORDER BY id LIMIT {}",
        limit + 1
    ))
    .bind(org_id)
    .bind(cursor)
    .bind(sandbox_id.unwrap_or_default())
    .fetch_all(pool)
    .await?;
    let snapshots = rows
        .iter()
        .map(SnapshotRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(super::page(snapshots, limit, |s| &s.id))
}

/// A snapshot as it is first recorded.
pub struct New<'a> {
    pub id: &'a str,
    pub org_id: &'a str,
    pub sandbox_id: &'a str,
    pub requested: &'a str,
    pub durability: &'a str,
    pub deadline_at_ms: Option<i64>,
    pub root: Option<&'a str>,
    pub captured_at_ms: Option<i64>,
    /// Set for a snapshot that ends as soon as it is recorded (`failed`).
    pub reason: Option<&'a str>,
    /// A salvage: the kept copy it is made of.
    pub kept: Option<&'a KeptSource>,
}

pub async fn insert(tx: &mut WriteTx, new: New<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, NULL, NULL, $9, $10, $10, $11, $12, $13)"
    ))
    .bind(new.id)
    .bind(new.org_id)
    .bind(new.sandbox_id)
    .bind(new.requested)
    .bind(new.durability)
    .bind(new.reason)
    .bind(new.deadline_at_ms)
    .bind(new.root)
    .bind(new.captured_at_ms)
    .bind(now_ms())
    .bind(new.kept.map(|kept| kept.copy_id.as_str()))
    .bind(new.kept.map(|kept| kept.runner_id.as_str()))
    .bind(new.kept.map(|kept| kept.kept_at_ms))
    .execute(&mut *tx.tx)
    .await?;
    tx.changed(new.id);
    Ok(())
}

/// The durability a runner's report brings a snapshot to.
pub enum Reached {
    /// Captured on the runner (only from `pending`).
    Local {
        captured_at_ms: i64,
    },
    /// The whole tree is in the store, pinned.
    Replicated {
        root: String,
        files: Option<i64>,
        logical_bytes: i64,
        captured_at_ms: Option<i64>,
    },
    Failed {
        reason: String,
    },
}

pub async fn set_durability(
    tx: &mut WriteTx,
    id: &str,
    reached: Reached,
) -> Result<(), sqlx::Error> {
    let now = now_ms();
    let query = match reached {
        Reached::Local { captured_at_ms } => sqlx::query(
            "UPDATE snapshots SET durability = 'local', captured_at_ms = $1, updated_at_ms = $2
             WHERE id = $3 AND durability = 'pending'",
        )
        .bind(captured_at_ms)
        .bind(now)
        .bind(id.to_owned()),
        Reached::Replicated {
            root,
            files,
            logical_bytes,
            captured_at_ms,
        } => sqlx::query(
            "UPDATE snapshots SET durability = 'replicated', root = $1, files = $2, logical_bytes = $3,
             captured_at_ms = COALESCE(captured_at_ms, $4), updated_at_ms = $5 WHERE id = $6",
        )
        .bind(root)
        .bind(files)
        .bind(logical_bytes)
        .bind(captured_at_ms)
        .bind(now)
        .bind(id.to_owned()),
        Reached::Failed { reason } => sqlx::query(
            "UPDATE snapshots SET durability = 'failed', reason = $1, updated_at_ms = $2 WHERE id = $3",
        )
        .bind(reason)
        .bind(now)
        .bind(id.to_owned()),
    };
    query.execute(&mut *tx.tx).await?;
    tx.changed(id);
    Ok(())
}

/// Fails a snapshot that has not reached `replicated` (or failed) yet.
pub async fn fail_unfinished(tx: &mut WriteTx, id: &str, reason: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE snapshots SET durability = 'failed', reason = $1, updated_at_ms = $2
         WHERE id = $3 AND durability IN ('pending', 'local')",
    )
    .bind(reason)
    .bind(now_ms())
    .bind(id)
    .execute(&mut *tx.tx)
    .await?;
    tx.changed(id);
    Ok(())
}

pub async fn delete(tx: &mut WriteTx, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM snapshots WHERE id = $1")
        .bind(id)
        .execute(&mut *tx.tx)
        .await?;
    tx.changed(id);
    Ok(())
}

/// The salvage snapshots of kept copy `copy_id` not yet replicated or
/// failed, in id order.
pub async fn pending_salvages(tx: &mut WriteTx, copy_id: &str) -> Result<Vec<String>, sqlx::Error> {
    let rows: Vec<(String,)> = sqlx::query_as(
        "SELECT id FROM snapshots WHERE kept_copy_id = $1 AND durability IN ('pending', 'local') ORDER BY id",
    )
    .bind(copy_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

/// Fails every unfinished salvage of kept copy `copy_id` (`reason`: why).
pub async fn fail_salvages(
    tx: &mut WriteTx,
    copy_id: &str,
    reason: &str,
) -> Result<(), sqlx::Error> {
    for id in pending_salvages(tx, copy_id).await? {
        fail_unfinished(tx, &id, reason).await?;
    }
    Ok(())
}
