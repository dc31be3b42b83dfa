//! The runner agent (`roost runner`): the one part of this crate that
//! speaks the control plane's runner protocol. It registers, keeps its
//! lease by heartbeat, long-polls its assignments and turns them into
//! containers through the OCI layer, reporting only what it observes.
//!
//! # Shape
//!
//! - [`run`]: registration, the heartbeat task and the assignments loop,
//!   which hands each sandbox's assignment (with its commands) to that
//!   sandbox's worker.
//! - `sandbox`: one worker task per sandbox, level-triggered: each pass
//!   compares the desired state with what the runtime is observed doing and
//!   acts (launch, stop keeping the home, start, terminate, delete), then
//!   reports the observed state with the placement's epoch. It also watches
//!   a running container for out-of-band death. `assignment` translates an
//!   assignment into the container's config (or why it cannot run here).
//! - `command`: one task per command: launched at most once (a marker is
//!   fsynced in the data dir first), output spooled and streamed to the
//!   server by offset, its end mapped to the server's command states.
//! - [`dirs`]: the data directory. [`host`]: default capacity.
//!
//! The agent holds its outside parties behind seams in `Shared`: the
//! runtime (`oci::ContainerRuntime`), the server (`control::ControlPlane`)
//! and time (`clock::Clock`). `run` puts the real ones there (runc or
//! crun, `api::client::Client`, tokio's time); the unit tests put the
//! fakes of `testing` (see `fake_tests`).
//!
//! # Restarts lose nothing reported
//!
//! Containers do not belong to the agent's process: they keep running when
//! it dies, and a restarted agent re-adopts them (by id, from the runtime's
//! state in the data dir) instead of launching them again. Its runner id
//! and its own credential (issued at its first registration; the runner
//! token only enrols) are kept in the data dir, so it registers as the
//! same runner and its placements stay valid. A command found launched but without a recorded
//! end is reported `unknown`, never launched again.
//!
//! # Fencing
//!
//! A report answered 409 `fenced` means the placement is no longer this
//! runner's (its lease expired and the sandbox was failed or moved, or a
//! newer placement exists): the agent kills the container, stops reporting
//! for that placement, and removes the sandbox's files once it is no longer
//! assigned. Nothing fenced is retried.
//!
//! A runner that cannot renew its lease fences itself (`fence`; DESIGN.md
//! §7, "never two writers"): once `freeze_after` (from registration: two
//! thirds of the lease) has passed since it sent the last heartbeat the
//! server answered, it pauses every running container (the cgroup freezer)
//! and its workers stop acting. The server's lease runs from when it got
//! that heartbeat, so the freeze lands at least a heartbeat interval (a
//! third of the lease) before the lease can expire, and the server places
//! nothing elsewhere before the lease and its fence margin have passed. A
//! heartbeat answered in time thaws exactly what was frozen. A heartbeat or
//! assignments answered `fenced` (the runner was declared lost: everything
//! it held was failed or moved) kills every container instead (resumed
//! after the SIGKILL so it lands), and the runner registers again; what is
//! no longer assigned is then removed as usual. Heartbeats time out after
//! an interval and the assignments long-poll after 30 s (it waits 25 s),
//! so a dead link holds neither up.
//!
//! None of that needs this process: every sandbox's init enforces the
//! lease too (`oci::lease`), stopping its processes once the deadline the
//! fence renews after each answered heartbeat passes. A runner whose
//! process dies leaves its sandboxes frozen; restarted, it renews (and so
//! thaws) what it is still assigned and kills the rest.
//!
//! # Preemption
//!
//! [`run_with_preemption`] passes each notice it is given (`roost runner`:
//! SIGUSR1, from a cloud's spot-interruption hook) on to the server, which
//! has the runner stop its durable sandboxes, through the usual
//! assignments, so that they can be placed elsewhere. The runner carries on.

pub mod dirs;
pub mod host;

mod assignment;
mod clock;
mod command;
mod control;
mod data;
mod data_files;
#[cfg(test)]
mod fake_tests;
mod fence;
mod homes;
mod images;
mod kept;
mod sandbox;
pub(crate) mod secrets;
#[cfg(test)]
mod testing;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::ErrorCode;
use api::client::ClientError;
use api::failpoint::Failpoints;
use api::runners::{Assignments, Capacity, CommandAssignment, PreemptRequest, RegisterRequest};
use tokio::sync::{mpsc, watch};

use clock::{Clock, TokioClock};
use control::ControlPlane;
use dirs::DataDir;
use oci::config::{InitProgram, SandboxId};
use oci::runtime::{Runtime, RuntimeChoice, RuntimeConfig};
use oci::seam::ContainerRuntime;
use sandbox::Assigned;

/// What this runner enforces, exactly; the server places only sandboxes
/// whose needs are all listed (fail closed: a network, image or storage
/// class missing here is refused at admission, never weakened).
pub const CAPABILITIES: &[&str] = &["image:default", "network:none", "storage:standard"];

/// Advertised on top of [`CAPABILITIES`] where the kernel has overlayfs:
/// the runner materialises imported images from the org's content store
/// and runs them as a read-only layer under the sandbox's own.
pub const STORE_IMAGE_CAPABILITY: &str = "image:store";

/// Advertised on top of [`CAPABILITIES`] when the runner's bridge (a
/// bridge, outbound NAT, isolation between sandboxes) was set up.
pub const BRIDGE_CAPABILITY: &str = "network:bridge";

/// Advertised, with the id, for each shared filesystem declared
/// (`--filesystem ID=PATH`).
pub const FILESYSTEM_CAPABILITY_PREFIX: &str = "filesystem:";

/// Advertised on top of [`CAPABILITIES`] where homes can be snapshotted
/// (btrfs): a durable home is saved while it runs only crash-consistently.
pub const DURABLE_CAPABILITY: &str = "storage:durable";

/// What this runner enforces, as it registers: the bridge only where its
/// setup succeeded on this host, durable storage only where running homes
/// can be snapshotted.
fn capabilities(
    runtime: &dyn ContainerRuntime,
    homes: &homes::Homes,
    filesystems: &BTreeMap<String, PathBuf>,
) -> Vec<String> {
    let mut capabilities: Vec<String> = CAPABILITIES.iter().map(|c| (*c).to_owned()).collect();
    // The shared filesystems the operator declared mounted on this host.
    for id in filesystems.keys() {
        capabilities.push(format!("{FILESYSTEM_CAPABILITY_PREFIX}{id}"));
    }
    if homes.can_snapshot() {
        capabilities.push(DURABLE_CAPABILITY.to_owned());
    }
    if homes.can_bound() {
        capabilities.push(api::sandboxes::HOME_BOUND_CAPABILITY.to_owned());
    }
    if runtime.bridge_available() {
        capabilities.push(BRIDGE_CAPABILITY.to_owned());
    }
    if overlayfs_available() {
        capabilities.push(STORE_IMAGE_CAPABILITY.to_owned());
    }
    capabilities
}

/// Whether the kernel offers overlayfs (listed in /proc/filesystems once
/// the module is loaded; `modprobe` is not ours to run).
fn overlayfs_available() -> bool {
    std::fs::read_to_string("/proc/filesystems").is_ok_and(|list| {
        list.lines()
            .any(|line| line.split_whitespace().last() == Some("overlay"))
    })
}

/// How soon a failed heartbeat is tried again.
/// `--sandbox-disk-max`'s default: 10 GiB of root layer per sandbox.
pub const SANDBOX_DISK_BYTES_DEFAULT: u64 = 10 << 30;

/// `--image-cache-max`'s default: 32 GiB of image trees and block cache.
pub const IMAGE_CACHE_BYTES_DEFAULT: u64 = 32 << 30;

/// How often the runner looks whether its image trees need collecting
/// (they do only after a new materialisation).
const IMAGE_COLLECTION_INTERVAL: Duration = Duration::from_secs(10);

const HEARTBEAT_RETRY_MS: u64 = 1_000;
/// Seconds one assignments long-poll may wait (the server's maximum).
const ASSIGNMENTS_WAIT_SECONDS: u64 = 25;
/// Past the long-poll's wait, how long before an unanswered assignments
/// request counts as lost (a dead link after a partition).
const ASSIGNMENTS_TIMEOUT_SECONDS: u64 = ASSIGNMENTS_WAIT_SECONDS + 5;
/// How long one registration attempt may take.
const REGISTER_TIMEOUT_SECONDS: u64 = 10;
/// Attempts at passing on a preemption notice, and how long each may take.
const PREEMPT_ATTEMPTS_MAX: u32 = 5;
const PREEMPT_TIMEOUT_SECONDS: u64 = 10;
/// First and longest pause between attempts at a call that failed
/// transiently (server restarting, connection dropped).
const RETRY_PAUSE_MIN_MS: u64 = 100;
const RETRY_PAUSE_MAX_MS: u64 = 5_000;

/// How to run the agent.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The control plane, e.g. `http://127.0.0.1:7070`.
    pub server_url: String,
    /// A runner token (`roost admin runner-token`): registers a new runner
    /// when the data dir holds no credential. Empty: none given (enough
    /// for a runner that has registered before).
    pub token: String,
    /// Where the runner keeps everything (see [`dirs`]).
    pub data_dir: PathBuf,
    pub runtime: RuntimeChoice,
    /// Shown in the server's records; defaults to the host name.
    pub name: String,
    /// `spot` or `on_demand`.
    pub placement_class: String,
    pub labels: BTreeMap<String, String>,
    pub capacity: Capacity,
    /// The program every sandbox runs as PID 1 (the `roost` binary with
    /// `init`), bind-mounted read-only into each sandbox.
    pub init: InitProgram,
    /// Parent of every sandbox's cgroup.
    pub cgroup_parent: String,
    /// Between a stop's SIGTERM and its SIGKILL.
    pub stop_grace: Duration,
    /// Between a command timeout's SIGTERM and its SIGKILL.
    pub command_kill_grace: Duration,
    /// Size of the btrfs image that holds homes when the data dir is not
    /// on btrfs (sparse: it costs what the homes use).
    pub homes_image_bytes: u64,
    /// The most a sandbox's root file system's writable layer (what it
    /// writes outside its home, `/tmp` and `/run`) may hold on this host,
    /// where the homes' volume is btrfs with quota groups on; `None`:
    /// unbounded (the volume's free space).
    pub sandbox_disk_bytes: Option<u64>,
    /// The most imported images' trees and the block cache may take on
    /// this host before trees no sandbox here uses go, least recently
    /// used first (`images`); `None`: no bound.
    pub image_cache_bytes: Option<u64>,
    /// Shared filesystems mounted on this host, by id (`--filesystem
    /// ID=PATH`): offered as `filesystem:ID`; a sandbox's mount names a
    /// directory beneath one. The path never leaves the runner.
    pub filesystems: BTreeMap<String, PathBuf>,
    /// Crash-safety tests only: the fault point at which the agent kills
    /// itself (`ROOST_FAILPOINT`), e.g. `runner:after_command_launch`.
    pub failpoint: Failpoints,
    /// Where delivered secrets are held: a tmpfs the runner mounts there
    /// (outside the data dir; see `secrets`). `None`: under
    /// `/run/roost/secrets`, named after the data dir.
    pub secrets_dir: Option<PathBuf>,
    /// Where the data listener listens (streams to sandboxes: stdin; see
    /// `data`). `None`: no data path (streams are refused for sandboxes
    /// here).
    pub data_listen: Option<std::net::SocketAddr>,
    /// The URL servers reach the data listener at, if not
    /// `http://` + the address it listens on (behind NAT, a name).
    pub data_url: Option<String>,
}

impl AgentConfig {
    /// A config with the host's defaults: its name, its whole capacity,
    /// `on_demand`, the runtime picked automatically.
    pub fn new(server_url: &str, token: &str, data_dir: PathBuf, init: InitProgram) -> Self {
        AgentConfig {
            server_url: server_url.to_owned(),
            token: token.to_owned(),
            data_dir,
            runtime: RuntimeChoice::Auto,
            name: host::hostname(),
            placement_class: "on_demand".to_owned(),
            labels: BTreeMap::new(),
            capacity: host::capacity(),
            init,
            cgroup_parent: "roost".to_owned(),
            stop_grace: Duration::from_secs(10),
            command_kill_grace: Duration::from_secs(10),
            homes_image_bytes: 256 << 30,
            sandbox_disk_bytes: Some(SANDBOX_DISK_BYTES_DEFAULT),
            image_cache_bytes: Some(IMAGE_CACHE_BYTES_DEFAULT),
            filesystems: BTreeMap::new(),
            failpoint: Failpoints::none(),
            secrets_dir: None,
            data_listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            data_url: None,
        }
    }

    /// Where this runner holds delivered secrets.
    pub(crate) fn secrets(&self) -> secrets::SecretsDir {
        secrets::SecretsDir::new(
            self.secrets_dir
                .clone()
                .unwrap_or_else(|| secrets::default_root(&self.data_dir)),
            self.capacity.sandboxes,
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Local(#[from] oci::Error),
    #[error("register with {url} failed: {source}")]
    Register { url: String, source: ClientError },
    #[error(
        "the server does not know runner {saved} by the credential in {path} (or it is missing), yet sandboxes of it are on disk: this data dir belongs to another control plane, or its credential was lost; use a fresh --data-dir"
    )]
    ForeignDataDir { saved: String, path: PathBuf },
    #[error(
        "no runner token: this data dir holds no runner credential ({path}), so the runner must register anew; give one with --token-file or ROOST_RUNNER_TOKEN (`roost admin runner-token`)"
    )]
    NoToken { path: PathBuf },
}

/// Why a report or upload stopped for good.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// 409 `fenced`: the placement is not this runner's any more.
    Fenced(String),
    /// Any other permanent answer (e.g. 409 `invalid_state`: the record
    /// has moved on, such as a command the server already ended).
    Refused(ClientError),
}

/// Sorts a client error into "try again" (`None`) and a refusal.
pub(crate) fn refusal(err: ClientError) -> Result<ClientError, Refusal> {
    match err.code() {
        Some(ErrorCode::Fenced) => Err(Refusal::Fenced(err.to_string())),
        _ if err.is_transient() => Ok(err),
        _ => Err(Refusal::Refused(err)),
    }
}

/// Pauses doubling from a first one to a longest one (by default
/// [`RETRY_PAUSE_MIN_MS`] to [`RETRY_PAUSE_MAX_MS`]).
#[derive(Debug)]
pub(crate) struct Backoff {
    next_ms: u64,
    max_ms: u64,
}

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff::between(RETRY_PAUSE_MIN_MS, RETRY_PAUSE_MAX_MS)
    }

    pub(crate) fn between(min_ms: u64, max_ms: u64) -> Backoff {
        Backoff {
            next_ms: min_ms,
            max_ms,
        }
    }

    pub(crate) fn next(&mut self) -> Duration {
        let pause = Duration::from_millis(self.next_ms);
        self.next_ms = (self.next_ms * 2).min(self.max_ms);
        pause
    }
}

/// What every task of the agent shares.
pub(crate) struct Shared {
    /// The server, through the runner protocol (a fake in unit tests).
    pub(crate) control: Arc<dyn ControlPlane>,
    runner_id: Mutex<String>,
    /// runc or crun (a fake in unit tests).
    pub(crate) runtime: Arc<dyn ContainerRuntime>,
    /// Every timer of the agent and the fence's notion of now.
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) data: DataDir,
    pub(crate) images: Arc<images::Images>,
    pub(crate) homes: homes::Homes,
    pub(crate) config: AgentConfig,
    /// Freezes the sandboxes when the lease cannot be renewed.
    pub(crate) fence: fence::Fence,
    /// Set while kept copies are being reported (one sync at a time).
    pub(crate) kept_syncing: Arc<AtomicBool>,
    /// Sandbox reports the server has accepted so far, a counter: an
    /// assignment asked for before a worker's report was accepted may not
    /// show that report (see `sandbox::Assigned::reports_before`).
    pub(crate) reports_accepted: AtomicU64,
    /// The deployment's stop grace in ms, as the server answered the last
    /// registration (0: `config.stop_grace`).
    stop_grace_ms: AtomicU64,
    /// The data listener's URL and key (hex), given at every registration.
    pub(crate) data_path: Option<(String, String)>,
}

impl Shared {
    pub(crate) fn runner_id(&self) -> String {
        self.runner_id
            .lock()
            .map(|id| id.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }

    /// Between a stop's SIGTERM and its SIGKILL: the server's
    /// `--stop-grace` once registered, so what the deployment publishes is
    /// what its runners do.
    pub(crate) fn stop_grace(&self) -> Duration {
        match self.stop_grace_ms.load(Ordering::Relaxed) {
            0 => self.config.stop_grace,
            ms => Duration::from_millis(ms),
        }
    }

    fn set_runner_id(&self, id: &str) {
        match self.runner_id.lock() {
            Ok(mut current) => *current = id.to_owned(),
            Err(poisoned) => *poisoned.into_inner() = id.to_owned(),
        }
    }

    /// Runs `call` until it succeeds or is refused, pausing between
    /// transient failures. Reports and uploads are idempotent, so a retry
    /// of one that did arrive changes nothing.
    pub(crate) async fn retrying<T, F, Fut>(&self, what: &str, mut call: F) -> Result<T, Refusal>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let mut backoff = Backoff::new();
        let mut attempts = 0_u32;
        loop {
            match call().await {
                Ok(value) => return Ok(value),
                Err(err) => {
                    let err = refusal(err)?;
                    attempts += 1;
                    if attempts >= 3 && attempts.is_power_of_two() {
                        tracing::warn!(%err, attempts, "{what} failed; retrying");
                    }
                    self.clock.sleep(backoff.next()).await;
                }
            }
        }
    }
}

/// Registers until the server answers; a permanent refusal (a bad token)
/// is an error. With the runner's own credential (from the data dir or an
/// earlier registration) it registers as that runner again; without one,
/// the runner token registers a new runner, whose id and credential are
/// kept in the data dir before anything else is done. The answer renews
/// the lease for the fence and sets its `freeze_after`. Returns the
/// heartbeat interval in ms.
async fn register(shared: &Shared) -> Result<u64, AgentError> {
    let mut backoff = Backoff::new();
    let mut attempts = 0_u32;
    let (registered, sent_at) = loop {
        if !shared.control.has_credential() {
            new_identity_allowed(shared)?;
        }
        let request = register_request(shared);
        let sent_at = shared.clock.now();
        let answer = clock::timeout(
            &*shared.clock,
            Duration::from_secs(REGISTER_TIMEOUT_SECONDS),
            shared.control.runner_register(&request),
        )
        .await;
        let err = match answer {
            Ok(Ok(registered)) => break (registered, sent_at),
            Ok(Err(err))
                if err.code() == Some(ErrorCode::Unauthenticated)
                    && shared.control.has_credential() =>
            {
                // The server does not know this runner's credential: the
                // data dir comes from another control plane (or one whose
                // records were reset). Start over as a new runner, if
                // nothing of the old one is on disk.
                tracing::warn!(%err, "the server does not know this runner's credential; registering as a new runner");
                shared.control.use_credential(None);
                continue;
            }
            Ok(Err(err)) if err.is_transient() => err.to_string(),
            Ok(Err(source)) => {
                return Err(AgentError::Register {
                    url: shared.config.server_url.clone(),
                    source,
                });
            }
            Err(_elapsed) => format!("no answer within {REGISTER_TIMEOUT_SECONDS} s"),
        };
        attempts += 1;
        if attempts.is_power_of_two() {
            tracing::warn!(%err, "cannot register yet; retrying");
        }
        shared.clock.sleep(backoff.next()).await;
    };
    if let Some(credential) = &registered.runner_token {
        // A new runner: its id first, then its credential, so a crash in
        // between leaves an id without a credential (registered anew at
        // the next start), never a credential under another's id.
        shared.data.save_runner_id(&registered.runner_id)?;
        shared.data.save_runner_token(credential)?;
        shared.control.use_credential(Some(credential));
    } else if registered.runner_id != shared.runner_id() {
        // Registered again by a credential that is not the saved id's.
        return Err(AgentError::ForeignDataDir {
            saved: shared.runner_id(),
            path: shared.data.root().join("runner-token"),
        });
    }
    shared.set_runner_id(&registered.runner_id);
    shared
        .stop_grace_ms
        .store(registered.stop_grace_ms, Ordering::Relaxed);
    let freeze_after_ms = match registered.freeze_after_ms {
        // Not given: the server's own rule.
        0 => registered.lease_ttl_ms * 2 / 3,
        ms => ms,
    };
    shared
        .fence
        .registration_answered(
            sent_at,
            Duration::from_millis(freeze_after_ms),
            Duration::from_millis(registered.lease_ttl_ms),
        )
        .await;
    tracing::info!(runner_id = %registered.runner_id, lease_ttl_ms = registered.lease_ttl_ms, freeze_after_ms, "registered");
    Ok(registered.heartbeat_interval_ms.max(100))
}

/// Whether this data dir may take a new runner identity: not while
/// sandboxes of the runner it names are on disk (they are that runner's,
/// and only its credential may speak for them), nor without a runner token.
fn new_identity_allowed(shared: &Shared) -> Result<(), AgentError> {
    let saved = shared.runner_id();
    if !saved.is_empty() && !shared.data.sandbox_ids_on_disk()?.is_empty() {
        return Err(AgentError::ForeignDataDir {
            saved,
            path: shared.data.root().join("runner-token"),
        });
    }
    if shared.config.token.is_empty() {
        return Err(AgentError::NoToken {
            path: shared.data.root().join("runner-token"),
        });
    }
    Ok(())
}

/// Names the saved runner only when registering by its credential: with
/// the runner token, a new runner is registered.
fn register_request(shared: &Shared) -> RegisterRequest {
    let config = &shared.config;
    let saved = shared.runner_id();
    let again = shared.control.has_credential() && !saved.is_empty();
    RegisterRequest {
        runner_id: again.then_some(saved),
        name: config.name.clone(),
        placement_class: config.placement_class.clone(),
        labels: config.labels.clone(),
        capabilities: capabilities(&*shared.runtime, &shared.homes, &config.filesystems),
        capacity: config.capacity.clone(),
        data_url: shared.data_path.as_ref().map(|(url, _)| url.clone()),
        data_key: shared.data_path.as_ref().map(|(_, key)| key.clone()),
    }
}

/// Runs the agent until `shutdown` resolves. Sandboxes keep running when
/// it returns (a restart re-adopts them), and so do the commands their
/// agents run: the next run attaches to them again (commands of a
/// container without an agent are killed, and reported `unknown`).
pub async fn run(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    run_agent(config, shutdown, |_| {}, None).await
}

/// [`run`] for a host that may be preempted: each message on `notices` is
/// a preemption notice (`roost runner` turns SIGUSR1 into one), passed on
/// to the server; the runner carries on.
pub async fn run_with_preemption(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
    notices: mpsc::Receiver<()>,
) -> Result<(), AgentError> {
    run_agent(config, shutdown, |_| {}, Some(notices)).await
}

/// [`run`], calling `on_registered` with the runner id once the first
/// registration has succeeded: from then on the server admits sandboxes
/// this runner can run (`roost up` says it is up only then).
pub async fn run_with(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
    on_registered: impl FnOnce(&str),
) -> Result<(), AgentError> {
    run_agent(config, shutdown, on_registered, None).await
}

async fn run_agent(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
    on_registered: impl FnOnce(&str),
    preemption_notices: Option<mpsc::Receiver<()>>,
) -> Result<(), AgentError> {
    let mut data = DataDir::open(&config.data_dir)?;
    // A runner that can never register touches nothing on the host: no
    // homes image made and mounted, no runtime state, no bridge.
    if config.token.is_empty() && data.runner_token()?.is_none() {
        return Err(AgentError::NoToken {
            path: data.root().join("runner-token"),
        });
    }
    if !rustix::process::geteuid().is_root() {
        // The OCI config is not rootless: every create would fail later,
        // one sandbox at a time.
        return Err(oci::Error::Unsupported(
            "the runner needs root: it creates containers, cgroups and mounts through runc or crun"
                .to_owned(),
        )
        .into());
    }
    for (id, root) in &config.filesystems {
        // A sandbox placed here for it would fail at launch: refuse now.
        if !root.is_absolute() || !root.is_dir() {
            return Err(oci::Error::Invalid(format!(
                "filesystem {id}: {} is not an absolute path to a directory",
                root.display()
            ))
            .into());
        }
        let secrets = config.secrets();
        dirs::check_apart(
            id,
            root,
            &[("data dir", data.root()), ("secrets dir", secrets.root())],
        )?;
        // What a sandbox's root writes there must not be a setuid program
        // or a device node for the host's users.
        oci::shared::ensure_host_safe(root)?;
    }
    // The data listener, bound before registering (its URL goes with the
    // registration); it serves once `shared` exists.
    let data_key = api::data_path::new_key()
        .map_err(|e| oci::Error::io("make the data key", data.root(), e))?;
    let (data_listener, data_path) = match config.data_listen {
        Some(address) => {
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .map_err(|e| oci::Error::io("bind the data listener", address.to_string(), e))?;
            let bound = listener
                .local_addr()
                .map_err(|e| oci::Error::io("bind the data listener", address.to_string(), e))?;
            // Servers cannot dial an unspecified address (and refuse a URL
            // naming one): listening on all of them needs the URL they reach.
            if bound.ip().is_unspecified() && config.data_url.is_none() {
                return Err(oci::Error::Invalid(format!(
                    "--data-listen {address}: servers cannot dial {}; give --data-url with an address they reach",
                    bound.ip()
                ))
                .into());
            }
            let url = config
                .data_url
                .clone()
                .unwrap_or_else(|| format!("http://{bound}"));
            tracing::info!(%url, "data listener bound");
            (
                Some(listener),
                Some((url, api::data_path::key_hex(&data_key))),
            )
        }
        None => (None, None),
    };
    let mut runtime_config = RuntimeConfig::new(config.runtime, data.runtime_root());
    runtime_config.cgroup_parent = config.cgroup_parent.clone();
    let mut bridge = oci::BridgeConfig::new(data.root().join("network"));
    // Bridge sandboxes route to the host's addresses: the data listener's
    // port is closed to them (only servers, with tokens, are its clients).
    if let Some(listener) = &data_listener
        && let Ok(bound) = listener.local_addr()
    {
        bridge.closed_host_ports.push(bound.port());
    }
    runtime_config.bridge = Some(bridge);
    let runtime = Runtime::open(runtime_config)?;
    if let Some(reason) = runtime.bridge_unavailable_reason() {
        tracing::warn!(%reason, "bridge networking unavailable; not offering network:bridge");
    }
    let saved = data.runner_id()?.unwrap_or_default();
    let link = control::RunnerLink::new(&config.server_url, &config.token);
    if let Some(credential) = data.runner_token()? {
        link.use_credential(Some(&credential));
    }
    let images = Arc::new(images::Images::open(data.root(), config.image_cache_bytes)?);
    let homes = homes::Homes::open(
        data.root(),
        Some(config.homes_image_bytes),
        config.failpoint.clone(),
    )?;
    if let Some(layers) = homes.layers() {
        data.place_layers_in(layers, true);
        match (homes.layers_unbounded_because(), config.sandbox_disk_bytes) {
            (None, Some(bytes)) => {
                tracing::info!(mib = bytes >> 20, "sandboxes' root layers are bounded");
            }
            (Some(reason), Some(_)) => {
                tracing::warn!(%reason, "sandboxes' root layers cannot be bounded here: a sandbox can fill the homes' volume");
            }
            (_, None) => {
                tracing::info!("sandboxes' root layers are unbounded (--sandbox-disk-max none)")
            }
        }
    } else {
        // Layers made when it could are still found where they are.
        data.place_layers_in(data.root().join("volumes").join("roots"), false);
        tracing::warn!(
            "sandboxes' root layers stay in the data dir, unbounded: the homes' volume is not btrfs"
        );
    }
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let shared = Arc::new(Shared {
        control: Arc::new(link),
        runner_id: Mutex::new(saved),
        fence: fence::Fence::new(data.root().join("fence.json"), clock.clone()),
        runtime: Arc::new(runtime),
        clock,
        data,
        images,
        homes,
        config,
        kept_syncing: Arc::new(AtomicBool::new(false)),
        reports_accepted: AtomicU64::new(0),
        stop_grace_ms: AtomicU64::new(0),
        data_path,
    });
    let _data_server = data_listener.map(|listener| {
        let plane = Arc::new(data::DataPlane {
            shared: shared.clone(),
            key: data_key,
            in_flight: Arc::default(),
            listings: data::Listings::new(),
        });
        AbortOnDrop(tokio::spawn(data::serve(plane, listener)))
    });
    tracing::info!(
        runtime = shared.runtime.name(),
        data_dir = %shared.data.root().display(),
        "runner starting"
    );
    let registration = tokio::sync::Mutex::new(());
    let mut shutdown = std::pin::pin!(shutdown);
    let heartbeat_ms = {
        let _guard = registration.lock().await;
        tokio::select! {
            registered = register(&shared) => registered?,
            () = &mut shutdown => return Ok(()),
        }
    };
    on_registered(&shared.runner_id());
    let mut workers: HashMap<String, WorkerHandle> = HashMap::new();
    let result = {
        let assignments = assignments_loop(&shared, &registration, &mut workers);
        let heartbeats = heartbeats(&shared, &registration, heartbeat_ms);
        tokio::select! {
            result = assignments => result,
            result = heartbeats => result,
            () = fence::watch(&shared) => Ok(()),
            () = preemption(&shared, preemption_notices) => Ok(()),
            () = collect_images(&shared) => Ok(()),
            () = &mut shutdown => Ok(()),
        }
    };
    // Workers end when their senders go; their containers stay.
    for (_, worker) in workers.drain() {
        drop(worker.sender);
        worker.task.abort();
    }
    tracing::info!("runner stopped; sandboxes keep running and are re-adopted at the next start");
    result
}

/// Heartbeats every interval until the agent stops: each answer renews
/// the lease for the fence; a failure is tried again soon (the fence
/// freezes unless one gets through); `fenced` has the fence kill
/// everything and the runner register again. Returns only an error.
async fn heartbeats(
    shared: &Shared,
    registration: &tokio::sync::Mutex<()>,
    mut heartbeat_ms: u64,
) -> Result<(), AgentError> {
    let mut pause_ms = heartbeat_ms;
    loop {
        shared.clock.sleep(Duration::from_millis(pause_ms)).await;
        pause_ms = heartbeat_ms;
        let request = api::runners::HeartbeatRequest {
            runner_id: shared.runner_id(),
        };
        // The lease runs from when the server got it: measuring from the
        // send errs on the early side.
        let sent_at = shared.clock.now();
        // A hung connection (after a partition) must not hold the beats
        // up: a lease lasts three intervals.
        let answer = clock::timeout(
            &*shared.clock,
            Duration::from_millis(heartbeat_ms),
            shared.control.runner_heartbeat(&request),
        )
        .await;
        let err = match answer {
            Ok(Ok(())) => {
                shared.fence.heartbeat_answered(sent_at).await;
                continue;
            }
            Ok(Err(err)) if err.code() == Some(ErrorCode::Fenced) => {
                let _guard = registration.lock().await;
                if fence::fenced(shared, sent_at).await {
                    tracing::warn!(%err, "lease lost; registering again");
                    heartbeat_ms = register(shared).await?;
                    pause_ms = heartbeat_ms;
                }
                continue;
            }
            Ok(Err(err)) => err.to_string(),
            Err(_elapsed) => format!("no answer within {heartbeat_ms} ms"),
        };
        // Try again soon: the fence freezes unless one gets through.
        pause_ms = HEARTBEAT_RETRY_MS.min(heartbeat_ms);
        tracing::warn!(%err, "heartbeat failed; the sandboxes freeze unless one gets through");
    }
}

/// Passes each preemption notice on to the server; never ends.
/// Keeps image trees within `--image-cache-max`: a collection after each
/// new materialisation (and one at start), never two at once.
async fn collect_images(shared: &Shared) {
    loop {
        if shared.images.collection_due() {
            match shared.images.collect().await {
                Ok(removed) => tracing::info!(removed = removed.len(), "image trees collected"),
                Err(err) => tracing::warn!(%err, "cannot collect image trees"),
            }
        }
        shared.clock.sleep(IMAGE_COLLECTION_INTERVAL).await;
    }
}

async fn preemption(shared: &Shared, notices: Option<mpsc::Receiver<()>>) {
    if let Some(mut notices) = notices {
        while notices.recv().await.is_some() {
            notify_preemption(shared).await;
        }
    }
    std::future::pending::<()>().await
}

/// Tells the server this host is being preempted, retrying transient
/// failures a few times. The server then has the durable sandboxes stopped
/// here (through the assignments) and placed elsewhere.
async fn notify_preemption(shared: &Shared) {
    let request = PreemptRequest {
        runner_id: shared.runner_id(),
    };
    tracing::warn!(runner_id = %request.runner_id, "preemption notice: telling the server this host is going away");
    let mut backoff = Backoff::new();
    for attempt in 1..=PREEMPT_ATTEMPTS_MAX {
        let answer = clock::timeout(
            &*shared.clock,
            Duration::from_secs(PREEMPT_TIMEOUT_SECONDS),
            shared.control.runner_preempt(&request),
        )
        .await;
        let err = match answer {
            Ok(Ok(runner)) => {
                tracing::info!(runner_id = %runner.id, drain = ?runner.drain, sandboxes = runner.sandboxes, "the server has the preemption notice; it moves this runner's durable sandboxes elsewhere");
                return;
            }
            Ok(Err(err)) if !err.is_transient() => {
                tracing::warn!(%err, "the server refused the preemption notice");
                return;
            }
            Ok(Err(err)) => err.to_string(),
            Err(_elapsed) => format!("no answer within {PREEMPT_TIMEOUT_SECONDS} s"),
        };
        tracing::warn!(%err, attempt, "passing on the preemption notice failed");
        if attempt < PREEMPT_ATTEMPTS_MAX {
            shared.clock.sleep(backoff.next()).await;
        }
    }
    tracing::warn!("gave up passing on the preemption notice; the runner carries on");
}

/// One sandbox's worker, as the assignments loop holds it.
struct WorkerHandle {
    sender: watch::Sender<Option<Assigned>>,
    task: tokio::task::JoinHandle<()>,
}

async fn assignments_loop(
    shared: &Arc<Shared>,
    registration: &tokio::sync::Mutex<()>,
    workers: &mut HashMap<String, WorkerHandle>,
) -> Result<(), AgentError> {
    let mut etag = String::new();
    let mut first = true;
    let mut backoff = Backoff::new();
    loop {
        let runner_id = shared.runner_id();
        let sent_at = shared.clock.now();
        let reports_before = shared.reports_accepted.load(Ordering::SeqCst);
        let answer = clock::timeout(
            &*shared.clock,
            Duration::from_secs(ASSIGNMENTS_TIMEOUT_SECONDS),
            shared
                .control
                .runner_assignments(&runner_id, &etag, ASSIGNMENTS_WAIT_SECONDS),
        )
        .await;
        let err = match answer {
            Ok(Ok(assignments)) if assignments.unchanged && !first => {
                // The set is as last answered, and the server's view is at
                // least this recent: no worker is woken.
                backoff = Backoff::new();
                for worker in workers.values() {
                    worker.sender.send_if_modified(|current| {
                        if let Some(current) = current {
                            current.reports_before = reports_before;
                        }
                        false
                    });
                }
                continue;
            }
            Ok(Ok(assignments)) => {
                tracing::debug!(
                    commands = assignments.commands.len(),
                    "hop: assignments read"
                );
                backoff = Backoff::new();
                etag = assignments.etag.clone();
                dispatch(shared, assignments, reports_before, workers, first)?;
                first = false;
                continue;
            }
            Ok(Err(err)) if err.code() == Some(ErrorCode::Fenced) => {
                let _guard = registration.lock().await;
                if fence::fenced(shared, sent_at).await {
                    tracing::warn!(%err, "the server no longer counts this runner live; registering again");
                    register(shared).await?;
                }
                etag.clear();
                continue;
            }
            Ok(Err(err)) => err.to_string(),
            Err(_elapsed) => format!("no answer within {ASSIGNMENTS_TIMEOUT_SECONDS} s"),
        };
        let pause = backoff.next();
        tracing::warn!(%err, pause_ms = pause.as_millis() as u64, "cannot read assignments; retrying");
        shared.clock.sleep(pause).await;
    }
}

/// Hands each sandbox its assignment and commands (waking its worker only
/// if they changed), tells workers of sandboxes no longer assigned, and on
/// the first answer also cleans up leftovers of earlier runs.
fn dispatch(
    shared: &Arc<Shared>,
    assignments: Assignments,
    reports_before: u64,
    workers: &mut HashMap<String, WorkerHandle>,
    first: bool,
) -> Result<(), AgentError> {
    let mut commands: HashMap<String, Vec<CommandAssignment>> = HashMap::new();
    for command in assignments.commands {
        commands
            .entry(command.sandbox_id.clone())
            .or_default()
            .push(command);
    }
    let mut assigned_ids: std::collections::HashSet<String> = std::collections::HashSet::new();
    kept::sync(shared, &assignments.kept, &shared.kept_syncing);
    for sandbox in assignments.sandboxes {
        let id = sandbox.sandbox_id.clone();
        let assigned = Assigned {
            commands: commands.remove(&id).unwrap_or_default(),
            sandbox,
            reports_before,
        };
        assigned_ids.insert(id.clone());
        if let Some(worker) = workers.get(&id)
            && !worker.task.is_finished()
        {
            // Unchanged: the worker is not woken, but learns that the
            // server's view is at least this recent.
            worker.sender.send_if_modified(|current| match current {
                Some(current) if current.same_as(&assigned) => {
                    current.reports_before = assigned.reports_before;
                    false
                }
                _ => {
                    *current = Some(assigned);
                    true
                }
            });
            continue;
        }
        match SandboxId::new(id.clone()) {
            Ok(sandbox_id) => {
                workers.insert(id, spawn_worker(shared, sandbox_id, Some(assigned)));
            }
            Err(err) => {
                tracing::error!(sandbox_id = %id, %err, "cannot run a sandbox with this id")
            }
        }
    }
    for (id, worker) in workers.iter() {
        if !assigned_ids.contains(id) {
            worker
                .sender
                .send_if_modified(|current| current.take().is_some());
        }
    }
    workers.retain(|_, worker| !worker.task.is_finished());
    if first {
        // Whatever an earlier run left that the server no longer assigns
        // here: a worker with no assignment removes it.
        let mut leftovers = shared.data.sandbox_ids_on_disk()?;
        leftovers.extend(shared.runtime.container_ids()?);
        leftovers.sort();
        leftovers.dedup();
        for id in leftovers {
            if workers.contains_key(&id) {
                continue;
            }
            match SandboxId::new(id.clone()) {
                Ok(sandbox_id) => {
                    workers.insert(id, spawn_worker(shared, sandbox_id, None));
                }
                Err(err) => tracing::warn!(name = %id, %err, "ignoring a file that is no sandbox"),
            }
        }
    }
    Ok(())
}

fn spawn_worker(shared: &Arc<Shared>, id: SandboxId, assigned: Option<Assigned>) -> WorkerHandle {
    let (sender, receiver) = watch::channel(assigned);
    let task = tokio::spawn(sandbox::run(shared.clone(), id, receiver));
    WorkerHandle { sender, task }
}

/// A task that ends with the scope holding it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
