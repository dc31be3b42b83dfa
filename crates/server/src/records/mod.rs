//! The records: the one owner of every row type and of every write to a
//! sandbox's or command's observed fields (state, reason, desired, runner,
//! home saves, output), each paired with its event row or wake-up. Here:
//! the shared vocabulary (state lists in SQL, ids, times, pages).
//!
//! - [`sandboxes`]: the sandbox row, its state changes and their events.
//! - [`commands`]: the command row and every command write.
//! - [`activity`]: what keeps a sandbox awake, and the sleep decision.
//! - [`snapshots`]: the snapshot row.
//! - [`images`]: the image row.
//! - [`runners`]: the runner row, its lease and drain.
//! - [`kept`]: kept copies of homes on runners, and the record's list.
//! - [`filesystems`]: which org may mount which shared filesystem.
//! - [`counts`]: quota counts and runner usage kept as rows, and their
//!   drift check.
//! - [`orgs`]: orgs with their quotas and usage (read only here).
//! - [`secrets`]: org secrets (sealed) and what each sandbox asked for.
//! - [`tokens`]: token revocation.
//! - [`backup`]: the roots a backup of the store must carry (a read).
//! - [`observed`]: saves' history and the reads behind the deployment's
//!   observed figures.

pub mod activity;
pub mod backup;
pub mod commands;
pub mod counts;
pub mod filesystems;
pub mod images;
pub mod kept;
pub mod observed;
pub mod orgs;
pub mod runners;
pub mod sandboxes;
pub mod secrets;
pub mod snapshots;
pub mod tokens;

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

/// Time-ordered ids: `PREFIX_` + 12 hex digits of milliseconds + 16 hex
/// digits, so ordering by id is ordering by creation (pagination, and
/// lists a client reads back in the order it created them). Within one
/// process ids are strictly increasing: a second id in the same
/// millisecond (or after the clock stepped back) takes the previous one's
/// tail plus one, as monotonic ULIDs do; otherwise the tail is random.
pub fn new_id(prefix: &str) -> Result<String, ControlError> {
    static LAST: std::sync::Mutex<(u64, u64)> = std::sync::Mutex::new((0, 0));
    let fresh = u64::from_str_radix(&crate::auth::random_hex(8)?, 16).unwrap_or(0);
    let (ms, tail) = {
        let mut last = LAST.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = now_ms().max(0) as u64;
        *last = if now > last.0 {
            (now, fresh)
        } else {
            match last.1.checked_add(1) {
                Some(tail) => (last.0, tail),
                None => (last.0 + 1, fresh),
            }
        };
        *last
    };
    Ok(format!("{prefix}_{ms:012x}{tail:016x}"))
}

pub fn rfc3339(ms: i64) -> String {
    let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(time).to_string()
}

pub fn json_map(text: &str) -> std::collections::BTreeMap<String, String> {
    serde_json::from_str(text).unwrap_or_default()
}

/// A row as either reader gives it: sqlx's `AnyRow`, or a row of a
/// direct SQLite read (`db::SqliteReads`), so a row type is decoded by one
/// function whichever read it.
pub trait ReadRow {
    /// The named column, decoded; a decode error names the column.
    fn column<T: Column>(&self, name: &str) -> Result<T, sqlx::Error>;
}

/// A column type both readers decode: the text, integer and nullable
/// columns the schema uses.
pub trait Column:
    for<'r> sqlx::Decode<'r, sqlx::Any> + sqlx::Type<sqlx::Any> + rusqlite::types::FromSql
{
}

impl<T> Column for T where
    T: for<'r> sqlx::Decode<'r, sqlx::Any> + sqlx::Type<sqlx::Any> + rusqlite::types::FromSql
{
}

impl ReadRow for AnyRow {
    fn column<T: Column>(&self, name: &str) -> Result<T, sqlx::Error> {
        self.try_get(name)
    }
}

/// A row of a direct SQLite read with its statement's column names.
/// rusqlite finds a column by name by asking SQLite for every column's
/// name in turn (a C string each), which for a 42-column row read by name
/// was a seventh of a GET's time; here the names are the statement's
/// column list, searched from just after the last one read, since rows are
/// decoded in that order.
pub struct DirectRow<'a> {
    row: &'a rusqlite::Row<'a>,
    names: &'a [&'a str],
    next: std::cell::Cell<usize>,
}

impl<'a> DirectRow<'a> {
    /// `names`: the columns of the `SELECT`, in order.
    pub fn new(row: &'a rusqlite::Row<'a>, names: &'a [&'a str]) -> DirectRow<'a> {
        DirectRow {
            row,
            names,
            next: std::cell::Cell::new(0),
        }
    }
}

impl ReadRow for DirectRow<'_> {
    fn column<T: Column>(&self, name: &str) -> Result<T, sqlx::Error> {
        let count = self.names.len();
        let start = self.next.get();
        let index = (0..count)
            .map(|step| (start + step) % count)
            .find(|&i| self.names[i] == name)
            .ok_or_else(|| sqlx::Error::ColumnNotFound(name.to_owned()))?;
        self.next.set(index + 1);
        self.row
            .get(index)
            .map_err(|err| sqlx::Error::ColumnDecode {
                index: name.to_owned(),
                source: Box::new(err),
            })
    }
}

/// A row type decoded by one function from either reader.
pub trait FromReadRow: Sized {
    fn from_read_row(row: &impl ReadRow) -> Result<Self, sqlx::Error>;
}

/// A parameter of a hot read, bound the same way for both readers.
pub enum Param<'a> {
    Text(&'a str),
    Int(i64),
}

impl rusqlite::ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        match self {
            Param::Text(text) => text.to_sql(),
            Param::Int(value) => value.to_sql(),
        }
    }
}

/// At most one row of a hot read (`sql` selecting `columns`, `$1`… in
/// order): on SQLite on this thread where it can (`db::SqliteReads`),
/// otherwise, or if that declines, through the pool.
pub async fn read_optional<T: FromReadRow>(
    db: &crate::db::Db,
    sql: &str,
    columns: &[&str],
    params: &[Param<'_>],
) -> Result<Option<T>, sqlx::Error> {
    if let Some(reads) = &db.sqlite_reads {
        let direct = reads.read(|conn| {
            let mut statement = conn.prepare_cached(sql)?;
            let mut rows = statement.query(rusqlite::params_from_iter(params))?;
            let Some(row) = rows.next()? else {
                return Ok(None);
            };
            // A row this reader cannot decode is declined too: sqlx's
            // decoding, the one every other read uses, decides.
            T::from_read_row(&DirectRow::new(row, columns))
                .map(Some)
                .map_err(|err| {
                    // (The index and type are not what the log names: the
                    // sqlx error inside names the column.)
                    rusqlite::Error::FromSqlConversionFailure(
                        0,
                        rusqlite::types::Type::Null,
                        Box::new(err),
                    )
                })
        });
        if let Some(found) = direct {
            return Ok(found);
        }
    }
    let mut query = sqlx::query(sql);
    for param in params {
        query = match param {
            Param::Text(text) => query.bind(*text),
            Param::Int(value) => query.bind(*value),
        };
    }
    let row = query.fetch_optional(&db.pool).await?;
    row.as_ref().map(T::from_read_row).transpose()
}

/// A `SELECT` column list split into its names, for [`DirectRow`].
pub fn column_names(list: &str) -> Vec<&str> {
    list.split(',').map(str::trim).collect()
}

/// A text column holding one of a lifecycle enum's spellings; anything
/// else is a decode error naming the column (the database was written by
/// something else).
pub fn parse_column<T>(row: &impl ReadRow, column: &str) -> Result<T, sqlx::Error>
where
    T: std::str::FromStr<Err = api::UnknownValue>,
{
    let text: String = row.column(column)?;
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

/// Stored characters (`LENGTH`) of the rows one page answers with, at
/// most (past its first row): a page of 200 commands of 320 KiB of argv and env each, or
/// of sandboxes with 64 KiB of env, would be held whole twice (rows and
/// JSON, each escaped byte six in it) in the shared server's memory.
pub const PAGE_BYTES_MAX: i64 = 2 << 20;

/// How many of the rows `sizes` (id and stored bytes, in order, up to one
/// past `limit`) a page takes, and the cursor after it if more follow:
/// at most `limit` rows, and no more than [`PAGE_BYTES_MAX`] past the
/// first (a row larger than that is a page of its own).
pub fn page_by_bytes(sizes: &[(String, i64)], limit: usize) -> (usize, Option<String>) {
    let mut bytes = 0;
    let mut taken = 0;
    for (_, size) in sizes.iter().take(limit) {
        if taken > 0 && bytes + size > PAGE_BYTES_MAX {
            break;
        }
        bytes += size;
        taken += 1;
    }
    let next = (taken > 0 && taken < sizes.len()).then(|| sizes[taken - 1].0.clone());
    (taken, next)
}

/// Errors every sandbox endpoint shares.
pub fn not_found(what: &str) -> ControlError {
    ControlError::new(ErrorCode::NotFound, format!("no such {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_ends_at_its_count_or_its_bytes_and_never_empty() {
        let rows = |sizes: &[i64]| -> Vec<(String, i64)> {
            sizes
                .iter()
                .enumerate()
                .map(|(i, size)| (format!("id{i}"), *size))
                .collect()
        };
        let mib = 1 << 20;
        // By count: three asked, a fourth there.
        assert_eq!(
            page_by_bytes(&rows(&[1, 1, 1, 1]), 3),
            (3, Some("id2".to_owned()))
        );
        assert_eq!(page_by_bytes(&rows(&[1, 1, 1]), 3), (3, None));
        // By bytes: 2 MiB fit, the third row would pass them.
        assert_eq!(
            page_by_bytes(&rows(&[mib, mib, 1]), 10),
            (2, Some("id1".to_owned()))
        );
        // A row larger than a page is a page of its own.
        assert_eq!(
            page_by_bytes(&rows(&[3 * mib, 1]), 10),
            (1, Some("id0".to_owned()))
        );
        assert_eq!(page_by_bytes(&rows(&[]), 10), (0, None));
    }

    #[test]
    fn ids_made_in_one_millisecond_still_sort_in_creation_order() {
        let ids: Vec<String> = (0..2000)
            .map(|_| super::new_id("x").expect("an id"))
            .collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids, sorted);
        sorted.dedup();
        assert_eq!(sorted.len(), ids.len());
    }

    /// A direct row finds columns by the statement's names in any order,
    /// and names a column that is not there.
    #[test]
    fn a_direct_row_reads_columns_by_name_in_any_order() {
        let conn = rusqlite::Connection::open_in_memory().expect("a database");
        let list = "a, b,c";
        let names = column_names(list);
        assert_eq!(names, ["a", "b", "c"]);
        conn.query_row("SELECT 1 AS a, 'x' AS b, NULL AS c", [], |row| {
            let row = DirectRow::new(row, &names);
            assert_eq!(row.column::<Option<i64>>("c").expect("c"), None);
            assert_eq!(row.column::<i64>("a").expect("a"), 1);
            assert_eq!(row.column::<String>("b").expect("b"), "x");
            assert_eq!(row.column::<String>("b").expect("b again"), "x");
            assert!(matches!(
                row.column::<i64>("d"),
                Err(sqlx::Error::ColumnNotFound(name)) if name == "d"
            ));
            assert!(matches!(
                row.column::<i64>("b"),
                Err(sqlx::Error::ColumnDecode { index, .. }) if index == "b"
            ));
            Ok(())
        })
        .expect("a row");
    }
}
