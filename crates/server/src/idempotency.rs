//! `Idempotency-Key`: the same key with the same request replays the
//! original response; with a different request it is 409
//! `idempotency_conflict`. The key row is written in the transaction that
//! makes the effect, with `ON CONFLICT DO NOTHING`: of two concurrent
//! requests with one key, the second waits on the first's uncommitted row
//! (PostgreSQL) or on the writer lock (SQLite), inserts nothing, rolls its
//! own effect back and replays the first one's answer. A create refused
//! before it reaches its key row (by the first's effect: the quota its
//! sandbox fills) looks for that answer too (`replay_after_failure`).

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use sqlx::Row;

use crate::db::{Db, WriteTx, now_ms};
use crate::error::ControlError;
use crate::limits;
use api::ErrorCode;

pub struct Key {
    pub org_id: String,
    pub scope: &'static str,
    pub key: String,
    pub request_hash: String,
}

impl Key {
    /// The key from the headers, if any, bound to this request's content.
    pub fn from_request(
        headers: &HeaderMap,
        org_id: &str,
        scope: &'static str,
        target: &str,
        request: &impl Serialize,
    ) -> Result<Option<Key>, ControlError> {
        let Some(value) = headers.get("idempotency-key") else {
            return Ok(None);
        };
        let key = value
            .to_str()
            .ok()
            .filter(|k| !k.is_empty() && k.len() <= limits::IDEMPOTENCY_KEY_BYTES_MAX)
            .ok_or_else(|| {
                limits::invalid(
                    "Idempotency-Key",
                    format!(
                        "use 1-{} visible ASCII characters",
                        limits::IDEMPOTENCY_KEY_BYTES_MAX
                    ),
                )
            })?;
        let mut hasher = blake3::Hasher::new();
        hasher.update(target.as_bytes());
        hasher.update(b"\n");
        // Serialized from the parsed request (maps are sorted), so two
        // spellings of one request are the same request.
        hasher.update(&serde_json::to_vec(request).unwrap_or_default());
        Ok(Some(Key {
            org_id: org_id.to_owned(),
            scope,
            key: key.to_owned(),
            request_hash: hasher.finalize().to_hex().to_string(),
        }))
    }
}

/// The stored answer for `key`, if a request with it has committed.
pub async fn replay(db: &Db, key: &Key) -> Result<Option<Response>, ControlError> {
    let row = sqlx::query(
        "SELECT request_hash, status, response FROM idempotency_keys WHERE org_id = $1 AND scope = $2 AND key = $3",
    )
    .bind(&key.org_id)
    .bind(key.scope)
    .bind(&key.key)
    .fetch_optional(&db.pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let hash: String = row.try_get("request_hash")?;
    if hash != key.request_hash {
        return Err(ControlError::new(
            ErrorCode::IdempotencyConflict,
            "this Idempotency-Key was used with a different request",
        ));
    }
    let status: i64 = row.try_get("status")?;
    let body: String = row.try_get("response")?;
    let status = StatusCode::from_u16(status as u16).unwrap_or(StatusCode::OK);
    let mut response = (
        status,
        [(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response();
    response
        .headers_mut()
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    Ok(Some(response))
}

/// What a keyed request that failed answers: the stored answer of the
/// request with its key, if one committed meanwhile, else `failed`. Two
/// concurrent requests with one key both find nothing to replay before
/// either commits, and the second can then be refused by the first's
/// effect (a quota its sandbox now fills) before it reaches its key row:
/// that refusal would tell a retrying client its first attempt failed.
/// A key used with another request is still 409 `idempotency_conflict`.
pub async fn replay_after_failure(
    db: &Db,
    key: Option<&Key>,
    failed: ControlError,
) -> Result<Response, ControlError> {
    let Some(key) = key else {
        return Err(failed);
    };
    match replay(db, key).await {
        Ok(Some(replayed)) => Ok(replayed),
        Err(conflict) if conflict.code == ErrorCode::IdempotencyConflict => Err(conflict),
        // Nothing committed with the key (or it cannot be read now): the
        // refusal is this request's own.
        Ok(None) | Err(_) => Err(failed),
    }
}

/// Records the answer in `tx`. `false`: another request with this key
/// committed first; roll back and replay its answer.
pub async fn record(
    tx: &mut WriteTx,
    key: &Key,
    status: StatusCode,
    body: &impl Serialize,
    resource_id: &str,
) -> Result<bool, ControlError> {
    let body = serde_json::to_string(body)
        .map_err(|e| ControlError::new(ErrorCode::Internal, e.to_string()))?;
    let inserted = sqlx::query(
        "INSERT INTO idempotency_keys (org_id, scope, key, request_hash, status, response, resource_id, created_at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
    )
    .bind(&key.org_id)
    .bind(key.scope)
    .bind(&key.key)
    .bind(&key.request_hash)
    .bind(i64::from(status.as_u16()))
    .bind(body)
    .bind(resource_id)
    .bind(now_ms())
    .execute(&mut *tx.tx)
    .await?;
    Ok(inserted.rows_affected() == 1)
}

/// Starts the keeping time of the keys that created `resource_id` again,
/// as the resource ends. A key is kept a day after its resource ended
/// (DESIGN §3), and `created_at_ms` is when that day starts counting: the
/// retention pass keeps the key of a sandbox or command that has not ended,
/// and of a snapshot that still exists, whatever that time says. A snapshot
/// leaves no row behind when deleted, so its keys count from here.
pub async fn resource_ended(
    tx: &mut WriteTx,
    org_id: &str,
    resource_id: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE idempotency_keys SET created_at_ms = $1 WHERE org_id = $2 AND resource_id = $3",
    )
    .bind(now_ms())
    .bind(org_id)
    .bind(resource_id)
    .execute(&mut *tx.tx)
    .await?;
    Ok(())
}

/// Commits a create's transaction with its key's answer (201 and
/// `record`). When another request with the same key committed first, this
/// one is rolled back and that one's answer is returned to replay.
pub async fn commit_created(
    mut tx: WriteTx,
    db: &crate::db::Db,
    key: Option<&Key>,
    record: &impl Serialize,
    resource_id: &str,
) -> Result<Option<axum::response::Response>, ControlError> {
    if let Some(key) = key
        && !self::record(&mut tx, key, StatusCode::CREATED, record, resource_id).await?
    {
        drop(tx);
        let replayed = replay(db, key)
            .await?
            .ok_or_else(|| ControlError::new(ErrorCode::Internal, "idempotency key vanished"))?;
        return Ok(Some(replayed));
    }
    tx.commit().await?;
    Ok(None)
}
