//! Org secrets: set (made or rotated), listed, deleted; sealed with
//! XChaCha20-Poly1305 under the deployment's secret key, which lives
//! outside the database (a 0600 key file, or `ROOST_SECRET_KEY`). The
//! associated data binds each ciphertext to its org, name and version, so
//! a row copied elsewhere in the table does not open. Values leave the
//! server only to the runner of a sandbox's current placement
//! ([`values_for_runner`]); no record, event, log line, metric or error
//! message carries one. A deployment without a key refuses every secret
//! (`unsupported_capability`, `secrets`).

use std::path::{Path, PathBuf};

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

use super::AppState;
use super::runner_protocol::{check_placement, no_such_runner};
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::limits;
use crate::records::{self, secrets::Sealed};
use api::ErrorCode;
use api::runners::{SecretValue, SecretValues, SecretsRequest};
use api::sandboxes::Secret;
use api::secrets::{
    SECRET_VALUE_BYTES_MAX, SECRETS_PER_ORG_MAX, SECRETS_PER_SANDBOX_MAX, SecretRecord,
    SetSecretRequest,
};

const KEY_BYTES: usize = 32;
const NONCE_BYTES: usize = 24;
/// Poly1305's tag, after the value in every ciphertext.
const TAG_BYTES: usize = 16;

/// Most bytes one sandbox's env secrets take together, names and values
/// (counted as `limits::env` counts a request's `env`, and as large). The
/// runner puts them into every command's environment, which goes to the
/// sandbox's agent in one frame of at most 1 MiB beside the command's own
/// `env` and `argv` (`oci::agent::wire::FRAME_BYTES_MAX`): 64 secrets of
/// 64 KiB each made every command end `launch_failed`.
pub const ENV_SECRETS_BYTES_MAX: usize = limits::ENV_BYTES_MAX;

/// A sealed value's length in bytes, read from its ciphertext's (hex of
/// the value and the tag) without opening it.
fn sealed_value_bytes(ciphertext_hex_bytes: usize) -> usize {
    (ciphertext_hex_bytes / 2).saturating_sub(TAG_BYTES)
}

/// The refusal of env secrets past [`ENV_SECRETS_BYTES_MAX`]: a create's
/// (`secrets`), or a secret's new value (`value`) that would push
/// `sandbox`'s env secrets past it.
fn env_secrets_too_large(field: &str, bytes: usize, sandbox: Option<&str>) -> ControlError {
    let whose = match sandbox {
        Some(id) => format!("with this value, sandbox {id}'s"),
        None => "the sandbox's".to_owned(),
    };
    ControlError::new(
        ErrorCode::PayloadTooLarge,
        format!(
            "{field}: {whose} env secrets would come to {bytes} bytes (names and values), past {ENV_SECRETS_BYTES_MAX}"
        ),
    )
    .with_details(serde_json::json!({
        "field": field,
        "limit_bytes": ENV_SECRETS_BYTES_MAX,
        "bytes": bytes,
        "sandbox_id": sandbox,
    }))
}

/// The deployment's secret key. Its bytes are never printed.
#[derive(Clone)]
pub struct SecretKey([u8; KEY_BYTES]);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}

/// Where the key comes from (`Config::secret_key`).
#[derive(Clone, Default)]
pub enum SecretKeySource {
    /// No key: `secrets` are refused.
    #[default]
    None,
    /// A file of 64 hex digits, mode 0600; made with a fresh key if absent.
    File(PathBuf),
    /// 64 hex digits (from `ROOST_SECRET_KEY`).
    Hex(String),
}

impl std::fmt::Debug for SecretKeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretKeySource::None => f.write_str("None"),
            SecretKeySource::File(path) => write!(f, "File({})", path.display()),
            SecretKeySource::Hex(_) => f.write_str("Hex(<redacted>)"),
        }
    }
}

/// Why the key could not be had; never shows key material.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("secret key {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "secret key {}: others may read it (mode {mode:o}); make it 0600",
        path.display()
    )]
    Exposed { path: PathBuf, mode: u32 },
    #[error("secret key {0}: not 64 hex digits")]
    Malformed(String),
    #[error(
        "secret key {}: the file is empty (a server killed while making it?): if no secret was ever set, remove it and start again",
        path.display()
    )]
    Empty { path: PathBuf },
    #[error("no randomness available for a secret key: {0}")]
    Random(String),
}

fn parse_hex_key(text: &str, what: &str) -> Result<SecretKey, KeyError> {
    let text = text.trim();
    let bytes = hex_decode(text).ok_or_else(|| KeyError::Malformed(what.to_owned()))?;
    let key: [u8; KEY_BYTES] = bytes
        .try_into()
        .map_err(|_| KeyError::Malformed(what.to_owned()))?;
    Ok(SecretKey(key))
}

fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hex_decode(text: &str) -> Option<Vec<u8>> {
    text.as_bytes()
        .chunks(2)
        .map(|pair| {
            let pair = std::str::from_utf8(pair).ok().filter(|p| p.len() == 2)?;
            u8::from_str_radix(pair, 16).ok()
        })
        .collect()
}

impl SecretKeySource {
    /// The key, reading (or first making) the key file.
    pub fn load(&self) -> Result<Option<SecretKey>, KeyError> {
        match self {
            SecretKeySource::None => Ok(None),
            SecretKeySource::Hex(text) => parse_hex_key(text, "ROOST_SECRET_KEY").map(Some),
            SecretKeySource::File(path) => load_or_make(path).map(Some),
        }
    }
}

fn load_or_make(path: &Path) -> Result<SecretKey, KeyError> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |source| KeyError::Io {
        path: path.to_owned(),
        source,
    };
    match std::fs::metadata(path) {
        // Left by a server (of a version before keys were linked in whole)
        // killed between making the file and writing it. Not removed
        // here: another server may be making it this instant, and a key
        // replaced after use loses every secret sealed with it.
        Ok(metadata) if metadata.len() == 0 => Err(KeyError::Empty {
            path: path.to_owned(),
        }),
        Ok(metadata) => {
            let mode = metadata.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(KeyError::Exposed {
                    path: path.to_owned(),
                    mode,
                });
            }
            let text = std::fs::read_to_string(path).map_err(io)?;
            parse_hex_key(&text, &path.display().to_string())
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            let mut key = [0u8; KEY_BYTES];
            getrandom::fill(&mut key).map_err(|e| KeyError::Random(e.to_string()))?;
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io)?;
            }
            // Written whole under a name of its own, then linked to
            // `path`, which fails if `path` exists: two servers starting
            // on one data dir cannot both make a key (the loser reads the
            // winner's), and neither they nor a server killed half way
            // ever leave `path` empty or half written.
            let temp = path.with_file_name(format!(
                ".{}.{}",
                path.file_name()
                    .map_or_else(Default::default, |n| n.to_string_lossy()),
                hex_encode(&{
                    let mut tag = [0u8; 8];
                    getrandom::fill(&mut tag).map_err(|e| KeyError::Random(e.to_string()))?;
                    tag
                })
            ));
            let written = (|| {
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&temp)?;
                file.write_all(format!("{}\n", hex_encode(&key)).as_bytes())?;
                file.sync_all()?;
                std::fs::hard_link(&temp, path)
            })();
            let _ = std::fs::remove_file(&temp);
            match written {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
                    return load_or_make(path);
                }
                Err(err) => return Err(io(err)),
            }
            if let Some(parent) = path.parent() {
                std::fs::File::open(parent)
                    .and_then(|dir| dir.sync_all())
                    .map_err(io)?;
            }
            tracing::info!(path = %path.display(), "made a secret key");
            Ok(SecretKey(key))
        }
        Err(err) => Err(io(err)),
    }
}

/// What a ciphertext is bound to.
fn associated_data(org: &str, name: &str, version: i64) -> Vec<u8> {
    format!("roost-secret-v1\0{org}\0{name}\0{version}").into_bytes()
}

fn internal() -> ControlError {
    ControlError::new(ErrorCode::Internal, "internal error")
}

fn seal(
    key: &SecretKey,
    org: &str,
    name: &str,
    version: i64,
    value: &[u8],
) -> Result<Sealed, ControlError> {
    let mut nonce = [0u8; NONCE_BYTES];
    getrandom::fill(&mut nonce).map_err(|_| internal())?;
    let cipher = XChaCha20Poly1305::new((&key.0).into());
    let aad = associated_data(org, name, version);
    let ciphertext = cipher
        .encrypt(
            XNonce::from_slice(&nonce),
            Payload {
                msg: value,
                aad: &aad,
            },
        )
        .map_err(|_| internal())?;
    Ok(Sealed {
        version,
        nonce: hex_encode(&nonce),
        ciphertext: hex_encode(&ciphertext),
    })
}

fn open(key: &SecretKey, org: &str, name: &str, sealed: &Sealed) -> Result<String, ControlError> {
    let cannot_open = || {
        tracing::error!(%org, secret = %name, "a secret does not open with this deployment's key");
        ControlError::new(
            ErrorCode::Internal,
            format!("secret {name:?} does not open with this deployment's secret key"),
        )
    };
    let nonce = hex_decode(&sealed.nonce)
        .filter(|n| n.len() == NONCE_BYTES)
        .ok_or_else(cannot_open)?;
    let ciphertext = hex_decode(&sealed.ciphertext).ok_or_else(cannot_open)?;
    let cipher = XChaCha20Poly1305::new((&key.0).into());
    let aad = associated_data(org, name, sealed.version);
    let plain = cipher
        .decrypt(
            XNonce::from_slice(&nonce),
            Payload {
                msg: &ciphertext,
                aad: &aad,
            },
        )
        .map_err(|_| cannot_open())?;
    String::from_utf8(plain).map_err(|_| cannot_open())
}

/// The key, or the refusal of a deployment without one.
pub fn key_of(state: &AppState) -> Result<&SecretKey, ControlError> {
    state.secret_key.as_deref().ok_or_else(|| {
        ControlError::new(
            ErrorCode::UnsupportedCapability,
            "this deployment has no secret key, so it holds no secrets (roost server --secret-key-file, or ROOST_SECRET_KEY)",
        )
        .with_details(serde_json::json!({ "missing": ["secrets"] }))
    })
}

pub fn not_found(name: &str) -> ControlError {
    ControlError::new(ErrorCode::NotFound, format!("no secret {name:?}"))
}

pub fn validate_name(field: &str, name: &str) -> Result<(), ControlError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(limits::invalid(
            field,
            "use 1-64 of A-Z a-z 0-9 _ . -, not starting with a dot",
        ))
    }
}

/// Sets the org's secret `name` to `request.value`: version 1, or one
/// more than the last (rotation). Sandboxes launched from now on get it.
pub async fn set(
    state: &AppState,
    org: &str,
    name: &str,
    request: &SetSecretRequest,
) -> Result<SecretRecord, ControlError> {
    let key = key_of(state)?;
    validate_name("name", name)?;
    if request.value.len() > SECRET_VALUE_BYTES_MAX {
        return Err(limits::too_large("value", SECRET_VALUE_BYTES_MAX));
    }
    if request.value.contains('\0') {
        return Err(limits::invalid("value", "contains a NUL byte"));
    }
    let mut tx = state.db.write().await?;
    // A sandbox that may launch again gets the new value in its commands'
    // env: it must still fit there.
    for sandbox in records::secrets::env_secrets_of_live_sandboxes(&mut tx, org, name).await? {
        let bytes: usize = sandbox
            .places
            .iter()
            .map(|place| {
                let value = if place.secret == name {
                    request.value.len()
                } else {
                    sealed_value_bytes(place.ciphertext_hex_bytes)
                };
                place.env.len() + value
            })
            .sum();
        if bytes > ENV_SECRETS_BYTES_MAX {
            return Err(env_secrets_too_large(
                "value",
                bytes,
                Some(&sandbox.sandbox_id),
            ));
        }
    }
    let version = match records::secrets::sealed(&mut tx, org, name).await? {
        Some(current) => current.version + 1,
        None => {
            if records::secrets::count(&mut tx, org).await? >= SECRETS_PER_ORG_MAX as i64 {
                let limit = SECRETS_PER_ORG_MAX as i64;
                return Err(ControlError::new(
                    ErrorCode::QuotaExceeded,
                    format!("quota secrets reached ({limit} of {limit})"),
                )
                .with_details(serde_json::json!({
                    "quota": { "metric": "secrets", "limit": limit, "current": limit }
                })));
            }
            1
        }
    };
    let sealed = seal(key, org, name, version, request.value.as_bytes())?;
    records::secrets::put(&mut tx, org, name, &sealed, now_ms()).await?;
    tx.commit().await?;
    tracing::info!(%org, secret = %name, version, "secret set");
    records::secrets::read(&state.db.pool, org, name)
        .await?
        .ok_or_else(|| not_found(name))
}

/// Forgets the org's secret `name`. Sandboxes running keep what they were
/// given; a later launch of one that asks for it fails
/// (`secret_unavailable`).
pub async fn delete(state: &AppState, org: &str, name: &str) -> Result<SecretRecord, ControlError> {
    let record = records::secrets::read(&state.db.pool, org, name)
        .await?
        .ok_or_else(|| not_found(name))?;
    let mut tx = state.db.write().await?;
    records::secrets::delete(&mut tx, org, name).await?;
    tx.commit().await?;
    tracing::info!(%org, secret = %name, "secret deleted");
    Ok(record)
}

/// Admission of a create's `secrets`: refused without a key; each names
/// an existing secret of the org and exactly one place (an env variable
/// or a file name), no place twice.
pub async fn check_request(
    state: &AppState,
    tx: &mut WriteTx,
    org: &str,
    secrets: &[Secret],
) -> Result<(), ControlError> {
    if secrets.is_empty() {
        return Ok(());
    }
    key_of(state)?;
    if secrets.len() > SECRETS_PER_SANDBOX_MAX {
        return Err(limits::invalid(
            "secrets",
            format!("at most {SECRETS_PER_SANDBOX_MAX}"),
        ));
    }
    let mut places = std::collections::BTreeSet::new();
    let mut env_bytes = 0;
    for secret in secrets {
        validate_name("secrets.name", &secret.name)?;
        let place = match (&secret.env, &secret.file) {
            (Some(env), None) => {
                let one = std::collections::BTreeMap::from([(env.clone(), String::new())]);
                limits::env("secrets.env", &one)?;
                format!("env {env}")
            }
            (None, Some(file)) => {
                validate_name("secrets.file", file)?;
                format!("file {file}")
            }
            _ => {
                return Err(limits::invalid(
                    "secrets",
                    format!("secret {:?}: give exactly one of env and file", secret.name),
                ));
            }
        };
        if !places.insert(place.clone()) {
            return Err(limits::invalid(
                "secrets",
                format!("{place} is given twice"),
            ));
        }
        let Some(sealed) = records::secrets::sealed(tx, org, &secret.name).await? else {
            return Err(ControlError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "secrets: no secret {:?} in this org (set it with `roost secret set`)",
                    secret.name
                ),
            )
            .with_details(serde_json::json!({ "field": "secrets", "secret": secret.name })));
        };
        if let Some(env) = &secret.env {
            env_bytes += env.len() + sealed_value_bytes(sealed.ciphertext.len());
        }
    }
    if env_bytes > ENV_SECRETS_BYTES_MAX {
        return Err(env_secrets_too_large("secrets", env_bytes, None));
    }
    Ok(())
}

/// The values of what the sandbox asked for, for the runner of its current
/// placement only.
pub async fn values_for_runner(
    state: &AppState,
    caller_runner_id: &str,
    sandbox_id: &str,
    request: &SecretsRequest,
) -> Result<SecretValues, ControlError> {
    if request.runner_id != caller_runner_id {
        return Err(no_such_runner());
    }
    let key = key_of(state)?;
    let mut tx = state.db.write().await?;
    let sandbox = records::load_sandbox(&mut tx, sandbox_id)
        .await?
        .ok_or_else(|| records::not_found("sandbox"))?;
    check_placement(&sandbox, caller_runner_id, request.epoch)?;
    // Only for a placement that may still run, on a runner that still
    // holds its lease: a runner left holding an ended sandbox (its
    // `runner_id` stays) would read the org's current values for ever.
    crate::control::runner_protocol::live_runner(&mut tx, caller_runner_id).await?;
    if sandbox.state.is_terminal()
        || sandbox.state == api::lifecycle::SandboxState::Deleting
        || matches!(
            sandbox.desired,
            api::lifecycle::DesiredState::Deleted | api::lifecycle::DesiredState::Terminated
        )
    {
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "sandbox {sandbox_id} is {} (wanted {}): its secrets are for a placement that runs",
                sandbox.state, sandbox.desired
            ),
        ));
    }
    let asked = records::secrets::of_sandbox(&mut tx, sandbox_id).await?;
    let mut secrets = Vec::with_capacity(asked.len());
    for secret in asked {
        let sealed = records::secrets::sealed(&mut tx, &sandbox.org_id, &secret.name)
            .await?
            .ok_or_else(|| {
                ControlError::new(
                    ErrorCode::NotFound,
                    format!(
                        "secret {:?} was deleted since the sandbox was created",
                        secret.name
                    ),
                )
                .with_details(serde_json::json!({ "secret": secret.name }))
            })?;
        let value = open(key, &sandbox.org_id, &secret.name, &sealed)?;
        secrets.push(SecretValue {
            name: secret.name,
            env: secret.env,
            file: secret.file,
            value,
        });
    }
    tx.commit().await?;
    Ok(SecretValues { secrets })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_values_open_only_where_they_were_sealed() {
        let key = SecretKey([7; KEY_BYTES]);
        let sealed = seal(&key, "org_a", "token", 3, b"hunter2").expect("seal");
        assert!(!sealed.ciphertext.contains(&hex_encode(b"hunter2")));
        assert_eq!(
            open(&key, "org_a", "token", &sealed).expect("open"),
            "hunter2"
        );
        assert!(open(&key, "org_b", "token", &sealed).is_err());
        assert!(open(&key, "org_a", "other", &sealed).is_err());
        let moved = Sealed {
            version: 4,
            ..sealed
        };
        assert!(open(&key, "org_a", "token", &moved).is_err());
        let other_key = SecretKey([8; KEY_BYTES]);
        let sealed = seal(&key, "org_a", "token", 1, b"x").expect("seal");
        assert!(open(&other_key, "org_a", "token", &sealed).is_err());
    }

    #[test]
    fn the_key_file_is_made_0600_and_refused_when_exposed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secret-key");
        let made = load_or_make(&path).expect("made");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = load_or_make(&path).expect("read");
        assert_eq!(made.0, again.0);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(matches!(load_or_make(&path), Err(KeyError::Exposed { .. })));
        assert!(format!("{:?}", SecretKeySource::Hex("ab".repeat(32))).contains("redacted"));
        assert!(!format!("{made:?}").contains(&hex_encode(&made.0)));
    }

    /// An empty key file (a server of an older version killed between
    /// making it and writing it) is refused naming what to do, never
    /// replaced behind another server's back.
    #[test]
    fn an_empty_key_file_is_refused_naming_it() {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secret-key");
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .expect("an empty key file");
        let err = load_or_make(&path).expect_err("refused").to_string();
        assert!(
            err.contains("is empty") && err.contains("remove it"),
            "{err}"
        );
    }

    /// Servers starting at once on one data dir all end with the one key
    /// one of them made, none ever reading it empty or half written; the
    /// directory holds the key and nothing else.
    #[test]
    fn servers_making_the_key_at_once_share_one_and_never_read_it_half_made() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("secret-key");
            let keys: Vec<[u8; KEY_BYTES]> = std::thread::scope(|scope| {
                let makers: Vec<_> = (0..8)
                    .map(|_| scope.spawn(|| load_or_make(&path).expect("a key, never malformed").0))
                    .collect();
                makers
                    .into_iter()
                    .map(|maker| maker.join().expect("no panic"))
                    .collect()
            });
            assert!(keys.iter().all(|key| *key == keys[0]), "one key");
            let names: Vec<_> = std::fs::read_dir(dir.path())
                .expect("list")
                .map(|entry| entry.expect("entry").file_name())
                .collect();
            assert_eq!(names, vec![std::ffi::OsString::from("secret-key")]);
        }
    }
}
