//! Sandboxes (`/v1/sandboxes`) and their event history.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::lifecycle::{DesiredState, Network, Placement, SandboxState, StorageClass};

/// `POST /v1/sandboxes`. Unknown fields are refused (400), so a typo never
/// turns into a silently ignored setting.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Image name; `default` is the runner host's own system.
    #[serde(default = "default_image")]
    #[schema(schema_with = crate::schema::name, default = "default")]
    pub image: String,
    /// `standard` (node-bound, the default) or `durable` (saved to the store).
    #[serde(default = "default_storage_class")]
    #[schema(value_type = StorageClass, default = "standard")]
    pub storage_class: String,
    #[serde(default)]
    pub resources: Resources,
    /// `none` (loopback only, the default) or `bridge`.
    #[serde(default = "default_network")]
    #[schema(value_type = Network, default = "none")]
    pub network: String,
    /// Seconds the sandbox may live; on expiry it is `terminated`
    /// (`ttl_expired`), its storage kept until delete.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 31_536_000)]
    pub ttl: Option<u64>,
    /// `spot_first` (default: spot runners, on-demand as fallback) or
    /// `non_preemptible` (on-demand runners only).
    #[serde(default = "default_placement")]
    #[schema(value_type = Placement, default = "spot_first")]
    pub placement: String,
    /// At most 128 variables and 64 KiB in all.
    #[serde(default)]
    #[schema(schema_with = crate::schema::env)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    #[schema(schema_with = crate::schema::labels)]
    pub labels: BTreeMap<String, String>,
    /// Shared filesystems to mount (at most 16): each an existing
    /// subdirectory of a filesystem an operator bound to the org, on
    /// runners that offer it (`filesystem:ID`). One at `/workspace` moves
    /// the sandbox's own home to `/private`.
    #[serde(default)]
    #[schema(max_items = 16)]
    pub mounts: Vec<Mount>,
    /// Org secrets delivered as env or files (at most 64); refused with
    /// `unsupported_capability` (`secrets`) where the deployment has no
    /// secret key.
    #[serde(default)]
    #[schema(max_items = 64)]
    pub secrets: Vec<Secret>,
    /// Seconds between saves of a durable home while it runs (within the
    /// deployment's bounds; default: the deployment's interval).
    #[serde(default)]
    pub save_interval_s: Option<u64>,
    /// A snapshot (`snp_…`, replicated) whose files the new home starts with.
    #[serde(default)]
    pub from_snapshot: Option<String>,
    /// Seconds without activity (README "Idle sandboxes") after which the
    /// running sandbox goes to sleep: an ordinary stop, `state_reason:
    /// idle` (a durable home is secured first). `0`: never. Within the
    /// deployment's bounds; default: the deployment's
    /// (`GET /v1/deployment`, `idle`).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// A command sent while the sandbox is stopped (asleep or stopped by
    /// hand) starts it under the same id and runs once it is running
    /// (default `true`); `false`: refused with 409 `invalid_state`.
    #[serde(default)]
    pub auto_wake: Option<bool>,
}

/// `PATCH /v1/sandboxes/{id}`: changes the idle policy (idempotent: the
/// same body twice leaves the same record). Absent fields stay as they
/// are; unknown fields are refused.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateSandboxRequest {
    /// As at create; the deadline moves to the last activity plus this.
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    #[serde(default)]
    pub auto_wake: Option<bool>,
}

pub fn default_image() -> String {
    "default".to_owned()
}
pub fn default_storage_class() -> String {
    "standard".to_owned()
}
pub fn default_network() -> String {
    "none".to_owned()
}
pub fn default_placement() -> String {
    "spot_first".to_owned()
}

/// The smallest limits a sandbox may ask for: below them the runtime
/// cannot start it, so admission refuses them (400) rather than admit a
/// sandbox bound to fail `runtime_error`. They are `oci::config`'s
/// `MEMORY_BYTES_MIN`, `PIDS_MIN` and `CPU_QUOTA_US_MIN` over
/// `CPU_PERIOD_US`; `oci` depends on no `api`, so the pairing is a test
/// (the server's `resource_minimums_are_the_runtimes`). The `#[schema]`
/// minimums below repeat them (checked by the same test file).
pub const MEMORY_MIB_MIN: u64 = 8;
pub const CPUS_MIN: f64 = 0.01;
pub const PIDS_MIN: u64 = 8;
/// The smallest and largest bound on a home, in MiB (16 MiB to 16 TiB).
pub const HOME_MIB_MIN: u64 = 16;
pub const HOME_MIB_MAX: u64 = 1 << 24;
/// What a runner offers when it can bound a home (`resources.home_mib`).
pub const HOME_BOUND_CAPABILITY: &str = "home:bounded";

/// Limits the runtime enforces; unset means the runner's default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 8, maximum = 1_073_741_824)]
    pub memory_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.01, maximum = 4096)]
    pub cpus: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 8, maximum = 4_194_304)]
    pub pids: Option<u64>,
    /// The most the home (`/workspace`) may hold on its runner, in MiB: a
    /// write past it fails inside the sandbox with `EDQUOT` ("Disk quota
    /// exceeded"), and deleting files frees room. Unset: the home is
    /// bounded only by its runner's volume. Enforced by runners offering
    /// `home:bounded` (homes on btrfs with quota groups on); where none
    /// does, the create is refused `unsupported_capability`. It bounds the
    /// home, not the root file system's writable layer, and not saves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 16, maximum = 16_777_216)]
    pub home_mib: Option<u64>,
}

/// A shared filesystem mounted into a sandbox. Its files are the
/// filesystem's, never part of a save or snapshot; two sandboxes writing
/// the same file see the filesystem's own semantics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    /// The filesystem's id, as runners declare it (`--filesystem ID=…`)
    /// and an operator binds it to the org.
    #[schema(pattern = "^[a-z0-9][a-z0-9_-]{0,63}$")]
    pub filesystem: String,
    /// A directory of the filesystem, relative to its root (empty: the
    /// root). It must exist: a missing one is refused at create (`422
    /// unsupported_capability` naming it, nothing created) when a runner
    /// offering the filesystem can be asked; should it go missing later,
    /// the sandbox fails at launch (`mount_source_missing`). No `..`.
    #[serde(default)]
    #[schema(max_length = 4096)]
    pub subpath: String,
    /// Where it appears: `/workspace`, or a path below `/mnt`.
    #[schema(max_length = 4096)]
    pub path: String,
    /// Mounted read-only (always so where the binding is read-only).
    #[serde(default)]
    pub read_only: bool,
}

/// An org secret delivered into the sandbox: as the environment variable
/// `env` of every command, or as the file `/run/secrets/{file}` (a tmpfs,
/// mode 0400, owned by the sandbox user); exactly one of the two. Each
/// launch (create, start, wake, recovery) receives the secret's current
/// version. Never saved: `/run` and `/tmp` are not part of the home.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Secret {
    /// The org secret's name (`roost secret set NAME`).
    #[schema(schema_with = crate::schema::secret_name)]
    pub name: String,
    /// Environment variable to expose it as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
    pub env: Option<String>,
    /// File name under `/run/secrets`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = crate::schema::secret_name)]
    pub file: Option<String>,
}

/// A sandbox record. `state` is what the runtime was observed doing;
/// `desired` is what was asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Sandbox {
    pub id: String,
    pub org_id: String,
    pub state: SandboxState,
    /// Why the record is in its state: a stable snake_case code.
    pub state_reason: Option<String>,
    /// One line for a person about the state and its reason: what the
    /// report or verdict that set them said (a failure's cause and what
    /// can be done, what a waiting sandbox waits for and when it tries
    /// again); `null` when nothing was said.
    #[serde(default)]
    pub state_message: Option<String>,
    pub desired: DesiredState,
    pub runner_id: Option<String>,
    /// Placement epoch, bumped on every placement; fences stale runners.
    pub epoch: u64,
    pub image: String,
    pub storage_class: StorageClass,
    pub resources: Resources,
    pub network: Network,
    pub placement: Placement,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub quarantined: bool,
    /// RFC 3339 times.
    pub created_at: String,
    pub updated_at: String,
    pub expires_at: Option<String>,
    pub ended_at: Option<String>,
    /// How saving the home goes (durable sandboxes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save: Option<SaveStatus>,
    /// The snapshot this sandbox's home started as (lineage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// Shared filesystems mounted in it (`read_only` as enforced).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// While `recovering`: what the home will be restored from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<Recovery>,
    /// Copies of the home that runners keep aside (not mounted, read-only)
    /// because they may hold work no completed save has: a runner that was
    /// fenced or lost came back with them. Discard one with
    /// `POST /v1/sandboxes/{id}/kept/{copy}/discard`; they expire after
    /// the retention window.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_copies: Vec<KeptCopy>,
    /// Seconds without activity before it sleeps; `0`: never.
    #[serde(default)]
    pub idle_timeout_s: u64,
    /// A command sent while it is stopped starts it.
    #[serde(default = "yes")]
    pub auto_wake: bool,
    /// RFC 3339: its last activity (README "Idle sandboxes").
    #[serde(default)]
    pub last_activity_at: Option<String>,
    /// What that activity was, one of exactly these (nothing else keeps a
    /// sandbox awake): `created`; `started` (it began running: idleness
    /// counts from there); `command` (a command created); `command_running`
    /// (a command still queued or running at the deadline: a command keeps
    /// its sandbox awake while it runs); `command_ended`; `stdin` (a
    /// command's stdin written or closed); `attach` (a command attached or
    /// its terminal resized); `files` (a file API call); `keepalive`. Not
    /// activity: processes the sandbox runs by itself after their command
    /// ended, network traffic, reads of records, events or output.
    #[serde(default)]
    #[schema(value_type = Option<crate::lifecycle::Activity>)]
    pub last_activity: Option<String>,
    /// RFC 3339: when it goes to sleep unless something happens first; set
    /// only while `running` with a timeout (a running command moves it on
    /// when it comes).
    #[serde(default)]
    pub idle_deadline: Option<String>,
}

fn yes() -> bool {
    true
}

/// What a `recovering` sandbox's home will be restored from: its last
/// completed save, the snapshot it was created from, or (no save ever
/// completed) an empty home. Writes after that point are not in it; a
/// runner that comes back with them keeps them aside (`kept_copies`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Recovery {
    /// `last_save`, `snapshot` or `empty`.
    pub restores: String,
    /// The tree restored (`None`: an empty home).
    pub root: Option<String>,
    /// When that save captured the home (RFC 3339; `last_save` only).
    pub saved_at: Option<String>,
    /// One line for a person.
    pub message: String,
}

/// A copy of a sandbox's home kept aside on a runner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct KeptCopy {
    /// `kpt_…`, for `…/kept/{copy}/discard`.
    pub id: String,
    pub runner_id: String,
    /// RFC 3339: when the runner set it aside.
    pub kept_at: String,
    /// Bytes the copy occupies on the runner (file contents).
    pub bytes: u64,
    /// Why it is kept: `unsaved_writes` (a durable home that may hold
    /// writes after the last completed save), `awaiting_new_placement` (a
    /// durable home equal to the last completed save, kept until the
    /// sandbox runs again from the store) or `node_lost` (a standard home
    /// whose runner was lost).
    pub reason: String,
}

/// A durable sandbox's saves. A save counts once it is complete in the
/// store and committed; `last_completed_at` is when it captured the home.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SaveStatus {
    /// Seconds between saves while the sandbox runs.
    pub interval_s: u64,
    /// `ok`, `delayed` (no save completed within twice the interval) or
    /// `failing` (the last attempt failed: `last_error`).
    pub state: String,
    pub last_completed_at: Option<String>,
    pub last_attempt_at: Option<String>,
    pub last_error: Option<String>,
    /// Bytes the save under way (or securing) still has to upload.
    pub bytes_pending: Option<u64>,
    /// The root tree of the last completed save.
    pub root: Option<String>,
    /// RFC 3339: when a scheduled save last found the home exactly as the
    /// last completed save left it, and so uploaded and committed nothing
    /// (a parked sandbox). `last_completed_at` does not move for it;
    /// `safe_until` does.
    #[serde(default)]
    pub last_unchanged_at: Option<String>,
    /// RFC 3339: everything written to the home before this instant is in
    /// a completed save (the last one's capture time, or a later
    /// `last_unchanged_at`); null until a save completes. It only moves
    /// forward.
    #[serde(default)]
    pub safe_until: Option<String>,
    /// Seconds of work a host failure would cost at this moment: since
    /// `safe_until` (since creation before the first save) while the home
    /// is live on a runner (`starting`, `running`, `stopping`,
    /// `securing`); 0 otherwise (no workload writes to it).
    #[serde(default)]
    pub at_risk_s: f64,
}

/// `GET /v1/sandboxes`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    /// Pass as `cursor` to get the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

/// One state change of a sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Event {
    pub seq: u64,
    pub at: String,
    pub state: SandboxState,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub epoch: u64,
    pub runner_id: Option<String>,
}

/// `GET /v1/sandboxes/{id}/events`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EventList {
    /// At most [`EVENTS_PAGE_MAX`], oldest first.
    pub events: Vec<Event>,
    /// Set when there are later events: the next page is `?after=` (or
    /// `?cursor=`) this.
    #[serde(default)]
    pub next_cursor: Option<String>,
}

/// The most events one answer of `GET /v1/sandboxes/{id}/events` holds.
pub const EVENTS_PAGE_MAX: usize = 1000;

/// `POST /v1/admin/sandboxes/{id}/quarantine`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QuarantineRequest {
    /// 1 to 1024 bytes (256 characters are at most 1024 bytes).
    #[schema(min_length = 1, max_length = 256)]
    pub reason: String,
}
