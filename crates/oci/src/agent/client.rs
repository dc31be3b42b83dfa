//! The runner's side of the agent protocol (see [`super`]): connect to a
//! sandbox's agent, run or attach to a command, write its stdin, list and
//! forget commands. A command run here ends in the same [`Outcome`]s as
//! one run by the runtime's `exec` ([`crate::exec`]), told from a better
//! witness: the agent reports the process's own wait status, so "killed
//! by signal N" is no longer guessed from status 128 + N.

use std::os::fd::AsRawFd;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::wire::{self, kind};
use crate::error::{Error, Result};
use crate::exec::{CommandEnd, CommandSpec, Outcome, SIGNALS_QUEUED_MAX, Signaller, Stream};
use crate::runtime::Sandbox;
use crate::runtime::log::LaunchFailure;
use crate::signal::Signal;
use crate::spec;
use crate::state::Status;

/// The highest signal number Linux has (`SIGRTMAX`).
const SIGNAL_NUMBER_MAX: i64 = 64;

/// The most of an agent's refusal message kept (it goes into logs and
/// API errors).
const REFUSAL_MESSAGE_CHARS_MAX: usize = 1_000;

/// An `ERROR` frame's code and message, as the runner may repeat them: the
/// agent (which the sandbox's root may have replaced) chooses both, so a
/// code is a word of `a-z _` (else `bad_answer`) and the message is cut
/// short with its control characters escaped: no forged log lines, no
/// megabyte of log a refusal.
fn refusal_of(value: &serde_json::Value) -> (String, String) {
    let code = value["code"].as_str().unwrap_or("unknown");
    let code = if !code.is_empty()
        && code.len() <= 64
        && code.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
    {
        code
    } else {
        "bad_answer"
    };
    let message: String = value["message"]
        .as_str()
        .unwrap_or_default()
        .chars()
        .take(REFUSAL_MESSAGE_CHARS_MAX)
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect();
    (code.to_owned(), message)
}

/// How an `ENDED` frame says the command ended: its exit code, or the
/// signal that ended it. A signal is 1 to 64: anything else from the
/// agent (which the sandbox's root may have replaced) is no signal, so
/// `128 + signal` stays in range.
fn ended_of(value: &serde_json::Value) -> Option<Ended> {
    let code = value["exit_code"]
        .as_i64()
        .and_then(|c| i32::try_from(c).ok());
    let signal = value["signal"]
        .as_i64()
        .filter(|s| (1..=SIGNAL_NUMBER_MAX).contains(s))
        .and_then(|s| i32::try_from(s).ok());
    match (code, signal) {
        (Some(code), _) => Some(Ended::Exited(code)),
        (None, Some(signal)) => Some(Ended::Signaled(signal)),
        (None, None) => None,
    }
}

/// How long a connection to the agent may take: a sandbox whose init is
/// frozen or gone must not hang the runner.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an init that closed its agent's connections may still be
/// reported running by the runtime (dead, not yet reaped).
const INIT_GONE_GRACE: Duration = Duration::from_secs(5);

/// A command the agent knows, as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentCommand {
    pub id: String,
    /// Its pid inside the sandbox.
    pub pid: i32,
    pub running: bool,
    pub started_unix_ms: u64,
}

/// What the agent answered to a listing.
#[derive(Clone, Debug)]
pub struct Listing {
    pub incarnation: String,
    pub commands: Vec<AgentCommand>,
}

impl Sandbox {
    /// Whether this container was started with an agent (containers from
    /// before the agent existed run commands through the runtime's exec).
    pub fn has_agent(&self) -> bool {
        self.paths().bundle().join(super::SOCKET_NAME).exists()
    }

    pub(super) fn agent_error(&self, code: &str, message: impl Into<String>) -> Error {
        Error::Agent {
            id: self.id().to_string(),
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// A connection to the agent. The path is reached through the bundle
    /// directory's descriptor: a unix socket's path is bounded (108
    /// bytes) and data dirs may be long.
    pub(super) async fn connect_agent(&self) -> Result<UnixStream> {
        let bundle = self.paths().bundle();
        let directory = std::fs::File::open(&bundle).map_err(|e| Error::io("open", &bundle, e))?;
        let path = format!(
            "/proc/self/fd/{}/{}",
            directory.as_raw_fd(),
            super::SOCKET_NAME
        );
        match tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(&path)).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(self.agent_error("unreachable", e.to_string())),
            Err(_) => Err(self.agent_error("unreachable", "no answer within 5 s")),
        }
    }

    /// One request, one answer frame (listing, forget, stdin close).
    async fn agent_request(&self, first: u8, body: &Value) -> Result<Option<wire::Frame>> {
        let stream = self.connect_agent().await?;
        let (mut reader, mut writer) = stream.into_split();
        let unreachable = |e: std::io::Error| self.agent_error("unreachable", e.to_string());
        wire::write_json(&mut writer, first, body)
            .await
            .map_err(unreachable)?;
        let answer = tokio::time::timeout(CONNECT_TIMEOUT, wire::read_frame(&mut reader))
            .await
            .map_err(|_| self.agent_error("unreachable", "no answer within 5 s"))?
            .map_err(unreachable)?;
        match answer {
            Some(frame) if frame.kind == kind::ERROR => Err(self.refusal(&frame)),
            other => Ok(other),
        }
    }

    pub(super) fn refusal(&self, frame: &wire::Frame) -> Error {
        match frame.json() {
            Ok(value) => {
                let (code, message) = refusal_of(&value);
                self.agent_error(&code, message)
            }
            Err(e) => self.agent_error("bad_answer", e.to_string()),
        }
    }

    /// The commands the agent knows, and its incarnation.
    pub async fn agent_listing(&self) -> Result<Listing> {
        let answer = self.agent_request(kind::LIST, &json!({})).await?;
        let Some(frame) = answer.filter(|f| f.kind == kind::LISTING) else {
            return Err(self.agent_error("bad_answer", "no listing"));
        };
        let value = frame
            .json()
            .map_err(|e| self.agent_error("bad_answer", e.to_string()))?;
        // The incarnation is written into the runner's launch records: only
        // the agent's own form (hex) is taken, never a line of the agent's
        // choosing.
        let incarnation = value["incarnation"].as_str().unwrap_or_default();
        if !well_formed_incarnation(incarnation) {
            return Err(self.agent_error("bad_answer", "the listing's incarnation is malformed"));
        }
        let incarnation = incarnation.to_owned();
        let commands = value["commands"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|item| {
                        Some(AgentCommand {
                            id: item["id"].as_str()?.to_owned(),
                            pid: process_id(&item["pid"])?,
                            running: item["running"].as_bool()?,
                            started_unix_ms: item["started_unix_ms"].as_u64().unwrap_or(0),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(Listing {
            incarnation,
            commands,
        })
    }

    /// Sets the size of command `id`'s terminal.
    pub async fn agent_resize(&self, id: &str, rows: u16, cols: u16) -> Result<()> {
        let body = json!({"id": id, "rows": rows, "cols": cols});
        self.agent_request(kind::RESIZE, &body).await?;
        Ok(())
    }

    /// Tells the agent the runner recorded `id`'s end.
    pub async fn agent_forget(&self, id: &str) -> Result<()> {
        self.agent_request(kind::FORGET, &json!({"id": id})).await?;
        Ok(())
    }

    /// Runs `command` as `id` through the agent of `incarnation`, or
    /// attaches to it if the agent already knows it, reading its output
    /// from `from` (stdout, stderr). A command that could not start comes
    /// back too: its [`AgentExecution::wait`] tells
    /// [`Outcome::LaunchFailed`].
    pub async fn run_in_agent(
        &self,
        id: &str,
        incarnation: &str,
        command: &CommandSpec,
        from: [u64; 2],
    ) -> Result<AgentExecution> {
        let process = self.command_process(command)?;
        let env: Vec<String> = process.env().clone().unwrap_or_default();
        let request = json!({
            "id": id,
            "incarnation": incarnation,
            "argv": command.argv,
            "env": env,
            "cwd": process.cwd().to_string_lossy(),
            "stdin": command.stdin,
            "tty": command.tty.map(|(rows, cols)| json!({"rows": rows, "cols": cols})),
            "stdout_from": from[0],
            "stderr_from": from[1],
        });
        let oom_before = self.cgroup_counters().oom_kills.unwrap_or(0);
        let stream = match self.connect_agent().await {
            Ok(stream) => stream,
            Err(err) => return self.unless_stopped(err, command).await,
        };
        let (mut reader, mut writer) = stream.into_split();
        let unreachable = |e: std::io::Error| self.agent_error("unreachable", e.to_string());
        wire::write_json(&mut writer, kind::RUN, &request)
            .await
            .map_err(unreachable)?;
        let answer = tokio::time::timeout(CONNECT_TIMEOUT, wire::read_frame(&mut reader))
            .await
            .map_err(|_| self.agent_error("unreachable", "no answer within 5 s"))?
            .map_err(unreachable)?
            .ok_or_else(|| self.agent_error("unreachable", "the agent closed the connection"))?;
        let mut execution = self.execution(Some((reader, writer)), command);
        execution.oom_before = oom_before;
        let value = answer
            .json()
            .map_err(|e| self.agent_error("bad_answer", e.to_string()))?;
        execution.received = from;
        match answer.kind {
            kind::STARTED => {
                execution.pid = process_id(&value["pid"]);
                execution.fresh = value["fresh"].as_bool().unwrap_or(false);
                // Attached again: the timeout counts from the launch (a
                // start in the future is the sandbox's lie, read as now).
                let age_ms =
                    unix_ms().saturating_sub(value["started_unix_ms"].as_u64().unwrap_or(0));
                let started = Instant::now()
                    .checked_sub(Duration::from_millis(age_ms))
                    .unwrap_or_else(Instant::now);
                execution.started = started;
                execution.timeout_at = command.timeout.map(|t| started + t);
            }
            kind::LAUNCH_FAILED => {
                let failure = match value["failure"].as_str() {
                    Some("bad_cwd") => LaunchFailure::BadCwd,
                    Some("missing_executable") => LaunchFailure::MissingExecutable,
                    Some("permission_denied") => LaunchFailure::PermissionDenied,
                    _ => LaunchFailure::RuntimeRefused,
                };
                let message = value["message"].as_str().unwrap_or_default();
                execution.launch_failure = Some(Outcome::LaunchFailed {
                    failure,
                    message: message.chars().take(1000).collect(),
                });
            }
            kind::ERROR => return Err(self.refusal(&answer)),
            other => {
                return Err(self.agent_error("bad_answer", format!("frame kind {other}")));
            }
        }
        Ok(execution)
    }

    fn execution(
        &self,
        connection: Option<(OwnedReadHalf, OwnedWriteHalf)>,
        command: &CommandSpec,
    ) -> AgentExecution {
        let (sender, signals) = mpsc::channel(SIGNALS_QUEUED_MAX);
        AgentExecution {
            sandbox: self.clone(),
            connection,
            pid: None,
            fresh: false,
            launch_failure: None,
            signals,
            signaller: Signaller::from_sender(sender),
            timeout_at: None,
            kill_grace: command.kill_grace,
            oom_before: 0,
            started: Instant::now(),
            received: [0, 0],
            forget: None,
        }
    }

    /// A command refused for want of a running sandbox: the agent cannot
    /// be reached because the init is gone. Any other failure stays one.
    pub(crate) async fn unless_stopped(
        &self,
        err: Error,
        command: &CommandSpec,
    ) -> Result<AgentExecution> {
        let unreachable = matches!(&err, Error::Agent { code, .. } if code == "unreachable");
        let running = matches!(
            self.state().await,
            Ok(Some(state)) if matches!(state.status, Status::Running | Status::Paused)
        );
        if !unreachable || running {
            return Err(err);
        }
        let mut execution = self.execution(None, command);
        execution.launch_failure = Some(Outcome::LaunchFailed {
            failure: LaunchFailure::SandboxNotRunning,
            message: format!("sandbox {} is not running: {err}", self.id()),
        });
        Ok(execution)
    }

    /// The command's process as the runtime's exec would have run it:
    /// the sandbox's env under the command's, and its cwd.
    fn command_process(&self, command: &CommandSpec) -> Result<oci_spec::runtime::Process> {
        let config_json = self.paths().config_json();
        let loaded = oci_spec::runtime::Spec::load(&config_json).map_err(|e| Error::Spec {
            id: self.id().to_string(),
            message: format!("reading {}: {e}", config_json.display()),
        })?;
        let base = loaded.process().as_ref().ok_or_else(|| Error::Spec {
            id: self.id().to_string(),
            message: format!("{} has no process", config_json.display()),
        })?;
        spec::exec_process(base, &command.argv, &command.env, command.cwd.as_deref())
    }

    /// Opens the stdin of command `id`: bytes written go to it in order.
    pub async fn agent_stdin(&self, id: &str) -> Result<AgentStdin> {
        let stream = self.connect_agent().await?;
        let (mut reader, mut writer) = stream.into_split();
        let unreachable = |e: std::io::Error| self.agent_error("unreachable", e.to_string());
        wire::write_json(&mut writer, kind::STDIN_OPEN, &json!({"id": id}))
            .await
            .map_err(unreachable)?;
        match tokio::time::timeout(CONNECT_TIMEOUT, wire::read_frame(&mut reader)).await {
            Ok(Ok(Some(frame))) if frame.kind == kind::OK => {}
            Ok(Ok(Some(frame))) if frame.kind == kind::ERROR => return Err(self.refusal(&frame)),
            Ok(Ok(_)) => return Err(self.agent_error("bad_answer", "no answer to open")),
            Ok(Err(e)) => return Err(unreachable(e)),
            Err(_) => return Err(self.agent_error("unreachable", "no answer within 5 s")),
        }
        Ok(AgentStdin {
            sandbox: self.clone(),
            reader,
            writer,
        })
    }
}

/// A command's stdin through the agent.
pub struct AgentStdin {
    sandbox: Sandbox,
    reader: OwnedReadHalf,
    writer: OwnedWriteHalf,
}

impl AgentStdin {
    /// Writes `bytes` (in frames of at most the protocol's bound); waits
    /// while the command does not read (back-pressure).
    pub async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        for chunk in bytes.chunks(wire::FRAME_BYTES_MAX) {
            if let Err(e) = wire::write_frame(&mut self.writer, kind::STDIN_DATA, chunk).await {
                return Err(self.refused_or(e).await);
            }
        }
        Ok(())
    }

    /// Closes the stdin (the command reads end of file) and waits for the
    /// agent to confirm.
    pub async fn close(mut self) -> Result<()> {
        if let Err(e) = wire::write_frame(&mut self.writer, kind::STDIN_CLOSE, b"").await {
            return Err(self.refused_or(e).await);
        }
        match wire::read_frame(&mut self.reader).await {
            Ok(Some(frame)) if frame.kind == kind::OK => Ok(()),
            Ok(Some(frame)) if frame.kind == kind::ERROR => Err(self.sandbox.refusal(&frame)),
            Ok(_) => Err(self
                .sandbox
                .agent_error("unreachable", "no answer to close")),
            Err(e) => Err(self.sandbox.agent_error("unreachable", e.to_string())),
        }
    }

    /// The agent's own refusal when it sent one before closing, else the
    /// write's error.
    async fn refused_or(&mut self, err: std::io::Error) -> Error {
        match tokio::time::timeout(Duration::from_secs(1), wire::read_frame(&mut self.reader)).await
        {
            Ok(Ok(Some(frame))) if frame.kind == kind::ERROR => self.sandbox.refusal(&frame),
            _ => self.sandbox.agent_error("unreachable", err.to_string()),
        }
    }
}

/// A process id as the agent reported it: positive, or none (0 and the
/// negative ones name process groups or nothing; the records refuse them).
fn process_id(value: &Value) -> Option<i32> {
    value
        .as_i64()
        .and_then(|pid| i32::try_from(pid).ok())
        .filter(|pid| *pid > 0)
}

/// What an agent's incarnation looks like (`Agent::new`: hex, or a pid and
/// a time joined by `-`), at most 64 bytes: nothing that could end a line
/// of a launch record or add one.
fn well_formed_incarnation(incarnation: &str) -> bool {
    !incarnation.is_empty()
        && incarnation.len() <= 64
        && incarnation
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A command running in the agent; [`AgentExecution::wait`] drives it to
/// its end. Dropped unfinished, the command runs on (the agent holds it:
/// a later [`Sandbox::run_in_agent`] attaches again).
#[derive(Debug)]
pub struct AgentExecution {
    sandbox: Sandbox,
    /// `None` only for a command that never started (`launch_failure`).
    connection: Option<(OwnedReadHalf, OwnedWriteHalf)>,
    pid: Option<i32>,
    fresh: bool,
    launch_failure: Option<Outcome>,
    signals: mpsc::Receiver<Signal>,
    signaller: Signaller,
    timeout_at: Option<Instant>,
    kill_grace: Duration,
    oom_before: u64,
    started: Instant,
    received: [u64; 2],
    /// Forget the command in the agent once it ended (nobody will attach
    /// to it again): the id.
    forget: Option<String>,
}

enum Event {
    Frame(std::io::Result<Option<wire::Frame>>),
    Signal(Option<Signal>),
    Timer,
}

/// How the agent said the process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    Exited(i32),
    Signaled(i32),
}

impl AgentExecution {
    /// The command's pid inside the sandbox (none when it never started).
    pub fn pid(&self) -> Option<i32> {
        self.pid
    }

    /// Has the agent forget the command once it ended.
    pub fn forget_at_end(&mut self, id: String) {
        self.forget = Some(id);
    }

    /// Whether this request started the command (not an attach).
    pub fn fresh(&self) -> bool {
        self.fresh
    }

    pub fn signaller(&self) -> Signaller {
        self.signaller.clone()
    }

    /// Streams output to `on_output` (every chunk before this returns,
    /// each acknowledged to the agent once `on_output` returned), delivers
    /// signals, enforces the timeout, and tells the [`Outcome`].
    pub async fn wait(mut self, mut on_output: impl FnMut(Stream, &[u8])) -> Result<CommandEnd> {
        if let Some(outcome) = self.launch_failure.take() {
            return Ok(CommandEnd {
                outcome,
                runtime_status: None,
                elapsed: self.started.elapsed(),
            });
        }
        let Some((reader, mut writer)) = self.connection.take() else {
            return Err(self.sandbox.agent_error("unreachable", "no connection"));
        };
        // Read in a `select!` with signals and timers: a frame half read
        // when one of them fires must be kept, not dropped.
        let mut reader = wire::FrameReader::new(reader);
        let mut timed_out = false;
        let mut kill_at: Option<Instant> = None;
        let mut delivered: Vec<Signal> = Vec::new();
        let mut signals_open = true;
        let status = loop {
            let next_timer = [self.timeout_at.filter(|_| !timed_out), kill_at]
                .into_iter()
                .flatten()
                .min();
            let event = tokio::select! {
                frame = reader.next() => Event::Frame(frame),
                signal = self.signals.recv(), if signals_open => Event::Signal(signal),
                () = sleep_until(next_timer), if next_timer.is_some() => Event::Timer,
            };
            let mut send: Option<Signal> = None;
            match event {
                Event::Frame(Ok(Some(frame))) => match frame.kind {
                    kind::STDOUT | kind::STDERR => {
                        let (stream, i) = if frame.kind == kind::STDOUT {
                            (Stream::Stdout, 0)
                        } else {
                            (Stream::Stderr, 1)
                        };
                        on_output(stream, &frame.payload);
                        self.received[i] += frame.payload.len() as u64;
                        // One ack for every frame a read brought (it says
                        // all received so far), not one per frame: an
                        // agent sending tiny frames would have the runner
                        // build and write an ack for each.
                        if !reader.holds_a_frame() {
                            let ack =
                                json!({"stdout": self.received[0], "stderr": self.received[1]});
                            // A lost ack only keeps bytes in the agent longer.
                            let _ = wire::write_json(&mut writer, kind::ACK, &ack).await;
                        }
                    }
                    kind::ENDED => {
                        break ended_of(&frame.json().unwrap_or_default());
                    }
                    kind::ERROR => return Err(self.sandbox.refusal(&frame)),
                    other => {
                        return Err(self
                            .sandbox
                            .agent_error("bad_answer", format!("frame kind {other}")));
                    }
                },
                // The agent went away before the end: its init ended.
                Event::Frame(Ok(None) | Err(_)) => break None,
                Event::Signal(Some(signal)) => {
                    delivered.push(signal);
                    send = Some(signal);
                }
                Event::Signal(None) => signals_open = false,
                Event::Timer => {
                    let now = Instant::now();
                    if !timed_out && self.timeout_at.is_some_and(|at| now >= at) {
                        timed_out = true;
                        send = Some(Signal::Term);
                        kill_at = Some(now + self.kill_grace);
                    } else if kill_at.is_some_and(|at| now >= at) {
                        kill_at = None;
                        send = Some(Signal::Kill);
                    }
                }
            }
            if let Some(signal) = send {
                let body = json!({"signal": signal.number()});
                let _ = wire::write_json(&mut writer, kind::SIGNAL, &body).await;
            }
        };
        drop((reader, writer));
        let elapsed = self.started.elapsed();
        let runtime_status = match status {
            Some(Ended::Exited(code)) => Some(code),
            Some(Ended::Signaled(signal)) => Some(128 + signal),
            None => None,
        };
        let outcome = self.classify(status, timed_out, &delivered).await?;
        if let Some(id) = self.forget.take() {
            let _ = self.sandbox.agent_forget(&id).await;
        }
        Ok(CommandEnd {
            outcome,
            runtime_status,
            elapsed,
        })
    }

    async fn classify(
        &self,
        status: Option<Ended>,
        timed_out: bool,
        delivered: &[Signal],
    ) -> Result<Outcome> {
        let alive = || async {
            matches!(
                self.sandbox.state().await,
                Ok(Some(state)) if matches!(state.status, Status::Running | Status::Paused)
            )
        };
        let oom_rose = || self.sandbox.cgroup_counters().oom_kills.unwrap_or(0) > self.oom_before;
        let Some(status) = status else {
            // No end from the agent: its init is gone (a stop or a death
            // killed every process), or something killed the agent alone.
            // The runtime may still call a just-dead init running for a
            // moment (until it is reaped): look again before concluding.
            let deadline = Instant::now() + INIT_GONE_GRACE;
            while alive().await {
                if Instant::now() >= deadline {
                    return Err(self.sandbox.agent_error(
                        "unreachable",
                        "the agent closed the connection before the command ended",
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if timed_out {
                return Ok(Outcome::TimedOut);
            }
            return Ok(if oom_rose() {
                Outcome::ResourceExhausted
            } else {
                Outcome::Interrupted {
                    signal: Signal::Kill,
                }
            });
        };
        if timed_out {
            return Ok(Outcome::TimedOut);
        }
        match status {
            Ended::Exited(code) => {
                // A shell reporting its child's SIGKILL while the count rose.
                if code == 128 + Signal::Kill.number() && oom_rose() {
                    return Ok(Outcome::ResourceExhausted);
                }
                Ok(Outcome::Exited { code })
            }
            Ended::Signaled(number) => {
                if let Some(signal) = delivered.iter().rev().find(|s| s.number() == number) {
                    return Ok(Outcome::Interrupted { signal: *signal });
                }
                if number == Signal::Kill.number() {
                    if oom_rose() {
                        return Ok(Outcome::ResourceExhausted);
                    }
                    if !alive().await {
                        return Ok(Outcome::Interrupted {
                            signal: Signal::Kill,
                        });
                    }
                }
                Ok(Outcome::Exited { code: 128 + number })
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
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

    /// Audit finding: a signal number from the agent went into `128 +
    /// signal` unchecked: a forged one overflowed (a panic in a debug
    /// build) or made up an exit code (`-128` read as 0).
    /// Audit finding: an agent's refusal went into logs and errors as it
    /// came: up to a megabyte, newlines and all (a forged log line naming
    /// another sandbox), with a code of its choosing.
    #[test]
    fn an_agents_refusal_is_a_word_and_a_short_line() {
        let (code, message) = refusal_of(&json!({"code": "not_found", "message": "no such file"}));
        assert_eq!(
            (code.as_str(), message.as_str()),
            ("not_found", "no such file")
        );
        let (code, message) = refusal_of(&json!({
            "code": "x\nlevel=ERROR sandbox_id=sbx_other",
            "message": format!("gone\n{{\"level\":\"ERROR\"}}{}", "a".repeat(1 << 20)),
        }));
        assert_eq!(code, "bad_answer");
        assert!(!message.contains('\n'), "{}", &message[..40]);
        assert!(message.starts_with("gone\\n"), "{}", &message[..40]);
        assert!(message.chars().count() <= REFUSAL_MESSAGE_CHARS_MAX + 8);
    }

    #[test]
    fn an_end_by_a_signal_past_linuxs_is_no_signal() {
        let ended = |value: serde_json::Value| ended_of(&value);
        assert_eq!(ended(json!({"signal": 9})), Some(Ended::Signaled(9)));
        assert_eq!(ended(json!({"exit_code": 3})), Some(Ended::Exited(3)));
        for forged in [0, -128, 65, i64::from(i32::MAX), i64::MAX] {
            assert_eq!(ended(json!({ "signal": forged })), None, "{forged}");
        }
    }

    #[test]
    fn only_the_agents_own_forms_of_incarnation_and_pid_are_taken() {
        assert!(well_formed_incarnation("0123456789abcdef0123456789abcdef"));
        assert!(well_formed_incarnation("41-1765000000000"));
        for lie in [
            "",
            "x\nend not_launched - - sandbox_not_running",
            "a b",
            "x\r",
            &"a".repeat(65),
        ] {
            assert!(!well_formed_incarnation(lie), "{lie:?}");
        }
        assert_eq!(process_id(&json!(42)), Some(42));
        for lie in [
            json!(0),
            json!(-1),
            json!(i64::MAX),
            json!("42"),
            json!(null),
        ] {
            assert_eq!(process_id(&lie), None, "{lie}");
        }
    }
}
