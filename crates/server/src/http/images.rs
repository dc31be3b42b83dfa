//! Images: root filesystems imported into an org's content store.
//!
//! `roost image import` uploads the tree through the block service, then
//! `PUT /v1/images/{name}` `{"root": HEX}` commits it: the server finds
//! the root under the store's commit lock (the block service took each
//! tree only with its children, so the root proves the whole tree),
//! points the store's home `image-{hash of name}` at it (which
//! keeps it alive for gc) and records the image. A sandbox created with
//! `image: NAME` pins that root; runners materialise it from the store.

use axum::extract::{Path, State};

use super::{AppState, Caller, Json};
use crate::control::home_store::store_org;
use crate::control::home_store::{blocking, store_error, store_of};
use crate::control::home_store::{parse_root, pin_tree};
use crate::db::now_ms;
use crate::error::ControlError;
use crate::limits;
use crate::records::rfc3339;
use api::ErrorCode;
use api::images::{CommitImageRequest, Image, ImageList};
use sqlx::Row;
use store::HomeName;

/// The store home that holds an image's tree. Image names allow more
/// characters than home names, so the home is named by a hash of it.
fn image_home(name: &str) -> Result<HomeName, ControlError> {
    let hash = blake3::hash(name.as_bytes()).to_hex();
    format!("image-{}", &hash[..32])
        .parse()
        .map_err(|_| ControlError::new(ErrorCode::Internal, "internal error"))
}

fn validate_name(name: &str) -> Result<(), ControlError> {
    limits::name("name", name)?;
    if name == "default" {
        return Err(limits::invalid(
            "name",
            "\"default\" is the runner host's own system and cannot be replaced",
        ));
    }
    Ok(())
}

fn not_found(name: &str) -> ControlError {
    ControlError::new(ErrorCode::NotFound, format!("no image {name:?}"))
}

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

async fn read(state: &AppState, org: &str, name: &str) -> Result<Option<Image>, ControlError> {
    let row = sqlx::query(&format!(
        "SELECT {IMAGE_COLUMNS} FROM images WHERE org_id = $1 AND name = $2"
    ))
    .bind(org)
    .bind(name)
    .fetch_optional(&state.db.pool)
    .await?;
    Ok(row.as_ref().map(image_of).transpose()?)
}

#[utoipa::path(put, path = "/v1/images/{name}", tag = "images", params(("name" = String, Path)), request_body = api::images::CommitImageRequest, responses((status = 200, body = api::images::Image), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn commit(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    Json(request): Json<CommitImageRequest>,
) -> Result<axum::Json<Image>, ControlError> {
    let org = caller.org()?;
    validate_name(&name)?;
    let root = parse_root(Some(&request.root))?;
    let summary = pin_tree(&state, &org, image_home(&name)?, root).await?;
    let now = now_ms();
    let mut tx = state.db.write().await?;
    let updated = sqlx::query(
        "UPDATE images SET root = $1, files = $2, logical_bytes = $3, updated_at_ms = $4
         WHERE org_id = $5 AND name = $6",
    )
    .bind(root.to_hex())
    .bind(request.files.unwrap_or(0) as i64)
    .bind(summary.logical_bytes as i64)
    .bind(now)
    .bind(&org)
    .bind(&name)
    .execute(&mut *tx.tx)
    .await?;
    if updated.rows_affected() == 0 {
        sqlx::query(&format!(
            "INSERT INTO images (org_id, {IMAGE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"
        ))
        .bind(&org)
        .bind(&name)
        .bind(root.to_hex())
        .bind(request.files.unwrap_or(0) as i64)
        .bind(summary.logical_bytes as i64)
        .bind(now)
        .bind(now)
        .execute(&mut *tx.tx)
        .await?;
    }
    tx.commit().await?;
    tracing::info!(%org, image = %name, %root, "image committed");
    read(&state, &org, &name)
        .await?
        .map(axum::Json)
        .ok_or_else(|| not_found(&name))
}

#[utoipa::path(get, path = "/v1/images/{name}", tag = "images", params(("name" = String, Path)), responses((status = 200, body = api::images::Image), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<axum::Json<Image>, ControlError> {
    let org = caller.org()?;
    read(&state, &org, &name)
        .await?
        .map(axum::Json)
        .ok_or_else(|| not_found(&name))
}

#[utoipa::path(get, path = "/v1/images", tag = "images", responses((status = 200, body = api::images::ImageList), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<axum::Json<ImageList>, ControlError> {
    let org = caller.org()?;
    let rows = sqlx::query(&format!(
        "SELECT {IMAGE_COLUMNS} FROM images WHERE org_id = $1 ORDER BY name"
    ))
    .bind(&org)
    .fetch_all(&state.db.pool)
    .await?;
    let images = rows.iter().map(image_of).collect::<Result<_, _>>()?;
    Ok(axum::Json(ImageList { images }))
}

/// Forgets the image; its tree becomes collectable by gc. Sandboxes that
/// already run it keep their materialised copy.
#[utoipa::path(delete, path = "/v1/images/{name}", tag = "images", params(("name" = String, Path)), responses((status = 200, body = api::images::Image), (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<axum::Json<Image>, ControlError> {
    let org = caller.org()?;
    let image = read(&state, &org, &name)
        .await?
        .ok_or_else(|| not_found(&name))?;
    let store = store_of(&state)?;
    let home = image_home(&name)?;
    let store_org = store_org(&org)?;
    let mut tx = state.db.write().await?;
    sqlx::query("DELETE FROM images WHERE org_id = $1 AND name = $2")
        .bind(&org)
        .bind(&name)
        .execute(&mut *tx.tx)
        .await?;
    blocking(move || store.delete_home(&store_org, &home))
        .await?
        .map_err(store_error)?;
    tx.commit().await?;
    Ok(axum::Json(image))
}
