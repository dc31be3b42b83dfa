//! Reconcilers: the lease watcher, the scheduler for waiting sandboxes,
//! TTL expiry, idle sleep and retention. Every server runs them; each step is a
//! conditional update inside a transaction, so servers running the same
//! step at once do it once (the loser's update matches no row).

use crate::control::AppState;
use crate::db::now_ms;
use crate::error::ControlError;
use crate::records::{
    SANDBOX_COLUMNS, SandboxRow, Transition, load_sandbox, set_sandbox_state, terminal_states_sql,
};
use api::lifecycle::{DesiredState, SandboxState, StorageClass};

/// Idempotency keys outlive what they created by at least this long.
const IDEMPOTENCY_KEEP_MS: i64 = 24 * 3600 * 1000;
const BATCH: i64 = 100;

pub async fn run(state: AppState) {
    let mut tick = tokio::time::interval(state.config.reconcile_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A server that just started (after an outage, perhaps) gives every
    // runner a full lease to reach it before it counts any as lost: the
    // control plane being down is not the fleet failing (DESIGN.md §7).
    let leases_watched_from =
        tokio::time::Instant::now() + state.config.lease_ttl + state.config.fence_margin;
    loop {
        tick.tick().await;
        let watch_leases = tokio::time::Instant::now() >= leases_watched_from;
        if let Err(err) = pass(&state, watch_leases).await {
            tracing::warn!(?err, "reconcile pass failed; retrying next tick");
        }
    }
}

pub async fn pass(state: &AppState, watch_leases: bool) -> Result<(), ControlError> {
    if watch_leases {
        let started = std::time::Instant::now();
        expire_leases(state).await?;
        state.metrics.lease_watched(started.elapsed());
    }
    expire_ttls(state).await?;
    crate::control::idle::sleep_due(state, now_ms()).await?;
    schedule_pending(state).await?;
    apply_retention(state).await?;
    crate::control::snapshots::expire(state).await?;
    crate::control::kept::expire(state).await?;
    release_deleted_homes(state).await?;
    Ok(())
}

/// Unpins the store homes of deleted sandboxes (their saves become
/// collectable by gc), then forgets the root. Done here, after the fact,
/// so every path to `deleted` is covered and a failed store call is
/// simply tried again on the next pass.
pub async fn release_deleted_homes(state: &AppState) -> Result<(), ControlError> {
    let Some(store) = state.store.clone() else {
        return Ok(());
    };
    let rows: Vec<(String, String)> = sqlx::query_as(&homes_to_release_sql())
        .bind(BATCH)
        .fetch_all(&state.db.pool)
        .await?;
    for (id, org_id) in rows {
        let (committed, next) = crate::control::home_store::home_names(&id)?;
        let org = crate::control::home_store::store_org(&org_id)?;
        let store = store.clone();
        let released = crate::control::home_store::blocking(move || {
            store.delete_home(&org, &next)?;
            store.delete_home(&org, &committed)
        })
        .await?;
        if let Err(err) = released {
            tracing::warn!(sandbox_id = %id, %err, "could not release a deleted sandbox's home; retrying next pass");
            continue;
        }
        let mut tx = state.db.write().await?;
        crate::records::sandboxes::forget_home(&mut tx, &id).await?;
        tx.commit().await?;
    }
    Ok(())
}

/// Deleted sandboxes whose store home is still pinned (`$1`: batch).
fn homes_to_release_sql() -> String {
    "SELECT id, org_id FROM sandboxes WHERE state = 'deleted' AND home_root IS NOT NULL LIMIT $1"
        .to_owned()
}

/// Sandboxes waiting for a runner (`$1`: batch).
fn waiting_sql() -> String {
    format!(
        "SELECT id FROM sandboxes WHERE state IN {} AND desired = 'running' ORDER BY id LIMIT $1",
        SandboxState::sql_in(SandboxState::awaits_placement)
    )
}

/// Sandboxes whose TTL is due (`$1`: now, `$2`: batch); the terms match
/// the partial index `sandboxes_ttl_due`'s, so only due ones are read. A
/// quarantined one waits for its release (a quarantine freezes it).
fn ttl_due_sql() -> String {
    format!(
        "SELECT id FROM sandboxes WHERE expires_at_ms <= $1 AND desired NOT IN ('terminated', 'deleted') AND state NOT IN {} AND quarantined = 0 LIMIT $2",
        terminal_states_sql()
    )
}

/// Ended sandboxes past retention, not yet deleted (`$1`: cutoff, `$2`:
/// batch), but for quarantined ones; index `sandboxes_retention_due`.
fn retention_due_sql() -> String {
    format!(
        "SELECT id FROM sandboxes WHERE ended_at_ms < $1 AND state IN {} AND desired <> 'deleted' AND quarantined = 0 LIMIT $2",
        SandboxState::sql_in(|s| s.is_terminal() && s != SandboxState::Deleted)
    )
}

/// Every pass's read of what is due, by name, with the index that bounds
/// it to what is due: what the tests check the plans against.
pub fn due_queries() -> Vec<(&'static str, String, &'static str)> {
    vec![
        (
            "lease watcher",
            crate::records::runners::SILENT_SQL.to_owned(),
            "runner_leases_by_end",
        ),
        ("ttl", ttl_due_sql(), "sandboxes_ttl_due"),
        ("retention", retention_due_sql(), "sandboxes_retention_due"),
        ("scheduling", waiting_sql(), "sandboxes_by_state_desired"),
        (
            "deleted homes",
            homes_to_release_sql(),
            "sandboxes_homes_to_release",
        ),
    ]
}

/// Whether `silent` of `live` runners going quiet at once looks
/// like the control plane being cut off rather than hosts dying: at least
/// two, and at least `threshold` of the fleet.
pub fn mass_loss(live: usize, silent: usize, threshold: f64) -> bool {
    silent >= 2 && silent as f64 >= threshold * live as f64
}

/// Ends a mass-loss hold, if there is one (most passes: no write).
async fn end_mass_loss_hold(state: &AppState) -> Result<(), ControlError> {
    let hold: Option<(i64,)> = sqlx::query_as("SELECT since_ms FROM lease_hold WHERE id = 'fleet'")
        .fetch_optional(&state.db.pool)
        .await?;
    if hold.is_some() {
        let mut tx = state.db.write().await?;
        sqlx::query("DELETE FROM lease_hold WHERE id = 'fleet'")
            .execute(&mut *tx.tx)
            .await?;
        tx.commit().await?;
    }
    Ok(())
}

/// Holds recovery while a mass lease loss (`silent` of `live` runners
/// past their freeze point) is younger than the grace period, until no
/// lease is expired any more. The hold's
/// start is a row, so every server honours one hold. Returns whether this
/// pass must leave the expired runners alone.
async fn hold_for_mass_loss(
    state: &AppState,
    live: usize,
    silent: usize,
    now: i64,
) -> Result<bool, ControlError> {
    let grace_ms = state.config.mass_loss_grace.as_millis() as i64;
    if !mass_loss(live, silent, state.config.mass_loss_threshold) {
        // A hold under way lasts its grace while any lease is expired:
        // runners cut off together report back one by one, and the last
        // must not be recovered because the first came back.
        let hold: Option<(i64,)> =
            sqlx::query_as("SELECT since_ms FROM lease_hold WHERE id = 'fleet'")
                .fetch_optional(&state.db.pool)
                .await?;
        if let Some((since,)) = hold
            && now - since < grace_ms
        {
            state.metrics.lease_held();
            return Ok(true);
        }
        end_mass_loss_hold(state).await?;
        return Ok(false);
    }
    let mut tx = state.db.write().await?;
    sqlx::query(
        "INSERT INTO lease_hold (id, since_ms) VALUES ('fleet', $1) ON CONFLICT (id) DO NOTHING",
    )
    .bind(now)
    .execute(&mut *tx.tx)
    .await?;
    let (since,): (i64,) = sqlx::query_as("SELECT since_ms FROM lease_hold WHERE id = 'fleet'")
        .fetch_one(&mut *tx.tx)
        .await?;
    tx.commit().await?;
    let held = now - since < grace_ms;
    if held {
        state.metrics.lease_held();
        if since == now {
            tracing::warn!(
                silent,
                live,
                grace_s = state.config.mass_loss_grace.as_secs(),
                "a large share of the fleet lost its lease at once; holding recovery so runners can report in"
            );
        }
    }
    Ok(held)
}

/// Lease watcher: a runner whose lease expired more than the fence margin
/// ago is `lost` (by then it has frozen its sandboxes: runners freeze at
/// [`crate::freeze_after`]). Its durable sandboxes go `recovering` with
/// the epoch bumped (fencing the old host) and are placed elsewhere once
/// wanted running (see [`lost_runner_verdict`]), its standard ones
/// `failed`/`node_lost` (their home was on it); their
/// commands end as `records::set_sandbox_state` decides. When a large
/// share of the fleet expires at once, recovery waits (see
/// [`hold_for_mass_loss`]).
pub async fn expire_leases(state: &AppState) -> Result<(), ControlError> {
    let now = now_ms();
    let cutoff = now - state.config.fence_margin.as_millis() as i64;
    // The share counts every runner already past its freeze point (no
    // answered heartbeat for two thirds of a lease), not only those past
    // lease and margin: runners cut off together expire up to a heartbeat
    // interval apart, and the first must not be recovered alone.
    let lease_ms = state.config.lease_ttl.as_millis() as i64;
    let silent_before =
        now + lease_ms - crate::freeze_after(state.config.lease_ttl).as_millis() as i64;
    // Only runners past their freeze point are read (indexed by lease
    // expiry): a healthy fleet of any size costs this pass one empty range.
    let silent = crate::records::runners::silent(&state.db.pool, silent_before).await?;
    let expired: Vec<(String, i64)> = silent
        .iter()
        .filter(|(_, expires)| *expires < cutoff)
        .cloned()
        .collect();
    if expired.is_empty() {
        return end_mass_loss_hold(state).await;
    }
    let live = crate::records::runners::count_live(&state.db.pool).await?;
    let silent = silent.len();
    if hold_for_mass_loss(state, live, silent, now).await? {
        return Ok(());
    }
    for (runner_id, expired_at) in expired {
        let mut tx = state.db.write().await?;
        if !crate::records::runners::mark_lost(&mut tx, &runner_id, cutoff).await? {
            continue;
        }
        let rows = sqlx::query(&format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE runner_id = $1 AND state NOT IN {}",
            terminal_states_sql()
        ))
        .bind(&runner_id)
        .fetch_all(&mut *tx.tx)
        .await?;
        for row in rows {
            let sandbox = SandboxRow::from_row(&row)?;
            // A stop's securing whose commit landed before the runner was
            // lost: the home is in the store as the stop left it.
            let secured = sandbox.state == SandboxState::Securing
                && crate::records::sandboxes::securing_committed(
                    &mut tx,
                    &sandbox.id,
                    sandbox.epoch,
                )
                .await?;
            let to = lost_runner_verdict(&sandbox, secured);
            let epoch = if to == SandboxState::Recovering {
                sandbox.epoch + 1
            } else {
                sandbox.epoch
            };
            let expired = crate::records::rfc3339(expired_at);
            let mut message = if epoch > sandbox.epoch {
                format!("lease of runner {runner_id} expired at {expired}; epoch {epoch} fences it")
            } else {
                format!("lease of runner {runner_id} expired at {expired}")
            };
            if secured {
                let root = sandbox.home.root.as_deref().unwrap_or("none");
                message = format!(
                    "{message}; its stop's securing had committed the home to the store first (root {root}): nothing written in it is lost"
                );
            } else if to == SandboxState::Recovering {
                // Say what comes back, and that anything later is only on
                // the lost runner (kept aside there if it returns).
                let plan = sandbox.recovery();
                message = format!(
                    "{message}; {}; writes after it stay on runner {runner_id}, which keeps its copy aside if it comes back",
                    plan.message
                );
            }
            if sandbox.state == SandboxState::Securing && !secured {
                // The stop's save never committed: the save status must
                // not look as if the home were secured.
                let error = format!(
                    "securing did not complete: runner {runner_id} was lost before the home was committed to the store"
                );
                crate::records::sandboxes::record_lost_save(&mut tx, &sandbox.id, &error).await?;
            }
            if to == sandbox.state {
                // Only the placement goes away.
                crate::records::sandboxes::release_runner(&mut tx, &sandbox, &message).await?;
                continue;
            }
            let transition = Transition {
                state: to,
                reason: Some("node_lost"),
                message: Some(&message),
            };
            set_sandbox_state(&mut tx, &sandbox, transition, None, epoch).await?;
            // A command waiting for a wake that was to follow this stop.
            if !to.is_terminal() {
                crate::control::idle::resume_after_stop(state, &mut tx, &sandbox.id).await?;
            }
        }
        tx.changed(&format!("runner:{runner_id}"));
        tx.commit().await?;
        state.metrics.lease_expired();
        tracing::warn!(%runner_id, "runner lease expired; runner is lost");
    }
    Ok(())
}

/// What a sandbox on a lost runner becomes. A durable one whose home is
/// in the store and which nothing runs (`stopped`) stays so, and so does
/// one whose stop's securing had committed (`secured`: the home is in the
/// store as the stop left it) unless it is wanted running again; any
/// other durable one is `recovering`, with its epoch bumped, whatever is
/// wanted of it: its runner may have held writes no save has (running)
/// or been in the middle of saving them (`securing`), so the record must
/// not say `stopped` as if the home were secured. It is placed again once
/// wanted running, from the last completed save (or its snapshot, or
/// empty: the record's `recovery` says which). A standard one fails (its
/// home was on the node); one being deleted is deleted.
pub fn lost_runner_verdict(sandbox: &SandboxRow, secured: bool) -> SandboxState {
    match (sandbox.storage_class, sandbox.state) {
        (_, SandboxState::Deleting) => SandboxState::Deleted,
        (StorageClass::Durable, SandboxState::Stopped) => SandboxState::Stopped,
        (StorageClass::Durable, SandboxState::Securing)
            if secured && sandbox.desired != DesiredState::Running =>
        {
            SandboxState::Stopped
        }
        (StorageClass::Durable, _) => SandboxState::Recovering,
        (StorageClass::Standard, _) => SandboxState::Failed,
    }
}

/// Places sandboxes waiting for a runner.
pub async fn schedule_pending(state: &AppState) -> Result<(), ControlError> {
    let waiting: Vec<(String,)> = sqlx::query_as(&waiting_sql())
        .bind(BATCH)
        .fetch_all(&state.db.pool)
        .await?;
    for (id,) in waiting {
        let mut tx = state.db.write().await?;
        let Some(row) = load_sandbox(&mut tx, &id).await? else {
            continue;
        };
        if !row.state.awaits_placement() || row.desired != DesiredState::Running {
            continue;
        }
        crate::control::placement::place_or_wait(&mut tx, &row).await?;
        tx.commit().await?;
    }
    Ok(())
}

/// TTL: an expired sandbox is to be terminated. One without compute is
/// terminated at once; a running one when its runner reports it ended.
async fn expire_ttls(state: &AppState) -> Result<(), ControlError> {
    let now = now_ms();
    let expired: Vec<(String,)> = sqlx::query_as(&ttl_due_sql())
        .bind(now)
        .bind(BATCH)
        .fetch_all(&state.db.pool)
        .await?;
    for (id,) in expired {
        let mut tx = state.db.write().await?;
        let Some(row) = load_sandbox(&mut tx, &id).await? else {
            continue;
        };
        if matches!(
            row.desired,
            DesiredState::Terminated | DesiredState::Deleted
        ) {
            continue;
        }
        let terminated = DesiredState::Terminated;
        crate::records::sandboxes::set_desired(&mut tx, &row, terminated, "ttl_expired").await?;
        let computing = row.runner_id.is_some() && row.state.runner_at_work();
        if !computing {
            let row = load_sandbox(&mut tx, &id).await?.unwrap_or(row);
            let to = Transition {
                state: SandboxState::Terminated,
                reason: Some("ttl_expired"),
                message: None,
            };
            set_sandbox_state(&mut tx, &row, to, row.runner_id.as_deref(), row.epoch).await?;
        }
        tx.commit().await?;
        tracing::info!(sandbox_id = %id, "ttl expired");
    }
    Ok(())
}

/// Retention: an ended sandbox past the window answers 404. One that still
/// holds storage is deleted then, so nothing strands; deleted records and
/// their history are purged, and idempotency keys a day after that.
async fn apply_retention(state: &AppState) -> Result<(), ControlError> {
    let cutoff = state.retained_since_ms();
    // Ended but not released: everything terminal except `deleted`.
    let ended: Vec<(String,)> = sqlx::query_as(&retention_due_sql())
        .bind(cutoff)
        .bind(BATCH)
        .fetch_all(&state.db.pool)
        .await?;
    for (id,) in ended {
        let mut tx = state.db.write().await?;
        let Some(row) = load_sandbox(&mut tx, &id).await? else {
            continue;
        };
        let deleted = DesiredState::Deleted;
        crate::records::sandboxes::set_desired(&mut tx, &row, deleted, "retention_expired").await?;
        if row.runner_id.is_none() {
            let to = Transition {
                state: SandboxState::Deleted,
                reason: Some("retention_expired"),
                message: None,
            };
            set_sandbox_state(&mut tx, &row, to, None, row.epoch).await?;
        }
        tx.commit().await?;
    }
    // Reads hide ended records past the retention window; the rows of deleted
    // ones stay until their idempotency keys may go, so a key is kept a day
    // after its sandbox ended even when the retention window is shorter.
    let keys_cutoff = now_ms() - IDEMPOTENCY_KEEP_MS.max(state.config.retention.as_millis() as i64);
    let mut tx = state.db.write().await?;
    crate::records::sandboxes::purge_deleted(&mut tx, keys_cutoff).await?;
    // The saves' history serves the observed figures only.
    let observed_since = now_ms() - crate::control::deployment::OBSERVED_WINDOW.as_millis() as i64;
    crate::records::observed::prune_saves(&mut tx, observed_since).await?;
    let purged = sqlx::query(
        "DELETE FROM idempotency_keys WHERE created_at_ms < $1
         AND resource_id NOT IN (SELECT id FROM sandboxes WHERE ended_at_ms IS NULL OR ended_at_ms >= $1)
         AND resource_id NOT IN (SELECT id FROM commands WHERE ended_at_ms IS NULL OR ended_at_ms >= $1)
         AND resource_id NOT IN (SELECT id FROM snapshots)",
    )
    .bind(keys_cutoff)
    .execute(&mut *tx.tx)
    .await?;
    tx.commit().await?;
    if purged.rows_affected() > 0 {
        tracing::debug!(keys = purged.rows_affected(), "expired idempotency keys");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::mass_loss;

    #[test]
    fn one_lost_runner_is_recovered_but_a_large_share_at_once_is_held() {
        // One runner of any fleet: a host failure, recovered at once.
        assert!(!mass_loss(1, 1, 0.5));
        assert!(!mass_loss(2, 1, 0.5));
        assert!(!mass_loss(10, 4, 0.5));
        // Half the fleet or more at once: the control plane is suspect.
        assert!(mass_loss(2, 2, 0.5));
        assert!(mass_loss(10, 5, 0.5));
        assert!(mass_loss(3, 3, 1.0));
        // The threshold is the operator's: 0.9 tolerates 8 of 10.
        assert!(!mass_loss(10, 8, 0.9));
        assert!(mass_loss(10, 9, 0.9));
        // Above 1 never holds.
        assert!(!mass_loss(3, 3, 1.01));
    }
}
