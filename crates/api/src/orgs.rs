//! Organisations and tokens (admin endpoints).

use serde::{Deserialize, Serialize};

/// `POST /v1/admin/orgs`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateOrgRequest {
    pub name: String,
    #[serde(default)]
    pub max_running: Option<u32>,
    #[serde(default)]
    pub max_total: Option<u32>,
}

/// The org and its token; the token is shown once and stored only hashed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CreateOrgResponse {
    pub org_id: String,
    pub name: String,
    pub token: String,
}

/// `POST /v1/admin/runner-tokens`: a token runners register with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunnerTokenResponse {
    pub token: String,
}
