//! The image row: an org's named root filesystem, a tree in its store.

use sqlx::AnyPool;
use sqlx::Row;

use super::rfc3339;
use crate::db::WriteTx;
use api::images::Image;

const IMAGE_COLUMNS: &str = "name, root, files, logical_bytes, created_at_ms, updated_at_ms";

fn image_of(row: &sqlx::any::AnyRow) -> Result<Image, sqlx::Error> {
    Ok(Image {
        name: row.try_get("name")?,
        root: row.try_get("root")?,
        files: row.try_get::<i64, _>("files")? as u64,
        logical_bytes: row.try_get::<i64, _>("logical_bytes")? as u64,
        created_at: rfc3339(row.try_get("created_at_ms")?),
        updated_at: rfc3339(row.try_get("updated_at_ms")?),
    })
}

/// The org's image named `name`.
pub async fn read(pool: &AnyPool, org: &str, name: &str) -> Result<Option<Image>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {IMAGE_COLUMNS} FROM images WHERE org_id = $1 AND name = $2"
    ))
    .bind(org)
    .bind(name)
    .fetch_optional(pool)
    .await?;
    row.as_ref().map(image_of).transpose()
}

/// The org's images by name.
pub async fn list(pool: &AnyPool, org: &str) -> Result<Vec<Image>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT {IMAGE_COLUMNS} FROM images WHERE org_id = $1 ORDER BY name"
    ))
    .bind(org)
    .fetch_all(pool)
    .await?;
    rows.iter().map(image_of).collect()
}

/// The root an org's image points at, read inside the admitting
/// transaction.
pub async fn root_of(
    tx: &mut WriteTx,
    org_id: &str,
    name: &str,
) -> Result<Option<String>, sqlx::Error> {
    let row: Option<(String,)> =
        sqlx::query_as("SELECT root FROM images WHERE org_id = $1 AND name = $2")
            .bind(org_id)
            .bind(name)
            .fetch_optional(&mut *tx.tx)
            .await?;
    Ok(row.map(|(root,)| root))
}

/// What an image commit records.
pub struct Committed<'a> {
    pub root: &'a str,
    pub files: i64,
    pub logical_bytes: i64,
    pub at_ms: i64,
}

/// Points the org's image `name` at a committed tree (made if new).
pub async fn upsert(
    tx: &mut WriteTx,
    org: &str,
    name: &str,
    image: Committed<'_>,
) -> Result<(), sqlx::Error> {
    let updated = sqlx::query(
        "UPDATE images SET root = $1, files = $2, logical_bytes = $3, updated_at_ms = $4
         WHERE org_id = $5 AND name = $6",
    )
    .bind(image.root)
    .bind(image.files)
    .bind(image.logical_bytes)
    .bind(image.at_ms)
    .bind(org)
    .bind(name)
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() == 0 {
        sqlx::query(&format!(
            "INSERT INTO images (org_id, {IMAGE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"
        ))
        .bind(org)
        .bind(name)
        .bind(image.root)
        .bind(image.files)
        .bind(image.logical_bytes)
        .bind(image.at_ms)
        .bind(image.at_ms)
        .execute(&mut *tx.tx)
        .await?;
    }
    Ok(())
}

/// Forgets the org's image `name`.
pub async fn delete(tx: &mut WriteTx, org: &str, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM images WHERE org_id = $1 AND name = $2")
        .bind(org)
        .bind(name)
        .execute(&mut *tx.tx)
        .await?;
    Ok(())
}
