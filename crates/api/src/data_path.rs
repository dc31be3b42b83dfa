//! The data path's credentials (DESIGN.md §1, §3): how a server proves to
//! a runner that a stream (a command's stdin, a file) is for a sandbox
//! that runner holds, without the runner accepting anything
//! unauthenticated and without servers talking to each other.
//!
//! Each runner makes a random key when it starts and gives it, with the
//! URL of its data listener, to the server at registration (the runner's
//! row keeps both). A server that serves a client's stream checks the
//! client's org may reach the sandbox, then mints a token for exactly
//! that request: the sandbox, the placement's epoch, the operation, the
//! command, and an expiry [`TOKEN_LIFETIME_MS`] away, authenticated with
//! the runner's key (BLAKE3 in keyed mode). Any server of a deployment
//! can mint one (the key is in the shared records); only the runner
//! holding the key can check it, and it serves a token only for a sandbox
//! it holds at that epoch.
//!
//! The token: `roost-data-v1.` + base64url(claims JSON) + `.` + hex MAC of
//! everything before the last dot.

use base64::Engine;
use serde::{Deserialize, Serialize};

/// The token's scheme and version.
pub const TOKEN_PREFIX: &str = "roost-data-v1";
/// How long a token is good for (it is minted for one request).
pub const TOKEN_LIFETIME_MS: u64 = 60_000;
/// A runner's data key, in bytes (hex on the wire: twice as many digits).
pub const KEY_BYTES: usize = 32;
/// The longest token a runner reads.
pub const TOKEN_BYTES_MAX: usize = 2048;

/// What a token allows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataClaims {
    pub sandbox_id: String,
    /// The placement's epoch: a runner serves only the placement it holds.
    pub epoch: u64,
    /// The operation, e.g. `stdin`.
    pub op: String,
    /// The command it is for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    /// What else it is for, if anything: for `filesystem.check`, the
    /// filesystem and directory as `ID/SUBPATH`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// The org whose sandbox it is for: a runner serves only so many of
    /// one org's requests at once, so one org cannot hold every place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub org_id: Option<String>,
    pub expires_unix_ms: u64,
}

/// Why a token was refused (each a 401 at the runner).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("not a data token")]
    Malformed,
    #[error("the data token's signature does not match this runner's key")]
    BadSignature,
    #[error("the data token expired")]
    Expired,
}

/// A fresh random key.
pub fn new_key() -> std::io::Result<[u8; KEY_BYTES]> {
    let mut key = [0u8; KEY_BYTES];
    getrandom::fill(&mut key).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(key)
}

pub fn key_hex(key: &[u8; KEY_BYTES]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// A key from its hex form (exactly [`KEY_BYTES`] bytes).
pub fn parse_key(hex: &str) -> Option<[u8; KEY_BYTES]> {
    if hex.len() != KEY_BYTES * 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut key = [0u8; KEY_BYTES];
    for (i, byte) in key.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).ok()?;
    }
    Some(key)
}

/// A token for `claims` under `key`.
pub fn mint(key: &[u8; KEY_BYTES], claims: &DataClaims) -> String {
    let json = serde_json::to_vec(claims).unwrap_or_default();
    let body = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json);
    let signed = format!("{TOKEN_PREFIX}.{body}");
    let mac = blake3::keyed_hash(key, signed.as_bytes());
    format!("{signed}.{}", mac.to_hex())
}

/// The claims of `token` if `key` signed it and it has not expired at
/// `now_unix_ms` (nor claims to last longer than a token can).
pub fn verify(
    key: &[u8; KEY_BYTES],
    token: &str,
    now_unix_ms: u64,
) -> Result<DataClaims, TokenError> {
    if token.len() > TOKEN_BYTES_MAX {
        return Err(TokenError::Malformed);
    }
    let (signed, mac) = token.rsplit_once('.').ok_or(TokenError::Malformed)?;
    let (prefix, body) = signed.split_once('.').ok_or(TokenError::Malformed)?;
    if prefix != TOKEN_PREFIX {
        return Err(TokenError::Malformed);
    }
    let given = blake3::Hash::from_hex(mac).map_err(|_| TokenError::Malformed)?;
    // `Hash` compares in constant time.
    if given != blake3::keyed_hash(key, signed.as_bytes()) {
        return Err(TokenError::BadSignature);
    }
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(body)
        .map_err(|_| TokenError::Malformed)?;
    let claims: DataClaims = serde_json::from_slice(&json).map_err(|_| TokenError::Malformed)?;
    if claims.expires_unix_ms < now_unix_ms
        || claims.expires_unix_ms > now_unix_ms + 2 * TOKEN_LIFETIME_MS
    {
        return Err(TokenError::Expired);
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(expires_unix_ms: u64) -> DataClaims {
        DataClaims {
            org_id: None,
            sandbox_id: "sbx_1".to_owned(),
            epoch: 3,
            op: "stdin".to_owned(),
            command_id: Some("cmd_1".to_owned()),
            subject: None,
            expires_unix_ms,
        }
    }

    #[test]
    fn a_token_holds_only_under_its_key_until_it_expires() {
        let key = new_key().expect("key");
        let other = new_key().expect("key");
        let token = mint(&key, &claims(10_000));
        assert_eq!(verify(&key, &token, 9_000), Ok(claims(10_000)));
        assert_eq!(verify(&other, &token, 9_000), Err(TokenError::BadSignature));
        assert_eq!(verify(&key, &token, 10_001), Err(TokenError::Expired));
        let far = mint(&key, &claims(9_000 + 3 * TOKEN_LIFETIME_MS));
        assert_eq!(verify(&key, &far, 9_000), Err(TokenError::Expired));
        // Claims changed under the signature: refused.
        let (_, mac) = token.rsplit_once('.').expect("mac");
        let forged_body = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(
            serde_json::to_vec(&claims(10_000))
                .expect("json")
                .as_slice(),
        );
        let forged = format!("{TOKEN_PREFIX}.{}x.{mac}", forged_body);
        assert_eq!(verify(&key, &forged, 9_000), Err(TokenError::BadSignature));
        for junk in ["", "x", "roost-data-v1", "a.b.c", &"y".repeat(5000)] {
            assert!(verify(&key, junk, 9_000).is_err(), "{junk}");
        }
        assert_eq!(parse_key(&key_hex(&key)), Some(key));
        assert_eq!(parse_key("zz"), None);
    }
}
