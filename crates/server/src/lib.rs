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
pub mod db;
mod error;
pub mod http;
pub mod hub;
mod idempotency;
mod limits;
mod metrics;
mod openapi;
mod reconcile;
mod records;
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
    /// How long a runner's lease lasts after a heartbeat.
    pub lease_ttl: Duration,
    /// How often the reconcilers run.
    pub reconcile_interval: Duration,
    /// See `AppState::failpoint` (tests only).
    pub failpoint: Option<String>,
}

impl Config {
    pub fn new(listen: SocketAddr, data_dir: PathBuf) -> Config {
        Config {
            listen,
            data_dir,
            database_url: None,
            store_url: None,
            fleet_max_running: None,
            retention: Duration::from_secs(7 * 24 * 3600),
            lease_ttl: Duration::from_secs(15),
            reconcile_interval: Duration::from_secs(1),
            failpoint: None,
        }
    }
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
    std::fs::create_dir_all(&config.data_dir).map_err(|source| ServerError::Io {
        path: config.data_dir.clone(),
        source,
    })?;
    let database_url = config.database_url.clone().unwrap_or_else(|| {
        format!(
            "sqlite://{}?mode=rwc",
            config.data_dir.join("roost.db").display()
        )
    });
    if let Some(store_url) = &config.store_url {
        store::backend::open(store_url).map_err(|e| ServerError::Store(e.to_string()))?;
    }
    let db = db::Db::connect(&database_url).await?;
    db.migrate().await?;
    let admin_token = auth::bootstrap_admin(&db, &config.data_dir).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServerError::Bind {
            addr: config.listen,
            source,
        })?;
    let local = listener.local_addr().map_err(|source| ServerError::Bind {
        addr: config.listen,
        source,
    })?;
    on_started(Started {
        url: format!("http://{local}"),
        admin_token,
    });
    if db.engine == db::Engine::Postgres {
        tokio::spawn(hub::listen_postgres(db.url.clone(), db.hub.clone()));
    }
    let state = http::AppState {
        db,
        config: Arc::new(config),
        metrics: Arc::new(metrics::Metrics::default()),
    };
    tokio::spawn(reconcile::run(state.clone()));
    let app = http::router(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| ServerError::Bind {
            addr: local,
            source,
        })
}
