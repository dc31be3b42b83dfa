//! The sandbox's agent: commands as a fork and exec of the sandbox's own
//! init, without a runtime process per command (DESIGN.md §4).
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
//! sandbox's own commands.
//!
//! # The protocol
//!
//! A connection carries one request, named by its first frame
//! ([`wire::kind`]):
//!
//! - `RUN {id, incarnation, argv, env, cwd, stdin, stdout_from,
//!   stderr_from}`: start command `id`, or attach to it if the agent
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
//!
//! Errors are `ERROR {code, message}` with a stable code
//! (`bad_request`, `unknown_command`, `incarnation_mismatch`,
//! `too_many_commands`, `offset_unavailable`, `stdin_unavailable`,
//! `stdin_closed`), and the connection closes.
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
pub mod server;
pub mod wire;

/// The socket's name in the bundle directory.
pub const SOCKET_NAME: &str = "agent.sock";
/// The init's flag naming the descriptor it serves the agent on.
pub const AGENT_FD_FLAG: &str = "--agent-fd";
/// The descriptor the listening socket has in the container.
pub const AGENT_FD: i32 = 3;
