//! The runner's data listener: streams for the sandboxes this runner
//! holds (see `server::control::data_path` for the design). Every request
//! carries a token a server minted for it with this runner's key
//! (`api::data_path`); a request without one, with a forged or expired
//! one, or for a sandbox this runner does not hold at the token's epoch
//! is refused before anything of the sandbox is touched. Errors are the
//! API's envelopes, so a server passes them on as they are.
//!
//! Routes:
//! - `POST /v1/data/sandboxes/{id}/commands/{cmd}/stdin?close=BOOL`: the
//!   body goes to the command's stdin through the sandbox's agent, in
//!   order, with back-pressure; `close` ends the stdin after it.
//! - `POST /v1/data/sandboxes/{id}/commands/{cmd}/resize?rows=R&cols=C`:
//!   the command's terminal's new size.
//! - `POST /v1/data/filesystems/check?filesystem=ID&subpath=P`: whether
//!   the directory exists in a shared filesystem this runner declares
//!   (200, 404 missing, 400 leading outside it), for admission.
//! - `/v1/data/sandboxes/{id}/files…`: the sandbox's files through its
//!   agent (`data_files`).

use std::sync::Arc;
use std::time::Duration;

use api::ErrorCode;
use api::data_path::{DataClaims, KEY_BYTES};
use api::write_stall::WRITE_STALL;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use super::Shared;
use oci::config::SandboxId;

/// How long a stdin request waits for the agent to know its command (the
/// runner launches it just after the server handed it over).
const LAUNCH_WAIT: Duration = Duration::from_secs(10);

/// The data listener's state.
pub(crate) struct DataPlane {
    pub(crate) shared: Arc<Shared>,
    pub(crate) key: [u8; KEY_BYTES],
    pub(crate) in_flight: Arc<InFlight>,
    /// Listings built at once.
    pub(crate) listings: Listings,
}

/// Listings the data listener builds at once: each is held whole, up to
/// `oci::agent::files_client::LISTING_BYTES_MAX` of JSON as read and as
/// much again as written, so this bounds their memory (about 150 MiB at
/// worst) however many are asked for.
pub(crate) const LISTINGS_AT_ONCE: usize = 8;
/// Of those, how many one sandbox may have: its agent answers as slowly
/// as it likes (within `LISTING_DEADLINE`), and the others stay for the
/// other sandboxes here.
pub(crate) const LISTINGS_PER_SANDBOX: usize = 2;
/// And how many one org's sandboxes may have together: an org with many
/// sandboxes here, their agents answering slowly, leaves the other half
/// to the other orgs.
pub(crate) const LISTINGS_PER_ORG: usize = LISTINGS_AT_ONCE / 2;
/// How long a listing waits for its turn before it is refused (503).
pub(crate) const LISTING_TURN_WAIT: std::time::Duration = std::time::Duration::from_secs(30);
/// The longest a listing may take, its agent's answer whole.
pub(crate) const LISTING_DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

/// The turns of the listings built at once: [`LISTINGS_AT_ONCE`] in all,
/// [`LISTINGS_PER_ORG`] an org, [`LISTINGS_PER_SANDBOX`] a sandbox.
pub(crate) struct Listings {
    all: Arc<tokio::sync::Semaphore>,
    /// Listings under way by `sandbox/ID` and `org/ID`.
    shares: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
}

/// One place in a sandbox's or an org's share of the listings, given back
/// when dropped.
struct Share {
    shares: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    key: String,
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut shares = locked(&self.shares);
        if let Some(count) = shares.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                shares.remove(&self.key);
            }
        }
    }
}

/// A listing's turn, given back when dropped.
pub(crate) struct ListingTurn {
    _all: tokio::sync::OwnedSemaphorePermit,
    _shares: Vec<Share>,
}

impl Listings {
    pub(crate) fn new() -> Listings {
        Listings {
            all: Arc::new(tokio::sync::Semaphore::new(LISTINGS_AT_ONCE)),
            shares: Arc::default(),
        }
    }

    /// A turn for a listing of `sandbox` (of `org`, where the token says):
    /// refused at once past the sandbox's or the org's share, and after
    /// [`LISTING_TURN_WAIT`] without one.
    pub(crate) async fn turn(
        &self,
        org: Option<&str>,
        sandbox: &str,
    ) -> Result<ListingTurn, String> {
        let shares = {
            let mut counts = locked(&self.shares);
            let mut wanted = vec![(
                format!("sandbox/{sandbox}"),
                LISTINGS_PER_SANDBOX,
                format!("sandbox {sandbox}"),
            )];
            if let Some(org) = org {
                wanted.push((format!("org/{org}"), LISTINGS_PER_ORG, format!("org {org}")));
            }
            if let Some((_, max, whose)) = wanted
                .iter()
                .find(|(key, max, _)| counts.get(key).copied().unwrap_or(0) >= *max)
            {
                return Err(format!(
                    "this runner builds {max} listings at once for {whose}"
                ));
            }
            wanted
                .into_iter()
                .map(|(key, _, _)| {
                    *counts.entry(key.clone()).or_insert(0) += 1;
                    Share {
                        shares: self.shares.clone(),
                        key,
                    }
                })
                .collect::<Vec<_>>()
        };
        match tokio::time::timeout(LISTING_TURN_WAIT, self.all.clone().acquire_owned()).await {
            Ok(Ok(all)) => Ok(ListingTurn {
                _all: all,
                _shares: shares,
            }),
            Ok(Err(_)) | Err(_) => Err(format!(
                "this runner builds {LISTINGS_AT_ONCE} listings at once and none ended within {} s",
                LISTING_TURN_WAIT.as_secs()
            )),
        }
    }
}

/// A refusal, as the API's envelope.
struct Refusal {
    code: ErrorCode,
    message: String,
}

fn refuse(code: ErrorCode, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = api::ErrorBody {
            error: api::ErrorDetail {
                code: self.code,
                message: self.message,
                details: serde_json::Value::Null,
                request_id: String::new(),
            },
        };
        let status =
            StatusCode::from_u16(self.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(body)).into_response()
    }
}

/// Requests the data listener serves at once, and at once for one
/// sandbox. Each holds a connection to the sandbox's agent (a download, a
/// listing of up to the agent's bound, a stdin stream) and file
/// descriptors for as long as its client reads: without a bound, one org
/// opening streams it never reads would take every descriptor of a runner
/// other orgs' sandboxes share. Past either bound the answer is 503
/// `unavailable` at once (the server passes it on; clients retry).
const REQUESTS_AT_ONCE_MAX: usize = 256;
const REQUESTS_PER_SANDBOX_MAX: usize = 32;
/// Of those, one org's (its token says which): an org with many sandboxes
/// here leaves the other half to the others.
const REQUESTS_PER_ORG_MAX: usize = REQUESTS_AT_ONCE_MAX / 2;
/// A connection that has not sent a whole request's headers within this
/// long (idle between requests included) is closed: nothing but a
/// verified token holds a connection open for longer.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// What the data listener serves at once: in all, per sandbox and per org.
#[derive(Default)]
pub(crate) struct InFlight {
    all: std::sync::Mutex<usize>,
    per_sandbox: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    per_org: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

/// One request's place among those served at once, given back when its
/// answer (body included) is done or dropped.
struct Place {
    in_flight: Arc<InFlight>,
    sandbox: Option<String>,
    org: Option<String>,
}

/// Whom a request is for, as its verified token says.
#[derive(Clone, Copy, Default)]
struct For<'a> {
    sandbox: Option<&'a str>,
    org: Option<&'a str>,
}

/// Gives one place of `key` back in `counts`.
fn give_back(counts: &std::sync::Mutex<std::collections::HashMap<String, usize>>, key: &str) {
    let mut counts = locked(counts);
    if let Some(count) = counts.get_mut(key) {
        *count -= 1;
        if *count == 0 {
            counts.remove(key);
        }
    }
}

fn locked<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl InFlight {
    /// A place for a request (on a sandbox of an org, if it says), or the
    /// refusal naming the bound reached. Every bound is checked before any
    /// count moves.
    fn take(self: &Arc<Self>, who: For<'_>) -> Result<Place, Refusal> {
        let unavailable = |message: String| refuse(ErrorCode::Unavailable, message);
        let mut all = locked(&self.all);
        if *all >= REQUESTS_AT_ONCE_MAX {
            return Err(unavailable(format!(
                "this runner serves {REQUESTS_AT_ONCE_MAX} data requests at once"
            )));
        }
        let mut per_sandbox = locked(&self.per_sandbox);
        let mut per_org = locked(&self.per_org);
        if let Some(sandbox) = who.sandbox
            && per_sandbox.get(sandbox).copied().unwrap_or(0) >= REQUESTS_PER_SANDBOX_MAX
        {
            return Err(unavailable(format!(
                "this runner serves {REQUESTS_PER_SANDBOX_MAX} data requests at once for sandbox {sandbox}"
            )));
        }
        if let Some(org) = who.org
            && per_org.get(org).copied().unwrap_or(0) >= REQUESTS_PER_ORG_MAX
        {
            return Err(unavailable(format!(
                "this runner serves {REQUESTS_PER_ORG_MAX} data requests of one org at once"
            )));
        }
        if let Some(sandbox) = who.sandbox {
            *per_sandbox.entry(sandbox.to_owned()).or_insert(0) += 1;
        }
        if let Some(org) = who.org {
            *per_org.entry(org.to_owned()).or_insert(0) += 1;
        }
        *all += 1;
        Ok(Place {
            in_flight: self.clone(),
            sandbox: who.sandbox.map(str::to_owned),
            org: who.org.map(str::to_owned),
        })
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        *locked(&self.in_flight.all) -= 1;
        if let Some(sandbox) = &self.sandbox {
            give_back(&self.in_flight.per_sandbox, sandbox);
        }
        if let Some(org) = &self.org {
            give_back(&self.in_flight.per_org, org);
        }
    }
}

/// Admits a request: its token verified first (a request without a good
/// one takes no place and touches nothing), then a place among those
/// served at once, held until its answer's body is done.
async fn admit(
    State(plane): State<Arc<DataPlane>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let claims = match plane.verified(request.headers()) {
        Ok(claims) => claims,
        Err(refusal) => return refusal.into_response(),
    };
    // Counted by what the verified token names (a route refuses a token
    // for another sandbox), never by how the path is spelled.
    let who = For {
        sandbox: Some(claims.sandbox_id.as_str()).filter(|id| !id.is_empty()),
        org: claims.org_id.as_deref(),
    };
    let place = match plane.in_flight.take(who) {
        Ok(place) => place,
        Err(refusal) => return refusal.into_response(),
    };
    let response = next.run(request).await;
    // The place goes with the body: a download holds it while it streams.
    response.map(|body| {
        Body::from_stream(body.into_data_stream().map(move |chunk| {
            let _held = &place;
            chunk
        }))
    })
}

pub(crate) fn router(plane: Arc<DataPlane>) -> axum::Router {
    axum::Router::new()
        .route(
            "/v1/data/sandboxes/{sandbox_id}/commands/{command_id}/stdin",
            axum::routing::post(stdin),
        )
        .route(
            "/v1/data/sandboxes/{sandbox_id}/commands/{command_id}/resize",
            axum::routing::post(resize),
        )
        .route(
            "/v1/data/filesystems/check",
            axum::routing::post(check_filesystem),
        )
        .merge(super::data_files::routes())
        .layer(axum::middleware::from_fn_with_state(plane.clone(), admit))
        .with_state(plane)
}

/// Serves `listener` until the runner stops: HTTP/1.1, each connection
/// closed once it has sent no whole request headers for
/// [`HEADER_READ_TIMEOUT`] (`axum::serve` sets no such timer, so an idle
/// connection was kept for ever).
pub(crate) async fn serve(plane: Arc<DataPlane>, listener: tokio::net::TcpListener) {
    serve_app(router(plane), listener, HEADER_READ_TIMEOUT, WRITE_STALL).await;
}

/// Serves `app` on `listener`; a connection whose peer takes nothing of an
/// answer for `write_stall` is ended (`api::write_stall`): a download a
/// client stopped reading gives its place back.
async fn serve_app(
    app: axum::Router,
    listener: tokio::net::TcpListener,
    header_read_timeout: Duration,
    write_stall: Duration,
) {
    use api::write_stall::WriteStall;
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Out of file descriptors and the like: back off, go on.
                tracing::warn!(%err, "the data listener could not accept");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .serve_connection(TokioIo::new(WriteStall::new(stream, write_stall)), service);
            if let Err(err) = connection.await {
                tracing::debug!(%err, "a data connection ended with an error");
            }
        });
    }
}

impl DataPlane {
    /// The claims of the request's token, if they allow `op` on this
    /// command of a sandbox this runner holds at their epoch.
    fn authorize(
        &self,
        headers: &HeaderMap,
        op: &str,
        sandbox_id: &str,
        command_id: &str,
    ) -> Result<DataClaims, Refusal> {
        self.authorize_for(headers, op, sandbox_id, Some(command_id))
    }

    /// The claims of the request's token, if they allow `op` on a sandbox
    /// this runner holds at their epoch, for no command (the files
    /// routes, `data_files`): a refusal as its code and message.
    pub(super) fn authorize_sandbox(
        &self,
        headers: &HeaderMap,
        op: &str,
        sandbox_id: &str,
    ) -> Result<DataClaims, (ErrorCode, String)> {
        self.authorize_for(headers, op, sandbox_id, None)
            .map_err(|refusal| (refusal.code, refusal.message))
    }

    /// The claims of the request's token, if they allow exactly `op` on
    /// `command_id` (or no command) of a sandbox this runner holds at
    /// their epoch.
    fn authorize_for(
        &self,
        headers: &HeaderMap,
        op: &str,
        sandbox_id: &str,
        command_id: Option<&str>,
    ) -> Result<DataClaims, Refusal> {
        let claims = self.verified(headers)?;
        if claims.op != op
            || claims.sandbox_id != sandbox_id
            || claims.command_id.as_deref() != command_id
        {
            return Err(refuse(
                ErrorCode::Unauthenticated,
                "the data token is for another request",
            ));
        }
        let held = self.held_epoch(sandbox_id);
        if held != Some(claims.epoch) {
            return Err(refuse(
                ErrorCode::NotFound,
                format!(
                    "this runner does not hold sandbox {sandbox_id} at epoch {}",
                    claims.epoch
                ),
            ));
        }
        Ok(claims)
    }

    /// The claims of the request's token, if this runner's key signed it
    /// and it has not expired.
    fn verified(&self, headers: &HeaderMap) -> Result<DataClaims, Refusal> {
        let token = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| refuse(ErrorCode::Unauthenticated, "a data token is required"))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        api::data_path::verify(&self.key, token, now)
            .map_err(|err| refuse(ErrorCode::Unauthenticated, err.to_string()))
    }

    /// The container of a sandbox this runner holds.
    fn container(&self, sandbox_id: &str) -> Result<Arc<dyn oci::Container>, Refusal> {
        let id =
            SandboxId::new(sandbox_id).map_err(|e| refuse(ErrorCode::NotFound, e.to_string()))?;
        let paths = self
            .shared
            .data
            .sandbox_paths(&id)
            .map_err(|e| refuse(ErrorCode::Internal, e.to_string()))?;
        Ok(self.shared.runtime.container(id, paths))
    }

    /// The epoch this runner's container of the sandbox was launched for.
    fn held_epoch(&self, sandbox_id: &str) -> Option<u64> {
        let id = SandboxId::new(sandbox_id).ok()?;
        let paths = self.shared.data.sandbox_paths(&id).ok()?;
        std::fs::read_to_string(paths.dir().join("placement"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

#[derive(serde::Deserialize)]
struct StdinQuery {
    #[serde(default)]
    close: bool,
}

async fn stdin(
    State(plane): State<Arc<DataPlane>>,
    Path((sandbox_id, command_id)): Path<(String, String)>,
    Query(query): Query<StdinQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    plane.authorize(&headers, "stdin", &sandbox_id, &command_id)?;
    let container = plane.container(&sandbox_id)?;
    let deadline = tokio::time::Instant::now() + LAUNCH_WAIT;
    let mut writer = loop {
        match container.open_stdin(&command_id).await {
            Ok(writer) => break writer,
            // Handed over but not launched yet: the runner is about to.
            Err(oci::Error::Agent { code, .. })
                if code == "unknown_command" && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(err) => return Err(agent_refusal(err)),
        }
    };
    let mut stream = body.into_data_stream();
    let mut written: u64 = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            refuse(
                ErrorCode::InvalidRequest,
                format!("the stdin body was cut: {e}"),
            )
        })?;
        within_stdin_stall(writer.write(&chunk))
            .await?
            .map_err(agent_refusal)?;
        written += chunk.len() as u64;
    }
    if query.close {
        within_stdin_stall(writer.close())
            .await?
            .map_err(agent_refusal)?;
    }
    let answer = serde_json::json!({"bytes": written, "closed": query.close});
    Ok((StatusCode::OK, axum::Json(answer)).into_response())
}

/// How long a stdin write may wait on a command that reads none of it (or
/// an agent that does not answer) before the request is refused: the
/// request holds one of the runner's data places meanwhile.
const STDIN_STALL: Duration = Duration::from_secs(120);

/// `step` (a write to a command's stdin, or its close), refused if it
/// makes no progress within [`STDIN_STALL`].
async fn within_stdin_stall<T>(step: impl std::future::Future<Output = T>) -> Result<T, Refusal> {
    tokio::time::timeout(STDIN_STALL, step).await.map_err(|_| {
        refuse(
            ErrorCode::InvalidState,
            format!(
                "the command read none of its stdin for {} s (or its sandbox's agent did not answer)",
                STDIN_STALL.as_secs()
            ),
        )
    })
}

#[derive(serde::Deserialize)]
struct ResizeQuery {
    rows: u16,
    cols: u16,
}

async fn resize(
    State(plane): State<Arc<DataPlane>>,
    Path((sandbox_id, command_id)): Path<(String, String)>,
    Query(query): Query<ResizeQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    plane.authorize(&headers, "resize", &sandbox_id, &command_id)?;
    let container = plane.container(&sandbox_id)?;
    container
        .resize_terminal(&command_id, query.rows, query.cols)
        .await
        .map_err(agent_refusal)?;
    let answer = serde_json::json!({"rows": query.rows, "cols": query.cols});
    Ok((StatusCode::OK, axum::Json(answer)).into_response())
}

#[derive(serde::Deserialize)]
struct CheckQuery {
    filesystem: String,
    subpath: String,
}

async fn check_filesystem(
    State(plane): State<Arc<DataPlane>>,
    Query(query): Query<CheckQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let claims = plane.verified(&headers)?;
    let subject = format!("{}/{}", query.filesystem, query.subpath);
    if claims.op != "filesystem.check" || claims.subject.as_deref() != Some(subject.as_str()) {
        return Err(refuse(
            ErrorCode::Unauthenticated,
            "the data token is for another request",
        ));
    }
    let Some(root) = plane.shared.config.filesystems.get(&query.filesystem) else {
        return Err(refuse(
            ErrorCode::NotFound,
            format!("this runner has no filesystem {}", query.filesystem),
        ));
    };
    let mount = oci::SharedMount {
        name: query.filesystem.clone(),
        root: root.clone(),
        subpath: query.subpath.clone(),
        destination: "/mnt/check".to_owned(),
        read_only: true,
    };
    match oci::shared::open_beneath(&mount) {
        Ok(_) => Ok((
            StatusCode::OK,
            axum::Json(serde_json::json!({"exists": true})),
        )
            .into_response()),
        Err(oci::Error::MountSourceMissing(message)) => Err(refuse(ErrorCode::NotFound, message)),
        Err(oci::Error::Invalid(message)) => Err(refuse(ErrorCode::InvalidRequest, message)),
        Err(err) => Err(refuse(ErrorCode::Internal, err.to_string())),
    }
}

/// The agent's refusals as the API's codes.
fn agent_refusal(err: oci::Error) -> Refusal {
    match &err {
        oci::Error::Agent { code, message, .. } => match code.as_str() {
            "unknown_command" => refuse(
                ErrorCode::NotFound,
                format!("the command is not running here: {message}"),
            ),
            "stdin_unavailable" | "stdin_closed" => {
                refuse(ErrorCode::InvalidState, message.clone())
            }
            "unreachable" => refuse(
                ErrorCode::InvalidState,
                format!("the sandbox is not running: {message}"),
            ),
            _ => refuse(ErrorCode::Internal, err.to_string()),
        },
        _ => refuse(ErrorCode::Internal, err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Audit finding: a stdin write to a command that never reads (or an
    /// agent that never answers) held its request, and one of the
    /// runner's data places, for ever.
    #[tokio::test(start_paused = true)]
    async fn a_stdin_write_that_makes_no_progress_is_refused() {
        let stalled = within_stdin_stall(std::future::pending::<()>()).await;
        let Err(refusal) = stalled else {
            panic!("a stalled write went on");
        };
        assert_eq!(refusal.code, ErrorCode::InvalidState);
        assert!(refusal.message.contains("stdin"), "{}", refusal.message);
        assert!(within_stdin_stall(async { 7 }).await.is_ok_and(|v| v == 7));
    }

    fn on(sandbox: &str) -> For<'_> {
        For {
            sandbox: Some(sandbox),
            org: None,
        }
    }

    #[test]
    fn requests_at_once_are_bounded_per_sandbox_and_in_all() {
        let in_flight = Arc::new(InFlight::default());
        let mut places: Vec<Place> = (0..REQUESTS_PER_SANDBOX_MAX)
            .map(|_| in_flight.take(on("sbx_a")).ok().expect("a place"))
            .collect();
        let refused = in_flight.take(on("sbx_a")).err().expect("refused");
        assert_eq!(refused.code, ErrorCode::Unavailable);
        assert!(refused.message.contains("sbx_a"), "{}", refused.message);
        // Another sandbox is served meanwhile.
        places.push(in_flight.take(on("sbx_b")).ok().expect("another sandbox"));
        // A place given back (its answer done) is taken again.
        places.swap_remove(0);
        places.push(in_flight.take(on("sbx_a")).ok().expect("a place again"));
        while places.len() < REQUESTS_AT_ONCE_MAX {
            let sandbox = format!("sbx_{}", places.len());
            places.push(in_flight.take(on(&sandbox)).ok().expect("a place"));
        }
        let refused = in_flight
            .take(For::default())
            .err()
            .expect("refused in all");
        assert_eq!(refused.code, ErrorCode::Unavailable);
        drop(places);
        assert_eq!(*locked(&in_flight.all), 0);
        assert!(locked(&in_flight.per_sandbox).is_empty(), "nothing kept");
    }

    /// Audit finding (data path): one org with many sandboxes on a runner
    /// could hold all its places (downloads it never reads), and every
    /// other org's files and stdin there were refused. One org holds at
    /// most half; the others are served meanwhile; a refusal moves no count.
    #[test]
    fn one_org_holds_at_most_half_of_a_runners_places() {
        let in_flight = Arc::new(InFlight::default());
        let sandboxes: Vec<String> = (0..16).map(|i| format!("sbx_{i}")).collect();
        let mut places: Vec<Place> = (0..REQUESTS_PER_ORG_MAX)
            .map(|i| {
                let who = For {
                    sandbox: Some(&sandboxes[i % sandboxes.len()]),
                    org: Some("greedy"),
                };
                in_flight.take(who).ok().expect("a place")
            })
            .collect();
        let more = For {
            sandbox: Some("sbx_other"),
            org: Some("greedy"),
        };
        let refused = in_flight
            .take(more)
            .err()
            .expect("refused past the org's share");
        assert!(refused.message.contains("one org"), "{}", refused.message);
        assert!(!locked(&in_flight.per_sandbox).contains_key("sbx_other"));
        let other = For {
            sandbox: Some("sbx_theirs"),
            org: Some("other"),
        };
        places.push(in_flight.take(other).ok().expect("another org is served"));
        drop(places);
        assert!(locked(&in_flight.per_org).is_empty(), "nothing kept");
    }

    #[tokio::test]
    async fn a_connection_that_sends_no_request_is_closed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let server = tokio::spawn(serve_app(
            app,
            listener,
            Duration::from_millis(300),
            WRITE_STALL,
        ));
        // A request is answered.
        let mut answered = tokio::net::TcpStream::connect(address)
            .await
            .expect("connect");
        answered
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("send");
        let mut answer = String::new();
        answered
            .read_to_string(&mut answer)
            .await
            .expect("an answer");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // A connection that sends nothing (or half a request) is closed
        // once the header timeout passes, whatever else loads the machine.
        for opening in [&b""[..], b"GET / HTTP/1.1\r\nhost"] {
            let mut idle = tokio::net::TcpStream::connect(address)
                .await
                .expect("connect");
            idle.write_all(opening).await.expect("send");
            let mut rest = Vec::new();
            let closed =
                tokio::time::timeout(Duration::from_secs(60), idle.read_to_end(&mut rest)).await;
            assert!(closed.is_ok(), "still open after 60 s");
        }
        server.abort();
    }

    /// Audit finding: a download a client stopped reading held its place
    /// (and its org's share) for as long as the client kept the connection
    /// open. The connection now ends once the client has taken nothing for
    /// the write stall, and the answer's place goes with it.
    #[tokio::test]
    async fn a_client_that_stops_reading_loses_its_connection_and_the_answers_place() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        /// A place among those served at once, given back when dropped.
        struct Place(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Place {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let places = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let taken = places.clone();
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(move || {
                taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let place = Place(taken.clone());
                async move {
                    // An endless download holding a place while it streams.
                    let chunks = futures::stream::repeat_with(move || {
                        let _held = &place;
                        Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![1u8; 64 << 10]))
                    });
                    Body::from_stream(chunks)
                }
            }),
        );
        let server = tokio::spawn(serve_app(
            app,
            listener,
            HEADER_READ_TIMEOUT,
            Duration::from_millis(300),
        ));
        let mut quiet = tokio::net::TcpStream::connect(address)
            .await
            .expect("connect");
        quiet
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("send");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let held = || places.load(std::sync::atomic::Ordering::SeqCst);
        while tokio::time::Instant::now() < deadline && held() == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(held(), 1, "the download was not served");
        while held() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the answer still holds its place"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The connection is gone: what was buffered, then its end.
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(60), quiet.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "still open");
        server.abort();
    }
}

#[cfg(test)]
mod listing_tests {
    use super::*;

    /// Audit finding: one sandbox's agent, answering a listing slowly, could
    /// hold every listing turn of the runner. A sandbox has its share; a
    /// turn given back is taken again.
    #[tokio::test]
    async fn a_sandbox_takes_at_most_its_share_of_the_listings() {
        let listings = Listings::new();
        let first = listings.turn(None, "sbx_a").await.expect("a first turn");
        let _second = listings.turn(None, "sbx_a").await.expect("a second turn");
        let third = listings.turn(None, "sbx_a").await;
        assert!(
            third.as_ref().is_err_and(|e| e.contains("sbx_a")),
            "past the sandbox's share: {:?}",
            third.err()
        );
        let others: Vec<ListingTurn> =
            futures::future::try_join_all((0..LISTINGS_AT_ONCE - LISTINGS_PER_SANDBOX).map(|n| {
                let listings = &listings;
                async move { listings.turn(None, &format!("sbx_{n}")).await }
            }))
            .await
            .expect("the other sandboxes' turns");
        assert_eq!(others.len(), LISTINGS_AT_ONCE - LISTINGS_PER_SANDBOX);
        drop(first);
        let _again = listings.turn(None, "sbx_a").await.expect("its turn back");
    }

    /// Audit finding: one org with many sandboxes here, their agents
    /// answering slowly, could hold every turn (two a sandbox). An org has
    /// half of them; the other orgs keep the rest.
    #[tokio::test]
    async fn an_org_takes_at_most_its_share_of_the_listings() {
        let listings = Listings::new();
        let held: Vec<ListingTurn> =
            futures::future::try_join_all((0..LISTINGS_PER_ORG).map(|n| {
                let listings = &listings;
                async move {
                    listings
                        .turn(Some("org_a"), &format!("sbx_a{}", n / 2))
                        .await
                }
            }))
            .await
            .expect("the org's share");
        let refused = listings.turn(Some("org_a"), "sbx_a9").await;
        assert!(
            refused.as_ref().is_err_and(|e| e.contains("org org_a")),
            "past the org's share: {:?}",
            refused.err()
        );
        let others: Vec<ListingTurn> =
            futures::future::try_join_all((0..LISTINGS_AT_ONCE - LISTINGS_PER_ORG).map(|n| {
                let listings = &listings;
                async move { listings.turn(Some("org_b"), &format!("sbx_b{n}")).await }
            }))
            .await
            .expect("another org's sandboxes, the rest");
        assert_eq!(others.len() + held.len(), LISTINGS_AT_ONCE);
        drop(held);
        drop(others);
        listings
            .turn(Some("org_a"), "sbx_a9")
            .await
            .expect("its share back");
    }

    /// A listing that finds every turn taken waits [`LISTING_TURN_WAIT`],
    /// then is refused (not queued for ever).
    #[tokio::test(start_paused = true)]
    async fn a_listing_without_a_turn_is_refused_after_a_wait() {
        let listings = Listings::new();
        let _taken: Vec<ListingTurn> =
            futures::future::try_join_all((0..LISTINGS_AT_ONCE).map(|n| {
                let listings = &listings;
                async move { listings.turn(None, &format!("sbx_{n}")).await }
            }))
            .await
            .expect("every turn");
        let refused = listings.turn(None, "sbx_late").await;
        assert!(refused.is_err_and(|e| e.contains("none ended")));
    }
}
