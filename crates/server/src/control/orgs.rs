//! Organisations: each is a tenant with its own token, quotas and
//! content store namespace.

use super::AppState;
use crate::auth;
use crate::db::now_ms;
use crate::error::ControlError;
use api::ErrorCode;
use api::orgs::{CreateOrgRequest, CreateOrgResponse};

const ORG_NAME_BYTES_MAX: usize = 64;

fn validate_org_name(name: &str) -> Result<(), ControlError> {
    let ok = !name.is_empty()
        && name.len() <= ORG_NAME_BYTES_MAX
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric();
    let refused = |message: &str| {
        Err(ControlError::new(ErrorCode::InvalidRequest, message)
            .with_details(serde_json::json!({ "field": "name" })))
    };
    if !ok {
        return refused("name: use 1-64 of a-z 0-9 - _, starting with a letter or digit");
    }
    // Where an org is named by its id or its name (`roost admin
    // filesystem bind --org`), a name spelled as ids are could stand for
    // another org.
    if name.starts_with("org_") {
        return refused("name: \"org_\" starts org ids, not names");
    }
    Ok(())
}

/// Creates an org and its token (shown once; only its hash is kept).
pub async fn create(
    state: &AppState,
    request: &CreateOrgRequest,
) -> Result<CreateOrgResponse, ControlError> {
    validate_org_name(&request.name)?;
    if let Some(mib) = request.max_store_mib
        && !(1..=api::orgs::STORE_MIB_MAX).contains(&mib)
    {
        return Err(ControlError::new(
            ErrorCode::InvalidRequest,
            format!(
                "max_store_mib: give 1 to {} (MiB)",
                api::orgs::STORE_MIB_MAX
            ),
        )
        .with_details(serde_json::json!({ "field": "max_store_mib" })));
    }
    let org_id = format!("org_{}", auth::random_hex(8)?);
    let token = auth::new_token("org")?;
    let mut tx = state.db.write().await?;
    let inserted = sqlx::query("INSERT INTO orgs (id, name, max_running, max_total, max_store_mib, created_at_ms) VALUES ($1, $2, $3, $4, $5, $6)")
        .bind(&org_id)
        .bind(&request.name)
        .bind(request.max_running.map(i64::from))
        .bind(request.max_total.map(i64::from))
        .bind(request.max_store_mib.map(|mib| mib as i64))
        .bind(now_ms())
        .execute(&mut *tx.tx)
        .await;
    if inserted.is_err() {
        let exists: Option<(String,)> = sqlx::query_as("SELECT id FROM orgs WHERE name = $1")
            .bind(&request.name)
            .fetch_optional(&state.db.pool)
            .await?;
        if exists.is_some() {
            return Err(ControlError::new(
                ErrorCode::InvalidState,
                format!("an org named {:?} exists", request.name),
            ));
        }
        inserted?;
    }
    crate::records::tokens::insert_org_token(&mut tx, &auth::hash_token(&token), &org_id, now_ms())
        .await?;
    tx.commit().await?;
    tracing::info!(%org_id, name = %request.name, "org created");
    Ok(CreateOrgResponse {
        org_id,
        name: request.name.clone(),
        token,
    })
}

/// Another token for an org (named by id or name), shown once.
pub async fn create_token(
    state: &AppState,
    org: &str,
) -> Result<api::orgs::OrgTokenResponse, ControlError> {
    let token = auth::new_token("org")?;
    let mut tx = state.db.write().await?;
    let org_id = crate::records::filesystems::org_id_of(&mut tx, org)
        .await?
        .ok_or_else(|| crate::records::not_found("org"))?;
    crate::records::tokens::insert_org_token(&mut tx, &auth::hash_token(&token), &org_id, now_ms())
        .await?;
    tx.commit().await?;
    tracing::info!(%org_id, "org token created");
    Ok(api::orgs::OrgTokenResponse { org_id, token })
}

/// Most bytes of a token a revoke accepts (roost's are 76).
const TOKEN_BYTES_MAX: usize = 256;

/// Revokes an org's token or a runner enrolment token. This server
/// refuses it at once; every other server within
/// [`auth::TOKEN_CACHE_TTL`] (its cached verification ages out, and the
/// record is read again).
pub async fn revoke_token(
    state: &AppState,
    request: &api::orgs::RevokeTokenRequest,
) -> Result<api::orgs::RevokedToken, ControlError> {
    if request.token.is_empty() || request.token.len() > TOKEN_BYTES_MAX {
        return Err(crate::limits::invalid("token", "1 to 256 bytes"));
    }
    let hash = auth::hash_token(&request.token);
    let mut tx = state.db.write().await?;
    let revocation = crate::records::tokens::revoke(&mut tx, &hash, now_ms()).await?;
    tx.commit().await?;
    state.db.tokens.forget(&hash);
    match revocation {
        crate::records::tokens::Revocation::Revoked {
            kind,
            org_id,
            revoked_at_ms,
        } => {
            tracing::warn!(%kind, org_id = org_id.as_deref().unwrap_or(""), "token revoked");
            Ok(api::orgs::RevokedToken {
                kind,
                org_id,
                revoked_at: crate::records::rfc3339(revoked_at_ms),
                refused_everywhere_within_ms: auth::TOKEN_CACHE_TTL.as_millis() as u64,
            })
        }
        crate::records::tokens::Revocation::Admin => Err(ControlError::new(
            ErrorCode::InvalidRequest,
            "the admin token cannot be revoked (it is the deployment's only way in)",
        )
        .with_details(serde_json::json!({ "field": "token" }))),
        crate::records::tokens::Revocation::NotFound => Err(crate::records::not_found("token")),
    }
}
