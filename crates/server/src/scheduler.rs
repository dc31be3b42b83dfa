//! Placement: which runner a sandbox goes to. Filters runners by live
//! lease, capabilities, placement class and free capacity; prefers the
//! runner the sandbox last ran on (its home and blocks are there), then
//! spot before on-demand for `spot_first`, then the emptiest runner.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::db::{WriteTx, now_ms};
use crate::records::counts::{Usage, all_runner_usage, runner_usage};
use crate::records::runners::{RunnerRow, all_runners};
use crate::records::{SandboxRow, Transition, set_sandbox_state};
use api::lifecycle::{Placement, SandboxState, StorageClass};

/// What a sandbox needs from a runner, each named as `details.missing`
/// names it when no runner offers it.
#[derive(Clone, Debug)]
pub struct Needs {
    pub capabilities: Vec<String>,
    pub on_demand_only: bool,
    pub memory_mib: i64,
    pub millicpus: i64,
    pub pids: i64,
}

impl Needs {
    pub fn of(sandbox: &SandboxRow) -> Needs {
        let mut capabilities = vec![
            // An imported image is one the runner fetches from the
            // store; admission has already checked that it exists.
            if sandbox.image_root.is_some() {
                "image:store".to_owned()
            } else {
                format!("image:{}", sandbox.image)
            },
            format!("network:{}", sandbox.network),
            format!("storage:{}", sandbox.storage_class),
        ];
        // A bound home is bounded on every placement: a recovery or a
        // drain moves it only where the bound holds too.
        if sandbox.home_mib.is_some() {
            capabilities.push(api::sandboxes::HOME_BOUND_CAPABILITY.to_owned());
        }
        // Every shared filesystem it mounts, on every placement: a
        // recovery or a drain moves it only where they are all mounted.
        for mount in sandbox.mounts() {
            let capability = format!("filesystem:{}", mount.filesystem);
            if !capabilities.contains(&capability) {
                capabilities.push(capability);
            }
        }
        Needs {
            capabilities,
            on_demand_only: sandbox.placement == Placement::NonPreemptible,
            memory_mib: sandbox.memory_mib.unwrap_or(0),
            millicpus: sandbox.millicpus.unwrap_or(0),
            pids: sandbox.pids.unwrap_or(0),
        }
    }

    /// Whether it fits on `runner` next to what `used` there.
    pub fn fits(&self, runner: &RunnerRow, used: &Usage) -> bool {
        used.sandboxes < runner.capacity_sandboxes
            && used.memory_mib + self.memory_mib <= runner.capacity_memory_mib
            && used.millicpus + self.millicpus <= runner.capacity_millicpus
            && used.pids + self.pids <= runner.capacity_pids
    }

    /// Whether `runner` offers every capability and the placement class
    /// asked for: the part of [`Needs::missing_on`] that runners of one
    /// [`View`] kind share.
    fn offered_by(&self, runner: &RunnerRow) -> bool {
        self.capabilities
            .iter()
            .all(|c| runner.capabilities.contains(c))
            && !(self.on_demand_only && runner.placement_class != "on_demand")
    }

    /// Whether what is asked for exceeds the runner's whole capacity.
    fn exceeds(&self, runner: &RunnerRow) -> bool {
        self.memory_mib > runner.capacity_memory_mib
            || self.millicpus > runner.capacity_millicpus
            || self.pids > runner.capacity_pids
    }

    /// What `runner` lacks, by name; empty if it can run the sandbox at all
    /// (ignoring what is in use right now).
    pub fn missing_on(&self, runner: &RunnerRow) -> Vec<String> {
        let mut missing: Vec<String> = self
            .capabilities
            .iter()
            .filter(|c| !runner.capabilities.contains(c))
            .cloned()
            .collect();
        if self.on_demand_only && runner.placement_class != "on_demand" {
            missing.push("placement:non_preemptible".to_owned());
        }
        if self.memory_mib > runner.capacity_memory_mib {
            missing.push(format!("resources.memory_mib:{}", self.memory_mib));
        }
        if self.millicpus > runner.capacity_millicpus {
            missing.push(format!("resources.cpus:{}", self.millicpus as f64 / 1000.0));
        }
        if self.pids > runner.capacity_pids {
            missing.push(format!("resources.pids:{}", self.pids));
        }
        missing
    }
}

/// The outcome of trying to place one sandbox.
#[derive(Debug, PartialEq, Eq)]
pub enum Placed {
    On(String),
    /// Stays where it is, with this reason (`no_capacity`, …).
    Waiting(&'static str),
    /// A standard sandbox whose home was on a runner that is gone.
    HomeLost,
    /// Changed under us; the next pass will look again.
    Raced,
}

/// How long a server places from the runners (and their usage) as it last
/// read them, instead of reading every runner for each create. Nothing is
/// decided on it alone: a runner picked from it is locked and checked in
/// the records, a refusal or a wait it suggests is checked against a
/// fresh read, and this server's own placements update it at once.
pub const RUNNER_VIEW_TTL: Duration = Duration::from_secs(1);

/// A fresh read asked for within this long of the last one is that one:
/// a burst of creates the fleet cannot take reads every runner ten times
/// a second, not once per create. (Runners registered or drained through
/// this server are seen at once: its commit clears the view.)
pub const RUNNER_VIEW_FRESH: Duration = Duration::from_millis(100);

/// A view older than [`RUNNER_VIEW_TTL`] but younger than this is still
/// placed from while one read ahead, on a connection of its own, replaces
/// it. At 10,000 runners the read takes about 20 ms of PostgreSQL and a
/// sixth of a busy server's CPU (decoding 10,000 rows); read inside the
/// creates that found the view stale, each of those held its transaction
/// open for it, and creates arriving together each read it.
pub const RUNNER_VIEW_STALE: Duration = Duration::from_secs(3);

/// The runners and their usage as this server last read them.
#[derive(Default)]
pub struct RunnerView {
    inner: std::sync::Mutex<Option<View>>,
    /// Bumped by [`RunnerView::clear`]: a read begun before it is not kept.
    generation: AtomicU64,
    /// Whether a read ahead is under way (at most one at a time).
    reading_ahead: AtomicBool,
    /// Held by a placement reading the view in its transaction: others
    /// that find no view young enough wait for that read, then place from
    /// it if it is (after a clear, creates arriving together each read
    /// every runner otherwise: the fleet's first second).
    reading: tokio::sync::Mutex<()>,
    /// Reads of every runner so far (`roost_runner_view_reads_total`).
    reads: AtomicU64,
}

/// One read of the runners. Placement looks at every runner for each
/// sandbox, so what it asks is kept cheap at 10,000 runners: runners that
/// offer the same capabilities and placement class are one kind, checked
/// once per sandbox; usage is found by position, not by id.
#[derive(Clone)]
pub struct View {
    at: std::time::Instant,
    pub runners: Arc<Vec<RunnerRow>>,
    /// For each runner (same position): the position of the first runner
    /// of its kind.
    kind: Arc<Vec<usize>>,
    /// For each runner: its usage as read, or as this server since noted.
    /// Shared by every copy of this view, so a note costs no copy.
    usage: Arc<Vec<UsageCell>>,
    position: Arc<HashMap<String, usize>>,
}

/// A runner's usage, updated in place by [`RunnerView::note`].
#[derive(Default)]
struct UsageCell([AtomicI64; 4]);

impl UsageCell {
    fn new(usage: Usage) -> UsageCell {
        let cell = UsageCell::default();
        cell.set(usage);
        cell
    }

    fn get(&self) -> Usage {
        let [sandboxes, memory_mib, millicpus, pids] =
            self.0.each_ref().map(|n| n.load(Ordering::Relaxed));
        Usage {
            sandboxes,
            memory_mib,
            millicpus,
            pids,
        }
    }

    fn set(&self, usage: Usage) {
        let values = [
            usage.sandboxes,
            usage.memory_mib,
            usage.millicpus,
            usage.pids,
        ];
        for (n, value) in self.0.iter().zip(values) {
            n.store(value, Ordering::Relaxed);
        }
    }
}

impl View {
    /// The view of a read begun at `at`.
    fn new(
        at: std::time::Instant,
        runners: Vec<RunnerRow>,
        mut usage: BTreeMap<String, Usage>,
    ) -> View {
        let mut first_of_kind: HashMap<(&[String], &str), usize> = HashMap::new();
        let kind = runners
            .iter()
            .enumerate()
            .map(|(i, r)| {
                *first_of_kind
                    .entry((r.capabilities.as_slice(), r.placement_class.as_str()))
                    .or_insert(i)
            })
            .collect();
        let usage = runners
            .iter()
            .map(|r| UsageCell::new(usage.remove(&r.id).unwrap_or_default()))
            .collect();
        let position = runners
            .iter()
            .enumerate()
            .map(|(i, r)| (r.id.clone(), i))
            .collect();
        View {
            at,
            runners: Arc::new(runners),
            kind: Arc::new(kind),
            usage: Arc::new(usage),
            position: Arc::new(position),
        }
    }

    /// For each runner of the view, whether its kind offers what `needs`
    /// asks for (each kind checked once).
    fn offering(&self, needs: &Needs) -> Vec<bool> {
        let mut offers = vec![false; self.runners.len()];
        for (i, runner) in self.runners.iter().enumerate() {
            let first = self.kind[i];
            offers[i] = if first == i {
                needs.offered_by(runner)
            } else {
                offers[first]
            };
        }
        offers
    }

    /// What the best-suited runner lacks to ever run a sandbox with these
    /// needs: empty if some runner can, `None` if there is no runner.
    pub fn missing(&self, needs: &Needs) -> Option<Vec<String>> {
        let offers = self.offering(needs);
        let can_run = self
            .runners
            .iter()
            .zip(&offers)
            .any(|(runner, offered)| *offered && !needs.exceeds(runner));
        if can_run {
            return Some(Vec::new());
        }
        self.runners
            .iter()
            .map(|r| needs.missing_on(r))
            .min_by_key(Vec::len)
    }
}

impl RunnerView {
    /// The view, read again if older than `max_age` ([`RUNNER_VIEW_TTL`],
    /// [`RUNNER_VIEW_FRESH`], or zero: read now).
    ///
    /// A view older than [`RUNNER_VIEW_TTL`] (and younger than
    /// [`RUNNER_VIEW_STALE`]) asked for with that age is answered as it is,
    /// and read again ahead, off the caller's transaction.
    pub async fn read(tx: &mut WriteTx, max_age: Duration) -> Result<View, sqlx::Error> {
        let cache = tx.runner_view.clone();
        if let Some(view) = cache.cached() {
            let age = view.at.elapsed();
            if age < max_age {
                return Ok(view);
            }
            if max_age >= RUNNER_VIEW_TTL && age < RUNNER_VIEW_STALE {
                cache.read_ahead(tx.pool.clone());
                return Ok(view);
            }
        }
        let _turn = cache.reading.lock().await;
        if let Some(view) = cache.cached()
            && view.at.elapsed() < max_age
        {
            return Ok(view);
        }
        let generation = cache.generation.load(Ordering::SeqCst);
        let view = read_view(&mut tx.tx).await?;
        cache.reads.fetch_add(1, Ordering::Relaxed);
        cache.keep(view.clone(), generation);
        Ok(view)
    }

    fn cached(&self) -> Option<View> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Reads the view on a task of its own, unless one already is.
    fn read_ahead(self: &Arc<Self>, pool: sqlx::AnyPool) {
        if self.reading_ahead.swap(true, Ordering::SeqCst) {
            return;
        }
        let generation = self.generation.load(Ordering::SeqCst);
        let cache = self.clone();
        tokio::spawn(async move {
            let read = async {
                let mut conn = pool.acquire().await?;
                read_view(&mut conn).await
            };
            match read.await {
                Ok(view) => {
                    cache.reads.fetch_add(1, Ordering::Relaxed);
                    cache.keep(view, generation);
                }
                // The view stays as it was; past its staleness bound a
                // placement reads it in its own transaction.
                Err(err) => tracing::debug!(%err, "reading the runners ahead failed"),
            }
            cache.reading_ahead.store(false, Ordering::SeqCst);
        });
    }

    /// Keeps `view` unless the view was cleared since its read began, or
    /// a read begun later is already kept.
    fn keep(&self, view: View, generation: u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let newer_kept = inner.as_ref().is_some_and(|kept| kept.at > view.at);
        if self.generation.load(Ordering::SeqCst) == generation && !newer_kept {
            *inner = Some(view);
        }
    }

    /// Forgets the view: the next placement reads the runners again.
    pub fn clear(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        self.generation.fetch_add(1, Ordering::SeqCst);
        *inner = None;
    }

    /// Reads of every runner since start.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// What this server now knows a runner uses (after placing on it, or
    /// reading its usage under its lock).
    fn note(&self, runner_id: &str, usage: Usage) {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(view) = inner.as_ref()
            && let Some(&i) = view.position.get(runner_id)
        {
            view.usage[i].set(usage);
        }
    }
}

/// Every runner and its usage, as of now.
async fn read_view(conn: &mut sqlx::AnyConnection) -> Result<View, sqlx::Error> {
    let at = std::time::Instant::now();
    let runners = all_runners(conn).await?;
    let usage = all_runner_usage(conn).await?;
    Ok(View::new(at, runners, usage))
}

/// Places `sandbox` (in `pending` or `recovering`, no runner) if a runner
/// fits, moving it to `starting` with a bumped epoch. The runner's row is
/// locked (an UPDATE) before its kept usage (`records::counts`) is read,
/// so servers placing at once never overfill it.
pub async fn place(tx: &mut WriteTx, sandbox: &SandboxRow) -> Result<Placed, sqlx::Error> {
    if !bindings_allow(tx, sandbox).await? {
        return Ok(Placed::Waiting(FILESYSTEM_UNBOUND));
    }
    // From the view first; what it says cannot be done, checked fresh.
    // A home declared lost is read now: it fails the sandbox.
    match place_from(tx, sandbox, RUNNER_VIEW_TTL).await? {
        Placed::HomeLost => place_from(tx, sandbox, Duration::ZERO).await,
        Placed::Waiting(_) => place_from(tx, sandbox, RUNNER_VIEW_FRESH).await,
        placed => Ok(placed),
    }
}

/// Why a sandbox waits whose shared filesystem is no longer bound to its
/// org: it runs again once bound again.
pub const FILESYSTEM_UNBOUND: &str = "filesystem_unbound";

/// Each placement (create, start, wake, recovery, drain) mounts only what
/// the org's bindings allow now, not what they allowed at create: an
/// unbound filesystem keeps the sandbox from running (false), and one
/// rebound read-only is mounted read-only (the record's mounts are
/// updated). A revocation thus reaches every sandbox at its next start.
async fn bindings_allow(tx: &mut WriteTx, sandbox: &SandboxRow) -> Result<bool, sqlx::Error> {
    let mut mounts = sandbox.mounts();
    if mounts.is_empty() {
        return Ok(true);
    }
    let mut changed = false;
    for mount in &mut mounts {
        let binding =
            crate::records::filesystems::binding(tx, &mount.filesystem, &sandbox.org_id).await?;
        let Some(binding) = binding else {
            return Ok(false);
        };
        if binding.read_only && !mount.read_only {
            mount.read_only = true;
            changed = true;
        }
    }
    if changed {
        crate::records::sandboxes::set_mounts(tx, &sandbox.id, &mounts).await?;
    }
    Ok(true)
}

async fn place_from(
    tx: &mut WriteTx,
    sandbox: &SandboxRow,
    max_age: Duration,
) -> Result<Placed, sqlx::Error> {
    let now = now_ms();
    let needs = Needs::of(sandbox);
    let view = RunnerView::read(tx, max_age).await?;
    let runners = &view.runners;
    // A standard home lives on its runner: it can start only there.
    let home_runner = (sandbox.storage_class == StorageClass::Standard)
        .then_some(sandbox.last_runner_id.as_deref())
        .flatten();
    if let Some(home) = home_runner {
        match view.position.get(home).map(|&i| &runners[i]) {
            Some(r) if r.state == "live" => {}
            _ => return Ok(Placed::HomeLost),
        }
    }
    // A first filter on the view's usage skips full runners without a
    // round trip each; the one chosen is checked again under its lock.
    let offers = view.offering(&needs);
    let last = sandbox.last_runner_id.as_deref();
    let mut candidates: Vec<(bool, bool, std::cmp::Reverse<i64>, usize)> = runners
        .iter()
        .enumerate()
        .filter(|&(i, r)| {
            offers[i]
                && r.is_live(now)
                && r.drain.is_none()
                && !needs.exceeds(r)
                && needs.fits(r, &view.usage[i].get())
                && home_runner.is_none_or(|home| r.id == home)
        })
        .map(|(i, r)| {
            (
                Some(r.id.as_str()) != last,
                r.placement_class != "spot",
                std::cmp::Reverse(r.capacity_sandboxes),
                i,
            )
        })
        .collect();
    // The position last: runners equal in all else are tried in id order.
    candidates.sort_unstable();
    for runner in candidates.into_iter().map(|(.., i)| &runners[i]) {
        tx.take_turn(&format!("runner:{}", runner.id)).await;
        let locked = sqlx::query(
            "UPDATE runners SET placements = placements + 1 WHERE id = $1 AND state = 'live' AND drain IS NULL
             AND EXISTS (SELECT 1 FROM runner_leases WHERE runner_id = $1 AND expires_at_ms > $2)",
        )
        .bind(&runner.id)
        .bind(now)
        .execute(&mut *tx.tx)
        .await?;
        if locked.rows_affected() == 0 {
            continue;
        }
        // Its kept usage, now that no other placement on it can commit.
        let usage = runner_usage(tx, &runner.id).await?;
        if !needs.fits(runner, &usage) {
            tx.runner_view.note(&runner.id, usage);
            continue;
        }
        tx.runner_view.note(
            &runner.id,
            Usage {
                sandboxes: usage.sandboxes + 1,
                memory_mib: usage.memory_mib + needs.memory_mib,
                millicpus: usage.millicpus + needs.millicpus,
                pids: usage.pids + needs.pids,
            },
        );
        // The events tell what a recovered (or moved) home comes back from.
        let message = match (&sandbox.home.root, sandbox.home.saved_at_ms) {
            (Some(root), Some(saved_at)) if sandbox.storage_class == StorageClass::Durable => {
                Some(format!(
                    "restoring the home's last completed save, taken at {} (root {})",
                    crate::records::rfc3339(saved_at),
                    root.get(..16).unwrap_or(root)
                ))
            }
            (None, _) if sandbox.state == SandboxState::Recovering => {
                Some("no save completed yet: the home starts empty".to_owned())
            }
            _ => None,
        };
        // A wake says what woke it, then what it comes back from.
        let message = match (sandbox.desired_reason.as_deref(), &sandbox.desired_message) {
            (Some(crate::control::idle::WOKEN_BY_COMMAND), Some(woken))
                if sandbox.state == SandboxState::Pending =>
            {
                let from = match (sandbox.storage_class, message) {
                    (_, Some(restoring)) => restoring,
                    (StorageClass::Durable, None) => {
                        "no save completed yet: the home starts empty".to_owned()
                    }
                    (StorageClass::Standard, None) => {
                        format!("the home is on runner {} as it was left", runner.id)
                    }
                };
                Some(format!("{woken}; {from}"))
            }
            _ => message,
        };
        let placed = set_sandbox_state(
            tx,
            sandbox,
            Transition {
                state: SandboxState::Starting,
                reason: Some("placed"),
                message: message.as_deref(),
            },
            Some(&runner.id),
            sandbox.epoch + 1,
        )
        .await?;
        return Ok(if placed {
            Placed::On(runner.id.clone())
        } else {
            Placed::Raced
        });
    }
    Ok(Placed::Waiting("no_capacity"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runner(id: &str, capabilities: &[&str], class: &str, memory_mib: i64) -> RunnerRow {
        RunnerRow {
            id: id.to_owned(),
            placement_class: class.to_owned(),
            capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
            capacity_sandboxes: 10,
            capacity_memory_mib: memory_mib,
            capacity_millicpus: 4000,
            capacity_pids: 1000,
            state: "live".to_owned(),
            lease_expires_at_ms: i64::MAX,
            drain: None,
        }
    }

    fn needs(capabilities: &[&str], on_demand_only: bool, memory_mib: i64) -> Needs {
        Needs {
            capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
            on_demand_only,
            memory_mib,
            millicpus: 0,
            pids: 0,
        }
    }

    #[test]
    fn runners_are_checked_by_kind_and_each_kind_answers_for_itself() {
        let view = View::new(
            std::time::Instant::now(),
            vec![
                runner("r1", &["image:a"], "spot", 1024),
                runner("r2", &["image:a", "image:b"], "spot", 1024),
                runner("r3", &["image:a"], "spot", 4096),
                runner("r4", &["image:a", "image:b"], "on_demand", 1024),
                runner("r5", &["image:a", "image:b"], "spot", 1024),
            ],
            BTreeMap::new(),
        );
        assert_eq!(*view.kind, vec![0, 1, 0, 3, 1]);
        assert_eq!(
            view.offering(&needs(&["image:b"], false, 0)),
            vec![false, true, false, true, true]
        );
        assert_eq!(
            view.offering(&needs(&["image:b"], true, 0)),
            vec![false, false, false, true, false]
        );
        // Capacity is each runner's own, though r1 and r3 are one kind.
        assert_eq!(
            view.missing(&needs(&["image:a"], false, 2048)),
            Some(vec![])
        );
        assert_eq!(
            view.missing(&needs(&["image:b"], false, 2048)),
            Some(vec!["resources.memory_mib:2048".to_owned()])
        );
        assert_eq!(
            view.missing(&needs(&["image:c"], false, 0)),
            Some(vec!["image:c".to_owned()])
        );
        assert_eq!(
            View::new(std::time::Instant::now(), Vec::new(), BTreeMap::new()).missing(&needs(
                &[],
                false,
                0
            )),
            None
        );
    }

    async fn sqlite_db() -> (crate::db::Db, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("r.db").display());
        let db = crate::db::Db::connect(&url).await.expect("open");
        db.migrate().await.expect("migrate");
        (db, dir)
    }

    /// A runner registered as through another server: nothing clears
    /// this server's view.
    async fn add_runner(db: &crate::db::Db, id: &str) {
        let request: api::runners::RegisterRequest = serde_json::from_value(serde_json::json!({
            "name": id,
            "placement_class": "on_demand",
            "capabilities": [],
            "capacity": {"sandboxes": 10, "memory_mib": 4096, "cpus": 4.0, "pids": 1000},
        }))
        .expect("request");
        let mut tx = db.write().await.expect("tx");
        let new = crate::records::runners::NewRunner {
            id,
            credential_hash: id,
            profile: None,
        };
        crate::records::runners::register_new(&mut tx, &request, now_ms() + 60_000, new)
            .await
            .expect("register");
        tx.runners_changed = false;
        tx.commit().await.expect("commit");
    }

    async fn view_ids(db: &crate::db::Db, max_age: Duration) -> Vec<String> {
        let mut tx = db.write().await.expect("tx");
        let view = RunnerView::read(&mut tx, max_age).await.expect("view");
        view.runners.iter().map(|r| r.id.clone()).collect()
    }

    /// Makes the kept view look read `age` ago.
    fn age_view(db: &crate::db::Db, age: Duration) {
        let mut inner = db.runner_view.inner.lock().expect("view lock");
        let view = inner.as_mut().expect("a view");
        view.at = std::time::Instant::now() - age;
    }

    async fn until_no_read_ahead(db: &crate::db::Db) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while db.runner_view.reading_ahead.load(Ordering::SeqCst) {
            assert!(
                std::time::Instant::now() < deadline,
                "the read ahead never ended"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_stale_view_is_placed_from_while_one_read_ahead_replaces_it() {
        let (db, _dir) = sqlite_db().await;
        add_runner(&db, "r1").await;
        assert_eq!(view_ids(&db, RUNNER_VIEW_TTL).await, ["r1"]);
        assert_eq!(db.runner_view.reads(), 1);
        add_runner(&db, "r2").await;
        age_view(&db, RUNNER_VIEW_TTL + Duration::from_millis(100));
        // Creates arriving together find it stale: each is answered from
        // it at once, and it is read once, off their transactions. (The
        // read ahead cannot run before this test yields: one thread.)
        let mut tx = db.write().await.expect("tx");
        for _ in 0..20 {
            let view = RunnerView::read(&mut tx, RUNNER_VIEW_TTL)
                .await
                .expect("view");
            assert_eq!(view.runners.len(), 1);
        }
        drop(tx);
        until_no_read_ahead(&db).await;
        assert_eq!(db.runner_view.reads(), 2);
        assert_eq!(view_ids(&db, RUNNER_VIEW_TTL).await, ["r1", "r2"]);
        // A fresh read (placement's second look) is never answered stale.
        add_runner(&db, "r3").await;
        age_view(&db, RUNNER_VIEW_FRESH + Duration::from_millis(100));
        assert_eq!(view_ids(&db, RUNNER_VIEW_FRESH).await, ["r1", "r2", "r3"]);
        // Nor is a view past its staleness bound.
        add_runner(&db, "r4").await;
        age_view(&db, RUNNER_VIEW_STALE);
        assert_eq!(
            view_ids(&db, RUNNER_VIEW_TTL).await,
            ["r1", "r2", "r3", "r4"]
        );
        assert_eq!(db.runner_view.reads(), 4);
    }

    /// After a clear (a runner registered), creates arriving together
    /// find no view: one reads every runner while the others wait for it
    /// and place from what it read (issue 21: the fleet's first second,
    /// eight creates reading 10,000 runners each). PostgreSQL: SQLite
    /// runs one transaction at a time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn placements_that_find_no_view_together_read_it_once() {
        let Ok(base) = std::env::var("ROOST_TEST_POSTGRES_URL") else {
            return;
        };
        use sqlx::Connection;
        let name = format!("roost_scheduler_view_{}", std::process::id());
        let mut admin = sqlx::PgConnection::connect(&base).await.expect("connect");
        for statement in [
            format!("DROP DATABASE IF EXISTS {name}"),
            format!("CREATE DATABASE {name}"),
        ] {
            sqlx::query(&statement)
                .execute(&mut admin)
                .await
                .expect("a fresh database");
        }
        let (prefix, _) = base.rsplit_once('/').expect("a url with a database");
        let db = crate::db::Db::connect(&format!("{prefix}/{name}"))
            .await
            .expect("open");
        db.migrate().await.expect("migrate");
        add_runner(&db, "r1").await;
        db.runner_view.clear();
        let creates = 8;
        let together = Arc::new(tokio::sync::Barrier::new(creates));
        let placements: Vec<_> = (0..creates)
            .map(|_| {
                let (db, together) = (db.clone(), together.clone());
                tokio::spawn(async move {
                    let mut tx = db.write().await.expect("tx");
                    together.wait().await;
                    // Any view read since is young enough for this test.
                    let view = RunnerView::read(&mut tx, Duration::from_secs(600))
                        .await
                        .expect("view");
                    view.runners.len()
                })
            })
            .collect();
        for placement in placements {
            assert_eq!(placement.await.expect("placement"), 1);
        }
        assert_eq!(db.runner_view.reads(), 1, "one read for all of them");
        drop(db);
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&mut admin)
            .await;
    }

    #[tokio::test]
    async fn the_view_has_each_runners_renewed_lease_and_a_lost_ones_end_in_id_order() {
        let (db, _dir) = sqlite_db().await;
        add_runner(&db, "r2").await;
        add_runner(&db, "r1").await;
        let registered = {
            let mut tx = db.write().await.expect("tx");
            RunnerView::read(&mut tx, Duration::ZERO)
                .await
                .expect("view")
                .runners
                .iter()
                .map(|r| r.lease_expires_at_ms)
                .collect::<Vec<_>>()
        };
        // Renewals write only the lease's own table: the view has them.
        let renewed_until = now_ms() + 120_000;
        crate::records::runners::renew_leases(&db, &["r1".to_owned()], renewed_until)
            .await
            .expect("renew");
        let mut tx = db.write().await.expect("tx");
        assert!(
            crate::records::runners::mark_lost(&mut tx, "r2", now_ms() + 61_000)
                .await
                .expect("mark lost")
        );
        tx.commit().await.expect("commit");
        let mut tx = db.write().await.expect("tx");
        let view = RunnerView::read(&mut tx, Duration::ZERO)
            .await
            .expect("view");
        let ids: Vec<&str> = view.runners.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["r1", "r2"]);
        let (r1, r2) = (&view.runners[0], &view.runners[1]);
        assert_eq!(r1.lease_expires_at_ms, renewed_until);
        assert!(r1.is_live(now_ms()));
        // A lost runner has no lease row: it keeps the lease it ended with.
        assert_eq!(
            (r2.state.as_str(), r2.lease_expires_at_ms),
            ("lost", registered[1])
        );
        assert!(!r2.is_live(now_ms()));
    }

    #[tokio::test]
    async fn a_read_ahead_begun_before_the_view_was_cleared_is_not_kept() {
        let (db, _dir) = sqlite_db().await;
        add_runner(&db, "r1").await;
        view_ids(&db, RUNNER_VIEW_TTL).await;
        age_view(&db, RUNNER_VIEW_TTL + Duration::from_millis(100));
        view_ids(&db, RUNNER_VIEW_TTL).await;
        assert!(db.runner_view.reading_ahead.load(Ordering::SeqCst));
        // A runner registered through this server clears the view at its
        // commit, before the read ahead (which may not see it) ends.
        db.runner_view.clear();
        until_no_read_ahead(&db).await;
        assert!(db.runner_view.cached().is_none(), "the read ahead was kept");
    }

    #[test]
    fn a_noted_usage_is_seen_by_every_copy_of_the_view() {
        let runner_view = RunnerView::default();
        let mut usage = BTreeMap::new();
        usage.insert(
            "r2".to_owned(),
            Usage {
                sandboxes: 3,
                ..Usage::default()
            },
        );
        let view = View::new(
            std::time::Instant::now(),
            vec![
                runner("r1", &[], "spot", 1024),
                runner("r2", &[], "spot", 1024),
            ],
            usage,
        );
        assert_eq!(view.usage[1].get().sandboxes, 3);
        *runner_view.inner.lock().expect("view lock") = Some(view.clone());
        let noted = Usage {
            sandboxes: 4,
            memory_mib: 512,
            millicpus: 100,
            pids: 7,
        };
        runner_view.note("r2", noted);
        runner_view.note("unknown", noted);
        assert_eq!(view.usage[1].get(), noted);
        assert_eq!(view.usage[0].get(), Usage::default());
    }
}
