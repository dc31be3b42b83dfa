//! Images: root filesystems imported into an org's content store
//! (`roost image import`), run by naming them in a sandbox's `image`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `PUT /v1/images/{name}`: points the image at a tree whose objects the
/// caller has uploaded through the block service. The server checks that
/// every object the tree reaches is in the store before it commits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommitImageRequest {
    /// The root tree digest (64 hex digits).
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub root: String,
    /// How many files the uploader counted (shown on the image).
    #[serde(default)]
    pub files: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Image {
    pub name: String,
    /// The root tree: sandboxes created from the image pin it.
    pub root: String,
    pub files: u64,
    pub logical_bytes: u64,
    /// RFC 3339 times.
    pub created_at: String,
    pub updated_at: String,
}

/// `GET /v1/images`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ImageList {
    pub images: Vec<Image>,
}
