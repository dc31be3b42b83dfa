//! The server's errors: [`ControlError`], what the control layer answers
//! (a stable `api::ErrorCode`, a one-line message, optional details; the
//! HTTP layer renders it as the envelope), and [`ServerError`], start-up
//! and database failures outside any request.

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
    #[error("{0}")]
    SecretKey(String),
}

/// A refusal or failure of the control layer: a stable code (which fixes
/// the HTTP status), a one-line message, optional details.
#[derive(Debug)]
pub struct ControlError {
    pub code: api::ErrorCode,
    pub message: String,
    pub details: serde_json::Value,
    /// For refusals that clear with time (quotas, in-flight keys).
    pub retry_after_s: Option<u64>,
}

impl ControlError {
    pub fn new(code: api::ErrorCode, message: impl Into<String>) -> ControlError {
        ControlError {
            code,
            message: message.into(),
            details: serde_json::Value::Null,
            retry_after_s: None,
        }
    }

    pub fn with_retry_after(mut self, seconds: u64) -> ControlError {
        self.retry_after_s = Some(seconds);
        self
    }

    pub fn with_details(mut self, details: serde_json::Value) -> ControlError {
        self.details = details;
        self
    }
}

impl From<sqlx::Error> for ControlError {
    fn from(err: sqlx::Error) -> ControlError {
        ControlError::from(&err)
    }
}

impl From<&sqlx::Error> for ControlError {
    fn from(err: &sqlx::Error) -> ControlError {
        if unstorable_text(err) {
            // The caller's input, not the database: PostgreSQL holds no
            // NUL byte in text (SQLite would have stored it).
            tracing::info!(%err, "a value the records cannot hold");
            return ControlError::new(
                api::ErrorCode::InvalidRequest,
                "a value holds a character the records cannot store (a NUL byte)",
            );
        }
        // Logged once here, where it is handled; the body hides internals.
        tracing::error!(%err, "database error");
        if database_unreachable(err) {
            // Whether a write whose commit was cut off took effect is not
            // known here, so the answer says to retry, which an
            // idempotency key makes safe.
            return ControlError::new(
                api::ErrorCode::Unavailable,
                "the records database is unreachable; retry (with the same Idempotency-Key for a mutation)",
            )
            .with_retry_after(1);
        }
        ControlError::new(api::ErrorCode::Internal, "internal error")
    }
}

/// PostgreSQL refused a text value for its characters: 22021
/// (`character_not_in_repertoire`, which a NUL byte is) or 22P05
/// (`untranslatable_character`).
fn unstorable_text(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(db)
        if db.code().is_some_and(|code| code == "22021" || code == "22P05"))
}

/// The database could not be reached or dropped the connection (as while
/// PostgreSQL restarts), rather than refusing a statement.
fn database_unreachable(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // PostgreSQL's connection exceptions (class 08) and its shutting
        // down (57P01-57P03: admin shutdown, crash shutdown, cannot
        // connect now).
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57P0")),
        _ => false,
    }
}

impl From<crate::ServerError> for ControlError {
    fn from(err: crate::ServerError) -> ControlError {
        tracing::error!(%err, "server error");
        ControlError::new(api::ErrorCode::Internal, "internal error")
    }
}
