//! `/v1/sandboxes/{id}/commands`: a record per exec, handed to the runner
//! through its assignments; output kept and readable while it runs.

use api::lifecycle::{Activity, CommandState};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::sandboxes::{visible_sandbox, wait_timeout};
use super::{AppState, Json, OrgCaller, Path, Query};
use crate::control;
use crate::error::ControlError;
use crate::idempotency;
use crate::limits;
use crate::records::commands::Stream;
use crate::records::{self, CommandRow, not_found};
use api::commands::{Command, CommandList, CreateCommandRequest, SignalRequest, TtySize};

/// Most output bytes one read returns.
const OUTPUT_READ_BYTES_MAX: usize = 1024 * 1024;

async fn visible_command(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    id: &str,
) -> Result<CommandRow, ControlError> {
    // A sandbox past its retention window takes its commands with it.
    visible_sandbox(state, org_id, sandbox_id).await?;
    records::commands::visible(&state.db, org_id, sandbox_id, id)
        .await?
        .ok_or_else(|| not_found("command"))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands", tag = "commands", params(("id" = String, Path, description = "sandbox id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$", description = "1-255 visible ASCII characters; replays the original answer for a retried request")), request_body = CreateCommandRequest, responses((status = 201, body = Command), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    headers: HeaderMap,
    Path(sandbox_id): Path<String>,
    Json(request): Json<CreateCommandRequest>,
) -> Result<Response, ControlError> {
    let key = idempotency::Key::from_request(&headers, &org_id, "commands", &sandbox_id, &request)?;
    if let Some(key) = &key
        && let Some(replayed) = idempotency::replay(&state.db, key).await?
    {
        return Ok(replayed);
    }
    control::commands::validate(&request)?;
    let mut tx = state.db.write().await?;
    // A sandbox past its retention window takes no commands.
    visible_sandbox(&state, &org_id, &sandbox_id).await?;
    let command =
        control::commands::create(&state, &mut tx, &org_id, &sandbox_id, &request).await?;
    let id = command.id.clone();
    let record = command.to_api();
    let replayed = idempotency::commit_created(tx, &state.db, key.as_ref(), &record, &id).await?;
    if let Some(replayed) = replayed {
        return Ok(replayed);
    }
    tracing::info!(command_id = %id, %sandbox_id, "command queued");
    Ok((StatusCode::CREATED, axum::Json(record)).into_response())
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct CommandWait {
    /// Long-poll until this state, or `ended` for any end state.
    #[param(schema_with = api::schema::command_wait_for)]
    wait_for: Option<String>,
    /// Seconds to wait, at most 25 (the default).
    #[param(minimum = 0, maximum = 25)]
    timeout: Option<u64>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands/{command_id}", tag = "commands", params(("id" = String, Path, description = "sandbox id"), ("command_id" = String, Path, description = "command id"), CommandWait), responses((status = 200, body = Command), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path((sandbox_id, id)): Path<(String, String)>,
    Query(query): Query<CommandWait>,
) -> Result<axum::Json<Command>, ControlError> {
    let Some(target) = query.wait_for else {
        // Boxed, like every read here: see `hub::wait_until`.
        let row = Box::pin(visible_command(&state, &org_id, &sandbox_id, &id)).await?;
        return Ok(axum::Json(row.to_api()));
    };
    // `ended`: any end state.
    let target: Option<CommandState> = match target.as_str() {
        "ended" => None,
        text => Some(
            text.parse()
                .map_err(|_| limits::invalid("wait_for", format!("unknown state {target:?}")))?,
        ),
    };
    let timeout = wait_timeout(query.timeout)?;
    let watch = state.db.hub.watch(&id);
    let row = crate::hub::wait_until(
        &watch,
        timeout,
        || visible_command(&state, &org_id, &sandbox_id, &id),
        |row| match target {
            Some(target) => row.state.settles_wait_for(target),
            None => row.ended(),
        },
    )
    .await?;
    Ok(axum::Json(row.to_api()))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands", tag = "commands", params(("id" = String, Path, description = "sandbox id"), ("limit" = Option<u32>, Query, minimum = 1, maximum = 200, description = "at most 200; default 50"), ("cursor" = Option<String>, Query, pattern = "^(cmd_[0-9a-f]{1,64})?$", description = "the next_cursor of the previous page"), ("state" = Option<CommandState>, Query, description = "only commands in this state, e.g. `running` (background work, with pids)")), responses((status = 200, body = CommandList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<axum::Json<CommandList>, ControlError> {
    visible_sandbox(&state, &org_id, &sandbox_id).await?;
    let mut limit = limits::LIST_LIMIT_DEFAULT;
    let mut cursor = String::new();
    let mut only = None;
    for (name, value) in query {
        match name.as_str() {
            "limit" => limit = limits::list_limit(&value)?,
            "cursor" => cursor = limits::cursor(&value, "cmd")?,
            "state" => {
                only = Some(value.parse::<CommandState>().map_err(|_| {
                    limits::invalid("state", format!("unknown command state {value:?}"))
                })?)
            }
            other => return Err(limits::invalid(other, "unknown query parameter")),
        }
    }
    let (commands, next_cursor) =
        records::commands::list(&state.db.pool, &sandbox_id, only, &cursor, limit).await?;
    Ok(axum::Json(CommandList {
        commands: commands.iter().map(CommandRow::to_api).collect(),
        next_cursor,
    }))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct OutputQuery {
    /// `stdout` (default) or `stderr`.
    #[param(schema_with = api::schema::stream)]
    stream: Option<String>,
    /// The first byte to read; past the end of the stream is 400.
    #[serde(default)]
    #[param(minimum = 0, maximum = 9_223_372_036_854_775_807_i64)]
    offset: u64,
    /// Seconds to wait for bytes past `offset`, at most 25 (default 0:
    /// answer at once).
    #[param(minimum = 0, maximum = 25)]
    timeout: Option<u64>,
}

/// Reads `stream` from `offset`: the bytes (raw) with `x-roost-next-offset`
/// and `x-roost-command-state`; `x-roost-complete: true` once the command
/// has ended and every byte has been read.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands/{command_id}/output", tag = "commands", params(("id" = String, Path, description = "sandbox id"), ("command_id" = String, Path, description = "command id"), OutputQuery), responses((status = 200, description = "raw bytes; headers x-roost-next-offset, x-roost-command-state, x-roost-complete", content_type = "application/octet-stream", body = Vec<u8>), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn output(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path((sandbox_id, id)): Path<(String, String)>,
    Query(query): Query<OutputQuery>,
) -> Result<Response, ControlError> {
    let stream = match query.stream.as_deref() {
        None => Stream::Stdout,
        Some(name) => {
            Stream::parse(name).ok_or_else(|| limits::invalid("stream", "stdout or stderr"))?
        }
    };
    let timeout = match query.timeout {
        None | Some(0) => std::time::Duration::ZERO,
        Some(t) => wait_timeout(Some(t))?,
    };
    let offset = limits::output_offset(query.offset)?;
    let watch = state.db.hub.watch(&id);
    let command = crate::hub::wait_until(
        &watch,
        timeout,
        || visible_command(&state, &org_id, &sandbox_id, &id),
        |c| c.ended() || stream.length_of(c) > offset,
    )
    .await?;
    let length = stream.length_of(&command);
    if offset > length {
        return Err(limits::invalid(
            "offset",
            format!("past the end of {} ({length} bytes)", stream.as_str()),
        ));
    }
    let data =
        records::commands::read_output(&state.db.pool, &id, stream, offset, OUTPUT_READ_BYTES_MAX)
            .await?;
    let next = offset + data.len() as i64;
    let complete = command.ended() && next >= length;
    let mut response = (StatusCode::OK, Body::from(data)).into_response();
    let headers = response.headers_mut();
    headers.insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert("x-roost-next-offset", HeaderValue::from(next));
    headers.insert(
        "x-roost-command-state",
        HeaderValue::from_static(command.state.as_str()),
    );
    headers.insert(
        "x-roost-complete",
        HeaderValue::from_static(if complete { "true" } else { "false" }),
    );
    Ok(response)
}

/// Asks a command to end. A queued one never starts (`not_launched`); a
/// started one gets the signal through its runner, which reports the end.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{command_id}/signal", tag = "commands", params(("id" = String, Path, description = "sandbox id"), ("command_id" = String, Path, description = "command id")), request_body = SignalRequest, responses((status = 202, body = Command), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn signal(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path((sandbox_id, id)): Path<(String, String)>,
    Json(request): Json<SignalRequest>,
) -> Result<(StatusCode, axum::Json<Command>), ControlError> {
    control::commands::check_signal(&request.signal)?;
    let command = visible_command(&state, &org_id, &sandbox_id, &id).await?;
    let mut tx = state.db.write().await?;
    let command = control::commands::signal(&mut tx, &command, &request.signal).await?;
    tx.commit().await?;
    Ok((StatusCode::ACCEPTED, axum::Json(command.to_api())))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct StdinQuery {
    /// Close the command's stdin after this body (default `true`); `false`
    /// leaves it open for a later request.
    close: Option<bool>,
}

/// Streams the body to a command's stdin (created with `stdin: true`),
/// in order, at the pace the command reads it, through the data path to
/// the runner holding the sandbox. Waits (up to 25 s) for a queued
/// command to reach its runner. One writer at a time: a second request
/// while one streams is 409, as is any after the stdin was closed or the
/// command ended.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{command_id}/stdin", tag = "commands", params(("id" = String, Path, description = "sandbox id"), ("command_id" = String, Path, description = "command id"), StdinQuery), request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "bytes for the command's stdin, any length"), responses((status = 200, description = "`{bytes, closed}`: how many bytes reached the command's stdin, and whether it is closed", body = Object), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn stdin(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path((sandbox_id, id)): Path<(String, String)>,
    Query(query): Query<StdinQuery>,
    body: Body,
) -> Result<Response, ControlError> {
    let stream = reqwest::Body::wrap_stream(body.into_data_stream());
    let close = query.close.unwrap_or(true);
    let relayed =
        control::data_path::send_stdin(&state, &org_id, &sandbox_id, &id, close, stream).await?;
    let status = StatusCode::from_u16(relayed.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut response = (status, Body::from(relayed.body)).into_response();
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

/// Sets the size of a command's terminal (created with `tty`): the
/// command gets SIGWINCH. 409 for a command without a terminal or not
/// running.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{command_id}/resize", tag = "commands", params(("id" = String, Path, description = "sandbox id"), ("command_id" = String, Path, description = "command id")), request_body = TtySize, responses((status = 200, description = "`{rows, cols}`: the terminal's size now", body = Object), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn resize(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path((sandbox_id, id)): Path<(String, String)>,
    Json(size): Json<TtySize>,
) -> Result<Response, ControlError> {
    let relayed = control::data_path::resize(&state, &org_id, &sandbox_id, &id, size).await?;
    Ok(relayed_response(relayed))
}

fn relayed_response(relayed: control::data_path::Relayed) -> Response {
    let status = StatusCode::from_u16(relayed.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut response = (status, Body::from(relayed.body)).into_response();
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The largest WebSocket message an attached client may send.
const ATTACH_MESSAGE_BYTES_MAX: usize = 1024 * 1024;

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AttachQuery {
    /// The first byte of output to send (reconnect from where you were).
    #[serde(default)]
    #[param(minimum = 0, maximum = 9_223_372_036_854_775_807_i64)]
    offset: u64,
}

/// Attaches to a command over a WebSocket: output (stdout; a terminal's
/// only stream) from `offset` as binary messages; binary messages from the
/// client are its stdin (the command needs `stdin` or `tty`); a text
/// message `{"type":"resize","rows":R,"cols":C}` resizes its terminal, and
/// `{"type":"eof"}` closes its stdin. Once it ended and every byte was
/// sent, one text message `{"type":"exit","state":…,"exit_code":…,
/// "signal":…,"state_reason":…}` and the close. Leaving never stops the
/// command: attach again from the offset you had.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands/{command_id}/attach", tag = "commands", params(("id" = String, Path, description = "sandbox id"), ("command_id" = String, Path, description = "command id"), AttachQuery), responses((status = 101, description = "switching to the WebSocket protocol"), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn attach(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path((sandbox_id, id)): Path<(String, String)>,
    Query(query): Query<AttachQuery>,
    headers: axum::http::HeaderMap,
    held: Option<axum::Extension<super::org_share::HeldPlaces>>,
    upgrade: axum::extract::ws::WebSocketUpgrade,
) -> Result<Response, ControlError> {
    // Kept to check again while the session lasts (`still_speaks_for`).
    let token = super::bearer_token(&headers).unwrap_or_default().to_owned();
    // The session holds its request's place in its org's share, and one
    // of the server's connections, for as long as it lasts: hyper hands
    // the connection over at the upgrade and forgets it.
    let place = match held {
        Some(axum::Extension(held)) => held.take(),
        None => vec![state.org_requests.take(&org_id)?],
    };
    let connection = state.connections.clone().try_acquire_owned().map_err(|_| {
        ControlError::new(
            api::ErrorCode::Unavailable,
            "this server serves as many connections as it may: attach again shortly",
        )
        .with_retry_after(1)
    })?;
    let open = crate::metrics::OpenConnection::new(state.metrics.clone());
    // Refused before the upgrade: an offset out of bounds (400), another
    // org's command (404).
    let offset = limits::output_offset(query.offset)?;
    Box::pin(visible_command(&state, &org_id, &sandbox_id, &id)).await?;
    control::idle::record(&state, &org_id, &sandbox_id, Activity::Attach).await?;
    // A message is at most what one stdin write takes: a client cannot
    // make the server hold more per connection than that and the feed's
    // bounded queue.
    let upgrade = upgrade
        .max_message_size(ATTACH_MESSAGE_BYTES_MAX)
        .max_frame_size(ATTACH_MESSAGE_BYTES_MAX);
    Ok(upgrade.on_upgrade(move |socket| async move {
        let session = AttachSession {
            state,
            org_id,
            token,
            sandbox_id,
            id,
            _held: (place, connection, open),
        };
        session.run(offset, socket).await;
    }))
}

/// How often an attached session checks that its token still speaks for
/// its org: a revoked token's terminal ends within this (and its server's
/// token cache time), and takes no input once refused.
const ATTACH_TOKEN_RECHECK: std::time::Duration = std::time::Duration::from_secs(5);
/// How long one message to the client may take to go out: a client that
/// stops reading its socket ends its session instead of holding it.
const ATTACH_SEND_STALL: std::time::Duration = std::time::Duration::from_secs(60);

struct AttachSession {
    state: AppState,
    org_id: String,
    token: String,
    sandbox_id: String,
    id: String,
    /// Its org's place, its connection's permit and its count as open.
    _held: (
        Vec<crate::control::org_share::OrgPlace>,
        tokio::sync::OwnedSemaphorePermit,
        crate::metrics::OpenConnection,
    ),
}

impl AttachSession {
    /// Whether the session's token still speaks for its org (a revoke
    /// reaches every server within the token cache's time).
    /// Only a definite answer ends it: a database out of reach for a
    /// moment (`Err`) is not a revoke.
    async fn still_speaks_for_org(&self) -> bool {
        match crate::auth::authenticate(&self.state.db, &self.token).await {
            Ok(Some(crate::auth::Principal::Org { org_id })) => org_id == self.org_id,
            Ok(_) => false,
            Err(err) => {
                tracing::debug!(%err, "attach: the token could not be checked now");
                true
            }
        }
    }

    async fn run(self, offset: i64, socket: axum::extract::ws::WebSocket) {
        let revoked = async {
            loop {
                tokio::time::sleep(ATTACH_TOKEN_RECHECK).await;
                if !self.still_speaks_for_org().await {
                    tracing::info!(command_id = %self.id, "attach: the token was revoked; the session ends");
                    return;
                }
            }
        };
        tokio::select! {
            () = self.stream(offset, socket) => {}
            () = revoked => {}
        }
    }

    async fn stream(&self, offset: i64, socket: axum::extract::ws::WebSocket) {
        let AttachSession {
            state,
            org_id,
            sandbox_id,
            id,
            ..
        } = self;
        use axum::extract::ws::Message;
        use futures::{SinkExt, StreamExt};
        let (mut sink, mut incoming) = socket.split();
        let output = async {
            let mut offset = offset;
            let watch = state.db.hub.watch(id);
            loop {
                let command = crate::hub::wait_until(
                    &watch,
                    std::time::Duration::from_secs(25),
                    || visible_command(state, org_id, sandbox_id, id),
                    |c| c.ended() || Stream::Stdout.length_of(c) > offset,
                )
                .await?;
                let length = Stream::Stdout.length_of(&command);
                if offset < length {
                    let data = records::commands::read_output(
                        &state.db.pool,
                        id,
                        Stream::Stdout,
                        offset,
                        OUTPUT_READ_BYTES_MAX,
                    )
                    .await?;
                    offset += data.len() as i64;
                    let sent = tokio::time::timeout(
                        ATTACH_SEND_STALL,
                        sink.send(Message::Binary(data.into())),
                    )
                    .await;
                    if !matches!(sent, Ok(Ok(()))) {
                        return Ok(());
                    }
                    continue;
                }
                if command.ended() {
                    let exit = serde_json::json!({
                        "type": "exit",
                        "state": command.state.as_str(),
                        "state_reason": command.state_reason,
                        "exit_code": command.exit_code,
                        "signal": command.signal,
                    });
                    let goodbye = async {
                        let _ = sink.send(Message::Text(exit.to_string().into())).await;
                        let _ = sink.close().await;
                    };
                    let _ = tokio::time::timeout(ATTACH_SEND_STALL, goodbye).await;
                    return Ok::<(), ControlError>(());
                }
            }
        };
        let input = async {
            let mut feed: Option<control::data_path::StdinSender> = None;
            while let Some(Ok(message)) = incoming.next().await {
                match message {
                    Message::Binary(bytes) => {
                        // No input once the token no longer speaks for the org
                        // (cached: a query every few seconds at most).
                        if !self.still_speaks_for_org().await {
                            break;
                        }
                        if feed.is_none() {
                            match control::data_path::stdin_feed(state, org_id, sandbox_id, id)
                                .await
                            {
                                Ok((sender, _task)) => feed = Some(sender),
                                Err(err) => {
                                    tracing::debug!(?err, "attach: no stdin for the command");
                                    continue;
                                }
                            }
                        }
                        if let Some(sender) = &feed
                            && sender.send(&bytes).await.is_err()
                        {
                            feed = None;
                        }
                    }
                    Message::Text(text) => {
                        let Ok(control_message) = serde_json::from_str::<serde_json::Value>(&text)
                        else {
                            continue;
                        };
                        match control_message["type"].as_str() {
                            Some("resize") => {
                                let size = TtySize {
                                    rows: control_message["rows"].as_u64().unwrap_or(0).min(65535)
                                        as u16,
                                    cols: control_message["cols"].as_u64().unwrap_or(0).min(65535)
                                        as u16,
                                };
                                if let Err(err) =
                                    control::data_path::resize(state, org_id, sandbox_id, id, size)
                                        .await
                                {
                                    tracing::debug!(?err, "attach: resize refused");
                                }
                            }
                            Some("eof") => {
                                // The open feed ends; its stdin is closed by
                                // an empty closing write.
                                feed = None;
                                let _ = control::data_path::send_stdin(
                                    state,
                                    org_id,
                                    sandbox_id,
                                    id,
                                    true,
                                    reqwest::Body::from(Vec::new()),
                                )
                                .await;
                            }
                            _ => {}
                        }
                    }
                    Message::Close(_) => break,
                    _ => {}
                }
            }
        };
        tokio::select! {
            result = output => {
                if let Err(err) = result {
                    tracing::debug!(?err, "attach: output ended");
                }
            }
            () = input => {}
        }
    }
}
