//! Snapshot deadlines: a snapshot that can no longer reach its requested
//! durability fails rather than leave an unusable receipt.

use sqlx::Row;

use super::AppState;
use crate::db::now_ms;
use crate::records;

/// Fails snapshots that can no longer keep their promise: past the
/// deadline without the requested durability, or whose sandbox ended
/// before its runner captured them. Returns how many.
pub async fn expire(state: &AppState) -> Result<u64, sqlx::Error> {
    let now = now_ms();
    let mut tx = state.db.write().await?;
    let rows = sqlx::query(&format!(
        "SELECT s.id AS id, CASE WHEN s.deadline_at_ms IS NOT NULL AND s.deadline_at_ms < $1
                AND NOT (s.requested = 'local' AND s.durability = 'local')
                THEN 'durability_deadline_exceeded' ELSE 'sandbox_ended' END AS reason
         FROM snapshots s JOIN sandboxes b ON b.id = s.sandbox_id
         WHERE s.durability IN ('pending', 'local')
         AND ((s.deadline_at_ms IS NOT NULL AND s.deadline_at_ms < $1
               AND NOT (s.requested = 'local' AND s.durability = 'local'))
              OR b.state IN {})",
        records::terminal_states_sql()
    ))
    .bind(now)
    .fetch_all(&mut *tx.tx)
    .await?;
    for row in &rows {
        let id: String = row.try_get("id")?;
        let reason: String = row.try_get("reason")?;
        sqlx::query(
            "UPDATE snapshots SET durability = 'failed', reason = $1, updated_at_ms = $2
             WHERE id = $3 AND durability IN ('pending', 'local')",
        )
        .bind(&reason)
        .bind(now)
        .bind(&id)
        .execute(&mut *tx.tx)
        .await?;
        tx.changed(&id).await?;
        tracing::info!(snapshot_id = %id, %reason, "snapshot failed");
    }
    tx.commit().await?;
    Ok(rows.len() as u64)
}
