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

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, OnceLock};
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
    /// For a file transfer: keeps the sandbox awake while held; held by
    /// the transfer until its body ends ([`DataRoute::while_awake`]).
    pub awake: Option<KeepAwake>,
}

impl DataRoute {
    /// `stream` (a download's body), holding what keeps the sandbox
    /// awake until the stream ends or is dropped.
    pub fn while_awake<S: futures::Stream>(
        &mut self,
        stream: S,
    ) -> impl futures::Stream<Item = S::Item> + use<S> {
        use futures::StreamExt;
        let awake = self.awake.take();
        stream.map(move |item| {
            let _held = &awake;
            item
        })
    }
}

/// While held, records the sandbox's `files` activity every so often
/// ([`keep_awake_every`]): one request is activity once, as it starts, and
/// a transfer longer than the sandbox's idle timeout would otherwise be
/// slept through and cut.
#[derive(Debug)]
pub struct KeepAwake(tokio::task::AbortHandle);

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How often a transfer records activity: a third of the idle timeout, at
/// least a second, at most a minute.
pub fn keep_awake_every(timeout_s: u64) -> Duration {
    Duration::from_millis(timeout_s.saturating_mul(1000) / 3)
        .clamp(Duration::from_secs(1), Duration::from_secs(60))
}

fn keep_awake(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    timeout_s: i64,
) -> Option<KeepAwake> {
    if timeout_s <= 0 {
        return None;
    }
    let every = keep_awake_every(timeout_s as u64);
    let (state, org_id, sandbox_id) = (state.clone(), org_id.to_owned(), sandbox_id.to_owned());
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            if let Err(err) =
                super::idle::record(&state, &org_id, &sandbox_id, Activity::Files).await
            {
                tracing::debug!(%sandbox_id, ?err, "a transfer's activity not recorded");
            }
        }
    });
    Some(KeepAwake(task.abort_handle()))
}

/// The relay's client. It never follows a redirect: a runner answers
/// for itself, and a 3xx would have the server fetch whatever URL a
/// compromised runner names (cloud metadata, say) and stream it to an org
/// as a file; a 3xx is a bad answer ([`refusal`]). Names resolve only to
/// addresses servers may dial ([`dialable`]).
fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .redirect(reqwest::redirect::Policy::none())
            .dns_resolver(Arc::new(DialableOnly))
            .build()
            .unwrap_or_default()
    })
}

/// Whether servers may dial `ip` on a runner's data path: never a
/// link-local address (169.254.0.0/16 holds cloud metadata services,
/// which may hand out the store's credentials; fe80::/10) nor an
/// unspecified one (0.0.0.0, `::`: the server's own host). A runner names
/// its own data address, so a compromised one must not point the relay
/// at what only the server's host can reach. Loopback and private
/// addresses stay allowed: one-host deployments and private networks use
/// them.
pub fn dialable(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => !(v4.is_link_local() || v4.is_unspecified()),
        IpAddr::V6(v6) => !(v6.is_unicast_link_local() || v6.is_unspecified()),
    }
}

/// Why servers may not dial a data URL whose host is an address, if they
/// may not (a name is checked as it resolves, by [`DialableOnly`]).
pub fn undialable_data_url(url: &reqwest::Url) -> Option<String> {
    // The URL parser writes an address in its one form (an IPv6 one in
    // brackets; `http://2852039166/` as 169.254.169.254).
    let host = url.host_str()?;
    let ip: IpAddr = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .parse()
        .ok()?;
    (!dialable(ip)).then(|| {
        format!("{ip} is a link-local or unspecified address: name an address servers can dial")
    })
}

/// The relay's name resolution: the system's, keeping only dialable
/// addresses, so a name for 169.254.169.254 is refused as the address
/// itself is at registration.
struct DialableOnly;

impl reqwest::dns::Resolve for DialableOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_owned();
        Box::pin(async move {
            let found = tokio::net::lookup_host((name.as_str(), 0)).await?;
            let addresses: Vec<SocketAddr> = found.filter(|a| dialable(a.ip())).collect();
            if addresses.is_empty() {
                return Err(format!(
                    "{name} resolves to no address servers may dial (only link-local or unspecified ones)"
                )
                .into());
            }
            Ok(Box::new(addresses.into_iter()) as reqwest::dns::Addrs)
        })
    }
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
    let (url, key) = runner_data_path(state, runner_id).await?;
    let claims = DataClaims {
        sandbox_id: sandbox_id.to_owned(),
        epoch: epoch as u64,
        op: op.to_owned(),
        command_id: Some(command_id.to_owned()),
        subject: None,
        org_id: Some(sandbox.org_id.clone()),
        expires_unix_ms: now_ms() as u64 + TOKEN_LIFETIME_MS,
    };
    Ok(DataRoute {
        url: format!(
            "{}/v1/data/sandboxes/{sandbox_id}/commands/{command_id}/{op}",
            url.trim_end_matches('/')
        ),
        token: api::data_path::mint(&key, &claims),
        awake: None,
    })
}

/// What the runner answered to a stdin write or a resize: a success's
/// status and its small JSON body, passed on as they are (a refusal is
/// an error, [`refusal`]).
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

/// The most bytes one piece of a stdin feed carries, and the most pieces
/// its queue holds: a command that never reads its stdin makes a feed
/// hold at most 2 MiB queued (plus the one message its sender is
/// splitting). A queue of 64 whole messages held up to 64 of E2B's 3 MiB
/// inputs, about 200 MiB a call.
pub const STDIN_PIECE_BYTES_MAX: usize = 256 * 1024;
pub const STDIN_QUEUE_PIECES: usize = 8;
const _: () = assert!(STDIN_QUEUE_PIECES * STDIN_PIECE_BYTES_MAX <= 2 * 1024 * 1024);

/// The feed has ended: the runner answered (or the request failed) and
/// takes no more bytes.
#[derive(Debug)]
pub struct StdinFeedEnded;

/// The writing end of a stdin feed ([`stdin_feed`]).
#[derive(Clone, Debug)]
pub struct StdinSender {
    pieces: tokio::sync::mpsc::Sender<Vec<u8>>,
}

impl StdinSender {
    /// Queues `bytes` in pieces of at most [`STDIN_PIECE_BYTES_MAX`],
    /// waiting while [`STDIN_QUEUE_PIECES`] are queued. Each piece is a
    /// copy, so a queued piece never keeps a whole message alive.
    pub async fn send(&self, bytes: &[u8]) -> Result<(), StdinFeedEnded> {
        for piece in bytes.chunks(STDIN_PIECE_BYTES_MAX) {
            self.pieces
                .send(piece.to_vec())
                .await
                .map_err(|_| StdinFeedEnded)?;
        }
        Ok(())
    }
}

/// A stdin feed's two ends: the body streams what the sender queues, and
/// ends once every sender is dropped.
fn stdin_pieces() -> (
    StdinSender,
    impl futures::Stream<Item = Result<Vec<u8>, std::io::Error>> + Send + 'static,
) {
    let (pieces, mut receiver) = tokio::sync::mpsc::channel::<Vec<u8>>(STDIN_QUEUE_PIECES);
    let body = futures::stream::poll_fn(move |cx| {
        receiver
            .poll_recv(cx)
            .map(|piece| piece.map(Ok::<_, std::io::Error>))
    });
    (StdinSender { pieces }, body)
}

/// A command's stdin fed for as long as the sender lives (a terminal
/// attached over a WebSocket, E2B's StreamInput): the stdin stays open
/// after.
pub async fn stdin_feed(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    command_id: &str,
) -> Result<
    (
        StdinSender,
        tokio::task::JoinHandle<Result<Relayed, ControlError>>,
    ),
    ControlError,
> {
    let route = command_route(state, org_id, sandbox_id, command_id, "stdin").await?;
    let (sender, body) = stdin_pieces();
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

/// A runner out of reach, told to the org without the runner's address:
/// where a runner listens on the deployment's own network is not the
/// org's to learn (it is logged).
fn unreachable(err: reqwest::Error) -> ControlError {
    tracing::warn!(%err, "a runner's data path is out of reach");
    ControlError::new(
        ErrorCode::Unavailable,
        format!(
            "the sandbox's runner is unreachable on its data path: {}",
            err.without_url()
        ),
    )
}

/// The most bytes of a runner's answer read whole where it is not
/// streamed on: an error envelope, a stdin write's or a resize's JSON
/// (all a few hundred bytes). More is a bad answer: a compromised runner
/// must not make a server hold what it likes.
pub const ANSWER_BYTES_MAX: usize = 64 * 1024;

/// The most bytes of a file listing read whole (E2B's ListDir and Stat
/// translate it, so it is not streamed on). A sandbox's agent stops a
/// listing at 8 MiB of its JSON and says `truncated`
/// (`oci::agent::files::LIST_JSON_BYTES_MAX`); the runner's rendering of
/// the same entries is about as long (dates as text, modes in octal), so
/// a sound runner sends well under this.
pub const LISTING_BYTES_MAX: usize = 16 * 1024 * 1024;

/// `details.reason` of a 503 for an answer no sound runner gives: a
/// redirect, a body past its bound, a refusal without an envelope.
pub const REASON_RUNNER_BAD_ANSWER: &str = "runner_bad_answer";
/// `details.reason` of a 503 for a runner refusing the server's own
/// credential (a runner restarted with a new key, clocks apart): the
/// client's token was fine, and a retry may pass.
pub const REASON_RUNNER_REFUSED_CREDENTIAL: &str = "runner_refused_credential";

/// The runner's fault, not the client's: 503 `unavailable` (retryable),
/// `reason` in the details.
fn runner_fault(reason: &str, message: String) -> ControlError {
    ControlError::new(ErrorCode::Unavailable, message)
        .with_details(serde_json::json!({ "reason": reason }))
}

/// A runner's answer body, read whole up to `bytes_max`; more is a bad
/// answer (refused as soon as it is known, never read to its end).
pub async fn answer_bytes(
    mut answer: reqwest::Response,
    bytes_max: usize,
) -> Result<Vec<u8>, ControlError> {
    let too_large = || {
        runner_fault(
            REASON_RUNNER_BAD_ANSWER,
            format!("the sandbox's runner answered more than {bytes_max} bytes"),
        )
    };
    if answer
        .content_length()
        .is_some_and(|length| length > bytes_max as u64)
    {
        return Err(too_large());
    }
    let mut body = Vec::new();
    loop {
        let chunk = answer.chunk().await.map_err(|err| {
            ControlError::new(
                ErrorCode::Unavailable,
                format!("the runner's answer was cut: {err}"),
            )
        })?;
        let Some(chunk) = chunk else {
            return Ok(body);
        };
        if body.len() + chunk.len() > bytes_max {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
}

/// A runner's answer other than a success, as the client's refusal: its
/// envelope's code, message and details (a file not found, a full disk),
/// except where the runner, not the client, is at fault (503
/// `unavailable`): a redirect (never followed), a refusal of the
/// server's own credential (401, 403, `unauthenticated`: passed on, the
/// client would take its own token for bad), a body past
/// [`ANSWER_BYTES_MAX`] or without an envelope.
pub async fn refusal(answer: reqwest::Response) -> ControlError {
    let status = answer.status();
    let refused_credential = || {
        runner_fault(
            REASON_RUNNER_REFUSED_CREDENTIAL,
            format!(
                "the sandbox's runner refused this server's credential ({status}): it may have restarted; retry"
            ),
        )
    };
    if status.is_redirection() {
        return runner_fault(
            REASON_RUNNER_BAD_ANSWER,
            format!("the sandbox's runner answered {status}, a redirect (never followed)"),
        );
    }
    if matches!(status.as_u16(), 401 | 403) {
        return refused_credential();
    }
    let bytes = match answer_bytes(answer, ANSWER_BYTES_MAX).await {
        Ok(bytes) => bytes,
        Err(error) => return error,
    };
    match serde_json::from_slice::<api::ErrorBody>(&bytes) {
        Ok(body) if body.error.code == ErrorCode::Unauthenticated => refused_credential(),
        Ok(body) => {
            ControlError::new(body.error.code, body.error.message).with_details(body.error.details)
        }
        Err(_) => runner_fault(
            REASON_RUNNER_BAD_ANSWER,
            format!("the sandbox's runner answered {status} without an error envelope"),
        ),
    }
}

/// A stdin write's or a resize's answer: a success with its JSON (at most
/// [`ANSWER_BYTES_MAX`]), or the refusal.
async fn relayed(answer: reqwest::Response) -> Result<Relayed, ControlError> {
    let status = answer.status();
    if !status.is_success() {
        return Err(refusal(answer).await);
    }
    let body = answer_bytes(answer, ANSWER_BYTES_MAX).await?;
    Ok(Relayed {
        status: status.as_u16(),
        body,
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
            if reqwest::Url::parse(&url)
                .ok()
                .is_none_or(|url| undialable_data_url(&url).is_some())
            {
                continue;
            }
            let subject = format!("{}/{}", mount.filesystem, mount.subpath);
            let claims = DataClaims {
                sandbox_id: String::new(),
                epoch: 0,
                op: "filesystem.check".to_owned(),
                command_id: None,
                subject: Some(subject.clone()),
                org_id: None,
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
        // Still running, but a stop is decided (its idle deadline passed
        // just before this call, or a stop was asked): the runner may be
        // stopping it already, and would cut the transfer.
        _ if super::idle::stop_under_way(&sandbox) => {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                format!(
                    "sandbox {sandbox_id} is stopping ({}): its files are reachable once it runs again",
                    sandbox
                        .desired_reason
                        .as_deref()
                        .unwrap_or("stop_requested")
                ),
            ));
        }
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
        org_id: Some(sandbox.org_id.clone()),
        expires_unix_ms: now_ms() as u64 + TOKEN_LIFETIME_MS,
    };
    Ok(DataRoute {
        url: format!(
            "{}/v1/data/sandboxes/{sandbox_id}/files{suffix}",
            url.trim_end_matches('/')
        ),
        token: api::data_path::mint(&key, &claims),
        awake: keep_awake(state, org_id, sandbox_id, sandbox.idle.timeout_s),
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
    // Registration refuses such a URL; this catches one a runner
    // registered before it did.
    let undialable = match reqwest::Url::parse(&url) {
        Ok(parsed) => undialable_data_url(&parsed),
        Err(err) => Some(err.to_string()),
    };
    if let Some(why) = undialable {
        return Err(ControlError::new(
            ErrorCode::Unavailable,
            format!("runner {runner_id}'s data URL cannot be dialed: {why}"),
        ));
    }
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
/// (streamed on by the caller, never buffered whole here). The caller
/// turns anything but a success into the client's error with
/// [`refusal`].
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
    request.send().await.map_err(unreachable)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    /// Audit finding (HTTP surface): the 503 an org got when its runner was
    /// out of reach named the runner's address (reqwest's message ends
    /// `for url (http://10.…:PORT/…)`).
    #[tokio::test]
    async fn an_unreachable_runner_is_not_named_by_its_address() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = closed.local_addr().expect("address");
        drop(closed);
        let err = reqwest::Client::new()
            .get(format!("http://{address}/v1/data/secret-path"))
            .send()
            .await
            .expect_err("nothing listens there");
        let refused = unreachable(err);
        assert!(!refused.message.contains("http://"), "{}", refused.message);
        assert!(
            !refused.message.contains(&address.port().to_string()),
            "{}",
            refused.message
        );
    }

    /// A runner's answer with `status` and `body` (built with hyper's
    /// types, which reqwest's response is made from).
    fn answer(status: u16, body: reqwest::Body) -> reqwest::Response {
        reqwest::Response::from(
            hyper::Response::builder()
                .status(status)
                .body(body)
                .expect("a response"),
        )
    }

    fn envelope(code: ErrorCode, message: &str) -> reqwest::Body {
        let body = serde_json::json!({
            "error": { "code": code.as_str(), "message": message, "details": { "reason": "r" },
                       "request_id": "req_1" },
        });
        reqwest::Body::from(body.to_string())
    }

    /// A body of 256 chunks of 16 KiB (4 MiB), counting the chunks read.
    fn long(read: &Arc<std::sync::atomic::AtomicUsize>) -> reqwest::Body {
        let read = read.clone();
        reqwest::Body::wrap_stream(futures::stream::iter(0..256).map(move |_| {
            read.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, std::io::Error>(vec![b'x'; 16 * 1024])
        }))
    }

    /// Whether a read of [`long`] stopped early (at its bound).
    fn stopped_early(read: &std::sync::atomic::AtomicUsize) -> bool {
        read.load(std::sync::atomic::Ordering::SeqCst) < 256
    }

    async fn refused(answer: reqwest::Response) -> ControlError {
        tokio::time::timeout(Duration::from_secs(30), refusal(answer))
            .await
            .expect("a refusal is read within a bound")
    }

    fn reason(error: &ControlError) -> &str {
        error.details["reason"].as_str().unwrap_or("")
    }

    /// Audit findings: a runner's 401 reached the client as its own
    /// token's fault; a redirect was followed; an error body was read
    /// whole, however long.
    #[tokio::test]
    async fn a_runner_at_fault_is_unavailable_and_its_refusals_pass_on() {
        // The runner's own refusals keep their code and details.
        let error = refused(answer(404, envelope(ErrorCode::NotFound, "no such file"))).await;
        assert_eq!(error.code, ErrorCode::NotFound);
        assert_eq!(error.message, "no such file");
        assert_eq!(reason(&error), "r");

        // The runner refused the server's credential: the client's token
        // was fine, so not 401, and a retry may pass.
        for (status, body) in [
            (401, envelope(ErrorCode::Unauthenticated, "bad token")),
            (403, reqwest::Body::from("forbidden")),
            (409, envelope(ErrorCode::Unauthenticated, "expired token")),
        ] {
            let error = refused(answer(status, body)).await;
            assert_eq!(error.code, ErrorCode::Unavailable, "{status}");
            assert_eq!(error.code.status(), 503);
            assert_eq!(reason(&error), REASON_RUNNER_REFUSED_CREDENTIAL, "{status}");
            assert!(
                error.message.contains("refused this server's credential"),
                "{}",
                error.message
            );
        }

        // Answers no sound runner gives.
        let padded = "x".repeat(ANSWER_BYTES_MAX);
        let read = Arc::default();
        for (status, body) in [
            (302, reqwest::Body::from("moved")),
            (307, reqwest::Body::from("")),
            (500, reqwest::Body::from("<html>")),
            (404, envelope(ErrorCode::NotFound, &padded)),
            (404, long(&read)),
        ] {
            let error = refused(answer(status, body)).await;
            assert_eq!(error.code, ErrorCode::Unavailable, "{status}");
            assert_eq!(reason(&error), REASON_RUNNER_BAD_ANSWER, "{status}");
        }
        assert!(stopped_early(&read), "a long refusal was read to its end");
    }

    #[tokio::test]
    async fn a_stdin_answer_is_read_within_its_bound() {
        let read = |answer| async {
            tokio::time::timeout(Duration::from_secs(30), relayed(answer))
                .await
                .expect("an answer is read within a bound")
        };
        let ok = read(answer(200, reqwest::Body::from(r#"{"bytes":3}"#)))
            .await
            .expect("a success");
        assert_eq!(
            (ok.status, ok.body.as_slice()),
            (200, &br#"{"bytes":3}"#[..])
        );
        let chunks = Arc::default();
        // Not `expect_err`: it would print the 4 MiB taken.
        let Err(error) = read(answer(200, long(&chunks))).await else {
            panic!("an answer past its bound was taken");
        };
        assert_eq!(reason(&error), REASON_RUNNER_BAD_ANSWER);
        assert!(stopped_early(&chunks), "a long answer was read to its end");
        let refusal = answer(401, envelope(ErrorCode::Unauthenticated, "bad token"));
        let Err(error) = read(refusal).await else {
            panic!("a refusal was taken for a success");
        };
        assert_eq!(error.code, ErrorCode::Unavailable);
        assert_eq!(reason(&error), REASON_RUNNER_REFUSED_CREDENTIAL);
    }

    #[tokio::test]
    async fn an_answer_past_its_bound_is_refused_whole_or_streamed() {
        let exact = vec![b'x'; 1000];
        let body = answer_bytes(answer(200, reqwest::Body::from(exact.clone())), 1000)
            .await
            .expect("at the bound");
        assert_eq!(body, exact);
        // Refused by its length before a byte is read, and by counting.
        for body in [
            reqwest::Body::from(vec![b'x'; 1001]),
            reqwest::Body::wrap_stream(futures::stream::iter(
                [vec![b'x'; 600], vec![b'x'; 401]].map(Ok::<_, std::io::Error>),
            )),
        ] {
            let Err(error) = answer_bytes(answer(200, body), 1000).await else {
                panic!("an answer past its bound was taken");
            };
            assert_eq!(reason(&error), REASON_RUNNER_BAD_ANSWER);
        }
    }

    /// Audit finding: a feed queued 64 whole messages (E2B's up to 3 MiB
    /// of input each) for a command that never read its stdin.
    #[tokio::test]
    async fn a_stdin_feed_queues_a_bounded_number_of_bytes() {
        let (sender, body) = stdin_pieces();
        let message: Vec<u8> = (0..4 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let sending = {
            let sender = sender.clone();
            let message = message.clone();
            tokio::spawn(async move { sender.send(&message).await })
        };
        // Nobody reads: the send waits once the queue is full.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!sending.is_finished(), "a 4 MiB message was queued whole");
        assert_eq!(sender.pieces.capacity(), 0, "the queue is full");

        // Read, the bytes come in order, in pieces within the bound.
        drop(sender);
        let pieces: Vec<Vec<u8>> = body.map(|piece| piece.expect("a piece")).collect().await;
        sending
            .await
            .expect("the send ends")
            .expect("the feed took every byte");
        assert!(pieces.iter().all(|p| p.len() <= STDIN_PIECE_BYTES_MAX));
        assert_eq!(pieces.concat(), message);
    }

    #[tokio::test]
    async fn names_resolve_only_to_dialable_addresses() {
        use reqwest::dns::Resolve;
        use std::str::FromStr;
        let resolve =
            |name: &str| DialableOnly.resolve(reqwest::dns::Name::from_str(name).expect("a name"));
        let found: Vec<SocketAddr> = resolve("127.0.0.1").await.expect("loopback").collect();
        assert_eq!(found.len(), 1);
        for undialable in ["169.254.169.254", "0.0.0.0"] {
            assert!(resolve(undialable).await.is_err(), "{undialable}");
        }
    }
}
