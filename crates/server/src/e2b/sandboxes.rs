//! E2B's sandbox lifecycle on roost's records: create (template → image,
//! timeout → TTL, metadata → labels, envVars → env), get, list (state
//! filter), connect/resume (→ start, same id), pause (→ stop: a durable
//! home is secured), kill (→ delete), set timeout (→ TTL from now).
//!
//! E2B answers a create, a connect and a pause once they are done, so
//! these wait (on the hub, never polling) for the state roost reaches
//! asynchronously.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use super::{ApiKeyCaller, E2bError, E2bPath, E2bQuery};
use crate::control::{self, AppState, admission};
use crate::error::ControlError;
use crate::idempotency;
use crate::records::sandboxes::ListFilter;
use crate::records::{self, SandboxRow, rfc3339};
use api::ErrorCode;
use api::e2b::rest::{
    ConnectSandbox, CreatedSandbox, ENVD_VERSION, NewSandbox, Pause, SandboxDetail, SetTimeout,
    State as E2bState,
};
use api::lifecycle::{DesiredState, SandboxState, StorageClass};
use api::sandboxes::CreateSandboxRequest;

/// E2B's sandbox lifetime when a create names none, in seconds.
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// How long a create, connect or pause waits for its sandbox to get there.
pub const SETTLE_WAIT: Duration = Duration::from_secs(180);
/// E2B's template name for its default image; roost's is `default`.
pub const E2B_BASE_TEMPLATE: &str = "base";
/// The idempotency scope of E2B creates (apart from `/v1`'s).
const IDEMPOTENCY_SCOPE: &str = "e2b_sandboxes";

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, E2bError> {
    let bytes: &[u8] = if body.is_empty() { b"{}" } else { body };
    serde_json::from_slice(bytes).map_err(|err| {
        E2bError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest.as_str(),
            format!("the body is not the JSON E2B's API takes: {err}"),
        )
    })
}

/// The roost create a `NewSandbox` asks for, or the refusal of what roost
/// cannot honour.
pub fn translate(body: &NewSandbox, durable: bool) -> Result<CreateSandboxRequest, E2bError> {
    // autoPause: the sandbox goes to sleep (paused, its home secured) once
    // it has gone `timeout` seconds without activity, and is not ended by a
    // TTL; unlike E2B, an active sandbox is never paused mid-work. Without
    // it, E2B's timeout is a TTL and the sandbox never sleeps on its own.
    let auto_pause = body.auto_pause == Some(true);
    let timeout = body.timeout.unwrap_or(DEFAULT_TIMEOUT_S).max(1);
    if body
        .auto_resume
        .as_ref()
        .is_some_and(|v| v.get("enabled").and_then(serde_json::Value::as_bool) == Some(true))
    {
        return Err(E2bError::unsupported(
            "autoResume is not supported by roost: resume a paused sandbox with connect()",
        ));
    }
    // E2B's pause keeps the memory unless told not to; roost's keeps the
    // files (the home) and ends the processes. Asked for in so many words,
    // it is refused, never quietly weakened.
    if auto_pause && body.auto_pause_memory == Some(true) {
        return Err(E2bError::unsupported(
            "autoPauseMemory is not supported by roost: its pause keeps the sandbox's files, not its memory (its processes end); pass false or leave it out",
        ));
    }
    let mut refused: Vec<&str> = Vec::new();
    for (name, value) in [
        ("network", &body.network),
        ("mcp", &body.mcp),
        ("iam", &body.iam),
    ] {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            refused.push(name);
        }
    }
    if body.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        refused.push("volumeMounts");
    }
    refused.extend(body.rest.keys().map(String::as_str));
    if !refused.is_empty() {
        return Err(E2bError::unsupported(format!(
            "not supported by roost's E2B-compatible API: {}",
            refused.join(", ")
        )));
    }
    let image = if body.template_id == E2B_BASE_TEMPLATE {
        api::sandboxes::default_image()
    } else {
        body.template_id.clone()
    };
    Ok(CreateSandboxRequest {
        image,
        storage_class: if durable {
            StorageClass::Durable.as_str().to_owned()
        } else {
            StorageClass::Standard.as_str().to_owned()
        },
        network: if body.allow_internet_access == Some(true) {
            api::lifecycle::Network::Bridge.as_str().to_owned()
        } else {
            api::sandboxes::default_network()
        },
        ttl: (!auto_pause).then_some(timeout),
        idle_timeout_s: Some(if auto_pause { timeout } else { 0 }),
        auto_wake: Some(true),
        env: body.env_vars.clone().unwrap_or_default(),
        labels: body.metadata.clone().unwrap_or_default(),
        ..CreateSandboxRequest::default()
    }
    .with_defaults())
}

trait WithDefaults {
    fn with_defaults(self) -> Self;
}

impl WithDefaults for CreateSandboxRequest {
    /// `Default` leaves the serde defaults empty; fill them as a parsed
    /// request has them.
    fn with_defaults(mut self) -> Self {
        self.placement = api::sandboxes::default_placement();
        self
    }
}

/// The sandbox as the org sees it, or E2B's 404.
async fn visible(state: &AppState, org_id: &str, id: &str) -> Result<SandboxRow, E2bError> {
    records::sandboxes::visible(&state.db, org_id, id, state.retained_since_ms())
        .await?
        .ok_or_else(|| not_found(id))
}

fn not_found(id: &str) -> E2bError {
    E2bError::new(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound.as_str(),
        format!("sandbox {id} was not found"),
    )
}

/// E2B's two states for roost's: compute wanted or held is `running`, a
/// sandbox asleep `paused`; one that ended (failed, terminated, deleted)
/// is not E2B's to show.
pub fn e2b_state(row: &SandboxRow) -> Option<E2bState> {
    if row.state.is_terminal()
        || matches!(row.state, SandboxState::Deleting)
        || row.desired == DesiredState::Deleted
    {
        return None;
    }
    match row.state {
        SandboxState::Stopped | SandboxState::Stopping | SandboxState::Securing => {
            Some(E2bState::Paused)
        }
        _ if row.desired == DesiredState::Stopped => Some(E2bState::Paused),
        _ => Some(E2bState::Running),
    }
}

/// What the template was called: E2B's `base` for roost's `default`.
fn template_of(row: &SandboxRow) -> String {
    if row.image == api::sandboxes::default_image() {
        E2B_BASE_TEMPLATE.to_owned()
    } else {
        row.image.clone()
    }
}

/// The sandbox as E2B describes it; with `key`, its envd access token
/// (`auth::envd_token`).
fn detail(row: &SandboxRow, state: E2bState, key: Option<&[u8; 32]>) -> SandboxDetail {
    // No end: a century on, as E2B has no "never".
    let end = row
        .expires_at_ms
        .unwrap_or(row.created_at_ms + 100 * 365 * 24 * 3600 * 1000);
    SandboxDetail {
        template_id: template_of(row),
        sandbox_id: row.id.clone(),
        client_id: "roost".to_owned(),
        started_at: rfc3339(row.created_at_ms),
        end_at: rfc3339(end),
        envd_version: ENVD_VERSION.to_owned(),
        cpu_count: row
            .millicpus
            .map_or(0, |m| (m.max(0) as u64).div_ceil(1000)),
        memory_mb: row.memory_mib.map_or(0, |m| m.max(0) as u64),
        disk_size_mb: 0,
        state,
        metadata: serde_json::from_str(&row.labels).unwrap_or_default(),
        envd_access_token: key.map(|key| crate::auth::envd_token(key, &row.org_id, &row.id)),
        domain: None,
    }
}

/// The created (or resumed) sandbox, with its envd access token.
fn created(row: &SandboxRow, key: &[u8; 32]) -> CreatedSandbox {
    CreatedSandbox {
        template_id: template_of(row),
        sandbox_id: row.id.clone(),
        client_id: "roost".to_owned(),
        envd_version: ENVD_VERSION.to_owned(),
        envd_access_token: crate::auth::envd_token(key, &row.org_id, &row.id),
        traffic_access_token: None,
        domain: None,
    }
}

/// Waits until the sandbox is `running`; a sandbox that ended or stopped
/// on the way is refused with its state and reason.
async fn until_running(state: &AppState, org_id: &str, id: &str) -> Result<SandboxRow, E2bError> {
    let row = settle(state, org_id, id, |row| {
        row.state == SandboxState::Running
            || row.state.is_terminal()
            || row.desired != DesiredState::Running
    })
    .await?;
    if row.state == SandboxState::Running {
        return Ok(row);
    }
    Err(E2bError::new(
        if row.state.is_terminal() {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::GATEWAY_TIMEOUT
        },
        "not_running",
        format!(
            "sandbox {id} is {} ({}), not running{}",
            row.state,
            row.state_reason.as_deref().unwrap_or("no reason recorded"),
            row.state_message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ),
    ))
}

/// Waits on the hub until `done` holds or [`SETTLE_WAIT`] passes.
async fn settle(
    state: &AppState,
    org_id: &str,
    id: &str,
    done: impl Fn(&SandboxRow) -> bool,
) -> Result<SandboxRow, E2bError> {
    let watch = state.db.hub.watch(id);
    let deadline = tokio::time::Instant::now() + SETTLE_WAIT;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let row = crate::hub::wait_until(
            &watch,
            left.min(Duration::from_secs(25)),
            || visible(state, org_id, id),
            &done,
        )
        .await?;
        if done(&row) || left.is_zero() {
            return Ok(row);
        }
    }
}

/// `POST /sandboxes`, `POST /v2/sandboxes`: a new sandbox, answered once it
/// runs. A retried create with the same `Idempotency-Key` (and the same
/// body) makes nothing new: it answers with the sandbox the first made;
/// with another body 409. Without a key, each create makes a sandbox.
pub async fn create(
    State(state): State<AppState>,
    caller: ApiKeyCaller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, E2bError> {
    let body: NewSandbox = parse(&body)?;
    let durable = state.config.store_url.is_some();
    let mut request = translate(&body, durable)?;
    let org_id = caller.org_id.clone();
    let key = idempotency::Key::from_request(&headers, &org_id, IDEMPOTENCY_SCOPE, "", &request)?;
    let id = match match &key {
        Some(key) => idempotency::replay(&state.db, key).await?,
        None => None,
    } {
        Some(replayed) => replayed_id(replayed).await?,
        None => match admit_and_commit(&state, &org_id, &mut request, key.as_ref()).await {
            Ok(id) => id,
            // A request with the key may have committed meanwhile: its
            // sandbox is the answer (`idempotency::replay_after_failure`).
            Err(failed) => {
                let replayed =
                    idempotency::replay_after_failure(&state.db, key.as_ref(), failed).await?;
                replayed_id(replayed).await?
            }
        },
    };
    let row = until_running(&state, &org_id, &id).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(created(&row, &state.envd_key)),
    )
        .into_response())
}

/// A create past its replay check, admitted and committed with its key:
/// the new sandbox's id, or the id a request that committed the key first
/// made.
async fn admit_and_commit(
    state: &AppState,
    org_id: &str,
    request: &mut CreateSandboxRequest,
    key: Option<&idempotency::Key>,
) -> Result<String, ControlError> {
    let mut row = admission::prepare(state, org_id, request)?;
    let id = row.id.clone();
    let mut tx = state.db.write().await?;
    admission::admit(state, &mut tx, &mut row, request).await?;
    let record = control::sandboxes::reload(&mut tx, &id).await?.to_api();
    match idempotency::commit_created(tx, &state.db, key, &record, &id).await? {
        Some(replayed) => replayed_id(replayed).await,
        None => {
            tracing::info!(sandbox_id = %id, %org_id, "sandbox created through the E2B API");
            Ok(id)
        }
    }
}

/// The sandbox id of a replayed create's stored answer (roost's record).
async fn replayed_id(replayed: Response) -> Result<String, ControlError> {
    let internal = |e: String| ControlError::new(ErrorCode::Internal, e);
    let bytes = axum::body::to_bytes(replayed.into_body(), 1024 * 1024)
        .await
        .map_err(|e| internal(e.to_string()))?;
    let record: api::sandboxes::Sandbox =
        serde_json::from_slice(&bytes).map_err(|e| internal(e.to_string()))?;
    Ok(record.id)
}

/// `GET /sandboxes/{id}`
pub async fn get(
    State(state): State<AppState>,
    caller: ApiKeyCaller,
    E2bPath(id): E2bPath<String>,
) -> Result<axum::Json<SandboxDetail>, E2bError> {
    let row = visible(&state, &caller.org_id, &id).await?;
    let Some(e2b) = e2b_state(&row) else {
        return Err(ended(&row));
    };
    Ok(axum::Json(detail(&row, e2b, Some(&state.envd_key))))
}

/// An ended sandbox: E2B's 404, its roost state named.
fn ended(row: &SandboxRow) -> E2bError {
    E2bError::new(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound.as_str(),
        format!(
            "sandbox {} was not found running or paused: it is {} ({})",
            row.id,
            row.state,
            row.state_reason.as_deref().unwrap_or("no reason recorded")
        ),
    )
}

/// `GET /v2/sandboxes?state=running,paused&metadata=k%3Dv&limit&nextToken`
pub async fn list_v2(
    state: State<AppState>,
    caller: ApiKeyCaller,
    E2bQuery(query): E2bQuery<Vec<(String, String)>>,
) -> Result<Response, E2bError> {
    list(state, caller, query, &[E2bState::Running, E2bState::Paused]).await
}

/// `GET /sandboxes` (v1): the running ones.
pub async fn list_v1(
    state: State<AppState>,
    caller: ApiKeyCaller,
    E2bQuery(query): E2bQuery<Vec<(String, String)>>,
) -> Result<Response, E2bError> {
    list(state, caller, query, &[E2bState::Running]).await
}

async fn list(
    State(state): State<AppState>,
    caller: ApiKeyCaller,
    query: Vec<(String, String)>,
    default_states: &[E2bState],
) -> Result<Response, E2bError> {
    let mut wanted: Vec<E2bState> = Vec::new();
    let mut labels: BTreeMap<String, String> = BTreeMap::new();
    let mut limit = crate::limits::LIST_LIMIT_DEFAULT;
    let mut cursor = String::new();
    for (name, value) in query {
        match name.as_str() {
            "state" => {
                for one in value.split(',').filter(|s| !s.is_empty()) {
                    wanted.push(E2bState::parse(one).ok_or_else(|| {
                        E2bError::new(
                            StatusCode::BAD_REQUEST,
                            ErrorCode::InvalidRequest.as_str(),
                            format!("state {one:?}: running or paused"),
                        )
                    })?);
                }
            }
            // `k=v&k2=v2`, URL-encoded once more by the SDK.
            "metadata" => {
                for (k, v) in url_pairs(&value) {
                    labels.insert(k, v);
                }
                crate::limits::label_filters("metadata", labels.len())?;
            }
            "limit" => {
                limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=crate::limits::LIST_LIMIT_MAX).contains(l))
                    .ok_or_else(|| {
                        E2bError::new(
                            StatusCode::BAD_REQUEST,
                            ErrorCode::InvalidRequest.as_str(),
                            format!("limit: 1 to {}", crate::limits::LIST_LIMIT_MAX),
                        )
                    })?;
            }
            "nextToken" => cursor = value,
            "order" | "startedAfter" | "template" => {
                return Err(E2bError::unsupported(format!(
                    "listing by {name} is not supported by roost"
                )));
            }
            other => {
                return Err(E2bError::new(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidRequest.as_str(),
                    format!("unknown query parameter {other}"),
                ));
            }
        }
    }
    if wanted.is_empty() {
        wanted = default_states.to_vec();
    }
    let filter = ListFilter {
        states: roost_states(&wanted),
        labels: labels.into_iter().collect(),
        cursor,
        limit,
        retained_since_ms: state.retained_since_ms(),
    };
    let (rows, next) = records::sandboxes::list(&state.db.pool, &caller.org_id, &filter).await?;
    let listed: Vec<SandboxDetail> = rows
        .iter()
        .filter_map(|row| {
            let e2b = e2b_state(row)?;
            wanted.contains(&e2b).then(|| detail(row, e2b, None))
        })
        .collect();
    let mut response = axum::Json(listed).into_response();
    if let Some(next) = next
        && let Ok(value) = HeaderValue::from_str(&next)
    {
        response.headers_mut().insert("x-next-token", value);
    }
    Ok(response)
}

/// roost's states that can show as the E2B states wanted (refined per row
/// by [`e2b_state`]).
fn roost_states(wanted: &[E2bState]) -> Vec<SandboxState> {
    let mut states = Vec::new();
    if wanted.contains(&E2bState::Running) {
        states.extend([
            SandboxState::Pending,
            SandboxState::Starting,
            SandboxState::Running,
            SandboxState::Recovering,
        ]);
    }
    if wanted.contains(&E2bState::Paused) || wanted.contains(&E2bState::Running) {
        // A stopping sandbox may still be wanted running (it restarts).
        states.extend([
            SandboxState::Stopping,
            SandboxState::Securing,
            SandboxState::Stopped,
        ]);
    }
    if wanted.contains(&E2bState::Paused) {
        states.extend([
            SandboxState::Pending,
            SandboxState::Starting,
            SandboxState::Running,
        ]);
    }
    states.sort_by_key(|s| s.as_str());
    states.dedup();
    states
}

/// `a=1&b=2` (percent-encoded) as pairs.
fn url_pairs(text: &str) -> Vec<(String, String)> {
    text.split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `DELETE /sandboxes/{id}`: roost's delete (its home released).
pub async fn kill(
    State(state): State<AppState>,
    caller: ApiKeyCaller,
    E2bPath(id): E2bPath<String>,
) -> Result<StatusCode, E2bError> {
    let mut tx = state.db.write().await?;
    control::sandboxes::delete(&state, &mut tx, &caller.org_id, &id)
        .await
        .map_err(|e| {
            if e.code == ErrorCode::NotFound {
                not_found(&id)
            } else {
                e.into()
            }
        })?;
    tx.commit().await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/timeout`: the sandbox ends `timeout` seconds from
/// now (roost's TTL: it is then `terminated`, `ttl_expired`).
pub async fn set_timeout(
    State(state): State<AppState>,
    caller: ApiKeyCaller,
    E2bPath(id): E2bPath<String>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let request: SetTimeout = parse(&body)?;
    check_timeout(request.timeout)?;
    visible(&state, &caller.org_id, &id).await?;
    // Read again in the transaction that writes, as every change is: a
    // quarantined sandbox refuses it, and an end since is not overwritten.
    let mut tx = state.db.write().await?;
    let row = control::sandboxes::load_mutable(&state, &mut tx, &caller.org_id, &id).await?;
    if e2b_state(&row).is_none() {
        return Err(ended(&row));
    }
    let expires = crate::db::now_ms() + request.timeout as i64 * 1000;
    records::sandboxes::set_expires_at(&mut tx, &row, expires, "timeout_set").await?;
    tx.commit().await?;
    Ok(StatusCode::NO_CONTENT)
}

fn check_timeout(timeout: u64) -> Result<(), E2bError> {
    if timeout == 0 || timeout > crate::limits::TTL_SECONDS_MAX {
        return Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest.as_str(),
            format!("timeout: 1 to {} seconds", crate::limits::TTL_SECONDS_MAX),
        ));
    }
    Ok(())
}

/// `POST /sandboxes/{id}/pause`: roost's stop, answered once `stopped`
/// (a durable home secured in the store first). 409 if already paused.
pub async fn pause(
    State(state): State<AppState>,
    caller: ApiKeyCaller,
    E2bPath(id): E2bPath<String>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let request: Pause = parse(&body)?;
    if request.require_healthy_guest == Some(true) {
        return Err(E2bError::unsupported(
            "requireHealthyGuest is not supported by roost: a pause always stops the sandbox",
        ));
    }
    let row = visible(&state, &caller.org_id, &id).await?;
    match e2b_state(&row) {
        None => return Err(ended(&row)),
        Some(E2bState::Paused) => {
            return Err(E2bError::new(
                StatusCode::CONFLICT,
                ErrorCode::InvalidState.as_str(),
                format!("sandbox {id} is already paused ({})", row.state),
            ));
        }
        Some(E2bState::Running) => {}
    }
    let mut tx = state.db.write().await?;
    control::sandboxes::stop(&state, &mut tx, &caller.org_id, &id).await?;
    tx.commit().await?;
    let row = settle(&state, &caller.org_id, &id, |row| {
        row.state == SandboxState::Stopped || row.state.is_terminal()
    })
    .await?;
    if row.state != SandboxState::Stopped {
        return Err(E2bError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "not_paused",
            format!(
                "sandbox {id} is {} ({}), not yet paused",
                row.state,
                row.state_reason.as_deref().unwrap_or("no reason recorded")
            ),
        ));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v2/sandboxes/{id}/connect` (and v1): a paused sandbox is
/// started again under the same id, its home as it was secured; answered
/// once it runs. A timeout extends its life (never shortens it).
pub async fn connect(
    state: State<AppState>,
    caller: ApiKeyCaller,
    id: E2bPath<String>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let row = resume_inner(&state, caller, id, body, false).await?;
    Ok((StatusCode::OK, axum::Json(created(&row, &state.envd_key))).into_response())
}

/// `POST /sandboxes/{id}/resume`: as connect, but 409 for a running one.
pub async fn resume(
    state: State<AppState>,
    caller: ApiKeyCaller,
    id: E2bPath<String>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let row = resume_inner(&state, caller, id, body, true).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(created(&row, &state.envd_key)),
    )
        .into_response())
}

async fn resume_inner(
    state: &AppState,
    caller: ApiKeyCaller,
    E2bPath(id): E2bPath<String>,
    body: Bytes,
    only_paused: bool,
) -> Result<SandboxRow, E2bError> {
    let request: ConnectSandbox = parse(&body)?;
    if !request.rest.is_empty() {
        return Err(E2bError::unsupported(format!(
            "not supported by roost's E2B-compatible API: {}",
            request.rest.keys().cloned().collect::<Vec<_>>().join(", ")
        )));
    }
    if let Some(timeout) = request.timeout {
        check_timeout(timeout)?;
    }
    let org_id = caller.org_id.clone();
    let row = visible(state, &org_id, &id).await?;
    match e2b_state(&row) {
        None => return Err(ended(&row)),
        Some(E2bState::Running) if only_paused => {
            return Err(E2bError::new(
                StatusCode::CONFLICT,
                ErrorCode::InvalidState.as_str(),
                format!("sandbox {id} is already running"),
            ));
        }
        Some(E2bState::Running) => {}
        Some(E2bState::Paused) => {
            // The stop first, whether or not its runner has begun it: a
            // start now would race it, and a command sent right after the
            // answer could reach the runner as it stops.
            let row = settle(state, &org_id, &id, |row| {
                !control::idle::stop_under_way(row)
                    && !matches!(row.state, SandboxState::Stopping | SandboxState::Securing)
            })
            .await?;
            let mut tx = state.db.write().await?;
            control::sandboxes::start(state, &mut tx, &org_id, &row.id).await?;
            tx.commit().await?;
        }
    }
    let row = until_running(state, &org_id, &id).await?;
    if let Some(timeout) = request.timeout {
        let expires = crate::db::now_ms() + timeout as i64 * 1000;
        if row.expires_at_ms.is_some_and(|at| at < expires) {
            let mut tx = state.db.write().await?;
            let row = control::sandboxes::load_mutable(state, &mut tx, &org_id, &row.id).await?;
            records::sandboxes::set_expires_at(&mut tx, &row, expires, "timeout_extended").await?;
            tx.commit().await?;
        }
    }
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_create_translates_and_refuses_what_roost_cannot_honour() {
        let body: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","metadata":{"team":"a"},"envVars":{"X":"1"}}"#,
        )
        .expect("in a test");
        let request = translate(&body, true).expect("in a test");
        assert_eq!(request.image, "default");
        assert_eq!(request.ttl, Some(DEFAULT_TIMEOUT_S));
        assert_eq!(request.storage_class, "durable");
        assert_eq!(request.network, "none");
        assert_eq!(request.labels["team"], "a");
        assert_eq!(request.env["X"], "1");
        let body: NewSandbox = serde_json::from_str(
            r#"{"templateID":"my-image","timeout":60,"allow_internet_access":true}"#,
        )
        .expect("in a test");
        let request = translate(&body, false).expect("in a test");
        assert_eq!(
            (
                request.image.as_str(),
                request.ttl,
                request.network.as_str()
            ),
            ("my-image", Some(60), "bridge")
        );
        for (body, named) in [
            (
                r#"{"templateID":"base","autoResume":{"enabled":true}}"#,
                "autoResume",
            ),
            (r#"{"templateID":"base","mcp":{"x":{}}}"#, "mcp"),
            (
                r#"{"templateID":"base","volumeMounts":[{"name":"v","path":"/v"}]}"#,
                "volumeMounts",
            ),
            (r#"{"templateID":"base","fancy":1}"#, "fancy"),
            // A pause that keeps memory: roost's keeps files only.
            (
                r#"{"templateID":"base","autoPause":true,"autoPauseMemory":true}"#,
                "autoPauseMemory",
            ),
        ] {
            let body: NewSandbox = serde_json::from_str(body).expect("in a test");
            let refused = translate(&body, true).expect_err("refused");
            assert_eq!(refused.status, StatusCode::BAD_REQUEST);
            assert!(refused.message.contains(named), "{}", refused.message);
        }
        // autoPause: sleep after the timeout without activity, no TTL.
        let body: NewSandbox =
            serde_json::from_str(r#"{"templateID":"base","timeout":120,"autoPause":true}"#)
                .expect("in a test");
        let request = translate(&body, true).expect("in a test");
        assert_eq!((request.ttl, request.idle_timeout_s), (None, Some(120)));
        let body: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","timeout":120,"autoPause":true,"autoPauseMemory":false}"#,
        )
        .expect("in a test");
        translate(&body, true).expect("a files-only pause is what roost does");
        let body: NewSandbox =
            serde_json::from_str(r#"{"templateID":"base","timeout":120}"#).expect("in a test");
        let request = translate(&body, true).expect("in a test");
        assert_eq!((request.ttl, request.idle_timeout_s), (Some(120), Some(0)));
        // Explicit "off" values are no request for anything.
        let body: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","autoPause":false,"autoResume":{"enabled":false},"mcp":null}"#,
        )
        .expect("in a test");
        translate(&body, true).expect("in a test");
    }

    #[test]
    fn metadata_queries_decode() {
        assert_eq!(
            url_pairs("team=a&x=y%20z"),
            vec![
                ("team".to_owned(), "a".to_owned()),
                ("x".to_owned(), "y z".to_owned())
            ]
        );
        assert_eq!(percent_decode("a%3Db"), "a=b");
        assert_eq!(percent_decode("100%"), "100%");
    }
}
