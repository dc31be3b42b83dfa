//! The history behind the deployment's observed figures (`GET
//! /v1/deployment`): a row per completed save (written with the save,
//! kept for the observation window), the reads of saves and events over a
//! window, and the fold that finds recoveries and wakes in a sandbox's
//! events ([`timings`], a pure function).

use sqlx::AnyPool;
use sqlx::Row;

use super::parse_column;
use crate::db::WriteTx;
use api::lifecycle::SandboxState;

/// Records a completed save: captured at `captured_at_ms`, committed at
/// `completed_at_ms`, with the capture of the save it replaces. Guarded by
/// the placement like the record's update (nothing is written for a stale
/// one); call it before that update, in its transaction.
pub(super) async fn insert_save(
    tx: &mut WriteTx,
    id: &str,
    epoch: i64,
    runner_id: &str,
    captured_at_ms: i64,
    completed_at_ms: i64,
    // The save's own guard (`$4` the epoch, `$1` the capture): a row only
    // for a save the record takes.
    guard: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO saves (sandbox_id, captured_at_ms, completed_at_ms, previous_captured_at_ms)
         SELECT id, $1, $2, home_saved_at_ms FROM sandboxes WHERE id = $3 AND epoch = $4 AND runner_id = $5 AND {guard}"
    ))
    .bind(captured_at_ms)
    .bind(completed_at_ms)
    .bind(id)
    .bind(epoch)
    .bind(runner_id)
    .execute(&mut *tx.tx)
    .await?;
    Ok(())
}

/// Forgets saves committed before `cutoff_ms` (past the window).
pub async fn prune_saves(tx: &mut WriteTx, cutoff_ms: i64) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM saves WHERE completed_at_ms < $1")
        .bind(cutoff_ms)
        .execute(&mut *tx.tx)
        .await?;
    Ok(())
}

/// One completed save, in ms since the epoch.
pub struct SaveTimes {
    pub captured_at_ms: i64,
    pub completed_at_ms: i64,
    /// The capture of the save it replaced (`None`: the first).
    pub previous_captured_at_ms: Option<i64>,
}

/// Saves committed since `since_ms`, the newest `limit` of them.
pub async fn saves_since(
    pool: &AnyPool,
    since_ms: i64,
    limit: usize,
) -> Result<Vec<SaveTimes>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT captured_at_ms, completed_at_ms, previous_captured_at_ms FROM saves
         WHERE completed_at_ms >= $1 ORDER BY completed_at_ms DESC LIMIT {limit}"
    ))
    .bind(since_ms)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(SaveTimes {
                captured_at_ms: row.try_get("captured_at_ms")?,
                completed_at_ms: row.try_get("completed_at_ms")?,
                previous_captured_at_ms: row.try_get("previous_captured_at_ms")?,
            })
        })
        .collect()
}

/// One event, as the fold needs it.
#[derive(Clone, Debug)]
pub struct EventPoint {
    pub sandbox_id: String,
    pub at_ms: i64,
    pub state: SandboxState,
    pub runner_id: Option<String>,
}

/// The whole history of the sandboxes (at most `limit` of them) that came
/// to `running` since `since_ms`, each sandbox's events in order: a wake
/// needs the runner it last ran on, however long ago.
pub async fn running_histories(
    pool: &AnyPool,
    since_ms: i64,
    limit: usize,
) -> Result<Vec<EventPoint>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT sandbox_id, at_ms, state, runner_id FROM events WHERE sandbox_id IN
           (SELECT DISTINCT sandbox_id FROM events WHERE state = $1 AND at_ms >= $2 LIMIT {limit})
         ORDER BY sandbox_id, seq"
    ))
    .bind(SandboxState::Running.as_str())
    .bind(since_ms)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(EventPoint {
                sandbox_id: row.try_get("sandbox_id")?,
                at_ms: row.try_get("at_ms")?,
                state: parse_column(row, "state")?,
                runner_id: row.try_get("runner_id")?,
            })
        })
        .collect()
}

/// Durations in ms found in event histories.
#[derive(Debug, Default, PartialEq)]
pub struct Timings {
    /// From `recovering` (the runner declared lost) to `running` again.
    pub recoveries_ms: Vec<i64>,
    /// From placement (`starting`) to `running`, for a sandbox that ran
    /// before: on the runner it last ran on, and on another.
    pub wakes_same_ms: Vec<i64>,
    pub wakes_other_ms: Vec<i64>,
}

/// Recoveries and wakes that reached `running` at or after `since_ms`, in
/// `events` (grouped by sandbox, each in order). An event repeating the
/// state before it is a note (a desired change, a waiting reason), not a
/// transition, and is skipped.
pub fn timings(events: &[EventPoint], since_ms: i64) -> Timings {
    let mut out = Timings::default();
    let mut sandbox: Option<&str> = None;
    let mut previous: Option<SandboxState> = None;
    let mut last_runner: Option<Option<&str>> = None;
    let mut placed_at: Option<i64> = None;
    let mut lost_at: Option<i64> = None;
    for event in events {
        if sandbox != Some(event.sandbox_id.as_str()) {
            sandbox = Some(&event.sandbox_id);
            previous = None;
            last_runner = None;
            placed_at = None;
            lost_at = None;
        }
        if previous == Some(event.state) {
            continue;
        }
        previous = Some(event.state);
        match event.state {
            SandboxState::Starting => placed_at = Some(event.at_ms),
            SandboxState::Recovering => lost_at = Some(event.at_ms),
            SandboxState::Running => {
                let runner = event.runner_id.as_deref();
                if event.at_ms >= since_ms {
                    if let (Some(before), Some(placed)) = (last_runner, placed_at) {
                        let took = (event.at_ms - placed).max(0);
                        if before == runner {
                            out.wakes_same_ms.push(took);
                        } else {
                            out.wakes_other_ms.push(took);
                        }
                    }
                    if let Some(lost) = lost_at {
                        out.recoveries_ms.push((event.at_ms - lost).max(0));
                    }
                }
                last_runner = Some(runner);
                placed_at = None;
                lost_at = None;
            }
            _ => {}
        }
    }
    out
}

/// The most work at risk across the fleet right now, in ms: the largest
/// [`super::sandboxes::at_risk_ms`] of the durable sandboxes whose home is
/// live on a runner.
pub async fn at_risk_ms_max(pool: &AnyPool, now_ms: i64) -> Result<i64, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT state, {} AS safe_until_ms, created_at_ms FROM sandboxes
         WHERE save_interval_s IS NOT NULL AND state IN {}",
        super::sandboxes::SAFE_UNTIL_SQL,
        SandboxState::sql_in(SandboxState::runner_at_work)
    ))
    .fetch_all(pool)
    .await?;
    let mut max = 0;
    for row in &rows {
        let state: SandboxState = parse_column(row, "state")?;
        let saved: Option<i64> = row.try_get("safe_until_ms")?;
        let created: i64 = row.try_get("created_at_ms")?;
        max = max.max(super::sandboxes::at_risk_ms(state, saved, created, now_ms));
    }
    Ok(max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState::*;

    fn event(sandbox: &str, at_ms: i64, state: SandboxState, runner: Option<&str>) -> EventPoint {
        EventPoint {
            sandbox_id: sandbox.to_owned(),
            at_ms,
            state,
            runner_id: runner.map(str::to_owned),
        }
    }

    #[test]
    fn recoveries_and_wakes_are_found_in_the_history() {
        let events = [
            // Created and first run: not a wake.
            event("a", 0, Pending, None),
            event("a", 10, Starting, Some("r1")),
            event("a", 50, Running, Some("r1")),
            // A note repeating the state changes nothing.
            event("a", 60, Running, None),
            // Stopped, started again on the same runner: a wake of 30 ms.
            event("a", 100, Stopping, Some("r1")),
            event("a", 110, Securing, Some("r1")),
            event("a", 120, Stopped, Some("r1")),
            event("a", 200, Starting, Some("r1")),
            event("a", 230, Running, Some("r1")),
            // Host lost: recovered on r2, 500 ms after the verdict; that
            // is a wake elsewhere too (placement to running: 100 ms).
            event("a", 1_000, Recovering, Some("r1")),
            event("a", 1_400, Starting, Some("r2")),
            event("a", 1_500, Running, Some("r2")),
            // Another sandbox, before the window: not counted.
            event("b", 0, Starting, Some("r1")),
            event("b", 5, Running, Some("r1")),
            event("b", 6, Recovering, Some("r1")),
            event("b", 7, Starting, Some("r2")),
            event("b", 9, Running, Some("r2")),
        ];
        let found = timings(&events, 100);
        assert_eq!(
            found,
            Timings {
                recoveries_ms: vec![500],
                wakes_same_ms: vec![30],
                wakes_other_ms: vec![100],
            }
        );
    }
}
