//! The control layer: the control plane's rules as functions of a write
//! transaction (or the shared state) and typed inputs, answering
//! `ControlError`. The HTTP layer parses, authenticates, calls and
//! renders; the reconciler calls these and never `http`. Rows and every
//! write to a sandbox's or command's observed fields are `records`'.
//!
//! - [`admission`]: a create request checked, refused or counted, placed.
//! - [`sandboxes`]: stop, start, delete.
//! - [`placement`]: placing a sandbox, or recording why it waits.
//! - [`runner_protocol`]: registration, leases, assignments, reports, output.
//! - [`renewals`]: lease renewals (heartbeats) committed in groups.
//! - [`saves`]: a durable home's save, committed only when complete.
//! - [`snapshots`]: receipts, their durability and deadlines.
//! - [`commands`]: queueing, cancelling and signalling commands.
//! - [`drain`]: emptying a runner (maintenance, preemption).
//! - [`images`]: committing and forgetting an org's images.
//! - [`orgs`]: tenants and their tokens.
//! - [`filesystems`]: shared filesystems bound to orgs.
//! - [`blocks`]: the block service (an org's objects, checked on upload).
//! - [`home_store`]: the content store as the control plane uses it.
//! - [`kept`]: homes runners set aside (kept copies): keep, discard, expire.
//! - [`deployment`]: what the deployment promises, derives and observed.
//! - [`secrets`]: org secrets sealed under the deployment's key, and their
//!   delivery to the runner of a sandbox's placement.

pub mod admission;
pub mod blocks;
pub mod commands;
pub mod data_path;
pub mod deployment;
pub mod drain;
pub mod filesystems;
pub mod home_store;
pub mod idle;
pub mod images;
pub mod kept;
pub mod org_share;
pub mod orgs;
pub mod placement;
pub mod renewals;
pub mod runner_protocol;
pub mod sandboxes;
pub mod saves;
pub mod secrets;
pub mod snapshots;

use std::sync::Arc;

use crate::db::Db;
pub use crate::error::ControlError;
use crate::metrics::Metrics;

/// What every request and task of the server shares. One `Arc`: axum
/// clones the state for each extractor and layer of every request, and a
/// clone of the parts themselves (a dozen reference counts) was a visible
/// share of a GET's time.
#[derive(Clone)]
pub struct AppState(Arc<AppStateParts>);

impl AppState {
    pub fn new(parts: AppStateParts) -> AppState {
        AppState(Arc::new(parts))
    }
}

impl std::ops::Deref for AppState {
    type Target = AppStateParts;

    fn deref(&self) -> &AppStateParts {
        &self.0
    }
}

pub struct AppStateParts {
    pub db: Db,
    /// The content store (`--store`): images, and the block service.
    pub store: Option<Arc<store::Store>>,
    pub config: Arc<crate::Config>,
    pub metrics: Arc<Metrics>,
    /// The key org secrets are sealed with (`Config::secret_key`); `None`:
    /// secrets are refused.
    pub secret_key: Option<Arc<secrets::SecretKey>>,
    /// Heartbeats' lease renewals, committed in groups.
    pub renewals: Arc<renewals::LeaseRenewals>,
    /// Runners' assignment reads under way at once: bounded, so that a
    /// fleet's reads (thousands at once when every runner starts) never
    /// hold every database connection while heartbeats wait for one.
    pub assignment_reads: tokio::sync::Semaphore,
    /// One assignments read at a time per runner: a runner's polls at once
    /// wait on each other, never on [`Self::assignment_reads`] ahead of
    /// other runners' (a runner sending hundreds would otherwise take
    /// every turn).
    pub runner_reads: RunnerTurns,
    /// One record's store pointer moves at a time: a sandbox's save
    /// commits (`saves`), an image's commits and deletes (`images`), a
    /// snapshot's replication (`snapshots`).
    pub pointer_turns: home_store::PointerTurns,
    /// Signs the envd access tokens of E2B's sandboxes (`auth::envd_token`).
    pub envd_key: [u8; 32],
    /// Each org's requests under way on this server, bounded
    /// (`http::org_share`).
    pub org_requests: Arc<org_share::OrgRequests>,
    /// The connections this server serves at once: a connection holds a
    /// permit from before its `accept` to its end, and an attached
    /// terminal (whose connection hyper hands over at the upgrade) holds
    /// one for its life (`Config::connections_max`).
    pub connections: Arc<tokio::sync::Semaphore>,
}

/// A turn per runner id, made when first asked for and gone when no one
/// holds or waits for it.
#[derive(Default)]
pub struct RunnerTurns(
    std::sync::Mutex<std::collections::HashMap<String, std::sync::Weak<tokio::sync::Mutex<()>>>>,
);

impl RunnerTurns {
    /// Waits for `runner_id`'s turn.
    pub async fn take(&self, runner_id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let turn = {
            let mut turns = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(turn) = turns.get(runner_id).and_then(std::sync::Weak::upgrade) {
                turn
            } else {
                // Those nobody holds any more go as a new one is made.
                turns.retain(|_, turn| turn.strong_count() > 0);
                let turn = Arc::new(tokio::sync::Mutex::new(()));
                turns.insert(runner_id.to_owned(), Arc::downgrade(&turn));
                turn
            }
        };
        turn.lock_owned().await
    }
}

/// Permits of [`AppStateParts::assignment_reads`]: half a PostgreSQL
/// pool's connections.
pub const ASSIGNMENT_READS_AT_ONCE: usize = 8;

impl AppState {
    /// Records that ended before this instant are past the retention
    /// window: reads answer 404 for them.
    pub fn retained_since_ms(&self) -> i64 {
        crate::db::now_ms() - self.config.retention.as_millis() as i64
    }
}

#[cfg(test)]
mod runner_turn_tests {
    use super::*;
    use std::time::Duration;

    /// Audit finding: a runner sending hundreds of assignments polls at
    /// once took every one of the server's read turns, ahead of every
    /// other runner. A runner's reads now take turns among themselves:
    /// while one holds its turn, its next waits and another runner's does
    /// not; a turn nobody holds is forgotten.
    #[tokio::test]
    async fn a_runners_reads_take_turns_and_other_runners_do_not_wait() {
        let turns = RunnerTurns::default();
        let first = turns.take("rnr_a").await;
        let waiting = tokio::time::timeout(Duration::from_millis(50), turns.take("rnr_a")).await;
        assert!(waiting.is_err(), "a second read of rnr_a waits");
        let _other = tokio::time::timeout(Duration::from_secs(60), turns.take("rnr_b"))
            .await
            .expect("rnr_b does not wait for rnr_a");
        drop(first);
        let _again = tokio::time::timeout(Duration::from_secs(60), turns.take("rnr_a"))
            .await
            .expect("rnr_a's turn once given back");
        drop(_again);
        drop(_other);
        let _c = turns.take("rnr_c").await;
        let held = turns
            .0
            .lock()
            .expect("turns")
            .values()
            .filter(|turn| turn.strong_count() > 0)
            .count();
        assert_eq!(held, 1, "only rnr_c's turn is held");
        assert!(turns.0.lock().expect("turns").len() <= 3);
    }
}
