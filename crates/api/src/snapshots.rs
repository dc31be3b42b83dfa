//! Snapshots: a sandbox's home captured at one instant and kept in the
//! store, whatever the sandbox's storage class.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /v1/sandboxes/{id}/snapshots` (`Idempotency-Key` accepted).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    /// `local` (captured on the host) or `replicated` (every object and the
    /// tree confirmed in the central store; the default).
    #[serde(default)]
    #[schema(schema_with = crate::schema::durability)]
    pub durability: Option<String>,
    /// Seconds from now by which the requested durability must be reached;
    /// past it the receipt fails with `durability_deadline_exceeded`.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 86_400)]
    pub deadline: Option<u64>,
}

/// Whether a snapshot at `durability` answers a wait for `target`: it has
/// that durability or a stronger one (`pending` < `local` <
/// `replicated`), or it has ended (`replicated` or `failed`) and can never
/// reach `target`. The server's long-poll and every client stop on it, so
/// a wait for `pending` on a replicated snapshot, or for `failed` on one
/// that replicated, answers at once rather than polling for ever.
pub fn wait_is_over(durability: &str, target: &str) -> bool {
    durability == target || has_ended(durability) || rank(durability) >= rank(target)
}

/// Whether a snapshot at `durability` reached `target` (the wait's success).
pub fn reached(durability: &str, target: &str) -> bool {
    durability == target || (durability != "failed" && rank(durability) >= rank(target))
}

/// `replicated` and `failed` never change.
pub fn has_ended(durability: &str) -> bool {
    matches!(durability, "replicated" | "failed")
}

/// The order durability moves in; `failed` is outside it.
fn rank(durability: &str) -> u8 {
    match durability {
        "pending" => 0,
        "local" => 1,
        "replicated" => 2,
        _ => u8::MAX,
    }
}

/// The receipt. `durability` moves `pending` → `local` → `replicated`, or
/// ends `failed` (`reason`); the snapshot always goes on to the store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Snapshot {
    pub id: String,
    pub sandbox_id: String,
    /// The durability asked for.
    pub requested: String,
    pub durability: String,
    pub reason: Option<String>,
    /// RFC 3339.
    pub deadline: Option<String>,
    pub root: Option<String>,
    pub files: Option<u64>,
    pub logical_bytes: Option<u64>,
    /// When the home was captured (for a salvage: when its runner set
    /// the copy aside, the copy's `kept_at`).
    pub captured_at: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    /// Set when the snapshot is a salvage of a kept copy of the sandbox's
    /// home (`POST /v1/sandboxes/{id}/kept/{copy}/salvage`): which copy,
    /// on which runner, set aside when.
    #[serde(default)]
    pub salvaged_from: Option<SalvagedFrom>,
}

/// The kept copy a salvage snapshot holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SalvagedFrom {
    /// `kpt_…`
    pub copy_id: String,
    pub runner_id: String,
    /// RFC 3339: when the runner set the copy aside.
    pub kept_at: String,
}

/// `POST /v1/sandboxes/{id}/kept/{copy}/salvage` (`Idempotency-Key`
/// accepted): a snapshot whose content is the kept copy, `pending` until
/// the runner holding it has uploaded it, then `replicated` (or `failed`
/// with a reason: the runner is gone, the upload failed, the copy was let
/// go first). The copy itself stays until discarded or expired.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SalvageRequest {
    /// Seconds from now by which the snapshot must be replicated; past it
    /// it fails with `durability_deadline_exceeded`.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 86_400)]
    pub deadline: Option<u64>,
}

/// `GET /v1/snapshots`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SnapshotList {
    pub snapshots: Vec<Snapshot>,
    pub next_cursor: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [&str; 4] = ["pending", "local", "replicated", "failed"];

    #[test]
    fn a_wait_is_over_once_reached_or_unreachable() {
        for durability in ALL {
            for target in ALL {
                let over = wait_is_over(durability, target);
                let ok = reached(durability, target);
                // Reaching it ends the wait; an ended snapshot ends it too.
                assert!(!ok || over, "{durability} reached {target} but waits");
                assert_eq!(over, ok || has_ended(durability), "{durability} / {target}");
            }
        }
        assert!(reached("replicated", "pending"));
        assert!(reached("replicated", "local"));
        assert!(!reached("local", "replicated"));
        assert!(!reached("failed", "replicated"));
        assert!(reached("failed", "failed"));
        assert!(!reached("replicated", "failed"));
        assert!(wait_is_over("replicated", "failed"));
        assert!(!wait_is_over("local", "failed"));
        assert!(!wait_is_over("pending", "local"));
    }
}
