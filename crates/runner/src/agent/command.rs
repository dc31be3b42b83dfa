//! One task per handed-over command: launch it at most once, stream its
//! output to the server by offset while it runs, and report how it ended
//! as one of the server's command states.
//!
//! At most once: before the runtime is asked to exec, a marker is fsynced
//! in the data dir ([`CommandFiles::record_launch`]). A command that has a
//! marker is never launched again: after a restart, one with a recorded end
//! is reported with that end, one without is reported `unknown` (it may
//! have run; nothing here can prove it did not).
//!
//! Output goes to spool files in the data dir as the OCI layer hands it
//! over (no memory grows with a chatty command), and an uploader appends
//! it to the server by offset. The server refuses output once the end is
//! reported, so every byte is uploaded first; a command that ends within
//! the report window sends its (small) output with its end instead.

use api::lifecycle::CommandState;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::client::OutputStream;
use api::runners::{CommandAssignment, CommandReport, REPORTED_OUTPUT_BYTES_MAX, ReportedOutput};
use tokio::sync::{Notify, watch};

use super::dirs::{CommandFiles, CommandRecord, RecordedEnd};
use super::{Refusal, Shared};
use oci::Error;
use oci::LaunchFailure;
use oci::exec::{CommandSpec, Outcome, Stream};
use oci::seam::Container;
use oci::signal::Signal;

/// Largest output chunk one upload carries (the server takes bodies up to
/// 1 MiB).
const UPLOAD_CHUNK_BYTES_MAX: usize = 256 * 1024;
/// Uploads of a command's output are at least this far apart (output
/// arriving sooner waits to go with more); the first after a quiet spell
/// goes at once.
const UPLOAD_BATCH_MS: u64 = 20;
/// How long a launched command may take to end before its `running` is
/// reported: one that ends sooner without output is reported once.
const RUNNING_REPORT_WINDOW: Duration = Duration::from_millis(5);

/// Everything a command task needs.
pub(crate) struct CommandJob {
    pub shared: Arc<Shared>,
    pub sandbox: Arc<dyn Container>,
    pub files: CommandFiles,
    pub assignment: CommandAssignment,
    /// The signal the caller asked for last, as the assignments show it.
    pub signals: watch::Receiver<SignalRequest>,
    /// False when the sandbox is not to run any more (it is to stop, or it
    /// died): a command not launched yet never will be, and says so.
    pub may_launch: bool,
    /// The env variables the sandbox's secrets go in (its assignment's
    /// `secrets`): a command runs with all of them or not at all.
    pub env_secrets: Vec<String>,
}

/// The signals the caller asked for that the assignments still show, oldest
/// first, each with its number among the command's signal requests (a
/// second request for the same signal has a new one) and its name.
pub(crate) type SignalRequest = Vec<(u64, String)>;

/// The assignment's [`SignalRequest`]: its kept signals, or from a server
/// that keeps only the latest, that one.
pub(crate) fn signal_request(assignment: &CommandAssignment) -> SignalRequest {
    if !assignment.signals.is_empty() {
        return assignment
            .signals
            .iter()
            .map(|requested| (requested.seq, requested.signal.clone()))
            .collect();
    }
    assignment
        .signal
        .clone()
        .map(|name| (assignment.signal_seq, name))
        .into_iter()
        .collect()
}

/// The task's stop: fenced (not this runner's), or refused for good.
struct Stopped;

pub(crate) async fn run(job: CommandJob) {
    let id = job.assignment.command_id.clone();
    tracing::debug!(command_id = %id, "hop: command task started");
    let record = match job.files.record(&id) {
        Ok(record) => record,
        Err(err) => {
            // Without its record the command could be run twice: leave it.
            tracing::error!(command_id = %id, %err, "cannot read the command's record; not launching it");
            return;
        }
    };
    // An end recorded before a restart is reported again with whatever
    // output it left spooled (the server skips what it already has).
    let restarted = matches!(record, CommandRecord::Ended(_));
    let end = match record {
        CommandRecord::Ended(end) => end,
        // Launched through the agent: ask it again (it attaches, or starts
        // the command if it never received it; never twice).
        CommandRecord::Launched {
            incarnation: Some(incarnation),
        } => match job.attach(&incarnation).await {
            Ok(end) => end,
            Err(Stopped) => return,
        },
        CommandRecord::Launched { incarnation: None } => {
            tracing::warn!(command_id = %id, "launched before a runner restart, end unknown: reporting unknown");
            unknown()
        }
        // Reported running by an earlier run whose records are gone.
        CommandRecord::New if job.assignment.state != CommandState::Starting => unknown(),
        // Handed over, but the sandbox stops (or died) before it ran: the
        // honest end is `not_launched`, where the record would say
        // `unknown` of a command left unconfirmed.
        CommandRecord::New if !job.may_launch => RecordedEnd {
            reason: Some("sandbox_not_running".to_owned()),
            ..RecordedEnd::new(CommandState::NotLaunched)
        },
        CommandRecord::New => match job.launch().await {
            Ok(end) => end,
            Err(Stopped) => return,
        },
    };
    // A restart's end is recorded already.
    let recorded = if restarted {
        Ok(())
    } else {
        job.files.record_end(&id, &end)
    };
    if let Err(err) = &recorded {
        tracing::warn!(command_id = %id, %err, "cannot record the command's end; reporting it anyway");
    }
    // A command that ended before any of its output went up (within the
    // report window): its output goes with its end, in one commit.
    let output = if restarted || end.pid.is_some() {
        job.spooled_output()
    } else {
        None
    };
    let _ = job.report_with(&end, output).await;
    // After the report, off the command's round trip: the agent keeps the
    // ended command until a later forget or its sandbox's end, and nothing
    // is run again for it meanwhile.
    if recorded.is_ok()
        && let Err(err) = job.sandbox.forget_command(&id).await
    {
        tracing::debug!(command_id = %id, %err, "the agent did not take the forget");
    }
}

/// The honest end of a command that may or may not have run.
fn unknown() -> RecordedEnd {
    RecordedEnd {
        reason: Some("runner_restarted".to_owned()),
        ..RecordedEnd::new(CommandState::Unknown)
    }
}

impl CommandJob {
    fn command_id(&self) -> &str {
        &self.assignment.command_id
    }

    /// Reports `end` (or `running`); a refusal other than a fence means
    /// the record has already moved on (the server ended the command).
    async fn report(&self, end: &RecordedEnd) -> Result<(), Stopped> {
        self.report_with(end, None).await
    }

    /// The command's spooled output, when every stream is small enough to
    /// go with its end report (and there is any).
    fn spooled_output(&self) -> Option<ReportedOutput> {
        let read = |name: &str| -> Option<Vec<u8>> {
            let path = self.files.output(self.command_id(), name);
            match std::fs::metadata(&path) {
                Ok(meta) if meta.len() > REPORTED_OUTPUT_BYTES_MAX as u64 => None,
                Ok(_) => std::fs::read(&path).ok(),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => Some(Vec::new()),
                Err(_) => None,
            }
        };
        let output = ReportedOutput {
            stdout: read("stdout")?,
            stderr: read("stderr")?,
        };
        let small = output.stdout.len().max(output.stderr.len()) <= REPORTED_OUTPUT_BYTES_MAX;
        (small && !(output.stdout.is_empty() && output.stderr.is_empty())).then_some(output)
    }

    /// Reports `end` with the output it carries (see [`CommandReport::output`]).
    async fn report_with(
        &self,
        end: &RecordedEnd,
        output: Option<ReportedOutput>,
    ) -> Result<(), Stopped> {
        let report = CommandReport {
            runner_id: self.shared.runner_id(),
            epoch: self.assignment.epoch,
            state: end.state,
            exit_code: end.exit_code,
            signal: end.signal.clone(),
            reason: end.reason.clone(),
            pid: end.pid,
            output,
        };
        let result = self
            .shared
            .retrying("command report", || {
                self.shared
                    .control
                    .runner_report_command(self.command_id(), &report)
            })
            .await;
        match result {
            Ok(_) => {
                tracing::debug!(command_id = %self.command_id(), state = %end.state, "command reported");
                Ok(())
            }
            Err(Refusal::Fenced(message)) => {
                tracing::warn!(command_id = %self.command_id(), %message, "fenced: the command is no longer this runner's");
                Err(Stopped)
            }
            Err(Refusal::Refused(err)) => {
                tracing::info!(command_id = %self.command_id(), state = %end.state, %err, "command report refused: its record has moved on");
                Err(Stopped)
            }
        }
    }

    /// The command's spec; an error when an env secret it must have
    /// cannot be read.
    fn spec(&self) -> Result<CommandSpec, Error> {
        let assignment = &self.assignment;
        let mut spec = CommandSpec::new(assignment.argv.iter().cloned());
        // Delivered env secrets under the command's own env (which wins,
        // as over the sandbox's env); with them, the scratch files (whose
        // process.json holds that env) go to the secrets' tmpfs.
        let secrets = self.shared.config.secrets();
        let sandbox_id = self.sandbox.id();
        spec.env = secrets.env(sandbox_id, &self.env_secrets)?;
        spec.env
            .extend(assignment.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        spec.scratch_dir = secrets.scratch(sandbox_id);
        spec.cwd = assignment.cwd.clone();
        spec.timeout = assignment.timeout.map(Duration::from_secs);
        spec.kill_grace = self.shared.config.command_kill_grace;
        spec.stdin = assignment.stdin;
        spec.tty = assignment.tty.map(|tty| (tty.rows, tty.cols));
        Ok(spec)
    }

    /// Launches the command (once), drives it to its end, uploads its
    /// output, and returns the end to report.
    async fn launch(&self) -> Result<RecordedEnd, Stopped> {
        let id = self.command_id();
        // The worker starts command tasks only in a pass that saw the
        // init alive; an agent that does not answer means the init is
        // gone or wedged, and the command is not launched.
        let incarnation = match self.sandbox.agent_incarnation().await {
            Ok(incarnation) => incarnation,
            Err(err) => {
                tracing::warn!(command_id = %id, %err, "the sandbox's agent does not answer; not launching");
                return Ok(RecordedEnd {
                    reason: Some("sandbox_not_running".to_owned()),
                    ..RecordedEnd::new(CommandState::NotLaunched)
                });
            }
        };
        tracing::debug!(command_id = %id, "hop: agent incarnation read");
        // Before the marker: a command whose env secrets cannot be read
        // (their tmpfs gone) never runs without them.
        let spec = match self.spec() {
            Ok(spec) => spec,
            Err(err) => {
                tracing::warn!(command_id = %id, %err, "the sandbox's env secrets cannot be read; not launching");
                return Ok(RecordedEnd {
                    reason: Some("secret_unavailable".to_owned()),
                    ..RecordedEnd::new(CommandState::LaunchFailed)
                });
            }
        };
        // The marker's fsyncs on a blocking thread: with many commands
        // starting at once, they would otherwise hold the runtime's few
        // workers (and every report and upload on them) for their length.
        let marker = {
            let (files, id, epoch) = (self.files.clone(), id.to_owned(), self.assignment.epoch);
            let incarnation = incarnation.clone();
            tokio::task::spawn_blocking(move || {
                files.record_launch(&id, epoch, incarnation.as_deref())
            })
        };
        let recorded = match marker.await {
            Ok(recorded) => recorded,
            Err(err) => Err(Error::Invalid(format!("the launch record's thread: {err}"))),
        };
        if let Err(err) = recorded {
            tracing::error!(command_id = %id, %err, "cannot record the launch; not launching");
            return Ok(RecordedEnd {
                reason: Some("runner_error".to_owned()),
                ..RecordedEnd::new(CommandState::LaunchFailed)
            });
        }
        let spool = Arc::new(Spool::new(&self.files, id));
        tracing::debug!(command_id = %id, "hop: launch recorded");
        let started = match &incarnation {
            Some(incarnation) => {
                self.sandbox
                    .run_in_agent(id, incarnation, &spec, [0, 0])
                    .await
            }
            // A container from before the agent: the runtime's exec.
            None => self.sandbox.exec_seen_running(&spec).await,
        };
        let execution = match started {
            Ok(execution) => execution,
            Err(Error::NotRunning { .. } | Error::NotFound { .. }) => {
                return Ok(RecordedEnd {
                    reason: Some("sandbox_not_running".to_owned()),
                    ..RecordedEnd::new(CommandState::NotLaunched)
                });
            }
            // Another init answers now: the sandbox restarted under the
            // command before it was sent.
            Err(Error::Agent { code, .. }) if code == "incarnation_mismatch" => {
                return Ok(RecordedEnd {
                    reason: Some("sandbox_not_running".to_owned()),
                    ..RecordedEnd::new(CommandState::NotLaunched)
                });
            }
            Err(err) => {
                tracing::warn!(command_id = %id, %err, "the runtime could not exec the command");
                return Ok(RecordedEnd {
                    reason: Some("runtime_error".to_owned()),
                    ..RecordedEnd::new(CommandState::LaunchFailed)
                });
            }
        };
        tracing::debug!(command_id = %id, "hop: started in the agent");
        self.shared
            .config
            .failpoint
            .hit("runner:after_command_launch");
        self.drive(execution, spool).await
    }

    /// A command launched through the agent before this runner (re)started:
    /// attached again from where its spool ends, driven to its end.
    async fn attach(&self, incarnation: &str) -> Result<RecordedEnd, Stopped> {
        let id = self.command_id();
        let spool = match Spool::reopen(&self.files, id) {
            Ok(spool) => Arc::new(spool),
            Err(err) => {
                tracing::error!(command_id = %id, %err, "cannot reopen the command's spool; its end is unknown");
                return Ok(unknown());
            }
        };
        let from = spool.lengths();
        // The agent starts the command from this spec if it never got it:
        // never without its env secrets.
        let spec = match self.spec() {
            Ok(spec) => spec,
            Err(err) => {
                tracing::warn!(command_id = %id, %err, "the sandbox's env secrets cannot be read; not attaching again, its end is unknown");
                return Ok(unknown());
            }
        };
        match self
            .sandbox
            .run_in_agent(id, incarnation, &spec, from)
            .await
        {
            Ok(execution) => {
                tracing::info!(command_id = %id, "attached again to a command launched before a restart");
                self.drive(execution, spool).await
            }
            // Another init, or none: the command may have run and died with
            // the earlier one.
            Err(err) => {
                tracing::warn!(command_id = %id, %err, "cannot attach again to a launched command; its end is unknown");
                Ok(unknown())
            }
        }
    }

    /// Drives a launched command to its end: output spooled and uploaded,
    /// signals delivered, `running` reported (with its pid).
    async fn drive(
        &self,
        execution: Box<dyn oci::RunningCommand>,
        spool: Arc<Spool>,
    ) -> Result<RecordedEnd, Stopped> {
        let id = self.command_id();
        let signaller = execution.signaller();
        let pid = execution.pid();
        let delivered: Mutex<Vec<Signal>> = Mutex::new(Vec::new());
        let mut uploader = Uploader::new(self, spool.clone());
        let fenced = Notify::new();
        // Output goes up only once `running` is recorded: a reader never
        // sees bytes of a command the record still calls `starting`.
        let (reported, mut running_recorded) = tokio::sync::watch::channel(false);

        let callback_spool = spool.clone();
        let waited = execution.wait(Box::new(move |stream, bytes| {
            callback_spool.append(stream, bytes)
        }));
        let mut waited = std::pin::pin!(waited);
        // A command that ends at once (`true`, `mkdir`, `echo`) is
        // reported once: its end with its pid and its output, which the
        // server records as started, written and ended in one transaction,
        // where a `running` report, an upload and the end would be three,
        // one after the other. Real time, not the agent's clock: the window
        // only ever delays a `running` report by this much.
        let early = tokio::select! {
            biased;
            ended = &mut waited => Some(ended),
            () = tokio::time::sleep(RUNNING_REPORT_WINDOW) => None,
        };
        let early = match early {
            // Output goes with the end only under a pid (the sign that
            // it ran, which `run` sends the spool with).
            Some(ended)
                if spool.lengths() == [0, 0] || (pid.is_some() && ran(&ended) && small(&spool)) =>
            {
                tracing::debug!(command_id = %id, "hop: ended in the agent");
                spool.close();
                return Ok(recorded_end(id, ended, &[], pid));
            }
            early => early,
        };

        let drive = async {
            let running = async {
                let report = RecordedEnd {
                    pid,
                    ..RecordedEnd::new(CommandState::Running)
                };
                if self.report(&report).await.is_err() {
                    fenced.notify_one();
                } else {
                    let _ = reported.send(true);
                }
            };
            let waited = async {
                let ended = match early {
                    Some(ended) => ended,
                    None => waited.await,
                };
                tracing::debug!(command_id = %id, "hop: ended in the agent");
                ended
            };
            let (ended, ()) = tokio::join!(waited, running);
            spool.close();
            ended
        };
        let signals = self.forward_signals(&signaller, &delivered);
        let uploads = async {
            if running_recorded
                .wait_for(|recorded| *recorded)
                .await
                .is_err()
            {
                return std::future::pending::<()>().await;
            }
            if uploader.run_while_open().await.is_err() {
                fenced.notify_one();
            }
            std::future::pending::<()>().await
        };
        let ended = tokio::select! {
            ended = drive => ended,
            () = signals => unreachable_pending(),
            () = uploads => unreachable_pending(),
            () = fenced.notified() => return Err(Stopped),
        };
        // Every byte goes up before the end is reported.
        uploader.flush().await?;
        let delivered = delivered
            .lock()
            .map(|d| d.clone())
            .unwrap_or_else(|p| p.into_inner().clone());
        Ok(recorded_end(id, ended, &delivered, None))
    }

    /// Delivers each signal the assignments ask for, once, even across a
    /// restart of this runner (what was delivered is in the command's
    /// launch record); never returns.
    async fn forward_signals(&self, signaller: &oci::Signaller, delivered: &Mutex<Vec<Signal>>) {
        let id = self.command_id();
        let mut signals = self.signals.clone();
        // An earlier runner's deliveries count as delivered: the request
        // it acted on is not acted on again, and the end says who asked.
        let earlier = self.files.delivered_signals(id).unwrap_or_else(|err| {
            tracing::warn!(command_id = %id, %err, "cannot read the signals delivered before");
            Vec::new()
        });
        if let Ok(mut delivered) = delivered.lock() {
            delivered.extend(
                earlier
                    .iter()
                    .filter_map(|(_, name)| Signal::from_name(name)),
            );
        }
        // The number of the last request delivered: every later one is
        // delivered, in order, and none again.
        let mut last: Option<u64> = earlier.iter().map(|(seq, _)| *seq).max();
        // A server that does not number requests (0) shows only its latest:
        // a new one is a different name.
        let mut last_unnumbered: Option<String> = earlier
            .iter()
            .rev()
            .find(|(seq, _)| *seq == 0)
            .map(|(_, name)| name.clone());
        loop {
            let requested = signals.borrow_and_update().clone();
            for (seq, name) in requested {
                if seq == 0 {
                    if last_unnumbered.as_ref() == Some(&name) {
                        continue;
                    }
                    last_unnumbered = Some(name.clone());
                } else if last.is_some_and(|last| seq <= last) {
                    continue;
                } else {
                    last = Some(seq);
                }
                let Some(signal) = Signal::from_name(&name) else {
                    continue;
                };
                tracing::info!(command_id = %id, %signal, "delivering a signal");
                if signaller.send(signal) {
                    if let Ok(mut delivered) = delivered.lock() {
                        delivered.push(signal);
                    }
                    if let Err(err) = self.files.record_signal(id, seq, &name) {
                        tracing::warn!(command_id = %id, %err, "cannot record a delivered signal: a restart may deliver it again");
                    }
                }
            }
            if signals.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// The end to record and report of a command that was launched. `pid`:
/// reported with an end that says the command ran (for a command whose
/// `running` was never reported).
fn recorded_end(
    id: &str,
    ended: Result<oci::exec::CommandEnd, Error>,
    delivered: &[Signal],
    pid: Option<i32>,
) -> RecordedEnd {
    let ran = ran(&ended);
    match ended {
        Ok(end) => RecordedEnd {
            pid: pid.filter(|_| ran),
            ..end_of(&end.outcome, delivered)
        },
        Err(err) => {
            tracing::warn!(command_id = %id, %err, "lost track of the command");
            RecordedEnd {
                reason: Some("runtime_exec_lost".to_owned()),
                ..RecordedEnd::new(CommandState::Unknown)
            }
        }
    }
}

/// Whether a command launched (its end is not a launch failure).
fn ran(ended: &Result<oci::exec::CommandEnd, Error>) -> bool {
    matches!(ended, Ok(end) if !matches!(end.outcome, Outcome::LaunchFailed { .. }))
}

/// Whether every stream of the spool fits in an end report.
fn small(spool: &Spool) -> bool {
    spool
        .lengths()
        .iter()
        .all(|&length| length <= REPORTED_OUTPUT_BYTES_MAX as u64)
}

/// The futures it is used on never complete.
fn unreachable_pending<T>() -> T {
    unreachable!("a future that never completes completed")
}

/// The report of an outcome. `delivered`: the signals the caller sent.
fn end_of(outcome: &Outcome, delivered: &[Signal]) -> RecordedEnd {
    match outcome {
        Outcome::Exited { code } => RecordedEnd {
            exit_code: Some(*code),
            ..RecordedEnd::new(CommandState::Exited)
        },
        Outcome::TimedOut => RecordedEnd {
            reason: Some("timeout".to_owned()),
            ..RecordedEnd::new(CommandState::TimedOut)
        },
        Outcome::ResourceExhausted => RecordedEnd {
            signal: Some(Signal::Kill.name().to_owned()),
            reason: Some("oom_killed".to_owned()),
            ..RecordedEnd::new(CommandState::ResourceExhausted)
        },
        Outcome::Interrupted { signal } => RecordedEnd {
            signal: Some(signal.name().to_owned()),
            reason: Some(
                if delivered.contains(signal) {
                    "signal_requested"
                } else {
                    "sandbox_stopped"
                }
                .to_owned(),
            ),
            ..RecordedEnd::new(CommandState::Interrupted)
        },
        // The runtime refused because the sandbox was no longer running:
        // the command never started, for want of a sandbox.
        Outcome::LaunchFailed {
            failure: LaunchFailure::SandboxNotRunning,
            ..
        } => RecordedEnd {
            reason: Some("sandbox_not_running".to_owned()),
            ..RecordedEnd::new(CommandState::NotLaunched)
        },
        Outcome::LaunchFailed { failure, .. } => RecordedEnd {
            reason: Some(launch_failure_reason(*failure).to_owned()),
            ..RecordedEnd::new(CommandState::LaunchFailed)
        },
    }
}

/// The stable reason code of a command that never started (the runtime's
/// message itself is logged).
fn launch_failure_reason(failure: LaunchFailure) -> &'static str {
    match failure {
        LaunchFailure::SandboxNotRunning => "sandbox_not_running",
        LaunchFailure::BadCwd => "bad_cwd",
        LaunchFailure::MissingExecutable => "executable_not_found",
        LaunchFailure::PermissionDenied => "permission_denied",
        LaunchFailure::RuntimeRefused => "exec_failed",
    }
}

/// A command's output spooled to files, as the OCI layer hands it over.
/// A stream's file is made at its first byte: most quick commands (`true`,
/// `mkdir`, `test`) make none, and every file made and removed per command
/// is work for the data dir's filesystem (on ext4 without a journal, each
/// new inode is found by skipping every one freed in the last seconds).
/// The most of a stream a spool holds: the record's bound and one byte.
const SPOOL_STREAM_BYTES_MAX: u64 = api::commands::OUTPUT_STREAM_BYTES_MAX + 1;

struct Spool {
    paths: [PathBuf; 2],
    /// Each stream's file once made, read and written: appended under the
    /// lock, read by the uploader at offsets below `written`.
    files: [Mutex<Option<Arc<File>>>; 2],
    written: [AtomicU64; 2],
    /// Set once the command has ended: no more bytes will come.
    closed: AtomicBool,
    /// Set when a write failed: the output from there on is lost (not
    /// spooled, see [`Spool::append`]).
    broken: AtomicBool,
    more: Notify,
}

fn index(stream: Stream) -> usize {
    match stream {
        Stream::Stdout => 0,
        Stream::Stderr => 1,
    }
}

const STREAMS: [(Stream, OutputStream); 2] = [
    (Stream::Stdout, OutputStream::Stdout),
    (Stream::Stderr, OutputStream::Stderr),
];

impl Spool {
    /// The spool of a command about to be launched: nothing on disk yet.
    fn new(files: &CommandFiles, command_id: &str) -> Spool {
        Spool {
            paths: [
                files.output(command_id, "stdout"),
                files.output(command_id, "stderr"),
            ],
            files: [Mutex::new(None), Mutex::new(None)],
            written: [AtomicU64::new(0), AtomicU64::new(0)],
            closed: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            more: Notify::new(),
        }
    }

    /// The spool of a command launched before a restart: appended to from
    /// where it ends (a stream that had no output has no file yet).
    fn reopen(files: &CommandFiles, command_id: &str) -> Result<Spool, Error> {
        let spool = Spool::new(files, command_id);
        for i in 0..2 {
            let path = &spool.paths[i];
            let file = match std::fs::OpenOptions::new()
                .read(true)
                .append(true)
                .open(path)
            {
                Ok(file) => file,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("open", path, e)),
            };
            let length = file
                .metadata()
                .map_err(|e| Error::io("inspect", path, e))?
                .len();
            spool.written[i].store(length, Ordering::SeqCst);
            *spool.files[i]
                .lock()
                .map_err(|_| Error::Invalid("a poisoned spool".to_owned()))? = Some(Arc::new(file));
        }
        Ok(spool)
    }

    fn lengths(&self) -> [u64; 2] {
        [
            self.written[0].load(Ordering::SeqCst),
            self.written[1].load(Ordering::SeqCst),
        ]
    }

    fn append(&self, stream: Stream, bytes: &[u8]) {
        // After a failed write the file no longer matches the offsets
        // counted (a write may have been cut short, or the file never
        // made): nothing more is spooled, so no byte is ever served at an
        // offset it was not written at.
        if self.broken.load(Ordering::SeqCst) {
            return;
        }
        let i = index(stream);
        // The record keeps a stream's first `OUTPUT_STREAM_BYTES_MAX`: one
        // byte more is spooled (its upload tells the server the stream was
        // cut), and nothing past it, so a command writing without end
        // fills neither this runner's disk nor its workers' time.
        let room = SPOOL_STREAM_BYTES_MAX.saturating_sub(self.written[i].load(Ordering::SeqCst));
        let bytes = &bytes[..bytes.len().min(usize::try_from(room).unwrap_or(usize::MAX))];
        if bytes.is_empty() {
            return;
        }
        let written = match self.files[i].lock() {
            Ok(mut file) => {
                if file.is_none() {
                    *file = self.make(i);
                }
                file.as_ref()
                    .is_some_and(|file| (&**file).write_all(bytes).is_ok())
            }
            Err(_) => false,
        };
        if written {
            self.written[i].fetch_add(bytes.len() as u64, Ordering::SeqCst);
            self.more.notify_one();
        } else if !self.broken.swap(true, Ordering::SeqCst) {
            tracing::error!("cannot spool a command's output; the rest of it is lost");
        }
    }

    /// Makes stream `i`'s file, at its first byte.
    fn make(&self, i: usize) -> Option<Arc<File>> {
        let path = &self.paths[i];
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
        {
            Ok(file) => Some(Arc::new(file)),
            Err(err) => {
                tracing::error!(path = %path.display(), %err, "cannot create a command's spool file");
                None
            }
        }
    }

    /// Stream `i`'s file, if it has had output.
    fn file(&self, i: usize) -> Option<Arc<File>> {
        self.files[i].lock().ok().and_then(|file| file.clone())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.more.notify_one();
    }
}

/// Appends spooled output to the server, by offset.
struct Uploader<'a> {
    job: &'a CommandJob,
    spool: Arc<Spool>,
    sent: [u64; 2],
    /// The server refused more of a stream (the command's record has
    /// ended, or the stream reached the bound the server keeps of it):
    /// nothing more of it is sent.
    refused: [bool; 2],
}

impl<'a> Uploader<'a> {
    fn new(job: &'a CommandJob, spool: Arc<Spool>) -> Self {
        Uploader {
            job,
            spool,
            sent: [0, 0],
            refused: [false, false],
        }
    }

    /// Uploads as output arrives until the spool is closed.
    async fn run_while_open(&mut self) -> Result<(), Stopped> {
        let batch = Duration::from_millis(UPLOAD_BATCH_MS);
        let mut last_upload: Option<tokio::time::Instant> = None;
        while !self.spool.closed.load(Ordering::SeqCst) {
            self.spool.more.notified().await;
            // A little batching for chatty output (fewer requests), but
            // output after a quiet spell (a prompt, a keystroke's echo)
            // goes at once.
            if let Some(at) = last_upload
                && at.elapsed() < batch
            {
                tokio::time::sleep_until(at + batch).await;
            }
            self.upload_available().await?;
            last_upload = Some(tokio::time::Instant::now());
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), Stopped> {
        self.upload_available().await
    }

    async fn upload_available(&mut self) -> Result<(), Stopped> {
        for (stream, wire) in STREAMS {
            let i = index(stream);
            loop {
                let written = self.spool.written[i].load(Ordering::SeqCst);
                if self.refused[i] || self.sent[i] >= written {
                    break;
                }
                let want = (written - self.sent[i]).min(UPLOAD_CHUNK_BYTES_MAX as u64) as usize;
                let mut chunk = vec![0u8; want];
                // Bytes were written, so the file exists.
                let read = match self.spool.file(i) {
                    Some(file) => file.read_exact_at(&mut chunk, self.sent[i]),
                    None => Err(std::io::Error::other("the spool file is missing")),
                };
                if let Err(err) = read {
                    tracing::error!(command_id = %self.job.command_id(), %err, "cannot read spooled output; the rest of it is lost");
                    self.refused = [true, true];
                    break;
                }
                let offset = self.sent[i];
                let shared = &self.job.shared;
                let runner_id = shared.runner_id();
                let result = shared
                    .retrying("output upload", || {
                        shared.control.runner_append_output(
                            self.job.command_id(),
                            wire,
                            (&runner_id, self.job.assignment.epoch),
                            offset,
                            chunk.clone(),
                        )
                    })
                    .await;
                match result {
                    Ok(_) => self.sent[i] = offset + want as u64,
                    Err(Refusal::Fenced(message)) => {
                        tracing::warn!(command_id = %self.job.command_id(), %message, "fenced while uploading output");
                        return Err(Stopped);
                    }
                    Err(Refusal::Refused(err)) => {
                        tracing::info!(command_id = %self.job.command_id(), stream = ?wire, %err, "output refused: the record has ended, or keeps no more of this stream");
                        self.refused[i] = true;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_map_to_command_states() {
        let end = end_of(&Outcome::Exited { code: 3 }, &[]);
        assert_eq!((end.state, end.exit_code), (CommandState::Exited, Some(3)));
        assert_eq!(
            end_of(&Outcome::TimedOut, &[]).state,
            CommandState::TimedOut
        );
        assert_eq!(
            end_of(&Outcome::ResourceExhausted, &[]).state,
            CommandState::ResourceExhausted
        );
        let asked = end_of(
            &Outcome::Interrupted {
                signal: Signal::Term,
            },
            &[Signal::Term],
        );
        assert_eq!(asked.signal.as_deref(), Some("TERM"));
        assert_eq!(asked.reason.as_deref(), Some("signal_requested"));
        let by_stop = end_of(
            &Outcome::Interrupted {
                signal: Signal::Kill,
            },
            &[],
        );
        assert_eq!(by_stop.reason.as_deref(), Some("sandbox_stopped"));
        let launch_failed = |failure: LaunchFailure| {
            let end = end_of(
                &Outcome::LaunchFailed {
                    failure,
                    message: "the runtime's words".to_owned(),
                },
                &[],
            );
            (end.state, end.reason)
        };
        let expect = |state: &str, reason: &str| {
            let state: CommandState = state.parse().expect("a command state");
            (state, Some(reason.to_owned()))
        };
        assert_eq!(
            launch_failed(LaunchFailure::MissingExecutable),
            expect("launch_failed", "executable_not_found")
        );
        assert_eq!(
            launch_failed(LaunchFailure::BadCwd),
            expect("launch_failed", "bad_cwd")
        );
        assert_eq!(
            launch_failed(LaunchFailure::PermissionDenied),
            expect("launch_failed", "permission_denied")
        );
        assert_eq!(
            launch_failed(LaunchFailure::RuntimeRefused),
            expect("launch_failed", "exec_failed")
        );
        assert_eq!(
            launch_failed(LaunchFailure::SandboxNotRunning),
            expect("not_launched", "sandbox_not_running")
        );
    }

    /// A stream's spool file is made at its first byte; once a write
    /// fails, nothing more is spooled, so no later byte is ever counted at
    /// an offset it was not written at.
    /// Audit finding: a command writing without end (`cat /dev/zero`) was
    /// spooled without end, filling the runner's disk, though its record
    /// keeps the first 32 MiB. A spool holds one byte past that.
    #[test]
    fn a_spool_holds_one_byte_past_what_the_record_keeps() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let data = super::super::dirs::DataDir::open(tmp.path()).expect("open");
        let files = data.commands(&oci::config::SandboxId::new("sbx_1").expect("id"));
        std::fs::create_dir_all(files.output("cmd_1", "x").parent().expect("dir")).expect("mkdir");
        let spool = Spool::new(&files, "cmd_1");
        let chunk = vec![b'z'; 1 << 20];
        let bound = api::commands::OUTPUT_STREAM_BYTES_MAX;
        for _ in 0..(bound / chunk.len() as u64 + 3) {
            spool.append(Stream::Stdout, &chunk);
        }
        spool.append(Stream::Stderr, b"still spooled");
        assert_eq!(spool.lengths(), [bound + 1, 13]);
        let on_disk = std::fs::metadata(files.output("cmd_1", "stdout"))
            .expect("stdout's file")
            .len();
        assert_eq!(on_disk, bound + 1);
    }

    #[test]
    fn a_spool_makes_files_at_the_first_byte_and_stops_at_a_failed_write() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let data = super::super::dirs::DataDir::open(tmp.path()).expect("open");
        let files = data.commands(&oci::config::SandboxId::new("sbx_1").expect("id"));
        std::fs::create_dir_all(files.output("cmd_1", "x").parent().expect("dir")).expect("mkdir");

        let spool = Spool::new(&files, "cmd_1");
        assert!(
            !files.output("cmd_1", "stdout").exists(),
            "nothing before a byte"
        );
        spool.append(Stream::Stdout, b"hello ");
        spool.append(Stream::Stdout, b"world");
        assert_eq!(spool.lengths(), [11, 0]);
        assert!(
            !files.output("cmd_1", "stderr").exists(),
            "stderr had no byte"
        );
        let mut read = vec![0; 11];
        spool
            .file(0)
            .expect("stdout's file")
            .read_exact_at(&mut read, 0)
            .expect("read");
        assert_eq!(read, b"hello world");

        // stderr's file cannot be made (a directory stands in its place):
        // its bytes are lost, and so is every later byte of either stream,
        // even once the file could be made.
        let stderr = files.output("cmd_1", "stderr");
        std::fs::create_dir(&stderr).expect("a directory in the way");
        spool.append(Stream::Stderr, b"lost");
        std::fs::remove_dir(&stderr).expect("rmdir");
        spool.append(Stream::Stderr, b"after");
        spool.append(Stream::Stdout, b"!");
        assert_eq!(spool.lengths(), [11, 0]);
        assert!(!stderr.exists(), "nothing spooled after the failure");

        // A restart reopens what was spooled, and only that.
        let reopened = Spool::reopen(&files, "cmd_1").expect("reopen");
        assert_eq!(reopened.lengths(), [11, 0]);
    }
}
