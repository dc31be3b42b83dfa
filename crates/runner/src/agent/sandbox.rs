//! One worker per sandbox, level-triggered: each pass observes the
//! container, compares that with the assignment's desired and recorded
//! states ([`decide`]), acts, and reports what it then observes, with the
//! placement's epoch. Passes run when the assignment changes, when the
//! container's init dies (a watcher on its pidfd), after a failed step (with
//! a backoff) and every [`RESYNC_SECONDS`] regardless. While the runner is
//! frozen (it cannot renew its lease, see `fence`) no pass runs: a pass
//! would resume what the freeze paused. A thaw runs a fresh pass at once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use api::lifecycle::{DesiredState, SandboxState, StorageClass};
use api::runners::{CommandAssignment, SandboxAssignment, SandboxReport, WakeReport};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::assignment;
use super::command::{self, CommandJob};
use super::dirs::CommandFiles;
use super::homes::{Homes, NotReady, SaveFailure, StoreWait};
use super::{Backoff, Refusal, Shared, refusal};
use oci::Error;
use oci::config::{RootImage, SandboxId};
use oci::seam::Container;
use oci::{DeathCause, Observation};

/// A pass runs at least this often, to catch what no event announced.
const RESYNC_SECONDS: u64 = 10;
/// How long a stop or a death waits for the sandbox's commands to report
/// their own ends before the sandbox's state is reported.
const COMMANDS_SETTLE_MS: u64 = 1_500;
/// Launch attempts that fail for a reason that may pass (a runtime that
/// could not be started, an I/O error) before the sandbox is failed.
const LAUNCH_ATTEMPTS_MAX: u32 = 3;
/// First and longest pause between launch attempts that wait for the
/// store (out of reach or full): a store outage is waited out, however
/// long, without a request a second from every sandbox waiting on it.
const STORE_RETRY_MIN_MS: u64 = 1_000;
const STORE_RETRY_MAX_MS: u64 = 15_000;
/// Pauses before securing a home again after the room for it ran out (the
/// store's, the org's bound on it, this runner's disk): doubling from 5 s
/// to a minute (the block service's `Retry-After` for an org past its
/// bound), since each attempt scans the home and seconds free no room.
const SECURE_FULL_RETRY_MIN_MS: u64 = 5_000;
const SECURE_FULL_RETRY_MAX_MS: u64 = 60_000;

/// A sandbox's assignment and the commands handed over for it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Assigned {
    pub sandbox: SandboxAssignment,
    pub commands: Vec<CommandAssignment>,
    /// How many sandbox reports the server had accepted from this runner
    /// (`Shared::reports_accepted`) when these assignments were asked for.
    /// A report accepted later may be missing from `sandbox.state`: the
    /// worker then goes by what it reported (see [`Worker::current`]).
    pub reports_before: u64,
}

impl Assigned {
    /// The same assignment and commands, however recent the view.
    pub(crate) fn same_as(&self, other: &Assigned) -> bool {
        self.sandbox == other.sandbox && self.commands == other.commands
    }
}

/// What the runtime shows, reduced to what decisions depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    Missing,
    Created,
    Running,
    Paused,
    Stopped,
}

impl Seen {
    fn of(observation: &Observation) -> Seen {
        match observation {
            Observation::Missing => Seen::Missing,
            Observation::Created { .. } => Seen::Created,
            Observation::Running { .. } => Seen::Running,
            Observation::Paused { .. } => Seen::Paused,
            Observation::Stopped(_) => Seen::Stopped,
        }
    }

    fn has_compute(self) -> bool {
        matches!(self, Seen::Created | Seen::Running | Seen::Paused)
    }
}

/// One step of a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Desired and observed agree.
    Idle,
    /// Create and start the container (removing a dead one of an earlier
    /// placement first).
    Launch,
    /// A created container not yet started (the runner died in between).
    Start,
    Resume,
    ReportRunning,
    /// The init died on its own: `failed` with its cause.
    ReportDeath,
    /// The record says running, the runtime has no such container.
    ReportVanished,
    /// Stop the container (SIGTERM, SIGKILL after the grace), keep its
    /// files, then report `end`; `stopping` first when not yet reported.
    Stop {
        report_stopping: bool,
        end: End,
    },
    /// Nothing runs any more: clear a dead container, report `end`.
    Finish {
        end: End,
    },
    /// The record says no compute, yet a container is there: kill it.
    Kill,
    /// A dead container with nothing left to report: remove it (its files
    /// stay).
    ClearCorpse,
    /// Kill everything, remove every file and the home, report `deleted`.
    Delete,
}

/// Where a stop ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    /// `stopped` (`stop_requested`): the home stays, start comes back here.
    Stopped,
    /// `terminated` (`ttl_expired`): final; storage stays until delete.
    Terminated,
}

impl End {
    fn state(self) -> SandboxState {
        match self {
            End::Stopped => SandboxState::Stopped,
            End::Terminated => SandboxState::Terminated,
        }
    }

    fn reason(self) -> &'static str {
        match self {
            End::Stopped => "stop_requested",
            End::Terminated => "ttl_expired",
        }
    }
}

/// The decision table: what to do given the desired state, the state the
/// server last recorded, what the runtime shows, and whether this process
/// launched the container for this placement. Pure, so it is tested alone.
pub(crate) fn decide(
    desired: DesiredState,
    recorded: SandboxState,
    seen: Seen,
    launched_here: bool,
) -> Action {
    use Action::*;
    if desired == DesiredState::Deleted {
        return Delete;
    }
    let settled = |seen: Seen| match seen {
        Seen::Missing => Idle,
        Seen::Stopped => ClearCorpse,
        _ => Kill,
    };
    if recorded.is_terminal() {
        return settled(seen);
    }
    match desired {
        DesiredState::Running => match recorded {
            SandboxState::Starting => match seen {
                Seen::Missing => Launch,
                Seen::Created => Start,
                Seen::Paused => Resume,
                Seen::Running => ReportRunning,
                // Died before it was ever reported running.
                Seen::Stopped if launched_here => ReportDeath,
                // A dead container of an earlier placement.
                Seen::Stopped => Launch,
            },
            SandboxState::Running => match seen {
                Seen::Running => Idle,
                Seen::Paused => Resume,
                Seen::Created => Start,
                Seen::Stopped => ReportDeath,
                Seen::Missing => ReportVanished,
            },
            // Started again while stopping (the server keeps the placement
            // until the stop is reported): if it still runs, it runs; if it
            // is already down, it runs again, on the same home.
            SandboxState::Stopping => match seen {
                Seen::Running => ReportRunning,
                Seen::Paused => Resume,
                Seen::Created => Start,
                Seen::Stopped | Seen::Missing => Launch,
            },
            // Waiting to be placed (again): no compute meanwhile.
            _ => settled(seen),
        },
        DesiredState::Stopped | DesiredState::Terminated => {
            let end = if desired == DesiredState::Stopped {
                End::Stopped
            } else {
                End::Terminated
            };
            match recorded {
                SandboxState::Stopped if end == End::Stopped => settled(seen),
                _ if seen.has_compute() => Stop {
                    report_stopping: recorded != SandboxState::Stopping,
                    end,
                },
                _ => Finish { end },
            }
        }
        DesiredState::Deleted => Delete,
    }
}

/// Whether `action` (on a container seen so) runs the sandbox here for the
/// assignment's placement: then its init's lease is renewed with this
/// runner's (`fence::Fence::hold`). Adopting a running container counts
/// (a restarted runner thaws what its inits froze by renewing).
fn runs_here(action: Action, seen: Seen) -> bool {
    match action {
        Action::Launch | Action::Start | Action::Resume | Action::ReportRunning => true,
        Action::Idle => seen == Seen::Running,
        _ => false,
    }
}

/// A report the server accepted: the state it recorded, at which epoch,
/// and its number in `Shared::reports_accepted`.
#[derive(Clone, Copy, Debug)]
struct Accepted {
    epoch: u64,
    state: SandboxState,
    seq: u64,
}

/// What to do after a pass.
/// A snapshot of a stopped sandbox's home, being captured and uploaded.
struct SnapshotTask {
    task: JoinHandle<()>,
    /// It reads the home itself (taken at rest), not a read-only copy.
    reads_live_home: bool,
    /// Set once the snapshot is replicated (or its placement fenced):
    /// nothing more to do for it here.
    done: Arc<AtomicBool>,
    /// Attempts that ended without that, in a row.
    failures: u32,
    /// When a failed attempt is tried again (set at the first pass that
    /// finds it failed).
    retry_at: Option<tokio::time::Instant>,
}

/// The pause before a failed snapshot is tried again, doubled with each
/// failure in a row up to [`SNAPSHOT_RETRY_MAX`]: a snapshot keeps trying
/// until it is replicated or its deadline fails it (DESIGN §3), without
/// scanning the home every pass while the store is out of reach.
const SNAPSHOT_RETRY_MIN: Duration = Duration::from_secs(5);
const SNAPSHOT_RETRY_MAX: Duration = Duration::from_secs(300);

/// How often a launch held back by a snapshot reading the home looks
/// again.
const SNAPSHOT_READ_POLL: Duration = Duration::from_millis(200);

enum Next {
    /// Wait for an event (or the resync).
    Idle,
    /// A step failed in a way that may pass: run again after a pause.
    Retry,
    /// Run again after this pause: the one a launch waiting for the
    /// store announced, or a securing's after the room ran out.
    RetryIn(Duration),
}

/// A running command task; aborted (killing the command) when dropped.
struct CommandTask {
    task: JoinHandle<()>,
    signal: watch::Sender<command::SignalRequest>,
}

impl Drop for CommandTask {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Worker {
    shared: Arc<Shared>,
    id: SandboxId,
    handle: Arc<dyn Container>,
    home: PathBuf,
    files: CommandFiles,
    /// Fires when the running container's init dies.
    watcher: Option<JoinHandle<()>>,
    /// The epoch this process launched a container for.
    launched_epoch: Option<u64>,
    /// A placement the server fenced this runner from: nothing more is done
    /// for it (or an earlier one).
    fenced_epoch: Option<u64>,
    launch_failures: u32,
    /// Pauses between launch attempts that wait for the store; reset by a
    /// launch that got past the store.
    store_backoff: Backoff,
    /// Pauses between securings refused for room; reset by one that
    /// completes.
    secure_full_backoff: Backoff,
    commands: HashMap<String, CommandTask>,
    /// The sandbox was deleted and reported so: nothing is left here.
    deleted: bool,
    /// The last state reported and accepted, with its place in
    /// `Shared::reports_accepted`: an older view of the record is read as
    /// this (see [`Worker::current`]); changes are logged once.
    accepted: Option<Accepted>,
    /// What the last pass saw.
    last_seen: Option<Seen>,
    /// Saves a running durable home on its schedule (for one epoch).
    saver: Option<(u64, JoinHandle<()>)>,
    /// Snapshots being captured and uploaded, by id.
    snapshots: HashMap<String, SnapshotTask>,
    /// What the last wake of a durable home downloaded, until reported.
    wake: Option<WakeReport>,
    /// The newest assignment, as the server last answered it: a stop under
    /// way looks at it for commands handed over since its pass began.
    latest: watch::Receiver<Option<Assigned>>,
}

/// Runs one sandbox's worker until its sender is dropped (the runner
/// stops: the container keeps running) or the sandbox is no longer
/// assigned (then it is removed).
pub(crate) async fn run(
    shared: Arc<Shared>,
    id: SandboxId,
    mut assigned: watch::Receiver<Option<Assigned>>,
) {
    let paths = match shared.data.sandbox_paths(&id) {
        Ok(paths) => paths,
        Err(err) => {
            tracing::error!(sandbox_id = %id, %err, "cannot place this sandbox's files");
            return;
        }
    };
    let mut worker = Worker {
        handle: shared.runtime.container(id.clone(), paths),
        home: shared
            .homes
            .path(id.as_str())
            .unwrap_or_else(|_| shared.data.home(&id)),
        files: shared.data.commands(&id),
        shared,
        id,
        watcher: None,
        launched_epoch: None,
        fenced_epoch: None,
        launch_failures: 0,
        store_backoff: Backoff::between(STORE_RETRY_MIN_MS, STORE_RETRY_MAX_MS),
        secure_full_backoff: Backoff::between(SECURE_FULL_RETRY_MIN_MS, SECURE_FULL_RETRY_MAX_MS),
        commands: HashMap::new(),
        deleted: false,
        accepted: None,
        last_seen: None,
        saver: None,
        snapshots: HashMap::new(),
        wake: None,
        latest: assigned.clone(),
    };
    let mut frozen = worker.shared.fence.subscribe();
    let mut backoff = Backoff::new();
    // Whether the next pass must ask the runtime (not the first, after a
    // timer or a death, or when the sandbox's own assignment changed).
    let mut fresh = true;
    loop {
        if *frozen.borrow_and_update() {
            // Nothing is done while frozen, not even a removal; the
            // assignment is read again after the thaw.
            tokio::select! {
                changed = frozen.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                changed = assigned.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
            fresh = true;
            continue;
        }
        let current = assigned.borrow_and_update().clone();
        let Some(current) = current else {
            worker.leave().await;
            // Assigned again while it was being removed: carry on.
            if assigned.borrow_and_update().is_some() {
                continue;
            }
            return;
        };
        let pause = match worker.pass(&current, fresh).await {
            // At rest (stopped as wanted, no container): nothing to look
            // at until the assignment changes. No timer per asleep
            // sandbox: a sleeping fleet costs the runner nothing.
            Next::Idle if worker.at_rest(&current.sandbox) => None,
            Next::Idle => {
                backoff = Backoff::new();
                Some(Duration::from_secs(RESYNC_SECONDS))
            }
            Next::Retry => Some(backoff.next()),
            Next::RetryIn(pause) => Some(pause),
        };
        let timer = async {
            match pause {
                Some(pause) => worker.shared.clock.sleep(pause).await,
                None => std::future::pending().await,
            }
        };
        let watcher = async {
            match worker.watcher.as_mut() {
                Some(watcher) => {
                    let _ = watcher.await;
                }
                None => std::future::pending().await,
            }
        };
        fresh = true;
        tokio::select! {
            changed = assigned.changed() => {
                if changed.is_err() {
                    // The runner is stopping; the container stays.
                    return;
                }
                let next = assigned.borrow();
                fresh = next.as_ref().is_none_or(|next| next.sandbox != current.sandbox);
            }
            changed = frozen.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = watcher => {
                worker.watcher = None;
            }
            () = timer => {}
        }
    }
}

impl Worker {
    /// Stopped as its record wants, with no container and nothing
    /// watched: only an assignment change gives it anything to do.
    fn at_rest(&self, sandbox: &SandboxAssignment) -> bool {
        sandbox.desired == DesiredState::Stopped
            && sandbox.state == SandboxState::Stopped
            && self.last_seen == Some(Seen::Missing)
            && self.watcher.is_none()
            && self.commands.is_empty()
            && !self.snapshots_unsettled()
    }

    /// The assignment as of now. Assignments asked for before this
    /// worker's last report was accepted can still show the state before
    /// it (a long-poll answered while the report was on its way): acting on
    /// that would undo the report (launching what was just stopped, or
    /// calling the stopped container vanished). Such a view of the same
    /// placement is read with the state this worker reported; the server
    /// moved the record there, and nothing but this worker's reports moves
    /// a placement's state on (a start, a recovery or a delete that moves
    /// it elsewhere changes the epoch or the desired state, which decide
    /// first).
    fn current(&self, assigned: &Assigned) -> SandboxAssignment {
        let mut sandbox = assigned.sandbox.clone();
        if let Some(accepted) = self.accepted
            && accepted.epoch == sandbox.epoch
            && assigned.reports_before < accepted.seq
        {
            sandbox.state = accepted.state;
        }
        sandbox
    }

    /// One pass. Without `fresh`, only the commands changed: if the init
    /// was seen running and its pidfd watcher has not fired since, it is
    /// still running, and the runtime is not asked again (that costs a
    /// process spawn per exec).
    async fn pass(&mut self, assigned: &Assigned, fresh: bool) -> Next {
        let sandbox = &self.current(assigned);
        if self
            .fenced_epoch
            .is_some_and(|fenced| sandbox.epoch <= fenced)
        {
            return Next::Idle;
        }
        let watched_alive = self.watcher.as_ref().is_some_and(|w| !w.is_finished());
        let observation = if !fresh && watched_alive && self.last_seen == Some(Seen::Running) {
            Observation::Running { init_pid: 0 }
        } else {
            match self.handle.observe().await {
                Ok(observation) => observation,
                Err(err) => {
                    tracing::warn!(sandbox_id = %self.id, %err, "cannot observe the container");
                    self.last_seen = None;
                    return Next::Retry;
                }
            }
        };
        let mut seen = Seen::of(&observation);
        let launched_here = self.launched_epoch == Some(sandbox.epoch);
        if seen != Seen::Missing
            && sandbox.state == SandboxState::Starting
            && !launched_here
            && self.launched_for_earlier_placement(sandbox.epoch)
        {
            // A container of a placement the server has since ended (this
            // runner lost its lease; its init froze it), met by a new
            // placement here: its processes are not this placement's (the
            // record ended their commands), and its home may hold writes
            // no save has. It goes before anything renews its lease (that
            // would thaw it); the launch keeps the home aside and restores
            // the record's.
            tracing::warn!(sandbox_id = %self.id, epoch = sandbox.epoch, "a container of an earlier placement is here; removing it before this placement launches");
            self.unwatch();
            if let Err(err) = self.handle.delete().await {
                return self.failed_step(sandbox, Step::Local(err)).await;
            }
            seen = Seen::Missing;
        }
        self.last_seen = Some(seen);
        let action = decide(sandbox.desired, sandbox.state, seen, launched_here);
        if matches!(action, Action::Launch | Action::Start | Action::Resume) {
            self.drop_unassigned_snapshots(sandbox);
            if self.snapshot_reads_home() {
                tracing::info!(sandbox_id = %self.id, "a snapshot is reading the stopped home; the launch waits for it");
                return Next::RetryIn(SNAPSHOT_READ_POLL);
            }
        }
        if action != Action::Idle {
            tracing::debug!(sandbox_id = %self.id, desired = %sandbox.desired, recorded = %sandbox.state, ?seen, ?action, "acting");
        }
        if runs_here(action, seen) {
            // Written afresh before a launch: its init needs a deadline
            // from the start (an old file may hold a lapsed one).
            let held = self
                .shared
                .fence
                .hold(
                    &self.id,
                    self.handle.paths().lease(),
                    action == Action::Launch,
                )
                .await;
            match held {
                Ok(()) => {}
                Err(err) if action == Action::Launch => {
                    return self.failed_step(sandbox, Step::Local(err)).await;
                }
                // Held all the same: the next renewal writes it again.
                Err(err) => {
                    tracing::warn!(sandbox_id = %self.id, %err, "cannot write the sandbox's lease deadline")
                }
            }
        }
        if sandbox.desired != DesiredState::Running
            || matches!(action, Action::ReportDeath | Action::ReportVanished)
        {
            // Before the sandbox's state is reported (the stop settles
            // these tasks first).
            self.decline_commands(assigned);
        }
        let result = match action {
            Action::Idle => Ok(()),
            Action::Launch => self.launch(sandbox, seen).await,
            Action::Start => self.start(sandbox).await,
            Action::Resume => self.resume(sandbox).await,
            Action::ReportRunning => self.report_running(sandbox).await,
            Action::ReportDeath => self.report_death(sandbox, &observation).await,
            Action::ReportVanished => {
                self.report(
                    sandbox,
                    SandboxState::Failed,
                    Some("workload_exited"),
                    Some("the container is gone from the runtime (was the host restarted?); its exit code is unknown".to_owned()),
                )
                .await
            }
            Action::Stop {
                report_stopping,
                end,
            } => self.stop(sandbox, report_stopping, end).await,
            Action::Finish { end } => self.finish(sandbox, end).await,
            Action::Kill => self.kill().await,
            Action::ClearCorpse => self.handle.delete().await.map_err(Step::Local),
            Action::Delete => self.delete(sandbox).await,
        };
        if let Err(step) = result {
            return self.failed_step(sandbox, step).await;
        }
        // A container dead or gone has no use for its secrets: they go
        // now, not at the sandbox's delete (which may never come), so no
        // value stays on the host past its sandbox's life and one org's
        // failed sandboxes cannot fill the tmpfs every sandbox here
        // shares. A launch delivers them again.
        let dead = matches!(
            action,
            Action::ReportDeath | Action::ReportVanished | Action::ClearCorpse | Action::Kill
        ) || (seen == Seen::Missing && sandbox.state.is_terminal());
        if dead {
            self.forget_secrets();
        }
        let running = seen == Seen::Running
            && matches!(action, Action::Idle | Action::ReportRunning)
            && sandbox.desired == DesiredState::Running;
        if running {
            self.watch();
            self.run_commands(assigned);
            self.keep_saving(sandbox);
        }
        let at_rest = seen == Seen::Missing && matches!(sandbox.state.as_str(), "stopped");
        if running || at_rest {
            self.take_snapshots(sandbox, running);
        }
        self.forget_ended_commands(assigned);
        Next::Idle
    }

    /// Starts the scheduled saves of a running durable home (once per
    /// placement): every interval, a snapshot uploaded and committed.
    fn keep_saving(&mut self, sandbox: &SandboxAssignment) {
        let Some(interval) = sandbox
            .save_interval_s
            .filter(|_| sandbox.storage_class == StorageClass::Durable)
        else {
            return;
        };
        if self
            .saver
            .as_ref()
            .is_some_and(|(epoch, task)| *epoch == sandbox.epoch && !task.is_finished())
        {
            return;
        }
        self.stop_saving();
        let epoch = sandbox.epoch;
        let task = tokio::spawn(save_on_schedule(
            self.shared.clone(),
            sandbox.clone(),
            Duration::from_secs(interval.max(1)),
        ));
        self.saver = Some((epoch, task));
    }

    fn stop_saving(&mut self) {
        if let Some((_, task)) = self.saver.take() {
            task.abort();
        }
    }

    /// Starts a task for each assigned snapshot that has none; drops tasks
    /// of snapshots no longer assigned (replicated, failed or deleted).
    /// A snapshot whose attempt failed (the store out of reach, its
    /// capture taken away by a stop) is tried again after a pause, as the
    /// sandbox is then (running: from a new read-only copy; at rest: the
    /// home itself).
    fn take_snapshots(&mut self, sandbox: &SandboxAssignment, running: bool) {
        self.drop_unassigned_snapshots(sandbox);
        let now = self.shared.clock.now();
        for snapshot in &sandbox.snapshots {
            let mut failures = 0;
            if let Some(earlier) = self.snapshots.get_mut(&snapshot.snapshot_id) {
                if !earlier.task.is_finished() || earlier.done.load(Ordering::Relaxed) {
                    continue;
                }
                let pause = SNAPSHOT_RETRY_MIN
                    .saturating_mul(1 << earlier.failures.min(16))
                    .min(SNAPSHOT_RETRY_MAX);
                if now < *earlier.retry_at.get_or_insert(now + pause) {
                    continue;
                }
                failures = earlier.failures + 1;
            }
            let shared = self.shared.clone();
            let sandbox = sandbox.clone();
            let snapshot_id = snapshot.snapshot_id.clone();
            let id = self.id.clone();
            let done = Arc::new(AtomicBool::new(false));
            let finished = done.clone();
            let task = tokio::spawn(async move {
                let runner_id = shared.runner_id();
                match shared
                    .homes
                    .snapshot(&shared.control, &sandbox, &runner_id, &snapshot_id, running)
                    .await
                {
                    Ok(()) => finished.store(true, Ordering::Relaxed),
                    Err(SaveFailure::Fenced(message)) => {
                        tracing::info!(sandbox_id = %id, %snapshot_id, %message, "snapshot fenced");
                        finished.store(true, Ordering::Relaxed);
                    }
                    Err(err) => {
                        tracing::warn!(sandbox_id = %id, %snapshot_id, error = err.message(), "snapshot did not complete; it is tried again");
                    }
                }
            });
            self.snapshots.insert(
                snapshot.snapshot_id.clone(),
                SnapshotTask {
                    task,
                    reads_live_home: !running,
                    done,
                    failures,
                    retry_at: None,
                },
            );
        }
    }

    /// Whether a snapshot is not yet done here (under way, or failed and
    /// to be tried again): the sandbox is not at rest, so that passes
    /// come to try it again.
    fn snapshots_unsettled(&self) -> bool {
        self.snapshots
            .values()
            .any(|snapshot| !snapshot.done.load(Ordering::Relaxed))
    }

    /// Stops the tasks of snapshots no longer assigned (replicated, failed
    /// or deleted).
    fn drop_unassigned_snapshots(&mut self, sandbox: &SandboxAssignment) {
        let mut captures = Vec::new();
        self.snapshots.retain(|id, snapshot| {
            let assigned = sandbox.snapshots.iter().any(|s| &s.snapshot_id == id);
            if !assigned {
                snapshot.task.abort();
                // An attempt stopped half way leaves its capture.
                if !snapshot.done.load(Ordering::Relaxed) {
                    captures.push(id.clone());
                }
            }
            assigned
        });
        if !captures.is_empty() {
            // A btrfs subvolume delete: off the async threads.
            let (shared, sandbox_id) = (self.shared.clone(), self.id.as_str().to_owned());
            tokio::task::spawn_blocking(move || {
                for snapshot_id in captures {
                    shared.homes.drop_capture(&sandbox_id, &snapshot_id);
                }
            });
        }
    }

    /// Whether a snapshot is still reading the home itself (taken at
    /// rest, with no read-only copy of it): nothing may run in the home
    /// until it is done, or the sandbox's root could swap a directory it
    /// has not read yet for a symlink to the host's files, and the scan,
    /// which goes by path, would read those into the org's store.
    fn snapshot_reads_home(&self) -> bool {
        self.snapshots
            .values()
            .any(|snapshot| snapshot.reads_live_home && !snapshot.task.is_finished())
    }

    async fn failed_step(&mut self, sandbox: &SandboxAssignment, step: Step) -> Next {
        match step {
            Step::Store(wait) => self.wait_for_store(sandbox, wait).await,
            Step::Local(err) => {
                tracing::warn!(sandbox_id = %self.id, %err, "step failed; retrying");
                Next::Retry
            }
            Step::Transient(err) => {
                tracing::debug!(sandbox_id = %self.id, %err, "report failed; retrying");
                Next::Retry
            }
            Step::Frozen => {
                // The loop waits for the thaw, then runs a fresh pass.
                tracing::debug!(sandbox_id = %self.id, "the runner froze; step skipped");
                Next::Idle
            }
            Step::Later(pause) => Next::RetryIn(pause),
            Step::Refused(Refusal::Fenced(message)) => {
                self.fenced(sandbox.epoch, &message).await;
                Next::Idle
            }
            Step::Refused(Refusal::Refused(err)) => {
                // The record moved on (e.g. a concurrent change): the
                // next assignment shows where it is.
                tracing::info!(sandbox_id = %self.id, %err, "report refused");
                Next::Retry
            }
        }
    }

    /// The launch could not get what it needs from the store (out of reach
    /// or full): the sandbox stays `starting`, reported with the wait's
    /// reason and a message saying what failed and when the next attempt
    /// is (the server writes an event only when the reason changes), and
    /// the next pass comes after a pause that doubles up to
    /// [`STORE_RETRY_MAX_MS`].
    async fn wait_for_store(&mut self, sandbox: &SandboxAssignment, wait: StoreWait) -> Next {
        let pause = self.store_backoff.next();
        let at = humantime::format_rfc3339_seconds(std::time::SystemTime::now() + pause);
        let message = format!(
            "{}; next attempt in {} s (at {at})",
            wait.cause,
            pause.as_secs().max(1)
        );
        tracing::warn!(sandbox_id = %self.id, reason = wait.reason, %message, "the launch waits for the store");
        let reported = self
            .report(
                sandbox,
                SandboxState::Starting,
                Some(wait.reason),
                Some(message),
            )
            .await;
        match reported {
            Err(Step::Refused(Refusal::Fenced(message))) => {
                self.fenced(sandbox.epoch, &message).await;
                Next::Idle
            }
            // Unsaid for now (the server is out of reach too, or the
            // record moved on): the next attempt says it again.
            Err(step) => {
                tracing::debug!(sandbox_id = %self.id, ?step, "the wait was not reported");
                Next::RetryIn(pause)
            }
            Ok(()) => Next::RetryIn(pause),
        }
    }

    /// The server says this placement is not ours: kill the container and
    /// stop acting for it. Logged once per placement.
    async fn fenced(&mut self, epoch: u64, message: &str) {
        if self.fenced_epoch.is_some_and(|fenced| fenced >= epoch) {
            return;
        }
        self.fenced_epoch = Some(epoch);
        let ended_here = self.accepted.is_some_and(|accepted| {
            accepted.epoch == epoch
                && (accepted.state.is_terminal() || accepted.state == SandboxState::Stopped)
        });
        if ended_here {
            // A late pass over an old assignment re-reported the end of a
            // placement the server has since replaced (a start after a
            // stop): nothing runs for it any more.
            tracing::debug!(sandbox_id = %self.id, epoch, message, "placement already ended and replaced");
        } else {
            tracing::warn!(sandbox_id = %self.id, epoch, message, "fenced: this placement is no longer this runner's; killing the sandbox");
        }
        self.unwatch();
        self.stop_saving();
        for (_, snapshot) in self.snapshots.drain() {
            snapshot.task.abort();
        }
        self.commands.clear();
        self.release_lease().await;
        if let Err(err) = self.handle.delete().await {
            tracing::error!(sandbox_id = %self.id, %err, "cannot kill the fenced sandbox");
        }
    }

    /// Reports `state` at the placement's epoch.
    async fn report(
        &mut self,
        sandbox: &SandboxAssignment,
        state: SandboxState,
        reason: Option<&str>,
        message: Option<String>,
    ) -> Result<(), Step> {
        let report = SandboxReport {
            runner_id: self.shared.runner_id(),
            epoch: sandbox.epoch,
            state,
            reason: reason.map(str::to_owned),
            message: message.clone(),
            // What the wake before this run cost, told once.
            wake: if state == SandboxState::Running {
                self.wake.clone()
            } else {
                None
            },
        };
        match self
            .shared
            .control
            .runner_report_sandbox(self.id.as_str(), &report)
            .await
        {
            Ok(_) => {
                let seq = self.shared.reports_accepted.fetch_add(1, Ordering::SeqCst) + 1;
                let changed = self
                    .accepted
                    .is_none_or(|last| (last.epoch, last.state) != (sandbox.epoch, state));
                if changed {
                    tracing::info!(sandbox_id = %self.id, epoch = sandbox.epoch, state = %state, reason, message, "reported");
                }
                self.accepted = Some(Accepted {
                    epoch: sandbox.epoch,
                    state,
                    seq,
                });
                if state == SandboxState::Running {
                    self.wake = None;
                }
                Ok(())
            }
            Err(err) => Err(match refusal(err) {
                Ok(transient) => Step::Transient(transient),
                Err(refused) => Step::Refused(refused),
            }),
        }
    }

    /// Fails the launch because this runner's disk is full: waiting here
    /// frees nothing, and the saved home is untouched in the store.
    async fn report_disk_full(
        &mut self,
        sandbox: &SandboxAssignment,
        message: String,
    ) -> Result<(), Step> {
        let message = format!(
            "{message}; nothing in the store changed: free space on this runner, or create the sandbox again (a durable one from its snapshots: GET /v1/snapshots?sandbox_id={id})",
            id = sandbox.sandbox_id
        );
        self.report(
            sandbox,
            SandboxState::Failed,
            Some(super::homes::LOCAL_DISK_FULL),
            Some(message),
        )
        .await
    }

    async fn launch(&mut self, sandbox: &SandboxAssignment, seen: Seen) -> Result<(), Step> {
        let image = match &sandbox.image_root {
            None => RootImage::Host,
            Some(root) => match self.image_tree(&sandbox.org_id, root).await {
                Ok(dir) => RootImage::Tree(dir),
                Err(NotReady::Store(wait)) => return Err(Step::Store(wait)),
                Err(NotReady::DiskFull(message)) => {
                    return self.report_disk_full(sandbox, message).await;
                }
                Err(NotReady::Failed(err)) if err.is_permanent() => {
                    return self
                        .report(
                            sandbox,
                            SandboxState::Failed,
                            Some("image_unavailable"),
                            Some(err.to_string()),
                        )
                        .await;
                }
                Err(NotReady::Failed(err)) => return Err(Step::Local(err)),
            },
        };
        let host = assignment::Host {
            init: &self.shared.config.init,
            data_root: self.shared.data.root(),
            durable: self.shared.homes.can_snapshot(),
            filesystems: &self.shared.config.filesystems,
        };
        let paths = self.handle.paths().clone();
        let translated =
            assignment::sandbox_config(sandbox, &self.id, paths, self.home.clone(), image, &host);
        let mut config = match translated {
            Ok(config) => config,
            Err(unrunnable) => {
                return self
                    .report(
                        sandbox,
                        SandboxState::Failed,
                        Some(unrunnable.reason),
                        Some(unrunnable.message),
                    )
                    .await;
            }
        };
        if seen == Seen::Stopped {
            self.handle.delete().await.map_err(Step::Local)?;
        }
        let last_launched = self.recorded_placement();
        match self
            .shared
            .homes
            .prepare(&self.shared.control, sandbox, last_launched)
            .await
        {
            Ok((home, wake)) => {
                self.home = home;
                self.wake = wake;
                config.workspace = self.home.clone();
                self.store_backoff = Backoff::between(STORE_RETRY_MIN_MS, STORE_RETRY_MAX_MS);
            }
            Err(NotReady::Store(wait)) => return Err(Step::Store(wait)),
            Err(NotReady::DiskFull(message)) => {
                return self.report_disk_full(sandbox, message).await;
            }
            Err(NotReady::Failed(err)) if err.is_permanent() => {
                let message = home_unavailable_message(&err, sandbox);
                return self
                    .report(
                        sandbox,
                        SandboxState::Failed,
                        Some("home_unavailable"),
                        Some(message),
                    )
                    .await;
            }
            Err(NotReady::Failed(err)) => return Err(Step::Local(err)),
        }
        if !sandbox.secrets.is_empty() {
            match self.deliver_secrets(sandbox).await {
                Ok(files) => {
                    config.secrets_dir = Some(files);
                    let root = self.shared.config.secrets().root().display().to_string();
                    config.masked_paths.push(root);
                }
                Err(Delivery::Step(step)) => return Err(step),
                Err(Delivery::Unavailable(message)) => {
                    return self
                        .report(
                            sandbox,
                            SandboxState::Failed,
                            Some("secret_unavailable"),
                            Some(message),
                        )
                        .await;
                }
            }
        }
        self.record_placement(sandbox.epoch).map_err(Step::Local)?;
        // A layer that cannot be made fails the launch as the runtime's
        // own failures do: retried a few times, then reported.
        let launched = match self.prepare_layer().await {
            Ok(()) => {
                let Some(_thawed) = self.shared.fence.thawed().await else {
                    return Err(Step::Frozen);
                };
                self.shared.runtime.launch(&config).await
            }
            Err(err) => Err(err),
        };
        match launched {
            Ok(handle) => {
                self.handle = handle;
                self.launched_epoch = Some(sandbox.epoch);
                self.launch_failures = 0;
            }
            Err(err) => {
                self.launch_failures += 1;
                if !err.is_permanent() && self.launch_failures < LAUNCH_ATTEMPTS_MAX {
                    return Err(Step::Local(err));
                }
                // A shared directory that is not there is the request's
                // problem, not the runtime's: its own stable reason.
                let reason = match err {
                    Error::MountSourceMissing(_) => "mount_source_missing",
                    _ => "runtime_error",
                };
                return self
                    .report(
                        sandbox,
                        SandboxState::Failed,
                        Some(reason),
                        Some(err.to_string()),
                    )
                    .await;
            }
        }
        // Report as soon as the init is seen alive, not a pass later.
        match self.handle.observe().await.map_err(Step::Local)? {
            Observation::Running { .. } => self.report_running(sandbox).await,
            // Anything else is handled by the next pass.
            _ => Err(Step::Local(Error::Invalid(
                "the container is not running right after start".to_owned(),
            ))),
        }
    }

    /// Removes what was delivered for the sandbox (its container is gone).
    fn forget_secrets(&self) {
        if let Err(err) = self.shared.config.secrets().remove(&self.id) {
            tracing::warn!(sandbox_id = %self.id, %err, "cannot remove the sandbox's delivered secrets");
        }
    }

    /// Fetches the values of the secrets the sandbox asked for (this
    /// placement's, current versions) onto the runner's tmpfs; the
    /// directory of its file secrets.
    async fn deliver_secrets(&mut self, sandbox: &SandboxAssignment) -> Result<PathBuf, Delivery> {
        let request = api::runners::SecretsRequest {
            runner_id: self.shared.runner_id(),
            epoch: sandbox.epoch,
        };
        let values = match self
            .shared
            .control
            .runner_secrets(self.id.as_str(), &request)
            .await
        {
            Ok(values) => values,
            Err(err) => {
                return Err(match refusal(err) {
                    Ok(transient) => Delivery::Step(Step::Transient(transient)),
                    Err(Refusal::Fenced(message)) => {
                        Delivery::Step(Step::Refused(Refusal::Fenced(message)))
                    }
                    // A secret deleted since the create, or a deployment
                    // that lost its key: this launch cannot be as asked.
                    Err(Refusal::Refused(err)) => Delivery::Unavailable(err.to_string()),
                });
            }
        };
        let secrets = self.shared.config.secrets();
        let id = self.id.clone();
        let root = secrets.root().to_owned();
        oci::host::blocking("deliver secrets", &root, move || {
            secrets.deliver(&id, &values)
        })
        .await
        .map_err(|err| Delivery::Step(Step::Local(err)))
    }

    /// The tree of image `root`, materialised here if need be, named first
    /// in the sandbox's directory: a collection of image trees never takes
    /// it from under the launch (`images`).
    async fn image_tree(&self, org_id: &str, root: &str) -> Result<PathBuf, NotReady> {
        let dir = self.handle.paths().dir();
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
        oci::host::write_durably(&dir.join("image"), root.as_bytes())?;
        self.shared
            .images
            .materialised(&*self.shared.control, org_id, root)
            .await
    }

    /// Where the epoch of the placement the container was launched for is
    /// kept (outside the bundle, which a create clears).
    fn placement_path(&self) -> PathBuf {
        self.handle.paths().dir().join("placement")
    }

    /// Records, before a launch, the placement it is for.
    fn record_placement(&self, epoch: u64) -> Result<(), Error> {
        let dir = self.handle.paths().dir();
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
        oci::host::write_durably(&self.placement_path(), epoch.to_string().as_bytes())
    }

    /// Makes the writable layer where it is apart from the sandbox's
    /// directory (a subvolume of the homes' volume), bounded by the
    /// runner's `--sandbox-disk-max`. After the placement is recorded: the
    /// directory is what tells a later pass there are files to remove.
    async fn prepare_layer(&self) -> Result<(), Error> {
        let paths = self.handle.paths();
        if !paths.layer_apart() {
            return Ok(());
        }
        let (shared, id, layer) = (
            self.shared.clone(),
            self.id.clone(),
            paths.layer().to_owned(),
        );
        oci::host::blocking("prepare the root layer", paths.layer(), move || {
            let bytes = shared.config.sandbox_disk_bytes;
            shared.homes.prepare_layer(id.as_str(), &layer, bytes)
        })
        .await
    }

    /// The epoch of the placement a container was last launched for here,
    /// if recorded.
    fn recorded_placement(&self) -> Option<u64> {
        std::fs::read_to_string(self.placement_path())
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
    }

    /// Whether the container here was launched for a placement older than
    /// `epoch`. Unknown (no record: launched before this was recorded) is
    /// no: such a container is adopted, as it always was.
    fn launched_for_earlier_placement(&self, epoch: u64) -> bool {
        self.recorded_placement()
            .is_some_and(|launched| launched < epoch)
    }

    async fn start(&mut self, sandbox: &SandboxAssignment) -> Result<(), Step> {
        let Some(_thawed) = self.shared.fence.thawed().await else {
            return Err(Step::Frozen);
        };
        self.handle.start().await.map_err(Step::Local)?;
        self.launched_epoch = Some(sandbox.epoch);
        Ok(())
    }

    async fn resume(&mut self, _sandbox: &SandboxAssignment) -> Result<(), Step> {
        let Some(_thawed) = self.shared.fence.thawed().await else {
            return Err(Step::Frozen);
        };
        self.handle.resume().await.map_err(Step::Local)
    }

    async fn report_running(&mut self, sandbox: &SandboxAssignment) -> Result<(), Step> {
        self.report(sandbox, SandboxState::Running, None, None)
            .await?;
        self.watch();
        Ok(())
    }

    /// Watches the init's pidfd; the worker runs a pass when it dies.
    fn watch(&mut self) {
        if self.watcher.as_ref().is_some_and(|w| !w.is_finished()) {
            return;
        }
        let handle = self.handle.clone();
        let id = self.id.clone();
        let clock = self.shared.clock.clone();
        self.watcher = Some(tokio::spawn(async move {
            if let Err(err) = handle.wait_for_exit().await {
                // The pass this wakes looks again; not at once, so a
                // runtime that keeps failing is not asked in a tight loop.
                tracing::debug!(sandbox_id = %id, %err, "watching the init failed");
                clock.sleep(Duration::from_secs(1)).await;
            }
        }));
    }

    fn unwatch(&mut self) {
        if let Some(watcher) = self.watcher.take() {
            watcher.abort();
        }
    }

    /// Lets the sandbox's commands report their own ends (they end with
    /// the container) before its state is reported, then drops the rest.
    /// Commands handed over for this placement while it was being stopped
    /// (the pass that stops it read an older assignment) are declined
    /// first: they never ran and never will (a start is a new placement),
    /// and said so now they end `not_launched`, where the state report
    /// would leave the record to end them `unknown`.
    async fn settle_commands(&mut self, epoch: u64) {
        let latest = self.latest.borrow().clone();
        if let Some(latest) = latest
            && latest.sandbox.epoch == epoch
        {
            self.decline_commands(&latest);
        }
        let deadline = tokio::time::Instant::now() + Duration::from_millis(COMMANDS_SETTLE_MS);
        for task in self.commands.values_mut() {
            let _ = tokio::time::timeout_at(deadline, &mut task.task).await;
        }
        self.commands.clear();
    }

    async fn report_death(
        &mut self,
        sandbox: &SandboxAssignment,
        observation: &Observation,
    ) -> Result<(), Step> {
        self.unwatch();
        self.stop_saving();
        self.settle_commands(sandbox.epoch).await;
        let cause = match observation {
            Observation::Stopped(cause) => *cause,
            _ => DeathCause::WorkloadExited { end: None },
        };
        let message = match (cause, cause.exit_code()) {
            (DeathCause::OomKilled, _) => {
                let limit = sandbox
                    .resources
                    .memory_mib
                    .map(|mib| format!(" ({mib} MiB)"))
                    .unwrap_or_default();
                format!("the sandbox ran out of memory{limit} and its init was killed")
            }
            (_, Some(code)) => format!("the sandbox's init exited with code {code}"),
            (_, None) => {
                "the sandbox's init was killed (no exit code is knowable): killed from outside"
                    .to_owned()
            }
        };
        self.report(
            sandbox,
            SandboxState::Failed,
            Some(cause.reason()),
            Some(message),
        )
        .await
    }

    async fn stop(
        &mut self,
        sandbox: &SandboxAssignment,
        report_stopping: bool,
        end: End,
    ) -> Result<(), Step> {
        if report_stopping {
            self.report(sandbox, SandboxState::Stopping, Some(end.reason()), None)
                .await?;
        }
        self.unwatch();
        self.handle
            .stop(self.shared.stop_grace())
            .await
            .map_err(Step::Local)?;
        self.finish(sandbox, end).await
    }

    async fn finish(&mut self, sandbox: &SandboxAssignment, end: End) -> Result<(), Step> {
        self.unwatch();
        self.stop_saving();
        self.settle_commands(sandbox.epoch).await;
        // The container goes; its root directory and the home stay.
        self.handle.delete().await.map_err(Step::Local)?;
        // Nothing runs here for it any more: its lease is not renewed with
        // every heartbeat (an asleep fleet costs the runner nothing); a
        // launch holds it again.
        self.release_lease().await;
        // Its secrets go with it: the next launch fetches them again.
        self.forget_secrets();
        if sandbox.storage_class == StorageClass::Durable {
            let homes = &self.shared.homes;
            if homes.restore_unfinished(self.id.as_str()) {
                // Stopped while its launch waited for the store: nothing
                // ran here, and the home here is at most part of the last
                // completed save, which stays the home. Uploading it would
                // commit that part as the sandbox's home.
                tracing::info!(sandbox_id = %self.id, "stopped before its home was restored; the last completed save stays its home");
            } else if !homes.holds(self.id.as_str()) {
                // Stopped before its launch made a home here (placed, then
                // stopped at once): nothing ran here either, and there is
                // nothing to secure; securing would wait for a home that
                // will never come.
                tracing::info!(sandbox_id = %self.id, "stopped before a home was made here; the last completed save stays its home");
            } else {
                self.secure(sandbox).await?;
            }
        }
        self.report(sandbox, end.state(), Some(end.reason()), None)
            .await
    }

    /// `securing`: the home of a durable sandbox goes into the store before
    /// the stop is reported. A failure leaves it `securing` with the error
    /// on its save status, the home kept, and the next pass tries again.
    async fn secure(&mut self, sandbox: &SandboxAssignment) -> Result<(), Step> {
        if sandbox.state != SandboxState::Securing {
            self.report(
                sandbox,
                SandboxState::Securing,
                Some("stop_requested"),
                None,
            )
            .await?;
        }
        let runner_id = self.shared.runner_id();
        match self
            .shared
            .homes
            .secure(&self.shared.control, sandbox, &runner_id)
            .await
        {
            Ok(()) => {
                self.secure_full_backoff =
                    Backoff::between(SECURE_FULL_RETRY_MIN_MS, SECURE_FULL_RETRY_MAX_MS);
                Ok(())
            }
            Err(SaveFailure::Fenced(message)) => Err(Step::Refused(Refusal::Fenced(message))),
            Err(failure) => {
                let error = failure.message();
                tracing::warn!(sandbox_id = %self.id, %error, "securing the home failed; the home stays and securing is tried again");
                if let Err(SaveFailure::Fenced(message)) =
                    Homes::report_failure(&self.shared.control, sandbox, &runner_id, error).await
                {
                    return Err(Step::Refused(Refusal::Fenced(message)));
                }
                match failure {
                    // Each attempt scans the home: not every few seconds
                    // while nothing can free the room.
                    SaveFailure::Full(_) => Err(Step::Later(self.secure_full_backoff.next())),
                    _ => Err(Step::Local(Error::Invalid(format!(
                        "securing the home: {error}"
                    )))),
                }
            }
        }
    }

    async fn kill(&mut self) -> Result<(), Step> {
        tracing::warn!(sandbox_id = %self.id, "a container runs that its record says must not; killing it");
        self.unwatch();
        self.stop_saving();
        self.commands.clear();
        self.release_lease().await;
        self.handle.delete().await.map_err(Step::Local)
    }

    /// The fence renews this sandbox's lease no more: whatever might still
    /// run in it stops at the last deadline.
    async fn release_lease(&mut self) {
        self.shared.fence.release(&self.id).await;
    }

    /// Removes the container and every file of the sandbox.
    async fn remove_everything(&mut self) -> Result<(), Error> {
        self.release_lease().await;
        self.unwatch();
        self.stop_saving();
        for (_, snapshot) in self.snapshots.drain() {
            snapshot.task.abort();
        }
        self.commands.clear();
        self.handle.remove_files().await?;
        let shared = self.shared.clone();
        let id = self.id.clone();
        let files = self.files.clone();
        tokio::task::spawn_blocking(move || {
            shared.config.secrets().remove(&id)?;
            shared.homes.remove(id.as_str())?;
            files.remove_all()
        })
        .await
        .map_err(|join| {
            Error::io(
                "remove the files of",
                self.home.clone(),
                std::io::Error::other(join.to_string()),
            )
        })?
    }

    async fn delete(&mut self, sandbox: &SandboxAssignment) -> Result<(), Step> {
        if !self.deleted {
            self.remove_everything().await.map_err(Step::Local)?;
        }
        self.deleted = true;
        self.report(
            sandbox,
            SandboxState::Deleted,
            Some("delete_requested"),
            None,
        )
        .await
    }

    /// No longer assigned here (deleted, or taken away with the lease):
    /// the container and files go, but the home is first kept aside (it
    /// may be the newest copy of the work: a runner lost while its sandbox
    /// ran or secured, a standard home whose sandbox failed with the
    /// runner) and reported; the server says whether it may go.
    async fn leave(&mut self) {
        if self.deleted {
            return;
        }
        let has_anything = self.handle.paths().dir().exists()
            || self.handle.paths().layer().exists()
            || self.home.exists()
            || matches!(self.handle.state().await, Ok(Some(_)));
        if !has_anything {
            self.deleted = true;
            return;
        }
        // The container goes first: nothing may write the home while it is
        // set aside.
        self.unwatch();
        self.stop_saving();
        self.commands.clear();
        if let Err(err) = self.handle.delete().await {
            tracing::error!(sandbox_id = %self.id, %err, "cannot remove the container of an unassigned sandbox; its files stay");
            return;
        }
        self.forget_secrets();
        let kept = {
            let (shared, id) = (self.shared.clone(), self.id.clone());
            tokio::task::spawn_blocking(move || shared.homes.keep_aside(id.as_str())).await
        };
        let kept = match kept {
            Ok(Ok(kept)) => kept,
            Ok(Err(err)) => {
                tracing::error!(sandbox_id = %self.id, %err, "cannot keep the home of an unassigned sandbox aside; nothing is removed");
                return;
            }
            Err(join) => {
                tracing::error!(sandbox_id = %self.id, %join, "cannot keep the home of an unassigned sandbox aside; nothing is removed");
                return;
            }
        };
        match &kept {
            Some(name) => {
                tracing::warn!(sandbox_id = %self.id, copy = %name, "no longer assigned to this runner; its home is kept aside (it may be the newest copy), its container and other files removed")
            }
            None => {
                tracing::warn!(sandbox_id = %self.id, "no longer assigned to this runner; removing its container and files")
            }
        }
        match self.remove_everything().await {
            Ok(()) => self.deleted = true,
            Err(err) => {
                tracing::error!(sandbox_id = %self.id, %err, "cannot remove an unassigned sandbox")
            }
        }
        if let Some(name) = kept {
            super::kept::report(&self.shared, self.id.as_str(), &name).await;
        }
    }

    /// Starts a task for each handed-over command that has none, and
    /// passes requested signals to running ones.
    fn run_commands(&mut self, assigned: &Assigned) {
        self.start_command_tasks(assigned, true);
    }

    /// Ends each handed-over command that has no task yet without
    /// launching it (`not_launched`): the sandbox is not to run any more.
    /// One launched before a restart is driven to its end as usual.
    fn decline_commands(&mut self, assigned: &Assigned) {
        self.start_command_tasks(assigned, false);
    }

    fn start_command_tasks(&mut self, assigned: &Assigned, may_launch: bool) {
        let epoch = assigned.sandbox.epoch;
        for command in &assigned.commands {
            if command.epoch != epoch {
                continue;
            }
            if let Some(task) = self.commands.get(&command.command_id) {
                let requested = command::signal_request(command);
                task.signal.send_if_modified(|current| {
                    if *current == requested {
                        false
                    } else {
                        *current = requested;
                        true
                    }
                });
                continue;
            }
            let (signal, signals) = watch::channel(command::signal_request(command));
            let job = CommandJob {
                shared: self.shared.clone(),
                sandbox: self.handle.clone(),
                files: self.files.clone(),
                assignment: command.clone(),
                signals,
                may_launch,
                env_secrets: assigned
                    .sandbox
                    .secrets
                    .iter()
                    .filter_map(|secret| secret.env.clone())
                    .collect(),
            };
            let task = tokio::spawn(command::run(job));
            self.commands
                .insert(command.command_id.clone(), CommandTask { task, signal });
        }
    }

    /// Drops tasks and files of commands no longer assigned: the server
    /// has their end, so nothing can hand them over again.
    fn forget_ended_commands(&mut self, assigned: &Assigned) {
        let assigned_ids: Vec<&str> = assigned
            .commands
            .iter()
            .map(|c| c.command_id.as_str())
            .collect();
        self.commands
            .retain(|id, task| assigned_ids.contains(&id.as_str()) || !task.task.is_finished());
        let on_disk = match self.files.command_ids() {
            Ok(ids) => ids,
            Err(err) => {
                tracing::warn!(sandbox_id = %self.id, %err, "cannot list command records");
                return;
            }
        };
        let ended: Vec<String> = on_disk
            .into_iter()
            .filter(|id| !assigned_ids.contains(&id.as_str()) && !self.commands.contains_key(id))
            .collect();
        if ended.is_empty() {
            return;
        }
        // Removed on a blocking thread: the pass that finds them has often
        // just started a new command's task, which would otherwise wait on
        // this worker for the unlinks. Only these ids: ended, their records
        // no server hands over again (a command started later is not one).
        let files = self.files.clone();
        let sandbox_id = self.id.to_string();
        tokio::task::spawn_blocking(move || {
            for id in ended {
                if let Err(err) = files.forget(&id) {
                    tracing::warn!(%sandbox_id, command_id = %id, %err, "cannot remove command records");
                }
            }
        });
    }
}

/// A running durable home's saves: every `interval` (on the agent's
/// clock), a snapshot uploaded and committed. A failed save is reported
/// (the record's save status says `failing`) and tried again next
/// interval; a fenced answer ends the schedule.
pub(crate) async fn save_on_schedule(
    shared: Arc<Shared>,
    sandbox: SandboxAssignment,
    interval: Duration,
) {
    let id = &sandbox.sandbox_id;
    loop {
        shared.clock.sleep(interval).await;
        let runner_id = shared.runner_id();
        match shared
            .homes
            .save_running(&shared.control, &sandbox, &runner_id)
            .await
        {
            Ok(_) => {}
            Err(SaveFailure::Fenced(message)) => {
                tracing::info!(sandbox_id = %id, %message, "saves stop: fenced");
                return;
            }
            Err(failure) => {
                let error = failure.message();
                tracing::warn!(sandbox_id = %id, %error, "save failed; trying again next interval");
                let reported =
                    Homes::report_failure(&shared.control, &sandbox, &runner_id, error).await;
                if let Err(SaveFailure::Fenced(_)) = reported {
                    return;
                }
            }
        }
    }
}

/// The `home_unavailable` message: what cannot be had (the object, and the
/// file it belongs to where known), and what its owner can do, as the API
/// offers it: the home as saved cannot come back, so the sandbox cannot
/// run again.
fn home_unavailable_message(err: &Error, sandbox: &SandboxAssignment) -> String {
    format!(
        "{err}; this sandbox cannot start from its saved home: create a new sandbox from one of its snapshots (GET /v1/snapshots?sandbox_id={id}, then POST /v1/sandboxes with from_snapshot), or delete it",
        id = sandbox.sandbox_id
    )
}

/// Why secrets were not delivered.
enum Delivery {
    Step(Step),
    /// The server will not give them for this placement as asked.
    Unavailable(String),
}

/// Why a step of a pass did not complete.
#[derive(Debug)]
enum Step {
    /// Something on this host failed (the runtime, a file).
    Local(Error),
    /// The server could not be reached.
    Transient(api::client::ClientError),
    /// The store is out of reach or full: the launch waits for it.
    Store(StoreWait),
    Refused(Refusal),
    /// The runner froze (it cannot renew its lease): nothing may start.
    Frozen,
    /// Failed, reported, and not worth trying again before this pause.
    Later(Duration),
}

#[cfg(test)]
mod tests {
    use super::Action::*;
    use super::*;

    /// `check(desired, recorded, seen, launched_here, expected)` for every
    /// row that matters.
    #[test]
    fn decisions() {
        let rows: &[(&str, &str, Seen, bool, Action)] = &[
            // Placed: launch, or report what is already there.
            ("running", "starting", Seen::Missing, false, Launch),
            ("running", "starting", Seen::Running, false, ReportRunning),
            ("running", "starting", Seen::Created, false, Start),
            ("running", "starting", Seen::Stopped, true, ReportDeath),
            ("running", "starting", Seen::Stopped, false, Launch),
            // Running: nothing to do, or report an out-of-band death.
            ("running", "running", Seen::Running, false, Idle),
            ("running", "running", Seen::Stopped, false, ReportDeath),
            ("running", "running", Seen::Missing, false, ReportVanished),
            ("running", "running", Seen::Paused, false, Resume),
            // Stop keeps the files; report stopping only once.
            (
                "stopped",
                "running",
                Seen::Running,
                false,
                Stop {
                    report_stopping: true,
                    end: End::Stopped,
                },
            ),
            (
                "stopped",
                "stopping",
                Seen::Running,
                false,
                Stop {
                    report_stopping: false,
                    end: End::Stopped,
                },
            ),
            (
                "stopped",
                "stopping",
                Seen::Missing,
                false,
                Finish { end: End::Stopped },
            ),
            // Stopped while still being placed or launched.
            (
                "stopped",
                "starting",
                Seen::Missing,
                false,
                Finish { end: End::Stopped },
            ),
            (
                "stopped",
                "pending",
                Seen::Missing,
                false,
                Finish { end: End::Stopped },
            ),
            ("stopped", "stopped", Seen::Missing, false, Idle),
            ("stopped", "stopped", Seen::Stopped, false, ClearCorpse),
            ("stopped", "stopped", Seen::Running, false, Kill),
            // Started again while stopping.
            ("running", "stopping", Seen::Running, false, ReportRunning),
            ("running", "stopping", Seen::Missing, false, Launch),
            // Waiting for placement again: nothing runs.
            ("running", "pending", Seen::Missing, false, Idle),
            ("running", "stopped", Seen::Missing, false, Idle),
            // TTL.
            (
                "terminated",
                "running",
                Seen::Running,
                false,
                Stop {
                    report_stopping: true,
                    end: End::Terminated,
                },
            ),
            (
                "terminated",
                "stopped",
                Seen::Missing,
                false,
                Finish {
                    end: End::Terminated,
                },
            ),
            // Ended records hold no compute.
            ("running", "failed", Seen::Stopped, false, ClearCorpse),
            ("running", "failed", Seen::Running, false, Kill),
            ("running", "failed", Seen::Missing, false, Idle),
            ("terminated", "terminated", Seen::Missing, false, Idle),
            // Delete, from anywhere.
            ("deleted", "deleting", Seen::Running, false, Delete),
            ("deleted", "failed", Seen::Missing, false, Delete),
        ];
        for (desired, recorded, seen, launched_here, expected) in rows {
            let (desired, recorded) = (
                desired.parse().expect("a desired state"),
                recorded.parse().expect("a sandbox state"),
            );
            assert_eq!(
                decide(desired, recorded, *seen, *launched_here),
                *expected,
                "desired {desired}, recorded {recorded}, seen {seen:?}"
            );
        }
    }
}
