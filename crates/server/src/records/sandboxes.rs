//! The sandbox row, and every write to a sandbox's observed fields: each
//! state change, desired change, waiting reason and runner release appends
//! its event, so the history tells everything the record ever said.

use std::collections::BTreeMap;

use sqlx::AnyPool;
use sqlx::Row;

use super::counts::Counted;
use super::{json_map, parse_column, rfc3339};
use crate::db::{Db, WriteTx, now_ms};
use api::lifecycle::{DesiredState, Network, Placement, SandboxState, StorageClass};

/// A sandbox row as stored.
#[derive(Clone, Debug)]
pub struct SandboxRow {
    pub id: String,
    pub org_id: String,
    pub image: String,
    /// The imported image's root tree, pinned at create (`None`: default).
    pub image_root: Option<String>,
    pub storage_class: StorageClass,
    pub memory_mib: Option<i64>,
    pub millicpus: Option<i64>,
    pub pids: Option<i64>,
    /// `resources.home_mib`: the bound its runner puts on its home.
    pub home_mib: Option<i64>,
    pub network: Network,
    pub placement: Placement,
    pub env: String,
    pub labels: String,
    pub state: SandboxState,
    pub state_reason: Option<String>,
    /// What the report or verdict that set the state and reason said.
    pub state_message: Option<String>,
    pub desired: DesiredState,
    pub runner_id: Option<String>,
    pub last_runner_id: Option<String>,
    pub epoch: i64,
    pub quarantined: bool,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub ended_at_ms: Option<i64>,
    pub home: HomeColumns,
    /// The record's list of kept copies (JSON), kept by `records::kept`.
    pub kept_copies: Option<String>,
    /// Shared filesystems mounted (JSON `api::sandboxes::Mount`s, with
    /// `read_only` as enforced); set at create, never changed.
    pub mounts: String,
    pub idle: IdleColumns,
    /// The reason `desired` was last set with (`idle`, `woken_by_command`…),
    /// and its event's message.
    pub desired_reason: Option<String>,
    pub desired_message: Option<String>,
    /// A start was asked while a stop was under way: it starts again once
    /// the stop is done (`control::idle::resume_after_stop`).
    pub start_after_stop: bool,
}

/// When a sandbox goes to sleep, and what last kept it awake.
#[derive(Clone, Debug, Default)]
pub struct IdleColumns {
    /// Seconds without activity before it sleeps; 0: never.
    pub timeout_s: i64,
    /// A command sent while it is stopped starts it.
    pub auto_wake: bool,
    pub last_activity_at_ms: Option<i64>,
    /// One of [`Activity`]'s names.
    pub last_activity: Option<String>,
    /// Set only while `running` with a timeout.
    pub deadline_ms: Option<i64>,
}

/// A sandbox's home in the store and how saving it goes (durable
/// sandboxes; a child of a snapshot starts from `root` whatever its class).
#[derive(Clone, Debug, Default)]
pub struct HomeColumns {
    /// The last completed save (or the snapshot a child starts from).
    pub root: Option<String>,
    /// When that save captured the home.
    pub saved_at_ms: Option<i64>,
    /// Set for durable sandboxes only.
    pub save_interval_s: Option<i64>,
    pub save_attempt_at_ms: Option<i64>,
    /// The last attempt's error; cleared by a completed save.
    pub save_error: Option<String>,
    pub save_bytes_pending: Option<i64>,
    pub from_snapshot: Option<String>,
    /// When a scheduled save last found the home exactly as `root` (nothing
    /// uploaded): the home was safe up to then too.
    pub unchanged_at_ms: Option<i64>,
}

pub const SANDBOX_COLUMNS: &str = "id, org_id, image, image_root, storage_class, memory_mib, millicpus, pids, network, placement, env, labels, state, state_reason, state_message, desired, runner_id, last_runner_id, epoch, quarantined, created_at_ms, updated_at_ms, expires_at_ms, ended_at_ms, home_root, home_saved_at_ms, save_interval_s, save_attempt_at_ms, save_error, save_bytes_pending, from_snapshot, kept_copies, mounts, idle_timeout_s, auto_wake, last_activity_at_ms, last_activity, idle_deadline_ms, desired_reason, desired_message, home_unchanged_at_ms, start_after_stop, home_mib";

/// [`SANDBOX_COLUMNS`] split, for direct reads (`super::DirectRow`).
static SANDBOX_COLUMN_NAMES: std::sync::LazyLock<Vec<&str>> =
    std::sync::LazyLock::new(|| super::column_names(SANDBOX_COLUMNS));

impl super::FromReadRow for SandboxRow {
    fn from_read_row(row: &impl super::ReadRow) -> Result<SandboxRow, sqlx::Error> {
        SandboxRow::from_row(row)
    }
}

impl SandboxRow {
    pub fn from_row(row: &impl super::ReadRow) -> Result<SandboxRow, sqlx::Error> {
        Ok(SandboxRow {
            id: row.column("id")?,
            org_id: row.column("org_id")?,
            image: row.column("image")?,
            image_root: row.column("image_root")?,
            storage_class: parse_column(row, "storage_class")?,
            memory_mib: row.column("memory_mib")?,
            millicpus: row.column("millicpus")?,
            pids: row.column("pids")?,
            home_mib: row.column("home_mib")?,
            network: parse_column(row, "network")?,
            placement: parse_column(row, "placement")?,
            env: row.column("env")?,
            labels: row.column("labels")?,
            state: parse_column(row, "state")?,
            state_reason: row.column("state_reason")?,
            state_message: row.column("state_message")?,
            desired: parse_column(row, "desired")?,
            runner_id: row.column("runner_id")?,
            last_runner_id: row.column("last_runner_id")?,
            epoch: row.column("epoch")?,
            quarantined: row.column::<i64>("quarantined")? != 0,
            created_at_ms: row.column("created_at_ms")?,
            updated_at_ms: row.column("updated_at_ms")?,
            expires_at_ms: row.column("expires_at_ms")?,
            ended_at_ms: row.column("ended_at_ms")?,
            home: HomeColumns {
                root: row.column("home_root")?,
                saved_at_ms: row.column("home_saved_at_ms")?,
                save_interval_s: row.column("save_interval_s")?,
                save_attempt_at_ms: row.column("save_attempt_at_ms")?,
                save_error: row.column("save_error")?,
                save_bytes_pending: row.column("save_bytes_pending")?,
                from_snapshot: row.column("from_snapshot")?,
                unchanged_at_ms: row.column("home_unchanged_at_ms")?,
            },
            kept_copies: row.column("kept_copies")?,
            mounts: row.column("mounts")?,
            idle: IdleColumns {
                timeout_s: row.column("idle_timeout_s")?,
                auto_wake: row.column::<i64>("auto_wake")? != 0,
                last_activity_at_ms: row.column("last_activity_at_ms")?,
                last_activity: row.column("last_activity")?,
                deadline_ms: row.column("idle_deadline_ms")?,
            },
            desired_reason: row.column("desired_reason")?,
            desired_message: row.column("desired_message")?,
            start_after_stop: row.column::<i64>("start_after_stop")? != 0,
        })
    }

    pub fn resources(&self) -> api::sandboxes::Resources {
        api::sandboxes::Resources {
            memory_mib: self.memory_mib.map(|v| v as u64),
            cpus: self.millicpus.map(|v| v as f64 / 1000.0),
            pids: self.pids.map(|v| v as u64),
            home_mib: self.home_mib.map(|v| v as u64),
        }
    }

    /// The shared filesystems it mounts.
    pub fn mounts(&self) -> Vec<api::sandboxes::Mount> {
        serde_json::from_str(&self.mounts).unwrap_or_default()
    }

    pub fn to_api(&self) -> api::sandboxes::Sandbox {
        api::sandboxes::Sandbox {
            id: self.id.clone(),
            org_id: self.org_id.clone(),
            state: self.state,
            state_reason: self.state_reason.clone(),
            state_message: self.state_message.clone(),
            desired: self.desired,
            runner_id: self.runner_id.clone(),
            epoch: self.epoch as u64,
            image: self.image.clone(),
            storage_class: self.storage_class,
            resources: self.resources(),
            network: self.network,
            placement: self.placement,
            env: json_map(&self.env),
            labels: json_map(&self.labels),
            quarantined: self.quarantined,
            created_at: rfc3339(self.created_at_ms),
            updated_at: rfc3339(self.updated_at_ms),
            expires_at: self.expires_at_ms.map(rfc3339),
            ended_at: self.ended_at_ms.map(rfc3339),
            save: self.save_status(now_ms()),
            from_snapshot: self.home.from_snapshot.clone(),
            mounts: self.mounts(),
            recovery: (self.state == SandboxState::Recovering).then(|| self.recovery()),
            kept_copies: self
                .kept_copies
                .as_deref()
                .and_then(|text| serde_json::from_str(text).ok())
                .unwrap_or_default(),
            idle_timeout_s: self.idle.timeout_s.max(0) as u64,
            auto_wake: self.idle.auto_wake,
            last_activity_at: self.idle.last_activity_at_ms.map(rfc3339),
            last_activity: self.idle.last_activity.clone(),
            idle_deadline: self.idle.deadline_ms.map(rfc3339),
        }
    }

    /// What a recovery restores the home from: the last completed save,
    /// else the snapshot it was created from, else nothing (an empty home).
    pub fn recovery(&self) -> api::sandboxes::Recovery {
        let root = self.home.root.clone();
        let (restores, message) = match (&root, self.home.saved_at_ms, &self.home.from_snapshot) {
            (Some(root), Some(saved_at), _) => (
                "last_save",
                format!(
                    "the home will be restored from its last completed save {root} (captured {}); later writes are not in it",
                    rfc3339(saved_at)
                ),
            ),
            (Some(_), None, Some(snapshot)) => (
                "snapshot",
                format!(
                    "no save of this sandbox ever completed: the home will be restored from snapshot {snapshot}, which it was created from"
                ),
            ),
            (Some(root), None, None) => (
                "last_save",
                format!("the home will be restored from {root}"),
            ),
            (None, _, _) => (
                "empty",
                "no save of this sandbox ever completed: the home will start empty".to_owned(),
            ),
        };
        api::sandboxes::Recovery {
            restores: restores.to_owned(),
            root,
            saved_at: self.home.saved_at_ms.map(rfc3339),
            message,
        }
    }

    /// The `save` object of a durable sandbox: `failing` while the last
    /// attempt failed, `delayed` when no save completed within twice the
    /// interval (counted from creation before the first), else `ok`.
    pub fn save_status(&self, now: i64) -> Option<api::sandboxes::SaveStatus> {
        let interval_s = self.home.save_interval_s?;
        let safe_until = self.safe_until_ms();
        let since = safe_until.unwrap_or(self.created_at_ms);
        let state = if self.home.save_error.is_some() {
            "failing"
        } else if self.state == SandboxState::Running && now - since > 2 * interval_s * 1000 {
            "delayed"
        } else {
            "ok"
        };
        Some(api::sandboxes::SaveStatus {
            interval_s: interval_s as u64,
            state: state.to_owned(),
            last_completed_at: self.home.saved_at_ms.map(rfc3339),
            last_attempt_at: self.home.save_attempt_at_ms.map(rfc3339),
            last_error: self.home.save_error.clone(),
            bytes_pending: self.home.save_bytes_pending.map(|b| b.max(0) as u64),
            root: self.home.root.clone(),
            last_unchanged_at: self.home.unchanged_at_ms.map(rfc3339),
            safe_until: safe_until.map(rfc3339),
            at_risk_s: at_risk_ms(self.state, safe_until, self.created_at_ms, now) as f64 / 1000.0,
        })
    }

    /// Everything written before this instant is in the last completed
    /// save: its capture, or later when a scheduled save since found the
    /// home unchanged (a parked sandbox).
    pub fn safe_until_ms(&self) -> Option<i64> {
        let saved = self.home.saved_at_ms?;
        Some(self.home.unchanged_at_ms.map_or(saved, |at| at.max(saved)))
    }
}

/// What a host failure would cost a durable home at `now`, in ms: the
/// writes since its last completed save's capture (since creation before
/// the first) while the home is live on a runner; nothing otherwise (a
/// stopped home was secured, a recovering one is restored from the store,
/// a pending one was never written).
pub fn at_risk_ms(
    state: SandboxState,
    saved_at_ms: Option<i64>,
    created_at_ms: i64,
    now: i64,
) -> i64 {
    if !state.runner_at_work() {
        return 0;
    }
    (now - saved_at_ms.unwrap_or(created_at_ms)).max(0)
}

pub async fn load_sandbox(tx: &mut WriteTx, id: &str) -> Result<Option<SandboxRow>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.as_ref().map(SandboxRow::from_row).transpose()
}

/// What a state change writes besides `state`.
pub struct Transition<'a> {
    pub state: SandboxState,
    pub reason: Option<&'a str>,
    pub message: Option<&'a str>,
}

/// Moves a sandbox to a new observed state: updates the record (guarded by
/// the state, epoch and runner it was read with, so a concurrent change
/// makes this return `false` and write nothing), appends the event, and
/// ends the sandbox's commands that can no longer run.
pub async fn set_sandbox_state(
    tx: &mut WriteTx,
    current: &SandboxRow,
    to: Transition<'_>,
    runner_id: Option<&str>,
    epoch: i64,
) -> Result<bool, sqlx::Error> {
    let now = now_ms();
    let ended = if to.state.is_terminal() {
        Some(current.ended_at_ms.unwrap_or(now))
    } else {
        None
    };
    // Every state carries a reason: the one given, else its usual one.
    let reason = to.reason.unwrap_or(to.state.usual_reason());
    // The row's `desired` comes back as locked by this update, so the
    // counts see exactly what changed (state and runner are guarded).
    let updated = sqlx::query(
        "UPDATE sandboxes SET state = $1, state_reason = $2, runner_id = $3, epoch = $4, updated_at_ms = $5, ended_at_ms = $6, state_message = $11,
         last_runner_id = COALESCE($3, last_runner_id)
         WHERE id = $7 AND state = $8 AND epoch = $9 AND COALESCE(runner_id, '') = $10 RETURNING desired",
    )
    .bind(to.state.as_str())
    .bind(reason)
    .bind(runner_id)
    .bind(epoch)
    .bind(now)
    .bind(ended)
    .bind(&current.id)
    .bind(current.state.as_str())
    .bind(current.epoch)
    .bind(current.runner_id.as_deref().unwrap_or(""))
    .bind(to.message)
    .fetch_optional(&mut *tx.tx)
    .await?;
    let Some(updated) = updated else {
        return Ok(false);
    };
    let mut before = Counted::of(current);
    before.desired = parse_column(&updated, "desired")?;
    let after = Counted {
        state: to.state,
        runner_id: runner_id.map(str::to_owned),
        ..before.clone()
    };
    tx.count(Some(&before), Some(&after));
    if to.state == SandboxState::Running {
        // Idleness counts from when it runs (a wake's restore is no idle
        // time); `started` is the activity that begins it.
        super::activity::touch_row(tx, &current.id, api::lifecycle::Activity::Started, now).await?;
    } else if current.state == SandboxState::Running {
        // Only a running sandbox has a deadline to sleep at.
        sqlx::query("UPDATE sandboxes SET idle_deadline_ms = NULL WHERE id = $1")
            .bind(&current.id)
            .execute(&mut *tx.tx)
            .await?;
    }
    let event = Event {
        state: to.state,
        reason: Some(reason),
        message: to.message,
        epoch,
        runner_id,
    };
    append_event(tx, &current.id, now, event).await?;
    super::commands::end_commands_for(tx, &current.id, to.state, to.reason).await?;
    tx.changed(&current.id);
    if let Some(runner) = runner_id.or(current.runner_id.as_deref()) {
        tx.changed(&format!("runner:{runner}"));
    }
    Ok(true)
}

/// One row of a sandbox's history.
struct Event<'a> {
    state: SandboxState,
    reason: Option<&'a str>,
    message: Option<&'a str>,
    epoch: i64,
    runner_id: Option<&'a str>,
}

/// Appends an event as the sandbox's next one (`seq` counts from 1), and
/// wakes the sandbox's waiters at commit.
async fn append_event(
    tx: &mut WriteTx,
    sandbox_id: &str,
    at_ms: i64,
    event: Event<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO events (sandbox_id, seq, at_ms, state, reason, message, epoch, runner_id)
         SELECT $1, COALESCE(MAX(seq), 0) + 1, $2, $3, $4, $5, $6, $7 FROM events WHERE sandbox_id = $1",
    )
    .bind(sandbox_id)
    .bind(at_ms)
    .bind(event.state.as_str())
    .bind(event.reason)
    .bind(event.message)
    .bind(event.epoch)
    .bind(event.runner_id)
    .execute(&mut *tx.tx)
    .await?;
    // Every event wakes its sandbox's waiters: an open timeline
    // (`GET …/events?after=`) answers at this commit.
    tx.changed(sandbox_id);
    Ok(())
}

/// An event that records a change to something other than the state (the
/// desired state, the waiting reason, the placement): the state column
/// repeats the current state, the reason says what changed.
pub(super) async fn note(
    tx: &mut WriteTx,
    row: &SandboxRow,
    reason: &str,
    message: &str,
    runner_id: Option<&str>,
) -> Result<(), sqlx::Error> {
    let event = Event {
        state: row.state,
        reason: Some(reason),
        message: Some(message),
        epoch: row.epoch,
        runner_id,
    };
    append_event(tx, &row.id, now_ms(), event).await?;
    tx.changed(&row.id);
    if let Some(runner) = runner_id.or(row.runner_id.as_deref()) {
        tx.changed(&format!("runner:{runner}"));
    }
    Ok(())
}

/// Writes a newly admitted sandbox, its label index and its first event.
pub async fn insert(
    tx: &mut WriteTx,
    row: &SandboxRow,
    labels: &BTreeMap<String, String>,
) -> Result<(), sqlx::Error> {
    // Every state carries a reason: the one given, else its usual one.
    let reason = row
        .state_reason
        .as_deref()
        .unwrap_or(row.state.usual_reason());
    sqlx::query(&format!(
        "INSERT INTO sandboxes ({SANDBOX_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35, $36, $37, $38, $39, $40, $41, $42, $43)"
    ))
    .bind(&row.id)
    .bind(&row.org_id)
    .bind(&row.image)
    .bind(&row.image_root)
    .bind(row.storage_class.as_str())
    .bind(row.memory_mib)
    .bind(row.millicpus)
    .bind(row.pids)
    .bind(row.network.as_str())
    .bind(row.placement.as_str())
    .bind(&row.env)
    .bind(&row.labels)
    .bind(row.state.as_str())
    .bind(reason)
    .bind(&row.state_message)
    .bind(row.desired.as_str())
    .bind(&row.runner_id)
    .bind(&row.last_runner_id)
    .bind(row.epoch)
    .bind(0_i64)
    .bind(row.created_at_ms)
    .bind(row.updated_at_ms)
    .bind(row.expires_at_ms)
    .bind(row.ended_at_ms)
    .bind(&row.home.root)
    .bind(row.home.saved_at_ms)
    .bind(row.home.save_interval_s)
    .bind(row.home.save_attempt_at_ms)
    .bind(&row.home.save_error)
    .bind(row.home.save_bytes_pending)
    .bind(&row.home.from_snapshot)
    .bind(&row.kept_copies)
    .bind(&row.mounts)
    .bind(row.idle.timeout_s)
    .bind(i64::from(row.idle.auto_wake))
    .bind(row.idle.last_activity_at_ms)
    .bind(&row.idle.last_activity)
    .bind(row.idle.deadline_ms)
    .bind(&row.desired_reason)
    .bind(&row.desired_message)
    .bind(row.home.unchanged_at_ms)
    .bind(i64::from(row.start_after_stop))
    .bind(row.home_mib)
    .execute(&mut *tx.tx)
    .await?;
    for (key, value) in labels {
        sqlx::query("INSERT INTO sandbox_labels (sandbox_id, key, value) VALUES ($1, $2, $3)")
            .bind(&row.id)
            .bind(key)
            .bind(value)
            .execute(&mut *tx.tx)
            .await?;
    }
    let event = Event {
        state: row.state,
        reason: Some(reason),
        message: None,
        epoch: row.epoch,
        runner_id: None,
    };
    append_event(tx, &row.id, row.created_at_ms, event).await?;
    tx.count(None, Some(&Counted::of(row)));
    tx.changed(&row.id);
    Ok(())
}

/// Locks the sandbox's row (an update that changes nothing) and returns
/// what it counts toward as of now: what a write that does not guard on
/// the counted fields changes them from.
async fn lock_counted(tx: &mut WriteTx, id: &str) -> Result<Option<Counted>, sqlx::Error> {
    let row = sqlx::query(
        "UPDATE sandboxes SET desired = desired WHERE id = $1
         RETURNING org_id, state, desired, runner_id, memory_mib, millicpus, pids",
    )
    .bind(id)
    .fetch_optional(&mut *tx.tx)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    Ok(Some(Counted {
        org_id: row.try_get("org_id")?,
        state: parse_column(&row, "state")?,
        desired: parse_column(&row, "desired")?,
        runner_id: row.try_get("runner_id")?,
        memory_mib: row.try_get::<Option<i64>, _>("memory_mib")?.unwrap_or(0),
        millicpus: row.try_get::<Option<i64>, _>("millicpus")?.unwrap_or(0),
        pids: row.try_get::<Option<i64>, _>("pids")?.unwrap_or(0),
    }))
}

/// What the sandbox's org (or a rule acting for it: a TTL, retention)
/// wants of it, with the event that says why.
pub async fn set_desired(
    tx: &mut WriteTx,
    row: &SandboxRow,
    desired: DesiredState,
    reason: &str,
) -> Result<(), sqlx::Error> {
    set_desired_saying(tx, row, desired, reason, &format!("desired {desired}")).await
}

/// [`set_desired`], with the event's message (what woke a sandbox).
pub async fn set_desired_saying(
    tx: &mut WriteTx,
    row: &SandboxRow,
    desired: DesiredState,
    reason: &str,
    message: &str,
) -> Result<(), sqlx::Error> {
    let before = lock_counted(tx, &row.id).await?;
    sqlx::query(
        "UPDATE sandboxes SET desired = $1, desired_reason = $2, desired_message = $3, updated_at_ms = $4,
         start_after_stop = 0 WHERE id = $5",
    )
    .bind(desired.as_str())
    .bind(reason)
    .bind(message)
    .bind(now_ms())
    .bind(&row.id)
    .execute(&mut *tx.tx)
    .await?;
    if let Some(before) = before {
        let after = Counted {
            desired,
            ..before.clone()
        };
        tx.count(Some(&before), Some(&after));
    }
    note(tx, row, reason, message, None).await
}

/// A start was asked while a stop is under way: kept on the row (any later
/// change of `desired` clears it) and said in its history; the sandbox
/// starts again once the stop is done.
pub async fn set_start_after_stop(
    tx: &mut WriteTx,
    row: &SandboxRow,
    message: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE sandboxes SET start_after_stop = 1, updated_at_ms = $1 WHERE id = $2")
        .bind(now_ms())
        .bind(&row.id)
        .execute(&mut *tx.tx)
        .await?;
    note(tx, row, "start_requested", message, None).await
}

/// The start asked during a stop is dropped (a later stop, or a quota
/// once the stop was done): cleared, and said in its history.
pub async fn clear_start_after_stop(
    tx: &mut WriteTx,
    row: &SandboxRow,
    reason: &str,
    message: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE sandboxes SET start_after_stop = 0, updated_at_ms = $1 WHERE id = $2")
        .bind(now_ms())
        .bind(&row.id)
        .execute(&mut *tx.tx)
        .await?;
    note(tx, row, reason, message, None).await
}

/// A command asked for a wake while the sandbox stops: said in its
/// history (the state and desired unchanged until the stop is done).
pub async fn note_wake_requested(
    tx: &mut WriteTx,
    row: &SandboxRow,
    message: &str,
) -> Result<(), sqlx::Error> {
    note(tx, row, "wake_requested", message, None).await
}

/// The sandbox's shared-filesystem mounts, as its next placement mounts
/// them (`scheduler::place`: a binding made read-only since).
pub async fn set_mounts(
    tx: &mut WriteTx,
    id: &str,
    mounts: &[api::sandboxes::Mount],
) -> Result<(), sqlx::Error> {
    let json = serde_json::to_string(mounts).unwrap_or_else(|_| "[]".to_owned());
    sqlx::query("UPDATE sandboxes SET mounts = $1 WHERE id = $2")
        .bind(json)
        .bind(id)
        .execute(&mut *tx.tx)
        .await?;
    tx.changed(id);
    Ok(())
}

/// Why a sandbox still waits for a runner (its state unchanged), recorded
/// with an event when the reason changes. Guarded by the state it was
/// read in.
pub async fn set_waiting_reason(
    tx: &mut WriteTx,
    row: &SandboxRow,
    reason: &str,
) -> Result<(), sqlx::Error> {
    if row.state_reason.as_deref() == Some(reason) {
        return Ok(());
    }
    let message = "waiting for a runner";
    let updated = sqlx::query(
        "UPDATE sandboxes SET state_reason = $1, state_message = $2 WHERE id = $3 AND state = $4",
    )
    .bind(reason)
    .bind(message)
    .bind(&row.id)
    .bind(row.state.as_str())
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() > 0 {
        note(tx, row, reason, message, None).await?;
    }
    Ok(())
}

/// A runner's report that the sandbox, still `starting` at its placement,
/// waits (`reason`, one of `api::lifecycle::STARTING_WAIT_REASONS`; the
/// caller checks): the reason and message change, the state does not.
/// An event is written only when the reason changes, not for every retry
/// (each retry only rewrites the message, which says when the next one
/// is). Guarded by the state, epoch and runner the row was read with:
/// `false` (nothing written) when the record moved on meanwhile.
pub async fn set_starting_wait(
    tx: &mut WriteTx,
    row: &SandboxRow,
    reason: &str,
    message: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let updated = sqlx::query(
        "UPDATE sandboxes SET state_reason = $1, state_message = $2, updated_at_ms = $3
         WHERE id = $4 AND state = $5 AND epoch = $6 AND COALESCE(runner_id, '') = $7",
    )
    .bind(reason)
    .bind(message)
    .bind(now_ms())
    .bind(&row.id)
    .bind(row.state.as_str())
    .bind(row.epoch)
    .bind(row.runner_id.as_deref().unwrap_or(""))
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() == 0 {
        return Ok(false);
    }
    if row.state_reason.as_deref() == Some(reason) {
        tx.changed(&row.id);
    } else {
        note(
            tx,
            row,
            reason,
            message.unwrap_or("waiting"),
            row.runner_id.as_deref(),
        )
        .await?;
    }
    Ok(true)
}

/// The runner holding the sandbox is gone while its state stays what it
/// was (a stopped standard home's runner was lost): the placement goes,
/// with an event.
pub async fn release_runner(
    tx: &mut WriteTx,
    row: &SandboxRow,
    message: &str,
) -> Result<(), sqlx::Error> {
    let before = lock_counted(tx, &row.id).await?;
    sqlx::query("UPDATE sandboxes SET runner_id = NULL WHERE id = $1")
        .bind(&row.id)
        .execute(&mut *tx.tx)
        .await?;
    if let Some(before) = before {
        let after = Counted {
            runner_id: None,
            ..before.clone()
        };
        tx.count(Some(&before), Some(&after));
    }
    note(tx, row, "node_lost", message, row.runner_id.as_deref()).await
}

/// An administrator's hold on the sandbox (`None` releases it). False if
/// there is no such sandbox.
pub async fn set_quarantine(
    tx: &mut WriteTx,
    id: &str,
    reason: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let updated = sqlx::query(
        "UPDATE sandboxes SET quarantined = $1, quarantine_reason = $2, updated_at_ms = $3 WHERE id = $4",
    )
    .bind(i64::from(reason.is_some()))
    .bind(reason)
    .bind(now_ms())
    .bind(id)
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() == 0 {
        return Ok(false);
    }
    tx.changed(id);
    Ok(true)
}

/// What a runner's save report changes on the record, guarded by the
/// placement (epoch and runner) it was made under.
pub enum SaveOutcome {
    /// The home is saved as `root`, captured at `captured_at_ms`.
    Completed {
        root: String,
        captured_at_ms: i64,
    },
    Failed {
        error: String,
        bytes_pending: Option<i64>,
    },
    Progress {
        bytes_pending: Option<i64>,
    },
    /// A scheduled save found the home exactly as `root`, the last
    /// completed save, at `captured_at_ms`: nothing uploaded or committed.
    Unchanged {
        root: String,
        captured_at_ms: i64,
    },
}

/// What became of a save report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveRecorded {
    Recorded,
    /// Another epoch or runner holds the sandbox: nothing is written.
    PlacementMoved,
    /// A completed save of this placement captured before the one the
    /// record holds (its commit waited behind a later save's): the record
    /// keeps the later one, which holds everything this one does.
    Superseded,
}

/// The guard that keeps a home from moving back within one placement: a
/// completed save replaces the record's root only if that root is another
/// placement's (or none), or was captured no later. `$epoch` and
/// `$captured` are the statement's placeholders for them.
fn not_older_within_the_placement(epoch: &str, captured: &str) -> String {
    format!(
        "(home_saved_epoch IS NULL OR home_saved_epoch <> {epoch} OR home_saved_at_ms IS NULL OR home_saved_at_ms <= {captured})"
    )
}

/// Records a save attempt's outcome.
pub async fn record_save(
    tx: &mut WriteTx,
    id: &str,
    epoch: i64,
    runner_id: &str,
    outcome: SaveOutcome,
) -> Result<SaveRecorded, sqlx::Error> {
    let now = now_ms();
    let completed = matches!(outcome, SaveOutcome::Completed { .. });
    if let SaveOutcome::Completed { captured_at_ms, .. } = &outcome {
        // The save's history row (for the observed figures), written
        // before the record moves on so it can name the previous capture;
        // guarded like the update below, in the same transaction.
        super::observed::insert_save(
            tx,
            id,
            epoch,
            runner_id,
            (*captured_at_ms).min(now),
            now,
            &not_older_within_the_placement("$4", "$1"),
        )
        .await?;
    }
    // Each statement ends with the placement guard: id, epoch, runner.
    let completed_sql;
    let query = match outcome {
        SaveOutcome::Completed {
            root,
            captured_at_ms,
        } => {
            completed_sql = format!(
                "UPDATE sandboxes SET home_root = $1, home_saved_at_ms = $2, save_attempt_at_ms = $3,
                 save_error = NULL, save_bytes_pending = 0, updated_at_ms = $3, home_saved_epoch = $5
                 WHERE {} AND id = $4 AND epoch = $5 AND runner_id = $6",
                not_older_within_the_placement("$5", "$2")
            );
            sqlx::query(&completed_sql)
                .bind(root)
                .bind(captured_at_ms.min(now))
                .bind(now)
        }
        SaveOutcome::Failed {
            error,
            bytes_pending,
        } => sqlx::query(
            "UPDATE sandboxes SET save_attempt_at_ms = $1, save_error = $2, save_bytes_pending = $3, updated_at_ms = $1
             WHERE id = $4 AND epoch = $5 AND runner_id = $6",
        )
        .bind(now)
        .bind(error)
        .bind(bytes_pending),
        SaveOutcome::Progress { bytes_pending } => sqlx::query(
            "UPDATE sandboxes SET save_attempt_at_ms = $1, save_bytes_pending = $2
             WHERE id = $3 AND epoch = $4 AND runner_id = $5",
        )
        .bind(now)
        .bind(bytes_pending),
        // Guarded by the root too: only the last completed save can be
        // found unchanged.
        SaveOutcome::Unchanged {
            root,
            captured_at_ms,
        } => sqlx::query(
            "UPDATE sandboxes SET home_unchanged_at_ms = $1, save_attempt_at_ms = $2,
             save_error = NULL, save_bytes_pending = 0
             WHERE home_root = $3 AND id = $4 AND epoch = $5 AND runner_id = $6",
        )
        .bind(captured_at_ms.min(now))
        .bind(now)
        .bind(root),
    };
    let updated = query
        .bind(id.to_owned())
        .bind(epoch)
        .bind(runner_id.to_owned())
        .execute(&mut *tx.tx)
        .await?;
    if updated.rows_affected() == 1 {
        tx.changed(id);
        return Ok(SaveRecorded::Recorded);
    }
    // Nothing written: the placement moved on, or (a completed save only)
    // the record holds a later capture of this placement.
    let ours =
        sqlx::query("SELECT 1 FROM sandboxes WHERE id = $1 AND epoch = $2 AND runner_id = $3")
            .bind(id.to_owned())
            .bind(epoch)
            .bind(runner_id.to_owned())
            .fetch_optional(&mut *tx.tx)
            .await?
            .is_some();
    Ok(if completed && ours {
        SaveRecorded::Superseded
    } else {
        SaveRecorded::PlacementMoved
    })
}

/// The runner holding the home was lost before a save under way (a stop's
/// securing) committed: the save status says so (`failing`, with why),
/// instead of the last completed one looking current. A completed save
/// clears it.
pub async fn record_lost_save(tx: &mut WriteTx, id: &str, error: &str) -> Result<(), sqlx::Error> {
    let now = now_ms();
    sqlx::query(
        "UPDATE sandboxes SET save_error = $1, save_attempt_at_ms = $2, save_bytes_pending = NULL WHERE id = $3",
    )
    .bind(error)
    .bind(now)
    .bind(id)
    .execute(&mut *tx.tx)
    .await?;
    Ok(())
}

/// The reasons a durable sandbox moving off a runner being emptied shows
/// (a drain for maintenance, a spot host's preemption): it runs again
/// elsewhere.
pub const MOVED_BY_DRAIN: &str = "runner_draining";
pub const MOVED_BY_PREEMPTION: &str = "preempted";

/// The reason of the event that says a stop's securing committed: the
/// home is in the store as the stop left it.
pub const SECURING_COMMITTED: &str = "securing_committed";

/// A stop's securing committed `root`: said in the sandbox's history, so
/// that the lease watcher knows the home is secured should the runner be
/// lost before it reports `stopped` ([`securing_committed`]).
pub async fn record_securing_committed(
    tx: &mut WriteTx,
    row: &SandboxRow,
    root: &str,
) -> Result<(), sqlx::Error> {
    let message = format!("the stop's securing committed the home to the store as {root}");
    note(
        tx,
        row,
        SECURING_COMMITTED,
        &message,
        row.runner_id.as_deref(),
    )
    .await
}

/// Whether the securing of the sandbox's placement at `epoch` committed.
pub async fn securing_committed(
    tx: &mut WriteTx,
    id: &str,
    epoch: i64,
) -> Result<bool, sqlx::Error> {
    let row = sqlx::query(
        "SELECT COUNT(*) AS n FROM (SELECT 1 FROM events WHERE sandbox_id = $1 AND epoch = $2 AND reason = $3 LIMIT 1) AS committed",
    )
    .bind(id)
    .bind(epoch)
    .bind(SECURING_COMMITTED)
    .fetch_one(&mut *tx.tx)
    .await?;
    Ok(row.try_get::<i64, _>("n")? > 0)
}

/// Whether the sandbox was ever placed on `runner_id` (its events name
/// every runner it ran on): what a runner's report of a copy of its home
/// must satisfy, so no runner can attach itself to another's sandbox.
pub async fn was_placed_on(
    tx: &mut WriteTx,
    id: &str,
    runner_id: &str,
) -> Result<bool, sqlx::Error> {
    use sqlx::Row;
    let row = sqlx::query(
        "SELECT COUNT(*) AS n FROM (SELECT 1 FROM events WHERE sandbox_id = $1 AND runner_id = $2 LIMIT 1) AS placed",
    )
    .bind(id)
    .bind(runner_id)
    .fetch_one(&mut *tx.tx)
    .await?;
    Ok(row.try_get::<i64, _>("n")? > 0)
}

/// A deleted sandbox's home was released from the store.
pub async fn forget_home(tx: &mut WriteTx, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE sandboxes SET home_root = NULL WHERE id = $1 AND state = 'deleted'")
        .bind(id)
        .execute(&mut *tx.tx)
        .await?;
    Ok(())
}

/// Removes deleted sandboxes (and, by cascade, their history) that ended
/// before `cutoff_ms`. A `deleted` row counts toward nothing
/// (`records::counts`), so no count changes.
pub async fn purge_deleted(tx: &mut WriteTx, cutoff_ms: i64) -> Result<(), sqlx::Error> {
    // Their commands' output goes with them: given back to each org.
    let given_back: Vec<(String, i64)> = sqlx::query_as(
        "SELECT c.org_id, CAST(SUM(c.stdout_bytes + c.stderr_bytes) AS BIGINT) FROM commands c
         JOIN sandboxes s ON s.id = c.sandbox_id
         WHERE s.state = 'deleted' AND s.ended_at_ms < $1 GROUP BY c.org_id",
    )
    .bind(cutoff_ms)
    .fetch_all(&mut *tx.tx)
    .await?;
    for (org_id, bytes) in given_back {
        if bytes != 0 {
            super::counts::add_output(tx, &org_id, -bytes).await?;
        }
    }
    sqlx::query("DELETE FROM sandboxes WHERE state = 'deleted' AND ended_at_ms < $1")
        .bind(cutoff_ms)
        .execute(&mut *tx.tx)
        .await?;
    Ok(())
}

/// The org's sandbox, unless it ended before `retained_since_ms`: the
/// hottest read of the API (`super::read_optional`).
pub async fn visible(
    db: &Db,
    org_id: &str,
    id: &str,
    retained_since_ms: i64,
) -> Result<Option<SandboxRow>, sqlx::Error> {
    use super::Param::{Int, Text};
    if let Some(reads) = &db.sandbox_reads
        && let Ok(row) = reads.read(id).await
    {
        // The same filter as the query's below.
        let Some(row) = row else { return Ok(None) };
        let sandbox = <SandboxRow as super::FromReadRow>::from_read_row(&row)?;
        let retained = sandbox
            .ended_at_ms
            .is_none_or(|ended| ended > retained_since_ms);
        return Ok((sandbox.org_id == org_id && retained).then_some(sandbox));
    }
    let sql = format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1 AND org_id = $2 AND (ended_at_ms IS NULL OR ended_at_ms > $3)"
    );
    super::read_optional(
        db,
        &sql,
        &SANDBOX_COLUMN_NAMES,
        &[Text(id), Text(org_id), Int(retained_since_ms)],
    )
    .await
}

/// Which of an org's sandboxes a list shows.
pub struct ListFilter {
    /// Any of these states (all when empty).
    pub states: Vec<SandboxState>,
    /// Every one of these labels.
    pub labels: Vec<(String, String)>,
    /// Ids after this one.
    pub cursor: String,
    pub limit: usize,
    pub retained_since_ms: i64,
}

/// One page of the org's sandboxes in id order, and the next page's cursor.
pub async fn list(
    pool: &AnyPool,
    org_id: &str,
    filter: &ListFilter,
) -> Result<(Vec<SandboxRow>, Option<String>), sqlx::Error> {
    // Built from fixed fragments; every value is a bound parameter.
    let mut conditions =
        String::from("org_id = $1 AND id > $2 AND (ended_at_ms IS NULL OR ended_at_ms > $3)");
    let mut params: Vec<String> = Vec::new();
    let mut next = 4;
    if !filter.states.is_empty() {
        let placeholders: Vec<String> = filter
            .states
            .iter()
            .map(|state| {
                params.push(state.as_str().to_owned());
                next += 1;
                format!("${}", next - 1)
            })
            .collect();
        conditions.push_str(&format!(" AND state IN ({})", placeholders.join(", ")));
    }
    for (key, value) in &filter.labels {
        conditions.push_str(&format!(
            " AND EXISTS (SELECT 1 FROM sandbox_labels l WHERE l.sandbox_id = s.id AND l.key = ${} AND l.value = ${})",
            next,
            next + 1
        ));
        params.push(key.clone());
        params.push(value.clone());
        next += 2;
    }
    // The page's rows by size first (`records::page_by_bytes`), then
    // those rows whole.
    let sizes_sql = format!(
        "SELECT id, CAST(LENGTH(env) + LENGTH(labels) AS BIGINT) FROM sandboxes s WHERE {conditions} ORDER BY id LIMIT {}",
        filter.limit + 1
    );
    let mut sizes_query = sqlx::query_as::<_, (String, i64)>(&sizes_sql)
        .bind(org_id)
        .bind(&filter.cursor)
        .bind(filter.retained_since_ms);
    for param in &params {
        sizes_query = sizes_query.bind(param);
    }
    let sizes = sizes_query.fetch_all(pool).await?;
    let (taken, next_cursor) = super::page_by_bytes(&sizes, filter.limit);
    let Some((last, _)) = taken.checked_sub(1).map(|i| &sizes[i]) else {
        return Ok((Vec::new(), None));
    };
    // Every row up to the page's last: one that came to match since the
    // sizes were read is answered too (a limit would push out a row
    // before the cursor, never to be listed).
    let sql = format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes s WHERE {conditions} AND id <= ${next} ORDER BY id"
    );
    let mut query = sqlx::query(&sql)
        .bind(org_id)
        .bind(&filter.cursor)
        .bind(filter.retained_since_ms);
    for param in &params {
        query = query.bind(param);
    }
    let rows = query.bind(last).fetch_all(pool).await?;
    let sandboxes = rows
        .iter()
        .map(SandboxRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((sandboxes, next_cursor))
}

/// The sandbox's history after event `after_seq` (0: all of it), oldest
/// first.
pub async fn events(
    pool: &AnyPool,
    id: &str,
    after_seq: i64,
    limit: usize,
) -> Result<Vec<api::sandboxes::Event>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT seq, at_ms, state, reason, message, epoch, runner_id FROM events WHERE sandbox_id = $1 AND seq > $2 ORDER BY seq LIMIT {limit}"
    ))
    .bind(id)
    .bind(after_seq)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(api::sandboxes::Event {
                seq: row.try_get::<i64, _>("seq")? as u64,
                at: rfc3339(row.try_get("at_ms")?),
                state: parse_column(row, "state")?,
                reason: row.try_get("reason")?,
                message: row.try_get("message")?,
                epoch: row.try_get::<i64, _>("epoch")? as u64,
                runner_id: row.try_get("runner_id")?,
            })
        })
        .collect()
}

/// How many sandboxes are in each state (for the metrics gauges).
pub async fn count_by_state(pool: &AnyPool) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT state, COUNT(*) FROM sandboxes GROUP BY state ORDER BY state")
        .fetch_all(pool)
        .await
}

/// [`SandboxRow::safe_until_ms`] in SQL.
pub const SAFE_UNTIL_SQL: &str = "CASE WHEN home_unchanged_at_ms > home_saved_at_ms THEN home_unchanged_at_ms ELSE home_saved_at_ms END";

/// For each running durable sandbox: until when its home is known saved
/// (or when it was created), and its save interval in seconds.
pub async fn save_lags(pool: &AnyPool) -> Result<Vec<(i64, i64)>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT COALESCE({SAFE_UNTIL_SQL}, created_at_ms), save_interval_s FROM sandboxes
         WHERE state = 'running' AND save_interval_s IS NOT NULL"
    ))
    .fetch_all(pool)
    .await
}

/// Sets when a sandbox's TTL expires (E2B's `set_timeout`: the sandbox
/// ends `timeout` seconds from now, however long it has lived), with an
/// event saying so.
pub async fn set_expires_at(
    tx: &mut WriteTx,
    row: &SandboxRow,
    expires_at_ms: i64,
    reason: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE sandboxes SET expires_at_ms = $1, updated_at_ms = $2 WHERE id = $3")
        .bind(expires_at_ms)
        .bind(now_ms())
        .bind(&row.id)
        .execute(&mut *tx.tx)
        .await?;
    let message = format!("expires at {}", super::rfc3339(expires_at_ms));
    note(tx, row, reason, &message, None).await
}
