//! The records: the one owner of every row type and of every write to a
//! sandbox's or command's observed fields (state, reason, desired, runner,
//! home saves, output), each paired with its event row or wake-up. Here:
//! the shared vocabulary (state lists in SQL, ids, times, pages).
//!
//! - [`sandboxes`]: the sandbox row, its state changes and their events.
//! - [`commands`]: the command row and every command write.
//! - [`snapshots`]: the snapshot row.
//! - [`images`]: the image row.
//! - [`runners`]: the runner row, its lease and drain.
//! - [`kept`]: kept copies of homes on runners, and the record's list.
//! - [`filesystems`]: which org may mount which shared filesystem.
//! - [`secrets`]: org secrets (sealed) and what each sandbox asked for.
//! - [`observed`]: saves' history and the reads behind the deployment's
//!   observed figures.

pub mod commands;
pub mod filesystems;
pub mod images;
pub mod kept;
pub mod observed;
pub mod runners;
pub mod sandboxes;
pub mod secrets;
pub mod snapshots;

pub use commands::{COMMAND_COLUMNS, CommandRow};
pub use sandboxes::{
    HomeColumns, SANDBOX_COLUMNS, SandboxRow, Transition, load_sandbox, set_sandbox_state,
};

use sqlx::Row;
use sqlx::any::AnyRow;

use crate::db::now_ms;
use crate::error::ControlError;
use api::ErrorCode;
use api::lifecycle::SandboxState;

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
