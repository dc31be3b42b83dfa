//! Organisations and tokens (admin endpoints).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /v1/admin/orgs`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateOrgRequest {
    /// 1-64 of a-z 0-9 - _, starting with a letter or digit, not with
    /// `org_` (how org ids start).
    #[schema(pattern = "^[a-z0-9][a-z0-9_-]{0,63}$")]
    pub name: String,
    #[serde(default)]
    pub max_running: Option<u32>,
    #[serde(default)]
    pub max_total: Option<u32>,
    /// The most its objects may take in the content store, in MiB (its
    /// homes' saves and snapshots, images, pushes, as stored: compressed,
    /// each object once). An upload that finds the org at or past it is
    /// refused 429 `quota_exceeded` (metric `store_bytes`): a durable
    /// sandbox's saves wait until deletes and a `store gc` free room.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1_073_741_824)]
    pub max_store_mib: Option<u64>,
}

/// The largest `max_store_mib` (1 PiB).
pub const STORE_MIB_MAX: u64 = 1 << 30;

/// The org and its token; the token is shown once and stored only hashed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CreateOrgResponse {
    pub org_id: String,
    pub name: String,
    pub token: String,
}

/// `POST /v1/admin/runner-tokens` (the body may be left out): what the
/// runners enrolled with the token may declare when they register, then
/// and every time after (a restart registers again). A registration that
/// declares another placement class or more capacity is refused (400
/// `invalid_request` naming the field); a capability the profile does not
/// list is not recorded (the runner is not offered for it). Each field
/// left out allows anything. It bounds what a runner host an attacker
/// controls can claim: a placement class or a capability (a shared
/// filesystem's, `home:bounded`…) it lacks, or the capacity to attract
/// every org's new sandboxes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunnerProfile {
    /// The placement classes they may declare (`spot`, `on_demand`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement_classes: Option<Vec<String>>,
    /// The capabilities they may be offered for: others they declare are
    /// not recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = crate::schema::capabilities)]
    pub capabilities: Option<Vec<String>>,
    /// The most capacity they may declare, figure by figure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<crate::runners::Capacity>,
}

impl RunnerProfile {
    /// Whether it allows anything (a token made without a body).
    pub fn allows_anything(&self) -> bool {
        *self == RunnerProfile::default()
    }
}

/// `POST /v1/admin/runner-tokens`: a token runners register with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunnerTokenResponse {
    pub token: String,
    /// What runners enrolled with it may declare (left out: anything).
    #[serde(default, skip_serializing_if = "RunnerProfile::allows_anything")]
    pub profile: RunnerProfile,
}

/// `POST /v1/admin/orgs/{org}/tokens`: another token for an org (to rotate
/// one: make a new token, move clients to it, revoke the old one).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OrgTokenResponse {
    pub org_id: String,
    /// Shown once; only its hash is kept.
    pub token: String,
}

/// `POST /v1/admin/tokens/revoke`: the token itself (only hashes are kept,
/// so it is named by its value).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RevokeTokenRequest {
    pub token: String,
}

/// A revoked token. Revoking again answers the same (the first revocation's
/// time): a retried revoke is safe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RevokedToken {
    /// `org` or `runner` (an enrolment token; runners it registered keep
    /// their own credentials).
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub org_id: Option<String>,
    pub revoked_at: String,
    /// Every server refuses the token at most this long after
    /// `revoked_at` (each trusts a token it verified for this long); the
    /// server that revoked it refuses it at once.
    pub refused_everywhere_within_ms: u64,
}

/// `GET /v1/whoami`: who a token belongs to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Whoami {
    /// `admin`, `org`, `runner` (a runner token: it enrols runners) or
    /// `runner_credential` (one runner's own credential).
    pub kind: String,
    /// The org of an org token.
    pub org_id: Option<String>,
    /// The runner of a runner's credential.
    #[serde(default)]
    pub runner_id: Option<String>,
}

/// `GET /v1/admin/orgs`: every org, oldest first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OrgList {
    pub orgs: Vec<OrgUsage>,
}

/// An org's quotas and what it uses of them, counted as admission counts
/// them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OrgUsage {
    pub org_id: String,
    pub name: String,
    /// RFC 3339.
    pub created_at: String,
    /// The limit on sandboxes wanted running (absent: none).
    pub max_running: Option<u64>,
    /// The limit on sandboxes held in any state but ended (absent: none).
    pub max_total: Option<u64>,
    /// The limit on what its objects take in the content store, in MiB
    /// (absent: none).
    #[serde(default)]
    pub max_store_mib: Option<u64>,
    /// Sandboxes counted against `max_running`.
    pub running: u64,
    /// Sandboxes counted against `max_total`.
    pub total: u64,
    /// Bytes of command output its records keep, counted against the
    /// deployment's bound on an org's stored output (`roost server
    /// --org-output-max`); a purged sandbox's commands give theirs back.
    #[serde(default)]
    pub output_bytes: u64,
}

/// `GET /v1/admin/counts`: the kept counts (each org's and the fleet's
/// quota counts, each runner's usage) recomputed from the sandboxes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CountsCheck {
    /// How many scopes (`fleet`, `org:ID`, `runner:ID`) were compared.
    pub scopes: u64,
    /// Every count whose kept value differs from the records' (empty:
    /// exact).
    pub drift: Vec<CountDrift>,
}

/// One kept count that differs from the records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CountDrift {
    /// `fleet`, `org:ID` or `runner:ID`.
    pub scope: String,
    /// `running`, `held` (quota scopes); `sandboxes`, `memory_mib`,
    /// `millicpus`, `pids` (runners).
    pub count: String,
    pub kept: i64,
    pub recomputed: i64,
}
