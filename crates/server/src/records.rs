//! Shared vocabulary of the records: states, ids, times, and the one place
//! a sandbox's state changes (`set_sandbox_state`), which also writes the
//! event history and ends the sandbox's unfinished commands.

use sqlx::Row;
use sqlx::any::AnyRow;

use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use api::ErrorCode;
use api::lifecycle::{CommandState, DesiredState, Network, Placement, SandboxState, StorageClass};

/// The state vocabulary lives in `api::lifecycle`; these are the SQL
/// lists built from its predicates, spliced into statements.
pub fn compute_states_sql() -> String {
    SandboxState::sql_in(SandboxState::holds_compute)
}

/// States that count as running for the `sandboxes.running` quota.
pub fn running_quota_states_sql() -> String {
    SandboxState::sql_in(SandboxState::counts_as_running)
}

/// States a sandbox still counts against `sandboxes.total` in.
pub fn held_states_sql() -> String {
    SandboxState::sql_in(SandboxState::is_held)
}

/// End states, in SQL.
pub fn terminal_states_sql() -> String {
    SandboxState::sql_in(SandboxState::is_terminal)
}

/// Time-ordered ids: `PREFIX_` + 12 hex digits of milliseconds + 16 random
/// hex digits, so ordering by id is ordering by creation (pagination).
pub fn new_id(prefix: &str) -> Result<String, ControlError> {
    Ok(format!(
        "{prefix}_{:012x}{}",
        now_ms(),
        crate::auth::random_hex(8)?
    ))
}

pub fn rfc3339(ms: i64) -> String {
    let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(time).to_string()
}

pub fn json_map(text: &str) -> std::collections::BTreeMap<String, String> {
    serde_json::from_str(text).unwrap_or_default()
}

/// A sandbox row as stored.
#[derive(Clone, Debug)]
pub struct SandboxRow {
    pub id: String,
    pub org_id: String,
    pub image: String,
    /// The imported image's root tree, pinned at create (`None`: default).
    pub image_root: Option<String>,
    pub storage_class: StorageClass,
    pub memory_mib: Option<i64>,
    pub millicpus: Option<i64>,
    pub pids: Option<i64>,
    pub network: Network,
    pub placement: Placement,
    pub env: String,
    pub labels: String,
    pub state: SandboxState,
    pub state_reason: Option<String>,
    pub desired: DesiredState,
    pub runner_id: Option<String>,
    pub last_runner_id: Option<String>,
    pub epoch: i64,
    pub quarantined: bool,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub ended_at_ms: Option<i64>,
    pub home: HomeColumns,
}

/// A sandbox's home in the store and how saving it goes (durable
/// sandboxes; a child of a snapshot starts from `root` whatever its class).
#[derive(Clone, Debug, Default)]
pub struct HomeColumns {
    /// The last completed save (or the snapshot a child starts from).
    pub root: Option<String>,
    /// When that save captured the home.
    pub saved_at_ms: Option<i64>,
    /// Set for durable sandboxes only.
    pub save_interval_s: Option<i64>,
    pub save_attempt_at_ms: Option<i64>,
    /// The last attempt's error; cleared by a completed save.
    pub save_error: Option<String>,
    pub save_bytes_pending: Option<i64>,
    pub from_snapshot: Option<String>,
}

pub const SANDBOX_COLUMNS: &str = "id, org_id, image, image_root, storage_class, memory_mib, millicpus, pids, network, placement, env, labels, state, state_reason, desired, runner_id, last_runner_id, epoch, quarantined, created_at_ms, updated_at_ms, expires_at_ms, ended_at_ms, home_root, home_saved_at_ms, save_interval_s, save_attempt_at_ms, save_error, save_bytes_pending, from_snapshot";

impl SandboxRow {
    pub fn from_row(row: &AnyRow) -> Result<SandboxRow, sqlx::Error> {
        Ok(SandboxRow {
            id: row.try_get("id")?,
            org_id: row.try_get("org_id")?,
            image: row.try_get("image")?,
            image_root: row.try_get("image_root")?,
            storage_class: parse_column(row, "storage_class")?,
            memory_mib: row.try_get("memory_mib")?,
            millicpus: row.try_get("millicpus")?,
            pids: row.try_get("pids")?,
            network: parse_column(row, "network")?,
            placement: parse_column(row, "placement")?,
            env: row.try_get("env")?,
            labels: row.try_get("labels")?,
            state: parse_column(row, "state")?,
            state_reason: row.try_get("state_reason")?,
            desired: parse_column(row, "desired")?,
            runner_id: row.try_get("runner_id")?,
            last_runner_id: row.try_get("last_runner_id")?,
            epoch: row.try_get("epoch")?,
            quarantined: row.try_get::<i64, _>("quarantined")? != 0,
            created_at_ms: row.try_get("created_at_ms")?,
            updated_at_ms: row.try_get("updated_at_ms")?,
            expires_at_ms: row.try_get("expires_at_ms")?,
            ended_at_ms: row.try_get("ended_at_ms")?,
            home: HomeColumns {
                root: row.try_get("home_root")?,
                saved_at_ms: row.try_get("home_saved_at_ms")?,
                save_interval_s: row.try_get("save_interval_s")?,
                save_attempt_at_ms: row.try_get("save_attempt_at_ms")?,
                save_error: row.try_get("save_error")?,
                save_bytes_pending: row.try_get("save_bytes_pending")?,
                from_snapshot: row.try_get("from_snapshot")?,
            },
        })
    }

    pub fn resources(&self) -> api::sandboxes::Resources {
        api::sandboxes::Resources {
            memory_mib: self.memory_mib.map(|v| v as u64),
            cpus: self.millicpus.map(|v| v as f64 / 1000.0),
            pids: self.pids.map(|v| v as u64),
        }
    }

    pub fn to_api(&self) -> api::sandboxes::Sandbox {
        api::sandboxes::Sandbox {
            id: self.id.clone(),
            org_id: self.org_id.clone(),
            state: self.state,
            state_reason: self.state_reason.clone(),
            desired: self.desired,
            runner_id: self.runner_id.clone(),
            epoch: self.epoch as u64,
            image: self.image.clone(),
            storage_class: self.storage_class,
            resources: self.resources(),
            network: self.network,
            placement: self.placement,
            env: json_map(&self.env),
            labels: json_map(&self.labels),
            quarantined: self.quarantined,
            created_at: rfc3339(self.created_at_ms),
            updated_at: rfc3339(self.updated_at_ms),
            expires_at: self.expires_at_ms.map(rfc3339),
            ended_at: self.ended_at_ms.map(rfc3339),
            save: self.save_status(now_ms()),
            from_snapshot: self.home.from_snapshot.clone(),
        }
    }

    /// The `save` object of a durable sandbox: `failing` while the last
    /// attempt failed, `delayed` when no save completed within twice the
    /// interval (counted from creation before the first), else `ok`.
    pub fn save_status(&self, now: i64) -> Option<api::sandboxes::SaveStatus> {
        let interval_s = self.home.save_interval_s?;
        let since = self.home.saved_at_ms.unwrap_or(self.created_at_ms);
        let state = if self.home.save_error.is_some() {
            "failing"
        } else if self.state == SandboxState::Running && now - since > 2 * interval_s * 1000 {
            "delayed"
        } else {
            "ok"
        };
        Some(api::sandboxes::SaveStatus {
            interval_s: interval_s as u64,
            state: state.to_owned(),
            last_completed_at: self.home.saved_at_ms.map(rfc3339),
            last_attempt_at: self.home.save_attempt_at_ms.map(rfc3339),
            last_error: self.home.save_error.clone(),
            bytes_pending: self.home.save_bytes_pending.map(|b| b.max(0) as u64),
            root: self.home.root.clone(),
        })
    }
}

/// A text column holding one of a lifecycle enum's spellings; anything
/// else is a decode error naming the column (the database was written by
/// something else).
pub fn parse_column<T>(row: &AnyRow, column: &str) -> Result<T, sqlx::Error>
where
    T: std::str::FromStr<Err = api::UnknownValue>,
{
    let text: String = row.try_get(column)?;
    text.parse()
        .map_err(|err: api::UnknownValue| sqlx::Error::ColumnDecode {
            index: column.to_owned(),
            source: Box::new(err),
        })
}

pub async fn load_sandbox(tx: &mut WriteTx, id: &str) -> Result<Option<SandboxRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(SandboxRow::from_row).transpose()
}

/// What a state change writes besides `state`.
pub struct Transition<'a> {
    pub state: SandboxState,
    pub reason: Option<&'a str>,
    pub message: Option<&'a str>,
}

/// Moves a sandbox to a new observed state: updates the record (guarded by
/// the state, epoch and runner it was read with, so a concurrent change
/// makes this return `false` and write nothing), appends the event, and
/// ends the sandbox's commands that can no longer run.
pub async fn set_sandbox_state(
    tx: &mut WriteTx,
    current: &SandboxRow,
    to: Transition<'_>,
    runner_id: Option<&str>,
    epoch: i64,
) -> Result<bool, sqlx::Error> {
    let now = now_ms();
    let ended = if to.state.is_terminal() {
        Some(current.ended_at_ms.unwrap_or(now))
    } else {
        None
    };
    let updated = sqlx::query(
        "UPDATE sandboxes SET state = $1, state_reason = $2, runner_id = $3, epoch = $4, updated_at_ms = $5, ended_at_ms = $6
         WHERE id = $7 AND state = $8 AND epoch = $9 AND COALESCE(runner_id, '') = $10",
    )
    .bind(to.state.as_str())
    .bind(to.reason)
    .bind(runner_id)
    .bind(epoch)
    .bind(now)
    .bind(ended)
    .bind(&current.id)
    .bind(current.state.as_str())
    .bind(current.epoch)
    .bind(current.runner_id.as_deref().unwrap_or(""))
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() == 0 {
        return Ok(false);
    }
    if let Some(runner_id) = runner_id {
        sqlx::query("UPDATE sandboxes SET last_runner_id = $1 WHERE id = $2")
            .bind(runner_id)
            .bind(&current.id)
            .execute(&mut *tx.tx)
            .await?;
    }
    sqlx::query(
        "INSERT INTO events (sandbox_id, seq, at_ms, state, reason, message, epoch, runner_id)
         SELECT $1, COALESCE(MAX(seq), 0) + 1, $2, $3, $4, $5, $6, $7 FROM events WHERE sandbox_id = $1",
    )
    .bind(&current.id)
    .bind(now)
    .bind(to.state.as_str())
    .bind(to.reason)
    .bind(to.message)
    .bind(epoch)
    .bind(runner_id)
    .execute(&mut *tx.tx)
    .await?;
    end_commands_for(tx, &current.id, to.state, to.reason).await?;
    tx.changed(&current.id).await?;
    if let Some(runner) = runner_id.or(current.runner_id.as_deref()) {
        tx.changed(&format!("runner:{runner}")).await?;
    }
    Ok(true)
}

/// Ends the commands that cannot run any more once a sandbox is in
/// `state`. Queued ones never started: `not_launched`. For the rest:
/// - the host is gone (`recovering`, or `failed` with `node_lost`): seen
///   running → `infrastructure_lost`; handed over but never confirmed →
///   `unknown`;
/// - the sandbox was stopped, terminated or deleted: the runner reports its
///   commands first; any it left open were asked to end by the stop
///   (`interrupted`), or, never confirmed, `unknown`;
/// - the workload died on its own (`failed`): the runner would have told
///   what it knew, so what is left is `unknown`.
async fn end_commands_for(
    tx: &mut WriteTx,
    sandbox_id: &str,
    state: SandboxState,
    reason: Option<&str>,
) -> Result<(), sqlx::Error> {
    use SandboxState::*;
    let running = match (state, reason) {
        (Recovering, _) | (Failed, Some("node_lost")) => CommandState::InfrastructureLost,
        (Stopped | Securing | Terminated | Deleting | Deleted, _) => CommandState::Interrupted,
        (Failed, _) => CommandState::Unknown,
        (Pending | Starting | Running | Stopping, _) => return Ok(()),
    };
    let now = now_ms();
    let reason = format!("sandbox_{state}");
    let mut ids: Vec<String> = Vec::new();
    for (from, to) in [
        (CommandState::Queued, CommandState::NotLaunched),
        (CommandState::Starting, CommandState::Unknown),
        (CommandState::Running, running),
    ] {
        let rows = sqlx::query(
            "UPDATE commands SET state = $1, state_reason = $2, ended_at_ms = $3 WHERE sandbox_id = $4 AND state = $5 RETURNING id",
        )
        .bind(to.as_str())
        .bind(&reason)
        .bind(now)
        .bind(sandbox_id)
        .bind(from.as_str())
        .fetch_all(&mut *tx.tx)
        .await?;
        for row in rows {
            ids.push(row.try_get("id")?);
        }
    }
    for id in ids {
        tx.changed(&id).await?;
    }
    Ok(())
}

/// One page of a list read with `LIMIT limit + 1`, ordered by id: the
/// first `limit` items, and the cursor of the next page if there is one.
pub fn page<T>(
    mut items: Vec<T>,
    limit: usize,
    id: impl Fn(&T) -> &str,
) -> (Vec<T>, Option<String>) {
    if items.len() <= limit {
        return (items, None);
    }
    items.truncate(limit);
    let next = items.last().map(|item| id(item).to_owned());
    (items, next)
}

/// Errors every sandbox endpoint shares.
pub fn not_found(what: &str) -> ControlError {
    ControlError::new(ErrorCode::NotFound, format!("no such {what}"))
}
