//! The runner row: what a runner registered (capabilities, capacity,
//! placement class), its lease, and whether it is being emptied; and the
//! administrator's view of it.

use sqlx::AnyPool;
use sqlx::Row;
use sqlx::any::AnyRow;

use super::{json_map, rfc3339};
use crate::db::{WriteTx, now_ms};
use api::runners::{RegisterRequest, RunnerRecord};

#[derive(Clone, Debug)]
pub struct RunnerRow {
    pub id: String,
    pub placement_class: String,
    pub capabilities: Vec<String>,
    pub capacity_sandboxes: i64,
    pub capacity_memory_mib: i64,
    pub capacity_millicpus: i64,
    pub capacity_pids: i64,
    pub state: String,
    pub lease_expires_at_ms: i64,
    /// `drain` or `preempt` while the runner is being emptied.
    pub drain: Option<String>,
}

/// A runner's columns as placement reads them, from [`RUNNER_FROM`]: a
/// live runner's lease from its row in `runner_leases`, any other's the
/// one it ended with.
pub const RUNNER_COLUMNS: &str = "r.id, r.placement_class, r.capabilities, r.capacity_sandboxes, r.capacity_memory_mib, r.capacity_millicpus, r.capacity_pids, r.state, COALESCE(l.expires_at_ms, r.lease_expires_at_ms) AS lease_expires_at_ms, r.drain";

pub const RUNNER_FROM: &str = "runners r LEFT JOIN runner_leases l ON l.runner_id = r.id";

impl RunnerRow {
    pub fn from_row(row: &AnyRow) -> Result<RunnerRow, sqlx::Error> {
        let capabilities: String = row.try_get("capabilities")?;
        Ok(RunnerRow {
            id: row.try_get("id")?,
            placement_class: row.try_get("placement_class")?,
            capabilities: serde_json::from_str(&capabilities).unwrap_or_default(),
            capacity_sandboxes: row.try_get("capacity_sandboxes")?,
            capacity_memory_mib: row.try_get("capacity_memory_mib")?,
            capacity_millicpus: row.try_get("capacity_millicpus")?,
            capacity_pids: row.try_get("capacity_pids")?,
            state: row.try_get("state")?,
            lease_expires_at_ms: row.try_get("lease_expires_at_ms")?,
            drain: row.try_get("drain")?,
        })
    }

    pub fn is_live(&self, now: i64) -> bool {
        self.state == "live" && self.lease_expires_at_ms > now
    }
}

/// The runner as this transaction sees it.
pub async fn load(tx: &mut WriteTx, id: &str) -> Result<Option<RunnerRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {RUNNER_COLUMNS} FROM {RUNNER_FROM} WHERE r.id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(RunnerRow::from_row).transpose()
}

/// Every runner not retired, by id (placement's view: in a write
/// transaction, or on a connection of its own when read ahead).
///
/// The runners and the live leases are read apart and joined here: the
/// join in the database cost more than the two plain reads at 10,000
/// runners, and this read runs every second on every server. A runner
/// lost between the two reads has no lease row left and keeps the lease
/// its row holds, as the join would have; the placement lock checks the
/// lease again before anything is placed on it.
pub async fn all_runners(conn: &mut sqlx::AnyConnection) -> Result<Vec<RunnerRow>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT r.id, r.placement_class, r.capabilities, r.capacity_sandboxes, r.capacity_memory_mib, r.capacity_millicpus, r.capacity_pids, r.state, r.lease_expires_at_ms, r.drain
         FROM runners r WHERE r.state <> 'retired'",
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut runners = rows
        .iter()
        .map(RunnerRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    let leases: std::collections::HashMap<String, i64> =
        sqlx::query_as("SELECT runner_id, expires_at_ms FROM runner_leases")
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .collect();
    for runner in &mut runners {
        if let Some(&expires_at_ms) = leases.get(&runner.id) {
            runner.lease_expires_at_ms = expires_at_ms;
        }
    }
    // Sorted here rather than by the database: a scan of the table in
    // order is cheaper for it than a walk of the key's index.
    runners.sort_unstable_by(|a, b| a.id.cmp(&b.id));
    Ok(runners)
}

/// A runner being enrolled.
pub struct NewRunner<'a> {
    pub id: &'a str,
    /// The hash of the credential it is bound to.
    pub credential_hash: &'a str,
    /// What its enrolment token allows it to declare (JSON of an
    /// `api::orgs::RunnerProfile`; `None`: anything), kept for every
    /// later registration.
    pub profile: Option<&'a str>,
}

/// Registers a new runner, live until `lease_until_ms`.
pub async fn register_new(
    tx: &mut WriteTx,
    request: &RegisterRequest,
    lease_until_ms: i64,
    new: NewRunner<'_>,
) -> Result<(), sqlx::Error> {
    let NewRunner {
        id,
        credential_hash,
        profile,
    } = new;
    let labels = serde_json::to_string(&request.labels).unwrap_or_default();
    let capabilities = serde_json::to_string(&request.capabilities).unwrap_or_default();
    let capacity = &request.capacity;
    sqlx::query(
        "INSERT INTO runners (id, name, placement_class, labels, capabilities, capacity_sandboxes, capacity_memory_mib, capacity_millicpus, capacity_pids, state, lease_expires_at_ms, registered_at_ms, placements, credential_hash, profile)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'live', $10, $11, 0, $12, $13)",
    )
    .bind(id)
    .bind(&request.name)
    .bind(&request.placement_class)
    .bind(&labels)
    .bind(&capabilities)
    .bind(capacity.sandboxes as i64)
    .bind(capacity.memory_mib as i64)
    .bind(millicpus(capacity.cpus))
    .bind(capacity.pids as i64)
    .bind(lease_until_ms)
    .bind(now_ms())
    .bind(credential_hash)
    .bind(profile)
    .execute(&mut *tx.tx)
    .await?;
    set_lease(tx, id, lease_until_ms).await?;
    tx.runners_changed = true;
    Ok(())
}

/// What runner `id`'s enrolment token allows it to declare (see
/// [`NewRunner::profile`]).
pub async fn profile(pool: &AnyPool, id: &str) -> Result<Option<String>, sqlx::Error> {
    let row: Option<(Option<String>,)> =
        sqlx::query_as("SELECT profile FROM runners WHERE id = $1")
            .bind(id)
            .fetch_optional(pool)
            .await?;
    Ok(row.and_then(|(profile,)| profile))
}

/// Writes a live runner's lease (`runner_leases`).
async fn set_lease(tx: &mut WriteTx, id: &str, until_ms: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO runner_leases (runner_id, expires_at_ms) VALUES ($1, $2)
         ON CONFLICT (runner_id) DO UPDATE SET expires_at_ms = excluded.expires_at_ms",
    )
    .bind(id)
    .bind(until_ms)
    .execute(&mut *tx.tx)
    .await?;
    Ok(())
}

/// Registers the runner `id` again (a restart, or after its lease was
/// lost), live until `lease_until_ms`, with what it offers now. False if
/// there is no such runner.
pub async fn register_again(
    tx: &mut WriteTx,
    id: &str,
    request: &RegisterRequest,
    lease_until_ms: i64,
) -> Result<bool, sqlx::Error> {
    let labels = serde_json::to_string(&request.labels).unwrap_or_default();
    let capabilities = serde_json::to_string(&request.capabilities).unwrap_or_default();
    let capacity = &request.capacity;
    let updated = sqlx::query(
        "UPDATE runners SET name = $1, placement_class = $2, labels = $3, capabilities = $4, capacity_sandboxes = $5, capacity_memory_mib = $6, capacity_millicpus = $7, capacity_pids = $8, state = 'live', lease_expires_at_ms = $9 WHERE id = $10",
    )
    .bind(&request.name)
    .bind(&request.placement_class)
    .bind(&labels)
    .bind(&capabilities)
    .bind(capacity.sandboxes as i64)
    .bind(capacity.memory_mib as i64)
    .bind(millicpus(capacity.cpus))
    .bind(capacity.pids as i64)
    .bind(lease_until_ms)
    .bind(id)
    .execute(&mut *tx.tx)
    .await?;
    let updated = updated.rows_affected() > 0;
    if updated {
        set_lease(tx, id, lease_until_ms).await?;
    }
    tx.runners_changed = true;
    Ok(updated)
}

fn millicpus(cpus: f64) -> i64 {
    (cpus * 1000.0).round() as i64
}

/// The runner whose credential hashes to `credential_hash`, if any.
pub async fn by_credential(
    pool: &AnyPool,
    credential_hash: &str,
) -> Result<Option<String>, sqlx::Error> {
    let row: Option<(String,)> =
        sqlx::query_as("SELECT id FROM runners WHERE credential_hash = $1")
            .bind(credential_hash)
            .fetch_optional(pool)
            .await?;
    Ok(row.map(|(id,)| id))
}

/// Whether the runner holds anything of `org_id`: while its lease is live,
/// a sandbox placed on it that has not ended (the sandboxes its
/// assignments list, with their images, saves and snapshots); or a kept
/// copy it is to upload for a salvage under way. The block service lets a
/// runner use an org's objects only then: an ended sandbox keeps its
/// `runner_id`, which must not keep the org's store open to that runner.
pub async fn holds_org(pool: &AnyPool, runner_id: &str, org_id: &str) -> Result<bool, sqlx::Error> {
    let row: Option<(String,)> = sqlx::query_as(
        "SELECT id FROM sandboxes WHERE runner_id = $1 AND org_id = $2
         AND state NOT IN ('deleted', 'deleting', 'terminated', 'failed')
         AND EXISTS (SELECT 1 FROM runner_leases WHERE runner_id = $1) LIMIT 1",
    )
    .bind(runner_id)
    .bind(org_id)
    .fetch_optional(pool)
    .await?;
    if row.is_some() {
        return Ok(true);
    }
    let salvage: Option<(String,)> = sqlx::query_as(
        "SELECT s.id FROM snapshots s JOIN kept_copies k ON k.id = s.kept_copy_id
         WHERE k.runner_id = $1 AND s.kept_runner_id = $1 AND k.state = 'kept' AND s.org_id = $2
         AND s.durability IN ('pending', 'local') LIMIT 1",
    )
    .bind(runner_id)
    .bind(org_id)
    .fetch_optional(pool)
    .await?;
    Ok(salvage.is_some())
}

/// Live runners whose lease ends before `before_ms`, soonest first: id and
/// lease end (an indexed range, `runner_leases_by_end`: only live runners
/// have a lease row).
pub async fn silent(pool: &AnyPool, before_ms: i64) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as(SILENT_SQL)
        .bind(before_ms)
        .fetch_all(pool)
        .await
}

pub const SILENT_SQL: &str = "SELECT runner_id, expires_at_ms FROM runner_leases WHERE expires_at_ms < $1 ORDER BY expires_at_ms";

/// How many runners are live (read only when some lease expired).
pub async fn count_live(pool: &AnyPool) -> Result<usize, sqlx::Error> {
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM runners WHERE state = 'live'")
        .fetch_one(pool)
        .await?;
    Ok(n.max(0) as usize)
}

/// Renews the leases of these runners, each only while still live: one
/// statement per [`RENEWALS_PER_STATEMENT`] ids, in one transaction
/// (heartbeats are the most frequent write of a fleet: a batch of them
/// costs one commit; on PostgreSQL a batch of one statement is that
/// statement committed by itself, one round trip). Answers which were
/// renewed.
pub async fn renew_leases(
    db: &crate::db::Db,
    ids: &[String],
    until_ms: i64,
) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    if db.engine == crate::db::Engine::Postgres && ids.len() <= RENEWALS_PER_STATEMENT {
        return renew_some(&db.pool, ids, until_ms).await;
    }
    let mut renewed = std::collections::HashSet::new();
    let mut tx = db.write().await?;
    for chunk in ids.chunks(RENEWALS_PER_STATEMENT) {
        renewed.extend(renew_some(&mut *tx.tx, chunk, until_ms).await?);
    }
    tx.commit().await?;
    Ok(renewed)
}

async fn renew_some<'e, E>(
    executor: E,
    ids: &[String],
    until_ms: i64,
) -> Result<std::collections::HashSet<String>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    let placeholders: Vec<String> = (0..ids.len()).map(|i| format!("${}", i + 2)).collect();
    let sql = format!(
        "UPDATE runner_leases SET expires_at_ms = $1 WHERE runner_id IN ({}) RETURNING runner_id",
        placeholders.join(", ")
    );
    let mut query = sqlx::query(&sql).bind(until_ms);
    for id in ids {
        query = query.bind(id);
    }
    query
        .fetch_all(executor)
        .await?
        .iter()
        .map(|row| row.try_get::<String, _>("runner_id"))
        .collect()
}

/// Ids bound in one renewal statement (well under SQLite's and
/// PostgreSQL's limits on bound parameters).
pub const RENEWALS_PER_STATEMENT: usize = 500;

/// Declares a live runner whose lease ended before `cutoff_ms` lost.
/// False if it renewed meanwhile (or was already lost).
pub async fn mark_lost(tx: &mut WriteTx, id: &str, cutoff_ms: i64) -> Result<bool, sqlx::Error> {
    // The lease row goes first: a renewal racing this waits for its lock,
    // then finds no row (not renewed: fenced); one that renewed first
    // leaves a lease this delete no longer matches.
    let ended: Option<(i64,)> = sqlx::query_as(
        "DELETE FROM runner_leases WHERE runner_id = $1 AND expires_at_ms < $2 RETURNING expires_at_ms",
    )
    .bind(id)
    .bind(cutoff_ms)
    .fetch_optional(&mut *tx.tx)
    .await?;
    let Some((ended_ms,)) = ended else {
        return Ok(false);
    };
    let lost =
        sqlx::query("UPDATE runners SET state = 'lost', lease_expires_at_ms = $1 WHERE id = $2 AND state = 'live'")
            .bind(ended_ms)
            .bind(id)
            .execute(&mut *tx.tx)
            .await?;
    Ok(lost.rows_affected() > 0)
}

/// Sets (`drain`, `preempt`) or clears the runner's drain, waking it.
pub async fn set_drain(tx: &mut WriteTx, id: &str, drain: Option<&str>) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE runners SET drain = $1 WHERE id = $2")
        .bind(drain)
        .bind(id)
        .execute(&mut *tx.tx)
        .await?;
    tx.runners_changed = true;
    Ok(())
}

const RECORD_QUERY: &str = "SELECT r.id, r.name, r.placement_class, r.state,
     COALESCE((SELECT l.expires_at_ms FROM runner_leases l WHERE l.runner_id = r.id), r.lease_expires_at_ms) AS lease_expires_at_ms, r.registered_at_ms, r.drain, r.capabilities, r.labels,
     (SELECT COUNT(*) FROM sandboxes s WHERE s.runner_id = r.id AND s.state <> 'deleted') AS sandboxes
     FROM runners r";

fn record_of(row: &AnyRow) -> Result<RunnerRecord, sqlx::Error> {
    let capabilities: String = row.try_get("capabilities")?;
    let labels: String = row.try_get("labels")?;
    Ok(RunnerRecord {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        placement_class: row.try_get("placement_class")?,
        state: row.try_get("state")?,
        lease_expires_at: rfc3339(row.try_get("lease_expires_at_ms")?),
        registered_at: rfc3339(row.try_get("registered_at_ms")?),
        drain: row.try_get("drain")?,
        sandboxes: row.try_get::<i64, _>("sandboxes")?.max(0) as u64,
        capabilities: serde_json::from_str(&capabilities).unwrap_or_default(),
        labels: json_map(&labels),
    })
}

/// The runner as an administrator sees it.
pub async fn record(tx: &mut WriteTx, id: &str) -> Result<Option<RunnerRecord>, sqlx::Error> {
    let row = sqlx::query(&format!("{RECORD_QUERY} WHERE r.id = $1"))
        .bind(id)
        .fetch_optional(&mut *tx.tx)
        .await?;
    row.as_ref().map(record_of).transpose()
}

/// Every runner not retired, as an administrator sees it.
pub async fn records(pool: &AnyPool) -> Result<Vec<RunnerRecord>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "{RECORD_QUERY} WHERE r.state <> 'retired' ORDER BY r.id"
    ))
    .fetch_all(pool)
    .await?;
    rows.iter().map(record_of).collect()
}

/// Records where the runner's data listener is and the key it checks
/// tokens with (both as of its last registration).
pub async fn set_data_path(
    tx: &mut WriteTx,
    id: &str,
    url: Option<&str>,
    key: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE runners SET data_url = $1, data_key = $2 WHERE id = $3")
        .bind(url)
        .bind(key)
        .bind(id)
        .execute(&mut *tx.tx)
        .await?;
    Ok(())
}

/// The runner's data URL and key, if it registered both.
pub async fn data_path(pool: &AnyPool, id: &str) -> Result<Option<(String, String)>, sqlx::Error> {
    let row: Option<(Option<String>, Option<String>)> =
        sqlx::query_as("SELECT data_url, data_key FROM runners WHERE id = $1")
            .bind(id)
            .fetch_optional(pool)
            .await?;
    Ok(match row {
        Some((Some(url), Some(key))) => Some((url, key)),
        _ => None,
    })
}

/// Live runners offering `capability` that have a data path: id, URL, key.
pub async fn live_data_paths(
    pool: &AnyPool,
    capability: &str,
    now_ms: i64,
) -> Result<Vec<(String, String, String)>, sqlx::Error> {
    let rows: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT r.id, r.capabilities, r.data_url, r.data_key FROM runners r JOIN runner_leases l ON l.runner_id = r.id
         WHERE r.state = 'live' AND l.expires_at_ms > $1 AND r.data_url IS NOT NULL AND r.data_key IS NOT NULL ORDER BY r.id",
    )
    .bind(now_ms)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter(|(_, capabilities, _, _)| {
            serde_json::from_str::<Vec<String>>(capabilities)
                .is_ok_and(|offered| offered.iter().any(|c| c == capability))
        })
        .map(|(id, _, url, key)| (id, url, key))
        .collect())
}
