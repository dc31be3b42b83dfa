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
    /// A runner token: may register a new runner, nothing else, declaring
    /// at most what `profile` allows (JSON of an `api::orgs::
    /// RunnerProfile`; `None`: anything).
    RunnerEnrolment {
        profile: Option<String>,
    },
    /// One runner, by its own credential.
    Runner {
        runner_id: String,
    },
}

pub fn random_hex(bytes: usize) -> Result<String, ServerError> {
    let mut buffer = vec![0u8; bytes];
    getrandom::fill(&mut buffer).map_err(|e| ServerError::Random(e.to_string()))?;
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes * 2);
    for byte in buffer {
        text.push(char::from(HEX[usize::from(byte >> 4)]));
        text.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    Ok(text)
}

pub fn new_token(kind: &str) -> Result<String, ServerError> {
    Ok(format!("roost_{kind}_{}", random_hex(32)?))
}

pub fn hash_token(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

/// The deployment's key for envd access tokens: made (32 random bytes)
/// by the first server to start on the database, read by every other.
pub async fn envd_key(db: &Db) -> Result<[u8; 32], ServerError> {
    let made = random_hex(32)?;
    sqlx::query(
        "INSERT INTO deployment_keys (name, value) VALUES ('envd', $1) ON CONFLICT (name) DO NOTHING",
    )
    .bind(&made)
    .execute(&db.pool)
    .await?;
    let (value,): (String,) =
        sqlx::query_as("SELECT value FROM deployment_keys WHERE name = 'envd'")
            .fetch_one(&db.pool)
            .await?;
    blake3::Hash::from_hex(value.trim())
        .map(|hash| *hash.as_bytes())
        .map_err(|_| {
            ServerError::SecretKey("the deployment's envd key is not 64 hex digits".to_owned())
        })
}

/// Where envd access tokens start: `roost_envd_ORG_MAC`.
const ENVD_TOKEN_PREFIX: &str = "roost_envd_";

/// The access token of sandbox `sandbox_id`'s envd (E2B's
/// `envdAccessToken`): good for that sandbox's envd routes only, never
/// for the org's API or another sandbox. It names its org (whose share
/// its requests take) and a keyed BLAKE3 of org and sandbox, so any
/// server checks it without a query.
pub fn envd_token(key: &[u8; 32], org_id: &str, sandbox_id: &str) -> String {
    format!(
        "{ENVD_TOKEN_PREFIX}{org_id}_{}",
        envd_mac(key, org_id, sandbox_id).to_hex()
    )
}

fn envd_mac(key: &[u8; 32], org_id: &str, sandbox_id: &str) -> blake3::Hash {
    let mut hasher = blake3::Hasher::new_keyed(key);
    hasher.update(org_id.as_bytes());
    hasher.update(b"\0");
    hasher.update(sandbox_id.as_bytes());
    hasher.finalize()
}

/// Whether `token` has the shape of an envd access token.
pub fn is_envd_token(token: &str) -> bool {
    token.starts_with(ENVD_TOKEN_PREFIX)
}

/// The org of an envd access token, if it is sandbox `sandbox_id`'s.
pub fn envd_org(key: &[u8; 32], token: &str, sandbox_id: &str) -> Option<String> {
    let rest = token.strip_prefix(ENVD_TOKEN_PREFIX)?;
    let (org_id, mac) = rest.rsplit_once('_')?;
    let mac = blake3::Hash::from_hex(mac).ok()?;
    // `Hash`'s equality is constant-time.
    (!org_id.is_empty() && mac == envd_mac(key, org_id, sandbox_id)).then(|| org_id.to_owned())
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

/// Stores a runner token whose runners may declare at most `profile`.
pub async fn store_runner_token(
    db: &Db,
    token: &str,
    profile: &api::orgs::RunnerProfile,
) -> Result<(), sqlx::Error> {
    let profile =
        (!profile.allows_anything()).then(|| serde_json::to_string(profile).unwrap_or_default());
    sqlx::query(
        "INSERT INTO tokens (hash, kind, org_id, created_at_ms, runner_profile) VALUES ($1, 'runner', NULL, $2, $3)",
    )
    .bind(hash_token(token))
    .bind(now_ms())
    .bind(profile)
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// How long a server trusts a token it verified without asking the
/// database again: the delay after which a token removed from the records
/// is refused by every server (on the server that removes it, at once:
/// [`TokenCache::forget`]). Unknown tokens are never cached, so a new
/// token works at once everywhere.
pub const TOKEN_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(3);

/// How long a server trusts a runner's credential it verified: longer
/// than [`TOKEN_CACHE_TTL`], because no credential of a runner is ever
/// revoked (what a runner may do is its record's to say: a lost runner is
/// `fenced` by its lease, whatever its credential), and a runner
/// heartbeats every 3 s, so at 3 s nearly every heartbeat missed the
/// cache and cost two queries (`bench/fleet/run.sh`).
pub const RUNNER_CREDENTIAL_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a verification of `principal` is trusted.
fn trusted_for(principal: &Principal) -> std::time::Duration {
    match principal {
        Principal::Runner { .. } => RUNNER_CREDENTIAL_CACHE_TTL,
        _ => TOKEN_CACHE_TTL,
    }
}

/// Most tokens one server remembers (a runner's credential each, plus
/// orgs'): about 200 bytes each.
pub const TOKEN_CACHE_ENTRIES_MAX: usize = 65_536;

/// Verified tokens by hash, each trusted for [`TOKEN_CACHE_TTL`] (a
/// runner's credential for [`RUNNER_CREDENTIAL_CACHE_TTL`]): an
/// authenticated request costs no database round trip for its token.
#[derive(Default)]
pub struct TokenCache {
    entries: std::sync::Mutex<std::collections::HashMap<String, (Principal, std::time::Instant)>>,
}

impl TokenCache {
    fn get(&self, hash: &str) -> Option<Principal> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries
            .get(hash)
            .filter(|(principal, at)| at.elapsed() < trusted_for(principal))
            .map(|(principal, _)| principal.clone())
    }

    fn put(&self, hash: String, principal: Principal) {
        self.put_verified_at(hash, principal, std::time::Instant::now());
    }

    fn put_verified_at(&self, hash: String, principal: Principal, at: std::time::Instant) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() >= TOKEN_CACHE_ENTRIES_MAX {
            // Bounded: the stale go first, and if all are fresh, all go
            // (each costs one query to come back).
            entries.retain(|_, (principal, at)| at.elapsed() < trusted_for(principal));
            if entries.len() >= TOKEN_CACHE_ENTRIES_MAX {
                entries.clear();
            }
        }
        entries.insert(hash, (principal, at));
    }

    /// Trusts a runner credential this server has just written (its
    /// registration committed): the runner's first heartbeat and long-poll
    /// come to this server, and a fleet registering at once would
    /// otherwise verify every credential again, two queries each, in the
    /// same seconds as its first reads (`bench/fleet/run.sh`).
    pub fn trust_new_runner_credential(&self, hash: String, runner_id: String) {
        self.put(hash, Principal::Runner { runner_id });
    }

    /// Forgets a token (by its hash) on this server at once: what removes
    /// a token from the records calls it.
    pub fn forget(&self, hash: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.remove(hash);
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The kind of `token` if it has the shape of the tokens this server
/// makes ([`new_token`]: `roost_KIND_` and 64 hex digits).
fn kind_of(token: &str) -> Option<&str> {
    let (kind, secret) = token
        .strip_prefix("roost_")
        .and_then(|rest| rest.split_once('_'))?;
    (matches!(kind, "admin" | "org" | "runner" | "runnercred")
        && secret.len() == 64
        && secret.bytes().all(|b| b.is_ascii_hexdigit()))
    .then_some(kind)
}

pub async fn authenticate(db: &Db, token: &str) -> Result<Option<Principal>, sqlx::Error> {
    // Refused without a query: unknown tokens are never cached, so a
    // flood of made-up ones would otherwise cost two queries each and
    // could take every connection of the pool from the other tenants.
    let Some(kind) = kind_of(token) else {
        return Ok(None);
    };
    let hash = hash_token(token);
    if let Some(principal) = db.tokens.get(&hash) {
        return Ok(Some(principal));
    }
    let principal = authenticate_uncached(db, &hash, kind == "runnercred").await?;
    if let Some(principal) = &principal {
        db.tokens.put(hash, principal.clone());
    }
    Ok(principal)
}

/// One query: a runner's credential (`credential`) is looked for among
/// the runners, any other token among the tokens.
async fn authenticate_uncached(
    db: &Db,
    hash: &str,
    credential: bool,
) -> Result<Option<Principal>, sqlx::Error> {
    if credential {
        let runner = crate::records::runners::by_credential(&db.pool, hash).await?;
        return Ok(runner.map(|runner_id| Principal::Runner { runner_id }));
    }
    let row: Option<(String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT kind, org_id, runner_profile FROM tokens WHERE hash = $1 AND revoked_at_ms IS NULL",
    )
    .bind(hash)
    .fetch_optional(&db.pool)
    .await?;
    let principal = row.and_then(|(kind, org_id, profile)| match (kind.as_str(), org_id) {
        ("admin", _) => Some(Principal::Admin),
        ("runner", _) => Some(Principal::RunnerEnrolment { profile }),
        ("org", Some(org_id)) => Some(Principal::Org { org_id }),
        _ => None,
    });
    Ok(principal)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Audit finding (HTTP surface): a made-up token cost two queries,
    /// never cached; a flood of them could take the pool.
    #[test]
    fn only_tokens_shaped_as_made_are_looked_up() {
        for kind in ["admin", "org", "runner", "runnercred"] {
            let token = new_token(kind).expect("a token");
            assert_eq!(kind_of(&token), Some(kind), "{token}");
        }
        for token in [
            "",
            "garbage",
            "roost_org_",
            "roost_org_abc",
            "roost_nope_0000000000000000000000000000000000000000000000000000000000000000",
            "roost_org_000000000000000000000000000000000000000000000000000000000000000g",
            "roost_org_00000000000000000000000000000000000000000000000000000000000000000",
        ] {
            assert_eq!(kind_of(token), None, "{token}");
        }
    }

    fn verified_ago(age: Duration) -> Instant {
        Instant::now()
            .checked_sub(age)
            .expect("the clock runs long enough")
    }

    /// A runner heartbeats every 3 s: its credential must outlive the
    /// 3 s a token is trusted, or every heartbeat costs two queries.
    #[test]
    fn a_runners_credential_is_trusted_longer_than_a_token() {
        let cache = TokenCache::default();
        let runner = Principal::Runner {
            runner_id: "rnr_1".to_owned(),
        };
        let org = Principal::Org {
            org_id: "org_1".to_owned(),
        };
        let past_token_ttl = verified_ago(TOKEN_CACHE_TTL + Duration::from_secs(1));
        cache.put_verified_at("runner".to_owned(), runner.clone(), past_token_ttl);
        cache.put_verified_at("org".to_owned(), org.clone(), past_token_ttl);
        assert_eq!(cache.get("runner"), Some(runner.clone()));
        assert_eq!(cache.get("org"), None, "a token is trusted for 3 s only");

        let past_runner_ttl = verified_ago(RUNNER_CREDENTIAL_CACHE_TTL + Duration::from_secs(1));
        cache.put_verified_at("runner".to_owned(), runner, past_runner_ttl);
        assert_eq!(cache.get("runner"), None, "then verified again");
    }
}
