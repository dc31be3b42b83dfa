//! The sandbox's agent: commands as a fork and exec of the sandbox's own
//! init, without a runtime process per command (DESIGN.md §4), and the
//! sandbox's files read and written from inside it ([`files`]).
//!
//! # The channel
//!
//! Before `create`, the runner binds a unix socket at
//! `bundle/agent.sock` (a host directory the sandbox never sees) and hands
//! its listening descriptor to the container through the runtime's
//! `--preserve-fds`: it is fd 3 of the init, started with `--agent-fd 3`.
//! The init accepts on it; the runner connects to the path, even after a
//! restart of its own. Nothing in the sandbox can create, replace or point
//! that path elsewhere, so the runner never connects to anything the
//! sandbox chose. The init keeps the descriptor close-on-exec: commands do
//! not inherit it. Everything the agent sends is still treated as hostile
//! by the runner (it runs with the sandbox's privileges): frames are
//! bounded ([`wire::FRAME_BYTES_MAX`]) and only ever describe the
//! sandbox's own commands and files.
//!
//! # The protocol
//!
//! A connection carries one request, named by its first frame
//! ([`wire::kind`]):
//!
//! - `RUN {id, incarnation, argv, env, cwd, stdin, tty?: {rows, cols},
//!   stdout_from, stderr_from}`: start command `id` (with `tty`, on a
//!   terminal of its own, [`pty`]: one output stream, stdin through the
//!   terminal), or attach to it if the agent
//!   already knows it. The agent answers `STARTED {pid, fresh,
//!   started_unix_ms}` (or `LAUNCH_FAILED {failure, message}`), then
//!   streams `STDOUT`/`STDERR` frames from the asked offsets and, once the
//!   process ended and its output is all sent, `ENDED {exit_code}` or
//!   `ENDED {signal}`. Meanwhile the runner may send `ACK {stdout,
//!   stderr}` (what it has spooled: the agent frees it) and `SIGNAL
//!   {signal}` (to the command's process group, never blocking).
//! - `STDIN_OPEN {id}` (answered `OK` once the stdin is this
//!   connection's), then `STDIN_DATA` frames and `STDIN_CLOSE` (answered
//!   `OK`): the command's stdin, with back-pressure.
//! - `LIST {}`: `LISTING {incarnation, commands: [{id, pid, running,
//!   started_unix_ms}]}`.
//! - `FORGET {id}`: the runner recorded the command's end; the agent
//!   drops it.
//! - `RESIZE {id, rows, cols}`: the command's terminal's new size
//!   (`no_terminal` for a command without one; 1 to 4096 each).
//!
//! - File requests ([`files`], executed by the agent inside the sandbox's
//!   own mount namespace; paths absolute or relative to `/workspace`):
//!   - `FILE_READ {path, offset, length?}`: `FILE_INFO {size, mode,
//!     mtime_unix_ms, type}`, then `DATA` frames (at most 64 KiB each) from
//!     `offset`, at most `length` bytes, then `DONE {size}`.
//!   - `FILE_WRITE {path, mode?, parents}`, then the runner's `DATA`
//!     frames and `DATA_END`: `DONE {size}` once the file is fsynced and
//!     renamed into place.
//!   - `FILE_LIST {path, depth?}`: `LISTING {entries: [{path, type, size,
//!     mode, mtime_unix_ms, link_target?}]}` frames (each under the frame
//!     bound), then `DONE {truncated, count}`.
//!   - `FILE_REMOVE {path, recursive}`, `FILE_MOVE {from, to,
//!     overwrite}`: `DONE {}`; `FILE_MKDIR {path, parents, mode?}`: `DONE
//!     {created}`.
//!   - `TAR_READ {path}`: `DATA` frames of a tar stream, then `DONE
//!     {files, directories, symlinks, bytes, skipped}`.
//!   - `TAR_WRITE {path}`, then the runner's `DATA` frames of a tar stream
//!     and `DATA_END`: `DONE {files, directories, symlinks, bytes,
//!     skipped}`.
//!
//! Errors are `ERROR {code, message}` with a stable code, and the
//! connection closes. Commands: `bad_request`, `unknown_command`,
//! `incarnation_mismatch`, `too_many_commands`, `offset_unavailable`,
//! `stdin_unavailable`, `stdin_closed`. Files: `bad_request` (a path
//! empty, over 4096 bytes, with a NUL byte or a `..` component; `/` or
//! `/workspace` removed or moved; a malformed or hostile tar entry),
//! `not_found`, `is_a_directory`, `not_a_directory`, `permission_denied`
//! (read-only filesystems included), `offset_past_end`,
//! `insufficient_storage` (`ENOSPC`, `EDQUOT`), `already_exists`,
//! `directory_not_empty`, `cross_device`, `io_error`. A refusal in the
//! middle of a download comes after some `DATA` frames: the download is
//! incomplete.
//!
//! # At most once
//!
//! Every init has a random incarnation. The runner records the
//! incarnation with its launch marker before it asks for the run, and every
//! `RUN` names it: an agent of another incarnation refuses
//! (`incarnation_mismatch`), and one of the same incarnation that already
//! knows the id attaches instead of starting it again. So a runner that
//! died anywhere around a launch asks again safely: the command runs once,
//! and its output is read from where the runner's spool ends.

pub mod client;
pub mod files;
pub mod files_client;
pub mod pty;
pub mod server;
pub mod wire;

/// The socket's name in the bundle directory.
pub const SOCKET_NAME: &str = "agent.sock";
/// The init's flag naming the descriptor it serves the agent on.
pub const AGENT_FD_FLAG: &str = "--agent-fd";
/// The descriptor the listening socket has in the container.
pub const AGENT_FD: i32 = 3;
