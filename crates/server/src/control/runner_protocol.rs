//! The runner protocol's rules. Runners register, renew a lease by
//! heartbeat, read their assignments (level-triggered: the whole desired
//! state each time) and report what they observe. A report whose runner or
//! epoch is not the sandbox's current placement is `fenced` and changes
//! nothing.

use api::lifecycle::{Activity, CommandState, DesiredState, SandboxState, StorageClass};
use std::collections::BTreeMap;

use sqlx::Row;

use super::AppState;
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::limits;
use crate::records::commands::{Observed, Stream};
use crate::records::runners::{self, RunnerRow};
use crate::records::{
    self, SANDBOX_COLUMNS, SandboxRow, Transition, load_sandbox, not_found, set_sandbox_state,
};
use crate::records::{COMMAND_COLUMNS, CommandRow};
use api::ErrorCode;
use api::commands::OUTPUT_STREAM_BYTES_MAX;
use api::runners::{
    Assignments, CommandAssignment, CommandReport, HeartbeatRequest, HeartbeatResponse,
    RegisterRequest, RegisterResponse, SandboxAssignment, SandboxReport, SnapshotAssignment,
};

const CAPABILITIES_MAX: usize = 64;

pub fn fenced(message: impl Into<String>) -> ControlError {
    ControlError::new(ErrorCode::Fenced, message)
}

/// Who registers: a runner token enrolling a new runner, or a runner by
/// its own credential registering again (a restart, or after its lease
/// was lost).
pub enum Registrant {
    /// With what its token allows runners it enrols to declare (JSON of
    /// an `api::orgs::RunnerProfile`; `None`: anything).
    Enrolment {
        profile: Option<String>,
    },
    Runner(String),
}

/// Checks a profile an administrator gives a runner token: the same bounds
/// as a registration's own fields.
pub fn validate_profile(profile: &api::orgs::RunnerProfile) -> Result<(), ControlError> {
    let known_class = |c: &String| ["spot", "on_demand"].contains(&c.as_str());
    if let Some(classes) = &profile.placement_classes
        && (classes.len() > 2 || !classes.iter().all(known_class))
    {
        return Err(limits::invalid(
            "placement_classes",
            "spot, on_demand or both",
        ));
    }
    if let Some(capabilities) = &profile.capabilities {
        if capabilities.len() > CAPABILITIES_MAX {
            return Err(limits::invalid(
                "capabilities",
                format!("more than {CAPABILITIES_MAX}"),
            ));
        }
        for capability in capabilities {
            limits::name("capabilities", capability)?;
        }
    }
    if let Some(capacity) = &profile.capacity
        && !(capacity.cpus.is_finite() && capacity.cpus >= 0.0)
    {
        return Err(limits::invalid("capacity.cpus", "a number of CPUs"));
    }
    Ok(())
}

/// Refuses a registration that declares a placement class or a capacity
/// `profile` does not allow, naming the field and what is not allowed; and
/// keeps, of what it declares it can do, only the capabilities `profile`
/// allows (a host gains some as it changes, overlayfs loaded or a release
/// that adds one: refusing would take its runner and sandboxes away; it
/// is just not offered for them). The capabilities to record.
fn within_profile(
    profile: &api::orgs::RunnerProfile,
    request: &RegisterRequest,
) -> Result<Vec<String>, ControlError> {
    let refused = |field: &str, what: String| {
        limits::invalid(
            field,
            format!("{what} is not allowed by the token this runner was enrolled with"),
        )
    };
    if let Some(classes) = &profile.placement_classes
        && !classes.contains(&request.placement_class)
    {
        return Err(refused(
            "placement_class",
            format!("{:?}", request.placement_class),
        ));
    }
    let mut capabilities = request.capabilities.clone();
    if let Some(allowed) = &profile.capabilities {
        let (kept, dropped): (Vec<String>, Vec<String>) =
            capabilities.into_iter().partition(|c| allowed.contains(c));
        if !dropped.is_empty() {
            tracing::warn!(
                name = %request.name,
                dropped = %dropped.join(", "),
                "a runner declared capabilities its enrolment token does not allow: not offered"
            );
        }
        capabilities = kept;
    }
    if let Some(max) = &profile.capacity {
        let declared = &request.capacity;
        let over = [
            ("sandboxes", declared.sandboxes > max.sandboxes),
            ("memory_mib", declared.memory_mib > max.memory_mib),
            ("cpus", declared.cpus > max.cpus),
            ("pids", declared.pids > max.pids),
        ];
        if let Some((figure, _)) = over.iter().find(|(_, over)| *over) {
            return Err(refused(
                &format!("capacity.{figure}"),
                format!("a capacity above the token's {figure}"),
            ));
        }
    }
    Ok(capabilities)
}

/// The profile of `registrant` (see [`Registrant::Enrolment`]); a runner
/// registering again keeps the one it was enrolled with.
async fn profile_of(
    state: &AppState,
    registrant: &Registrant,
) -> Result<api::orgs::RunnerProfile, ControlError> {
    let stored = match registrant {
        Registrant::Enrolment { profile } => profile.clone(),
        Registrant::Runner(id) => runners::profile(&state.db.pool, id).await?,
    };
    // One that cannot be read refuses, never allows anything.
    stored.map_or(Ok(api::orgs::RunnerProfile::default()), |json| {
        serde_json::from_str(&json).map_err(|_| {
            ControlError::new(
                ErrorCode::Internal,
                "the profile of this runner's enrolment token cannot be read",
            )
        })
    })
}

/// Registers a runner with a fresh lease, and places what waited for
/// capacity. A runner token gets a new runner and its credential (shown
/// only in this answer); a runner's credential registers that runner
/// again, keeping its id and placements. `runner_id` in the request may
/// only name the credential's own runner: any other is 404, and so is
/// any with a runner token (no token takes over another runner's id).
pub async fn register(
    state: &AppState,
    registrant: &Registrant,
    request: &RegisterRequest,
) -> Result<RegisterResponse, ControlError> {
    let named_other = match (registrant, &request.runner_id) {
        (_, None) => false,
        (Registrant::Runner(own), Some(named)) => own != named,
        (Registrant::Enrolment { .. }, Some(_)) => true,
    };
    if named_other {
        return Err(no_such_runner());
    }
    limits::name("name", &request.name)?;
    if !["spot", "on_demand"].contains(&request.placement_class.as_str()) {
        return Err(limits::invalid("placement_class", "spot or on_demand"));
    }
    limits::labels(&request.labels)?;
    if request.capabilities.len() > CAPABILITIES_MAX {
        return Err(limits::invalid(
            "capabilities",
            format!("more than {CAPABILITIES_MAX}"),
        ));
    }
    for capability in &request.capabilities {
        limits::name("capabilities", capability)?;
    }
    let capacity = &request.capacity;
    if !(capacity.cpus.is_finite() && capacity.cpus >= 0.0) {
        return Err(limits::invalid("capacity.cpus", "a number of CPUs"));
    }
    check_data_path(request)?;
    let profile = profile_of(state, registrant).await?;
    let allowed = within_profile(&profile, request)?;
    let within;
    let request = if allowed == request.capabilities {
        request
    } else {
        within = RegisterRequest {
            capabilities: allowed,
            ..request.clone()
        };
        &within
    };
    let now = now_ms();
    let lease_ms = state.config.lease_ttl.as_millis() as i64;
    // Before the transaction: a write that gives the new runner anything
    // can only commit after it, so it is notified after this start.
    let start = state.db.hub.read_start();
    let mut tx = state.db.write().await?;
    let (runner_id, runner_token, credential_hash) = match registrant {
        Registrant::Runner(id) => {
            if !runners::register_again(&mut tx, id, request, now + lease_ms).await? {
                return Err(no_such_runner());
            }
            (id.clone(), None, None)
        }
        Registrant::Enrolment { profile } => {
            let id = records::new_id("rnr")?;
            let credential = crate::auth::new_token("runnercred")?;
            let hash = crate::auth::hash_token(&credential);
            let new = runners::NewRunner {
                id: &id,
                credential_hash: &hash,
                profile: profile.as_deref(),
            };
            runners::register_new(&mut tx, request, now + lease_ms, new).await?;
            (id, Some(credential), Some(hash))
        }
    };
    runners::set_data_path(
        &mut tx,
        &runner_id,
        request.data_url.as_deref(),
        request.data_key.as_deref(),
    )
    .await?;
    tx.commit().await?;
    if let Some(hash) = credential_hash {
        state
            .db
            .tokens
            .trust_new_runner_credential(hash, runner_id.clone());
        // A new runner's set is empty (no sandbox, command or kept copy
        // names its new id): its first long-poll needs no read, which a
        // fleet starting at once would otherwise make for every runner in
        // the same seconds as its first heartbeats.
        state.db.hub.remember(
            &format!("runner:{runner_id}"),
            empty_set_etag(),
            Vec::new(),
            start,
        );
    }
    tracing::info!(%runner_id, name = %request.name, "runner registered");
    // New capacity: place what has been waiting for it.
    crate::reconcile::schedule_pending(state).await?;
    Ok(RegisterResponse {
        runner_id,
        runner_token,
        lease_ttl_ms: lease_ms as u64,
        heartbeat_interval_ms: (lease_ms / 3) as u64,
        freeze_after_ms: crate::freeze_after(state.config.lease_ttl).as_millis() as u64,
        stop_grace_ms: state.config.stop_grace.as_millis() as u64,
    })
}

/// A data path is a URL servers can dial (`http://` or `https://`, no
/// credentials in it, no link-local or unspecified address:
/// `data_path::dialable`) and a key of the right length, both or neither.
fn check_data_path(request: &RegisterRequest) -> Result<(), ControlError> {
    match (&request.data_url, &request.data_key) {
        (None, None) => Ok(()),
        (Some(url), Some(key)) => {
            // Scheme, host and port only: servers append the data path's
            // own paths to it, so a path, query or fragment of the runner's
            // choosing would aim their requests elsewhere on that host.
            let parsed = reqwest::Url::parse(url).ok().filter(|u| {
                matches!(u.scheme(), "http" | "https")
                    && u.host().is_some()
                    && u.username().is_empty()
                    && u.password().is_none()
                    && u.path() == "/"
                    && u.query().is_none()
                    && u.fragment().is_none()
                    && !url.ends_with('/')
            });
            let Some(parsed) = parsed.filter(|_| url.len() <= 512) else {
                return Err(limits::invalid(
                    "data_url",
                    "an http(s) URL of at most 512 bytes naming only a host and port (no credentials, path, query or fragment)",
                ));
            };
            if let Some(why) = super::data_path::undialable_data_url(&parsed) {
                return Err(limits::invalid("data_url", why));
            }
            if api::data_path::parse_key(key).is_none()
                || key.bytes().any(|b| b.is_ascii_uppercase())
            {
                return Err(limits::invalid("data_key", "64 lowercase hex digits"));
            }
            Ok(())
        }
        _ => Err(limits::invalid(
            "data_url",
            "data_url and data_key come together",
        )),
    }
}

/// What a runner's credential gets for any other runner's id: as if it
/// did not exist.
pub fn no_such_runner() -> ControlError {
    ControlError::new(
        ErrorCode::NotFound,
        "no such runner for this credential (a runner speaks only for itself)",
    )
}

/// The runner, refused as fenced unless its lease is live.
pub async fn live_runner(tx: &mut WriteTx, runner_id: &str) -> Result<RunnerRow, ControlError> {
    let runner = runners::load(tx, runner_id)
        .await?
        .ok_or_else(|| not_found("runner"))?;
    if runner.state != "live" {
        return Err(fenced(
            "this runner's lease expired and its sandboxes were taken from it; register again",
        ));
    }
    Ok(runner)
}

/// Renews a live runner's lease.
pub async fn heartbeat(
    state: &AppState,
    request: &HeartbeatRequest,
) -> Result<HeartbeatResponse, ControlError> {
    let lease_ms = state.config.lease_ttl.as_millis() as i64;
    // Renewed only while still live: a lease the watcher has expired
    // stays expired (the runner must register again). Committed with the
    // other heartbeats arriving meanwhile; the runner is read only to say
    // why one is refused.
    let renewed = state
        .renewals
        .renew(&state.db, &request.runner_id, lease_ms)
        .await
        .map_err(|err| ControlError::from(&*err))?;
    if !renewed {
        let mut tx = state.db.write().await?;
        live_runner(&mut tx, &request.runner_id).await?;
        return Err(fenced("lease expired; register again"));
    }
    Ok(HeartbeatResponse {
        lease_expires_in_ms: lease_ms as u64,
    })
}

/// Everything placed on the runner. Queued commands of running sandboxes
/// are handed over here (`starting`, with the sandbox's epoch); they stay
/// in every answer until the runner reports them, so a lost answer loses
/// nothing.
pub async fn read_assignments(
    state: &AppState,
    runner_id: &str,
) -> Result<Assignments, ControlError> {
    let mut tx = state.db.write().await?;
    let runner = live_runner(&mut tx, runner_id).await?;
    let rows = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE runner_id = $1 AND state <> 'deleted' ORDER BY id"
    ))
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    // A runner with no sandbox has no command, snapshot or secret either:
    // its read is three queries, not seven (a fleet starting reads every
    // runner's set at once, most of them empty).
    let (sandboxes, commands) = if rows.is_empty() {
        (Vec::new(), Vec::new())
    } else {
        placed_on(&mut tx, &runner, &rows).await?
    };
    let kept = crate::control::kept::kept_assignments(state, &mut tx, runner_id).await?;
    tx.commit().await?;
    Ok(Assignments {
        etag: assignments_etag(&sandboxes, &commands, &kept),
        unchanged: false,
        sandboxes,
        commands,
        kept,
    })
}

/// A set's ETag: a hash of everything in it.
fn assignments_etag(
    sandboxes: &[SandboxAssignment],
    commands: &[CommandAssignment],
    kept: &[api::runners::KeptAssignment],
) -> String {
    let body = serde_json::to_vec(&(sandboxes, commands, kept)).unwrap_or_default();
    blake3::hash(&body).to_hex()[..32].to_owned()
}

/// The ETag of an empty set: what a runner just registered is assigned.
pub fn empty_set_etag() -> &'static str {
    static EMPTY: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| assignments_etag(&[], &[], &[]));
    &EMPTY
}

/// The sandboxes in `rows` (the runner's) as assignments, and the
/// commands to run in them, queued ones handed over first.
async fn placed_on(
    tx: &mut WriteTx,
    runner: &RunnerRow,
    rows: &[sqlx::any::AnyRow],
) -> Result<(Vec<SandboxAssignment>, Vec<CommandAssignment>), ControlError> {
    let runner_id = runner.id.as_str();
    records::commands::hand_over(tx, runner_id, runner.drain.is_some()).await?;
    let mut snapshots: BTreeMap<String, Vec<SnapshotAssignment>> = BTreeMap::new();
    let pending = sqlx::query(
        "SELECT id, sandbox_id, durability FROM snapshots WHERE durability IN ('pending', 'local')
         AND kept_copy_id IS NULL
         AND sandbox_id IN (SELECT id FROM sandboxes WHERE runner_id = $1) ORDER BY id",
    )
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    for row in &pending {
        snapshots
            .entry(row.try_get("sandbox_id")?)
            .or_default()
            .push(SnapshotAssignment {
                snapshot_id: row.try_get("id")?,
                durability: row.try_get("durability")?,
            });
    }
    let mut secrets = records::secrets::of_runner(tx, runner_id).await?;
    let sandboxes: Vec<SandboxAssignment> = rows
        .iter()
        .map(|row| {
            let s = SandboxRow::from_row(row)?;
            Ok(SandboxAssignment {
                sandbox_id: s.id.clone(),
                org_id: s.org_id.clone(),
                epoch: s.epoch as u64,
                desired: crate::control::drain::desired_on(&s, runner.drain.as_deref()),
                state: s.state,
                image: s.image.clone(),
                image_root: s.image_root.clone(),
                storage_class: s.storage_class,
                resources: s.resources(),
                network: s.network,
                env: records::json_map(&s.env),
                home_root: s.home.root.clone(),
                save_interval_s: s.home.save_interval_s.map(|i| i as u64),
                snapshots: snapshots.remove(&s.id).unwrap_or_default(),
                mounts: s.mounts(),
                secrets: secrets.remove(&s.id).unwrap_or_default(),
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    let commands = sqlx::query(&format!(
        "SELECT {COMMAND_COLUMNS} FROM commands WHERE state IN {}
         AND sandbox_id IN (SELECT id FROM sandboxes WHERE runner_id = $1) ORDER BY id",
        CommandState::sql_in(CommandState::on_runner)
    ))
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    let commands = commands
        .iter()
        .map(CommandRow::from_row)
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    // Most sets have no command ever signalled: no read of the signals.
    let mut signals = if commands.iter().any(|c| c.signal_seq > 0) {
        records::commands::signals_of_runner(tx, runner_id).await?
    } else {
        Default::default()
    };
    let commands: Vec<CommandAssignment> = commands
        .into_iter()
        .map(|c| CommandAssignment {
            signals: signals.remove(&c.id).unwrap_or_default(),
            argv: c.argv(),
            env: records::json_map(&c.env),
            epoch: c.epoch.unwrap_or(0) as u64,
            timeout: c.timeout_s.map(|t| t as u64),
            signal_seq: c.signal_seq.max(0) as u64,
            command_id: c.id,
            sandbox_id: c.sandbox_id,
            cwd: c.cwd,
            signal: c.signal_requested,
            state: c.state,
            stdin: c.stdin,
            tty: c.tty,
        })
        .collect();
    Ok((sandboxes, commands))
}

/// Checks the report is from the sandbox's current placement.
pub fn check_placement(row: &SandboxRow, runner_id: &str, epoch: u64) -> Result<(), ControlError> {
    if row.runner_id.as_deref() != Some(runner_id) || row.epoch as u64 != epoch {
        return Err(fenced(format!(
            "stale placement: the sandbox is at epoch {} on {}; this report is for epoch {epoch} on {runner_id}",
            row.epoch,
            row.runner_id.as_deref().unwrap_or("no runner")
        ))
        .with_details(serde_json::json!({ "current_epoch": row.epoch })));
    }
    Ok(())
}

/// Records what a runner observed of a sandbox at its placement: a move
/// the transition table allows, or nothing (fenced, invalid_state). A
/// report of the recorded state is no change, except a `starting` sandbox
/// reported waiting for the store (`SandboxState::runner_may_restate`):
/// its reason and message are recorded, with an event when the reason
/// changes.
pub async fn report_sandbox(
    state: &AppState,
    id: &str,
    report: &SandboxReport,
) -> Result<SandboxRow, ControlError> {
    if let Some(reason) = &report.reason {
        limits::name("reason", reason)?;
    }
    let message = report
        .message
        .as_deref()
        .map(|m| limits::truncated(m, limits::RUNNER_TEXT_BYTES_MAX));
    let mut tx = state.db.write().await?;
    let runner = live_runner(&mut tx, &report.runner_id).await?;
    let row = load_sandbox(&mut tx, id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    check_placement(&row, &report.runner_id, report.epoch)?;
    let drain_reason =
        crate::control::drain::drain_reason(&row, report.state, runner.drain.as_deref());
    // What a wake cost, counted once the move to `running` is committed.
    let mut woke = None;
    // Why it came to rest `stopped`, counted likewise.
    let mut sleep_reason: Option<String> = None;
    let restated = report
        .reason
        .as_deref()
        .filter(|reason| row.state == report.state && row.state.runner_may_restate(reason));
    if let Some(reason) = restated {
        // Still starting, now waiting (or waiting still, for another
        // cause): the reason and message change, the state does not.
        if !records::sandboxes::set_starting_wait(&mut tx, &row, reason, message.as_deref()).await?
        {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                "the sandbox changed meanwhile; read the assignments and report again",
            ));
        }
        // A wake that must wait for the store does not keep its commands
        // waiting with it: they end now, saying why (the sandbox goes on
        // trying, and its record says so).
        records::commands::end_queued(&mut tx, id, &format!("sandbox_{reason}")).await?;
    } else if row.state != report.state {
        if !row.state.runner_may_report(report.state, row.desired) {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                format!(
                    "a runner cannot move a sandbox from {} to {}",
                    row.state, report.state
                ),
            ));
        }
        // A deleted sandbox no longer holds anything on its runner.
        let runner_drain = runner.drain.clone();
        let runner = (report.state != SandboxState::Deleted).then_some(report.runner_id.as_str());
        // A stop for idleness says so in every state it goes through (the
        // runner only knows it was asked to stop).
        let asleep = report.reason.as_deref() == Some("stop_requested")
            && row.desired == DesiredState::Stopped
            && row.desired_reason.as_deref() == Some(super::idle::IDLE);
        let reason = match drain_reason {
            Some(drain) => Some(drain),
            None if asleep => Some(super::idle::IDLE),
            None => report.reason.as_deref(),
        };
        let to = Transition {
            state: report.state,
            reason,
            message: message.as_deref(),
        };
        if !set_sandbox_state(&mut tx, &row, to, runner, row.epoch).await? {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                "the sandbox changed meanwhile; read the assignments and report again",
            ));
        }
        if report.state == SandboxState::Deleted {
            tx.changed(&format!("runner:{}", report.runner_id));
        }
        if report.state == SandboxState::Running {
            woke = report.wake.clone();
        }
        // Wanted running once stopped: a durable home moved off a runner
        // being emptied (once secured), or any sandbox started again while
        // it stopped. Otherwise the last request (a start) would be left
        // undone, the sandbox resting `stopped` while wanted running.
        if report.state == SandboxState::Stopped && row.desired == DesiredState::Running {
            let durable = row.storage_class == StorageClass::Durable;
            let again = match (&runner_drain, report.reason.as_deref()) {
                (Some(drain), _) if durable => Some((
                    crate::control::drain::reason_of(drain),
                    "home secured; placing it on another runner",
                )),
                (_, Some("stop_requested")) if durable => {
                    Some(("start_requested", "home secured; started again"))
                }
                (_, Some("stop_requested")) => Some(("start_requested", "stopped; started again")),
                _ => None,
            };
            // Started again by a command's wake: its events say so.
            let again = again.map(|(reason, message)| match row.desired_reason.as_deref() {
                Some(super::idle::WOKEN_BY_COMMAND) if reason == "start_requested" => {
                    (super::idle::WOKEN_BY_COMMAND, message)
                }
                _ => (reason, message),
            });
            if let Some((reason, message)) = again {
                crate::control::placement::place_again(&mut tx, id, reason, message).await?;
            } else {
                // Resting `stopped` with nothing to start it again: what
                // waited for it to run will not.
                records::commands::end_queued(&mut tx, id, "sandbox_stopped").await?;
            }
        }
        if report.state == SandboxState::Stopped {
            sleep_reason = reason.map(str::to_owned);
            // A command that arrived while it stopped wakes it now.
            if row.desired != DesiredState::Running {
                super::idle::resume_after_stop(state, &mut tx, id).await?;
            }
        }
    }
    let record = load_sandbox(&mut tx, id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    tx.commit().await?;
    if let Some(wake) = woke {
        state
            .metrics
            .woke(wake.downloaded_bytes, wake.from_own_copy);
    }
    if let Some(reason) = sleep_reason {
        state.metrics.slept(&reason);
    }
    Ok(record)
}

/// The command and its sandbox, checked to be this runner's at `epoch`.
async fn runner_command(
    tx: &mut WriteTx,
    id: &str,
    runner_id: &str,
    epoch: u64,
) -> Result<CommandRow, ControlError> {
    live_runner(tx, runner_id).await?;
    let command = records::commands::load(tx, id)
        .await?
        .ok_or_else(|| not_found("command"))?;
    let sandbox = load_sandbox(tx, &command.sandbox_id)
        .await?
        .ok_or_else(|| not_found("sandbox"))?;
    check_placement(&sandbox, runner_id, epoch)?;
    if command.epoch != Some(epoch as i64) {
        return Err(fenced("the command was handed over under another epoch"));
    }
    Ok(command)
}

/// Records what a runner observed of a command it holds at its epoch. An
/// end may carry the command's whole output (one that ended before any of
/// it was uploaded): stored in the end's own commit, so a reader sees the
/// output and the end at once.
pub async fn report_command(
    state: &AppState,
    id: &str,
    report: &CommandReport,
) -> Result<CommandRow, ControlError> {
    if let Some(reason) = &report.reason {
        limits::name("reason", reason)?;
    }
    if let Some(signal) = &report.signal
        && !api::commands::SIGNALS.contains(&signal.as_str())
    {
        return Err(limits::invalid(
            "signal",
            format!("one of {}", api::commands::SIGNALS.join(", ")),
        ));
    }
    if let Some(output) = &report.output {
        if !report.state.is_end() {
            return Err(limits::invalid("output", "output goes with an end only"));
        }
        if output.stdout.len().max(output.stderr.len()) > api::runners::REPORTED_OUTPUT_BYTES_MAX {
            return Err(limits::invalid(
                "output",
                format!(
                    "at most {} bytes per stream (upload more by offset)",
                    api::runners::REPORTED_OUTPUT_BYTES_MAX
                ),
            ));
        }
    }
    let mut tx = state.db.write().await?;
    let command = runner_command(&mut tx, id, &report.runner_id, report.epoch).await?;
    let to = report.state;
    let mut wake_latency = None;
    if command.state != to {
        if !command.state.runner_may_report(to) {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                format!("a command cannot go from {} to {to}", command.state),
            ));
        }
        if to == CommandState::Exited && report.exit_code.is_none() {
            return Err(limits::invalid("exit_code", "an exited command has one"));
        }
        if let Some(pid) = report.pid
            && pid <= 0
        {
            return Err(limits::invalid("pid", "a pid is positive"));
        }
        // Output carried by the end: stored before the end (the same
        // commit), skipping what an earlier upload already stored.
        if let Some(output) = &report.output {
            for (stream, bytes) in [
                (Stream::Stdout, &output.stdout),
                (Stream::Stderr, &output.stderr),
            ] {
                let stored = stream.length_of(&command) as usize;
                if stored < bytes.len() {
                    store_output(state, &mut tx, &command, stream, &bytes[stored..]).await?;
                }
            }
        }
        // An end straight from `starting` with a pid: it started and ended
        // before its `running` report went out; both are recorded here.
        let ran = to.is_end() && command.state == CommandState::Starting && report.pid.is_some();
        let observed = Observed {
            state: to,
            reason: report.reason.as_deref(),
            exit_code: report.exit_code.map(i64::from),
            signal: report.signal.as_deref(),
            pid: if ran { report.pid } else { None },
        };
        let updated = records::commands::set_observed(&mut tx, &command, observed).await?;
        if !updated {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                "the command changed meanwhile",
            ));
        }
        if to.is_end() {
            // Idleness counts from a command's end.
            let now = now_ms();
            records::activity::touch_row(&mut tx, &command.sandbox_id, Activity::CommandEnded, now)
                .await?;
        }
        if (to == CommandState::Running || ran) && command.waited_for_wake {
            wake_latency = Some(now_ms() - command.created_at_ms);
        }
    }
    if to == CommandState::Running
        && let Some(pid) = report.pid
    {
        if pid <= 0 {
            return Err(limits::invalid("pid", "a pid is positive"));
        }
        records::commands::set_pid(&mut tx, id, pid).await?;
    }
    let command = records::commands::load(&mut tx, id)
        .await?
        .ok_or_else(|| not_found("command"))?;
    tx.commit().await?;
    if let Some(ms) = wake_latency {
        state.metrics.wake_latency(ms.max(0) as f64 / 1000.0);
    }
    Ok(command)
}

/// Appends output at `offset` (the stream's length as the runner knows it).
/// A retry of bytes already stored is accepted and skipped; a gap is 409.
/// Output is complete once the command has ended (readers are told so),
/// so a runner appends everything before it reports the end; bytes for an
/// ended command are refused (409) unless they are a retry. Answers the
/// stream's new length.
pub async fn append_output(
    state: &AppState,
    id: &str,
    stream: Stream,
    at: &OutputAt,
    body: &[u8],
) -> Result<u64, ControlError> {
    let mut tx = state.db.write().await?;
    let command = runner_command(&mut tx, id, &at.runner_id, at.epoch).await?;
    let length = stream.length_of(&command) as u64;
    if at.offset > length {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "offset {} leaves a gap: the stream has {length} bytes",
                at.offset
            ),
        )
        .with_details(serde_json::json!({ "length": length })));
    }
    let skip = (length - at.offset) as usize;
    if skip < body.len() && command.ended() {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "the command has ended ({}); its output is complete",
                command.state
            ),
        ));
    }
    let fresh = &body[skip.min(body.len())..];
    match store_output(state, &mut tx, &command, stream, fresh).await? {
        None => {
            tx.commit().await?;
            Ok(length.max(at.offset + body.len() as u64))
        }
        // What did not fit is refused, so the runner stops sending this
        // stream (a retry of stored bytes is still answered as before).
        Some(cut) => {
            tx.commit().await?;
            Err(cut.refusal(stream))
        }
    }
}

/// The bound that cut a command's output short.
enum OutputCut {
    /// The stream's own: its record keeps the first
    /// `OUTPUT_STREAM_BYTES_MAX` bytes.
    Stream,
    /// The org's: its commands' records keep `limit` bytes in all, and
    /// held `current` before this.
    Org { limit: u64, current: u64 },
}

impl OutputCut {
    fn refusal(&self, stream: Stream) -> ControlError {
        match self {
            OutputCut::Stream => ControlError::new(
                ErrorCode::PayloadTooLarge,
                format!(
                    "the record keeps the first {OUTPUT_STREAM_BYTES_MAX} bytes of {}; the rest is not stored",
                    stream.as_str()
                ),
            )
            .with_details(serde_json::json!({
                "stream": stream.as_str(),
                "limit_bytes": OUTPUT_STREAM_BYTES_MAX,
            })),
            OutputCut::Org { limit, current } => ControlError::new(
                ErrorCode::QuotaExceeded,
                format!(
                    "quota output_bytes reached ({current} of {limit}): the org's commands keep no more output; the rest of {} is not stored",
                    stream.as_str()
                ),
            )
            .with_details(serde_json::json!({
                "stream": stream.as_str(),
                "quota": { "metric": "output_bytes", "limit": limit, "current": current },
            })),
        }
    }
}

/// Stores what of `fresh` (the bytes of `stream` past what the record
/// holds) the bounds leave room for: the stream's first
/// `OUTPUT_STREAM_BYTES_MAX`, and the org's output within
/// `Config::org_output_bytes_max` (appends at once may pass it by a chunk
/// each). What does not fit is not stored, and the record says so
/// (`stdout_truncated`, `stderr_truncated`); the answer names the bound.
async fn store_output(
    state: &AppState,
    tx: &mut WriteTx,
    command: &CommandRow,
    stream: Stream,
    fresh: &[u8],
) -> Result<Option<OutputCut>, ControlError> {
    if fresh.is_empty() {
        return Ok(None);
    }
    let length = stream.length_of(command) as u64;
    let stream_room = OUTPUT_STREAM_BYTES_MAX.saturating_sub(length);
    let limit = state.config.org_output_bytes_max;
    let current = records::counts::output_bytes(tx, &command.org_id)
        .await?
        .max(0) as u64;
    let org_room = limit.saturating_sub(current);
    let room = stream_room.min(org_room);
    let kept = &fresh[..fresh.len().min(usize::try_from(room).unwrap_or(usize::MAX))];
    if !kept.is_empty() {
        records::commands::append_output(tx, command, stream, length as i64, kept).await?;
    }
    if kept.len() == fresh.len() {
        return Ok(None);
    }
    if !stream.truncated_in(command) {
        records::commands::mark_truncated(tx, &command.id, stream).await?;
    }
    Ok(Some(if stream_room <= org_room {
        OutputCut::Stream
    } else {
        OutputCut::Org { limit, current }
    }))
}

/// Where a runner's output append lands: its placement and the offset.
pub struct OutputAt {
    pub runner_id: String,
    pub epoch: u64,
    pub offset: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Audit finding: a runner could register a data URL at the cloud
    /// metadata address, and the server's relay would fetch it for an org.
    #[test]
    fn a_data_url_is_refused_at_a_link_local_or_unspecified_address() {
        let check = |url: &str, accepted: bool| {
            let request = RegisterRequest {
                runner_id: None,
                name: "r".to_owned(),
                placement_class: "on_demand".to_owned(),
                labels: Default::default(),
                capabilities: Vec::new(),
                capacity: api::runners::Capacity {
                    sandboxes: 1,
                    memory_mib: 1024,
                    cpus: 1.0,
                    pids: 1024,
                },
                data_url: Some(url.to_owned()),
                data_key: Some("ab".repeat(32)),
            };
            let checked = check_data_path(&request);
            assert_eq!(checked.is_ok(), accepted, "{url}: {checked:?}");
            if let Err(error) = checked {
                assert_eq!(error.code, ErrorCode::InvalidRequest, "{url}");
                assert_eq!(error.details["field"], "data_url", "{url}");
            }
        };
        for dialable in [
            "http://127.0.0.1:7071",
            "http://10.0.0.5:7071",
            "https://runner-1.internal:7071",
            "http://[::1]:7071",
            "http://[fd00::5]:7071",
            "http://169.253.255.255",
        ] {
            check(dialable, true);
        }
        for undialable in [
            "http://169.254.169.254",
            "http://169.254.0.1:7071",
            // The same address in the forms a URL parser normalises.
            "http://2852039166",
            "http://0xa9.0xfe.0xa9.0xfe",
            "http://[::ffff:169.254.169.254]",
            "http://[fe80::1]:7071",
            "http://[febf::1]:7071",
            "http://0.0.0.0:7071",
            "http://[::]:7071",
            "ftp://127.0.0.1",
            "http://user:pw@127.0.0.1",
            // Audit finding: the server appends the data path's paths to
            // the URL, so one with a path, query or fragment of the
            // runner's choosing aimed the server's requests (and what it
            // streams back to an org) at any path of a host it reaches.
            "http://127.0.0.1:8500/v1/kv/?recurse=#",
            "http://127.0.0.1:8500/v1/kv",
            "http://127.0.0.1:8500?x=",
            "http://127.0.0.1:8500#x",
            "http://127.0.0.1:8500/",
        ] {
            check(undialable, false);
        }
    }
}
