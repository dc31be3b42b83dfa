//! Commands (`/v1/sandboxes/{id}/commands`): a record per exec.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::lifecycle::CommandState;

/// `POST /v1/sandboxes/{id}/commands`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCommandRequest {
    /// The program and its arguments: 256 KiB in all.
    #[schema(schema_with = crate::schema::argv)]
    pub argv: Vec<String>,
    /// At most 128 variables and 64 KiB in all.
    #[serde(default)]
    #[schema(schema_with = crate::schema::env)]
    pub env: BTreeMap<String, String>,
    /// Working directory inside the sandbox (default: `/workspace`).
    #[serde(default)]
    #[schema(pattern = r"^/[^\x00]{0,1023}$")]
    pub cwd: Option<String>,
    /// Seconds before the command is asked to end (`timed_out`).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 2_592_000)]
    pub timeout: Option<u64>,
    /// Whether the command reads a stdin the client writes
    /// (`POST …/commands/{command_id}/stdin`); otherwise it reads an empty
    /// stdin (`/dev/null`).
    #[serde(default)]
    pub stdin: bool,
    /// A terminal for the command: its stdin, stdout and stderr (one output
    /// stream, `stdout`), resizable (`POST …/resize`), attached over a
    /// WebSocket (`GET …/attach`). Implies `stdin`.
    #[serde(default)]
    pub tty: Option<TtySize>,
}

/// A terminal's size: 1 to 4096 rows and columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TtySize {
    #[schema(minimum = 1, maximum = 4096)]
    pub rows: u16,
    #[schema(minimum = 1, maximum = 4096)]
    pub cols: u16,
}

impl TtySize {
    /// The largest number of rows or columns.
    pub const MAX: u16 = 4096;

    pub fn is_valid(self) -> bool {
        (1..=Self::MAX).contains(&self.rows) && (1..=Self::MAX).contains(&self.cols)
    }
}

/// A command record. `state` is one of `queued`, `starting` (handed to the
/// runner, not yet seen running), `running`, or an end state of DESIGN.md
/// §4: `exited`, `timed_out`, `resource_exhausted`, `interrupted`,
/// `launch_failed`, `not_launched`, `infrastructure_lost`, `unknown`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Command {
    pub id: String,
    pub sandbox_id: String,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub timeout: Option<u64>,
    pub state: CommandState,
    pub state_reason: Option<String>,
    /// The program's own exit code (`exited`).
    pub exit_code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<String>,
    /// The sandbox epoch it was handed to the runner under.
    pub epoch: Option<u64>,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    /// The command wrote more to stdout than its record keeps
    /// ([`OUTPUT_STREAM_BYTES_MAX`]): `stdout_bytes` are the first ones,
    /// the rest was not stored.
    #[serde(default)]
    pub stdout_truncated: bool,
    /// The same for stderr.
    #[serde(default)]
    pub stderr_truncated: bool,
    pub created_at: String,
    pub started_at: Option<String>,
    pub ended_at: Option<String>,
    /// The command's pid inside the sandbox while its agent runs it
    /// (reported with `running`); absent before, and for commands run by
    /// the runtime's exec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    /// Whether the command reads a stdin the client writes.
    #[serde(default)]
    pub stdin: bool,
    /// Its terminal's size at creation, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tty: Option<TtySize>,
    /// It was created while its sandbox was not running (asleep, stopped,
    /// stopping) and waited for the sandbox to wake; the sandbox's
    /// `starting` event names it.
    #[serde(default)]
    pub waited_for_wake: bool,
}

/// `GET /v1/sandboxes/{id}/commands`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CommandList {
    pub commands: Vec<Command>,
    pub next_cursor: Option<String>,
}

/// `POST /v1/sandboxes/{id}/commands/{cid}/signal`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// `TERM`, `KILL`, `INT`, `HUP`, `QUIT`, `USR1` or `USR2`.
    #[schema(schema_with = crate::schema::signal)]
    pub signal: String,
}

/// How many of a command's latest signal requests its record keeps for
/// its runner: every one asked between two of the runner's polls is
/// delivered, up to this many (older ones than these were delivered
/// long since, or the command is not reading its signals).
pub const SIGNALS_KEPT: i64 = 16;

/// Signals a command may be sent.
/// The most of each stream (stdout, stderr) a command's record keeps:
/// output past it is not stored, and the record says so
/// (`stdout_truncated`, `stderr_truncated`). Records live in the
/// deployment's shared database: without a bound one runaway command
/// (`yes`) would fill it for every org. Larger results belong in files
/// (the file API).
pub const OUTPUT_STREAM_BYTES_MAX: u64 = 32 * 1024 * 1024;

pub const SIGNALS: &[&str] = &["TERM", "KILL", "INT", "HUP", "QUIT", "USR1", "USR2"];
