//! Reads of the org rows (written by `control::orgs`): every org with its
//! quotas and what it uses of them, for the admin's view.

use sqlx::AnyPool;
use sqlx::Row;

use super::rfc3339;

/// Every org, oldest first, with its usage counted as `admission` counts
/// it (running: wanted running in a running state; total: held, not being
/// deleted), read from the kept counts (`records::counts`).
pub async fn usage(pool: &AnyPool) -> Result<Vec<api::orgs::OrgUsage>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT o.id, o.name, o.max_running, o.max_total, o.max_store_mib, o.created_at_ms,
            (SELECT CAST(COALESCE(SUM(c.running), 0) AS BIGINT) FROM sandbox_counts c WHERE c.scope = 'org:' || o.id) AS running,
            (SELECT CAST(COALESCE(SUM(c.held), 0) AS BIGINT) FROM sandbox_counts c WHERE c.scope = 'org:' || o.id) AS total,
            (SELECT CAST(COALESCE(SUM(b.bytes), 0) AS BIGINT) FROM output_counts b WHERE b.org_id = o.id) AS output_bytes
         FROM orgs o ORDER BY o.created_at_ms, o.id",
    )
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
                max_store_mib: limit("max_store_mib")?,
                running: row.try_get::<i64, _>("running")?.max(0) as u64,
                total: row.try_get::<i64, _>("total")?.max(0) as u64,
                output_bytes: row.try_get::<i64, _>("output_bytes")?.max(0) as u64,
            })
        })
        .collect()
}

/// The org's bound on its stored bytes, in MiB (`None`: unbounded, or no
/// such org).
pub async fn max_store_mib(pool: &AnyPool, org_id: &str) -> Result<Option<u64>, sqlx::Error> {
    let row: Option<(Option<i64>,)> =
        sqlx::query_as("SELECT max_store_mib FROM orgs WHERE id = $1")
            .bind(org_id)
            .fetch_optional(pool)
            .await?;
    Ok(row.and_then(|(limit,)| limit).map(|v| v.max(0) as u64))
}
