//! The secret rows: an org's secrets as ciphertext and nonce (never a
//! value: `control::secrets` encrypts and decrypts), and what each sandbox
//! asked for (names and where they go).

use std::collections::BTreeMap;

use sqlx::AnyPool;
use sqlx::Row;

use super::rfc3339;
use crate::db::WriteTx;
use api::lifecycle::SandboxState;
use api::sandboxes::Secret;
use api::secrets::SecretRecord;

/// A secret as stored: the sealed value and what it is bound to.
pub struct Sealed {
    pub version: i64,
    /// Hex.
    pub nonce: String,
    /// Hex.
    pub ciphertext: String,
}

fn record_of(row: &sqlx::any::AnyRow) -> Result<SecretRecord, sqlx::Error> {
    Ok(SecretRecord {
        name: row.try_get("name")?,
        version: row.try_get::<i64, _>("version")? as u64,
        created_at: rfc3339(row.try_get("created_at_ms")?),
        updated_at: rfc3339(row.try_get("updated_at_ms")?),
    })
}

/// The org's secret `name`, without its value.
pub async fn read(
    pool: &AnyPool,
    org: &str,
    name: &str,
) -> Result<Option<SecretRecord>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT name, version, created_at_ms, updated_at_ms FROM secrets WHERE org_id = $1 AND name = $2",
    )
    .bind(org)
    .bind(name)
    .fetch_optional(pool)
    .await?;
    row.as_ref().map(record_of).transpose()
}

/// The org's secrets by name, without values.
pub async fn list(pool: &AnyPool, org: &str) -> Result<Vec<SecretRecord>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT name, version, created_at_ms, updated_at_ms FROM secrets WHERE org_id = $1 ORDER BY name",
    )
    .bind(org)
    .fetch_all(pool)
    .await?;
    rows.iter().map(record_of).collect()
}

/// The sealed secret, read inside `tx`.
pub async fn sealed(
    tx: &mut WriteTx,
    org: &str,
    name: &str,
) -> Result<Option<Sealed>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT version, nonce, ciphertext FROM secrets WHERE org_id = $1 AND name = $2",
    )
    .bind(org)
    .bind(name)
    .fetch_optional(&mut *tx.tx)
    .await?;
    row.map(|row| {
        Ok(Sealed {
            version: row.try_get("version")?,
            nonce: row.try_get("nonce")?,
            ciphertext: row.try_get("ciphertext")?,
        })
    })
    .transpose()
}

/// How many secrets the org holds.
pub async fn count(tx: &mut WriteTx, org: &str) -> Result<i64, sqlx::Error> {
    let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM secrets WHERE org_id = $1")
        .bind(org)
        .fetch_one(&mut *tx.tx)
        .await?;
    Ok(count)
}

/// Writes version `sealed.version` of the secret (made when it is 1).
pub async fn put(
    tx: &mut WriteTx,
    org: &str,
    name: &str,
    sealed: &Sealed,
    at_ms: i64,
) -> Result<(), sqlx::Error> {
    if sealed.version == 1 {
        sqlx::query(
            "INSERT INTO secrets (org_id, name, version, nonce, ciphertext, created_at_ms, updated_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(org)
        .bind(name)
        .bind(sealed.version)
        .bind(&sealed.nonce)
        .bind(&sealed.ciphertext)
        .bind(at_ms)
        .bind(at_ms)
        .execute(&mut *tx.tx)
        .await?;
    } else {
        sqlx::query(
            "UPDATE secrets SET version = $1, nonce = $2, ciphertext = $3, updated_at_ms = $4
             WHERE org_id = $5 AND name = $6",
        )
        .bind(sealed.version)
        .bind(&sealed.nonce)
        .bind(&sealed.ciphertext)
        .bind(at_ms)
        .bind(org)
        .bind(name)
        .execute(&mut *tx.tx)
        .await?;
    }
    Ok(())
}

/// Forgets the org's secret `name`.
pub async fn delete(tx: &mut WriteTx, org: &str, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM secrets WHERE org_id = $1 AND name = $2")
        .bind(org)
        .bind(name)
        .execute(&mut *tx.tx)
        .await?;
    Ok(())
}

/// Records what a new sandbox asked for, in the create's transaction.
pub async fn insert_for_sandbox(
    tx: &mut WriteTx,
    sandbox_id: &str,
    secrets: &[Secret],
) -> Result<(), sqlx::Error> {
    for (position, secret) in secrets.iter().enumerate() {
        sqlx::query(
            "INSERT INTO sandbox_secrets (sandbox_id, position, name, env, file) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(sandbox_id)
        .bind(position as i64)
        .bind(&secret.name)
        .bind(secret.env.as_deref())
        .bind(secret.file.as_deref())
        .execute(&mut *tx.tx)
        .await?;
    }
    Ok(())
}

fn secret_of(row: &sqlx::any::AnyRow) -> Result<Secret, sqlx::Error> {
    Ok(Secret {
        name: row.try_get("name")?,
        env: row.try_get("env")?,
        file: row.try_get("file")?,
    })
}

/// What one sandbox asked for, in the order it asked.
pub async fn of_sandbox(tx: &mut WriteTx, sandbox_id: &str) -> Result<Vec<Secret>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT name, env, file FROM sandbox_secrets WHERE sandbox_id = $1 ORDER BY position",
    )
    .bind(sandbox_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    rows.iter().map(secret_of).collect()
}

/// What each sandbox placed on the runner asked for, by sandbox id.
pub async fn of_runner(
    tx: &mut WriteTx,
    runner_id: &str,
) -> Result<BTreeMap<String, Vec<Secret>>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT sandbox_id, name, env, file FROM sandbox_secrets
         WHERE sandbox_id IN (SELECT id FROM sandboxes WHERE runner_id = $1)
         ORDER BY sandbox_id, position",
    )
    .bind(runner_id)
    .fetch_all(&mut *tx.tx)
    .await?;
    let mut by_sandbox: BTreeMap<String, Vec<Secret>> = BTreeMap::new();
    for row in &rows {
        by_sandbox
            .entry(row.try_get("sandbox_id")?)
            .or_default()
            .push(secret_of(row)?);
    }
    Ok(by_sandbox)
}

/// One env secret a sandbox asked for: the secret, the variable, and its
/// sealed value's length in hex (0 for a secret deleted since).
pub struct EnvPlace {
    pub secret: String,
    pub env: String,
    pub ciphertext_hex_bytes: usize,
}

/// A sandbox's env secrets.
pub struct SandboxEnvSecrets {
    pub sandbox_id: String,
    pub places: Vec<EnvPlace>,
}

/// Every env secret of each of the org's sandboxes that asks for `name` as
/// an env variable and may launch again (not ended, not being deleted):
/// what a new value of `name` would put into their commands' env.
pub async fn env_secrets_of_live_sandboxes(
    tx: &mut WriteTx,
    org: &str,
    name: &str,
) -> Result<Vec<SandboxEnvSecrets>, sqlx::Error> {
    let live = SandboxState::sql_in(|s| !s.is_terminal() && s.is_held());
    let rows = sqlx::query(&format!(
        // The org's live sandboxes through `sandboxes_by_org_state`, each
        // one's secrets by their key: no scan of every org's.
        "SELECT p.sandbox_id, p.name, p.env, COALESCE(LENGTH(s.ciphertext), 0) AS hex_bytes
         FROM sandboxes b
         JOIN sandbox_secrets p ON p.sandbox_id = b.id
         LEFT JOIN secrets s ON s.org_id = b.org_id AND s.name = p.name
         WHERE b.org_id = $1 AND b.state IN {live} AND p.env IS NOT NULL
           AND EXISTS (SELECT 1 FROM sandbox_secrets q
                       WHERE q.sandbox_id = b.id AND q.name = $2 AND q.env IS NOT NULL)
         ORDER BY p.sandbox_id, p.position"
    ))
    .bind(org)
    .bind(name)
    .fetch_all(&mut *tx.tx)
    .await?;
    let mut sandboxes: Vec<SandboxEnvSecrets> = Vec::new();
    for row in &rows {
        let sandbox_id: String = row.try_get("sandbox_id")?;
        let place = EnvPlace {
            secret: row.try_get("name")?,
            env: row.try_get("env")?,
            ciphertext_hex_bytes: row.try_get::<i64, _>("hex_bytes")?.max(0) as usize,
        };
        match sandboxes.last_mut() {
            Some(last) if last.sandbox_id == sandbox_id => last.places.push(place),
            _ => sandboxes.push(SandboxEnvSecrets {
                sandbox_id,
                places: vec![place],
            }),
        }
    }
    Ok(sandboxes)
}
