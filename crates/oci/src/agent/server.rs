//! The agent's side, inside the sandbox: part of `roost init` (PID 1).
//!
//! Commands are a fork and exec of the init, so they are the init's
//! children: they get the sandbox's posture (user, capabilities, seccomp,
//! cgroup, namespaces) from it, and the init's reaper hands their ends
//! here ([`Agent::reaped`]). A command is known by the runner's id; asking
//! to run an id already known attaches to it instead, so a runner that
//! restarts between its launch record and its request cannot start a
//! command twice (see [`super`]).
//!
//! Output is held in memory per stream, at most [`BUFFER_BYTES_MAX`] not
//! yet acknowledged: past that the agent stops reading the command's pipe
//! and the command blocks on its writes (back-pressure, never unbounded
//! buffering), until the runner acknowledges what it has spooled. So a
//! runner away for a restart loses nothing: it attaches again from the
//! offsets it holds.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustix::process::{Pid, WaitStatus};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::pipe;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;
use tokio::time::Instant;

use super::pty;
use super::wire::{self, Frame, kind};

/// Commands known at once (running, or ended and not yet forgotten).
pub const COMMANDS_MAX: usize = 1024;
/// Output held per stream that the runner has not acknowledged.
pub const BUFFER_BYTES_MAX: usize = 256 * 1024;
/// One read from a command's pipe, and the most one output frame carries.
pub const READ_CHUNK_BYTES: usize = 64 * 1024;
/// How long output is still read after the command's process ended, for
/// background processes that keep its pipes open (as `runc exec` did).
pub const DRAIN_MS: u64 = crate::exec::OUTPUT_DRAIN_MS;
/// The longest command id.
pub const ID_BYTES_MAX: usize = 128;
/// Connections served at once; more wait in the listen backlog.
const CONNECTIONS_MAX: usize = 256;

/// A refusal: a stable code and a one-line message, sent as an error frame.
#[derive(Debug)]
struct Refusal {
    code: &'static str,
    message: String,
}

fn refuse(code: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

impl From<io::Error> for Refusal {
    fn from(err: io::Error) -> Refusal {
        refuse("bad_request", err.to_string())
    }
}

/// How a command's process ended.
#[derive(Clone, Copy, Debug)]
enum End {
    Exited(i32),
    Signaled(i32),
}

/// One stream's output not yet acknowledged.
#[derive(Default)]
struct Buffer {
    /// The offset of `bytes[0]` in the stream.
    base: u64,
    bytes: VecDeque<u8>,
    /// No more bytes will come (the pipe closed or was drained).
    closed: bool,
}

impl Buffer {
    fn end(&self) -> u64 {
        self.base + self.bytes.len() as u64
    }

    fn ack(&mut self, offset: u64) {
        let upto = offset.min(self.end());
        if upto > self.base {
            self.bytes.drain(..(upto - self.base) as usize);
            self.base = upto;
        }
    }

    /// Up to [`READ_CHUNK_BYTES`] from `from`.
    fn chunk(&self, from: u64) -> Vec<u8> {
        let start = (from.saturating_sub(self.base)) as usize;
        self.bytes
            .range(start.min(self.bytes.len())..)
            .take(READ_CHUNK_BYTES)
            .copied()
            .collect()
    }
}

#[derive(Default)]
struct Progress {
    streams: [Buffer; 2],
    end: Option<End>,
    ended_at: Option<Instant>,
}

struct Command {
    id: String,
    pid: Pid,
    started_unix_ms: u64,
    progress: Mutex<Progress>,
    /// Bumped on every change of `progress`: output, acks, the end.
    changed: watch::Sender<()>,
    /// The write end of the command's stdin, while it has one open and no
    /// connection holds it.
    stdin: Mutex<Option<Input>>,
    /// The command's terminal, if it asked for one (resized on request).
    terminal: Option<Arc<pty::Master>>,
}

impl Command {
    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self) {
        self.changed.send_modify(|()| {});
    }
}

/// The sandbox's agent: its commands, by id.
pub struct Agent {
    incarnation: String,
    commands: Mutex<BTreeMap<String, Arc<Command>>>,
}

impl Agent {
    pub fn new() -> Arc<Agent> {
        // Distinct for every init: a runner that finds another incarnation
        // than it recorded knows the commands it launched died with the
        // earlier init.
        let mut random = [0u8; 16];
        let incarnation = match getrandom::fill(&mut random) {
            Ok(()) => random.iter().map(|b| format!("{b:02x}")).collect(),
            Err(_) => format!("{}-{}", std::process::id(), unix_ms()),
        };
        Arc::new(Agent {
            incarnation,
            commands: Mutex::new(BTreeMap::new()),
        })
    }

    fn commands(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Command>>> {
        self.commands.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn find(&self, id: &str) -> Option<Arc<Command>> {
        self.commands().get(id).cloned()
    }

    /// The init reaped `pid`: if it was a command, record its end.
    pub fn reaped(&self, pid: Pid, status: WaitStatus) {
        let command = self.commands().values().find(|c| c.pid == pid).cloned();
        let Some(command) = command else { return };
        let end = match status.terminating_signal() {
            Some(signal) => End::Signaled(signal),
            None => End::Exited(status.exit_status().unwrap_or(0)),
        };
        {
            let mut progress = command.progress();
            progress.end = Some(end);
            progress.ended_at = Some(Instant::now());
        }
        command.touch();
    }

    /// Serves connections on `listener` forever.
    pub async fn serve(self: Arc<Self>, listener: std::os::unix::net::UnixListener) {
        if let Err(e) = listener.set_nonblocking(true) {
            eprintln!("roost-init: the agent cannot serve: {e}");
            return;
        }
        let listener = match tokio::net::UnixListener::from_std(listener) {
            Ok(listener) => listener,
            Err(e) => {
                eprintln!("roost-init: the agent cannot serve: {e}");
                return;
            }
        };
        let permits = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
        loop {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            match listener.accept().await {
                Ok((stream, _)) => {
                    let agent = self.clone();
                    tokio::spawn(async move {
                        agent.handle(stream).await;
                        drop(permit);
                    });
                }
                // EMFILE and the like: wait a little rather than spin.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    async fn handle(self: Arc<Self>, stream: UnixStream) {
        let (mut reader, mut writer) = stream.into_split();
        let first = match wire::read_frame(&mut reader).await {
            Ok(Some(frame)) => frame,
            Ok(None) => return,
            Err(e) => {
                let _ = wire::write_error(&mut writer, "bad_request", &e.to_string()).await;
                return;
            }
        };
        let result = match first.kind {
            kind::RUN => self.serve_run(&first, reader, &mut writer).await,
            kind::STDIN_OPEN => self.serve_stdin(&first, reader, &mut writer).await,
            kind::LIST => self.serve_list(&mut writer).await,
            kind::FORGET => self.forget(&first),
            kind::RESIZE => self.resize(&first),
            kind::FILE_READ
            | kind::FILE_WRITE
            | kind::FILE_LIST
            | kind::FILE_REMOVE
            | kind::FILE_MOVE
            | kind::FILE_MKDIR
            | kind::TAR_READ
            | kind::TAR_WRITE => {
                super::files::serve(&first, reader, &mut writer).await;
                Ok(())
            }
            other => Err(refuse(
                "bad_request",
                format!("frame kind {other} cannot open a connection"),
            )),
        };
        if let Err(refusal) = result {
            let _ = wire::write_error(&mut writer, refusal.code, &refusal.message).await;
        }
        let _ = writer.shutdown().await;
    }

    /// Sets the size of a command's terminal.
    fn resize(&self, first: &Frame) -> Result<(), Refusal> {
        let request = first.json()?;
        let id = wire::text(&request, "id")?;
        let (rows, cols) = pty::check_size(
            wire::number(&request, "rows")?,
            wire::number(&request, "cols")?,
        )
        .map_err(|message| refuse("bad_request", message))?;
        let command = self
            .find(id)
            .ok_or_else(|| refuse("unknown_command", format!("no command {id:?}")))?;
        let terminal = command
            .terminal
            .as_ref()
            .ok_or_else(|| refuse("no_terminal", format!("command {id} has no terminal")))?;
        terminal
            .resize(rows, cols)
            .map_err(|e| refuse("io_error", format!("cannot resize the terminal: {e}")))
    }

    /// Drops an ended command (a running one stays: the runner asked
    /// too early, or another runner process still reads it).
    fn forget(&self, first: &Frame) -> Result<(), Refusal> {
        let request = first.json()?;
        let id = wire::text(&request, "id")?;
        let mut commands = self.commands();
        if commands.get(id).is_some_and(|c| c.progress().end.is_some()) {
            commands.remove(id);
        }
        Ok(())
    }

    async fn serve_list(&self, writer: &mut OwnedWriteHalf) -> Result<(), Refusal> {
        let commands: Vec<Value> = self
            .commands()
            .values()
            .map(|c| {
                json!({
                    "id": c.id,
                    "pid": c.pid.as_raw_nonzero().get(),
                    "running": c.progress().end.is_none(),
                    "started_unix_ms": c.started_unix_ms,
                })
            })
            .collect();
        let answer = json!({"incarnation": self.incarnation, "commands": commands});
        wire::write_json(writer, kind::LISTING, &answer).await?;
        Ok(())
    }

    async fn serve_run(
        self: &Arc<Self>,
        first: &Frame,
        reader: OwnedReadHalf,
        writer: &mut OwnedWriteHalf,
    ) -> Result<(), Refusal> {
        let request = first.json()?;
        let id = wire::text(&request, "id")?;
        check_id(id)?;
        let incarnation = wire::text(&request, "incarnation")?;
        if incarnation != self.incarnation {
            return Err(refuse(
                "incarnation_mismatch",
                format!(
                    "this agent is incarnation {}, not {incarnation}",
                    self.incarnation
                ),
            ));
        }
        let from = [
            wire::number(&request, "stdout_from")?,
            wire::number(&request, "stderr_from")?,
        ];
        let (command, fresh) = match self.find(id) {
            Some(command) => (command, false),
            None => match self.launch(id, &request) {
                Ok(command) => (command, true),
                Err(Launch::Refused(refusal)) => return Err(refusal),
                Err(Launch::Failed { failure, message }) => {
                    let answer = json!({"failure": failure, "message": message});
                    wire::write_json(writer, kind::LAUNCH_FAILED, &answer).await?;
                    return Ok(());
                }
            },
        };
        {
            let progress = command.progress();
            for (i, stream) in progress.streams.iter().enumerate() {
                if from[i] < stream.base || from[i] > stream.end() {
                    return Err(refuse(
                        "offset_unavailable",
                        format!(
                            "offset {} of stream {i} is outside what the agent holds ({}..{})",
                            from[i],
                            stream.base,
                            stream.end()
                        ),
                    ));
                }
            }
        }
        let started = json!({
            "pid": command.pid.as_raw_nonzero().get(),
            "fresh": fresh,
            "started_unix_ms": command.started_unix_ms,
        });
        wire::write_json(writer, kind::STARTED, &started).await?;

        let control = tokio::spawn(control_loop(command.clone(), reader));
        let sent = stream_output(&command, from, writer).await;
        if sent.is_ok() {
            // The end is sent: the runner closes the connection once it
            // has it (acks may still come until then).
            let _ = control.await;
        } else {
            control.abort();
        }
        Ok(())
    }

    fn launch(&self, id: &str, request: &Value) -> Result<Arc<Command>, Launch> {
        let argv = wire::texts(request, "argv").map_err(|e| Launch::Refused(e.into()))?;
        let env = wire::texts(request, "env").map_err(|e| Launch::Refused(e.into()))?;
        let cwd = wire::text(request, "cwd").map_err(|e| Launch::Refused(e.into()))?;
        let with_stdin = request["stdin"].as_bool().unwrap_or(false);
        let size = match &request["tty"] {
            Value::Null => None,
            tty => Some(
                pty::check_size(
                    wire::number(tty, "rows").map_err(|e| Launch::Refused(e.into()))?,
                    wire::number(tty, "cols").map_err(|e| Launch::Refused(e.into()))?,
                )
                .map_err(|message| Launch::Refused(refuse("bad_request", message)))?,
            ),
        };
        let Some((program, args)) = argv.split_first() else {
            return Err(Launch::Refused(refuse("bad_request", "argv is empty")));
        };
        if argv.iter().chain(&env).any(|s| s.contains('\0')) || cwd.contains('\0') {
            return Err(Launch::Refused(refuse(
                "bad_request",
                "argv, env and cwd cannot hold NUL bytes",
            )));
        }
        if self.commands().len() >= COMMANDS_MAX {
            return Err(Launch::Refused(refuse(
                "too_many_commands",
                format!("{COMMANDS_MAX} commands are known to the agent already"),
            )));
        }
        // A missing cwd and a missing program are both ENOENT from spawn:
        // the cwd is looked at first to tell them apart.
        if !std::path::Path::new(cwd).is_dir() {
            return Err(Launch::Failed {
                failure: "bad_cwd",
                message: format!("cwd {cwd:?} is not a directory in the sandbox"),
            });
        }
        let mut process = std::process::Command::new(program);
        process.args(args).env_clear().current_dir(cwd);
        for pair in &env {
            match pair.split_once('=') {
                Some((name, value)) if !name.is_empty() => {
                    process.env(name, value);
                }
                _ => {
                    return Err(Launch::Refused(refuse(
                        "bad_request",
                        format!("env entry {pair:?} is not NAME=VALUE"),
                    )));
                }
            }
        }
        // A terminal: the slave is the command's stdin, stdout, stderr and
        // controlling terminal; its input and output go through the master.
        let terminal = match size {
            Some((rows, cols)) => {
                let (master, slave) = pty::open(rows, cols).map_err(|e| {
                    Launch::Refused(refuse(
                        "pty_unavailable",
                        format!("cannot open a terminal: {e}"),
                    ))
                })?;
                let copy = |fd: &OwnedFd| {
                    fd.try_clone().map_err(|e| {
                        Launch::Refused(refuse(
                            "pty_unavailable",
                            format!("cannot open a terminal: {e}"),
                        ))
                    })
                };
                process
                    .stdin(Stdio::from(copy(&slave)?))
                    .stdout(Stdio::from(copy(&slave)?))
                    .stderr(Stdio::from(slave));
                Some(Arc::new(master))
            }
            None => {
                process
                    .stdin(if with_stdin {
                        Stdio::piped()
                    } else {
                        Stdio::null()
                    })
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                None
            }
        };
        let controlling = terminal.is_some();
        // SAFETY: setsid and the TIOCSCTTY ioctl are async-signal-safe
        // and touch no memory. Its own session makes the command a process
        // group leader, so a signal reaches the children that stayed in
        // its group; with a terminal, fd 0 becomes its controlling one.
        #[allow(unsafe_code)]
        unsafe {
            process.pre_exec(move || {
                rustix::process::setsid().map_err(io::Error::from)?;
                if controlling {
                    let stdin = std::os::fd::BorrowedFd::borrow_raw(0);
                    rustix::process::ioctl_tiocsctty(stdin).map_err(io::Error::from)?;
                }
                Ok(())
            });
        }
        // No await between the spawn and the insertion below: the init's
        // reaper runs on this same thread, so it cannot reap the command
        // before the agent knows its pid.
        let mut child = process.spawn().map_err(|e| Launch::Failed {
            failure: match e.kind() {
                io::ErrorKind::NotFound => "missing_executable",
                io::ErrorKind::PermissionDenied => "permission_denied",
                _ => "refused",
            },
            message: match e.kind() {
                io::ErrorKind::NotFound => {
                    format!("{program:?}: executable file not found (not on PATH, or no such file)")
                }
                _ => format!("cannot start {program:?}: {e}"),
            },
        })?;
        let pid = Pid::from_child(&child);
        let (changed, _) = watch::channel(());
        let stdin = match &terminal {
            Some(master) => Some(Input::Terminal(master.clone())),
            None => child
                .stdin
                .take()
                .and_then(|s| pipe::Sender::from_owned_fd(OwnedFd::from(s)).ok())
                .map(Input::Pipe),
        };
        let command = Arc::new(Command {
            id: id.to_owned(),
            pid,
            started_unix_ms: unix_ms(),
            progress: Mutex::new(Progress::default()),
            changed,
            stdin: Mutex::new(stdin),
            terminal: terminal.clone(),
        });
        self.commands().insert(id.to_owned(), command.clone());
        let outputs = match terminal {
            // One stream: the terminal's (stderr stays empty).
            Some(master) => [Some(Output::Terminal(master)), None],
            None => [
                child
                    .stdout
                    .take()
                    .and_then(|s| pipe::Receiver::from_owned_fd(OwnedFd::from(s)).ok())
                    .map(Output::Pipe),
                child
                    .stderr
                    .take()
                    .and_then(|s| pipe::Receiver::from_owned_fd(OwnedFd::from(s)).ok())
                    .map(Output::Pipe),
            ],
        };
        for (i, output) in outputs.into_iter().enumerate() {
            tokio::spawn(pump(command.clone(), i, output));
        }
        Ok(command)
    }

    async fn serve_stdin(
        &self,
        first: &Frame,
        mut reader: OwnedReadHalf,
        writer: &mut OwnedWriteHalf,
    ) -> Result<(), Refusal> {
        let request = first.json()?;
        let id = wire::text(&request, "id")?;
        let command = self
            .find(id)
            .ok_or_else(|| refuse("unknown_command", format!("no command {id:?}")))?;
        let taken = command
            .stdin
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let mut pipe = taken.ok_or_else(|| {
            refuse(
                "stdin_unavailable",
                "the command has no open stdin, or another connection writes it",
            )
        })?;
        // Opened: the writer may send.
        if let Err(e) = wire::write_frame(writer, kind::OK, b"").await {
            *command.stdin.lock().unwrap_or_else(|p| p.into_inner()) = Some(pipe);
            return Err(e.into());
        }
        loop {
            match wire::read_frame(&mut reader).await {
                Ok(Some(frame)) if frame.kind == kind::STDIN_DATA => {
                    if let Err(e) = pipe.write_all(&frame.payload).await {
                        return Err(refuse(
                            "stdin_closed",
                            format!("the command no longer reads its stdin: {e}"),
                        ));
                    }
                }
                Ok(Some(frame)) if frame.kind == kind::STDIN_CLOSE => {
                    // A terminal's end of input is its EOF character
                    // (the master stays: it carries the output).
                    if let Input::Terminal(master) = &pipe {
                        let _ = master.write_all(b"\x04").await;
                    }
                    drop(pipe);
                    wire::write_frame(writer, kind::OK, b"").await?;
                    return Ok(());
                }
                Ok(Some(frame)) => {
                    return Err(refuse(
                        "bad_request",
                        format!("frame kind {} on a stdin connection", frame.kind),
                    ));
                }
                // The runner went away: the stdin waits for it to return.
                Ok(None) | Err(_) => {
                    *command.stdin.lock().unwrap_or_else(|p| p.into_inner()) = Some(pipe);
                    return Ok(());
                }
            }
        }
    }
}

enum Launch {
    Refused(Refusal),
    Failed {
        failure: &'static str,
        message: String,
    },
}

fn check_id(id: &str) -> Result<(), Refusal> {
    let fine = !id.is_empty()
        && id.len() <= ID_BYTES_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if fine {
        Ok(())
    } else {
        Err(refuse(
            "bad_request",
            format!("a command id is 1 to {ID_BYTES_MAX} of [A-Za-z0-9_-]"),
        ))
    }
}

/// Reads one stream of a command into its buffer while there is room.
/// Where a command's input goes: a pipe, or its terminal.
enum Input {
    Pipe(pipe::Sender),
    Terminal(Arc<pty::Master>),
}

impl Input {
    async fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Input::Pipe(pipe) => pipe.write_all(bytes).await,
            Input::Terminal(master) => master.write_all(bytes).await,
        }
    }
}

/// Where a stream of a command's output comes from.
enum Output {
    Pipe(pipe::Receiver),
    Terminal(Arc<pty::Master>),
}

impl Output {
    async fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            Output::Pipe(pipe) => pipe.read(buffer).await,
            Output::Terminal(master) => master.read(buffer).await,
        }
    }
}

async fn pump(command: Arc<Command>, i: usize, pipe: Option<Output>) {
    let mut changes = command.changed.subscribe();
    if let Some(mut pipe) = pipe {
        let mut chunk = vec![0u8; READ_CHUNK_BYTES];
        loop {
            let (room, drain_deadline) = {
                let progress = command.progress();
                let held = progress.streams[i].bytes.len();
                (
                    BUFFER_BYTES_MAX.saturating_sub(held),
                    progress
                        .ended_at
                        .map(|at| at + Duration::from_millis(DRAIN_MS)),
                )
            };
            let drained = async {
                match drain_deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                read = pipe.read(&mut chunk[..room.min(READ_CHUNK_BYTES)]), if room > 0 => {
                    match read {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            command.progress().streams[i].bytes.extend(&chunk[..n]);
                            command.touch();
                        }
                    }
                }
                changed = changes.changed() => if changed.is_err() { break },
                () = drained => break,
            }
        }
    }
    command.progress().streams[i].closed = true;
    command.touch();
}

/// Sends a command's output from `from` as it comes, then its end.
async fn stream_output(
    command: &Command,
    mut from: [u64; 2],
    writer: &mut OwnedWriteHalf,
) -> io::Result<()> {
    let mut changes = command.changed.subscribe();
    loop {
        let (chunks, end) = {
            let progress = command.progress();
            let chunks: [Vec<u8>; 2] = [
                progress.streams[0].chunk(from[0]),
                progress.streams[1].chunk(from[1]),
            ];
            let done =
                progress.streams.iter().all(|s| s.closed) && chunks.iter().all(Vec::is_empty);
            (chunks, if done { progress.end } else { None })
        };
        let mut sent = false;
        for (i, chunk) in chunks.iter().enumerate() {
            if !chunk.is_empty() {
                let frame_kind = if i == 0 { kind::STDOUT } else { kind::STDERR };
                wire::write_frame(writer, frame_kind, chunk).await?;
                from[i] += chunk.len() as u64;
                sent = true;
            }
        }
        if sent {
            continue;
        }
        if let Some(end) = end {
            let answer = match end {
                End::Exited(code) => json!({"exit_code": code}),
                End::Signaled(signal) => json!({"signal": signal}),
            };
            return wire::write_json(writer, kind::ENDED, &answer).await;
        }
        if changes.changed().await.is_err() {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
    }
}

/// What the runner sends on a command connection after its request.
async fn control_loop(command: Arc<Command>, mut reader: OwnedReadHalf) {
    while let Ok(Some(frame)) = wire::read_frame(&mut reader).await {
        let Ok(value) = frame.json() else { return };
        match frame.kind {
            kind::ACK => {
                let offsets = [
                    wire::number(&value, "stdout").unwrap_or(0),
                    wire::number(&value, "stderr").unwrap_or(0),
                ];
                {
                    let mut progress = command.progress();
                    for (stream, offset) in progress.streams.iter_mut().zip(offsets) {
                        stream.ack(offset);
                    }
                }
                command.touch();
            }
            kind::SIGNAL => {
                let number = wire::number(&value, "signal").unwrap_or(0);
                // Only real signals; never to a command that has ended
                // (its pid may be another process's by now).
                let signal = i32::try_from(number)
                    .ok()
                    .and_then(crate::signal::Signal::from_number);
                if let Some(signal) = signal
                    && command.progress().end.is_none()
                {
                    // ESRCH: it ended meanwhile; its end tells the rest.
                    let _ = rustix::process::kill_process_group(command.pid, signal.to_rustix());
                }
            }
            _ => return,
        }
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_frees_what_is_acknowledged_and_no_more() {
        let mut buffer = Buffer::default();
        buffer.bytes.extend(b"hello world");
        buffer.ack(6);
        assert_eq!((buffer.base, buffer.chunk(6)), (6, b"world".to_vec()));
        buffer.ack(3);
        assert_eq!(buffer.base, 6, "an ack never goes back");
        buffer.ack(100);
        assert_eq!((buffer.base, buffer.end()), (11, 11));
        assert!(buffer.chunk(11).is_empty());
    }

    #[test]
    fn command_ids_are_bounded_names() {
        assert!(check_id("cmd_01a2-b").is_ok());
        for bad in ["", "a/b", "../x", "a\0b", &"x".repeat(ID_BYTES_MAX + 1)] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }
}
