//! Commands in a running sandbox: `RUNTIME exec --process=process.json`,
//! output streamed to the caller while it runs, a timeout, signals, and one
//! honest [`Outcome`] per command.
//!
//! # How an end is told
//!
//! The runtime's `exec` waits for the command's process and exits with its
//! status (128 + N when signal N killed it: the runtime cannot tell "killed
//! by SIGKILL" from "exited 137", and neither can this layer). What it
//! reports about itself goes to a JSON log of its own (`--log`), apart from
//! the command's stderr, and it writes the process's host pid to a file
//! (`--pid-file`) once the process exists. So:
//!
//! 1. the runtime logged an error → [`Outcome::LaunchFailed`] with its
//!    message (runc: `exec failed: unable to start container process: exec:
//!    "x": executable file not found in $PATH`, status 255; a bad cwd:
//!    `chdir to cwd ("/x") set in config.json failed`) and the
//!    [`LaunchFailure`] those words mean. A program that exits 127 or 255
//!    itself logs nothing and is [`Outcome::Exited`];
//! 2. the timeout fired (SIGTERM, then SIGKILL after the grace) →
//!    [`Outcome::TimedOut`], however the process then ended;
//! 3. a signal sent through [`Signaller`] killed it (status 128 + that
//!    signal) → [`Outcome::Interrupted`]; a program that catches the signal
//!    and exits on its own terms is [`Outcome::Exited`] with its code;
//! 4. status 137 and the sandbox's memory cgroup counted an OOM kill while
//!    it ran → [`Outcome::ResourceExhausted`] (a shell reporting its child's
//!    SIGKILL counts too: `sh -c 'big | tail'` exits 137);
//! 5. status 137 and the sandbox's init is gone (a stop, or an out-of-band
//!    death, killed every process) → [`Outcome::Interrupted`] with SIGKILL;
//! 6. otherwise → [`Outcome::Exited`] with the status.
//!
//! # What an end does not prove
//!
//! The command's end is its first process's end. Processes it started in
//! the background may live on (they are the sandbox's now, re-parented to
//! its init), and may still hold its stdout or stderr open: output is read
//! until both close or [`OUTPUT_DRAIN_MS`] after the end, whichever is
//! first. Timeouts and signals go to the command's process group (the
//! runtime makes the process a session leader), so children that stayed in
//! the group get them too, and children that started their own session
//! (daemons) do not. When several commands run at once an OOM kill cannot
//! be pinned to one of them: each that ended with status 137 while the
//! count rose is reported as having hit the limit.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use oci_spec::runtime::Spec;
use rustix::process::Pid;
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::agent::client::AgentExecution;
use crate::error::{Error, Result};
use crate::host::{read_lossy, write_file};
use crate::runtime::Sandbox;
use crate::runtime::log::{LaunchFailure, runtime_errors};
use crate::signal::Signal;
use crate::spec;
use crate::state::Status;

/// How long output is still read after the command's process ended, for
/// background processes that keep its pipes open.
pub const OUTPUT_DRAIN_MS: u64 = 500;
/// Size of one output read; also the largest chunk handed to the caller.
pub const OUTPUT_CHUNK_BYTES_MAX: usize = 64 * 1024;
/// Default wait between the timeout's SIGTERM and its SIGKILL.
pub const KILL_GRACE_MS_DEFAULT: u64 = 10_000;
/// How often to look for the runtime's pid file while a signal waits for
/// the process to exist.
const PID_POLL_MS: u64 = 10;

/// A command to run.
#[derive(Clone, Debug, PartialEq)]
pub struct CommandSpec {
    pub argv: Vec<String>,
    /// On top of the sandbox's env (which is on top of `PATH` and `HOME`).
    pub env: BTreeMap<String, String>,
    /// Absolute; default `/workspace`.
    pub cwd: Option<String>,
    pub timeout: Option<Duration>,
    /// After the timeout's SIGTERM, SIGKILL follows this much later.
    pub kill_grace: Duration,
    /// Where the command's scratch files go (its `process.json`, which
    /// holds its whole env); `None`: the bundle. A caller whose env
    /// carries secrets points it at a tmpfs, so no value reaches a disk.
    pub scratch_dir: Option<std::path::PathBuf>,
    /// Whether the command reads a stdin the caller writes (through the
    /// agent, [`crate::runtime::Sandbox::agent_stdin`]); else `/dev/null`.
    pub stdin: bool,
    /// A terminal of this many rows and columns (through the agent only):
    /// the command's stdin, stdout and stderr, one output stream.
    pub tty: Option<(u16, u16)>,
}

impl CommandSpec {
    pub fn new(argv: impl IntoIterator<Item = impl Into<String>>) -> Self {
        CommandSpec {
            argv: argv.into_iter().map(Into::into).collect(),
            env: BTreeMap::new(),
            cwd: None,
            timeout: None,
            kill_grace: Duration::from_millis(KILL_GRACE_MS_DEFAULT),
            scratch_dir: None,
            stdin: false,
            tty: None,
        }
    }
}

/// Which stream a chunk of output came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// How a command ended: exactly one of these (DESIGN.md §4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The program ended; the code is its own (or 128 + N when signal N
    /// killed it and nothing above explains the signal).
    Exited { code: i32 },
    /// Its timeout passed and its processes were asked to end.
    TimedOut,
    /// It was killed while the sandbox's memory cgroup counted an OOM kill.
    ResourceExhausted,
    /// A signal sent through the API ended it, or the sandbox stopping did.
    Interrupted { signal: Signal },
    /// It never started: `failure` says why (read once, here, from the
    /// runtime's words), `message` is what the runtime said.
    LaunchFailed {
        failure: LaunchFailure,
        message: String,
    },
}

impl Outcome {
    /// The command state it is reported as.
    pub fn state(&self) -> &'static str {
        match self {
            Outcome::Exited { .. } => "exited",
            Outcome::TimedOut => "timed_out",
            Outcome::ResourceExhausted => "resource_exhausted",
            Outcome::Interrupted { .. } => "interrupted",
            Outcome::LaunchFailed { .. } => "launch_failed",
        }
    }
}

/// A command's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandEnd {
    pub outcome: Outcome,
    /// The exit status as a shell shows it (128 + N for signal N): the
    /// agent's wait status, or the runtime exec's own status.
    pub runtime_status: Option<i32>,
    pub elapsed: Duration,
}

/// Signals waiting for [`Execution::wait`] to deliver them; more are
/// refused (a caller repeating a signal faster than it is delivered gains
/// nothing).
pub const SIGNALS_QUEUED_MAX: usize = 16;

/// Sends signals to a running command from anywhere. A signal sent before
/// the process exists is delivered as soon as it does.
#[derive(Clone, Debug)]
pub struct Signaller {
    sender: mpsc::Sender<Signal>,
}

impl Signaller {
    /// A signaller and the queue it fills, for a command that is not an
    /// [`Execution`] (a test's fake): the receiver sees what was sent.
    pub fn channel() -> (Signaller, mpsc::Receiver<Signal>) {
        let (sender, receiver) = mpsc::channel(SIGNALS_QUEUED_MAX);
        (Signaller { sender }, receiver)
    }

    pub(crate) fn from_sender(sender: mpsc::Sender<Signal>) -> Signaller {
        Signaller { sender }
    }

    /// Queues `signal` for delivery. Returns false when the command has
    /// already ended (or [`SIGNALS_QUEUED_MAX`] signals are still waiting).
    pub fn send(&self, signal: Signal) -> bool {
        self.sender.try_send(signal).is_ok()
    }
}

/// A command that is running, through the sandbox's agent (every sandbox
/// this crate creates has one) or, for a container started without one,
/// through the runtime's exec; [`Execution::wait`] drives it to its end.
#[derive(Debug)]
pub enum Execution {
    Agent(AgentExecution),
    Runtime(RuntimeExecution),
}

impl Execution {
    /// A handle to signal the command while [`Execution::wait`] runs.
    pub fn signaller(&self) -> Signaller {
        match self {
            Execution::Agent(execution) => execution.signaller(),
            Execution::Runtime(execution) => execution.signaller(),
        }
    }

    /// The command's pid inside the sandbox, when the agent runs it.
    pub fn pid(&self) -> Option<i32> {
        match self {
            Execution::Agent(execution) => execution.pid(),
            Execution::Runtime(_) => None,
        }
    }

    /// Drives the command to its end: streams output to `on_output` as it
    /// comes (every chunk before this returns), delivers signals, enforces
    /// the timeout, and tells the [`Outcome`].
    pub async fn wait(self, on_output: impl FnMut(Stream, &[u8])) -> Result<CommandEnd> {
        match self {
            Execution::Agent(execution) => execution.wait(on_output).await,
            Execution::Runtime(execution) => execution.wait(on_output).await,
        }
    }
}

/// A command run by the runtime's exec (`RUNTIME exec`): the fallback for
/// containers started without an agent. Dropping it unfinished kills the
/// command's process group.
#[derive(Debug)]
pub struct RuntimeExecution {
    sandbox: Sandbox,
    child: tokio::process::Child,
    signals: mpsc::Receiver<Signal>,
    signaller: Signaller,
    scratch: Scratch,
    target: Option<Target>,
    timeout: Option<Duration>,
    kill_grace: Duration,
    oom_before: u64,
    started: Instant,
    finished: bool,
}

/// The per-command files: process.json, the pid file, the runtime's log.
#[derive(Debug)]
struct Scratch {
    process: PathBuf,
    pid: PathBuf,
    log: PathBuf,
}

impl Scratch {
    fn remove(&self) {
        for path in [&self.process, &self.pid, &self.log] {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Where signals go: the process group when the process leads one (runc
/// makes it a session leader), else the process alone. Never a group the
/// runner itself is in.
#[derive(Debug, Clone, Copy)]
struct Target {
    pid: Pid,
    group: bool,
}

impl Target {
    fn find(pid_file: &std::path::Path) -> Option<Target> {
        let text = std::fs::read_to_string(pid_file).ok()?;
        let pid = Pid::from_raw(text.trim().parse().ok()?)?;
        // Field 5 of /proc/PID/stat is the process group (host numbering).
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_pid())).ok();
        let group = stat
            .as_deref()
            .and_then(|s| s.rsplit_once(')'))
            .and_then(|(_, rest)| rest.split_whitespace().nth(2))
            .and_then(|pgrp| pgrp.parse::<i32>().ok())
            == Some(pid.as_raw_pid());
        Some(Target { pid, group })
    }

    fn send(self, signal: Signal) {
        let signal = signal.to_rustix();
        // ESRCH: it ended meanwhile; the runtime's exit tells the rest.
        let _ = if self.group {
            rustix::process::kill_process_group(self.pid, signal)
        } else {
            rustix::process::kill_process(self.pid, signal)
        };
    }
}

/// Why a signal is being sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Caller,
    Timeout,
}

static EXEC_SEQUENCE: AtomicU64 = AtomicU64::new(0);

static ANONYMOUS_SEQUENCE: AtomicU64 = AtomicU64::new(0);

impl Sandbox {
    /// Starts `command` in the sandbox. Refused with [`Error::NotRunning`]
    /// (the command was never launched) unless the sandbox is running.
    pub async fn exec(&self, command: &CommandSpec) -> Result<Execution> {
        match self.state().await? {
            None => {
                return Err(Error::NotFound {
                    id: self.id.to_string(),
                });
            }
            Some(state) if state.status != Status::Running => {
                return Err(Error::NotRunning {
                    id: self.id.to_string(),
                    status: state.status,
                    op: "exec",
                });
            }
            Some(_) => {}
        }
        self.exec_seen_running(command).await
    }

    /// [`Sandbox::exec`] without asking the runtime first, for a caller
    /// that has just seen the sandbox running. Through the agent when the
    /// container has one (the command is forgotten by the agent once it
    /// ended: nobody attaches to it again), else the runtime's exec.
    pub async fn exec_seen_running(&self, command: &CommandSpec) -> Result<Execution> {
        if !self.has_agent() {
            return Ok(Execution::Runtime(self.exec_with_runtime(command).await?));
        }
        let listing = match self.agent_listing().await {
            Ok(listing) => listing,
            // The init is gone (stopped): refused like the runtime's exec.
            Err(err) => return Ok(Execution::Agent(self.unless_stopped(err, command).await?)),
        };
        let id = format!(
            "anon-{}-{}",
            std::process::id(),
            ANONYMOUS_SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        let mut execution = self
            .run_in_agent(&id, &listing.incarnation, command, [0, 0])
            .await?;
        execution.forget_at_end(id);
        Ok(Execution::Agent(execution))
    }

    /// Runs `command` through the runtime's exec (`RUNTIME exec
    /// --process=…`), the documented fallback: two runtime process starts
    /// per command. Should the sandbox not be running, the runtime's exec
    /// fails and the command ends [`Outcome::LaunchFailed`] with the
    /// runtime's message.
    pub async fn exec_with_runtime(&self, command: &CommandSpec) -> Result<RuntimeExecution> {
        let config_json = self.paths.config_json();
        let spec = Spec::load(&config_json).map_err(|e| Error::Spec {
            id: self.id.to_string(),
            message: format!("reading {}: {e}", config_json.display()),
        })?;
        let base = spec.process().as_ref().ok_or_else(|| Error::Spec {
            id: self.id.to_string(),
            message: format!("{} has no process", config_json.display()),
        })?;
        let process =
            spec::exec_process(base, &command.argv, &command.env, command.cwd.as_deref())?;

        let dir = command
            .scratch_dir
            .clone()
            .unwrap_or_else(|| self.paths.exec_dir());
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        let name = format!(
            "{}-{}",
            std::process::id(),
            EXEC_SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        let scratch = Scratch {
            process: dir.join(format!("{name}.process.json")),
            pid: dir.join(format!("{name}.pid")),
            log: dir.join(format!("{name}.runtime.log")),
        };
        let json = serde_json::to_vec(&process).map_err(|e| Error::Spec {
            id: self.id.to_string(),
            message: e.to_string(),
        })?;
        write_file(&scratch.process, &json)?;

        let oom_before = self.cgroup_counters().oom_kills.unwrap_or(0);
        let mut process_flag = std::ffi::OsString::from("--process=");
        process_flag.push(&scratch.process);
        let mut pid_flag = std::ffi::OsString::from("--pid-file=");
        pid_flag.push(&scratch.pid);
        let started = Instant::now();
        let child = self
            .runtime
            .command(Some(&scratch.log))
            .arg("exec")
            .arg(process_flag)
            .arg(pid_flag)
            .arg(self.id.as_str())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| {
                scratch.remove();
                Error::Spawn {
                    runtime: self.runtime.kind().name(),
                    op: "exec",
                    id: self.id.to_string(),
                    source,
                }
            })?;
        let (sender, signals) = mpsc::channel(SIGNALS_QUEUED_MAX);
        Ok(RuntimeExecution {
            sandbox: self.clone(),
            child,
            signals,
            signaller: Signaller { sender },
            scratch,
            target: None,
            timeout: command.timeout,
            kill_grace: command.kill_grace,
            oom_before,
            started,
            finished: false,
        })
    }

    /// Runs `command` to its end, handing output chunks to `on_output`.
    pub async fn run(
        &self,
        command: &CommandSpec,
        on_output: impl FnMut(Stream, &[u8]),
    ) -> Result<CommandEnd> {
        self.exec(command).await?.wait(on_output).await
    }
}

enum Event {
    Exited(std::io::Result<std::process::ExitStatus>),
    Output(Stream, std::io::Result<usize>),
    Signal(Option<Signal>),
    Timer,
}

async fn read_from<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut Option<R>,
    buffer: &mut [u8],
) -> std::io::Result<usize> {
    match reader {
        Some(reader) => reader.read(buffer).await,
        None => std::future::pending().await,
    }
}

impl RuntimeExecution {
    /// A handle to signal the command while [`RuntimeExecution::wait`] runs.
    pub fn signaller(&self) -> Signaller {
        self.signaller.clone()
    }

    /// Drives the command to its end: streams output to `on_output` as it
    /// comes (every chunk before this returns), delivers signals, enforces
    /// the timeout, and tells the [`Outcome`].
    pub async fn wait(mut self, mut on_output: impl FnMut(Stream, &[u8])) -> Result<CommandEnd> {
        let mut stdout = self.child.stdout.take();
        let mut stderr = self.child.stderr.take();
        let mut stdout_buffer = vec![0u8; OUTPUT_CHUNK_BYTES_MAX];
        let mut stderr_buffer = vec![0u8; OUTPUT_CHUNK_BYTES_MAX];
        let timeout_at = self.timeout.map(|t| self.started + t);
        let mut kill_at: Option<Instant> = None;
        let mut timed_out = false;
        let mut pending: Vec<(Signal, Origin)> = Vec::new();
        let mut delivered: Vec<Signal> = Vec::new();
        let mut signals_open = true;

        let status = loop {
            if self.target.is_none() {
                self.target = Target::find(&self.scratch.pid);
            }
            if let Some(target) = self.target {
                for (signal, origin) in pending.drain(..) {
                    target.send(signal);
                    if origin == Origin::Caller {
                        delivered.push(signal);
                    }
                }
            }
            let now = Instant::now();
            let mut next_timer = [
                timeout_at.filter(|_| !timed_out),
                kill_at,
                (!pending.is_empty()).then(|| now + Duration::from_millis(PID_POLL_MS)),
            ]
            .into_iter()
            .flatten()
            .min();
            if let Some(at) = next_timer {
                next_timer = Some(at.max(now));
            }

            let event = tokio::select! {
                status = self.child.wait() => Event::Exited(status),
                read = read_from(&mut stdout, &mut stdout_buffer), if stdout.is_some() => {
                    Event::Output(Stream::Stdout, read)
                }
                read = read_from(&mut stderr, &mut stderr_buffer), if stderr.is_some() => {
                    Event::Output(Stream::Stderr, read)
                }
                signal = self.signals.recv(), if signals_open => Event::Signal(signal),
                () = sleep_until(next_timer), if next_timer.is_some() => Event::Timer,
            };
            match event {
                Event::Exited(status) => break status,
                Event::Output(stream, Ok(0) | Err(_)) => match stream {
                    Stream::Stdout => stdout = None,
                    Stream::Stderr => stderr = None,
                },
                Event::Output(Stream::Stdout, Ok(n)) => {
                    on_output(Stream::Stdout, &stdout_buffer[..n])
                }
                Event::Output(Stream::Stderr, Ok(n)) => {
                    on_output(Stream::Stderr, &stderr_buffer[..n])
                }
                Event::Signal(Some(signal)) => pending.push((signal, Origin::Caller)),
                Event::Signal(None) => signals_open = false,
                Event::Timer => {
                    let now = Instant::now();
                    if !timed_out && timeout_at.is_some_and(|at| now >= at) {
                        timed_out = true;
                        pending.push((Signal::Term, Origin::Timeout));
                        kill_at = Some(now + self.kill_grace);
                    } else if kill_at.is_some_and(|at| now >= at) {
                        kill_at = None;
                        pending.push((Signal::Kill, Origin::Timeout));
                    }
                }
            }
        };
        self.finished = true;
        let elapsed = self.started.elapsed();
        let status = status
            .map_err(|e| Error::io("wait for runtime exec of", self.sandbox.paths.dir(), e))?;

        // Output written just before the end is still in the pipes.
        let drain_until = Instant::now() + Duration::from_millis(OUTPUT_DRAIN_MS);
        while stdout.is_some() || stderr.is_some() {
            let event = tokio::select! {
                read = read_from(&mut stdout, &mut stdout_buffer), if stdout.is_some() => {
                    Some((Stream::Stdout, read))
                }
                read = read_from(&mut stderr, &mut stderr_buffer), if stderr.is_some() => {
                    Some((Stream::Stderr, read))
                }
                () = tokio::time::sleep_until(drain_until) => None,
            };
            match event {
                None => break,
                Some((Stream::Stdout, Ok(0) | Err(_))) => stdout = None,
                Some((Stream::Stderr, Ok(0) | Err(_))) => stderr = None,
                Some((Stream::Stdout, Ok(n))) => on_output(Stream::Stdout, &stdout_buffer[..n]),
                Some((Stream::Stderr, Ok(n))) => on_output(Stream::Stderr, &stderr_buffer[..n]),
            }
        }

        let runtime_message = runtime_errors(&read_lossy(&self.scratch.log));
        let launched = self.target.is_some() || Target::find(&self.scratch.pid).is_some();
        self.scratch.remove();
        let outcome = self
            .classify(status, &runtime_message, launched, timed_out, &delivered)
            .await?;
        Ok(CommandEnd {
            outcome,
            runtime_status: status.code(),
            elapsed,
        })
    }

    async fn classify(
        &self,
        status: std::process::ExitStatus,
        runtime_message: &str,
        launched: bool,
        timed_out: bool,
        delivered: &[Signal],
    ) -> Result<Outcome> {
        let runtime = self.sandbox.runtime.kind().name();
        if !runtime_message.is_empty() {
            return Ok(Outcome::LaunchFailed {
                failure: LaunchFailure::of_runtime_message(runtime_message),
                message: runtime_message.to_owned(),
            });
        }
        let Some(code) = status.code() else {
            // The runtime's exec itself was killed (not by this layer): the
            // command may still run, and its end is unknowable here.
            use std::os::unix::process::ExitStatusExt;
            return Err(Error::Runtime {
                runtime,
                op: "exec",
                id: self.sandbox.id.to_string(),
                status: None,
                message: format!(
                    "the runtime's exec was killed by signal {}; the command's end is unknown",
                    status.signal().unwrap_or_default()
                ),
            });
        };
        if !launched {
            return Ok(Outcome::LaunchFailed {
                failure: LaunchFailure::RuntimeRefused,
                message: format!(
                    "{runtime} exec ended with status {code} before starting the process"
                ),
            });
        }
        if timed_out {
            return Ok(Outcome::TimedOut);
        }
        if let Some(signal) = delivered.iter().rev().find(|s| code == 128 + s.number()) {
            return Ok(Outcome::Interrupted { signal: *signal });
        }
        if code == 128 + Signal::Kill.number() {
            let oom_after = self.sandbox.cgroup_counters().oom_kills.unwrap_or(0);
            let alive = matches!(
                self.sandbox.state().await,
                Ok(Some(state)) if matches!(state.status, Status::Running | Status::Paused)
            );
            if oom_after > self.oom_before {
                if alive {
                    // The sandbox survived this kill: it must not explain a
                    // later death.
                    self.sandbox.oom_seen.fetch_max(oom_after, Ordering::SeqCst);
                }
                return Ok(Outcome::ResourceExhausted);
            }
            if !alive {
                return Ok(Outcome::Interrupted {
                    signal: Signal::Kill,
                });
            }
        }
        Ok(Outcome::Exited { code })
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Drop for RuntimeExecution {
    fn drop(&mut self) {
        if !self.finished {
            // Abandoned mid-run: end the command rather than leave it
            // running unobserved (kill_on_drop ends the runtime's exec).
            if let Some(target) = self.target.or_else(|| Target::find(&self.scratch.pid)) {
                target.send(Signal::Kill);
            }
            self.scratch.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_states() {
        assert_eq!(Outcome::Exited { code: 0 }.state(), "exited");
        assert_eq!(Outcome::TimedOut.state(), "timed_out");
        assert_eq!(Outcome::ResourceExhausted.state(), "resource_exhausted");
        assert_eq!(
            Outcome::Interrupted {
                signal: Signal::Term
            }
            .state(),
            "interrupted"
        );
        assert_eq!(
            Outcome::LaunchFailed {
                failure: LaunchFailure::RuntimeRefused,
                message: String::new()
            }
            .state(),
            "launch_failed"
        );
    }

    #[test]
    fn scratch_names_do_not_repeat() {
        let a = EXEC_SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let b = EXEC_SEQUENCE.fetch_add(1, Ordering::Relaxed);
        assert_ne!(a, b);
    }
}
