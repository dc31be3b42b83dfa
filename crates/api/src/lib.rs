//! Wire types of the roost HTTP API (`/v1`) and the client the CLI uses.
//!
//! Everything here is a compatibility promise: a type is `Serialize` only
//! because it crosses the wire. Domain types live in their own crates.

pub mod blocks;
pub mod client;
pub mod commands;
pub mod data_path;
pub mod deployment;
pub mod e2b;
mod error;
pub mod failpoint;
pub mod files;
pub mod filesystems;
pub mod images;
pub mod lifecycle;
pub mod orgs;
pub mod runners;
pub mod sandboxes;
pub mod schema;
pub mod secrets;
pub mod snapshots;
pub mod write_stall;

pub use error::{ErrorBody, ErrorCode, ErrorDetail};
pub use lifecycle::{
    CommandState, DesiredState, Network, Placement, SandboxState, StorageClass, UnknownValue,
};
