//! Reads of the org rows (written by `control::orgs`): every org with its
//! quotas and what it uses of them, for the admin's view.

use sqlx::AnyPool;
use sqlx::Row;

use super::{held_states_sql, rfc3339, running_quota_states_sql};

/// Every org, oldest first, with its usage counted as `admission` counts
/// it (running: wanted running in a running state; total: held, not being
/// deleted). One statement: the counts are grouped, not one query per org.
pub async fn usage(pool: &AnyPool) -> Result<Vec<api::orgs::OrgUsage>, sqlx::Error> {
    let (running_states, held_states) = (running_quota_states_sql(), held_states_sql());
    let rows = sqlx::query(&format!(
        "SELECT o.id, o.name, o.max_running, o.max_total, o.created_at_ms,
            (SELECT COUNT(*) FROM sandboxes s WHERE s.org_id = o.id AND s.desired = 'running' AND s.state IN {running_states}) AS running,
            (SELECT COUNT(*) FROM sandboxes s WHERE s.org_id = o.id AND s.desired <> 'deleted' AND s.state IN {held_states}) AS total
         FROM orgs o ORDER BY o.created_at_ms, o.id"
    ))
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            let limit = |column: &str| -> Result<Option<u64>, sqlx::Error> {
                Ok(row
                    .try_get::<Option<i64>, _>(column)?
                    .map(|v| v.max(0) as u64))
            };
            Ok(api::orgs::OrgUsage {
                org_id: row.try_get("id")?,
                name: row.try_get("name")?,
                created_at: rfc3339(row.try_get("created_at_ms")?),
                max_running: limit("max_running")?,
                max_total: limit("max_total")?,
                running: row.try_get::<i64, _>("running")?.max(0) as u64,
                total: row.try_get::<i64, _>("total")?.max(0) as u64,
            })
        })
        .collect()
}
