//! Fakes for the agent's unit tests, in place of runc/crun, the server
//! and tokio's clock: [`FakeRuntime`] (records what it is asked, can be
//! told that the next launch fails, that a container dies, that pause
//! fails or hangs, what an exec prints and how it ends), [`FakeControl`]
//! (records every request, answers from a script: ok, unreachable,
//! fenced, refused, never; long-polls assignments a test hands it) and [`ManualClock`] (time moves only when a test moves
//! it). [`agent`] builds the agent's `Shared` over them and a temporary
//! data dir: the data dir, homes and command records are the real ones.
//!
//! Tests wait for what they expect with [`FakeRuntime::wait_until`] and
//! [`FakeControl::wait_until`], which wake on each recorded call; the
//! wall-clock limit there only turns a hang into a failure.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use api::ErrorCode;
use api::blocks::RemoteBackend;
use api::client::{Client, ClientError, OutputStream};
use api::failpoint::Failpoints;
use api::lifecycle::{CommandState, DesiredState, SandboxState, StorageClass};
use api::runners::{
    Assignments, CommandAssignment, CommandReport, HeartbeatRequest, KeptCopyAnswer,
    KeptCopyReport, PreemptRequest, RegisterRequest, RegisterResponse, RunnerRecord,
    SandboxAssignment, SandboxReport, SaveReport, SnapshotReport,
};
use oci::agent::files_client::{FileInfo, FileListing};
use oci::config::{InitProgram, SandboxConfig, SandboxId, SandboxPaths};
use oci::exec::{CommandEnd, CommandSpec, Outcome, Signaller, Stream};
use oci::seam::{BoxFuture, Container, ContainerRuntime, RunningCommand};
use oci::signal::Signal;
use oci::{DeathCause, Error, Observation, RuntimeState, Status};
use tokio::sync::watch;
use tokio::time::Instant;

use super::clock::Clock;
use super::control::{Answer, ControlPlane};
use super::dirs::DataDir;
use super::{AgentConfig, Shared, fence, homes, images};

/// How long a test waits for an event before it counts as never coming.
const EVENT_LIMIT: Duration = Duration::from_secs(20);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits until `done` holds of what `inner` has recorded, waking at each
/// bump of `version`.
async fn wait_for<T>(
    inner: &Mutex<T>,
    version: &watch::Sender<u64>,
    what: &str,
    done: impl Fn(&T) -> bool,
) {
    let mut changes = version.subscribe();
    let waited = tokio::time::timeout(EVENT_LIMIT, async {
        loop {
            if done(&lock(inner)) {
                return;
            }
            if changes.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    })
    .await;
    assert!(waited.is_ok(), "never happened: {what}");
}

/// Lets every task woken so far run until it waits again (the fakes
/// answer at once, so a few rounds settle the agent).
pub(crate) async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

// ---------------------------------------------------------------------
// The clock.

/// Time that moves only when [`ManualClock::advance`] moves it.
#[derive(Debug)]
pub(crate) struct ManualClock {
    origin: Instant,
    elapsed: watch::Sender<Duration>,
}

impl ManualClock {
    pub(crate) fn new() -> Arc<ManualClock> {
        Arc::new(ManualClock {
            origin: Instant::now(),
            elapsed: watch::channel(Duration::ZERO).0,
        })
    }

    /// Simulated time since the clock was made.
    pub(crate) fn elapsed(&self) -> Duration {
        *self.elapsed.borrow()
    }

    /// Moves time on by `by`, waking every sleep it ends.
    pub(crate) fn advance(&self, by: Duration) {
        self.elapsed.send_modify(|elapsed| *elapsed += by);
    }

    /// Moves time on by `by` in `step`s, letting the agent act after each.
    pub(crate) async fn run_for(&self, by: Duration, step: Duration) {
        let end = self.elapsed() + by;
        while self.elapsed() < end {
            self.advance(step.min(end - self.elapsed()));
            settle().await;
        }
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.origin + self.elapsed()
    }

    /// The simulated time in ms: a lease deadline reads as when it falls.
    fn boottime_ms(&self) -> u64 {
        self.elapsed().as_millis() as u64
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let deadline = self.elapsed() + duration;
        let mut elapsed = self.elapsed.subscribe();
        Box::pin(async move {
            while *elapsed.borrow_and_update() < deadline {
                if elapsed.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
    }
}

// ---------------------------------------------------------------------
// The runtime.

/// What the fake runtime was asked to do (reads are not recorded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    /// Create and start.
    Launch(String),
    Start(String),
    Kill(String, Signal),
    Pause(String),
    Resume(String),
    Stop(String),
    Delete(String),
    RemoveFiles(String),
    Exec(String, Vec<String>),
}

/// How `pause` misbehaves, when told to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PauseFault {
    Fails,
    Hangs,
}

/// What an exec prints and how it ends.
#[derive(Clone, Debug)]
pub(crate) struct ExecScript {
    pub output: Vec<(Stream, Vec<u8>)>,
    pub outcome: Outcome,
}

#[derive(Debug)]
struct FakeBox {
    status: Status,
    cause: Option<DeathCause>,
}

#[derive(Debug, Default)]
struct RuntimeInner {
    containers: BTreeMap<String, FakeBox>,
    /// With the simulated time of each.
    calls: Vec<(Duration, Call)>,
    launch_faults: VecDeque<Error>,
    pause_fault: Option<PauseFault>,
    execs: VecDeque<ExecScript>,
    /// How many times a container's state was asked for.
    observations: u64,
    /// `stop` waits while this holds (`hold_stops`).
    stops_held: bool,
}

/// A container runtime that keeps its containers in memory.
#[derive(Debug)]
pub(crate) struct FakeRuntime {
    inner: Mutex<RuntimeInner>,
    version: watch::Sender<u64>,
    clock: Arc<ManualClock>,
}

impl FakeRuntime {
    pub(crate) fn new(clock: Arc<ManualClock>) -> Arc<FakeRuntime> {
        Arc::new(FakeRuntime {
            inner: Mutex::new(RuntimeInner::default()),
            version: watch::channel(0).0,
            clock,
        })
    }

    fn changed(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// How many times any container's state was asked for so far.
    pub(crate) fn observations(&self) -> u64 {
        lock(&self.inner).observations
    }

    fn record(&self, call: Call) {
        lock(&self.inner).calls.push((self.clock.elapsed(), call));
        self.changed();
    }

    /// Every call so far, in order.
    pub(crate) fn calls(&self) -> Vec<Call> {
        lock(&self.inner)
            .calls
            .iter()
            .map(|(_, c)| c.clone())
            .collect()
    }

    /// When (simulated) each call matching `wanted` was made.
    pub(crate) fn times_of(&self, wanted: impl Fn(&Call) -> bool) -> Vec<Duration> {
        lock(&self.inner)
            .calls
            .iter()
            .filter(|(_, c)| wanted(c))
            .map(|(at, _)| *at)
            .collect()
    }

    pub(crate) fn status(&self, id: &str) -> Option<Status> {
        lock(&self.inner).containers.get(id).map(|b| b.status)
    }

    /// A container already there (as a restarted runner finds one).
    pub(crate) fn add(&self, id: &str, status: Status) {
        lock(&self.inner).containers.insert(
            id.to_owned(),
            FakeBox {
                status,
                cause: None,
            },
        );
        self.changed();
    }

    /// The next launch fails with `error`.
    pub(crate) fn fail_next_launch(&self, error: Error) {
        lock(&self.inner).launch_faults.push_back(error);
    }

    /// From now on, `pause` fails or hangs (`None`: works).
    pub(crate) fn pause_fault(&self, fault: Option<PauseFault>) {
        lock(&self.inner).pause_fault = fault;
    }

    /// From now on, a `stop` waits (after recording its call) until stops
    /// are let go again: a stop that takes a while.
    pub(crate) fn hold_stops(&self, held: bool) {
        lock(&self.inner).stops_held = held;
        self.changed();
    }

    /// The next exec prints and ends as `script` says.
    pub(crate) fn next_exec(&self, script: ExecScript) {
        lock(&self.inner).execs.push_back(script);
    }

    /// The container's init dies with `cause`, out of band.
    pub(crate) fn die(&self, id: &str, cause: DeathCause) {
        if let Some(found) = lock(&self.inner).containers.get_mut(id) {
            found.status = Status::Stopped;
            found.cause = Some(cause);
        }
        self.changed();
    }

    pub(crate) async fn wait_until(&self, what: &str, done: impl Fn(&[Call]) -> bool) {
        wait_for(&self.inner, &self.version, what, |inner| {
            let calls: Vec<Call> = inner.calls.iter().map(|(_, c)| c.clone()).collect();
            done(&calls)
        })
        .await
    }

    fn handle(self: &Arc<Self>, id: SandboxId, paths: SandboxPaths) -> Arc<dyn Container> {
        Arc::new(FakeContainer {
            runtime: self.clone(),
            id,
            paths,
        })
    }

    fn set(&self, id: &str, status: Status, cause: Option<DeathCause>) {
        if let Some(found) = lock(&self.inner).containers.get_mut(id) {
            found.status = status;
            found.cause = cause;
        }
        self.changed();
    }
}

/// `Arc<FakeRuntime>` as the agent holds it.
#[derive(Debug)]
pub(crate) struct FakeRuntimeHandle(pub Arc<FakeRuntime>);

impl ContainerRuntime for FakeRuntimeHandle {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn bridge_available(&self) -> bool {
        false
    }

    fn container_ids(&self) -> oci::Result<Vec<String>> {
        Ok(lock(&self.0.inner).containers.keys().cloned().collect())
    }

    fn container(&self, id: SandboxId, paths: SandboxPaths) -> Arc<dyn Container> {
        self.0.handle(id, paths)
    }

    fn launch<'a>(
        &'a self,
        config: &'a SandboxConfig,
    ) -> BoxFuture<'a, oci::Result<Arc<dyn Container>>> {
        Box::pin(async move {
            let id = config.id.to_string();
            self.0.record(Call::Launch(id.clone()));
            let fault = lock(&self.0.inner).launch_faults.pop_front();
            if let Some(error) = fault {
                return Err(error);
            }
            // The real init would freeze at once without a deadline.
            if let Some(dir) = &config.lease_dir
                && let Err(err) = oci::lease::read_deadline(dir)
            {
                return Err(Error::Invalid(format!(
                    "launched without a lease deadline: {err}"
                )));
            }
            lock(&self.0.inner).containers.insert(
                id,
                FakeBox {
                    status: Status::Running,
                    cause: None,
                },
            );
            self.0.changed();
            Ok(self.0.handle(config.id.clone(), config.paths.clone()))
        })
    }
}

#[derive(Debug)]
struct FakeContainer {
    runtime: Arc<FakeRuntime>,
    id: SandboxId,
    paths: SandboxPaths,
}

impl FakeContainer {
    fn key(&self) -> String {
        self.id.to_string()
    }

    fn status(&self) -> Option<(Status, Option<DeathCause>)> {
        lock(&self.runtime.inner)
            .containers
            .get(self.id.as_str())
            .map(|b| (b.status, b.cause))
    }

    fn missing(&self) -> Error {
        Error::NotFound { id: self.key() }
    }
}

impl Container for FakeContainer {
    fn id(&self) -> &SandboxId {
        &self.id
    }

    fn paths(&self) -> &SandboxPaths {
        &self.paths
    }

    fn start(&self) -> BoxFuture<'_, oci::Result<()>> {
        Box::pin(async move {
            self.runtime.record(Call::Start(self.key()));
            self.status().ok_or_else(|| self.missing())?;
            self.runtime.set(self.id.as_str(), Status::Running, None);
            Ok(())
        })
    }

    fn state(&self) -> BoxFuture<'_, oci::Result<Option<RuntimeState>>> {
        Box::pin(async move {
            Ok(self.status().map(|(status, _)| RuntimeState {
                status,
                init_pid: (status != Status::Stopped).then_some(4242),
            }))
        })
    }

    fn observe(&self) -> BoxFuture<'_, oci::Result<Observation>> {
        Box::pin(async move {
            lock(&self.runtime.inner).observations += 1;
            Ok(match self.status() {
                None => Observation::Missing,
                Some((Status::Created, _)) => Observation::Created { init_pid: None },
                Some((Status::Running, _)) => Observation::Running { init_pid: 4242 },
                Some((Status::Paused, _)) => Observation::Paused { init_pid: 4242 },
                Some((_, cause)) => {
                    Observation::Stopped(cause.unwrap_or(DeathCause::WorkloadExited { end: None }))
                }
            })
        })
    }

    fn kill(&self, signal: Signal) -> BoxFuture<'_, oci::Result<()>> {
        Box::pin(async move {
            self.runtime.record(Call::Kill(self.key(), signal));
            let (status, _) = self.status().ok_or_else(|| self.missing())?;
            // A frozen task cannot die: a paused container's kill lands
            // once it is resumed.
            if signal == Signal::Kill && status != Status::Paused {
                let cause = DeathCause::WorkloadExited { end: None };
                self.runtime
                    .set(self.id.as_str(), Status::Stopped, Some(cause));
            }
            Ok(())
        })
    }

    fn pause(&self) -> BoxFuture<'_, oci::Result<()>> {
        Box::pin(async move {
            self.runtime.record(Call::Pause(self.key()));
            let fault = lock(&self.runtime.inner).pause_fault;
            match fault {
                Some(PauseFault::Fails) => {
                    return Err(Error::Invalid("pause failed (told to)".to_owned()));
                }
                Some(PauseFault::Hangs) => std::future::pending::<()>().await,
                None => {}
            }
            self.status().ok_or_else(|| self.missing())?;
            self.runtime.set(self.id.as_str(), Status::Paused, None);
            Ok(())
        })
    }

    fn resume(&self) -> BoxFuture<'_, oci::Result<()>> {
        Box::pin(async move {
            self.runtime.record(Call::Resume(self.key()));
            let (_, cause) = self.status().ok_or_else(|| self.missing())?;
            // Killed while paused: the kill lands now.
            let killed = lock(&self.runtime.inner)
                .calls
                .iter()
                .rev()
                .take_while(|(_, c)| *c != Call::Pause(self.key()))
                .any(|(_, c)| *c == Call::Kill(self.key(), Signal::Kill));
            if killed {
                let cause = Some(DeathCause::WorkloadExited { end: None });
                self.runtime.set(self.id.as_str(), Status::Stopped, cause);
            } else {
                self.runtime.set(self.id.as_str(), Status::Running, cause);
            }
            Ok(())
        })
    }

    fn stop(&self, _grace: Duration) -> BoxFuture<'_, oci::Result<DeathCause>> {
        Box::pin(async move {
            self.runtime.record(Call::Stop(self.key()));
            let mut changes = self.runtime.version.subscribe();
            while lock(&self.runtime.inner).stops_held {
                if changes.changed().await.is_err() {
                    break;
                }
            }
            self.status().ok_or_else(|| self.missing())?;
            let cause = DeathCause::WorkloadExited { end: None };
            self.runtime
                .set(self.id.as_str(), Status::Stopped, Some(cause));
            Ok(cause)
        })
    }

    fn wait_for_exit(&self) -> BoxFuture<'_, oci::Result<DeathCause>> {
        Box::pin(async move {
            let mut changes = self.runtime.version.subscribe();
            loop {
                match self.status() {
                    None => return Err(self.missing()),
                    Some((Status::Stopped, cause)) => {
                        return Ok(cause.unwrap_or(DeathCause::WorkloadExited { end: None }));
                    }
                    Some(_) => {}
                }
                if changes.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
    }

    fn delete(&self) -> BoxFuture<'_, oci::Result<()>> {
        Box::pin(async move {
            self.runtime.record(Call::Delete(self.key()));
            lock(&self.runtime.inner)
                .containers
                .remove(self.id.as_str());
            self.runtime.changed();
            Ok(())
        })
    }

    fn remove_files(&self) -> BoxFuture<'_, oci::Result<()>> {
        Box::pin(async move {
            self.runtime.record(Call::RemoveFiles(self.key()));
            lock(&self.runtime.inner)
                .containers
                .remove(self.id.as_str());
            self.runtime.changed();
            Ok(())
        })
    }

    fn exec_seen_running<'a>(
        &'a self,
        command: &'a CommandSpec,
    ) -> BoxFuture<'a, oci::Result<Box<dyn RunningCommand>>> {
        Box::pin(async move {
            self.runtime
                .record(Call::Exec(self.key(), command.argv.clone()));
            match self.status() {
                Some((Status::Running, _)) => {}
                Some((status, _)) => {
                    return Err(Error::NotRunning {
                        id: self.key(),
                        status,
                        op: "exec",
                    });
                }
                None => return Err(self.missing()),
            }
            let script = lock(&self.runtime.inner)
                .execs
                .pop_front()
                .unwrap_or(ExecScript {
                    output: Vec::new(),
                    outcome: Outcome::Exited { code: 0 },
                });
            let (signaller, signals) = Signaller::channel();
            Ok(Box::new(FakeExec {
                script,
                signaller,
                _signals: signals,
            }) as Box<dyn RunningCommand>)
        })
    }

    /// The fake has no agent: its commands go the exec path.
    fn agent_incarnation(&self) -> BoxFuture<'_, oci::Result<Option<String>>> {
        Box::pin(async { Ok(None) })
    }

    fn run_in_agent<'a>(
        &'a self,
        _id: &'a str,
        _incarnation: &'a str,
        command: &'a CommandSpec,
        _from: [u64; 2],
    ) -> BoxFuture<'a, oci::Result<Box<dyn RunningCommand>>> {
        self.exec_seen_running(command)
    }

    fn forget_command<'a>(&'a self, _id: &'a str) -> BoxFuture<'a, oci::Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn open_stdin<'a>(
        &'a self,
        _id: &'a str,
    ) -> BoxFuture<'a, oci::Result<Box<dyn oci::CommandStdin>>> {
        Box::pin(async { Err(Error::Unsupported("the fake has no agent".to_owned())) })
    }

    fn resize_terminal<'a>(
        &'a self,
        _id: &'a str,
        _rows: u16,
        _cols: u16,
    ) -> BoxFuture<'a, oci::Result<()>> {
        Box::pin(async { Err(Error::Unsupported("the fake has no agent".to_owned())) })
    }
    fn read_file<'a>(
        &'a self,
        _path: &'a str,
        _offset: u64,
        _length: Option<u64>,
    ) -> BoxFuture<'a, oci::Result<(FileInfo, Box<dyn oci::FileDownload>)>> {
        Box::pin(async { Err(no_agent_files()) })
    }

    fn write_file<'a>(
        &'a self,
        _path: &'a str,
        _mode: Option<u32>,
        _parents: bool,
    ) -> BoxFuture<'a, oci::Result<Box<dyn oci::FileUpload>>> {
        Box::pin(async { Err(no_agent_files()) })
    }

    fn list_files<'a>(
        &'a self,
        _path: &'a str,
        _depth: u32,
    ) -> BoxFuture<'a, oci::Result<FileListing>> {
        Box::pin(async { Err(no_agent_files()) })
    }

    fn remove_file<'a>(
        &'a self,
        _path: &'a str,
        _recursive: bool,
    ) -> BoxFuture<'a, oci::Result<()>> {
        Box::pin(async { Err(no_agent_files()) })
    }

    fn move_file<'a>(
        &'a self,
        _from: &'a str,
        _to: &'a str,
        _overwrite: bool,
    ) -> BoxFuture<'a, oci::Result<()>> {
        Box::pin(async { Err(no_agent_files()) })
    }

    fn make_dir<'a>(
        &'a self,
        _path: &'a str,
        _parents: bool,
        _mode: Option<u32>,
    ) -> BoxFuture<'a, oci::Result<bool>> {
        Box::pin(async { Err(no_agent_files()) })
    }

    fn tar_read<'a>(
        &'a self,
        _path: &'a str,
    ) -> BoxFuture<'a, oci::Result<Box<dyn oci::FileDownload>>> {
        Box::pin(async { Err(no_agent_files()) })
    }

    fn tar_write<'a>(
        &'a self,
        _path: &'a str,
    ) -> BoxFuture<'a, oci::Result<Box<dyn oci::TarUpload>>> {
        Box::pin(async { Err(no_agent_files()) })
    }
}

/// The fake's containers have no agent, so no file operations.
fn no_agent_files() -> Error {
    Error::Unsupported("the fake has no agent".to_owned())
}

struct FakeExec {
    script: ExecScript,
    signaller: Signaller,
    _signals: tokio::sync::mpsc::Receiver<Signal>,
}

/// The pid every fake command has in its sandbox.
pub(crate) const FAKE_PID: i32 = 4242;

impl RunningCommand for FakeExec {
    fn signaller(&self) -> Signaller {
        self.signaller.clone()
    }

    fn pid(&self) -> Option<i32> {
        Some(FAKE_PID)
    }

    fn wait<'a>(
        self: Box<Self>,
        mut on_output: oci::seam::OnOutput<'a>,
    ) -> BoxFuture<'a, oci::Result<CommandEnd>> {
        Box::pin(async move {
            for (stream, bytes) in &self.script.output {
                on_output(*stream, bytes);
            }
            Ok(CommandEnd {
                outcome: self.script.outcome.clone(),
                runtime_status: Some(0),
                elapsed: Duration::ZERO,
            })
        })
    }
}

// ---------------------------------------------------------------------
// The control plane.

/// A request the agent made.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Request {
    Register(RegisterRequest),
    Heartbeat,
    Preempt,
    Assignments,
    Sandbox(String, SandboxReport),
    Command(String, CommandReport),
    Output(String, OutputStream, u64, Vec<u8>),
    Save(String, SaveReport),
    Snapshot(String, SnapshotReport),
    Kept(KeptCopyReport),
}

/// Which call a scripted answer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Register,
    Heartbeat,
    Preempt,
    Assignments,
    Sandbox,
    Command,
    Output,
    Save,
    Snapshot,
    Kept,
}

/// How the fake answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scripted {
    Ok,
    /// No answer from the server (transient).
    Unreachable,
    /// 409 `fenced`.
    Fenced,
    /// 409 `invalid_state` (permanent).
    Refused,
    /// No answer ever (a dead link after a partition).
    Hangs,
    /// 401 `unauthenticated`: the server does not know the credential.
    Unauthenticated,
}

impl Scripted {
    fn error(self) -> Option<ClientError> {
        let api = |code: ErrorCode| ClientError::Api {
            status: 409,
            code,
            message: format!("{} (scripted)", code.as_str()),
            request_id: "req_fake".to_owned(),
            details: serde_json::Value::Null,
        };
        match self {
            Scripted::Ok | Scripted::Hangs => None,
            Scripted::Unreachable => Some(ClientError::Unreachable {
                url: "http://fake".to_owned(),
                message: "connection refused (scripted)".to_owned(),
            }),
            Scripted::Fenced => Some(api(ErrorCode::Fenced)),
            Scripted::Refused => Some(api(ErrorCode::InvalidState)),
            Scripted::Unauthenticated => Some(ClientError::Api {
                status: 401,
                code: ErrorCode::Unauthenticated,
                message: "missing or unknown bearer token (scripted)".to_owned(),
                request_id: "req_fake".to_owned(),
                details: serde_json::Value::Null,
            }),
        }
    }
}

#[derive(Debug, Default)]
struct ControlInner {
    requests: Vec<(Duration, Request)>,
    /// Answers to use first, per call, then `modes`.
    next: HashMap<Kind, VecDeque<Scripted>>,
    modes: HashMap<Kind, Scripted>,
    /// Kept copies reported from now on are to be deleted.
    discard_kept: bool,
    /// Long-polls answered `unchanged` (their timeout passed on the same
    /// etag).
    unchanged_answers: usize,
}

/// A control plane that records requests and answers from a script.
#[derive(Debug)]
pub(crate) struct FakeControl {
    inner: Mutex<ControlInner>,
    version: watch::Sender<u64>,
    clock: Arc<ManualClock>,
    /// What the assignments long-poll answers (etag `""` at first: a poll
    /// waits until [`FakeControl::assign`]).
    assignments: watch::Sender<Assignments>,
    /// The credential calls go with, as the agent set it.
    credential: std::sync::Mutex<Option<String>>,
    /// Where block transfers go; `None`: a closed port.
    blocks_url: std::sync::Mutex<Option<String>>,
}

/// The credential the fake hands a runner registering without one.
pub(crate) const FAKE_CREDENTIAL: &str = "roost_runnercred_fake";

/// What registration answers: a 9 s lease, beats every 3 s, freeze 6 s
/// after the last answered one was sent.
pub(crate) const LEASE_TTL_MS: u64 = 9_000;
pub(crate) const HEARTBEAT_MS: u64 = 3_000;
pub(crate) const FREEZE_AFTER_MS: u64 = 6_000;
/// The deployment's stop grace, as registration answers it.
pub(crate) const STOP_GRACE_MS: u64 = 4_000;

impl FakeControl {
    /// Block transfers go to `url` from now on.
    pub(crate) fn blocks_at(&self, url: &str) {
        *self
            .blocks_url
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(url.to_owned());
    }

    pub(crate) fn new(clock: Arc<ManualClock>) -> Arc<FakeControl> {
        Arc::new(FakeControl {
            inner: Mutex::new(ControlInner::default()),
            version: watch::channel(0).0,
            clock,
            credential: std::sync::Mutex::new(None),
            blocks_url: std::sync::Mutex::new(None),
            assignments: watch::channel(Assignments {
                etag: String::new(),
                unchanged: false,
                sandboxes: Vec::new(),
                commands: Vec::new(),
                kept: Vec::new(),
            })
            .0,
        })
    }

    /// From now on, calls of `kind` are answered `answer`.
    pub(crate) fn answer(&self, kind: Kind, answer: Scripted) {
        lock(&self.inner).modes.insert(kind, answer);
    }

    /// The next call of `kind` is answered `answer` (then the mode).
    pub(crate) fn answer_next(&self, kind: Kind, answer: Scripted) {
        lock(&self.inner)
            .next
            .entry(kind)
            .or_default()
            .push_back(answer);
    }

    pub(crate) fn requests(&self) -> Vec<Request> {
        lock(&self.inner)
            .requests
            .iter()
            .map(|(_, r)| r.clone())
            .collect()
    }

    /// The sandbox reports so far: (state, reason, message).
    pub(crate) fn sandbox_reports(&self) -> Vec<(SandboxState, Option<String>, Option<String>)> {
        self.requests()
            .into_iter()
            .filter_map(|r| match r {
                Request::Sandbox(_, report) => Some((report.state, report.reason, report.message)),
                _ => None,
            })
            .collect()
    }

    pub(crate) fn command_reports(&self) -> Vec<CommandReport> {
        self.requests()
            .into_iter()
            .filter_map(|r| match r {
                Request::Command(_, report) => Some(report),
                _ => None,
            })
            .collect()
    }

    pub(crate) async fn wait_until(&self, what: &str, done: impl Fn(&[Request]) -> bool) {
        wait_for(&self.inner, &self.version, what, |inner| {
            let requests: Vec<Request> = inner.requests.iter().map(|(_, r)| r.clone()).collect();
            done(&requests)
        })
        .await
    }

    /// Records `request` and answers as scripted for `kind`.
    async fn call(&self, kind: Kind, request: Request) -> Result<(), ClientError> {
        let answer = {
            let mut inner = lock(&self.inner);
            inner.requests.push((self.clock.elapsed(), request));
            let next = inner.next.get_mut(&kind).and_then(VecDeque::pop_front);
            next.or_else(|| inner.modes.get(&kind).copied())
                .unwrap_or(Scripted::Ok)
        };
        self.version.send_modify(|v| *v += 1);
        if answer == Scripted::Hangs {
            std::future::pending::<()>().await;
        }
        match answer.error() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Hands the runner `sandboxes` and `commands` as its assignments
    /// (a new etag: a waiting long-poll answers at once).
    pub(crate) fn assign(
        &self,
        sandboxes: Vec<SandboxAssignment>,
        commands: Vec<CommandAssignment>,
    ) {
        self.assignments.send_modify(|current| {
            let etag = current.etag.parse::<u64>().unwrap_or(0) + 1;
            *current = Assignments {
                etag: etag.to_string(),
                unchanged: false,
                sandboxes,
                commands,
                kept: Vec::new(),
            };
        });
    }

    /// How many long-polls were answered `unchanged`.
    pub(crate) fn unchanged_answers(&self) -> usize {
        lock(&self.inner).unchanged_answers
    }

    /// From now on, kept copies reported are answered `keep: false`.
    pub(crate) fn discard_kept(&self) {
        lock(&self.inner).discard_kept = true;
    }
}

impl ControlPlane for FakeControl {
    fn runner_register<'a>(&'a self, request: &'a RegisterRequest) -> Answer<'a, RegisterResponse> {
        Box::pin(async move {
            self.call(Kind::Register, Request::Register(request.clone()))
                .await?;
            Ok(RegisterResponse {
                runner_id: "rnr_fake".to_owned(),
                runner_token: (!self.has_credential()).then(|| FAKE_CREDENTIAL.to_owned()),
                lease_ttl_ms: LEASE_TTL_MS,
                heartbeat_interval_ms: HEARTBEAT_MS,
                freeze_after_ms: FREEZE_AFTER_MS,
                stop_grace_ms: STOP_GRACE_MS,
            })
        })
    }

    fn runner_heartbeat<'a>(&'a self, _request: &'a HeartbeatRequest) -> Answer<'a, ()> {
        Box::pin(async move { self.call(Kind::Heartbeat, Request::Heartbeat).await })
    }

    fn runner_preempt<'a>(&'a self, request: &'a PreemptRequest) -> Answer<'a, RunnerRecord> {
        Box::pin(async move {
            self.call(Kind::Preempt, Request::Preempt).await?;
            Ok(RunnerRecord {
                id: request.runner_id.clone(),
                name: "fake".to_owned(),
                placement_class: "on_demand".to_owned(),
                state: "live".to_owned(),
                lease_expires_at: String::new(),
                registered_at: String::new(),
                drain: Some("preempt".to_owned()),
                sandboxes: 0,
                capabilities: Vec::new(),
                labels: BTreeMap::new(),
            })
        })
    }

    /// Answers at once when the assignments differ from `etag`, else when
    /// they change or `wait_s` has passed on the clock.
    fn runner_assignments<'a>(
        &'a self,
        _runner_id: &'a str,
        etag: &'a str,
        wait_s: u64,
    ) -> Answer<'a, Assignments> {
        Box::pin(async move {
            self.call(Kind::Assignments, Request::Assignments).await?;
            let mut current = self.assignments.subscribe();
            let mut waited = self.clock.sleep(Duration::from_secs(wait_s));
            loop {
                if current.borrow_and_update().etag != etag {
                    break;
                }
                tokio::select! {
                    changed = current.changed() => {
                        if changed.is_err() {
                            break;
                        }
                    }
                    () = &mut waited => break,
                }
            }
            let answer = current.borrow().clone();
            if answer.etag == etag {
                // As the server may answer a runner that takes it.
                lock(&self.inner).unchanged_answers += 1;
                return Ok(Assignments {
                    etag: answer.etag,
                    unchanged: true,
                    sandboxes: Vec::new(),
                    commands: Vec::new(),
                    kept: Vec::new(),
                });
            }
            Ok(answer)
        })
    }

    fn runner_report_sandbox<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SandboxReport,
    ) -> Answer<'a, ()> {
        Box::pin(async move {
            self.call(
                Kind::Sandbox,
                Request::Sandbox(sandbox_id.to_owned(), report.clone()),
            )
            .await
        })
    }

    fn runner_report_command<'a>(
        &'a self,
        command_id: &'a str,
        report: &'a CommandReport,
    ) -> Answer<'a, ()> {
        Box::pin(async move {
            self.call(
                Kind::Command,
                Request::Command(command_id.to_owned(), report.clone()),
            )
            .await
        })
    }

    fn runner_append_output<'a>(
        &'a self,
        command_id: &'a str,
        stream: OutputStream,
        _placement: (&'a str, u64),
        offset: u64,
        data: Vec<u8>,
    ) -> Answer<'a, u64> {
        Box::pin(async move {
            let end = offset + data.len() as u64;
            self.call(
                Kind::Output,
                Request::Output(command_id.to_owned(), stream, offset, data),
            )
            .await?;
            Ok(end)
        })
    }

    fn runner_report_save<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SaveReport,
    ) -> Answer<'a, ()> {
        Box::pin(async move {
            self.call(
                Kind::Save,
                Request::Save(sandbox_id.to_owned(), report.clone()),
            )
            .await
        })
    }

    fn runner_report_snapshot<'a>(
        &'a self,
        snapshot_id: &'a str,
        report: &'a SnapshotReport,
    ) -> Answer<'a, ()> {
        Box::pin(async move {
            self.call(
                Kind::Snapshot,
                Request::Snapshot(snapshot_id.to_owned(), report.clone()),
            )
            .await
        })
    }

    /// Keeps every copy, unless [`FakeControl::discard_kept`] was called.
    fn runner_report_kept<'a>(&'a self, report: &'a KeptCopyReport) -> Answer<'a, KeptCopyAnswer> {
        Box::pin(async move {
            self.call(Kind::Kept, Request::Kept(report.clone())).await?;
            let keep = !lock(&self.inner).discard_kept;
            Ok(KeptCopyAnswer {
                copy_id: Some("kpt_fake".to_owned()),
                keep,
                reason: if keep { "unsaved_writes" } else { "discarded" }.to_owned(),
            })
        })
    }

    /// No fake sandbox asks for secrets: none are held.
    fn runner_secrets<'a>(
        &'a self,
        _sandbox_id: &'a str,
        _request: &'a api::runners::SecretsRequest,
    ) -> Answer<'a, api::runners::SecretValues> {
        Box::pin(async move {
            Ok(api::runners::SecretValues {
                secrets: Vec::new(),
            })
        })
    }

    /// Block transfers are not faked: a client of a closed port, so
    /// every transfer fails as unreachable, unless a test named a block
    /// service of its own ([`FakeControl::blocks_at`]).
    fn blocks(&self) -> RemoteBackend {
        let url = self
            .blocks_url
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .unwrap_or_else(|| "http://127.0.0.1:9".to_owned());
        RemoteBackend::new(Client::new(&url, "fake"), tokio::runtime::Handle::current())
    }

    fn use_credential(&self, credential: Option<&str>) {
        let mut current = self
            .credential
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *current = credential.map(str::to_owned);
    }

    fn has_credential(&self) -> bool {
        self.credential
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }
}

// ---------------------------------------------------------------------
// The agent over the fakes.

/// The agent's shared state over the fakes, and the fakes.
pub(crate) struct Agent {
    pub shared: Arc<Shared>,
    pub runtime: Arc<FakeRuntime>,
    pub control: Arc<FakeControl>,
    pub clock: Arc<ManualClock>,
    /// Holds the data dir.
    _dir: tempfile::TempDir,
}

/// Builds the agent's `Shared` over fresh fakes and a temporary data dir,
/// registered as `rnr_fake`.
pub(crate) fn agent(failpoint: Failpoints) -> Agent {
    let dir = tempfile::tempdir().expect("a temporary data dir");
    let clock = ManualClock::new();
    let runtime = FakeRuntime::new(clock.clone());
    let control = FakeControl::new(clock.clone());
    let shared = shared_over(dir.path(), &runtime, &control, &clock, failpoint);
    Agent {
        shared,
        runtime,
        control,
        clock,
        _dir: dir,
    }
}

fn shared_over(
    root: &Path,
    runtime: &Arc<FakeRuntime>,
    control: &Arc<FakeControl>,
    clock: &Arc<ManualClock>,
    failpoint: Failpoints,
) -> Arc<Shared> {
    let data = DataDir::open(&root.join("runner")).expect("the data dir opens");
    let mut config = AgentConfig::new(
        "http://fake",
        "token",
        data.root().to_path_buf(),
        InitProgram {
            host_path: "/nonexistent/roost".into(),
            args: vec!["init".to_owned()],
        },
    );
    config.failpoint = failpoint.clone();
    let images = Arc::new(images::Images::open(data.root(), None).expect("the images dir opens"));
    let homes = homes::Homes::open(data.root(), None, failpoint).expect("homes open");
    let clock: Arc<dyn Clock> = clock.clone();
    // Registered before: the runner holds its own credential.
    control.use_credential(Some(FAKE_CREDENTIAL));
    Arc::new(Shared {
        control: control.clone(),
        runner_id: Mutex::new("rnr_fake".to_owned()),
        runtime: Arc::new(FakeRuntimeHandle(runtime.clone())),
        fence: fence::Fence::new(data.root().join("fence.json"), clock.clone()),
        clock,
        data,
        images,
        homes,
        config,
        kept_syncing: Default::default(),
        reports_accepted: Default::default(),
        stop_grace_ms: Default::default(),
        data_path: None,
    })
}

/// A sandbox assignment: `desired` over `state` at `epoch`, standard
/// storage, the default image, no network.
pub(crate) fn assignment(
    id: &str,
    epoch: u64,
    desired: DesiredState,
    state: SandboxState,
) -> SandboxAssignment {
    SandboxAssignment {
        sandbox_id: id.to_owned(),
        org_id: "org_fake".to_owned(),
        epoch,
        desired,
        state,
        image: "default".to_owned(),
        image_root: None,
        storage_class: StorageClass::Standard,
        resources: Default::default(),
        network: api::Network::None,
        env: BTreeMap::new(),
        home_root: None,
        save_interval_s: None,
        snapshots: Vec::new(),
        mounts: Vec::new(),
        secrets: Vec::new(),
    }
}

/// A command handed over for `sandbox` at `epoch`, not yet launched.
pub(crate) fn command(id: &str, sandbox: &str, epoch: u64, argv: &[&str]) -> CommandAssignment {
    CommandAssignment {
        command_id: id.to_owned(),
        sandbox_id: sandbox.to_owned(),
        epoch,
        argv: argv.iter().map(|a| (*a).to_owned()).collect(),
        env: BTreeMap::new(),
        cwd: None,
        timeout: None,
        signal: None,
        signal_seq: 0,
        signals: Vec::new(),
        state: CommandState::Starting,
        stdin: false,
        tty: None,
    }
}
