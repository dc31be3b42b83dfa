//! The runner's self-fence (DESIGN.md §7, "never two writers", enforced
//! on the host): a runner that cannot renew its lease freezes its
//! sandboxes before the server could count the lease expired and place
//! them elsewhere, thaws them if a heartbeat gets through in time, and
//! kills them if it learns that it was fenced (declared lost).
//!
//! # Timings
//!
//! The server gives them at registration: a heartbeat every third of the
//! lease, and `freeze_after` (two thirds of it). The fence measures from
//! when the last answered heartbeat was *sent*: the server's lease runs
//! from when it received it, so this errs on the early side. Once
//! `freeze_after` has passed without a newer answered one, every running
//! container is paused (the OCI runtime's `pause`, the cgroup freezer):
//! at least a heartbeat interval before the lease can expire on the
//! server, and the server recovers nothing before the lease and its fence
//! margin have passed.
//!
//! # Phases
//!
//! - thawed: the workers act as usual.
//! - frozen: the workers do nothing (a pass would resume a paused
//!   container recorded `running`); every step that makes a container run
//!   (launch, start, resume) holds [`Fence::thawed`], so a freeze waits for
//!   the ones under way and later ones are refused. A heartbeat answered
//!   in time (the lease never lapsed) resumes exactly the containers the
//!   freeze paused.
//! - fenced: a heartbeat or the assignments were answered 409 `fenced`:
//!   the server failed or moved everything this runner held. Every
//!   container is sent SIGKILL (a paused one is resumed after, so the kill
//!   lands) and nothing is thawed; once the runner has registered again,
//!   the workers act again and remove what is no longer assigned.
//!
//! # Without the runner process
//!
//! All of the above needs this process alive. So that a runner whose
//! process dies leaves its sandboxes frozen too (DESIGN.md §7), every
//! sandbox's init enforces the lease itself (`oci::lease`): after each
//! answered heartbeat (or registration) the fence writes a deadline into
//! the lease directory of every sandbox a worker runs for a current
//! placement ([`Fence::hold`]), and the init stops every process of its
//! sandbox once that deadline passes unrenewed. The deadline is halfway
//! between `freeze_after` and the lease's end, measured from the same
//! send: after this fence's own freeze (which leaves the inits frozen
//! before their deadline, so they never act while the runner does), still
//! half a heartbeat interval before the server could count the lease
//! expired. The deadlines are written before the fence learns of the
//! renewal, so a thaw never runs an init that still holds an old one.
//! Nothing here waits on the runtime: a `pause` that hangs delays this
//! fence's freeze, not the inits'. A restarted runner renews only what its
//! workers hold again (the sandboxes it is still assigned); a sandbox
//! moved elsewhere stays stopped until the worker kills it.
//!
//! Each transition is logged and recorded in `DIR/fence.json`
//! (`{"state": "frozen"|"thawed"|"fenced", "at_ms", "containers"}`,
//! replaced atomically): the containers frozen, thawed or killed. The
//! registration after a fence resumes nothing, so the record keeps saying
//! `fenced` until the next freeze.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{RwLock, RwLockReadGuard, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Shared;
use super::clock::{self, Clock};
use oci::Status;
use oci::config::SandboxId;
use oci::host::write_durably;
use oci::seam::Container;
use oci::signal::Signal;

/// How often the fence looks at the time since the last renewal.
const TICK_MS: u64 = 100;
/// How long a freeze waits for launches, starts and resumes under way to
/// end before it pauses around them (and looks again at the next tick).
const DRAIN_MS: u64 = 1_000;

/// Where the fence stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Thawed,
    Frozen,
    Fenced,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Thawed => "thawed",
            Phase::Frozen => "frozen",
            Phase::Fenced => "fenced",
        }
    }
}

/// What the fence knows of the lease.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Lease {
    /// When the newest heartbeat the server answered was sent.
    heartbeat_sent_at: Option<Instant>,
    /// When the newest answered registration was sent.
    registration_sent_at: Option<Instant>,
    /// When that registration's answer arrived: a `fenced` answer to a
    /// request sent before it may predate the registration.
    registered_at: Option<Instant>,
    /// From the newest registration.
    freeze_after: Option<Duration>,
    /// From the newest registration.
    lease_ttl: Option<Duration>,
}

impl Lease {
    /// The newest renewal of either kind.
    fn renewed_sent_at(&self) -> Option<Instant> {
        self.heartbeat_sent_at.max(self.registration_sent_at)
    }

    /// When the sandboxes' inits stop their processes unless renewed:
    /// halfway from `freeze_after` to the lease's end, after the newest
    /// renewal's send (see the module docs). `None` before registration.
    fn init_deadline(&self) -> Option<Instant> {
        let renewed = self.renewed_sent_at()?;
        let freeze_after = self.freeze_after?;
        let lease_ttl = self
            .lease_ttl
            .filter(|ttl| *ttl > freeze_after)
            .unwrap_or(freeze_after);
        Some(renewed + freeze_after + (lease_ttl - freeze_after) / 2)
    }
}

/// What the fence does at a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Move {
    Stay,
    Freeze,
    Thaw,
}

/// The timing rule, pure. Thawed → frozen once `freeze_after` has passed
/// since the newest renewal was sent. Frozen → thawed only by a heartbeat
/// sent less than `freeze_after` ago (a registration proves nothing about
/// the old lease). Fenced → thawed by a renewal sent since the fence.
/// Nothing happens before the first registration.
fn decide(phase: Phase, lease: &Lease, fenced_at: Option<Instant>, now: Instant) -> Move {
    let Some(freeze_after) = lease.freeze_after else {
        return Move::Stay;
    };
    let fresh = |sent_at: Option<Instant>| {
        sent_at.is_some_and(|sent_at| now.saturating_duration_since(sent_at) < freeze_after)
    };
    let renewed = lease.renewed_sent_at();
    match phase {
        Phase::Thawed if renewed.is_some() && !fresh(renewed) => Move::Freeze,
        Phase::Frozen if fresh(lease.heartbeat_sent_at) => Move::Thaw,
        Phase::Fenced
            if fresh(renewed)
                && renewed
                    .zip(fenced_at)
                    .is_some_and(|(renewed, fenced)| renewed >= fenced) =>
        {
            Move::Thaw
        }
        _ => Move::Stay,
    }
}

/// The phase and what the fence holds, changed by one transition at a time.
#[derive(Debug)]
struct Held {
    phase: Phase,
    /// Containers the freeze paused: resumed at the thaw, killed if fenced.
    containers: Vec<String>,
    /// When the current phase began.
    since: Instant,
    /// When the server's `fenced` was acted on.
    fenced_at: Option<Instant>,
    /// Whether the freeze found no launch, start or resume under way;
    /// if one was, the fence looks again at every tick until it finds none.
    drained: bool,
}

/// The self-fence state, shared by the agent's tasks (in `Shared`).
#[derive(Debug)]
pub(crate) struct Fence {
    lease: std::sync::Mutex<Lease>,
    held: tokio::sync::Mutex<Held>,
    /// Read-held around every step that makes a container run.
    gate: RwLock<()>,
    /// `true` while frozen or fenced; the workers watch it.
    frozen: watch::Sender<bool>,
    /// `DIR/fence.json`.
    record: PathBuf,
    /// The lease directories of the sandboxes whose inits this runner
    /// renews, by sandbox id (see [`Fence::hold`]); held while writing.
    leases: tokio::sync::Mutex<BTreeMap<String, PathBuf>>,
    /// Where "now" and the drain's limit come from.
    clock: Arc<dyn Clock>,
}

impl Fence {
    /// Thawed: a restarted runner resumes what an earlier run froze (the
    /// workers' decision table resumes a paused sandbox recorded running).
    pub(crate) fn new(record: PathBuf, clock: Arc<dyn Clock>) -> Fence {
        Fence {
            lease: std::sync::Mutex::new(Lease::default()),
            held: tokio::sync::Mutex::new(Held {
                phase: Phase::Thawed,
                containers: Vec::new(),
                since: clock.now(),
                fenced_at: None,
                drained: true,
            }),
            gate: RwLock::new(()),
            frozen: watch::channel(false).0,
            record,
            leases: tokio::sync::Mutex::new(BTreeMap::new()),
            clock,
        }
    }

    fn lease(&self) -> Lease {
        match self.lease.lock() {
            Ok(lease) => *lease,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    fn update_lease(&self, change: impl FnOnce(&mut Lease)) {
        match self.lease.lock() {
            Ok(mut lease) => change(&mut lease),
            Err(poisoned) => change(&mut poisoned.into_inner()),
        }
    }

    /// A heartbeat sent at `sent_at` was answered: the lease runs at least
    /// from then.
    pub(crate) fn renewed(&self, sent_at: Instant) {
        self.update_lease(|lease| {
            lease.heartbeat_sent_at = lease.heartbeat_sent_at.max(Some(sent_at));
        });
    }

    /// A registration sent at `sent_at` was answered, with the server's
    /// `freeze_after` and lease (the newest one counts).
    pub(crate) fn registered(&self, sent_at: Instant, freeze_after: Duration, lease_ttl: Duration) {
        let now = self.clock.now();
        self.update_lease(|lease| {
            lease.registration_sent_at = lease.registration_sent_at.max(Some(sent_at));
            lease.registered_at = Some(now);
            lease.freeze_after = Some(freeze_after);
            lease.lease_ttl = Some(lease_ttl);
        });
    }

    /// [`Fence::renewed`], after renewing the held sandboxes' deadlines.
    pub(crate) async fn heartbeat_answered(&self, sent_at: Instant) {
        let mut next = self.lease();
        next.heartbeat_sent_at = next.heartbeat_sent_at.max(Some(sent_at));
        self.write_deadlines(&next).await;
        self.renewed(sent_at);
    }

    /// [`Fence::registered`], after renewing the held sandboxes' deadlines.
    pub(crate) async fn registration_answered(
        &self,
        sent_at: Instant,
        freeze_after: Duration,
        lease_ttl: Duration,
    ) {
        let mut next = self.lease();
        next.registration_sent_at = next.registration_sent_at.max(Some(sent_at));
        next.freeze_after = Some(freeze_after);
        next.lease_ttl = Some(lease_ttl);
        self.write_deadlines(&next).await;
        self.registered(sent_at, freeze_after, lease_ttl);
    }

    /// The sandbox `id` runs here for a current placement: from now on its
    /// init's deadline (in `dir`) is renewed with the lease. The current
    /// one is written before this returns when the sandbox was not held
    /// yet, or when `fresh` (a launch needs it: an init without a deadline
    /// freezes at once).
    pub(crate) async fn hold(&self, id: &SandboxId, dir: PathBuf, fresh: bool) -> oci::Result<()> {
        let mut leases = self.leases.lock().await;
        if !fresh && leases.contains_key(id.as_str()) {
            return Ok(());
        }
        let deadline = self.deadline_in(&self.lease());
        let written = oci::lease::write_deadline(&dir, deadline);
        leases.insert(id.to_string(), dir);
        written
    }

    /// The sandbox `id` is no longer run here (fenced, stopped for good,
    /// moved, deleted): its deadline is renewed no more, so its init stops
    /// whatever still runs in it once the last one passes.
    pub(crate) async fn release(&self, id: &SandboxId) {
        self.leases.lock().await.remove(id.as_str());
    }

    /// The deadline `lease` gives, as the inits read it; one already
    /// passed (or none yet) freezes them at once.
    fn deadline_in(&self, lease: &Lease) -> oci::lease::Deadline {
        let now = self.clock.now();
        let remaining_ms = match lease.init_deadline() {
            Some(at) if at >= now => at.duration_since(now).as_millis() as i64,
            Some(at) => -(now.duration_since(at).as_millis() as i64),
            None => 0,
        };
        oci::lease::Deadline::from(self.clock.boottime_ms(), remaining_ms)
    }

    /// Writes `lease`'s deadline for every held sandbox. One that cannot
    /// be written is logged: its init freezes at the old deadline.
    ///
    /// In line, not on a blocking thread: a small file per sandbox in the
    /// data dir, unsynced, and the clock's tests need the renewal done when
    /// the beat's answer is. A disk that hangs holds the heartbeats up with
    /// it, so the lease lapses and everything freezes: the safe side.
    async fn write_deadlines(&self, lease: &Lease) {
        let leases = self.leases.lock().await;
        let deadline = self.deadline_in(lease);
        for (sandbox_id, dir) in leases.iter() {
            if let Err(err) = oci::lease::write_deadline(dir, deadline) {
                tracing::warn!(%sandbox_id, %err, "cannot renew the sandbox's lease deadline; it freezes at the old one");
            }
        }
    }

    /// `true` while the runner is frozen or fenced.
    pub(crate) fn subscribe(&self) -> watch::Receiver<bool> {
        self.frozen.subscribe()
    }

    /// Held around a step that makes a container run (launch, start,
    /// resume); `None` while frozen or fenced: the step must not run.
    pub(crate) async fn thawed(&self) -> Option<RwLockReadGuard<'_, ()>> {
        let guard = self.gate.read().await;
        (!*self.frozen.borrow()).then_some(guard)
    }

    /// Tells the workers, waking them only on a change.
    fn publish(&self, frozen: bool) {
        self.frozen.send_if_modified(|current| {
            let changed = *current != frozen;
            *current = frozen;
            changed
        });
    }

    /// Closes the gate, then waits (at most [`DRAIN_MS`]) for the steps
    /// that passed it before; says whether they all ended.
    async fn close(&self) -> bool {
        self.publish(true);
        clock::timeout(
            &*self.clock,
            Duration::from_millis(DRAIN_MS),
            self.gate.write(),
        )
        .await
        .is_ok()
    }
}

/// Runs the fence until the agent stops: every [`TICK_MS`] (on the
/// agent's clock; a late tick delays the next), one [`tick`].
pub(crate) async fn watch(shared: &Shared) {
    loop {
        tick(shared).await;
        shared.clock.sleep(Duration::from_millis(TICK_MS)).await;
    }
}

/// Freezes or thaws as [`decide`] says, now.
pub(crate) async fn tick(shared: &Shared) {
    let mut held = shared.fence.held.lock().await;
    let lease = shared.fence.lease();
    match decide(held.phase, &lease, held.fenced_at, shared.clock.now()) {
        Move::Freeze => freeze(shared, &mut held, &lease).await,
        Move::Thaw => thaw(shared, &mut held).await,
        Move::Stay if held.phase == Phase::Frozen && !held.drained => {
            // A step was still under way at the freeze: pause what it
            // may have started.
            held.drained = shared.fence.close().await;
            let more = pause_running(shared, &held.containers).await;
            if !more.is_empty() {
                tracing::warn!(containers = ?more, "froze sandboxes started during the freeze");
                held.containers.extend(more);
                record(&shared.fence, &held).await;
            }
        }
        Move::Stay => {}
    }
}

async fn freeze(shared: &Shared, held: &mut Held, lease: &Lease) {
    held.drained = shared.fence.close().await;
    if !held.drained {
        tracing::warn!("a launch, start or resume is still under way; freezing around it");
    }
    held.containers = pause_running(shared, &[]).await;
    held.phase = Phase::Frozen;
    held.since = shared.clock.now();
    let since_renewal_ms = lease
        .renewed_sent_at()
        .map(|sent_at| held.since.saturating_duration_since(sent_at).as_millis() as u64);
    tracing::warn!(
        containers = held.containers.len(),
        frozen_at_ms = unix_ms(),
        since_renewal_ms,
        freeze_after_ms = lease.freeze_after.map(|d| d.as_millis() as u64),
        "cannot renew the lease: froze {} sandbox(es) until a heartbeat gets through in time",
        held.containers.len()
    );
    record(&shared.fence, held).await;
}

async fn thaw(shared: &Shared, held: &mut Held) {
    let was = held.phase;
    let frozen_ms = shared
        .clock
        .now()
        .saturating_duration_since(held.since)
        .as_millis() as u64;
    // After a fence, the list is empty: those containers were killed.
    let thawed = held.containers.len();
    resume_all(shared, &held.containers).await;
    held.phase = Phase::Thawed;
    held.since = shared.clock.now();
    held.fenced_at = None;
    held.drained = true;
    // The record keeps saying `fenced` (and what was killed) until the
    // next freeze: nothing it names is thawed.
    if was == Phase::Frozen {
        record(&shared.fence, held).await;
    }
    held.containers.clear();
    shared.fence.publish(false);
    if was == Phase::Fenced {
        tracing::info!(
            thawed_at_ms = unix_ms(),
            fenced_ms = frozen_ms,
            "registered again after being fenced; sandboxes run here again as assigned"
        );
    } else {
        tracing::info!(
            containers = thawed,
            thawed_at_ms = unix_ms(),
            frozen_ms,
            "lease renewed in time: thawed {thawed} sandbox(es)"
        );
    }
}

/// The server declared this runner lost (a heartbeat or the assignments
/// answered `fenced`, for a request `sent_at`): everything it held has
/// been failed or moved. Kills every container (resuming paused ones so
/// the kill lands) and forgets what was frozen; nothing thaws until a
/// registration. Returns `false` (and does nothing) for a stale answer: a
/// request sent before the newest registration was answered.
pub(crate) async fn fenced(shared: &Shared, sent_at: Instant) -> bool {
    let mut held = shared.fence.held.lock().await;
    if let Some(registered_at) = shared.fence.lease().registered_at
        && sent_at < registered_at
    {
        tracing::debug!("a fenced answer to a request older than the newest registration; ignored");
        return false;
    }
    shared.fence.close().await;
    // Nothing is renewed until a worker holds its sandbox again for a
    // placement the server confirms.
    shared.fence.leases.lock().await.clear();
    let killed = kill_all(shared).await;
    held.phase = Phase::Fenced;
    held.since = shared.clock.now();
    held.fenced_at = Some(held.since);
    held.drained = true;
    held.containers = killed;
    tracing::warn!(
        containers = held.containers.len(),
        fenced_at_ms = unix_ms(),
        "the server declared this runner lost: killed {} sandbox(es)",
        held.containers.len()
    );
    record(&shared.fence, &held).await;
    held.containers.clear();
    true
}

/// Handles to the containers of this runner whose ids pass `wanted`.
fn handles(shared: &Shared, wanted: impl Fn(&str) -> bool) -> Vec<Arc<dyn Container>> {
    let ids = match shared.runtime.container_ids() {
        Ok(ids) => ids,
        Err(err) => {
            tracing::error!(%err, "cannot list this runner's containers");
            return Vec::new();
        }
    };
    ids.into_iter()
        .filter(|id| wanted(id))
        .filter_map(|id| {
            let id = SandboxId::new(id).ok()?;
            let paths = shared.data.sandbox_paths(&id).ok()?;
            Some(shared.runtime.container(id, paths))
        })
        .collect()
}

/// Runs `act` on every handle at once; returns the ids of those it acted
/// on (`Ok(true)`), sorted. One that fails (gone meanwhile, say) is logged
/// and skipped.
async fn each<F, Fut>(handles: Vec<Arc<dyn Container>>, what: &'static str, act: F) -> Vec<String>
where
    F: Fn(Arc<dyn Container>) -> Fut,
    Fut: std::future::Future<Output = oci::Result<bool>> + Send + 'static,
{
    let mut tasks = JoinSet::new();
    for handle in handles {
        let id = handle.id().to_string();
        let work = act(handle);
        tasks.spawn(async move { (id, work.await) });
    }
    let mut done = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((id, Ok(true))) => done.push(id),
            Ok((_, Ok(false))) => {}
            Ok((id, Err(err))) => {
                tracing::warn!(sandbox_id = %id, %err, "cannot {what} this sandbox; carrying on")
            }
            Err(join) => tracing::warn!(%join, "a {what} task failed"),
        }
    }
    done.sort();
    done
}

/// Pauses every running container not in `except`; returns those paused.
async fn pause_running(shared: &Shared, except: &[String]) -> Vec<String> {
    let handles = handles(shared, |id| !except.iter().any(|e| e == id));
    each(handles, "freeze", |handle| async move {
        match handle.state().await? {
            Some(state) if state.status == Status::Running => {
                handle.pause().await?;
                Ok(true)
            }
            _ => Ok(false),
        }
    })
    .await
}

/// SIGKILL to every container that has a live init; a paused one is
/// resumed after, so the kill lands (a frozen task cannot die). One whose
/// kill failed stays paused.
async fn kill_all(shared: &Shared) -> Vec<String> {
    each(handles(shared, |_| true), "kill", |handle| async move {
        let Some(state) = handle.state().await? else {
            return Ok(false);
        };
        if !matches!(
            state.status,
            Status::Running | Status::Paused | Status::Created
        ) {
            return Ok(false);
        }
        handle.kill(Signal::Kill).await?;
        if state.status == Status::Paused
            && let Err(err) = handle.resume().await
        {
            // Already dead (the kill landed through the freezer) or gone.
            tracing::debug!(sandbox_id = %handle.id(), %err, "resume after the kill");
        }
        Ok(true)
    })
    .await
}

/// Resumes the containers the freeze paused; one that is gone is skipped.
async fn resume_all(shared: &Shared, containers: &[String]) {
    if containers.is_empty() {
        return;
    }
    let handles = handles(shared, |id| containers.iter().any(|c| c == id));
    each(handles, "thaw", |handle| async move {
        match handle.state().await? {
            Some(state) if state.status == Status::Paused => {
                handle.resume().await?;
                Ok(true)
            }
            _ => Ok(false),
        }
    })
    .await;
}

/// Writes `DIR/fence.json` (temporary file, renamed into place).
async fn record(fence: &Fence, held: &Held) {
    let value = serde_json::json!({
        "state": held.phase.name(),
        "at_ms": unix_ms(),
        "containers": held.containers,
    });
    let path = fence.record.clone();
    let bytes = value.to_string().into_bytes();
    let written = tokio::task::spawn_blocking(move || write_durably(&path, &bytes)).await;
    match written {
        Ok(Ok(())) => {}
        Ok(Err(err)) => tracing::warn!(%err, "cannot record the fence's state"),
        Err(join) => tracing::warn!(%join, "cannot record the fence's state"),
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FREEZE_AFTER_MS: u64 = 6_000;

    /// Times in ms after a common origin.
    struct At(Instant);

    impl At {
        fn ms(&self, ms: u64) -> Instant {
            self.0 + Duration::from_millis(ms)
        }

        fn lease(&self, heartbeat_ms: Option<u64>, registration_ms: Option<u64>) -> Lease {
            Lease {
                heartbeat_sent_at: heartbeat_ms.map(|ms| self.ms(ms)),
                registration_sent_at: registration_ms.map(|ms| self.ms(ms)),
                registered_at: registration_ms.map(|ms| self.ms(ms + 10)),
                freeze_after: Some(Duration::from_millis(FREEZE_AFTER_MS)),
                lease_ttl: Some(Duration::from_millis(FREEZE_AFTER_MS * 3 / 2)),
            }
        }
    }

    /// `(phase, heartbeat sent, registration sent, fenced at, now, expected)`.
    type Row = (Phase, Option<u64>, Option<u64>, Option<u64>, u64, Move);

    #[test]
    fn when_to_freeze_and_thaw() {
        use Move::*;
        use Phase::*;
        let at = At(Instant::now());
        let rows: &[Row] = &[
            // Nothing before the first registration.
            (Thawed, None, None, None, 60_000, Stay),
            // Registration counts as a renewal for freezing.
            (Thawed, None, Some(0), None, 5_999, Stay),
            (Thawed, None, Some(0), None, 6_000, Freeze),
            // Measured from the newest renewal's send.
            (Thawed, Some(3_000), Some(0), None, 8_999, Stay),
            (Thawed, Some(3_000), Some(0), None, 9_000, Freeze),
            (Thawed, Some(3_000), Some(0), None, 30_000, Freeze),
            // Frozen until a heartbeat sent less than freeze_after ago.
            (Frozen, Some(3_000), Some(0), None, 9_100, Stay),
            (Frozen, Some(3_000), Some(0), None, 60_000, Stay),
            (Frozen, Some(9_500), Some(0), None, 9_600, Thaw),
            // A heartbeat sent before the freeze, answered after it, still
            // proves the lease: the server renewed it when it got it.
            (Frozen, Some(8_900), Some(0), None, 9_200, Thaw),
            // Answered too late to count: the next one will.
            (Frozen, Some(3_100), Some(0), None, 9_200, Stay),
            // A registration never thaws a freeze.
            (Frozen, Some(3_000), Some(9_500), None, 9_600, Stay),
            // Fenced: only a renewal sent after the fence thaws (what was
            // frozen is dead by then).
            (Fenced, Some(3_000), Some(0), Some(9_000), 9_100, Stay),
            (Fenced, Some(8_990), Some(0), Some(9_000), 9_100, Stay),
            (Fenced, Some(3_000), Some(9_050), Some(9_000), 9_100, Thaw),
            (Fenced, Some(3_000), Some(9_050), Some(9_000), 15_050, Stay),
        ];
        for (phase, heartbeat, registration, fenced, now, expected) in rows {
            let lease = at.lease(*heartbeat, *registration);
            assert_eq!(
                decide(*phase, &lease, fenced.map(|ms| at.ms(ms)), at.ms(*now)),
                *expected,
                "{phase:?}, heartbeat {heartbeat:?}, registration {registration:?}, fenced {fenced:?}, now {now}"
            );
        }
    }

    /// A lease of 9 s: heartbeats every 3 s, answered until the link goes
    /// at 10 s, one answered again at 17 s. Frozen at 15 s (the last
    /// answered one was sent at 9 s), at least one interval before the
    /// server could expire the lease (18 s), thawed by the one at 17 s.
    #[test]
    fn a_partition_freezes_then_thaws() {
        let at = At(Instant::now());
        let fence = Fence::new(
            PathBuf::from("/nonexistent/fence.json"),
            Arc::new(clock::TokioClock),
        );
        fence.registered(
            at.ms(0),
            Duration::from_millis(FREEZE_AFTER_MS),
            Duration::from_millis(9_000),
        );
        let answered = [3_000, 6_000, 9_000, 17_000];
        let mut phase = Phase::Thawed;
        let mut moves = Vec::new();
        for now in (0..=20_000).step_by(100) {
            if answered.contains(&now) {
                fence.renewed(at.ms(now));
            }
            let step = decide(phase, &fence.lease(), None, at.ms(now));
            match step {
                Move::Freeze => phase = Phase::Frozen,
                Move::Thaw => phase = Phase::Thawed,
                Move::Stay => continue,
            }
            moves.push((now, step));
        }
        assert_eq!(moves, [(15_000, Move::Freeze), (17_000, Move::Thaw)]);
    }

    #[test]
    fn renewals_keep_the_newest() {
        let at = At(Instant::now());
        let fence = Fence::new(
            PathBuf::from("/nonexistent/fence.json"),
            Arc::new(clock::TokioClock),
        );
        fence.renewed(at.ms(5_000));
        fence.renewed(at.ms(4_000));
        fence.registered(
            at.ms(1_000),
            Duration::from_millis(6_000),
            Duration::from_millis(9_000),
        );
        fence.registered(
            at.ms(2_000),
            Duration::from_millis(4_000),
            Duration::from_millis(6_000),
        );
        let lease = fence.lease();
        assert_eq!(lease.heartbeat_sent_at, Some(at.ms(5_000)));
        assert_eq!(lease.registration_sent_at, Some(at.ms(2_000)));
        assert_eq!(lease.freeze_after, Some(Duration::from_millis(4_000)));
        // The inits' deadline: halfway from the freeze to the lease's end
        // (5 s + 4 s + 1 s), after the fence's own freeze (9 s), before
        // the server could expire the lease (11 s).
        assert_eq!(lease.init_deadline(), Some(at.ms(10_000)));
    }

    /// A freeze waits for a step that passed the gate; later ones are
    /// refused; the workers see it.
    #[tokio::test]
    async fn the_gate_drains_then_refuses() {
        let fence = std::sync::Arc::new(Fence::new(
            PathBuf::from("/nonexistent/fence.json"),
            Arc::new(clock::TokioClock),
        ));
        let mut frozen = fence.subscribe();
        let step = fence.thawed().await.expect("thawed at first");
        let closing = tokio::spawn({
            let fence = fence.clone();
            async move { fence.close().await }
        });
        frozen.changed().await.expect("the fence lives");
        assert!(*frozen.borrow());
        drop(step);
        assert!(closing.await.expect("close ran"), "drained");
        assert!(fence.thawed().await.is_none());
    }
}
