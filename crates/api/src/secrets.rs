//! An org's secrets (`/v1/secrets`): values the server holds encrypted at
//! rest and delivers only into sandboxes that ask for them by name
//! (`CreateSandboxRequest::secrets`). No answer of this API ever carries a
//! value: only the runner a sandbox is placed on receives them
//! (`runners::SecretValues`).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Longest secret value, in bytes.
pub const SECRET_VALUE_BYTES_MAX: usize = 64 * 1024;
/// Most secrets an org holds.
pub const SECRETS_PER_ORG_MAX: usize = 1024;
/// Most secrets one sandbox asks for.
pub const SECRETS_PER_SANDBOX_MAX: usize = 64;

/// `PUT /v1/secrets/{name}`: sets the secret (made, or rotated: a new
/// version that sandboxes launched from then on receive).
#[derive(Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetSecretRequest {
    /// The value, at most 64 KiB, no NUL byte.
    #[schema(max_length = 65536, pattern = r"^[^\x00]*$")]
    pub value: String,
}

/// Never prints the value.
impl std::fmt::Debug for SetSecretRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SetSecretRequest")
            .field("value", &"<redacted>")
            .finish()
    }
}

/// A secret as the API shows it: never its value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SecretRecord {
    pub name: String,
    /// 1 when made, one more at every set.
    pub version: u64,
    /// RFC 3339 times: made, and last set.
    pub created_at: String,
    pub updated_at: String,
}

/// `GET /v1/secrets`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SecretList {
    pub secrets: Vec<SecretRecord>,
}
