//! Kept copies: homes runners set aside instead of deleting (they may be
//! the newest copy of a sandbox's work). Every write here rewrites the
//! sandbox's `kept_copies` list, which its record shows, and appends an
//! event saying what happened to the copy.

use sqlx::Row;
use sqlx::any::AnyRow;

use super::rfc3339;
use super::sandboxes::{load_sandbox, note};
use crate::db::WriteTx;

/// A kept copy's row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptRow {
    pub id: String,
    pub sandbox_id: String,
    pub org_id: String,
    pub runner_id: String,
    pub name: String,
    pub bytes: i64,
    pub kept_at_ms: i64,
    /// Why it is kept (a stable code, see `api::sandboxes::KeptCopy`).
    pub reason: String,
    /// `kept`, or `discarded` (with `ended_reason`).
    pub state: String,
    pub ended_reason: Option<String>,
}

const KEPT_COLUMNS: &str =
    "id, sandbox_id, org_id, runner_id, name, bytes, kept_at_ms, reason, state, ended_reason";

/// A copy still kept.
pub const KEPT: &str = "kept";
/// A copy the runner is to delete.
pub const DISCARDED: &str = "discarded";

impl KeptRow {
    fn from_row(row: &AnyRow) -> Result<KeptRow, sqlx::Error> {
        Ok(KeptRow {
            id: row.try_get("id")?,
            sandbox_id: row.try_get("sandbox_id")?,
            org_id: row.try_get("org_id")?,
            runner_id: row.try_get("runner_id")?,
            name: row.try_get("name")?,
            bytes: row.try_get("bytes")?,
            kept_at_ms: row.try_get("kept_at_ms")?,
            reason: row.try_get("reason")?,
            state: row.try_get("state")?,
            ended_reason: row.try_get("ended_reason")?,
        })
    }

    pub fn to_api(&self) -> api::sandboxes::KeptCopy {
        api::sandboxes::KeptCopy {
            id: self.id.clone(),
            runner_id: self.runner_id.clone(),
            kept_at: rfc3339(self.kept_at_ms),
            bytes: self.bytes.max(0) as u64,
            reason: self.reason.clone(),
        }
    }
}

/// The copy a runner reported under `name` for the sandbox, in any state.
pub async fn find(
    tx: &mut WriteTx,
    runner_id: &str,
    sandbox_id: &str,
    name: &str,
) -> Result<Option<KeptRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {KEPT_COLUMNS} FROM kept_copies WHERE runner_id = $1 AND sandbox_id = $2 AND name = $3"
    ))
    .bind(runner_id)
    .bind(sandbox_id)
    .bind(name)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(KeptRow::from_row).transpose()
}

/// The copy `id` of the sandbox, in any state.
pub async fn load(
    tx: &mut WriteTx,
    sandbox_id: &str,
    id: &str,
) -> Result<Option<KeptRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {KEPT_COLUMNS} FROM kept_copies WHERE id = $1 AND sandbox_id = $2"
    ))
    .bind(id)
    .bind(sandbox_id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(KeptRow::from_row).transpose()
}

/// The copies on `runner_id` still kept.
pub async fn kept_on_runner(
    tx: &mut WriteTx,
    runner_id: &str,
) -> Result<Vec<KeptRow>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT {KEPT_COLUMNS} FROM kept_copies WHERE runner_id = $1 AND state = 'kept' ORDER BY id"
    ))
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    rows.iter().map(KeptRow::from_row).collect()
}

/// How many copies of the sandbox are kept: on `runner_id`, and on every
/// runner.
pub async fn count_kept(
    tx: &mut WriteTx,
    sandbox_id: &str,
    runner_id: &str,
) -> Result<(i64, i64), sqlx::Error> {
    let row = sqlx::query(
        "SELECT COUNT(CASE WHEN runner_id = $2 THEN 1 END) AS on_runner, COUNT(*) AS on_all
         FROM kept_copies WHERE sandbox_id = $1 AND state = 'kept'",
    )
    .bind(sandbox_id)
    .bind(runner_id)
    .fetch_one(&mut *tx.tx)
    .await?;
    Ok((row.try_get("on_runner")?, row.try_get("on_all")?))
}

/// Copies still kept that were set aside before `cutoff_ms`, but those
/// being salvaged (they wait for the salvage to end).
pub async fn kept_before(
    tx: &mut WriteTx,
    cutoff_ms: i64,
    limit: i64,
) -> Result<Vec<KeptRow>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT {KEPT_COLUMNS} FROM kept_copies WHERE state = 'kept' AND kept_at_ms < $1
         AND NOT EXISTS (SELECT 1 FROM snapshots s WHERE s.kept_copy_id = kept_copies.id
                         AND s.durability IN ('pending', 'local'))
         ORDER BY id LIMIT $2"
    ))
    .bind(cutoff_ms)
    .bind(limit)
    .fetch_all(&mut *tx.tx)
    .await?;
    rows.iter().map(KeptRow::from_row).collect()
}

/// Records a new kept copy (state `kept`), with an event on its sandbox.
pub async fn insert(tx: &mut WriteTx, copy: &KeptRow) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO kept_copies ({KEPT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
    ))
    .bind(&copy.id)
    .bind(&copy.sandbox_id)
    .bind(&copy.org_id)
    .bind(&copy.runner_id)
    .bind(&copy.name)
    .bind(copy.bytes)
    .bind(copy.kept_at_ms)
    .bind(&copy.reason)
    .bind(KEPT)
    .bind(None::<String>)
    .execute(&mut *tx.tx)
    .await?;
    // A new copy in the runner's set (its assignments list what it keeps).
    tx.changed(&format!("runner:{}", copy.runner_id));
    let message = format!(
        "runner {} keeps a copy of the home aside ({}, {} bytes): {}",
        copy.runner_id, copy.id, copy.bytes, copy.reason
    );
    refresh(tx, &copy.sandbox_id, "home_kept", &message).await
}

/// The copy goes (`why`: a stable code); the runner deletes it when it
/// next reads its assignments. False if it was no longer kept.
pub async fn discard(tx: &mut WriteTx, copy: &KeptRow, why: &str) -> Result<bool, sqlx::Error> {
    let updated = sqlx::query(
        "UPDATE kept_copies SET state = 'discarded', ended_reason = $1 WHERE id = $2 AND state = 'kept'",
    )
    .bind(why)
    .bind(&copy.id)
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() == 0 {
        return Ok(false);
    }
    tx.changed(&format!("runner:{}", copy.runner_id));
    // A salvage not yet uploaded cannot be any more: it says why.
    let reason = format!(
        "kept_copy_gone: the copy {} was let go ({why}) before its runner uploaded it",
        copy.id
    );
    super::snapshots::fail_salvages(tx, &copy.id, &reason).await?;
    let message = format!(
        "the copy {} on runner {} is to be deleted: {why}",
        copy.id, copy.runner_id
    );
    refresh(tx, &copy.sandbox_id, "home_copy_discarded", &message).await?;
    Ok(true)
}

/// Rewrites the sandbox's list of kept copies, with an event.
async fn refresh(
    tx: &mut WriteTx,
    sandbox_id: &str,
    reason: &str,
    message: &str,
) -> Result<(), sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT {KEPT_COLUMNS} FROM kept_copies WHERE sandbox_id = $1 AND state = 'kept' ORDER BY id"
    ))
    .bind(sandbox_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    let copies = rows
        .iter()
        .map(|row| KeptRow::from_row(row).map(|copy| copy.to_api()))
        .collect::<Result<Vec<_>, _>>()?;
    let list = (!copies.is_empty()).then(|| serde_json::to_string(&copies).unwrap_or_default());
    sqlx::query("UPDATE sandboxes SET kept_copies = $1 WHERE id = $2")
        .bind(list)
        .bind(sandbox_id)
        .execute(&mut *tx.tx)
        .await?;
    if let Some(sandbox) = load_sandbox(tx, sandbox_id).await? {
        note(tx, &sandbox, reason, message, None).await?;
    }
    Ok(())
}
