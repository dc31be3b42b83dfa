//! The command row, and every write to a command: queued by its org,
//! started and ended by its runner's reports, cancelled or signalled, ended
//! with its sandbox.

use sqlx::AnyPool;
use sqlx::Row;

use super::{json_map, parse_column, rfc3339};
use crate::db::{WriteTx, now_ms};
use api::commands::{Command, CreateCommandRequest};
use api::lifecycle::{CommandState, SandboxState};
use api::runners::RequestedSignal;
use std::collections::HashMap;

#[derive(Clone, Debug)]
pub struct CommandRow {
    pub id: String,
    pub sandbox_id: String,
    pub org_id: String,
    pub argv: String,
    pub env: String,
    pub cwd: Option<String>,
    pub timeout_s: Option<i64>,
    pub state: CommandState,
    pub state_reason: Option<String>,
    pub exit_code: Option<i64>,
    pub signal: Option<String>,
    pub signal_requested: Option<String>,
    /// Signals asked so far (`request_signal` adds one each time).
    pub signal_seq: i64,
    pub epoch: Option<i64>,
    pub stdout_bytes: i64,
    pub stderr_bytes: i64,
    pub created_at_ms: i64,
    pub started_at_ms: Option<i64>,
    pub ended_at_ms: Option<i64>,
    pub pid: Option<i64>,
    pub stdin: bool,
    pub tty: Option<api::commands::TtySize>,
    /// Created while its sandbox was not running: it waited for a wake.
    pub waited_for_wake: bool,
    /// Output past the bound was not stored (`api::commands::OUTPUT_STREAM_BYTES_MAX`).
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

pub const COMMAND_COLUMNS: &str = "id, sandbox_id, org_id, argv, env, cwd, timeout_s, state, state_reason, exit_code, signal, signal_requested, signal_seq, epoch, stdout_bytes, stderr_bytes, created_at_ms, started_at_ms, ended_at_ms, pid, stdin, tty, waited_for_wake, stdout_truncated, stderr_truncated";

/// [`COMMAND_COLUMNS`] split, for direct reads (`super::DirectRow`).
static COMMAND_COLUMN_NAMES: std::sync::LazyLock<Vec<&str>> =
    std::sync::LazyLock::new(|| super::column_names(COMMAND_COLUMNS));

impl super::FromReadRow for CommandRow {
    fn from_read_row(row: &impl super::ReadRow) -> Result<CommandRow, sqlx::Error> {
        CommandRow::from_row(row)
    }
}

impl CommandRow {
    pub fn from_row(row: &impl super::ReadRow) -> Result<CommandRow, sqlx::Error> {
        Ok(CommandRow {
            id: row.column("id")?,
            sandbox_id: row.column("sandbox_id")?,
            org_id: row.column("org_id")?,
            argv: row.column("argv")?,
            env: row.column("env")?,
            cwd: row.column("cwd")?,
            timeout_s: row.column("timeout_s")?,
            state: parse_column(row, "state")?,
            state_reason: row.column("state_reason")?,
            exit_code: row.column("exit_code")?,
            signal: row.column("signal")?,
            signal_requested: row.column("signal_requested")?,
            signal_seq: row.column("signal_seq")?,
            epoch: row.column("epoch")?,
            stdout_bytes: row.column("stdout_bytes")?,
            stderr_bytes: row.column("stderr_bytes")?,
            created_at_ms: row.column("created_at_ms")?,
            started_at_ms: row.column("started_at_ms")?,
            ended_at_ms: row.column("ended_at_ms")?,
            pid: row.column("pid")?,
            stdin: row.column::<i64>("stdin")? != 0,
            tty: row
                .column::<Option<String>>("tty")?
                .and_then(|text| serde_json::from_str(&text).ok()),
            waited_for_wake: row.column::<i64>("waited_for_wake")? != 0,
            stdout_truncated: row.column::<i64>("stdout_truncated")? != 0,
            stderr_truncated: row.column::<i64>("stderr_truncated")? != 0,
        })
    }

    pub fn argv(&self) -> Vec<String> {
        serde_json::from_str(&self.argv).unwrap_or_default()
    }

    pub fn ended(&self) -> bool {
        self.state.is_end()
    }

    pub fn to_api(&self) -> Command {
        Command {
            id: self.id.clone(),
            sandbox_id: self.sandbox_id.clone(),
            argv: self.argv(),
            env: json_map(&self.env),
            cwd: self.cwd.clone(),
            timeout: self.timeout_s.map(|t| t as u64),
            state: self.state,
            state_reason: self.state_reason.clone(),
            exit_code: self.exit_code.map(|c| c as i32),
            signal: self.signal.clone(),
            epoch: self.epoch.map(|e| e as u64),
            stdout_bytes: self.stdout_bytes as u64,
            stderr_bytes: self.stderr_bytes as u64,
            created_at: rfc3339(self.created_at_ms),
            started_at: self.started_at_ms.map(rfc3339),
            ended_at: self.ended_at_ms.map(rfc3339),
            pid: self.pid.map(|p| p as i32),
            stdin: self.stdin,
            tty: self.tty,
            waited_for_wake: self.waited_for_wake,
            stdout_truncated: self.stdout_truncated,
            stderr_truncated: self.stderr_truncated,
        }
    }
}

/// Ends the commands that cannot run any more once a sandbox is in
/// `state`. Queued ones never started: `not_launched` (unless they wait
/// for a wake, or for a durable sandbox a drain moves). For the rest:
/// - the host is gone (`recovering`, or `failed` with `node_lost`): seen
///   running → `infrastructure_lost`; handed over but never confirmed →
///   `unknown`;
/// - the sandbox was stopped, terminated or deleted: the runner reports its
///   commands first; any it left open were asked to end by the stop
///   (`interrupted`), or, never confirmed, `unknown`. `deleting` is the
///   request, not yet the runner's doing: its commands stay as they are
///   until the runner reports them or the sandbox `deleted`, so a command
///   that exits meanwhile is recorded `exited`, with all its output;
/// - the workload died on its own (`failed`): the runner would have told
///   what it knew, so what is left is `unknown`.
pub(super) async fn end_commands_for(
    tx: &mut WriteTx,
    sandbox_id: &str,
    state: SandboxState,
    reason: Option<&str>,
) -> Result<(), sqlx::Error> {
    use SandboxState::*;
    let running = match (state, reason) {
        (Recovering, _) | (Failed, Some("node_lost")) => CommandState::InfrastructureLost,
        (Stopped | Securing | Terminated | Deleted, _) => CommandState::Interrupted,
        (Failed, _) => CommandState::Unknown,
        (Pending | Starting | Running | Stopping | Deleting, _) => return Ok(()),
    };
    // A durable sandbox moving off a runner being emptied runs again on
    // another: its queued commands (none was handed to the runner it
    // leaves) wait for it there, as they would for a wake.
    let moving = !state.is_terminal()
        && matches!(
            reason,
            Some(super::sandboxes::MOVED_BY_DRAIN | super::sandboxes::MOVED_BY_PREEMPTION)
        );
    let now = now_ms();
    let reason = format!("sandbox_{state}");
    let mut ids: Vec<String> = Vec::new();
    // A queued command that waits for its sandbox to wake never started: it
    // waits while the sandbox may still run (a wake under way, a stop it
    // arrived during, a recovery of a waking sandbox), and runs once it does.
    // Only commands that came to wait for a wake do (whether the wake has
    // begun, desired `running`, or waits for a stop to finish, desired
    // `stopped`: `control::idle::resume_after_stop`); one queued in a
    // running sandbox whose host is lost ends `not_launched`, as it did.
    let queued_wait = !state.is_terminal();
    for (from, to) in [
        (CommandState::Queued, CommandState::NotLaunched),
        (CommandState::Starting, CommandState::Unknown),
        (CommandState::Running, running),
    ] {
        if from == CommandState::Queued && moving {
            continue;
        }
        let keep_waiting = if from == CommandState::Queued && queued_wait {
            " AND waited_for_wake = 0"
        } else {
            ""
        };
        let rows = sqlx::query(&format!(
            "UPDATE commands SET state = $1, state_reason = $2, ended_at_ms = $3 WHERE sandbox_id = $4 AND state = $5{keep_waiting} RETURNING id",
        ))
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
        tx.changed(&id);
    }
    Ok(())
}

/// Ends the sandbox's queued commands (`not_launched`, `reason`): they
/// were waiting for it to run, and it will not (a wake that cannot go on,
/// a sandbox resting `stopped` that nothing starts again).
pub async fn end_queued(
    tx: &mut WriteTx,
    sandbox_id: &str,
    reason: &str,
) -> Result<usize, sqlx::Error> {
    end_queued_matching(tx, sandbox_id, reason, "").await
}

/// What [`end_queued`] and [`end_queued_waiting`] share: `only` narrows
/// the commands (fixed SQL, never input).
async fn end_queued_matching(
    tx: &mut WriteTx,
    sandbox_id: &str,
    reason: &str,
    only: &'static str,
) -> Result<usize, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "UPDATE commands SET state = 'not_launched', state_reason = $1, ended_at_ms = $2 WHERE sandbox_id = $3 AND state = 'queued'{only} RETURNING id",
    ))
    .bind(reason)
    .bind(now_ms())
    .bind(sandbox_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    for row in &rows {
        let id: String = row.try_get("id")?;
        tx.changed(&id);
    }
    Ok(rows.len())
}

/// Ends the sandbox's commands queued for a wake (`not_launched`,
/// `reason`): a stop asked after them.
pub async fn end_queued_waiting(
    tx: &mut WriteTx,
    sandbox_id: &str,
    reason: &str,
) -> Result<(), sqlx::Error> {
    end_queued_matching(tx, sandbox_id, reason, " AND waited_for_wake = 1")
        .await
        .map(drop)
}

/// The oldest command of the sandbox still queued for a wake, if any.
pub async fn first_waiting_for_wake(
    tx: &mut WriteTx,
    sandbox_id: &str,
) -> Result<Option<String>, sqlx::Error> {
    let row: Option<(String,)> = sqlx::query_as(
        "SELECT id FROM commands WHERE sandbox_id = $1 AND state = 'queued' AND waited_for_wake = 1 ORDER BY id LIMIT 1",
    )
    .bind(sandbox_id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    Ok(row.map(|(id,)| id))
}

/// The command as this transaction sees it.
pub async fn load(tx: &mut WriteTx, id: &str) -> Result<Option<CommandRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {COMMAND_COLUMNS} FROM commands WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(CommandRow::from_row).transpose()
}

/// Queues a command for a sandbox; its runner (if any) is woken to pick it up.
pub async fn insert(
    tx: &mut WriteTx,
    id: &str,
    sandbox: &super::SandboxRow,
    request: &CreateCommandRequest,
    waits_for_wake: bool,
) -> Result<CommandRow, sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO commands ({COMMAND_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, 'queued', NULL, NULL, NULL, NULL, 0, NULL, 0, 0, $8, NULL, NULL, NULL, $9, $10, $11, 0, 0)"
    ))
    .bind(id)
    .bind(&sandbox.id)
    .bind(&sandbox.org_id)
    .bind(serde_json::to_string(&request.argv).unwrap_or_default())
    .bind(serde_json::to_string(&request.env).unwrap_or_default())
    .bind(&request.cwd)
    .bind(request.timeout.map(|t| t as i64))
    .bind(now_ms())
    .bind(i64::from(request.stdin || request.tty.is_some()))
    .bind(request.tty.map(|tty| serde_json::to_string(&tty).unwrap_or_default()))
    .bind(i64::from(waits_for_wake))
    .execute(&mut *tx.tx)
    .await?;
    if let Some(runner) = &sandbox.runner_id {
        tx.changed(&format!("runner:{runner}"));
    }
    load(tx, id).await?.ok_or(sqlx::Error::RowNotFound)
}

/// Hands the queued commands of the runner's running sandboxes over to it
/// (`starting`, under the sandbox's epoch). A runner being emptied is
/// handed none for its durable sandboxes: it is told to stop them (they
/// move), so it would never launch them; they wait queued for the runner
/// the sandbox moves to ([`end_commands_for`]).
pub async fn hand_over(
    tx: &mut WriteTx,
    runner_id: &str,
    draining: bool,
) -> Result<(), sqlx::Error> {
    let moving = if draining {
        " AND storage_class <> 'durable'"
    } else {
        ""
    };
    let handed = sqlx::query(&format!(
        "UPDATE commands SET state = 'starting', epoch = (SELECT epoch FROM sandboxes s WHERE s.id = commands.sandbox_id)
         WHERE state = 'queued' AND sandbox_id IN (SELECT id FROM sandboxes WHERE runner_id = $1 AND state = 'running' AND desired = 'running'{moving}) RETURNING id",
    ))
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    // Its waiters are woken, but no runner's set remembered by the hub is
    // stale for it: this runs in a read of the runner's set, whose answer
    // holds the command handed over; any other read either handed it over
    // too or began before the write that made it due (the command's
    // creation, which notifies the runner, or its sandbox's change), and
    // is not trusted after that write. Counted as a change, it made every
    // command's runner read its set a second time, to the same answer.
    for row in &handed {
        let id: String = row.try_get("id")?;
        tx.woken(&id);
    }
    Ok(())
}

/// What a runner observed of a command.
pub struct Observed<'a> {
    pub state: CommandState,
    pub reason: Option<&'a str>,
    pub exit_code: Option<i64>,
    pub signal: Option<&'a str>,
    /// Its pid, with an end reported straight from `starting`: the runner
    /// saw it start, so it is recorded started too (a command that ended
    /// before its `running` report was sent is reported once).
    pub pid: Option<i32>,
}

/// Moves a command to what its runner observed, guarded by the state it
/// was read in (false: it changed meanwhile, nothing written). It wakes
/// the command's waiters, not the runner's assignments: the runner already
/// knows what it reported, and learns that the command left its
/// assignments (then removes its files) on its next read, which the next
/// change or the long-poll's timeout brings. A re-read per report would
/// hold the write lock while other commands' reports wait for it.
pub async fn set_observed(
    tx: &mut WriteTx,
    current: &CommandRow,
    to: Observed<'_>,
) -> Result<bool, sqlx::Error> {
    let now = now_ms();
    let ended = to.state.is_end().then_some(now);
    let started = to.state == CommandState::Running || (to.state.is_end() && to.pid.is_some());
    let updated = sqlx::query(
        "UPDATE commands SET state = $1, state_reason = $2, exit_code = $3, signal = $4, started_at_ms = COALESCE(started_at_ms, $5), ended_at_ms = $6, pid = COALESCE($7, pid) WHERE id = $8 AND state = $9",
    )
    .bind(to.state.as_str())
    .bind(to.reason)
    .bind(to.exit_code)
    .bind(to.signal)
    .bind(started.then_some(now))
    .bind(ended)
    .bind(to.pid.filter(|_| to.state.is_end()).map(i64::from))
    .bind(&current.id)
    .bind(current.state.as_str())
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() == 0 {
        return Ok(false);
    }
    tx.changed(&current.id);
    Ok(true)
}

/// The pid its runner reported for a running command (again after a
/// runner restart: the same process, attached again).
pub async fn set_pid(tx: &mut WriteTx, id: &str, pid: i32) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE commands SET pid = $1 WHERE id = $2 AND state = 'running'")
        .bind(i64::from(pid))
        .bind(id)
        .execute(&mut *tx.tx)
        .await?;
    tx.changed(id);
    Ok(())
}

/// A queued command that will never start (`not_launched`, cancelled).
/// False if it left the queue meanwhile.
pub async fn cancel_queued(tx: &mut WriteTx, id: &str) -> Result<bool, sqlx::Error> {
    let updated = sqlx::query(
        "UPDATE commands SET state = 'not_launched', state_reason = 'cancelled', ended_at_ms = $1 WHERE id = $2 AND state = 'queued'",
    )
    .bind(now_ms())
    .bind(id)
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() == 0 {
        return Ok(false);
    }
    tx.changed(id);
    Ok(true)
}

/// Asks the runner to signal a command it holds: the request joins the
/// command's kept signals (the latest [`api::commands::SIGNALS_KEPT`]),
/// each delivered once. False if the command is no longer on a runner.
pub async fn request_signal(tx: &mut WriteTx, id: &str, signal: &str) -> Result<bool, sqlx::Error> {
    let numbered = sqlx::query(&format!(
        "UPDATE commands SET signal_requested = $1, signal_seq = signal_seq + 1 WHERE id = $2 AND state IN {} RETURNING signal_seq",
        CommandState::sql_in(CommandState::on_runner)
    ))
    .bind(signal)
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    let Some(numbered) = numbered else {
        return Ok(false);
    };
    let seq: i64 = numbered.try_get("signal_seq")?;
    sqlx::query("INSERT INTO command_signals (command_id, seq, signal) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(seq)
        .bind(signal)
        .execute(&mut *tx.tx)
        .await?;
    sqlx::query("DELETE FROM command_signals WHERE command_id = $1 AND seq <= $2")
        .bind(id)
        .bind(seq - api::commands::SIGNALS_KEPT)
        .execute(&mut *tx.tx)
        .await?;
    tx.changed(id);
    Ok(true)
}

/// The kept signals of the commands a runner holds, oldest first, by
/// command id.
pub async fn signals_of_runner(
    tx: &mut WriteTx,
    runner_id: &str,
) -> Result<HashMap<String, Vec<RequestedSignal>>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT command_id, seq, signal FROM command_signals WHERE command_id IN (
            SELECT id FROM commands WHERE state IN {}
            AND sandbox_id IN (SELECT id FROM sandboxes WHERE runner_id = $1))
         ORDER BY command_id, seq",
        CommandState::sql_in(CommandState::on_runner)
    ))
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    let mut signals: HashMap<String, Vec<RequestedSignal>> = HashMap::new();
    for row in &rows {
        let seq: i64 = row.try_get("seq")?;
        signals
            .entry(row.try_get("command_id")?)
            .or_default()
            .push(RequestedSignal {
                seq: seq.max(0) as u64,
                signal: row.try_get("signal")?,
            });
    }
    Ok(signals)
}

/// One of a command's output streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn parse(name: &str) -> Option<Stream> {
        match name {
            "stdout" => Some(Stream::Stdout),
            "stderr" => Some(Stream::Stderr),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }

    /// Bytes of this stream the command has stored.
    pub fn length_of(self, command: &CommandRow) -> i64 {
        match self {
            Stream::Stdout => command.stdout_bytes,
            Stream::Stderr => command.stderr_bytes,
        }
    }

    /// Whether output of this stream was not stored (past the bound).
    pub fn truncated_in(self, command: &CommandRow) -> bool {
        match self {
            Stream::Stdout => command.stdout_truncated,
            Stream::Stderr => command.stderr_truncated,
        }
    }
}

/// Appends fresh output at the stream's current end `at`.
pub async fn append_output(
    tx: &mut WriteTx,
    command: &CommandRow,
    stream: Stream,
    at: i64,
    fresh: &[u8],
) -> Result<(), sqlx::Error> {
    let id = command.id.as_str();
    sqlx::query(
        "INSERT INTO command_output (command_id, stream, start_offset, data) VALUES ($1, $2, $3, $4)",
    )
    .bind(id)
    .bind(stream.as_str())
    .bind(at)
    .bind(fresh.to_vec())
    .execute(&mut *tx.tx)
    .await?;
    let column = match stream {
        Stream::Stdout => "stdout_bytes",
        Stream::Stderr => "stderr_bytes",
    };
    sqlx::query(&format!(
        "UPDATE commands SET {column} = {column} + $1 WHERE id = $2"
    ))
    .bind(fresh.len() as i64)
    .bind(id)
    .execute(&mut *tx.tx)
    .await?;
    super::counts::add_output(tx, &command.org_id, fresh.len() as i64).await?;
    tx.changed(id);
    Ok(())
}

/// Records that output of `stream` past the bound was not stored.
pub async fn mark_truncated(tx: &mut WriteTx, id: &str, stream: Stream) -> Result<(), sqlx::Error> {
    let column = match stream {
        Stream::Stdout => "stdout_truncated",
        Stream::Stderr => "stderr_truncated",
    };
    sqlx::query(&format!("UPDATE commands SET {column} = 1 WHERE id = $1"))
        .bind(id)
        .execute(&mut *tx.tx)
        .await?;
    tx.changed(id);
    Ok(())
}

/// The org's command in its sandbox: read again by every exec's
/// long-poll (`super::read_optional`).
pub async fn visible(
    db: &crate::db::Db,
    org_id: &str,
    sandbox_id: &str,
    id: &str,
) -> Result<Option<CommandRow>, sqlx::Error> {
    use super::Param::Text;
    let sql = format!(
        "SELECT {COMMAND_COLUMNS} FROM commands WHERE id = $1 AND sandbox_id = $2 AND org_id = $3"
    );
    super::read_optional(
        db,
        &sql,
        &COMMAND_COLUMN_NAMES,
        &[Text(id), Text(sandbox_id), Text(org_id)],
    )
    .await
}

/// One page of a sandbox's commands in id order (after `cursor`), and the
/// next page's cursor.
pub async fn list(
    pool: &AnyPool,
    sandbox_id: &str,
    state: Option<CommandState>,
    cursor: &str,
    limit: usize,
) -> Result<(Vec<CommandRow>, Option<String>), sqlx::Error> {
    // The page's rows by size first (`records::page_by_bytes`), then
    // those rows whole.
    let only = state.map_or("", |s| s.as_str());
    let sizes: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT id, CAST(LENGTH(argv) + LENGTH(env) AS BIGINT) FROM commands WHERE sandbox_id = $1 AND id > $2 AND ($3 = '' OR state = $3) ORDER BY id LIMIT {}",
        limit + 1
    ))
    .bind(sandbox_id)
    .bind(cursor)
    .bind(only)
    .fetch_all(pool)
    .await?;
    let (taken, next) = super::page_by_bytes(&sizes, limit);
    let Some((last, _)) = taken.checked_sub(1).map(|i| &sizes[i]) else {
        return Ok((Vec::new(), None));
    };
    // Every row up to the page's last: one that came to match since the
    // sizes were read is answered too (a limit would push out a row
    // before the cursor, never to be listed).
    let rows = sqlx::query(&format!(
        "SELECT {COMMAND_COLUMNS} FROM commands WHERE sandbox_id = $1 AND id > $2 AND id <= $4 AND ($3 = '' OR state = $3) ORDER BY id"
    ))
    .bind(sandbox_id)
    .bind(cursor)
    .bind(only)
    .bind(last)
    .fetch_all(pool)
    .await?;
    let commands = rows
        .iter()
        .map(CommandRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((commands, next))
}

/// The sandbox's command with `pid`: a running one first (pids are
/// reused), else the latest created (`running_only`: none but a running
/// one). One indexed read (`commands_by_pid`).
pub async fn by_pid(
    pool: &AnyPool,
    sandbox_id: &str,
    pid: i64,
    running_only: bool,
) -> Result<Option<CommandRow>, sqlx::Error> {
    let only = if running_only {
        " AND state = 'running'"
    } else {
        ""
    };
    let row = sqlx::query(&format!(
        "SELECT {COMMAND_COLUMNS} FROM commands WHERE sandbox_id = $1 AND pid = $2{only}
         ORDER BY CASE WHEN state = 'running' THEN 0 ELSE 1 END, created_at_ms DESC, id DESC LIMIT 1"
    ))
    .bind(sandbox_id)
    .bind(pid)
    .fetch_optional(pool)
    .await?;
    row.as_ref().map(CommandRow::from_row).transpose()
}

/// Up to `max` bytes of a command's stream from `offset`.
pub async fn read_output(
    pool: &AnyPool,
    id: &str,
    stream: Stream,
    offset: i64,
    max: usize,
) -> Result<Vec<u8>, sqlx::Error> {
    let chunks = sqlx::query(
        // Only the chunks that overlap the range: a reader tailing a long
        // stream is not sent every earlier chunk's bytes on each read
        // (`length` of a blob or bytea reads its size, not its bytes).
        "SELECT start_offset, data FROM command_output WHERE command_id = $1 AND stream = $2 AND start_offset < $3 AND start_offset + length(data) > $4 ORDER BY start_offset",
    )
    .bind(id)
    .bind(stream.as_str())
    .bind(offset.saturating_add(max as i64))
    .bind(offset)
    .fetch_all(pool)
    .await?;
    let mut data: Vec<u8> = Vec::new();
    for chunk in chunks {
        let start: i64 = chunk.try_get("start_offset")?;
        let bytes: Vec<u8> = chunk.try_get("data")?;
        let end = start + bytes.len() as i64;
        if end <= offset {
            continue;
        }
        let from = (offset.max(start) - start) as usize;
        let want = max - data.len();
        let slice = &bytes[from..];
        data.extend_from_slice(&slice[..slice.len().min(want)]);
        if data.len() >= max {
            break;
        }
    }
    Ok(data)
}
