//! Shared filesystems bound to orgs (`/v1/admin/filesystems`): which org
//! may mount which filesystem that runners declare.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `PUT /v1/admin/filesystems/{id}/orgs/{org}`: binds (or rebinds) the
/// filesystem to the org.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BindFilesystemRequest {
    /// The org's sandboxes mount it read-only, whatever they ask.
    #[serde(default)]
    pub read_only: bool,
}

/// One filesystem bound to one org.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FilesystemBinding {
    pub filesystem: String,
    pub org_id: String,
    pub org_name: String,
    pub read_only: bool,
    /// RFC 3339.
    pub bound_at: String,
}

/// `GET /v1/admin/filesystems`: every binding, by filesystem then org.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FilesystemBindingList {
    pub bindings: Vec<FilesystemBinding>,
}
