//! `roost server`: the control plane. Holds the records (SQLite by
//! default, PostgreSQL at scale, through one code path), authenticates
//! every call, and answers the `/v1` API with one error envelope.
//!
//! Built so far: records and migrations, tokens, the admin endpoints that
//! create organisations and runner tokens. Sandboxes, commands and the
//! runner protocol come next (issue 3 in the tracker).

pub mod auth;
pub mod db;
mod error;
pub mod http;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use error::ServerError;

/// Largest request body accepted, in bytes (larger → 413 payload_too_large).
pub const REQUEST_BODY_BYTES_MAX: usize = 1024 * 1024;

#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// `sqlite://…` or `postgres://…`; default: `roost.db` in the data dir.
    pub database_url: Option<String>,
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
    let app = http::router(http::AppState { db });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| ServerError::Bind {
            addr: local,
            source,
        })
}
