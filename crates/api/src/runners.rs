//! The runner protocol (`/v1/runner/…`): runners dial out, hold a lease,
//! long-poll their assignments and report what they observe. A runner
//! token only registers a new runner; the answer carries that runner's
//! own credential, the bearer of every other call, which speaks for that
//! runner alone (another runner's id is 404). Every report carries the
//! placement epoch; a stale one is 409 `fenced`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::lifecycle::{CommandState, DesiredState, Network, SandboxState, StorageClass};
use crate::sandboxes::Resources;

/// `POST /v1/runner/register`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    /// Set by a runner registering again with its own credential (after a
    /// restart, or a lost lease): must be that credential's runner. With a
    /// runner token it is refused (404): no token takes over a runner.
    #[serde(default)]
    pub runner_id: Option<String>,
    #[schema(schema_with = crate::schema::name)]
    pub name: String,
    /// `spot` or `on_demand`.
    #[schema(schema_with = crate::schema::placement_class)]
    pub placement_class: String,
    #[serde(default)]
    #[schema(schema_with = crate::schema::labels)]
    pub labels: BTreeMap<String, String>,
    /// What this runner can do, e.g. `image:default`, `network:none`,
    /// `network:bridge`, `storage:standard`, `storage:durable`,
    /// `filesystem:ID` (a shared filesystem mounted on its host).
    #[schema(schema_with = crate::schema::capabilities)]
    pub capabilities: Vec<String>,
    pub capacity: Capacity,
    /// Where this runner's data listener is (`http://HOST:PORT`), reached
    /// by servers for streams (`api::data_path`); absent: no data path.
    #[serde(default)]
    #[schema(max_length = 512)]
    pub data_url: Option<String>,
    /// The key (64 hex digits) its data listener checks the servers'
    /// per-request tokens with.
    #[serde(default)]
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub data_key: Option<String>,
}

/// Total capacity of a runner; a sandbox's resources count against it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Capacity {
    pub sandboxes: u64,
    pub memory_mib: u64,
    #[schema(minimum = 0)]
    pub cpus: f64,
    pub pids: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RegisterResponse {
    pub runner_id: String,
    /// The runner's own credential, issued when a runner token registers
    /// a new runner (and shown only then): the bearer token of every
    /// later call of this runner, heartbeats, assignments, reports, the
    /// block service and its registrations again. The server keeps only
    /// its hash. Absent when a runner registers again by its credential.
    #[serde(default)]
    pub runner_token: Option<String>,
    /// The lease lasts this long after each heartbeat.
    pub lease_ttl_ms: u64,
    pub heartbeat_interval_ms: u64,
    /// Self-fencing: once this long has passed since the runner sent its
    /// last heartbeat that was answered, it freezes its sandboxes (they
    /// may be about to run elsewhere). Shorter than the lease by at least
    /// a heartbeat interval, so the freeze lands before the server could
    /// count the lease expired.
    pub freeze_after_ms: u64,
    /// Between a stop's SIGTERM and its SIGKILL of a workload, the
    /// deployment's `--stop-grace` (0: the runner's own default).
    #[serde(default)]
    pub stop_grace_ms: u64,
}

/// `POST /v1/runner/heartbeat`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    pub runner_id: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HeartbeatResponse {
    pub lease_expires_in_ms: u64,
}

/// `POST /v1/runner/preempt`: the runner passes on its host's preemption
/// notice (a cloud hook signalled it). Same effect as
/// `POST /v1/admin/runners/{id}/preempt`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PreemptRequest {
    pub runner_id: String,
}

/// A runner as the control plane sees it (`GET /v1/admin/runners`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunnerRecord {
    pub id: String,
    pub name: String,
    /// `spot` or `on_demand`.
    pub placement_class: String,
    /// `live` (holding a lease) or `lost` (its lease expired).
    pub state: String,
    /// RFC 3339.
    pub lease_expires_at: String,
    pub registered_at: String,
    /// Set while the runner is being emptied: `drain` (maintenance) or
    /// `preempt` (its host is going away). Nothing new is placed on it,
    /// and its durable sandboxes are secured and placed elsewhere.
    pub drain: Option<String>,
    /// Sandboxes placed on it (any state that holds it).
    pub sandboxes: u64,
    pub capabilities: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

/// `GET /v1/runner/assignments?runner_id=…&etag=…&timeout=…&unchanged=true`:
/// everything placed on the runner, level-triggered. Returns at once when
/// the set differs from `etag`, otherwise when it changes or the timeout
/// passes. With `unchanged=true` an answer at the timeout whose set is
/// still `etag` may be `unchanged: true` with empty lists (the server saw
/// no write since it last read the set): the previous answer stands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Assignments {
    pub etag: String,
    /// The set is still `etag`'s; the lists are empty, not read.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unchanged: bool,
    pub sandboxes: Vec<SandboxAssignment>,
    pub commands: Vec<CommandAssignment>,
    /// Kept copies of homes on this runner that are still to be kept. A
    /// copy the runner holds and finds missing here it reports again
    /// (`POST /v1/runner/kept`), and the answer says whether to keep it.
    #[serde(default)]
    pub kept: Vec<KeptAssignment>,
}

/// A kept copy the runner is to go on keeping.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct KeptAssignment {
    pub copy_id: String,
    pub sandbox_id: String,
    /// The runner's own name for the copy (from its report).
    pub name: String,
    /// The org of the copy's sandbox (whose store a salvage goes to).
    #[serde(default)]
    pub org_id: String,
    /// Salvage snapshots of this copy not yet replicated or failed: the
    /// runner uploads the copy through the block service and reports each
    /// (`POST /v1/runner/snapshots/{id}/report`, `epoch` ignored: only the
    /// runner holding the copy may report).
    #[serde(default)]
    pub salvage: Vec<String>,
}

/// `POST /v1/runner/kept`: a home this runner no longer has assigned was
/// set aside instead of deleted (it may be the newest copy of the work).
/// Reporting the same copy again is idempotent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KeptCopyReport {
    pub runner_id: String,
    pub sandbox_id: String,
    /// The runner's name for the copy: `[A-Za-z0-9_.-]`, unique per sandbox.
    pub name: String,
    pub bytes: u64,
    /// When it was set aside (ms since the epoch).
    pub kept_at_ms: i64,
    /// The root a stop secured, when the copy is known to be exactly that
    /// tree (nothing ran in it since). `None`: it may hold anything.
    #[serde(default)]
    pub secured_root: Option<String>,
}

/// Whether the runner keeps the copy it reported, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct KeptCopyAnswer {
    /// The copy's id on the record, when kept.
    pub copy_id: Option<String>,
    pub keep: bool,
    /// A stable code: why it is kept (see `KeptCopy::reason`) or why it
    /// may go (`sandbox_deleted`, `discarded`, `expired`, `restored`).
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxAssignment {
    pub sandbox_id: String,
    pub org_id: String,
    pub epoch: u64,
    pub desired: DesiredState,
    /// The last state this runner (or the control plane) recorded.
    pub state: SandboxState,
    pub image: String,
    /// For an imported image, the root tree to materialise from the
    /// org's store (pinned when the sandbox was created).
    #[serde(default)]
    pub image_root: Option<String>,
    pub storage_class: StorageClass,
    pub resources: Resources,
    pub network: Network,
    pub env: BTreeMap<String, String>,
    /// The tree the home starts as on a runner that has no copy of it: the
    /// last completed save of a durable home, or the snapshot a child was
    /// created from. `None`: an empty home.
    #[serde(default)]
    pub home_root: Option<String>,
    /// Durable sandboxes: seconds between saves while running.
    #[serde(default)]
    pub save_interval_s: Option<u64>,
    /// Snapshots asked for and not yet replicated or failed.
    #[serde(default)]
    pub snapshots: Vec<SnapshotAssignment>,
    /// Shared filesystems to mount, by the ids this runner declared
    /// (`filesystem:ID`); the runner alone knows where each is on its host.
    #[serde(default)]
    pub mounts: Vec<crate::sandboxes::Mount>,
    /// The org secrets the sandbox asked for (names and where they go,
    /// never values): a launch fetches the values
    /// (`POST /v1/runner/sandboxes/{id}/secrets`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<crate::sandboxes::Secret>,
}

/// `POST /v1/runner/sandboxes/{id}/secrets`: the values of the secrets a
/// sandbox asked for, answered only to the runner of its current placement
/// (another runner or epoch is `fenced`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretsRequest {
    pub runner_id: String,
    pub epoch: u64,
}

/// The answer: every secret the sandbox asked for, with its current value.
/// A secret deleted since the create is `404` naming it.
#[derive(Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SecretValues {
    pub secrets: Vec<SecretValue>,
}

#[derive(Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SecretValue {
    pub name: String,
    #[serde(default)]
    pub env: Option<String>,
    #[serde(default)]
    pub file: Option<String>,
    pub value: String,
}

/// Never prints a value.
impl std::fmt::Debug for SecretValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.secrets.iter().map(|s| s.name.as_str()).collect();
        f.debug_struct("SecretValues")
            .field("names", &names)
            .finish()
    }
}

/// Never prints the value.
impl std::fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretValue")
            .field("name", &self.name)
            .field("env", &self.env)
            .field("file", &self.file)
            .finish()
    }
}

/// A snapshot the runner is to capture and replicate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SnapshotAssignment {
    pub snapshot_id: String,
    /// `pending` or `local`.
    pub durability: String,
}

/// `POST /v1/runner/sandboxes/{id}/saves`: how a save of a durable home
/// went. `completed` carries the root the runner uploaded; the server
/// checks the tree is complete and commits it only at the current epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SaveReport {
    pub runner_id: String,
    pub epoch: u64,
    /// `progress`, `completed`, `failed`, or `unchanged` (a scheduled
    /// save found the home exactly as `root`, the last completed save:
    /// nothing was uploaded or is to be committed).
    pub outcome: String,
    #[serde(default)]
    pub root: Option<String>,
    /// When the saved state was captured (ms since the epoch).
    #[serde(default)]
    pub captured_at_ms: Option<i64>,
    #[serde(default)]
    pub bytes_pending: Option<u64>,
    #[serde(default)]
    pub error: Option<String>,
    /// A completed save of a running home: how long its snapshot took, ms
    /// (the most the workload could have been held up).
    #[serde(default)]
    pub snapshot_ms: Option<f64>,
    /// A completed save: the stored bytes it uploaded.
    #[serde(default)]
    pub uploaded_bytes: Option<u64>,
    /// A save of a stop's securing (the home itself, nothing running in
    /// it), not of a running home: once committed, the home is secured,
    /// whatever becomes of the runner before it reports `stopped`.
    #[serde(default)]
    pub securing: bool,
}

/// `POST /v1/runner/snapshots/{id}/report`: from the sandbox's current
/// placement, or, for a salvage of a kept copy, from the runner holding
/// the copy (any other runner's report is 404).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotReport {
    pub runner_id: String,
    /// The placement's epoch (ignored for a salvage: no placement).
    pub epoch: u64,
    /// `local`, `replicated` (with `root`) or `failed` (with `message`).
    pub durability: String,
    #[serde(default)]
    pub root: Option<String>,
    /// Files in the snapshot, as the runner counted them.
    #[serde(default)]
    pub files: Option<u64>,
    #[serde(default)]
    pub captured_at_ms: Option<i64>,
    #[serde(default)]
    pub message: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CommandAssignment {
    pub command_id: String,
    pub sandbox_id: String,
    pub epoch: u64,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub timeout: Option<u64>,
    /// A signal the caller asked to deliver, not yet reported delivered.
    pub signal: Option<String>,
    /// How many signals were asked of the command, this one included: a
    /// new request for the same signal has a new number (0 from a server
    /// that does not count them).
    #[serde(default)]
    pub signal_seq: u64,
    /// Every signal asked of the command that its record still keeps (the
    /// latest [`crate::commands::SIGNALS_KEPT`]), oldest first: the
    /// runner delivers each it has not delivered yet, in order. Empty
    /// from a server that keeps only the latest (`signal`).
    #[serde(default)]
    pub signals: Vec<RequestedSignal>,
    /// `starting` until the runner reports the command running.
    pub state: CommandState,
    /// Whether the command reads a stdin its client writes.
    #[serde(default)]
    pub stdin: bool,
    /// The command's terminal, if it asked for one.
    #[serde(default)]
    pub tty: Option<crate::commands::TtySize>,
}

/// A signal asked of a command: its name and its number among the
/// command's signal requests (a second request for the same signal has a
/// new number).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RequestedSignal {
    pub seq: u64,
    pub signal: String,
}

/// `POST /v1/runner/sandboxes/{id}/report`: an observed sandbox state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxReport {
    pub runner_id: String,
    pub epoch: u64,
    pub state: SandboxState,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
    /// With the first `running` after a durable home was materialised:
    /// what came down for it.
    #[serde(default)]
    pub wake: Option<WakeReport>,
}

/// What waking a durable home cost: the stored bytes downloaded, and
/// whether this runner woke it from its own earlier copy (only the
/// difference comes down) or from nothing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WakeReport {
    pub downloaded_bytes: u64,
    pub from_own_copy: bool,
}

/// `POST /v1/runner/commands/{id}/report`: an observed command state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommandReport {
    pub runner_id: String,
    pub epoch: u64,
    pub state: CommandState,
    #[serde(default)]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub signal: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
    /// The command's pid inside the sandbox (with `running`, when the
    /// sandbox's agent runs it; with an end reported straight from
    /// `starting`, a command that ended before its `running` report went
    /// out: it is recorded started and ended at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    /// The whole output of a command that ended before anything of it was
    /// uploaded (it ended within the runner's report window, or the
    /// runner restarted before reporting it), sent with its end so that
    /// one commit records its start, output and end. Each stream at most
    /// [`REPORTED_OUTPUT_BYTES_MAX`]; stored from offset 0, skipping what
    /// the record already holds (a retried report adds nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<ReportedOutput>,
}

/// The largest stream a command report may carry (larger output is
/// uploaded by offset while the command runs).
pub const REPORTED_OUTPUT_BYTES_MAX: usize = 64 * 1024;

/// A command's output carried by its end report, each stream base64
/// (standard alphabet, padded).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportedOutput {
    #[serde(with = "base64_bytes")]
    #[schema(value_type = String, format = Byte)]
    pub stdout: Vec<u8>,
    #[serde(with = "base64_bytes")]
    #[schema(value_type = String, format = Byte)]
    pub stderr: Vec<u8>,
}

/// Bytes as a base64 string in JSON.
mod base64_bytes {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        STANDARD
            .decode(text.as_bytes())
            .map_err(|err| serde::de::Error::custom(format!("not base64: {err}")))
    }
}
