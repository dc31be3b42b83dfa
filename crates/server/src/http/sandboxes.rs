//! `/v1/sandboxes`: create (admission, quotas, idempotency, placement),
//! read (long-pollable), list (long-pollable for a change of the page),
//! stop, start, delete, events (long-pollable for the next one), the idle
//! policy and keepalive.

use crate::control::{self, admission};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::{AppState, Json, OrgCaller, Path, Query};
use crate::error::ControlError;
use crate::idempotency;
use crate::limits;
use crate::records::sandboxes::ListFilter;
use crate::records::{self, SandboxRow, not_found};
use api::lifecycle::SandboxState;
use api::sandboxes::{CreateSandboxRequest, EventList, Sandbox, SandboxList, UpdateSandboxRequest};

pub const LONG_POLL_SECONDS_MAX: u64 = 25;

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$", description = "1-255 visible ASCII characters; replays the original answer for a retried request")), request_body = CreateSandboxRequest, responses((status = 201, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    headers: HeaderMap,
    Json(mut request): Json<CreateSandboxRequest>,
) -> Result<Response, ControlError> {
    let key = idempotency::Key::from_request(&headers, &org_id, "sandboxes", "", &request)?;
    if let Some(key) = &key
        && let Some(replayed) = idempotency::replay(&state.db, key).await?
    {
        return Ok(replayed);
    }
    match admit_and_commit(&state, &org_id, &mut request, key.as_ref()).await {
        Ok(created) => Ok(created),
        Err(failed) => idempotency::replay_after_failure(&state.db, key.as_ref(), failed).await,
    }
}

/// A create past its replay check: admitted, written and committed with
/// its key's answer (or the answer of the request that committed the key
/// first).
async fn admit_and_commit(
    state: &AppState,
    org_id: &str,
    request: &mut CreateSandboxRequest,
    key: Option<&idempotency::Key>,
) -> Result<Response, ControlError> {
    let mut row = admission::prepare(state, org_id, request)?;
    control::data_path::check_mount_sources(state, org_id, &request.mounts).await?;
    let id = row.id.clone();
    let mut tx = state.db.write().await?;
    admission::admit(state, &mut tx, &mut row, request).await?;
    let record = control::sandboxes::reload(&mut tx, &id).await?.to_api();
    let replayed = idempotency::commit_created(tx, &state.db, key, &record, &id).await?;
    if let Some(replayed) = replayed {
        return Ok(replayed);
    }
    state.config.failpoint.hit("after_commit:create_sandbox");
    tracing::info!(sandbox_id = %id, %org_id, state = %record.state, "sandbox created");
    Ok((StatusCode::CREATED, axum::Json(record)).into_response())
}

/// The sandbox as its org sees it: another org's, and one past its
/// retention window, do not exist.
pub async fn visible_sandbox(
    state: &AppState,
    org_id: &str,
    id: &str,
) -> Result<SandboxRow, ControlError> {
    let since = state.retained_since_ms();
    records::sandboxes::visible(&state.db, org_id, id, since)
        .await?
        .ok_or_else(|| not_found("sandbox"))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct WaitQuery {
    /// Long-poll until this state (or an end state).
    #[param(value_type = Option<SandboxState>)]
    wait_for: Option<String>,
    /// Seconds to wait, at most 25 (the default).
    #[param(minimum = 0, maximum = 25)]
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

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id"), WaitQuery), responses((status = 200, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(id): Path<String>,
    Query(query): Query<WaitQuery>,
) -> Result<axum::Json<Sandbox>, ControlError> {
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

#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", params(("state" = Option<Vec<SandboxState>>, Query, explode, description = "repeatable: any of these states"), ("label" = Option<Vec<String>>, Query, explode, max_items = 32, pattern = "^[a-z0-9._/-]{1,63}=.*$", description = "KEY=VALUE (repeatable in a request, at most 32 times; every one must match)"), ("limit" = Option<u32>, Query, minimum = 1, maximum = 200, description = "at most 200; default 50"), ("cursor" = Option<String>, Query, pattern = "^(sbx_[0-9a-f]{1,64})?$", description = "the next_cursor of the previous page"), ("timeout" = Option<u64>, Query, minimum = 0, maximum = 25, description = "with If-None-Match: seconds to wait for the page to change, at most 25 (default 0)"), ("If-None-Match" = Option<String>, Header, description = "the ETag of the page as last read: answer 304 unless it changes (within `timeout`)")), responses((status = 200, body = SandboxList, headers(("ETag" = String, description = "the page's version: its sandboxes and their last changes"))), (status = 304, description = "the page is unchanged (If-None-Match) after `timeout`"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    headers: HeaderMap,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<Response, ControlError> {
    let mut filter = ListFilter {
        states: Vec::new(),
        labels: Vec::new(),
        cursor: String::new(),
        limit: limits::LIST_LIMIT_DEFAULT,
        retained_since_ms: state.retained_since_ms(),
    };
    let mut timeout = None;
    for (name, value) in query {
        match name.as_str() {
            "state" => {
                let wanted = value
                    .parse()
                    .map_err(|_| limits::invalid("state", format!("unknown state {value:?}")))?;
                // Each state once: a repeated one would only lengthen the
                // statement (a bind parameter each).
                if !filter.states.contains(&wanted) {
                    filter.states.push(wanted);
                }
            }
            "label" => {
                let (k, v) = value
                    .split_once('=')
                    .ok_or_else(|| limits::invalid("label", "use label=KEY=VALUE"))?;
                limits::label_key(k)?;
                filter.labels.push((k.to_owned(), v.to_owned()));
                limits::label_filters("label", filter.labels.len())?;
            }
            "limit" => filter.limit = limits::list_limit(&value)?,
            "cursor" => filter.cursor = limits::cursor(&value, "sbx")?,
            "timeout" => {
                let seconds = value
                    .parse()
                    .map_err(|_| limits::invalid("timeout", "a number of seconds"))?;
                timeout = Some(seconds);
            }
            other => return Err(limits::invalid(other, "unknown query parameter")),
        }
    }
    // The version the caller holds; without one there is nothing to wait
    // for, so the page is answered at once.
    let known = headers
        .get(axum::http::header::IF_NONE_MATCH)
        .and_then(|value| value.to_str().ok())
        .map(|value| value.trim().trim_start_matches("W/").to_owned());
    let wait = match (&known, timeout) {
        (Some(_), Some(seconds)) if seconds > 0 => wait_timeout(Some(seconds))?,
        (_, Some(seconds)) => wait_timeout(Some(seconds)).map(|_| Duration::ZERO)?,
        (_, None) => Duration::ZERO,
    };
    let watch = state.db.hub.watch(crate::hub::ANY_SANDBOX);
    let (sandboxes, next_cursor, etag) = crate::hub::wait_until(
        &watch,
        wait,
        || async {
            let (rows, next) = records::sandboxes::list(&state.db.pool, &org_id, &filter).await?;
            let etag = page_etag(&rows, next.as_deref());
            Ok::<_, ControlError>((rows, next, etag))
        },
        |(_, _, etag)| known.as_deref() != Some(etag.as_str()),
    )
    .await?;
    let mut response = if known.as_deref() == Some(etag.as_str()) {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        axum::Json(SandboxList {
            sandboxes: sandboxes.iter().map(SandboxRow::to_api).collect(),
            next_cursor,
        })
        .into_response()
    };
    if let Ok(value) = axum::http::HeaderValue::from_str(&etag) {
        response
            .headers_mut()
            .insert(axum::http::header::ETAG, value);
    }
    Ok(response)
}

/// A page's version: which sandboxes it holds and when each last changed
/// (every write to a sandbox row sets `updated_at_ms`; kept copies are
/// their own column), and whether more follow. Figures computed at read
/// time (a save's lag) are not in it: they change without a write.
fn page_etag(rows: &[SandboxRow], next_cursor: Option<&str>) -> String {
    let mut hasher = blake3::Hasher::new();
    for row in rows {
        hasher.update(row.id.as_bytes());
        hasher.update(&row.updated_at_ms.to_le_bytes());
        hasher.update(row.kept_copies.as_deref().unwrap_or("").as_bytes());
        hasher.update(b"\0");
    }
    hasher.update(next_cursor.unwrap_or("").as_bytes());
    let hash = hasher.finalize().to_hex();
    format!("\"{}\"", &hash.as_str()[..32])
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Only events after this `seq` (default 0: the whole history).
    #[serde(default)]
    #[param(minimum = 0)]
    after: u64,
    /// The `next_cursor` of the previous page (the same as `after`).
    cursor: Option<String>,
    /// Seconds to wait for an event after `after`, at most 25 (default 0:
    /// answer at once, possibly with none).
    #[param(minimum = 0, maximum = 25)]
    timeout: Option<u64>,
}

/// The sandbox's history, oldest first; with `after` and `timeout`, a
/// long-poll that answers as soon as a later event is recorded (an open
/// timeline follows the sandbox this way).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/events", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id"), EventsQuery), responses((status = 200, body = EventList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn events(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
) -> Result<axum::Json<EventList>, ControlError> {
    // Past any seq there can be: nothing yet (the document sets no upper
    // bound, so no valid value is refused).
    let after = match &query.cursor {
        Some(cursor) => cursor
            .parse::<u64>()
            .map_err(|_| crate::limits::invalid("cursor", "a page's next_cursor"))?,
        None => query.after,
    };
    let after = i64::try_from(after).unwrap_or(i64::MAX);
    let timeout = match query.timeout {
        None | Some(0) => Duration::ZERO,
        Some(t) => wait_timeout(Some(t))?,
    };
    // Every event is written with a wake-up of its sandbox's key.
    let watch = state.db.hub.watch(&id);
    let events = crate::hub::wait_until(
        &watch,
        timeout,
        || async {
            Box::pin(visible_sandbox(&state, &org_id, &id)).await?;
            // One more than a page: whether there is a next one.
            let limit = api::sandboxes::EVENTS_PAGE_MAX + 1;
            Ok::<_, ControlError>(
                records::sandboxes::events(&state.db.pool, &id, after, limit).await?,
            )
        },
        |events| !events.is_empty(),
    )
    .await?;
    let mut events = events;
    let next_cursor = (events.len() > api::sandboxes::EVENTS_PAGE_MAX).then(|| {
        events.truncate(api::sandboxes::EVENTS_PAGE_MAX);
        events
            .last()
            .map(|event| event.seq.to_string())
            .unwrap_or_default()
    });
    Ok(axum::Json(EventList {
        events,
        next_cursor,
    }))
}

/// Stop asks for no compute; see `control::sandboxes::stop`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/stop", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), responses((status = 202, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn stop(
    state: State<AppState>,
    caller: OrgCaller,
    id: Path<String>,
) -> Result<(StatusCode, axum::Json<Sandbox>), ControlError> {
    change(state, caller, id, Change::Stop).await
}

/// Start asks for compute again; see `control::sandboxes::start`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/start", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), responses((status = 202, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn start(
    state: State<AppState>,
    caller: OrgCaller,
    id: Path<String>,
) -> Result<(StatusCode, axum::Json<Sandbox>), ControlError> {
    change(state, caller, id, Change::Start).await
}

/// Delete is idempotent by outcome; see `control::sandboxes::delete`.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), responses((status = 202, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn delete(
    state: State<AppState>,
    caller: OrgCaller,
    id: Path<String>,
) -> Result<(StatusCode, axum::Json<Sandbox>), ControlError> {
    change(state, caller, id, Change::Delete).await
}

/// Changes the idle policy; see `control::idle::update`.
#[utoipa::path(patch, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), request_body = UpdateSandboxRequest, responses((status = 200, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn update(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(id): Path<String>,
    Json(request): Json<UpdateSandboxRequest>,
) -> Result<axum::Json<Sandbox>, ControlError> {
    let mut tx = state.db.write().await?;
    let record = control::idle::update(&state, &mut tx, &org_id, &id, &request).await?;
    tx.commit().await?;
    Ok(axum::Json(record.to_api()))
}

/// Activity that keeps a running sandbox awake (it does not wake a stopped
/// one: 409); see `control::idle::keepalive`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/keepalive", tag = "sandboxes", params(("id" = String, Path, description = "sandbox id")), responses((status = 200, body = Sandbox), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn keepalive(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(id): Path<String>,
) -> Result<axum::Json<Sandbox>, ControlError> {
    let mut tx = state.db.write().await?;
    let record = control::idle::keepalive(&state, &mut tx, &org_id, &id).await?;
    tx.commit().await?;
    Ok(axum::Json(record.to_api()))
}

enum Change {
    Stop,
    Start,
    Delete,
}

/// One write transaction around one lifecycle change, answered 202.
async fn change(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(id): Path<String>,
    change: Change,
) -> Result<(StatusCode, axum::Json<Sandbox>), ControlError> {
    let mut tx = state.db.write().await?;
    let record = match change {
        Change::Stop => control::sandboxes::stop(&state, &mut tx, &org_id, &id).await?,
        Change::Start => control::sandboxes::start(&state, &mut tx, &org_id, &id).await?,
        Change::Delete => control::sandboxes::delete(&state, &mut tx, &org_id, &id).await?,
    };
    tx.commit().await?;
    Ok((StatusCode::ACCEPTED, axum::Json(record.to_api())))
}
