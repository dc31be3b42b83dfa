//! `/v1/sandboxes`: create (admission, quotas, idempotency, placement),
//! read (long-pollable), list, stop, start, delete, events.

use crate::control::placement::place_or_wait;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sqlx::Row;

use super::{AppState, Caller, Json};
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::idempotency;
use crate::limits;
use crate::records::{
    self, SANDBOX_COLUMNS, SandboxRow, Transition, held_states_sql, load_sandbox, not_found,
    running_quota_states_sql, set_sandbox_state,
};
use crate::scheduler::{self, Needs, Placed};
use api::ErrorCode;
use api::lifecycle::{DesiredState, Network, Placement, SandboxState, StorageClass};
use api::sandboxes::{CreateSandboxRequest, Event, EventList, Sandbox, SandboxList};

/// Defaults written into the record, so it shows the limits enforced.
const DEFAULT_MEMORY_MIB: u64 = 512;
const DEFAULT_CPUS: f64 = 1.0;
const DEFAULT_PIDS: u64 = 1024;
pub const LONG_POLL_SECONDS_MAX: u64 = 25;

fn unsupported(missing: Vec<String>, message: impl Into<String>) -> ControlError {
    ControlError::new(ErrorCode::UnsupportedCapability, message)
        .with_details(serde_json::json!({ "missing": missing }))
}

/// The create request with defaults applied and every bound checked.
fn validate(request: &mut CreateSandboxRequest) -> Result<(), ControlError> {
    limits::name("image", &request.image)?;
    limits::env("env", &request.env)?;
    limits::labels(&request.labels)?;
    let resources = &mut request.resources;
    let memory = *resources.memory_mib.get_or_insert(DEFAULT_MEMORY_MIB);
    let cpus = *resources.cpus.get_or_insert(DEFAULT_CPUS);
    let pids = *resources.pids.get_or_insert(DEFAULT_PIDS);
    if !(1..=1 << 30).contains(&memory) {
        return Err(limits::invalid("resources.memory_mib", "must be 1 or more"));
    }
    if !(cpus.is_finite() && (0.001..=4096.0).contains(&cpus)) {
        return Err(limits::invalid(
            "resources.cpus",
            "must be between 0.001 and 4096",
        ));
    }
    if !(1..=1 << 22).contains(&pids) {
        return Err(limits::invalid("resources.pids", "must be 1 or more"));
    }
    if let Some(ttl) = request.ttl
        && (ttl == 0 || ttl > limits::TTL_SECONDS_MAX)
    {
        return Err(limits::invalid(
            "ttl",
            format!("seconds, between 1 and {}", limits::TTL_SECONDS_MAX),
        ));
    }
    for mount in &request.mounts {
        limits::absolute_path("mounts.target", &mount.target)?;
    }
    Ok(())
}

/// A durable sandbox's save interval: the request's, within the
/// deployment's bounds, or the deployment's default. Others have none.
fn save_interval(
    state: &AppState,
    request: &CreateSandboxRequest,
) -> Result<Option<i64>, ControlError> {
    let config = &state.config;
    if request.storage_class != StorageClass::Durable.as_str() {
        if request.save_interval_s.is_some() {
            return Err(limits::invalid(
                "save_interval_s",
                "only durable sandboxes are saved on a schedule",
            ));
        }
        return Ok(None);
    }
    let (min, max) = (
        config.save_interval_min.as_secs(),
        config.save_interval_max.as_secs(),
    );
    let interval = request
        .save_interval_s
        .unwrap_or_else(|| config.save_interval.as_secs());
    if !(min..=max).contains(&interval) {
        return Err(limits::invalid(
            "save_interval_s",
            format!("seconds, between {min} and {max} in this deployment"),
        ));
    }
    Ok(Some(interval as i64))
}

/// The request's storage class, network and placement, or what no runner
/// of any deployment offers (refused as unsupported, naming it).
fn classes(
    request: &CreateSandboxRequest,
) -> Result<(StorageClass, Network, Placement), ControlError> {
    let storage_class = request.storage_class.parse().map_err(|_| {
        unsupported(
            vec![format!("storage_class:{}", request.storage_class)],
            format!("unknown storage class {:?}", request.storage_class),
        )
    })?;
    let network = request.network.parse().map_err(|_| {
        let missing = format!("network:{}", request.network);
        unsupported(
            vec![missing.clone()],
            format!("no registered runner offers {missing}"),
        )
    })?;
    let placement = request.placement.parse().map_err(|_| {
        unsupported(
            vec![format!("placement:{}", request.placement)],
            format!("unknown placement {:?}", request.placement),
        )
    })?;
    Ok((storage_class, network, placement))
}

/// Fail-closed admission: everything the deployment or its runners cannot
/// enforce exactly is refused, naming what is missing.
async fn admit(
    state: &AppState,
    tx: &mut WriteTx,
    sandbox: &mut SandboxRow,
    request: &CreateSandboxRequest,
) -> Result<(), ControlError> {
    if sandbox.image != "default" {
        let root = crate::http::images::root_of(tx, &sandbox.org_id, &sandbox.image).await?;
        match root {
            Some(root) if state.store.is_some() => sandbox.image_root = Some(root),
            _ => {
                return Err(unsupported(
                    vec![format!("image:{}", sandbox.image)],
                    format!(
                        "no image {:?} in this org (import one with `roost image import`)",
                        sandbox.image
                    ),
                ));
            }
        }
    }
    if sandbox.storage_class == StorageClass::Durable && state.config.store_url.is_none() {
        return Err(unsupported(
            vec!["storage_class:durable".to_owned()],
            "durable storage needs a home store, and this deployment has none (--store)",
        ));
    }
    // No mount transport or secret store is configured in this deployment.
    if let Some(mount) = request.mounts.first() {
        return Err(unsupported(
            vec![format!("mount:{}", mount.source)],
            "no shared filesystem is configured for mounts",
        ));
    }
    if let Some(secret) = request.secrets.first() {
        return Err(unsupported(
            vec![format!("secret:{}", secret.path)],
            "no secret store is configured",
        ));
    }
    let needs = Needs::of(sandbox);
    let runners = scheduler::all_runners(tx).await?;
    let best = runners
        .iter()
        .map(|r| needs.missing_on(r))
        .min_by_key(Vec::len);
    match best {
        None => Err(unsupported(
            vec!["runner".to_owned()],
            "no runner is registered, so nothing would run this sandbox",
        )),
        Some(missing) if !missing.is_empty() => Err(unsupported(
            missing.clone(),
            format!("no registered runner offers {}", missing.join(", ")),
        )),
        Some(_) => Ok(()),
    }
}

fn quota_exceeded(metric: &str, limit: i64, current: i64, retry_after_s: u64) -> ControlError {
    ControlError::new(
        ErrorCode::QuotaExceeded,
        format!("quota {metric} reached ({current} of {limit})"),
    )
    .with_details(serde_json::json!({
        "quota": { "metric": metric, "limit": limit, "current": current }
    }))
    .with_retry_after(retry_after_s)
}

/// Checks the org's quotas and the fleet ceiling for one more running
/// sandbox (and one more held one if `new`). Where any limit applies, it
/// first takes the admission lock (one row, updated): creates and starts
/// on every server then count one at a time, so no limit can be raced
/// past. With no limit set, nothing is locked or counted.
async fn check_quotas(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    new: bool,
) -> Result<(), ControlError> {
    let org = sqlx::query("SELECT max_running, max_total FROM orgs WHERE id = $1")
        .bind(org_id)
        .fetch_one(&mut *tx.tx)
        .await?;
    let max_running: Option<i64> = org.try_get("max_running")?;
    let max_total: Option<i64> = org.try_get("max_total")?;
    if max_running.is_none() && max_total.is_none() && state.config.fleet_max_running.is_none() {
        // Nothing to count against: no lock, no counting.
        return Ok(());
    }
    sqlx::query("UPDATE admission SET creates = creates + 1 WHERE id = 1")
        .execute(&mut *tx.tx)
        .await?;
    let (running_states, held_states) = (running_quota_states_sql(), held_states_sql());
    let counts = sqlx::query(&format!(
        "SELECT
            (SELECT COUNT(*) FROM sandboxes WHERE org_id = $1 AND desired = 'running' AND state IN {running_states}) AS running,
            (SELECT COUNT(*) FROM sandboxes WHERE org_id = $1 AND desired <> 'deleted' AND state IN {held_states}) AS total,
            (SELECT COUNT(*) FROM sandboxes WHERE desired = 'running' AND state IN {running_states}) AS fleet"
    ))
    .bind(org_id)
    .fetch_one(&mut *tx.tx)
    .await?;
    let running: i64 = counts.try_get("running")?;
    let total: i64 = counts.try_get("total")?;
    let fleet: i64 = counts.try_get("fleet")?;
    if let Some(limit) = max_total.filter(|&limit| new && total >= limit) {
        state.metrics.quota_rejected("sandboxes.total");
        return Err(quota_exceeded("sandboxes.total", limit, total, 60));
    }
    if let Some(limit) = max_running.filter(|&limit| running >= limit) {
        state.metrics.quota_rejected("sandboxes.running");
        return Err(quota_exceeded("sandboxes.running", limit, running, 30));
    }
    if let Some(limit) = state.config.fleet_max_running {
        let limit = limit as i64;
        if fleet >= limit {
            state.metrics.quota_rejected("fleet.sandboxes.running");
            return Err(quota_exceeded("fleet.sandboxes.running", limit, fleet, 30));
        }
    }
    Ok(())
}

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", params(("Idempotency-Key" = Option<String>, Header, description = "replays the original answer for a retried request")), request_body = CreateSandboxRequest, responses((status = 201, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(mut request): Json<CreateSandboxRequest>,
) -> Result<Response, ControlError> {
    let org_id = caller.org()?;
    let key = idempotency::Key::from_request(&headers, &org_id, "sandboxes", "", &request)?;
    if let Some(key) = &key
        && let Some(replayed) = idempotency::replay(&state.db, key).await?
    {
        return Ok(replayed);
    }
    validate(&mut request)?;
    let (storage_class, network, placement) = classes(&request)?;
    let now = now_ms();
    let id = records::new_id("sbx")?;
    let env = serde_json::to_string(&request.env).unwrap_or_default();
    let labels = serde_json::to_string(&request.labels).unwrap_or_default();
    let resources = &request.resources;
    let mut row = SandboxRow {
        id: id.clone(),
        org_id: org_id.clone(),
        image: request.image.clone(),
        image_root: None,
        storage_class,
        memory_mib: resources.memory_mib.map(|v| v as i64),
        millicpus: resources.cpus.map(|v| (v * 1000.0).round() as i64),
        pids: resources.pids.map(|v| v as i64),
        network,
        placement,
        env,
        labels,
        state: SandboxState::Pending,
        state_reason: Some("admitted".to_owned()),
        desired: DesiredState::Running,
        runner_id: None,
        last_runner_id: None,
        epoch: 0,
        quarantined: false,
        created_at_ms: now,
        updated_at_ms: now,
        expires_at_ms: request.ttl.map(|ttl| now + ttl as i64 * 1000),
        ended_at_ms: None,
        home: records::HomeColumns::default(),
    };

    row.home.save_interval_s = save_interval(&state, &request)?;
    let mut tx = state.db.write().await?;
    if let Some(snapshot_id) = &request.from_snapshot {
        let root = crate::http::snapshots::replicated_root(&mut tx, &org_id, snapshot_id).await?;
        row.home.root = Some(root);
        row.home.from_snapshot = Some(snapshot_id.clone());
    }
    admit(&state, &mut tx, &mut row, &request).await?;
    check_quotas(&state, &mut tx, &org_id, true).await?;
    insert_sandbox(&mut tx, &row, &request).await?;
    let placed = scheduler::place(&mut tx, &row).await?;
    if let Placed::Waiting(reason) = placed {
        sqlx::query("UPDATE sandboxes SET state_reason = $1 WHERE id = $2")
            .bind(reason)
            .bind(&id)
            .execute(&mut *tx.tx)
            .await?;
    }
    if let Some(root) = &row.home.root {
        // The child's home starts as the snapshot: pinned under the
        // child's own name, so deleting the snapshot cannot take it. (The
        // snapshot's own pin was checked complete when it was replicated.)
        let digest: store::Digest = root
            .parse()
            .map_err(|_| ControlError::new(ErrorCode::Internal, "internal error"))?;
        let (home, _) = crate::control::home_store::home_names(&id)?;
        let org = crate::control::home_store::store_org(&org_id)?;
        let store = crate::control::home_store::store_of(&state)?;
        crate::control::home_store::blocking(move || store.write_home(&org, &home, &digest))
            .await?
            .map_err(crate::control::home_store::store_error)?;
    }
    let record = reload(&mut tx, &id).await?.to_api();
    if let Some(key) = &key
        && !idempotency::record(&mut tx, key, StatusCode::CREATED, &record, &id).await?
    {
        drop(tx);
        return idempotency::replay(&state.db, key)
            .await?
            .ok_or_else(|| ControlError::new(ErrorCode::Internal, "idempotency key vanished"));
    }
    tx.commit().await?;
    state.config.failpoint.hit("after_commit:create_sandbox");
    tracing::info!(sandbox_id = %id, %org_id, state = %record.state, "sandbox created");
    Ok((StatusCode::CREATED, axum::Json(record)).into_response())
}

async fn insert_sandbox(
    tx: &mut WriteTx,
    row: &SandboxRow,
    request: &CreateSandboxRequest,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO sandboxes ({SANDBOX_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30)"
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
    .bind(&row.state_reason)
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
    .execute(&mut *tx.tx)
    .await?;
    for (key, value) in &request.labels {
        sqlx::query("INSERT INTO sandbox_labels (sandbox_id, key, value) VALUES ($1, $2, $3)")
            .bind(&row.id)
            .bind(key)
            .bind(value)
            .execute(&mut *tx.tx)
            .await?;
    }
    sqlx::query(
        "INSERT INTO events (sandbox_id, seq, at_ms, state, reason, message, epoch, runner_id) VALUES ($1, 1, $2, 'pending', 'admitted', NULL, 0, NULL)",
    )
    .bind(&row.id)
    .bind(row.created_at_ms)
    .execute(&mut *tx.tx)
    .await?;
    Ok(())
}

/// The sandbox as its org sees it: another org's, and one past its
/// retention window, do not exist.
pub async fn visible_sandbox(
    state: &AppState,
    org_id: &str,
    id: &str,
) -> Result<SandboxRow, ControlError> {
    let row = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1 AND org_id = $2 AND (ended_at_ms IS NULL OR ended_at_ms > $3)"
    ))
    .bind(id)
    .bind(org_id)
    .bind(now_ms() - state.config.retention.as_millis() as i64)
    .fetch_optional(&state.db.pool)
    .await?;
    match row {
        Some(row) => Ok(SandboxRow::from_row(&row)?),
        None => Err(not_found("sandbox")),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    wait_for: Option<String>,
    timeout: Option<u64>,
}

pub fn wait_timeout(timeout: Option<u64>) -> Result<Duration, ControlError> {
    match timeout {
        None => Ok(Duration::from_secs(LONG_POLL_SECONDS_MAX)),
        Some(t) if t <= LONG_POLL_SECONDS_MAX => Ok(Duration::from_secs(t)),
        Some(_) => Err(limits::invalid(
            "timeout",
            format!("at most {LONG_POLL_SECONDS_MAX} seconds"),
        )),
    }
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id"), ("wait_for" = Option<String>, Query, description = "long-poll until this state (or an end state)"), ("timeout" = Option<u64>, Query, description = "seconds, at most 25")), responses((status = 200, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<WaitQuery>,
) -> Result<axum::Json<Sandbox>, ControlError> {
    let org_id = caller.org()?;
    let Some(target) = query.wait_for else {
        // Boxed, like every read here: see `hub::wait_until`.
        let row = Box::pin(visible_sandbox(&state, &org_id, &id)).await?;
        return Ok(axum::Json(row.to_api()));
    };
    let target: SandboxState = target
        .parse()
        .map_err(|_| limits::invalid("wait_for", format!("unknown state {target:?}")))?;
    let timeout = wait_timeout(query.timeout)?;
    let watch = state.db.hub.watch(&id);
    let row = crate::hub::wait_until(
        &watch,
        timeout,
        || visible_sandbox(&state, &org_id, &id),
        |row| row.state.settles_wait_for(target, row.desired),
    )
    .await?;
    Ok(axum::Json(row.to_api()))
}

#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", params(("state" = Option<String>, Query, description = "repeatable"), ("label" = Option<String>, Query, description = "KEY=VALUE, repeatable"), ("limit" = Option<u32>, Query), ("cursor" = Option<String>, Query)), responses((status = 200, body = SandboxList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<axum::Json<SandboxList>, ControlError> {
    let org_id = caller.org()?;
    let mut states: Vec<String> = Vec::new();
    let mut labels: Vec<(String, String)> = Vec::new();
    let mut limit = limits::LIST_LIMIT_DEFAULT;
    let mut cursor = String::new();
    for (name, value) in query {
        match name.as_str() {
            "state" => {
                if value.parse::<SandboxState>().is_err() {
                    return Err(limits::invalid("state", format!("unknown state {value:?}")));
                }
                states.push(value);
            }
            "label" => {
                let (k, v) = value
                    .split_once('=')
                    .ok_or_else(|| limits::invalid("label", "use label=KEY=VALUE"))?;
                limits::label_key(k)?;
                labels.push((k.to_owned(), v.to_owned()));
            }
            "limit" => limit = limits::list_limit(&value)?,
            "cursor" => cursor = value,
            other => return Err(limits::invalid(other, "unknown query parameter")),
        }
    }
    // Built from fixed fragments; every value is a bound parameter.
    let mut sql = format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes s WHERE org_id = $1 AND id > $2 AND (ended_at_ms IS NULL OR ended_at_ms > $3)"
    );
    let mut params: Vec<String> = Vec::new();
    let mut next = 4;
    if !states.is_empty() {
        let placeholders: Vec<String> = states
            .iter()
            .map(|s| {
                params.push(s.clone());
                next += 1;
                format!("${}", next - 1)
            })
            .collect();
        sql.push_str(&format!(" AND state IN ({})", placeholders.join(", ")));
    }
    for (k, v) in &labels {
        sql.push_str(&format!(
            " AND EXISTS (SELECT 1 FROM sandbox_labels l WHERE l.sandbox_id = s.id AND l.key = ${} AND l.value = ${})",
            next,
            next + 1
        ));
        params.push(k.clone());
        params.push(v.clone());
        next += 2;
    }
    sql.push_str(&format!(" ORDER BY id LIMIT {}", limit + 1));
    let mut query = sqlx::query(&sql)
        .bind(&org_id)
        .bind(&cursor)
        .bind(now_ms() - state.config.retention.as_millis() as i64);
    for p in &params {
        query = query.bind(p);
    }
    let rows = query.fetch_all(&state.db.pool).await?;
    let sandboxes = rows
        .iter()
        .map(SandboxRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    let (sandboxes, next_cursor) = records::page(sandboxes, limit, |s| &s.id);
    Ok(axum::Json(SandboxList {
        sandboxes: sandboxes.iter().map(SandboxRow::to_api).collect(),
        next_cursor,
    }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/events", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), responses((status = 200, body = EventList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn events(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<EventList>, ControlError> {
    let org_id = caller.org()?;
    visible_sandbox(&state, &org_id, &id).await?;
    let rows = sqlx::query(
        "SELECT seq, at_ms, state, reason, message, epoch, runner_id FROM events WHERE sandbox_id = $1 ORDER BY seq",
    )
    .bind(&id)
    .fetch_all(&state.db.pool)
    .await?;
    let events = rows
        .iter()
        .map(|row| {
            Ok(Event {
                seq: row.try_get::<i64, _>("seq")? as u64,
                at: records::rfc3339(row.try_get("at_ms")?),
                state: records::parse_column(row, "state")?,
                reason: row.try_get("reason")?,
                message: row.try_get("message")?,
                epoch: row.try_get::<i64, _>("epoch")? as u64,
                runner_id: row.try_get("runner_id")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok(axum::Json(EventList { events }))
}

/// The sandbox as this transaction now sees it (after its own writes).
async fn reload(tx: &mut WriteTx, id: &str) -> Result<SandboxRow, ControlError> {
    load_sandbox(tx, id)
        .await?
        .ok_or_else(|| not_found("sandbox"))
}

/// Loads the caller's sandbox inside a write transaction, refusing a
/// quarantined one.
async fn load_mutable(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    id: &str,
) -> Result<SandboxRow, ControlError> {
    let row = load_sandbox(tx, id)
        .await?
        .filter(|row| row.org_id == org_id)
        .filter(|row| {
            row.ended_at_ms
                .is_none_or(|ended| ended > now_ms() - state.config.retention.as_millis() as i64)
        })
        .ok_or_else(|| not_found("sandbox"))?;
    if row.quarantined {
        return Err(ControlError::new(
            ErrorCode::Quarantined,
            "the sandbox is quarantined by an administrator",
        ));
    }
    Ok(row)
}

async fn set_desired(
    tx: &mut WriteTx,
    row: &SandboxRow,
    desired: DesiredState,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE sandboxes SET desired = $1, updated_at_ms = $2 WHERE id = $3")
        .bind(desired.as_str())
        .bind(now_ms())
        .bind(&row.id)
        .execute(&mut *tx.tx)
        .await?;
    tx.changed(&row.id).await?;
    if let Some(runner) = &row.runner_id {
        tx.changed(&format!("runner:{runner}")).await?;
    }
    Ok(())
}

fn invalid_state(row: &SandboxRow, action: &str) -> ControlError {
    ControlError::new(
        ErrorCode::InvalidState,
        format!("cannot {action} a sandbox that is {}", row.state),
    )
    .with_details(serde_json::json!({ "state": row.state, "desired": row.desired }))
}

/// Stop asks for no compute. A sandbox not yet placed has none, so it is
/// stopped at once; a placed one stops when its runner reports it.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/stop", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), responses((status = 202, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn stop(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<(StatusCode, axum::Json<Sandbox>), ControlError> {
    let org_id = caller.org()?;
    let mut tx = state.db.write().await?;
    let row = load_mutable(&state, &mut tx, &org_id, &id).await?;
    if row.state.is_terminal() || row.desired == DesiredState::Deleted {
        return Err(invalid_state(&row, "stop"));
    }
    if row.desired != DesiredState::Stopped {
        set_desired(&mut tx, &row, DesiredState::Stopped).await?;
        if row.runner_id.is_none() && row.state.awaits_placement() {
            let to = Transition {
                state: SandboxState::Stopped,
                reason: Some("stop_requested"),
                message: None,
            };
            set_sandbox_state(&mut tx, &row, to, None, row.epoch).await?;
        }
    }
    let record = reload(&mut tx, &id).await?;
    tx.commit().await?;
    Ok((StatusCode::ACCEPTED, axum::Json(record.to_api())))
}

/// Start asks for compute again: a stopped sandbox goes back to `pending`
/// and is placed (a standard one only on the runner that holds its home).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/start", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), responses((status = 202, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn start(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<(StatusCode, axum::Json<Sandbox>), ControlError> {
    let org_id = caller.org()?;
    let mut tx = state.db.write().await?;
    let row = load_mutable(&state, &mut tx, &org_id, &id).await?;
    if row.state.is_terminal()
        || row.desired == DesiredState::Deleted
        || row.desired == DesiredState::Terminated
    {
        return Err(invalid_state(&row, "start"));
    }
    // Stopped while wanted running (the workload ended itself) also needs
    // compute again.
    let needs_compute = row.state == SandboxState::Stopped;
    if row.desired != DesiredState::Running || needs_compute {
        check_quotas(&state, &mut tx, &org_id, false).await?;
        if row.desired != DesiredState::Running {
            set_desired(&mut tx, &row, DesiredState::Running).await?;
        }
        if needs_compute {
            let row = reload(&mut tx, &id).await?;
            // A standard home stays on its runner, which keeps it assigned
            // while the sandbox waits to be placed there again.
            let keep = (row.storage_class == StorageClass::Standard)
                .then_some(row.runner_id.as_deref())
                .flatten();
            let to = Transition {
                state: SandboxState::Pending,
                reason: Some("start_requested"),
                message: None,
            };
            set_sandbox_state(&mut tx, &row, to, keep, row.epoch).await?;
            let row = reload(&mut tx, &id).await?;
            place_or_wait(&mut tx, &row).await?;
        }
    }
    let record = reload(&mut tx, &id).await?;
    tx.commit().await?;
    Ok((StatusCode::ACCEPTED, axum::Json(record.to_api())))
}

/// Delete is idempotent by outcome: accepted once while the sandbox holds
/// anything (failed and terminated included), then `not_found`.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), responses((status = 202, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<(StatusCode, axum::Json<Sandbox>), ControlError> {
    let org_id = caller.org()?;
    let mut tx = state.db.write().await?;
    let row = load_mutable(&state, &mut tx, &org_id, &id).await?;
    if row.desired == DesiredState::Deleted || row.state == SandboxState::Deleted {
        return Err(not_found("sandbox"));
    }
    set_desired(&mut tx, &row, DesiredState::Deleted).await?;
    let runner_alive = match &row.runner_id {
        Some(runner) => {
            let live: Option<(String,)> =
                sqlx::query_as("SELECT id FROM runners WHERE id = $1 AND state = 'live'")
                    .bind(runner)
                    .fetch_optional(&mut *tx.tx)
                    .await?;
            live.is_some()
        }
        None => false,
    };
    // With no runner holding anything, nothing is left to release.
    let to = if runner_alive {
        Transition {
            state: SandboxState::Deleting,
            reason: Some("delete_requested"),
            message: None,
        }
    } else {
        Transition {
            state: SandboxState::Deleted,
            reason: Some("delete_requested"),
            message: None,
        }
    };
    let runner = if runner_alive {
        row.runner_id.as_deref()
    } else {
        None
    };
    set_sandbox_state(&mut tx, &row, to, runner, row.epoch).await?;
    let record = reload(&mut tx, &id).await?;
    tx.commit().await?;
    Ok((StatusCode::ACCEPTED, axum::Json(record.to_api())))
}
