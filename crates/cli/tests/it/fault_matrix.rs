//! The runner killed (kill -9, at a fault point) at every step of a running
//! save and of a stop's securing, crossed with what becomes of it (issue
//! 13, point 10), through real processes: a `roost server` with a store,
//! two `roost runner` processes driving runc (each its own data dir and
//! cgroup parent, homes on a loop-mounted btrfs), a durable sandbox.
//!
//! | fault point (`ROOST_FAILPOINT`) | committed | back before lease | never back | back after lease, moved | back after lease, placed back |
//! |---------------------------------|-----------|-------------------|------------|------------------------|-------------------------------|
//! | `runner:save_before_upload`     | no        | ✓                 | ✓          | ✓                      | ✓                             |
//! | `runner:save_mid_upload`        | no        | ✓                 | ✓          | ✓                      | ✓                             |
//! | `runner:save_before_commit`     | no        | ✓                 | ✓          | ✓                      | ✓                             |
//! | `runner:save_after_commit`      | yes       | ✓                 | ✓          | ✓                      | ✓                             |
//! | `runner:secure_before_upload`   | no        | ✓                 | ✓          | ✓                      | ✓                             |
//! | `runner:secure_before_commit`   | no        | ✓                 | ✓          | ✓                      | ✓                             |
//! | `runner:secure_after_commit`    | yes       | ✓                 | ✓          | ✓                      | ✓                             |
//!
//! Each row ([`MATRIX`]) is one test, and its one sandbox goes through the
//! columns in turn. The victim is the runner that holds the sandbox; the
//! other one stands by:
//!
//! 1. *back before its lease expired*: killed at the point, restarted at
//!    once on the same data dir, it carries on with its own copy;
//! 2. *never back*: killed at the point again and left dead: once its
//!    lease expired the sandbox is recovered on the other runner (a
//!    securing one is `recovering`, or `stopped` if the securing
//!    committed, until it is started);
//! 3. *back after its lease, moved*: that victim then comes back on its
//!    data dir, the sandbox running elsewhere: it kills the frozen
//!    container and keeps its copy of the home aside;
//! 4. *back after its lease, placed back*: the runner the sandbox now runs
//!    on is killed at the point, the other one drained, so that only the
//!    victim's return can place the sandbox again: a new placement on the
//!    runner that holds the old one's container and home.
//!
//! After each, the same checks: (1) no acknowledged write that a completed
//! save held is missing (markers appended to a file, each save read back
//! from the store: [`Case::check_writes`]); (2) no workload runs on two
//! hosts at once past the freeze point (a stamp file per placement, the
//! victim's init log: [`Case::check_one_writer`]); (3) the record came to
//! rest with a reason, on it and on every event ([`Case::check_converged`]);
//! (4) no copy of the home deleted while it may be the newest, none kept
//! needlessly ([`Case::check_copies`]).
//!
//! The other rows of issue 13's point 10 are elsewhere: a runner process
//! killed with its host up in `failover.rs`
//! (`a_dead_runner_process_leaves_its_sandbox_frozen_and_its_copy_writes_nothing_after_the_freeze`,
//! `a_runner_restarted_within_its_lease_thaws_what_its_inits_froze`; host
//! loss, partitions and the seeded chaos loop there too); a server killed
//! between the commit and the answer of a create, and the idempotent
//! retry, in `sandboxes.rs`
//! (`a_create_retried_after_the_server_died_between_commit_and_answer_returns_the_same_sandbox`);
//! a runner lost while securing a home no save ever held in `durable.rs`
//! (`a_runner_lost_while_securing_keeps_the_only_copy_aside_and_the_record_says_so`),
//! and a store refusing writes while securing there
//! (`a_securing_that_fails_says_so_keeps_the_home_and_ends_once_the_store_takes_writes`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::failover::{frozen_at, now_ms, parse_ms, remove_cgroups, stamps, start_stamper};
use crate::plane::{Api, Plane, eventually};
use crate::runner_e2e::{RunnerProcess, create_running, sh, wait_sandbox};

/// What a fault point interrupts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum During {
    /// A scheduled save of the running home, the workload writing on.
    Save,
    /// A stop's securing: nothing runs in the home any more.
    Securing,
}

use During::{Save, Securing};

/// A row of the matrix: where the runner dies, and whether the server has
/// committed the interrupted save by then.
struct Row {
    failpoint: &'static str,
    during: During,
    commits: bool,
}

const fn row(failpoint: &'static str, during: During, commits: bool) -> Row {
    Row {
        failpoint,
        during,
        commits,
    }
}

/// Every row; each runs every column (see the module's doc).
const MATRIX: &[Row] = &[
    row("runner:save_before_upload", Save, false),
    row("runner:save_mid_upload", Save, false),
    row("runner:save_before_commit", Save, false),
    row("runner:save_after_commit", Save, true),
    row("runner:secure_before_upload", Securing, false),
    row("runner:secure_before_commit", Securing, false),
    row("runner:secure_after_commit", Securing, true),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_killed_before_upload() {
    run("runner:save_before_upload").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_killed_mid_upload() {
    run("runner:save_mid_upload").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_killed_before_commit() {
    run("runner:save_before_commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_killed_after_commit() {
    run("runner:save_after_commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn securing_killed_before_upload() {
    run("runner:secure_before_upload").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn securing_killed_before_commit() {
    run("runner:secure_before_commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn securing_killed_after_commit() {
    run("runner:secure_after_commit").await;
}

/// The row of `failpoint`, through every column.
async fn run(failpoint: &str) {
    let row = MATRIX
        .iter()
        .find(|row| row.failpoint == failpoint)
        .expect("a row of the matrix");
    let mut case = Case::start(row).await;
    let fault = case.kill_at_the_point().await;
    case.back_before_lease(&fault).await;
    let fault = case.kill_at_the_point().await;
    case.never_back(&fault).await;
    case.back_after_lease_moved(&fault).await;
    case.hand_over().await;
    let fault = case.kill_at_the_point().await;
    case.back_after_lease_placed_back(&fault).await;
}

/// The lease: short, so that a lost runner is recovered within seconds.
const LEASE: &str = "3s";
/// A running save every second (save rows).
const SAVE_INTERVAL_S: u64 = 1;
/// The longest any step is waited for.
const PATIENCE: Duration = Duration::from_secs(60);

/// What a kill at the point left: when it was armed, the markers the
/// victim's copy held, and the record just before (the old runner process
/// dead, the armed one not yet started) and just after.
struct Fault {
    armed_at_ms: i64,
    markers: Vec<String>,
    before: Value,
    after: Value,
    /// Whether the interrupted save or securing was committed.
    committed: bool,
}

impl Fault {
    fn epoch(&self) -> u64 {
        self.before["epoch"].as_u64().expect("epoch")
    }

    /// The last completed save once the victim died.
    fn saved_root(&self) -> Option<&str> {
        self.after["save"]["root"].as_str()
    }
}

/// What became of the victim, as the checks need to know it.
#[derive(Clone, Copy, Debug)]
enum Fate {
    /// Restarted at this time (ms), before its lease expired.
    BackBefore(i64),
    /// Dead, its lease expired.
    Away,
    /// Restarted at this time (ms), its lease long expired.
    BackAfter(i64),
}

/// One row's world: a server with a store, two runners, the sandbox and
/// the markers written into its home.
struct Case {
    row: &'static Row,
    runners: Vec<RunnerProcess>,
    /// The runner that holds the sandbox and is killed; the other one.
    victim: usize,
    other: usize,
    cgroups: Vec<String>,
    plane: Plane,
    store: tempfile::TempDir,
    dir: tempfile::TempDir,
    id: String,
    /// Every marker a command appended to the home and saw written.
    acknowledged: Vec<String>,
    /// When the victim's init froze the workload its dead runner left (read
    /// from its log before a return removes it).
    victim_frozen_at: Option<i64>,
}

impl Drop for Case {
    fn drop(&mut self) {
        // Runners (and their containers) go before the server and cgroups.
        self.runners.clear();
        for cgroup in &self.cgroups {
            remove_cgroups(cgroup);
        }
    }
}

impl Case {
    /// The server, the victim with the sandbox running on it, the other.
    async fn start(row: &'static Row) -> Case {
        let store = tempfile::tempdir().expect("store dir");
        let store_arg = store.path().to_str().expect("utf-8").to_owned();
        let plane = Plane::start(&[
            "--store",
            &store_arg,
            "--lease-ttl",
            LEASE,
            "--save-interval-min",
            "1s",
        ])
        .await;
        let dir = tempfile::Builder::new()
            .prefix("roost-matrix-")
            .tempdir()
            .expect("tempdir");
        let mut case = Case {
            row,
            runners: Vec::new(),
            victim: 0,
            other: 1,
            cgroups: Vec::new(),
            plane,
            store,
            dir,
            id: String::new(),
            acknowledged: Vec::new(),
            victim_frozen_at: None,
        };
        case.runner("a");
        let body = match row.during {
            // Saved every second while it runs.
            Save => json!({"storage_class": "durable", "save_interval_s": SAVE_INTERVAL_S}),
            // Saved only by its stops (the default interval is minutes).
            Securing => json!({"storage_class": "durable"}),
        };
        case.id = create_running(case.api(), body).await;
        case.runner("b");
        if row.during == Save {
            case.start_stamper().await;
        }
        case.mark().await;
        case
    }

    /// Starts a runner with its own data dir and cgroup parent (a sandbox
    /// recovered on one must not meet the frozen copy's cgroup on the
    /// other).
    fn runner(&mut self, name: &str) {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        let cgroup = format!(
            "roost-matrix-{}-{}-{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let runner = RunnerProcess::start_in(
            &self.plane.server.url,
            &self.plane.runner_token,
            &self.dir.path().join(name),
            &[],
            None,
            &["--name", name, "--cgroup-parent", &cgroup],
        );
        self.cgroups.push(cgroup);
        self.runners.push(runner);
    }

    fn api(&self) -> &Api {
        &self.plane.org
    }

    fn victim_id(&self) -> String {
        self.runners[self.victim].runner_id.clone()
    }

    fn other_id(&self) -> String {
        self.runners[self.other].runner_id.clone()
    }

    async fn get(&self) -> Value {
        self.api()
            .get(&format!("/v1/sandboxes/{}", self.id))
            .await
            .body
    }

    async fn events(&self) -> Vec<Value> {
        let events = self
            .api()
            .get(&format!("/v1/sandboxes/{}/events", self.id))
            .await;
        assert_eq!(events.status, 200, "{events:?}");
        events.body["events"].as_array().expect("events").clone()
    }

    async fn request(&self, what: &str) {
        let answer = self
            .api()
            .post(&format!("/v1/sandboxes/{}/{what}", self.id), json!({}))
            .await;
        assert_eq!(answer.status, 202, "{what}: {answer:?}");
    }

    /// Waits until the sandbox runs on runner `index` at an epoch past
    /// `epoch`, or at it (`moved`: false).
    async fn wait_running_on(&self, index: usize, epoch: u64, moved: bool) -> Value {
        let runner = self.runners[index].runner_id.clone();
        let ok = eventually(PATIENCE, || async {
            let record = self.get().await;
            let at = record["epoch"].as_u64().unwrap_or(0);
            record["state"] == "running"
                && record["runner_id"] == runner.as_str()
                && if moved { at > epoch } else { at == epoch }
        })
        .await;
        let record = self.get().await;
        assert!(ok, "not running on {runner} (from epoch {epoch}): {record}");
        record
    }

    /// The record's kept copies (absent when there are none).
    fn kept_copies(record: &Value) -> Vec<Value> {
        record["kept_copies"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Appends a new marker to the home; acknowledged once the command
    /// that wrote it exited.
    async fn mark(&mut self) {
        let marker = format!("m{}", self.acknowledged.len());
        sh(
            self.api(),
            &self.id,
            &format!("echo {marker} >> /workspace/markers && sync /workspace/markers"),
        )
        .await;
        self.acknowledged.push(marker);
    }

    /// The markers in the sandbox's home, wherever it runs.
    async fn home_markers(&self) -> Vec<String> {
        let text = sh(self.api(), &self.id, "cat /workspace/markers || true").await;
        text.lines().map(str::to_owned).collect()
    }

    /// The markers in a saved tree, read from the store itself (`None`: no
    /// save, no markers).
    fn saved_markers(&self, root: Option<&str>) -> Vec<String> {
        let Some(root) = root else {
            return Vec::new();
        };
        let dest = crate::durable::materialize_saved(self.store.path(), &self.plane.org_id, root);
        read_markers(&dest.path().join("markers"))
    }

    /// A workload writing the time to `stamps.EPOCH` five times a second
    /// (a file per placement, so that each one's writes stay apart).
    async fn start_stamper(&self) {
        let epoch = self.get().await["epoch"].as_u64().expect("epoch");
        start_stamper(self.api(), &self.id, &format!("stamps.{epoch}")).await;
    }

    fn victim_dir(&self) -> &Path {
        &self.runners[self.victim].data_dir
    }

    /// The victim's copy of a file of the home (its own, not kept aside).
    fn victim_home_file(&self, name: &str) -> PathBuf {
        self.victim_dir()
            .join("volumes/homes")
            .join(&self.id)
            .join(name)
    }

    /// The victim's kept copies of the sandbox's home set aside since
    /// `since` (ms; a copy is named `kMS` after when).
    fn victim_kept_copies(&self, since: i64) -> Vec<PathBuf> {
        let dir = self.victim_dir().join("volumes/kept").join(&self.id);
        let mut copies: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|entries| entries.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        copies.retain(|copy| {
            copy.file_name()
                .and_then(|name| name.to_str()?.strip_prefix('k')?.parse::<i64>().ok())
                .is_some_and(|ms| ms >= since)
        });
        copies.sort();
        copies
    }

    /// Reads when the victim's init froze the workload its dead runner
    /// left (save rows), before a return clears its log.
    fn record_freeze(&mut self) {
        if self.row.during != Save {
            return;
        }
        let path = self
            .victim_dir()
            .join("sandboxes")
            .join(&self.id)
            .join("bundle/init.log");
        let log = std::fs::read_to_string(path).unwrap_or_default();
        let frozen = frozen_at(&log).unwrap_or_else(|| panic!("the init never froze: {log}"));
        self.victim_frozen_at = Some(frozen);
    }

    /// Kills the victim at the row's point: restarted with the point armed
    /// (a save reaches it within an interval; a stop is asked for to reach
    /// securing), waited for until it died there.
    async fn kill_at_the_point(&mut self) -> Fault {
        let markers = self.home_markers().await;
        // The old process dies first: nothing it saves can land after the
        // arming time, so a save captured later is the armed runner's.
        self.runners[self.victim].kill9();
        let armed_at_ms = now_ms();
        let before = self.get().await;
        self.runners[self.victim].restart(&[("ROOST_FAILPOINT", self.row.failpoint)]);
        if self.row.during == Securing {
            self.request("stop").await;
        }
        let victim = self.victim;
        let reached = eventually(PATIENCE, || {
            let exited = self.runners[victim].exited();
            async move { exited }
        })
        .await;
        assert!(
            reached,
            "the victim never reached {}: {}",
            self.row.failpoint,
            self.get().await
        );
        let after = self.get().await;
        let committed = after["save"]["last_completed_at"]
            .as_str()
            .is_some_and(|at| parse_ms(at) > armed_at_ms);
        assert_eq!(
            committed,
            self.row.commits,
            "at {}, the save was {}committed: before {before}, after {after}",
            self.row.failpoint,
            if committed { "" } else { "not " }
        );
        if !committed {
            assert_eq!(
                after["save"]["root"], before["save"]["root"],
                "the record moved without a commit"
            );
        }
        Fault {
            armed_at_ms,
            markers,
            before,
            after,
            committed,
        }
    }

    /// Column 1: the victim comes back at once on its data dir and carries
    /// on with its own copy of the home.
    async fn back_before_lease(&mut self, fault: &Fault) {
        let returned_at = now_ms();
        self.runners[self.victim].restart(&[]);
        match self.row.during {
            Save => {
                // It saves again: a save captured after its return.
                let saved = eventually(PATIENCE, || async {
                    self.get().await["save"]["last_completed_at"]
                        .as_str()
                        .is_some_and(|at| parse_ms(at) > returned_at)
                })
                .await;
                assert!(saved, "no save after the return: {}", self.get().await);
                self.check_no_save_left_behind(returned_at);
            }
            Securing => {
                // It finishes securing; a start brings it back there, on
                // the copy it secured.
                let stopped = wait_sandbox(self.api(), &self.id, "stopped").await;
                assert_eq!(stopped["state"], "stopped", "{stopped}");
                self.request("start").await;
            }
        }
        let placements = u64::from(self.row.during == Securing);
        self.wait_running_on(self.victim, fault.epoch() + placements, false)
            .await;
        self.check_converged().await;
        // Its own copy: every write acknowledged on it, saved or not.
        let home = self.home_markers().await;
        for marker in &fault.markers {
            assert!(home.contains(marker), "{marker} lost: {home:?}");
        }
        self.check_writes(self.get().await["save"]["root"].as_str())
            .await;
        let fate = Fate::BackBefore(returned_at);
        self.check_one_writer(fault, fate).await;
        self.check_copies(fault, fate).await;
        self.mark().await;
    }

    /// Column 2: the victim is left dead; once its lease expired the
    /// sandbox runs on the other runner from the last completed save.
    async fn never_back(&mut self, fault: &Fault) {
        self.wait_lost(fault).await;
        self.record_freeze();
        if self.row.during == Securing {
            self.request("start").await;
        }
        self.wait_running_on(self.other, fault.epoch(), true).await;
        self.check_converged().await;
        self.check_writes(fault.saved_root()).await;
        self.check_newest_write(fault).await;
        self.check_one_writer(fault, Fate::Away).await;
        self.check_copies(fault, Fate::Away).await;
        if self.row.during == Save {
            self.start_stamper().await;
        }
    }

    /// Column 3: the victim of column 2 comes back on its data dir long
    /// after its lease expired; the sandbox runs on elsewhere, undisturbed.
    async fn back_after_lease_moved(&mut self, fault: &Fault) {
        let placed = self.get().await;
        let returned_at = now_ms();
        self.runners[self.victim].restart(&[]);
        let victim = self.victim_id();
        let unsaved = self.unsaved(fault);
        let settled = eventually(PATIENCE, || async {
            let record = self.get().await;
            let listed = Self::kept_copies(&record)
                .iter()
                .any(|c| c["runner_id"] == victim.as_str());
            // A copy of exactly the save the sandbox runs from may go.
            let kept_as_due = if unsaved {
                listed
            } else {
                self.victim_kept_copies(returned_at).is_empty()
            };
            self.runners[self.victim]
                .container_status(&self.id)
                .is_none()
                && !self.victim_home_file("").exists()
                && kept_as_due
        })
        .await;
        let record = self.check_converged().await;
        assert!(
            settled,
            "the returning victim did not remove its container and set its copy aside as due (unsaved writes: {unsaved}): {record}"
        );
        assert_eq!(record["state"], "running", "{record}");
        assert_eq!(record["runner_id"], placed["runner_id"], "{record}");
        assert_eq!(record["epoch"], placed["epoch"], "{record}");
        self.check_writes(fault.saved_root()).await;
        let fate = Fate::BackAfter(returned_at);
        self.check_one_writer(fault, fate).await;
        self.check_copies(fault, fate).await;
    }

    /// Between columns 3 and 4: the runner the sandbox runs on becomes the
    /// victim, the other is drained (it takes no placement), and a new
    /// marker is written.
    async fn hand_over(&mut self) {
        std::mem::swap(&mut self.victim, &mut self.other);
        let record = self.get().await;
        assert_eq!(record["runner_id"], self.victim_id().as_str(), "{record}");
        let drained = self
            .plane
            .admin
            .post(
                &format!("/v1/admin/runners/{}/drain", self.other_id()),
                json!({}),
            )
            .await;
        assert_eq!(drained.status, 200, "{drained:?}");
        self.victim_frozen_at = None;
        self.mark().await;
    }

    /// Column 4: no other runner takes the sandbox; the victim comes back
    /// long after its lease expired and the sandbox is placed on it again,
    /// where its old placement's container and home still are.
    async fn back_after_lease_placed_back(&mut self, fault: &Fault) {
        self.wait_lost(fault).await;
        self.record_freeze();
        if self.row.during == Securing {
            // Waits: nothing can take it until the victim is back.
            self.request("start").await;
        }
        let returned_at = now_ms();
        self.runners[self.victim].restart(&[]);
        self.wait_running_on(self.victim, fault.epoch(), true).await;
        let victim = self.victim_id();
        if self.unsaved(fault) {
            let listed = eventually(PATIENCE, || async {
                Self::kept_copies(&self.get().await)
                    .iter()
                    .any(|c| c["runner_id"] == victim.as_str())
            })
            .await;
            assert!(listed, "no copy kept: {}", self.get().await);
        }
        self.check_converged().await;
        self.check_writes(fault.saved_root()).await;
        self.check_newest_write(fault).await;
        let fate = Fate::BackAfter(returned_at);
        self.check_one_writer(fault, fate).await;
        self.check_copies(fault, fate).await;
    }

    /// Waits for the lease watcher's verdict on the dead victim: a running
    /// sandbox or an unsecured stop is `recovering`; a stop whose securing
    /// committed is `stopped` (never `stopped` with a save that did not
    /// happen, never `recovering` as if it had not). Checks what the
    /// record says of its save.
    async fn wait_lost(&self, fault: &Fault) {
        let verdict = if self.row.during == Securing && fault.committed {
            "stopped"
        } else {
            "recovering"
        };
        let other = self.other_id();
        let lost = eventually(PATIENCE, || async {
            let record = self.get().await;
            let moved_on = record["epoch"].as_u64() > Some(fault.epoch())
                && record["runner_id"] == other.as_str();
            // A running sandbox's record may say why it waits since.
            let said = record["state_reason"] == "node_lost" || self.row.during == Save;
            (record["state"] == verdict && said) || moved_on
        })
        .await;
        assert!(lost, "no {verdict} verdict: {}", self.get().await);
        if self.row.during == Save {
            // Recovered already, or about to be.
            return;
        }
        let record = self.check_converged().await;
        assert_eq!(record["desired"], "stopped", "{record}");
        assert_eq!(record["runner_id"], Value::Null, "{record}");
        let save = &record["save"];
        assert_eq!(save["root"].as_str(), fault.saved_root(), "{record}");
        if fault.committed {
            assert_eq!(save["state"], "ok", "{record}");
            assert_eq!(save["last_error"], Value::Null, "{record}");
            return;
        }
        assert_eq!(save["state"], "failing", "{record}");
        assert!(
            save["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("securing did not complete")),
            "{record}"
        );
        // It says what a start restores: the last completed save.
        let recovery = &record["recovery"];
        assert_eq!(recovery["root"], save["root"], "{record}");
        let restores = if save["root"].is_string() {
            "last_save"
        } else {
            "empty"
        };
        assert_eq!(recovery["restores"], restores, "{record}");
    }

    /// Whether the victim's copy held writes no completed save has: the
    /// workload's stamps (save rows), or all of it (a securing that did
    /// not commit).
    fn unsaved(&self, fault: &Fault) -> bool {
        self.row.during == Save || !fault.committed
    }

    /// The runner, back, cleared what the interrupted save left: no
    /// snapshot of a save begun before its return (`save-EPOCH-MS`) stays
    /// on it, holding the home's old data.
    fn check_no_save_left_behind(&self, returned_at: i64) {
        let dir = self.victim_dir().join("volumes/snapshots").join(&self.id);
        let left: Vec<String> = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect::<Vec<String>>()
            })
            .unwrap_or_default()
            .into_iter()
            .filter(|name| {
                name.rsplit('-')
                    .next()
                    .and_then(|ms| ms.parse::<i64>().ok())
                    .is_some_and(|ms| ms < returned_at)
            })
            .collect();
        assert!(
            left.is_empty(),
            "an interrupted save's snapshot stays: {left:?}"
        );
    }

    /// Invariant 3: the record is at rest (running on a runner, stopped,
    /// or recovering) with a reason, and so is every event of its history.
    async fn check_converged(&self) -> Value {
        let at_rest = |record: &Value| match record["state"].as_str() {
            Some("running") => record["runner_id"].is_string(),
            Some("stopped" | "recovering") => true,
            _ => false,
        };
        let converged = eventually(PATIENCE, || async { at_rest(&self.get().await) }).await;
        let record = self.get().await;
        assert!(converged, "the record never came to rest: {record}");
        assert!(
            record["state_reason"]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
            "no reason on the record: {record}"
        );
        for event in self.events().await {
            assert!(
                event["reason"].as_str().is_some_and(|r| !r.is_empty()),
                "an event without a reason: {event}"
            );
        }
        record
    }

    /// Invariant 1: every write the last completed save (`root`) held is
    /// in the home, wherever it runs.
    async fn check_writes(&self, root: Option<&str>) {
        let saved = self.saved_markers(root);
        let home = self.home_markers().await;
        for marker in &saved {
            assert!(
                home.contains(marker),
                "{marker}, held by the save {root:?}, is missing from the home: {home:?}"
            );
        }
    }

    /// A securing row, restored from the store: the newest write (made
    /// after the last stop, nothing running since) is back exactly when
    /// the securing committed.
    async fn check_newest_write(&self, fault: &Fault) {
        if self.row.during != Securing {
            return;
        }
        let newest = fault.markers.last().expect("a marker");
        assert_eq!(
            self.home_markers().await.contains(newest),
            fault.committed,
            "{newest} after a securing {}committed",
            if fault.committed { "" } else { "not " }
        );
    }

    /// Invariant 2: one writer. Back before its lease, the same placement
    /// runs on, on the victim (its workload writes after the return).
    /// Otherwise the lease watcher moved the sandbox on: the workload its
    /// dead runner left wrote nothing after its init froze it, and that was
    /// before the move; nothing of that placement runs on the victim but,
    /// placed back on it, the new placement (whose home holds nothing
    /// written after the freeze either: it was restored, not adopted).
    async fn check_one_writer(&self, fault: &Fault, fate: Fate) {
        let epoch = fault.epoch();
        let events = self.events().await;
        // The lease watcher's verdict on the victim, if any came.
        let moved_at = events
            .iter()
            .map(|e| (e, parse_ms(e["at"].as_str().expect("at"))))
            .find(|(e, at)| e["reason"] == "node_lost" && *at >= fault.armed_at_ms)
            .map(|(_, at)| at);
        let record = self.get().await;
        if let Fate::BackBefore(returned_at) = fate {
            assert_eq!(moved_at, None, "recovered while the runner was back");
            if self.row.during == Save {
                assert_eq!(record["epoch"].as_u64(), Some(epoch), "{record}");
                let stamps_file = self.victim_home_file(&format!("stamps.{epoch}"));
                let writes = eventually(PATIENCE, || async {
                    stamps(&stamps_file).iter().any(|s| *s > returned_at)
                })
                .await;
                assert!(writes, "the workload does not write after the return");
            }
            return;
        }
        let moved_at = moved_at.unwrap_or_else(|| panic!("never recovered: {events:#?}"));
        // Left by a dead runner, the old container stays, frozen; a runner
        // back removes it unless it runs the new placement.
        let runs_on_victim = record["runner_id"] == self.victim_id().as_str();
        if matches!(fate, Fate::BackAfter(_)) && !runs_on_victim {
            assert_eq!(
                self.runners[self.victim].container_status(&self.id),
                None,
                "a container of the old placement is left on the victim"
            );
        }
        if self.row.during == Securing {
            return;
        }
        // The old placement's stamps: in the victim's home (placed back:
        // the restored one), or in the copies it kept aside.
        let name = format!("stamps.{epoch}");
        let old = std::iter::once(self.victim_home_file(&name))
            .chain(
                self.victim_kept_copies(fault.armed_at_ms)
                    .into_iter()
                    .map(|c| c.join(&name)),
            )
            .flat_map(|path| stamps(&path))
            .max()
            .expect("the old placement wrote");
        let frozen = self.victim_frozen_at.expect("the freeze point");
        assert!(
            old > fault.armed_at_ms,
            "the workload stopped before the runner died"
        );
        assert!(
            old <= frozen,
            "the old placement wrote at {old}, after its freeze at {frozen}"
        );
        assert!(
            frozen < moved_at,
            "frozen at {frozen}, after the sandbox moved at {moved_at}"
        );
    }

    /// Invariant 4: no copy of the home that may be the newest is deleted,
    /// none kept needlessly. Back before its lease, the victim keeps
    /// nothing aside (it carries on with its copy). Back after it, it keeps
    /// its copy when that holds writes no completed save has, with every
    /// write acknowledged on it, read-only, and the record lists it; a copy
    /// of exactly the save the sandbox runs from goes.
    async fn check_copies(&self, fault: &Fault, fate: Fate) {
        let record = self.get().await;
        let listed = Self::kept_copies(&record);
        let returned_at = match fate {
            Fate::BackBefore(_) => {
                assert!(listed.is_empty(), "a copy kept needlessly: {record}");
                assert!(self.victim_kept_copies(0).is_empty());
                return;
            }
            Fate::Away => return,
            Fate::BackAfter(at) => at,
        };
        let victim = self.victim_id();
        let mine: Vec<&Value> = listed
            .iter()
            .filter(|c| {
                c["runner_id"] == victim.as_str()
                    && c["kept_at"]
                        .as_str()
                        .is_some_and(|at| parse_ms(at) >= returned_at)
            })
            .collect();
        if !self.unsaved(fault) {
            // Kept (`awaiting_new_placement`) at most until the sandbox
            // runs from the store, which it does.
            let gone = eventually(PATIENCE, || async {
                let listed = Self::kept_copies(&self.get().await);
                self.victim_kept_copies(returned_at).is_empty()
                    && !listed.iter().any(|c| c["runner_id"] == victim.as_str())
            })
            .await;
            assert!(
                gone,
                "a copy kept needlessly: {}: {:?}",
                self.get().await,
                self.victim_kept_copies(returned_at)
            );
            return;
        }
        assert_eq!(mine.len(), 1, "{record}");
        assert_eq!(mine[0]["reason"], "unsaved_writes", "{record}");
        let copies = self.victim_kept_copies(returned_at);
        assert_eq!(copies.len(), 1, "{copies:?}");
        let kept = read_markers(&copies[0].join("markers"));
        for marker in &fault.markers {
            assert!(kept.contains(marker), "{marker} is not kept: {kept:?}");
        }
        assert!(
            std::fs::write(copies[0].join("markers"), "overwritten\n").is_err(),
            "the kept copy is read-only"
        );
    }
}

/// The lines of a markers file (none if it is missing).
fn read_markers(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}
