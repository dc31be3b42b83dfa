//! Counts kept as rows: each org's and the fleet's quota counts
//! (`sandbox_counts`) and each runner's usage (`runner_usage`), so that
//! admission and placement read a few rows, never count sandboxes.
//!
//! Every write that changes what a sandbox counts toward (its state,
//! desired state or runner; insert) hands the row's before and after
//! [`Counted`] to [`WriteTx::count`]; the deltas are summed in the
//! transaction and written by [`flush`] at commit, in one order (quota
//! slots sorted, then runners sorted), as the transaction's last
//! statements: a transaction holding a count row waits for nothing else,
//! so counts add no deadlock, and a row is held only for the commit.
//! Reads inside the transaction add its pending deltas ([`runner_usage`]).
//! [`drift`] recomputes everything from the sandboxes and names what
//! differs (`roost admin counts`, and the tests).

use std::collections::BTreeMap;

use sqlx::AnyPool;
use sqlx::Row;

use crate::db::WriteTx;
use api::lifecycle::{DesiredState, SandboxState};

/// Quota rows per scope: concurrent transactions pick one at random, so
/// they rarely wait on each other; a count sums them.
const SLOTS: u64 = 8;

/// Count rows written per statement at commit (well within SQLite's and
/// PostgreSQL's limits on parameters).
const QUOTA_ROWS_PER_STATEMENT: usize = 256;

/// What one sandbox row counts toward, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counted {
    pub org_id: String,
    pub state: SandboxState,
    pub desired: DesiredState,
    pub runner_id: Option<String>,
    pub memory_mib: i64,
    pub millicpus: i64,
    pub pids: i64,
}

impl Counted {
    pub fn of(row: &super::SandboxRow) -> Counted {
        Counted {
            org_id: row.org_id.clone(),
            state: row.state,
            desired: row.desired,
            runner_id: row.runner_id.clone(),
            memory_mib: row.memory_mib.unwrap_or(0),
            millicpus: row.millicpus.unwrap_or(0),
            pids: row.pids.unwrap_or(0),
        }
    }

    /// Counts against `sandboxes.running` and the fleet ceiling.
    pub fn running(&self) -> bool {
        self.desired == DesiredState::Running && self.state.counts_as_running()
    }

    /// Counts against `sandboxes.total`.
    pub fn held(&self) -> bool {
        self.desired != DesiredState::Deleted && self.state.is_held()
    }

    /// The runner whose capacity it uses.
    pub fn computes_on(&self) -> Option<&str> {
        self.runner_id
            .as_deref()
            .filter(|_| self.state.holds_compute())
    }
}

/// Usage of a runner's capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub sandboxes: i64,
    pub memory_mib: i64,
    pub millicpus: i64,
    pub pids: i64,
}

/// The changes a transaction makes to the counts, written at commit.
#[derive(Debug, Default)]
pub struct Pending {
    /// scope → (running, held).
    quotas: BTreeMap<String, (i64, i64)>,
    runners: BTreeMap<String, Usage>,
}

impl Pending {
    fn add(&mut self, counted: &Counted, sign: i64) {
        let (running, held) = (
            i64::from(counted.running()) * sign,
            i64::from(counted.held()) * sign,
        );
        if running != 0 || held != 0 {
            for scope in ["fleet".to_owned(), format!("org:{}", counted.org_id)] {
                let entry = self.quotas.entry(scope).or_default();
                entry.0 += running;
                entry.1 += held;
            }
        }
        if let Some(runner) = counted.computes_on() {
            let usage = self.runners.entry(runner.to_owned()).or_default();
            usage.sandboxes += sign;
            usage.memory_mib += counted.memory_mib * sign;
            usage.millicpus += counted.millicpus * sign;
            usage.pids += counted.pids * sign;
        }
    }

    /// A row changed from `before` to `after` (`None`: absent).
    pub fn change(&mut self, before: Option<&Counted>, after: Option<&Counted>) {
        if before == after {
            return;
        }
        if let Some(before) = before {
            self.add(before, -1);
        }
        if let Some(after) = after {
            self.add(after, 1);
        }
    }

    pub fn runner(&self, runner_id: &str) -> Usage {
        self.runners.get(runner_id).copied().unwrap_or_default()
    }
}

/// Writes the transaction's pending deltas (called by `WriteTx::commit`).
pub async fn flush(tx: &mut WriteTx) -> Result<(), sqlx::Error> {
    let pending = std::mem::take(&mut tx.counts);
    let slot = (rand_u64() % SLOTS) as i64;
    // One statement for every scope (the org's and the fleet's), its rows
    // in the map's order: locks are taken in one order by every writer.
    let quotas: Vec<(String, (i64, i64))> = pending
        .quotas
        .into_iter()
        .filter(|(_, (running, held))| *running != 0 || *held != 0)
        .collect();
    for chunk in quotas.chunks(QUOTA_ROWS_PER_STATEMENT) {
        let values: Vec<String> = (0..chunk.len())
            .map(|i| format!("(${}, $1, ${}, ${})", 3 * i + 2, 3 * i + 3, 3 * i + 4))
            .collect();
        let sql = format!(
            "INSERT INTO sandbox_counts (scope, slot, running, held) VALUES {}
             ON CONFLICT (scope, slot) DO UPDATE SET running = sandbox_counts.running + excluded.running, held = sandbox_counts.held + excluded.held",
            values.join(", ")
        );
        let mut query = sqlx::query(&sql).bind(slot);
        for (scope, (running, held)) in chunk {
            query = query.bind(scope.as_str()).bind(*running).bind(*held);
        }
        query.execute(&mut *tx.tx).await?;
    }
    for (runner, usage) in pending.runners {
        if usage == Usage::default() {
            continue;
        }
        sqlx::query(
            "INSERT INTO runner_usage (runner_id, sandboxes, memory_mib, millicpus, pids) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (runner_id) DO UPDATE SET sandboxes = runner_usage.sandboxes + excluded.sandboxes,
             memory_mib = runner_usage.memory_mib + excluded.memory_mib, millicpus = runner_usage.millicpus + excluded.millicpus,
             pids = runner_usage.pids + excluded.pids",
        )
        .bind(runner)
        .bind(usage.sandboxes)
        .bind(usage.memory_mib)
        .bind(usage.millicpus)
        .bind(usage.pids)
        .execute(&mut *tx.tx)
        .await?;
    }
    Ok(())
}

fn rand_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // A slot is only a spread: any value is right, so a failure is slot 0.
    let _ = getrandom::fill(&mut bytes);
    u64::from_le_bytes(bytes)
}

/// The command output `org_id`'s records keep, in bytes.
pub async fn output_bytes(tx: &mut WriteTx, org_id: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM output_counts WHERE org_id = $1",
    )
    .bind(org_id)
    .fetch_one(&mut *tx.tx)
    .await
}

/// Adds `bytes` (negative: given back) to `org_id`'s kept output, on a
/// slot picked at random.
pub async fn add_output(tx: &mut WriteTx, org_id: &str, bytes: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO output_counts (org_id, slot, bytes) VALUES ($1, $2, $3)
         ON CONFLICT (org_id, slot) DO UPDATE SET bytes = output_counts.bytes + excluded.bytes",
    )
    .bind(org_id)
    .bind((rand_u64() % SLOTS) as i64)
    .bind(bytes)
    .execute(&mut *tx.tx)
    .await?;
    Ok(())
}

/// The quota counts of `scope` (`fleet`, `org:ID`) as committed, plus this
/// transaction's pending ones: (running, held).
pub async fn quota(tx: &mut WriteTx, scope: &str) -> Result<(i64, i64), sqlx::Error> {
    let row = sqlx::query(
        "SELECT CAST(COALESCE(SUM(running), 0) AS BIGINT) AS running, CAST(COALESCE(SUM(held), 0) AS BIGINT) AS held
         FROM sandbox_counts WHERE scope = $1",
    )
    .bind(scope)
    .fetch_one(&mut *tx.tx)
    .await?;
    let (pending_running, pending_held) = tx.counts.quotas.get(scope).copied().unwrap_or_default();
    Ok((
        row.try_get::<i64, _>("running")? + pending_running,
        row.try_get::<i64, _>("held")? + pending_held,
    ))
}

/// What the runner's sandboxes use of it, committed plus pending here.
/// Placement reads it after locking the runner's row: every placement on
/// it committed before, so its usage is in.
pub async fn runner_usage(tx: &mut WriteTx, runner_id: &str) -> Result<Usage, sqlx::Error> {
    let row = sqlx::query(
        "SELECT sandboxes, memory_mib, millicpus, pids FROM runner_usage WHERE runner_id = $1",
    )
    .bind(runner_id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    let stored = match row {
        Some(row) => Usage {
            sandboxes: row.try_get("sandboxes")?,
            memory_mib: row.try_get("memory_mib")?,
            millicpus: row.try_get("millicpus")?,
            pids: row.try_get("pids")?,
        },
        None => Usage::default(),
    };
    let pending = tx.counts.runner(runner_id);
    Ok(Usage {
        sandboxes: stored.sandboxes + pending.sandboxes,
        memory_mib: stored.memory_mib + pending.memory_mib,
        millicpus: stored.millicpus + pending.millicpus,
        pids: stored.pids + pending.pids,
    })
}

/// Every runner's committed usage, by id (placement's first filter; the
/// runner's row is locked and its usage read again before it is used).
pub async fn all_runner_usage(
    conn: &mut sqlx::AnyConnection,
) -> Result<BTreeMap<String, Usage>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT runner_id, sandboxes, memory_mib, millicpus, pids FROM runner_usage WHERE sandboxes <> 0",
    )
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|row| {
            Ok((
                row.try_get("runner_id")?,
                Usage {
                    sandboxes: row.try_get("sandboxes")?,
                    memory_mib: row.try_get("memory_mib")?,
                    millicpus: row.try_get("millicpus")?,
                    pids: row.try_get("pids")?,
                },
            ))
        })
        .collect()
}

/// One count whose stored value differs from the records'.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drift {
    /// `fleet`, `org:ID` or `runner:ID`.
    pub scope: String,
    /// `running`, `held`, `sandboxes`, `memory_mib`, `millicpus`, `pids`.
    pub count: String,
    pub stored: i64,
    pub recomputed: i64,
}

/// Recomputes every count from the sandboxes (scans: for checks, never on
/// a request's path) and returns how many scopes were compared and each
/// count that differs. Read in one transaction, so a consistent view.
pub async fn drift(pool: &AnyPool) -> Result<(usize, Vec<Drift>), sqlx::Error> {
    let running_states = super::running_quota_states_sql();
    let held_states = super::held_states_sql();
    let compute_states = super::compute_states_sql();
    let mut conn = pool.begin().await?;
    // On PostgreSQL one snapshot for every read below.
    let _ = sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *conn)
        .await;
    let mut recomputed: BTreeMap<(String, String), i64> = BTreeMap::new();
    let mut stored: BTreeMap<(String, String), i64> = BTreeMap::new();
    let rows = sqlx::query(&format!(
        "SELECT org_id,
            CAST(SUM(CASE WHEN desired = 'running' AND state IN {running_states} THEN 1 ELSE 0 END) AS BIGINT) AS running,
            CAST(SUM(CASE WHEN desired <> 'deleted' AND state IN {held_states} THEN 1 ELSE 0 END) AS BIGINT) AS held
         FROM sandboxes GROUP BY org_id"
    ))
    .fetch_all(&mut *conn)
    .await?;
    let (mut fleet_running, mut fleet_held) = (0, 0);
    for row in &rows {
        let org: String = row.try_get("org_id")?;
        let (running, held): (i64, i64) = (row.try_get("running")?, row.try_get("held")?);
        fleet_running += running;
        fleet_held += held;
        recomputed.insert((format!("org:{org}"), "running".to_owned()), running);
        recomputed.insert((format!("org:{org}"), "held".to_owned()), held);
    }
    recomputed.insert(("fleet".to_owned(), "running".to_owned()), fleet_running);
    recomputed.insert(("fleet".to_owned(), "held".to_owned()), fleet_held);
    let rows = sqlx::query(&format!(
        "SELECT runner_id, COUNT(*) AS sandboxes, CAST(COALESCE(SUM(memory_mib), 0) AS BIGINT) AS memory_mib,
            CAST(COALESCE(SUM(millicpus), 0) AS BIGINT) AS millicpus, CAST(COALESCE(SUM(pids), 0) AS BIGINT) AS pids
         FROM sandboxes WHERE runner_id IS NOT NULL AND state IN {compute_states} GROUP BY runner_id"
    ))
    .fetch_all(&mut *conn)
    .await?;
    for row in &rows {
        let runner: String = row.try_get("runner_id")?;
        for count in ["sandboxes", "memory_mib", "millicpus", "pids"] {
            recomputed.insert(
                (format!("runner:{runner}"), count.to_owned()),
                row.try_get(count)?,
            );
        }
    }
    let rows = sqlx::query(
        "SELECT scope, CAST(SUM(running) AS BIGINT) AS running, CAST(SUM(held) AS BIGINT) AS held FROM sandbox_counts GROUP BY scope",
    )
    .fetch_all(&mut *conn)
    .await?;
    for row in &rows {
        let scope: String = row.try_get("scope")?;
        stored.insert(
            (scope.clone(), "running".to_owned()),
            row.try_get("running")?,
        );
        stored.insert((scope, "held".to_owned()), row.try_get("held")?);
    }
    let rows =
        sqlx::query("SELECT runner_id, sandboxes, memory_mib, millicpus, pids FROM runner_usage")
            .fetch_all(&mut *conn)
            .await?;
    for row in &rows {
        let runner: String = row.try_get("runner_id")?;
        for count in ["sandboxes", "memory_mib", "millicpus", "pids"] {
            stored.insert(
                (format!("runner:{runner}"), count.to_owned()),
                row.try_get(count)?,
            );
        }
    }
    conn.rollback().await?;
    let mut keys: Vec<&(String, String)> = recomputed.keys().chain(stored.keys()).collect();
    keys.sort();
    keys.dedup();
    let scopes = {
        let mut scopes: Vec<&str> = keys.iter().map(|(scope, _)| scope.as_str()).collect();
        scopes.dedup();
        scopes.len()
    };
    let drifts = keys
        .into_iter()
        .filter_map(|key| {
            let (stored, recomputed) = (
                stored.get(key).copied().unwrap_or(0),
                recomputed.get(key).copied().unwrap_or(0),
            );
            (stored != recomputed).then(|| Drift {
                scope: key.0.clone(),
                count: key.1.clone(),
                stored,
                recomputed,
            })
        })
        .collect();
    Ok((scopes, drifts))
}
