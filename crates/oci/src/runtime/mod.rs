//! Driving an OCI runtime binary (runc or crun) through its standard
//! command line: `create`, `start`, `state`, `kill`, `pause`, `resume`,
//! `delete` and `exec`, each as `RUNTIME --root=DIR … ID`, one bundle
//! directory per sandbox.
//!
//! # Which runtime
//!
//! `auto` takes crun on a pure cgroup v2 host (`/sys/fs/cgroup` is the
//! unified hierarchy and no v1 controller is mounted) and runc otherwise:
//! crun refuses hybrid hosts outright ("cgroups in hybrid mode not
//! supported"), while runc handles v1, hybrid and v2. An explicit choice is
//! used as given: a missing binary is [`Error::RuntimeNotFound`] naming it,
//! and crun on a hybrid host fails at create with crun's own message.
//!
//! # Cgroups
//!
//! Every sandbox's cgroup is `/PARENT/ID` (default parent `roost`) under the
//! cgroupfs driver (an absolute `cgroupsPath`, no `--systemd-cgroup`): it
//! needs no systemd. On a hybrid host runc puts the sandbox in every v1
//! controller at that path (and mirrors it in the unified hierarchy); the
//! OOM-kill counter is read from the v1 memory controller there
//! (`memory.oom_control`), from `memory.events` on a v2 host. The runtime
//! removes the cgroups at delete; a stopped container keeps them, so its
//! OOM count can still be read to explain its death.
//!
//! # Watching
//!
//! The runtime's `state` says created, running, paused or stopped and the
//! init's host pid. [`Sandbox::wait_for_exit`] watches a pidfd of the init
//! (a zero-timeout poll every few ms, no runtime calls, immune to pid
//! reuse), then explains the death: the init's own status line (see
//! [`crate::init`]) and the memory cgroup's OOM-kill counter give
//! [`DeathCause::OomKilled`] or [`DeathCause::WorkloadExited`].

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;

use crate::cgroup::CgroupHost;
use crate::config::{Network, SandboxConfig, SandboxId, SandboxPaths};
use crate::error::{Error, Result};
use crate::init::InitEnd;
use crate::network::{BridgeConfig, BridgeNetwork, Lease};
use crate::probe::HostSystem;
use crate::signal::Signal;
use crate::{rootfs, spec};

/// Which runtime to use, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeChoice {
    Auto,
    Runc,
    Crun,
}

impl RuntimeChoice {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(RuntimeChoice::Auto),
            "runc" => Ok(RuntimeChoice::Runc),
            "crun" => Ok(RuntimeChoice::Crun),
            other => Err(Error::Invalid(format!(
                "runtime {other:?}: use auto, runc or crun"
            ))),
        }
    }
}

/// The runtime in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeKind {
    Runc,
    Crun,
}

impl RuntimeKind {
    pub fn name(self) -> &'static str {
        match self {
            RuntimeKind::Runc => "runc",
            RuntimeKind::Crun => "crun",
        }
    }

    /// The global option that sends the runtime's log to `path`.
    fn log_option(self, path: &Path) -> OsString {
        let mut option = OsString::from(match self {
            RuntimeKind::Runc => "--log=",
            RuntimeKind::Crun => "--log=file:",
        });
        option.push(path);
        option
    }
}

/// How to set up a [`Runtime`].
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    pub choice: RuntimeChoice,
    /// The runtime's `--root`: where it keeps container state. Must be
    /// private to this runner (and on tmpfs in production, so a reboot
    /// forgets containers that no longer exist).
    pub state_root: PathBuf,
    /// Parent of every sandbox's cgroup: `/PARENT/ID`.
    pub cgroup_parent: String,
    /// Where to look for the binaries; `None` = the `PATH` variable.
    pub search_path: Option<OsString>,
    /// The `bridge` network, set up by [`Runtime::open`] (a handful of
    /// blocking `ip` and `iptables` calls); `None` = this runtime refuses
    /// `bridge` sandboxes. See [`Runtime::bridge_available`].
    pub bridge: Option<BridgeConfig>,
}

impl RuntimeConfig {
    pub fn new(choice: RuntimeChoice, state_root: impl Into<PathBuf>) -> Self {
        RuntimeConfig {
            choice,
            state_root: state_root.into(),
            cgroup_parent: "roost".to_owned(),
            search_path: None,
            bridge: None,
        }
    }
}

/// Picks the runtime for `choice` on a host with `cgroups`, finding
/// binaries with `find`.
pub fn select(
    choice: RuntimeChoice,
    cgroups: &CgroupHost,
    search_path: &OsStr,
    find: impl Fn(&str) -> Option<PathBuf>,
) -> Result<(RuntimeKind, PathBuf)> {
    let path_text = || search_path.to_string_lossy().into_owned();
    let explicit = |kind: RuntimeKind| {
        find(kind.name())
            .map(|binary| (kind, binary))
            .ok_or(Error::RuntimeNotFound {
                name: kind.name(),
                path: path_text(),
            })
    };
    match choice {
        RuntimeChoice::Runc => explicit(RuntimeKind::Runc),
        RuntimeChoice::Crun => explicit(RuntimeKind::Crun),
        RuntimeChoice::Auto => {
            let order: &[RuntimeKind] = if cgroups.is_pure_v2() {
                &[RuntimeKind::Crun, RuntimeKind::Runc]
            } else {
                // crun cannot run here; never fall back to it.
                &[RuntimeKind::Runc]
            };
            order
                .iter()
                .copied()
                .find_map(|kind| find(kind.name()).map(|binary| (kind, binary)))
                .ok_or(Error::NoRuntime { path: path_text() })
        }
    }
}

/// An executable named `name` in one of `search_path`'s directories.
pub fn find_binary(search_path: &OsStr, name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(search_path)
        .map(|dir| dir.join(name))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// An OCI runtime ready to run sandboxes. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Runtime {
    inner: Arc<RuntimeInner>,
}

#[derive(Debug)]
struct RuntimeInner {
    kind: RuntimeKind,
    binary: PathBuf,
    state_root: PathBuf,
    cgroup_parent: String,
    cgroups: CgroupHost,
    host: HostSystem,
    bridge: Option<BridgeState>,
}

/// The configured bridge and, when its setup failed, why: `bridge`
/// sandboxes are then refused with that reason. Kept either way so that
/// deleting a sandbox still frees what an earlier run gave it.
#[derive(Debug)]
struct BridgeState {
    network: Arc<BridgeNetwork>,
    unavailable: Option<String>,
}

impl Runtime {
    /// Resolves the runtime binary and probes the host (cgroup layout,
    /// the system directories the default image shows).
    pub fn open(config: RuntimeConfig) -> Result<Self> {
        if config.cgroup_parent.is_empty()
            || !config
                .cgroup_parent
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/'))
            || config.cgroup_parent.split('/').any(|part| part == "..")
        {
            return Err(Error::Invalid(format!(
                "cgroup parent {:?}: use A-Z a-z 0-9 _ - . /",
                config.cgroup_parent
            )));
        }
        if !config.state_root.is_absolute() {
            return Err(Error::Invalid(format!(
                "runtime state root {} must be absolute",
                config.state_root.display()
            )));
        }
        let cgroups = CgroupHost::probe()?;
        let search_path = config
            .search_path
            .clone()
            .or_else(|| std::env::var_os("PATH"))
            .unwrap_or_default();
        let (kind, binary) = select(config.choice, &cgroups, &search_path, |name| {
            find_binary(&search_path, name)
        })?;
        let host = HostSystem::probe(cgroups.swap_accounting())?;
        // A malformed bridge config is an error; a host that cannot do
        // bridging is not: the runtime still runs `none` sandboxes and says
        // why `bridge` is unavailable (`bridge_unavailable_reason`).
        let bridge = match config.bridge {
            Some(bridge) => {
                let network = BridgeNetwork::new(bridge)?;
                let unavailable = network.setup().err().map(|e| match e {
                    // Refused again at create as Unsupported: no need to
                    // say "unsupported" twice.
                    Error::Unsupported(reason) => reason,
                    other => other.to_string(),
                });
                Some(BridgeState {
                    network: Arc::new(network),
                    unavailable,
                })
            }
            None => None,
        };
        Ok(Runtime {
            inner: Arc::new(RuntimeInner {
                kind,
                binary,
                state_root: config.state_root,
                cgroup_parent: config.cgroup_parent.trim_matches('/').to_owned(),
                cgroups,
                host,
                bridge,
            }),
        })
    }

    /// Whether this runtime creates `bridge` sandboxes: configured, and
    /// set up on this host with everything [`crate::network`] promises
    /// (isolation, NAT). Only then may the runner advertise
    /// `network:bridge`.
    pub fn bridge_available(&self) -> bool {
        self.inner
            .bridge
            .as_ref()
            .is_some_and(|bridge| bridge.unavailable.is_none())
    }

    /// Why `bridge` sandboxes are refused, or `None` when they are not.
    pub fn bridge_unavailable_reason(&self) -> Option<String> {
        match &self.inner.bridge {
            None => Some("no bridge is configured for this runner".to_owned()),
            Some(bridge) => bridge.unavailable.clone(),
        }
    }

    /// The configured bridge (whether or not its setup worked): its
    /// leases, e.g. a sandbox's address.
    pub fn bridge(&self) -> Option<&BridgeNetwork> {
        self.inner
            .bridge
            .as_ref()
            .map(|bridge| bridge.network.as_ref())
    }

    /// The bridge, for a sandbox that asks for one; fails closed.
    fn usable_bridge(&self) -> Result<Arc<BridgeNetwork>> {
        match (&self.inner.bridge, self.bridge_unavailable_reason()) {
            (Some(bridge), None) => Ok(bridge.network.clone()),
            (_, reason) => Err(Error::Unsupported(format!(
                "network bridge is not available on this runner: {}",
                reason.unwrap_or_default()
            ))),
        }
    }

    pub fn kind(&self) -> RuntimeKind {
        self.inner.kind
    }

    pub fn binary(&self) -> &Path {
        &self.inner.binary
    }

    pub fn cgroups(&self) -> &CgroupHost {
        &self.inner.cgroups
    }

    pub fn host_system(&self) -> &HostSystem {
        &self.inner.host
    }

    /// The sandbox's cgroup path as given to the runtime.
    pub fn cgroups_path(&self, id: &SandboxId) -> String {
        format!("/{}/{}", self.inner.cgroup_parent, id)
    }

    /// The runtime's state directory for `id`. Both runc and crun keep one
    /// directory per container under `--root`, named by id; its absence is
    /// how "no such container" is told from a failing runtime.
    fn state_dir(&self, id: &SandboxId) -> PathBuf {
        self.inner.state_root.join(id.as_str())
    }

    /// Ids of the containers the runtime knows (e.g. after a runner
    /// restart, to find what is still there).
    pub fn container_ids(&self) -> Result<Vec<String>> {
        let root = &self.inner.state_root;
        let listing = match std::fs::read_dir(root) {
            Ok(listing) => listing,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("list", root, e)),
        };
        let mut ids = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| Error::io("list", root, e))?;
            if entry.path().is_dir()
                && let Ok(name) = entry.file_name().into_string()
            {
                ids.push(name);
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// A handle to a sandbox the runtime may already have (after a runner
    /// restart). Nothing is checked until it is used.
    pub fn sandbox(&self, id: SandboxId, paths: SandboxPaths) -> Sandbox {
        let cgroups_path = self.cgroups_path(&id);
        let oom_seen = self.inner.cgroups.oom_kills(&cgroups_path).unwrap_or(0);
        Sandbox {
            runtime: self.clone(),
            id,
            paths,
            cgroups_path,
            oom_seen: Arc::new(AtomicU64::new(oom_seen)),
        }
    }

    /// Writes the bundle (config.json, a fresh init status and log), makes
    /// the root directory and runs `create`: the container exists, its init
    /// waits for [`Sandbox::start`].
    pub async fn create(&self, config: &SandboxConfig) -> Result<Sandbox> {
        let cgroups_path = self.cgroups_path(&config.id);
        let oci_config = spec::spec(config, &self.inner.host, &cgroups_path)?;
        // Refused before anything is written (fail closed, never `none`).
        let bridge = match config.network {
            Network::Bridge => Some(self.usable_bridge()?),
            Network::None => None,
        };
        let paths = &config.paths;
        if !config.workspace.is_dir() {
            return Err(Error::Invalid(format!(
                "workspace {} is not a directory",
                config.workspace.display()
            )));
        }
        if !config.init.host_path.is_file() {
            return Err(Error::Invalid(format!(
                "init binary {} is not a file",
                config.init.host_path.display()
            )));
        }
        // Checked before the bundle is replaced: a live container's
        // config and init status must not be clobbered.
        if self.state_dir(&config.id).exists() {
            return Err(Error::AlreadyExists {
                id: config.id.to_string(),
            });
        }
        for dir in [paths.dir(), self.inner.state_root.as_path()] {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
        }
        let bundle = paths.bundle();
        // The bundle belongs to one container life: files of an earlier one
        // (its init status above all) must not explain this one's death.
        match std::fs::remove_dir_all(&bundle) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("clear", &bundle, e)),
        }
        std::fs::create_dir_all(&bundle).map_err(|e| Error::io("create directory", &bundle, e))?;
        rootfs::prepare_rootfs(config, &self.inner.host)?;
        let config_json = paths.config_json();
        let json = serde_json::to_vec_pretty(&oci_config).map_err(|e| Error::Spec {
            id: config.id.to_string(),
            message: e.to_string(),
        })?;
        write_file(&config_json, &json)?;

        // ── network step (`bridge`) ──────────────────────────────────────
        // The named namespace config.json points at, plumbed before the
        // runtime joins it (why before `create`: see crate::network).
        if let Some(bridge) = &bridge {
            let (id, owned_paths) = (config.id.clone(), paths.clone());
            let network = bridge.clone();
            blocking("set up the network of", paths.dir(), move || {
                network.attach(&id, &owned_paths).map(drop)
            })
            .await?;
        }

        let status = open_append(&paths.init_status())?;
        let log = open_append(&paths.init_log())?;
        let runtime_log = paths.runtime_log("create");
        let mut command = self.command(Some(&runtime_log));
        command
            .arg("create")
            .arg(flag("--bundle=", &bundle))
            .arg(flag("--pid-file=", &bundle.join("init.pid")))
            .arg(config.id.as_str())
            // The init's stdio is the runtime's: stdout carries its status
            // line, stderr its and the workload's output.
            .stdin(Stdio::null())
            .stdout(status)
            .stderr(log);
        let outcome = command.status().await.map_err(|source| Error::Spawn {
            runtime: self.kind().name(),
            op: "create",
            id: config.id.to_string(),
            source,
        })?;
        let sandbox = self.sandbox(config.id.clone(), paths.clone());
        if !outcome.success() {
            let mut message = runtime_errors(&read_lossy(&runtime_log));
            if message.is_empty() {
                message = tail(&read_lossy(&paths.init_log()), 2000);
            }
            // A failed create may leave a half-made container behind.
            if self.state_dir(&config.id).exists() {
                let _ = sandbox.delete_container().await;
            }
            // ── network step: undo the attach ──
            let _ = sandbox.release_network().await;
            return Err(Error::Runtime {
                runtime: self.kind().name(),
                op: "create",
                id: config.id.to_string(),
                status: outcome.code(),
                message,
            });
        }
        sandbox.oom_seen.store(
            self.inner.cgroups.oom_kills(&cgroups_path).unwrap_or(0),
            Ordering::SeqCst,
        );
        Ok(sandbox)
    }

    /// `create` then `start`; a failed start deletes the container again.
    pub async fn launch(&self, config: &SandboxConfig) -> Result<Sandbox> {
        let sandbox = self.create(config).await?;
        if let Err(e) = sandbox.start().await {
            let _ = sandbox.delete_container().await;
            // ── network step: undo the attach ──
            let _ = sandbox.release_network().await;
            return Err(e);
        }
        Ok(sandbox)
    }

    /// `RUNTIME --root=DIR [--log=…] --log-format=json`.
    pub(crate) fn command(&self, log: Option<&Path>) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.inner.binary);
        command.arg(flag("--root=", &self.inner.state_root));
        if let Some(log) = log {
            command.arg(self.kind().log_option(log));
        }
        command.arg("--log-format=json");
        command
    }
}

fn flag(name: &str, path: &Path) -> OsString {
    let mut flag = OsString::from(name);
    flag.push(path);
    flag
}

fn open_append(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::io("open", path, e))
}

/// Runs blocking host work (the `ip` and `iptables` commands of
/// [`crate::network`]) off the async workers.
async fn blocking(
    action: &'static str,
    path: &Path,
    work: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<()> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(join) => Err(Error::io(
            action,
            path,
            std::io::Error::other(join.to_string()),
        )),
    }
}

pub(crate) fn write_file(path: &Path, contents: &[u8]) -> Result<()> {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, contents).map_err(|e| Error::io("write", &temporary, e))?;
    std::fs::rename(&temporary, path).map_err(|e| Error::io("rename into", path, e))
}

pub(crate) fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

fn tail(text: &str, max_chars: usize) -> String {
    let text = text.trim();
    let count = text.chars().count();
    text.chars().skip(count.saturating_sub(max_chars)).collect()
}

/// The error messages in a runtime's JSON log (`{"level":"error","msg":…}`
/// lines), joined; or, when there are none, the text lines that are not
/// JSON (a runtime also prints its fatal error plainly).
pub(crate) fn runtime_errors(log: &str) -> String {
    #[derive(Deserialize)]
    struct Line {
        level: Option<String>,
        msg: Option<String>,
    }
    let mut errors = Vec::new();
    let mut plain = Vec::new();
    for line in log.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match serde_json::from_str::<Line>(line) {
            Ok(Line {
                level: Some(level),
                msg: Some(msg),
            }) if matches!(level.as_str(), "error" | "fatal" | "panic") => errors.push(msg),
            Ok(_) => {}
            Err(_) => plain.push(line.to_owned()),
        }
    }
    let chosen = if errors.is_empty() { plain } else { errors };
    tail(&chosen.join("; "), 2000)
}

/// A container's status as the runtime reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Creating,
    Created,
    Running,
    Paused,
    Stopped,
}

impl Status {
    fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "creating" => Status::Creating,
            "created" => Status::Created,
            "running" => Status::Running,
            "paused" => Status::Paused,
            "stopped" => Status::Stopped,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Status::Creating => "creating",
            Status::Created => "created",
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Stopped => "stopped",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The runtime's `state` of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeState {
    pub status: Status,
    /// The init's pid on the host, while it has one.
    pub init_pid: Option<i32>,
}

/// Why a sandbox's init is gone: the `state_reason` it is reported with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeathCause {
    /// The memory cgroup recorded an OOM kill since the sandbox was last
    /// seen alive, and the init's end looks like that kill (SIGKILL, or no
    /// word at all because the init itself was the victim).
    OomKilled,
    /// Anything else: the workload ended, the init was stopped, or the init
    /// was killed from outside (then `end` is `None`: it could say nothing,
    /// and no exit code is knowable).
    WorkloadExited { end: Option<InitEnd> },
}

impl DeathCause {
    /// The stable `state_reason` code (DESIGN.md §2).
    pub fn reason(self) -> &'static str {
        match self {
            DeathCause::OomKilled => "oom_killed",
            DeathCause::WorkloadExited { .. } => "workload_exited",
        }
    }

    /// The workload's (or the init's) exit code, where knowable.
    pub fn exit_code(self) -> Option<i32> {
        match self {
            DeathCause::OomKilled => Some(137),
            DeathCause::WorkloadExited { end } => end.map(InitEnd::exit_code),
        }
    }
}

/// What [`Sandbox::observe`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observation {
    /// The runtime has no such container (never created, or deleted).
    Missing,
    /// Created (or being created), not started.
    Created {
        init_pid: Option<i32>,
    },
    Running {
        init_pid: i32,
    },
    Paused {
        init_pid: i32,
    },
    /// The init is gone; the container (and its cgroup) remain until delete.
    Stopped(DeathCause),
}

/// Cgroup counters of a sandbox; `None` where the cgroup or file is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupCounters {
    pub oom_kills: Option<u64>,
    pub pids_current: Option<u64>,
}

/// One sandbox's container. Cheap to clone; clones share what they have
/// seen (the OOM-kill count last observed while alive).
#[derive(Clone, Debug)]
pub struct Sandbox {
    pub(crate) runtime: Runtime,
    pub(crate) id: SandboxId,
    pub(crate) paths: SandboxPaths,
    pub(crate) cgroups_path: String,
    /// OOM kills already accounted for: seen while the sandbox was alive
    /// (or blamed on a command). Only kills beyond this explain a death.
    pub(crate) oom_seen: Arc<AtomicU64>,
}

/// How often [`Sandbox::wait_for_exit`] looks at the init's pidfd.
const INIT_POLL_MS: u64 = 25;

/// Whether the process behind `pidfd` has ended.
fn process_ended(pidfd: &std::os::fd::OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&zero)) {
        Ok(ready) => ready > 0,
        // EINTR: look again next time. Anything else would repeat forever;
        // treat it as ended and let the runtime's state decide.
        Err(rustix::io::Errno::INTR) => false,
        Err(_) => true,
    }
}

/// How long [`Sandbox::wait_for_exit`] waits for the runtime to agree that
/// a dead init's container is stopped.
const STOPPED_AGREEMENT_MS: u64 = 5_000;

impl Sandbox {
    pub fn id(&self) -> &SandboxId {
        &self.id
    }

    pub fn paths(&self) -> &SandboxPaths {
        &self.paths
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// `/PARENT/ID`, the cgroup path given to the runtime.
    pub fn cgroups_path(&self) -> &str {
        &self.cgroups_path
    }

    pub fn cgroup_counters(&self) -> CgroupCounters {
        let cgroups = &self.runtime.inner.cgroups;
        CgroupCounters {
            oom_kills: cgroups.oom_kills(&self.cgroups_path),
            pids_current: cgroups.pids_current(&self.cgroups_path),
        }
    }

    /// Runs `RUNTIME OP ARGS… ID`, returning its stdout. Failures carry the
    /// runtime's error messages; a container that vanished is
    /// [`Error::NotFound`].
    async fn invoke(&self, op: &'static str, args: &[&str]) -> Result<Vec<u8>> {
        self.invoke_with(op, args, &[]).await
    }

    /// As [`Sandbox::invoke`], with `trailing` arguments after the id
    /// (`kill ID SIGNAL`).
    async fn invoke_with(
        &self,
        op: &'static str,
        args: &[&str],
        trailing: &[&str],
    ) -> Result<Vec<u8>> {
        let runtime = self.runtime.kind().name();
        let output = self
            .runtime
            .command(None)
            .arg(op)
            .args(args)
            .arg(self.id.as_str())
            .args(trailing)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|source| Error::Spawn {
                runtime,
                op,
                id: self.id.to_string(),
                source,
            })?;
        if output.status.success() {
            return Ok(output.stdout);
        }
        if !self.runtime.state_dir(&self.id).exists() {
            return Err(Error::NotFound {
                id: self.id.to_string(),
            });
        }
        Err(Error::Runtime {
            runtime,
            op,
            id: self.id.to_string(),
            status: output.status.code(),
            message: runtime_errors(&String::from_utf8_lossy(&output.stderr)),
        })
    }

    /// Starts the created container's init.
    pub async fn start(&self) -> Result<()> {
        self.invoke("start", &[]).await.map(drop)
    }

    /// The runtime's view, or `None` when it has no such container.
    pub async fn state(&self) -> Result<Option<RuntimeState>> {
        if !self.runtime.state_dir(&self.id).exists() {
            return Ok(None);
        }
        let stdout = match self.invoke("state", &[]).await {
            Ok(stdout) => stdout,
            Err(Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        #[derive(Deserialize)]
        struct StateJson {
            status: String,
            #[serde(default)]
            pid: i32,
        }
        let protocol = |message: String| Error::Protocol {
            runtime: self.runtime.kind().name(),
            op: "state",
            id: self.id.to_string(),
            message,
        };
        let state: StateJson =
            serde_json::from_slice(&stdout).map_err(|e| protocol(e.to_string()))?;
        let status = Status::parse(&state.status)
            .ok_or_else(|| protocol(format!("unknown status {:?}", state.status)))?;
        let init_pid = (state.pid > 0 && status != Status::Stopped).then_some(state.pid);
        Ok(Some(RuntimeState { status, init_pid }))
    }

    /// Sends `signal` to the init (SIGTERM asks an idle init to stop; with
    /// a workload it is forwarded to it).
    pub async fn kill(&self, signal: Signal) -> Result<()> {
        self.invoke_with("kill", &[], &[signal.name()])
            .await
            .map(drop)
    }

    /// Freezes every process of the sandbox (the freezer cgroup).
    pub async fn pause(&self) -> Result<()> {
        self.invoke("pause", &[]).await.map(drop)
    }

    pub async fn resume(&self) -> Result<()> {
        self.invoke("resume", &[]).await.map(drop)
    }

    /// What the sandbox is doing now; for a stopped one, why it died.
    /// Observing it alive marks the OOM kills so far as accounted for (a
    /// command's OOM that the sandbox survived does not explain a later
    /// death).
    pub async fn observe(&self) -> Result<Observation> {
        let Some(state) = self.state().await? else {
            return Ok(Observation::Missing);
        };
        let alive_pid = state.init_pid.unwrap_or_default();
        Ok(match state.status {
            Status::Creating | Status::Created => Observation::Created {
                init_pid: state.init_pid,
            },
            Status::Running | Status::Paused => {
                if let Some(count) = self.cgroup_counters().oom_kills {
                    self.oom_seen.fetch_max(count, Ordering::SeqCst);
                }
                if state.status == Status::Running {
                    Observation::Running {
                        init_pid: alive_pid,
                    }
                } else {
                    Observation::Paused {
                        init_pid: alive_pid,
                    }
                }
            }
            Status::Stopped => Observation::Stopped(self.death_cause()),
        })
    }

    /// Why the (stopped) sandbox died: the init's status line and the OOM
    /// kills beyond those already accounted for.
    pub fn death_cause(&self) -> DeathCause {
        let end = InitEnd::parse_last(&read_lossy(&self.paths.init_status()));
        let oom_now = self.cgroup_counters().oom_kills.unwrap_or(0);
        let oom_new = oom_now > self.oom_seen.load(Ordering::SeqCst);
        if oom_new && end.is_none_or(InitEnd::looks_killed) {
            DeathCause::OomKilled
        } else {
            DeathCause::WorkloadExited { end }
        }
    }

    /// Waits until the init is gone, however that happens (its workload
    /// ended, a stop, an OOM kill, a kill from the host), and says why.
    /// Watches a pidfd of the init, so waiting costs no runtime calls.
    pub async fn wait_for_exit(&self) -> Result<DeathCause> {
        loop {
            let Some(state) = self.state().await? else {
                return Err(Error::NotFound {
                    id: self.id.to_string(),
                });
            };
            let pid = match (state.status, state.init_pid) {
                (Status::Stopped, _) | (_, None) => break,
                (_, Some(pid)) => pid,
            };
            let Some(pid) = rustix::process::Pid::from_raw(pid) else {
                break;
            };
            let pidfd =
                match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::NONBLOCK) {
                    Ok(fd) => fd,
                    // Gone between state and open: ask the runtime again.
                    Err(_) => continue,
                };
            // The pid could have been reused between `state` and the open;
            // the runtime still naming it afterwards rules that out.
            match self.state().await? {
                Some(again) if again.init_pid == Some(pid.as_raw_pid()) => {}
                _ => continue,
            }
            // A pidfd turns readable when its process ends. tokio can only
            // register it through an `unsafe` call (the workspace denies
            // unsafe code), so look at it with a zero-timeout poll(2) every
            // few milliseconds: one cheap syscall, no runtime call, and the
            // pid cannot be mistaken for a newer process.
            while !process_ended(&pidfd) {
                tokio::time::sleep(Duration::from_millis(INIT_POLL_MS)).await;
            }
            break;
        }
        // The runtime may take a moment to see the init gone.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(STOPPED_AGREEMENT_MS);
        loop {
            match self.state().await? {
                None => {
                    return Err(Error::NotFound {
                        id: self.id.to_string(),
                    });
                }
                Some(state) if state.status == Status::Stopped => return Ok(self.death_cause()),
                Some(state) if tokio::time::Instant::now() >= deadline => {
                    return Err(Error::Protocol {
                        runtime: self.runtime.kind().name(),
                        op: "state",
                        id: self.id.to_string(),
                        message: format!("init exited but the runtime still says {}", state.status),
                    });
                }
                Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// Stops the sandbox: SIGTERM to the init, SIGKILL after `grace`, and
    /// waits for the end. A paused sandbox is resumed first (frozen
    /// processes cannot act on either signal).
    pub async fn stop(&self, grace: Duration) -> Result<DeathCause> {
        match self.state().await? {
            None => {
                return Err(Error::NotFound {
                    id: self.id.to_string(),
                });
            }
            Some(state) if state.status == Status::Stopped => return Ok(self.death_cause()),
            Some(state) if state.status == Status::Paused => self.resume().await?,
            Some(_) => {}
        }
        self.kill_unless_stopped(Signal::Term).await?;
        match tokio::time::timeout(grace, self.wait_for_exit()).await {
            Ok(result) => result,
            Err(_elapsed) => {
                self.kill_unless_stopped(Signal::Kill).await?;
                self.wait_for_exit().await
            }
        }
    }

    async fn kill_unless_stopped(&self, signal: Signal) -> Result<()> {
        match self.kill(signal).await {
            Ok(()) => Ok(()),
            Err(e) => match self.state().await? {
                Some(state) if state.status != Status::Stopped => Err(e),
                _ => Ok(()),
            },
        }
    }

    /// `delete --force`: kills what still runs, removes the runtime's state
    /// and the cgroups. Idempotent.
    async fn delete_container(&self) -> Result<()> {
        if !self.runtime.state_dir(&self.id).exists() {
            return Ok(());
        }
        match self.invoke("delete", &["--force"]).await {
            Ok(_) | Err(Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Takes the sandbox off the runtime's bridge (its veth, namespace and
    /// address lease), if it is on it. Runs for every sandbox of a runtime
    /// with a bridge, since a handle made after a restart does not know
    /// the sandbox's network mode; for a `none` sandbox it finds nothing.
    async fn release_network(&self) -> Result<()> {
        let Some(bridge) = &self.runtime.inner.bridge else {
            return Ok(());
        };
        let network = bridge.network.clone();
        let id = self.id.clone();
        blocking("release the network of", self.paths.dir(), move || {
            network.detach(&id)
        })
        .await
    }

    /// The sandbox's address on the runtime's bridge, if it has one.
    pub fn lease(&self) -> Result<Option<Lease>> {
        match self.runtime.bridge() {
            Some(network) => network.lease(&self.id),
            None => Ok(None),
        }
    }

    /// Deletes the container and its bundle. The root directory (the
    /// sandbox's writable layer) and the workspace stay: they are storage
    /// the caller may keep (a stopped `standard` sandbox) or remove with
    /// [`Sandbox::remove_files`]. Idempotent.
    pub async fn delete(&self) -> Result<()> {
        self.delete_container().await?;
        // ── network step: veth, namespace, then the lease ──
        self.release_network().await?;
        rootfs::unmount_rootfs(&self.paths)?;
        let bundle = self.paths.bundle();
        match std::fs::remove_dir_all(&bundle) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &bundle, e)),
        }
    }

    /// Deletes the container and removes the sandbox directory, root
    /// directory included (not the workspace, which the caller owns).
    pub async fn remove_files(&self) -> Result<()> {
        self.delete().await?;
        let dir = self.paths.dir().to_path_buf();
        let result = tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &dir, e)),
        })
        .await;
        match result {
            Ok(result) => result,
            Err(join) => Err(Error::io(
                "remove",
                self.paths.dir(),
                std::io::Error::other(join.to_string()),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(pure_v2: bool) -> CgroupHost {
        if pure_v2 {
            CgroupHost {
                v1: Vec::new(),
                v2: Some("/sys/fs/cgroup".into()),
            }
        } else {
            CgroupHost {
                v1: vec![("memory".into(), "/sys/fs/cgroup/memory".into())],
                v2: Some("/sys/fs/cgroup/unified".into()),
            }
        }
    }

    fn pick(choice: RuntimeChoice, pure_v2: bool, installed: &[&str]) -> Result<RuntimeKind> {
        select(choice, &host(pure_v2), OsStr::new("/usr/bin"), |name| {
            installed
                .contains(&name)
                .then(|| PathBuf::from("/usr/bin").join(name))
        })
        .map(|(kind, _)| kind)
    }

    #[test]
    fn selection() {
        use RuntimeChoice::*;
        let both = ["runc", "crun"];
        assert_eq!(pick(Auto, true, &both).ok(), Some(RuntimeKind::Crun));
        assert_eq!(pick(Auto, false, &both).ok(), Some(RuntimeKind::Runc));
        assert_eq!(pick(Auto, true, &["runc"]).ok(), Some(RuntimeKind::Runc));
        assert!(matches!(
            pick(Auto, false, &["crun"]),
            Err(Error::NoRuntime { .. })
        ));
        assert_eq!(pick(Crun, false, &both).ok(), Some(RuntimeKind::Crun));
        let missing = pick(Runc, true, &["crun"]).expect_err("runc missing");
        assert!(missing.to_string().contains("runc"), "{missing}");
        assert!(matches!(
            missing,
            Error::RuntimeNotFound { name: "runc", .. }
        ));
    }

    #[test]
    fn runtime_error_messages() {
        let log = r#"{"level":"warning","msg":"ignoring","time":"x"}
{"level":"error","msg":"exec failed: unable to start container process: exec: \"nope\": executable file not found in $PATH","time":"x"}
exec failed: unable to start container process: exec: "nope": executable file not found in $PATH
"#;
        assert_eq!(
            runtime_errors(log),
            "exec failed: unable to start container process: exec: \"nope\": executable file not found in $PATH"
        );
        assert_eq!(runtime_errors("plain failure\n"), "plain failure");
        assert_eq!(runtime_errors(""), "");
    }

    #[test]
    fn choices_parse() {
        assert_eq!(RuntimeChoice::parse("auto").ok(), Some(RuntimeChoice::Auto));
        assert!(RuntimeChoice::parse("youki").is_err());
    }
}
