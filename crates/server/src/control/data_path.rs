//! Streams between a client and the runner holding its sandbox (the data
//! path, DESIGN.md §1 and §3): a command's stdin, and a sandbox's files
//! (`files_route`, `relay`).
//!
//! Runners still dial out for control; for data, each runner listens on
//! its own data address (given at registration, with a random key) and
//! accepts only requests carrying a token a server minted for that very
//! request with the runner's key (`api::data_path`). So any server of a
//! deployment on one database serves any sandbox's streams, straight to
//! its runner: no server forwards to another, and nothing on a runner
//! takes an unauthenticated request. The org check is here, before a
//! token exists: an org reaches only its own sandboxes.

use std::sync::OnceLock;
use std::time::Duration;

use api::ErrorCode;
use api::data_path::{DataClaims, TOKEN_LIFETIME_MS};
use api::lifecycle::{Activity, CommandState, SandboxState};

use super::AppState;
use crate::db::now_ms;
use crate::error::ControlError;
use crate::records;

/// How long a stream waits for a queued command to be handed to its
/// runner before it is refused.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(25);

/// Where a stream goes, and its credential.
#[derive(Debug)]
pub struct DataRoute {
    /// The runner's data URL and the path under it.
    pub url: String,
    pub token: String,
}

fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .unwrap_or_default()
    })
}

/// The route for `op` on the org's command: waits for a queued command
/// to be handed over; refuses one that ended (409) and a sandbox whose
/// runner has no data path (503).
pub async fn command_route(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    command_id: &str,
    op: &str,
) -> Result<DataRoute, ControlError> {
    // Writing to a command (stdin, its terminal) is activity.
    let activity = if op == "stdin" {
        Activity::Stdin
    } else {
        Activity::Attach
    };
    super::idle::record(state, org_id, sandbox_id, activity).await?;
    let watch = state.db.hub.watch(command_id);
    let command = crate::hub::wait_until(
        &watch,
        HANDOVER_WAIT,
        || async {
            records::commands::visible(&state.db, org_id, sandbox_id, command_id)
                .await?
                .ok_or_else(|| records::not_found("command"))
        },
        |row| row.state != CommandState::Queued,
    )
    .await?;
    if command.ended() {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("command {command_id} has ended ({})", command.state),
        ));
    }
    if command.state == CommandState::Queued {
        // Commands are handed only to running sandboxes.
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("command {command_id} is still queued: its sandbox is not running"),
        ));
    }
    let since = state.retained_since_ms();
    let sandbox = records::sandboxes::visible(&state.db, org_id, sandbox_id, since)
        .await?
        .ok_or_else(|| records::not_found("sandbox"))?;
    let (Some(runner_id), Some(epoch)) = (&sandbox.runner_id, command.epoch) else {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("sandbox {sandbox_id} is not placed"),
        ));
    };
    if sandbox.state != SandboxState::Running || sandbox.epoch != epoch {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!("sandbox {sandbox_id} is {}, not running", sandbox.state),
        ));
    }
    let Some((url, key)) = records::runners::data_path(&state.db.pool, runner_id).await? else {
        return Err(ControlError::new(
            ErrorCode::Unavailable,
            format!("runner {runner_id} offers no data path (an older runner?)"),
        ));
    };
    let Some(key) = api::data_path::parse_key(&key) else {
        return Err(ControlError::new(
            ErrorCode::Internal,
            format!("runner {runner_id}'s data key is unreadable"),
        ));
    };
    let claims = DataClaims {
        sandbox_id: sandbox_id.to_owned(),
        epoch: epoch as u64,
        op: op.to_owned(),
        command_id: Some(command_id.to_owned()),
        subject: None,
        expires_unix_ms: now_ms() as u64 + TOKEN_LIFETIME_MS,
    };
    Ok(DataRoute {
        url: format!(
            "{}/v1/data/sandboxes/{sandbox_id}/commands/{command_id}/{op}",
            url.trim_end_matches('/')
        ),
        token: api::data_path::mint(&key, &claims),
    })
}

/// What the runner answered: its status and body, passed on as they are
/// (its errors are the API's envelopes, with stable codes).
#[derive(Debug)]
pub struct Relayed {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Streams `body` to the org's command's stdin (closing it after, if
/// `close`).
pub async fn send_stdin(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    command_id: &str,
    close: bool,
    body: reqwest::Body,
) -> Result<Relayed, ControlError> {
    let route = command_route(state, org_id, sandbox_id, command_id, "stdin").await?;
    let answer = client()
        .post(&route.url)
        .query(&[("close", close)])
        .bearer_auth(&route.token)
        .body(body)
        .send()
        .await
        .map_err(unreachable)?;
    relayed(answer).await
}

/// Sets the size of the org's command's terminal.
pub async fn resize(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    command_id: &str,
    size: api::commands::TtySize,
) -> Result<Relayed, ControlError> {
    if !size.is_valid() {
        return Err(crate::limits::invalid(
            "rows",
            format!("1 to {} rows and columns", api::commands::TtySize::MAX),
        ));
    }
    let route = command_route(state, org_id, sandbox_id, command_id, "resize").await?;
    let answer = client()
        .post(&route.url)
        .query(&[("rows", size.rows), ("cols", size.cols)])
        .bearer_auth(&route.token)
        .send()
        .await
        .map_err(unreachable)?;
    relayed(answer).await
}

/// A command's stdin fed from a channel for as long as the sender lives
/// (a terminal attached over a WebSocket): the stdin stays open after.
pub async fn stdin_feed(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    command_id: &str,
) -> Result<
    (
        tokio::sync::mpsc::Sender<Vec<u8>>,
        tokio::task::JoinHandle<Result<Relayed, ControlError>>,
    ),
    ControlError,
> {
    let route = command_route(state, org_id, sandbox_id, command_id, "stdin").await?;
    let (sender, mut receiver) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
    let body = futures::stream::poll_fn(move |cx| {
        receiver
            .poll_recv(cx)
            .map(|chunk| chunk.map(Ok::<_, std::io::Error>))
    });
    let request = client()
        .post(&route.url)
        .query(&[("close", false)])
        .bearer_auth(&route.token)
        .body(reqwest::Body::wrap_stream(body));
    let task = tokio::spawn(async move {
        let answer = request.send().await.map_err(unreachable)?;
        relayed(answer).await
    });
    Ok((sender, task))
}

fn unreachable(err: reqwest::Error) -> ControlError {
    ControlError::new(
        ErrorCode::Unavailable,
        format!("the sandbox's runner is unreachable on its data path: {err}"),
    )
}

async fn relayed(answer: reqwest::Response) -> Result<Relayed, ControlError> {
    let status = answer.status().as_u16();
    let body = answer.bytes().await.map_err(|err| {
        ControlError::new(
            ErrorCode::Unavailable,
            format!("the runner's answer was cut: {err}"),
        )
    })?;
    Ok(Relayed {
        status,
        body: body.to_vec(),
    })
}

/// How many runners offering a filesystem are asked whether a directory
/// exists before the create goes on unchecked (the runner then checks at
/// launch, `mount_source_missing`).
const MOUNT_CHECK_RUNNERS_MAX: usize = 3;

/// Refuses a create whose shared mounts name a directory that does not
/// exist (422, naming it; nothing created), asking a live runner that
/// offers the filesystem over its data path. Called before the create's
/// transaction: no network call is made while it holds the database.
pub async fn check_mount_sources(
    state: &AppState,
    org_id: &str,
    mounts: &[api::sandboxes::Mount],
) -> Result<(), ControlError> {
    for mount in mounts.iter().filter(|m| !m.subpath.is_empty()) {
        // Only the org's own filesystems are looked into: for any other,
        // admission refuses the binding and no runner is asked anything.
        if !records::filesystems::is_bound(&state.db.pool, &mount.filesystem, org_id).await? {
            continue;
        }
        let capability = format!("filesystem:{}", mount.filesystem);
        let runners =
            records::runners::live_data_paths(&state.db.pool, &capability, now_ms()).await?;
        for (runner_id, url, key) in runners.into_iter().take(MOUNT_CHECK_RUNNERS_MAX) {
            let Some(key) = api::data_path::parse_key(&key) else {
                continue;
            };
            let subject = format!("{}/{}", mount.filesystem, mount.subpath);
            let claims = DataClaims {
                sandbox_id: String::new(),
                epoch: 0,
                op: "filesystem.check".to_owned(),
                command_id: None,
                subject: Some(subject.clone()),
                expires_unix_ms: now_ms() as u64 + TOKEN_LIFETIME_MS,
            };
            let answer = client()
                .post(format!(
                    "{}/v1/data/filesystems/check",
                    url.trim_end_matches('/')
                ))
                .query(&[
                    ("filesystem", &mount.filesystem),
                    ("subpath", &mount.subpath),
                ])
                .bearer_auth(api::data_path::mint(&key, &claims))
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            match answer.map(|a| a.status().as_u16()) {
                Ok(200) => break,
                Ok(404) => {
                    return Err(ControlError::new(
                        ErrorCode::UnsupportedCapability,
                        format!(
                            "shared filesystem {} has no directory {:?} (it must exist; nothing was created)",
                            mount.filesystem, mount.subpath
                        ),
                    )
                    .with_details(serde_json::json!({
                        "missing": [format!("directory:{subject}")],
                    })));
                }
                Ok(400) => {
                    return Err(crate::limits::invalid(
                        "mounts.subpath",
                        format!(
                            "{:?} leads outside filesystem {}",
                            mount.subpath, mount.filesystem
                        ),
                    ));
                }
                // That runner could not say: ask another.
                other => {
                    tracing::debug!(%runner_id, ?other, "a runner could not check a shared directory");
                }
            }
        }
    }
    Ok(())
}

/// The route to the files of the org's sandbox (`api::files::ops`, no
/// command): the sandbox must be running on a runner with a data path.
/// Another org's sandbox, or one past retention, is 404; one not running
/// 409; a runner without a data path 503. `suffix` follows `…/files`
/// (`""`, `/list`, `/tar`…).
pub async fn files_route(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    op: &str,
    suffix: &str,
) -> Result<DataRoute, ControlError> {
    super::idle::record(state, org_id, sandbox_id, Activity::Files).await?;
    let since = state.retained_since_ms();
    let sandbox = records::sandboxes::visible(&state.db, org_id, sandbox_id, since)
        .await?
        .ok_or_else(|| records::not_found("sandbox"))?;
    let runner_id = match (&sandbox.runner_id, sandbox.state) {
        (Some(runner_id), SandboxState::Running) => runner_id,
        _ => {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                format!(
                    "sandbox {sandbox_id} is {}, not running: its files are reachable only while it runs",
                    sandbox.state
                ),
            ));
        }
    };
    let (url, key) = runner_data_path(state, runner_id).await?;
    let claims = DataClaims {
        sandbox_id: sandbox_id.to_owned(),
        epoch: sandbox.epoch as u64,
        op: op.to_owned(),
        command_id: None,
        subject: None,
        expires_unix_ms: now_ms() as u64 + TOKEN_LIFETIME_MS,
    };
    Ok(DataRoute {
        url: format!(
            "{}/v1/data/sandboxes/{sandbox_id}/files{suffix}",
            url.trim_end_matches('/')
        ),
        token: api::data_path::mint(&key, &claims),
    })
}

/// A runner's data URL and key.
async fn runner_data_path(
    state: &AppState,
    runner_id: &str,
) -> Result<(String, [u8; api::data_path::KEY_BYTES]), ControlError> {
    let Some((url, key)) = records::runners::data_path(&state.db.pool, runner_id).await? else {
        return Err(ControlError::new(
            ErrorCode::Unavailable,
            format!("runner {runner_id} offers no data path (an older runner?)"),
        ));
    };
    let Some(key) = api::data_path::parse_key(&key) else {
        return Err(ControlError::new(
            ErrorCode::Internal,
            format!("runner {runner_id}'s data key is unreadable"),
        ));
    };
    Ok((url, key))
}

/// A request body for the runner: streamed, or JSON.
#[derive(Debug)]
pub enum RelayBody {
    None,
    Json(Vec<u8>),
    Stream(reqwest::Body),
}

/// Sends a request on `route` with `query` and `body`; the runner's
/// answer as it comes: its status and headers, the body still to read
/// (streamed on by the caller, never buffered whole here). Its errors are
/// the API's envelopes.
pub async fn relay(
    route: &DataRoute,
    method: reqwest::Method,
    query: &[(&str, String)],
    body: RelayBody,
) -> Result<reqwest::Response, ControlError> {
    let mut request = client()
        .request(method, &route.url)
        .query(query)
        .bearer_auth(&route.token);
    request = match body {
        RelayBody::None => request,
        RelayBody::Json(bytes) => request
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(bytes),
        RelayBody::Stream(stream) => request
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(stream),
    };
    request.send().await.map_err(|err| {
        ControlError::new(
            ErrorCode::Unavailable,
            format!("the sandbox's runner is unreachable on its data path: {err}"),
        )
    })
}
