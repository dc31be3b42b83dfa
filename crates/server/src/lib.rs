//! `roost server`: the control plane. Holds the records (SQLite by
//! default, PostgreSQL at scale, through one code path), authenticates
//! every call, and answers the `/v1` API with one error envelope.
//!
//! Parts: `http` (handlers, one module per resource), `records` (states
//! and the one place a sandbox's state changes), `scheduler` (placement),
//! `reconcile` (lease watcher, TTL, retention, waiting sandboxes), `hub`
//! (long-poll wake-ups, across servers through PostgreSQL NOTIFY),
//! `idempotency`, `limits`, `metrics`, `openapi`.

pub mod auth;
pub mod backup;
pub mod control;
pub mod db;
pub mod e2b;
mod error;
pub mod http;
pub mod hub;
mod idempotency;
mod limits;
pub mod metrics;
mod openapi;
pub mod reconcile;
pub mod records;
mod scheduler;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use error::ServerError;

/// Largest request body accepted, in bytes (larger → 413 payload_too_large).
pub const REQUEST_BODY_BYTES_MAX: usize = 1024 * 1024;

#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// `sqlite://…` or `postgres://…`; default: `roost.db` in the data dir.
    pub database_url: Option<String>,
    /// The home store (a path, `file://`, `s3://`); without one, `durable`
    /// storage is refused.
    pub store_url: Option<String>,
    /// Most sandboxes running at once across the whole fleet.
    pub fleet_max_running: Option<u64>,
    /// How long ended records stay readable.
    pub retention: Duration,
    /// The most command output one org's records keep, all its commands
    /// together (each stream is bounded too:
    /// `api::commands::OUTPUT_STREAM_BYTES_MAX`): without it, one org's
    /// commands could fill the database every org shares. A purged
    /// sandbox's commands give theirs back.
    pub org_output_bytes_max: u64,
    /// How long a runner's lease lasts after a heartbeat. Runners beat
    /// every third of it and freeze their sandboxes at two thirds of it
    /// without an answered beat ([`freeze_after`]).
    pub lease_ttl: Duration,
    /// Past a lease's expiry, how long the lease watcher still waits
    /// before it declares the runner lost and starts replacements: covers
    /// clock drift between the servers and the runner's freeze taking
    /// time. Recovery starts `lease_ttl + fence_margin` after the last
    /// answered heartbeat at the earliest.
    pub fence_margin: Duration,
    /// When at least this share of the live runners (and at least two)
    /// have an expired lease at once, the control plane is more likely
    /// cut off than they are all dead: the lease watcher holds off for
    /// `mass_loss_grace` (DESIGN.md §7) before recovering anything.
    pub mass_loss_threshold: f64,
    pub mass_loss_grace: Duration,
    /// How often the reconcilers run.
    pub reconcile_interval: Duration,
    /// How often a running durable sandbox's home is saved, unless its
    /// create asks otherwise within `save_interval_min..=save_interval_max`.
    pub save_interval: Duration,
    pub save_interval_min: Duration,
    pub save_interval_max: Duration,
    /// How long a running sandbox may go without activity before it
    /// sleeps, unless its create asks otherwise: 0 (never) or within
    /// `idle_timeout_min..=idle_timeout_max`.
    pub idle_timeout: Duration,
    pub idle_timeout_min: Duration,
    pub idle_timeout_max: Duration,
    /// Between a stop's SIGTERM and its SIGKILL of a workload; runners take
    /// it from the server when they register.
    pub stop_grace: Duration,
    /// Where the key that seals org secrets comes from; without one,
    /// secrets are refused (`unsupported_capability`).
    pub secret_key: control::secrets::SecretKeySource,
    /// How long a connection may take to send a request's head (its
    /// request line and headers), from when it opens or its previous
    /// answer ended; past it the server closes the connection. Without
    /// it, a client that connects and sends nothing holds a file
    /// descriptor forever.
    pub header_read_timeout: Duration,
    /// How long a connection's peer may take nothing of an answer before
    /// the connection is ended and the answer dropped
    /// (`api::write_stall`): a client that stops reading a stream gives
    /// back its org's share.
    pub write_stall: Duration,
    /// The most connections served at once (`--max-connections`); past it
    /// new ones wait in the listen backlog until one ends. Lowered to what
    /// the process's open files limit leaves after the database's, the
    /// data path's and the store's files.
    pub connections_max: usize,
    /// The most requests one org may have under way at once on this
    /// server (`--org-requests-max`): long-polls, streams and attached
    /// terminals included; past it, 429 `quota_exceeded`.
    pub org_requests_max: usize,
    /// A token a metrics scraper may read `/metrics` with
    /// (`--metrics-token-file`), besides the admin token; `/metrics`
    /// refuses every other caller.
    pub metrics_token: Option<String>,
    /// Crash-safety tests only: the fault point armed
    /// (`ROOST_FAILPOINT`), e.g. `after_commit:create_sandbox`.
    pub failpoint: api::failpoint::Failpoints,
}

/// 8 GiB of command output per org: 256 commands at the bound of both
/// streams.
pub const DEFAULT_ORG_OUTPUT_BYTES_MAX: u64 = 8 << 30;

/// A sandbox sleeps after half an hour without activity unless asked
/// otherwise: long enough for an agent's longest think, short enough that
/// a forgotten sandbox does not hold a runner all day.
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 1800;

impl Config {
    pub fn new(listen: SocketAddr, data_dir: PathBuf) -> Config {
        Config {
            listen,
            data_dir,
            database_url: None,
            store_url: None,
            fleet_max_running: None,
            retention: Duration::from_secs(7 * 24 * 3600),
            org_output_bytes_max: DEFAULT_ORG_OUTPUT_BYTES_MAX,
            lease_ttl: Duration::from_secs(9),
            fence_margin: Duration::from_secs(1),
            mass_loss_threshold: 0.5,
            mass_loss_grace: Duration::from_secs(120),
            reconcile_interval: Duration::from_secs(1),
            save_interval: Duration::from_secs(300),
            save_interval_min: Duration::from_secs(10),
            save_interval_max: Duration::from_secs(24 * 3600),
            idle_timeout: Duration::from_secs(DEFAULT_IDLE_TIMEOUT_S),
            idle_timeout_min: Duration::from_secs(10),
            idle_timeout_max: Duration::from_secs(7 * 24 * 3600),
            stop_grace: Duration::from_secs(10),
            secret_key: control::secrets::SecretKeySource::None,
            header_read_timeout: Duration::from_secs(30),
            write_stall: api::write_stall::WRITE_STALL,
            connections_max: DEFAULT_CONNECTIONS_MAX,
            org_requests_max: DEFAULT_ORG_REQUESTS_MAX,
            metrics_token: None,
            failpoint: api::failpoint::Failpoints::none(),
        }
    }
}

/// How long after its last answered heartbeat was sent a runner freezes
/// its sandboxes: two thirds of the lease. The server's lease runs from
/// when it received that heartbeat, so the freeze lands at least a third
/// of the lease (one heartbeat interval) before the server could count
/// the lease expired, and `fence_margin` later still before anything is
/// started elsewhere.
pub fn freeze_after(lease_ttl: Duration) -> Duration {
    lease_ttl * 2 / 3
}

/// What the server prints once at start-up.
pub struct Started {
    pub url: String,
    /// Set only by the server that created the admin token.
    pub admin_token: Option<String>,
}

/// Opens the database, bootstraps, binds, and serves until `shutdown`
/// resolves. `on_started` learns the address and the one-time admin token.
pub async fn serve(
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    on_started: impl FnOnce(Started),
) -> Result<(), ServerError> {
    // Bound first: a server that cannot listen makes nothing (no database,
    // no admin token whose one-time printout would be lost with it).
    let listener = listen(config.listen).map_err(|source| ServerError::Bind {
        addr: config.listen,
        source,
    })?;
    let state = open_state(config).await?;
    let config = state.config.clone();
    let admin_token = auth::bootstrap_admin(&state.db, &config.data_dir).await?;
    let local = listener.local_addr().map_err(|source| ServerError::Bind {
        addr: config.listen,
        source,
    })?;
    on_started(Started {
        url: format!("http://{local}"),
        admin_token,
    });
    if state.db.engine == db::Engine::Postgres {
        // Other servers' writes are unseen until the listener is in place.
        state.db.hub.set_complete(false);
        tokio::spawn(hub::listen_postgres(
            state.db.url.to_string(),
            state.db.hub.clone(),
        ));
    }
    tokio::spawn(reconcile::run(state.clone()));
    let metrics = state.metrics.clone();
    let limits = ConnectionLimits {
        header_read_timeout: config.header_read_timeout,
        write_stall: config.write_stall,
        slots: state.connections.clone(),
    };
    let app = http::router(state);
    serve_connections(listener, app, limits, metrics, shutdown).await;
    Ok(())
}

/// The default of [`Config::connections_max`]: a fleet's runners each
/// hold a long-poll and send heartbeats, 10,000 runners on two servers
/// about 5,000 a server.
pub const DEFAULT_CONNECTIONS_MAX: usize = 16_384;

/// The default of [`Config::org_requests_max`]: a quarter of the
/// connections, so that four orgs at their bound still leave room.
pub const DEFAULT_ORG_REQUESTS_MAX: usize = DEFAULT_CONNECTIONS_MAX / 4;

/// Open files kept for what is not a client's connection: the database
/// pool, the data path's streams to runners, the store's files, logs.
const FILES_RESERVED_MIN: u64 = 256;

/// How many connections may be served at once: `configured`, or less when
/// the open files limit would run out first (`roost` raises its soft
/// limit to the hard one at start). Without a cap below that limit,
/// clients holding idle connections take every file descriptor, and the
/// server can then open neither a database connection nor a runner's
/// stream, for every tenant at once.
fn connection_slots(configured: usize) -> usize {
    use rustix::process::{Resource, getrlimit};
    let files = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    let reserved = (files / 4).max(FILES_RESERVED_MIN);
    let fit = usize::try_from(files.saturating_sub(reserved)).unwrap_or(usize::MAX);
    if fit < configured {
        tracing::warn!(
            open_files = files,
            connections = fit,
            configured,
            "the open files limit allows fewer connections than configured"
        );
    }
    configured.min(fit).max(1)
}

/// What bounds the connections [`serve_connections`] takes.
struct ConnectionLimits {
    header_read_timeout: Duration,
    write_stall: Duration,
    /// Served at once (`AppStateParts::connections`).
    slots: Arc<tokio::sync::Semaphore>,
}

/// The most a request's head (its line and headers) may take in the read
/// buffer: far over any request of the API (paths are at most 4 KiB, a
/// token is 90 bytes), far under hyper's default of about 400 KiB a
/// connection.
const READ_BUFFER_BYTES_MAX: usize = 128 * 1024;

/// The control plane's state on `config`: its store opened, its database
/// connected and migrated. Serving (HTTP, the reconciler) is separate, so
/// the control layer can be driven in process.
pub async fn open_state(config: Config) -> Result<control::AppState, ServerError> {
    std::fs::create_dir_all(&config.data_dir).map_err(|source| ServerError::Io {
        path: config.data_dir.clone(),
        source,
    })?;
    let database_url = config
        .database_url
        .clone()
        .unwrap_or_else(|| backup::default_database_url(&config.data_dir));
    let store = match &config.store_url {
        // The orgs' merged pack indexes live on disk, in the data dir (per
        // store URL), not in memory or a temporary directory.
        Some(url) => Some(Arc::new(
            store::Store::open(url)
                .map_err(|e| ServerError::Store(e.to_string()))?
                .with_index_cache(
                    config
                        .data_dir
                        .join("pack-indexes")
                        .join(&store::Digest::of(url.as_bytes()).to_hex()[..32]),
                ),
        )),
        None => None,
    };
    let secret_key = config
        .secret_key
        .load()
        .map_err(|e| ServerError::SecretKey(e.to_string()))?
        .map(Arc::new);
    let db = db::Db::connect(&database_url).await?;
    db.migrate().await?;
    let envd_key = auth::envd_key(&db).await?;
    let org_requests_max = config.org_requests_max;
    let connections = connection_slots(config.connections_max);
    let metrics = Arc::new(metrics::Metrics::default());
    metrics.set_connections_max(connections);
    Ok(control::AppState::new(control::AppStateParts {
        db,
        store,
        config: Arc::new(config),
        metrics,
        secret_key,
        renewals: Arc::default(),
        assignment_reads: tokio::sync::Semaphore::new(control::ASSIGNMENT_READS_AT_ONCE),
        runner_reads: Default::default(),
        pointer_turns: Default::default(),
        envd_key,
        org_requests: Arc::new(control::org_share::OrgRequests::new(org_requests_max)),
        connections: Arc::new(tokio::sync::Semaphore::new(connections)),
    }))
}

/// Pending connections the kernel queues before `accept`: a burst of
/// clients (thousands of long-polls reconnecting at once) must not
/// overflow it into SYN retries.
const LISTEN_BACKLOG: u32 = 4096;

fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves HTTP/1.1 on each accepted connection until `shutdown`, then stops
/// accepting (connections in flight end with the process; clients retry).
///
/// Hand-rolled rather than `axum::serve` for memory: that builds a copy
/// of the router per connection and speaks HTTP/1 and HTTP/2, which cost
/// about 35 KiB per idle connection, and a long-poll holds its connection
/// for up to 25 s (10,000 waiters: 490 MiB that way, under 200 here;
/// BENCHMARKS.md).
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: ConnectionLimits,
    metrics: std::sync::Arc<metrics::Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    // hyper keeps its header-read timeout off without a timer: a
    // connection that never sends a request would be kept forever.
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(READ_BUFFER_BYTES_MAX);
    // A slot is taken before a connection is accepted and given back when
    // it ends: past the cap, new connections wait in the kernel's backlog
    // (and idle ones end at the header-read timeout), never taking the
    // file descriptors the server needs for its own work.
    let slots = limits.slots;
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot,
            () = &mut shutdown => return,
        };
        let Ok(slot) = slot else { return };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Out of file descriptors and the like: back off, go on.
                tracing::warn!(%err, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let write_stall = limits.write_stall;
        let open = metrics::OpenConnection::new(metrics.clone());
        tokio::spawn(async move {
            let _held = (slot, open);
            // A peer that takes nothing of an answer for minutes loses its
            // connection (`api::write_stall`), and the answer what it held.
            let stream = api::write_stall::WriteStall::new(stream, write_stall);
            // With upgrades: a terminal attaches over a WebSocket.
            let connection = builder
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            if let Err(err) = connection.await {
                tracing::debug!(%err, "connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Audit finding: a client that stopped reading a streamed answer (a
    /// download relayed from a runner, a command's output) kept its
    /// connection, its org's share and whatever the answer held for as
    /// long as it kept the socket open. Past the write stall the
    /// connection ends and its slot comes back.
    #[tokio::test]
    async fn a_client_that_stops_reading_loses_its_connection_and_slot() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(|| async {
                let chunks = futures::stream::repeat_with(|| {
                    Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![1u8; 64 << 10]))
                });
                axum::body::Body::from_stream(chunks)
            }),
        );
        let slots = Arc::new(tokio::sync::Semaphore::new(4));
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_secs(30),
            write_stall: Duration::from_millis(300),
            slots: slots.clone(),
        };
        let metrics = Arc::new(metrics::Metrics::default());
        let server = tokio::spawn(serve_connections(
            listener,
            app,
            limits,
            metrics,
            std::future::pending(),
        ));
        let mut quiet = tokio::net::TcpStream::connect(address)
            .await
            .expect("connect");
        quiet
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("send");
        // One slot for the quiet connection, one for the next accept.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while slots.available_permits() > 2 {
            assert!(tokio::time::Instant::now() < deadline, "never served");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        while slots.available_permits() < 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the quiet connection still holds its slot"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(60), quiet.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "still open");
        server.abort();
    }
}
