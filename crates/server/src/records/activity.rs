//! A sandbox's activity (`api::lifecycle::Activity`, nothing else) and the
//! idle deadline it moves; the sleep decision that reads them.
//!
//! Every write here is an `UPDATE` of the sandbox's row, so on PostgreSQL
//! it takes the row's lock: an activity and a sleep decision on the same
//! sandbox, on any two servers, are ordered, and whichever comes second
//! sees the first (see [`claim_sleep`]).

use api::lifecycle::{Activity, CommandState};

use crate::db::WriteTx;

/// Records `activity` at `now` on the sandbox: its last activity and, when
/// it is running with a timeout, its deadline (`now` plus the timeout).
/// False when there is no such sandbox.
pub async fn touch_row(
    tx: &mut WriteTx,
    sandbox_id: &str,
    activity: Activity,
    now: i64,
) -> Result<bool, sqlx::Error> {
    touch(tx, sandbox_id, None, activity, now).await
}

/// [`touch_row`] of the org's sandbox only, in the same one statement:
/// false when there is no such sandbox of that org.
pub async fn touch_org_row(
    tx: &mut WriteTx,
    org_id: &str,
    sandbox_id: &str,
    activity: Activity,
    now: i64,
) -> Result<bool, sqlx::Error> {
    touch(tx, sandbox_id, Some(org_id), activity, now).await
}

async fn touch(
    tx: &mut WriteTx,
    sandbox_id: &str,
    org_id: Option<&str>,
    activity: Activity,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let of_org = if org_id.is_some() {
        " AND org_id = $4"
    } else {
        ""
    };
    let sql = format!(
        "UPDATE sandboxes SET last_activity_at_ms = $1, last_activity = $2,
         idle_deadline_ms = CASE WHEN state = 'running' AND idle_timeout_s > 0 THEN $1 + idle_timeout_s * 1000 ELSE NULL END
         WHERE id = $3{of_org}"
    );
    let mut query = sqlx::query(&sql)
        .bind(now)
        .bind(activity.as_str())
        .bind(sandbox_id);
    if let Some(org_id) = org_id {
        query = query.bind(org_id);
    }
    let updated = query.execute(&mut *tx.tx).await?;
    Ok(updated.rows_affected() > 0)
}

/// Sets the idle policy; the deadline follows from the last activity (or,
/// with none, the record's change before this one: an update's
/// expressions read the row as it was).
pub async fn set_policy(
    tx: &mut WriteTx,
    sandbox_id: &str,
    timeout_s: i64,
    auto_wake: bool,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE sandboxes SET idle_timeout_s = $1, auto_wake = $2, updated_at_ms = $4,
         idle_deadline_ms = CASE WHEN state = 'running' AND $1 > 0 THEN COALESCE(last_activity_at_ms, updated_at_ms) + $1 * 1000 ELSE NULL END
         WHERE id = $3",
    )
    .bind(timeout_s)
    .bind(i64::from(auto_wake))
    .bind(sandbox_id)
    .bind(crate::db::now_ms())
    .execute(&mut *tx.tx)
    .await?;
    tx.changed(sandbox_id);
    Ok(())
}

/// Sandboxes whose deadline has passed at `now`, oldest deadline first
/// (an indexed read of what is due: a sleeping or busy-free fleet costs
/// nothing here), but for quarantined ones: they sleep once released.
pub async fn due(pool: &sqlx::AnyPool, now: i64, limit: i64) -> Result<Vec<String>, sqlx::Error> {
    let rows: Vec<(String,)> = sqlx::query_as(
        "SELECT id FROM sandboxes WHERE idle_deadline_ms IS NOT NULL AND idle_deadline_ms <= $1 AND quarantined = 0 ORDER BY idle_deadline_ms LIMIT $2",
    )
    .bind(now)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

/// What the sleep decision found.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// No longer due (an activity moved the deadline, or the sandbox is no
    /// longer running and wanted so): nothing to do.
    NotDue,
    /// A command is still queued or running: it keeps the sandbox awake
    /// (the deadline moved on from `now`).
    Busy,
    /// Idle: the caller stops it in this transaction.
    Idle,
}

/// The first step of the sleep decision, in the caller's transaction: the
/// deadline is cleared only if it is still due at `now` and the sandbox
/// still running and wanted so, which locks the row; then commands are
/// counted. An activity committed before the lock moved the deadline (not
/// due); one waiting on the lock sees the decision once it is committed
/// (and wakes the sandbox); a command created before it is counted here,
/// since on PostgreSQL each statement reads what was committed when it
/// began.
pub async fn claim_sleep(
    tx: &mut WriteTx,
    sandbox_id: &str,
    now: i64,
) -> Result<Claim, sqlx::Error> {
    let claimed = sqlx::query(
        "UPDATE sandboxes SET idle_deadline_ms = NULL WHERE id = $1 AND idle_deadline_ms IS NOT NULL
         AND idle_deadline_ms <= $2 AND state = 'running' AND desired = 'running'",
    )
    .bind(sandbox_id)
    .bind(now)
    .execute(&mut *tx.tx)
    .await?;
    if claimed.rows_affected() == 0 {
        return Ok(Claim::NotDue);
    }
    let (active,): (i64,) = sqlx::query_as(&format!(
        "SELECT COUNT(*) FROM commands WHERE sandbox_id = $1 AND state IN {}",
        CommandState::sql_in(|state| !state.is_end())
    ))
    .bind(sandbox_id)
    .fetch_one(&mut *tx.tx)
    .await?;
    if active > 0 {
        touch_row(tx, sandbox_id, Activity::CommandRunning, now).await?;
        tx.changed(sandbox_id);
        return Ok(Claim::Busy);
    }
    Ok(Claim::Idle)
}
