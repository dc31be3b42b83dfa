//! Placement: which runner a sandbox goes to. Filters runners by live
//! lease, capabilities, placement class and free capacity; prefers the
//! runner the sandbox last ran on (its home and blocks are there), then
//! spot before on-demand for `spot_first`, then the emptiest runner.

use std::collections::BTreeMap;
use std::sync::Arc;
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

/// The runners and their usage as this server last read them.
#[derive(Default)]
pub struct RunnerView {
    inner: std::sync::Mutex<Option<View>>,
}

#[derive(Clone)]
pub struct View {
    at: std::time::Instant,
    pub runners: Arc<Vec<RunnerRow>>,
    pub usage: Arc<BTreeMap<String, Usage>>,
}

impl RunnerView {
    /// The view, read again if older than `max_age` ([`RUNNER_VIEW_TTL`],
    /// [`RUNNER_VIEW_FRESH`], or zero: read now).
    pub async fn read(tx: &mut WriteTx, max_age: Duration) -> Result<View, sqlx::Error> {
        let cache = tx.runner_view.clone();
        let cached = cache
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(view) = cached.filter(|v| v.at.elapsed() < max_age) {
            return Ok(view);
        }
        let view = View {
            at: std::time::Instant::now(),
            runners: Arc::new(all_runners(tx).await?),
            usage: Arc::new(all_runner_usage(tx).await?),
        };
        *cache.inner.lock().unwrap_or_else(|p| p.into_inner()) = Some(view.clone());
        Ok(view)
    }

    /// Forgets the view: the next placement reads the runners again.
    pub fn clear(&self) {
        *self.inner.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// What this server now knows a runner uses (after placing on it, or
    /// reading its usage under its lock).
    fn note(&self, runner_id: &str, usage: Usage) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(view) = inner.as_mut() {
            Arc::make_mut(&mut view.usage).insert(runner_id.to_owned(), usage);
        }
    }
}

/// Places `sandbox` (in `pending` or `recovering`, no runner) if a runner
/// fits, moving it to `starting` with a bumped epoch. The runner's row is
/// locked (an UPDATE) before its kept usage (`records::counts`) is read,
/// so servers placing at once never overfill it.
pub async fn place(tx: &mut WriteTx, sandbox: &SandboxRow) -> Result<Placed, sqlx::Error> {
    // From the view first; what it says cannot be done, checked fresh.
    // A home declared lost is read now: it fails the sandbox.
    match place_from(tx, sandbox, RUNNER_VIEW_TTL).await? {
        Placed::HomeLost => place_from(tx, sandbox, Duration::ZERO).await,
        Placed::Waiting(_) => place_from(tx, sandbox, RUNNER_VIEW_FRESH).await,
        placed => Ok(placed),
    }
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
        match runners.iter().find(|r| r.id == home) {
            Some(r) if r.state == "live" => {}
            _ => return Ok(Placed::HomeLost),
        }
    }
    // A first filter on the view's usage skips full runners without a
    // round trip each; the one chosen is checked again under its lock.
    let usage = &view.usage;
    let mut candidates: Vec<&RunnerRow> = runners
        .iter()
        .filter(|r| r.is_live(now) && r.drain.is_none() && needs.missing_on(r).is_empty())
        .filter(|r| {
            let used = usage.get(&r.id).copied().unwrap_or_default();
            needs.fits(r, &used)
        })
        .filter(|r| home_runner.is_none_or(|home| r.id == home))
        .collect();
    let last = sandbox.last_runner_id.as_deref();
    candidates.sort_by_key(|r| {
        (
            Some(r.id.as_str()) != last,
            r.placement_class != "spot",
            std::cmp::Reverse(r.capacity_sandboxes),
        )
    });
    for runner in candidates {
        tx.take_turn(&format!("runner:{}", runner.id)).await;
        let locked = sqlx::query(
            "UPDATE runners SET placements = placements + 1 WHERE id = $1 AND state = 'live' AND drain IS NULL AND lease_expires_at_ms > $2",
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
