//! Errors of the server outside request handling (start-up, database).

use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("unsupported database url {0:?}: use sqlite://PATH or postgres://…")]
    UnsupportedDatabase(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{source} at {}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open the home store: {0}")]
    Store(String),
    #[error("no randomness available: {0}")]
    Random(String),
}
