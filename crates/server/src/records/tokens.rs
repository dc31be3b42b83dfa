//! Token rows: an org's tokens, and revocation (a revoked token keeps its
//! row, with when it was revoked, so a retried revoke answers the same).
//! The admin's and runner tokens are written by `auth`, which reads them
//! all.

use sqlx::Row;

use crate::db::WriteTx;

/// Adds a token (by its hash) for the org.
pub async fn insert_org_token(
    tx: &mut WriteTx,
    hash: &str,
    org_id: &str,
    now_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO tokens (hash, kind, org_id, created_at_ms) VALUES ($1, 'org', $2, $3)",
    )
    .bind(hash)
    .bind(org_id)
    .bind(now_ms)
    .execute(&mut *tx.tx)
    .await?;
    Ok(())
}

/// What a revoke found.
pub enum Revocation {
    /// Revoked now, or earlier (then `revoked_at_ms` is that first time).
    Revoked {
        kind: String,
        org_id: Option<String>,
        revoked_at_ms: i64,
    },
    /// The admin token: never revoked (it is the deployment's only way in).
    Admin,
    NotFound,
}

/// Revokes the token with this hash, unless it is the admin's.
pub async fn revoke(tx: &mut WriteTx, hash: &str, now_ms: i64) -> Result<Revocation, sqlx::Error> {
    let row = sqlx::query("SELECT kind, org_id, revoked_at_ms FROM tokens WHERE hash = $1")
        .bind(hash)
        .fetch_optional(&mut *tx.tx)
        .await?;
    let Some(row) = row else {
        return Ok(Revocation::NotFound);
    };
    let kind: String = row.try_get("kind")?;
    if kind == "admin" {
        return Ok(Revocation::Admin);
    }
    let org_id: Option<String> = row.try_get("org_id")?;
    let revoked_at_ms = match row.try_get::<Option<i64>, _>("revoked_at_ms")? {
        Some(earlier) => earlier,
        None => {
            sqlx::query("UPDATE tokens SET revoked_at_ms = $2 WHERE hash = $1")
                .bind(hash)
                .bind(now_ms)
                .execute(&mut *tx.tx)
                .await?;
            now_ms
        }
    };
    Ok(Revocation::Revoked {
        kind,
        org_id,
        revoked_at_ms,
    })
}
