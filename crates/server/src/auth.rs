//! Tokens: random, shown once, stored only as BLAKE3 hashes. A token is
//! 32 random bytes, so a fast hash is enough (there is nothing to guess).
//!
//! Runners hold two secrets. A runner token (`roost admin runner-token`,
//! a `tokens` row of kind `runner`) only enrols: it may register a new
//! runner and nothing else. Registering hands that runner its own
//! credential (its hash on the runner's row), with which it speaks for
//! itself alone: its heartbeats, assignments and reports, and the block
//! service for the orgs of the sandboxes placed on it.

use std::io::Write;
use std::path::Path;

use crate::ServerError;
use crate::db::{Db, now_ms};

/// Who is calling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    Admin,
    Org {
        org_id: String,
    },
    /// A runner token: may register a new runner, nothing else.
    RunnerEnrolment,
    /// One runner, by its own credential.
    Runner {
        runner_id: String,
    },
}

pub fn random_hex(bytes: usize) -> Result<String, ServerError> {
    let mut buffer = vec![0u8; bytes];
    getrandom::fill(&mut buffer).map_err(|e| ServerError::Random(e.to_string()))?;
    Ok(buffer.iter().map(|b| format!("{b:02x}")).collect())
}

pub fn new_token(kind: &str) -> Result<String, ServerError> {
    Ok(format!("roost_{kind}_{}", random_hex(32)?))
}

pub fn hash_token(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

pub async fn store_token(
    db: &Db,
    token: &str,
    kind: &str,
    org_id: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO tokens (hash, kind, org_id, created_at_ms) VALUES ($1, $2, $3, $4)")
        .bind(hash_token(token))
        .bind(kind)
        .bind(org_id)
        .bind(now_ms())
        .execute(&db.pool)
        .await?;
    Ok(())
}

pub async fn authenticate(db: &Db, token: &str) -> Result<Option<Principal>, sqlx::Error> {
    let hash = hash_token(token);
    let row: Option<(String, Option<String>)> =
        sqlx::query_as("SELECT kind, org_id FROM tokens WHERE hash = $1")
            .bind(&hash)
            .fetch_optional(&db.pool)
            .await?;
    let principal = row.and_then(|(kind, org_id)| match (kind.as_str(), org_id) {
        ("admin", _) => Some(Principal::Admin),
        ("runner", _) => Some(Principal::RunnerEnrolment),
        ("org", Some(org_id)) => Some(Principal::Org { org_id }),
        _ => None,
    });
    if principal.is_some() {
        return Ok(principal);
    }
    let runner = crate::records::runners::by_credential(&db.pool, &hash).await?;
    Ok(runner.map(|runner_id| Principal::Runner { runner_id }))
}

/// Creates the admin token on the first start of a database: returned
/// (to print once) and written with mode 0600 to `data_dir/admin-token`.
/// Later starts, and other servers on the same database, get `None`.
pub async fn bootstrap_admin(db: &Db, data_dir: &Path) -> Result<Option<String>, ServerError> {
    let mut tx = db.write().await?;
    let claimed =
        sqlx::query("INSERT INTO bootstrap (step, done_at_ms) VALUES ('admin_token', $1)")
            .bind(now_ms())
            .execute(&mut *tx.tx)
            .await;
    if claimed.is_err() {
        return Ok(None);
    }
    let token = new_token("admin")?;
    sqlx::query(
        "INSERT INTO tokens (hash, kind, org_id, created_at_ms) VALUES ($1, 'admin', NULL, $2)",
    )
    .bind(hash_token(&token))
    .bind(now_ms())
    .execute(&mut *tx.tx)
    .await?;
    let path = data_dir.join("admin-token");
    write_secret(&path, &token).map_err(|source| ServerError::Io { path, source })?;
    tx.commit().await?;
    Ok(Some(token))
}

fn write_secret(path: &Path, secret: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(secret.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()
}
