//! Driving an OCI runtime binary (runc or crun) through its standard
//! command line: `create`, `start`, `state`, `kill`, `pause`, `resume`,
//! `delete` and `exec`, each as `RUNTIME --root=DIR … ID`, one bundle
//! directory per sandbox.
//!
//! # Which runtime
//!
//! [`select`]: `auto` takes crun on a pure cgroup v2 host (`/sys/fs/cgroup`
//! is the unified hierarchy and no v1 controller is mounted) and runc
//! otherwise: crun refuses hybrid hosts outright ("cgroups in hybrid mode
//! not supported"), while runc handles v1, hybrid and v2. An explicit
//! choice is used as given: a missing binary is [`Error::RuntimeNotFound`]
//! naming it, and crun on a hybrid host fails at create with crun's own
//! message. The runner bridge a runtime owns is [`bridge`]'s; what the
//! runtime's log says, [`log`]'s. The traits the agent holds the driver by
//! (so its tests can put a fake in its place) are [`crate::seam`]'s.
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

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;

use crate::cgroup::CgroupHost;
use crate::config::{Network, SandboxConfig, SandboxId, SandboxPaths};
use crate::error::{Error, Result};
use crate::host::{blocking, find_binary, read_lossy, write_file};
use crate::init::InitEnd;
use crate::network::{BridgeConfig, BridgeNetwork, Lease};
use crate::probe::HostSystem;
use crate::signal::Signal;
use crate::state::{CgroupCounters, DeathCause, Observation, RuntimeState, Status};
use crate::{rootfs, spec};

mod bridge;
pub mod log;
pub mod select;

use bridge::OwnedBridge;
use log::{runtime_errors, tail};
pub use select::{RuntimeChoice, RuntimeKind, select};

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
    bridge: OwnedBridge,
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
        // bridging is not (see `bridge_unavailable_reason`).
        let bridge = OwnedBridge::open(config.bridge)?;
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
        self.inner.bridge.unavailable_reason().is_none()
    }

    /// Why `bridge` sandboxes are refused, or `None` when they are not.
    pub fn bridge_unavailable_reason(&self) -> Option<String> {
        self.inner.bridge.unavailable_reason()
    }

    /// The configured bridge (whether or not its setup worked): its
    /// leases, e.g. a sandbox's address.
    pub fn bridge(&self) -> Option<&BridgeNetwork> {
        self.inner.bridge.network()
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
        container_ids_under(&self.inner.state_root)
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
            Network::Bridge => Some(self.inner.bridge.usable()?),
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
        // The lease directory is the mount's source; its deadline is the
        // runner's to write (the init freezes at once without one).
        for dir in [paths.dir(), paths.layer(), self.inner.state_root.as_path()]
            .into_iter()
            .chain(config.lease_dir.as_deref())
        {
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
        if let Some(network) = bridge {
            OwnedBridge::attach(network, &config.id, paths).await?;
        }

        let status = open_append(&paths.init_status())?;
        let log = open_append(&paths.init_log())?;
        let runtime_log = paths.runtime_log("create");
        // Shared directories, opened beneath their roots and staged for
        // the runtime's binds; detached again once `create` has returned
        // (the container's mount namespace keeps its own).
        if let Err(e) = crate::shared::stage(config) {
            let sandbox = self.sandbox(config.id.clone(), paths.clone());
            let _ = sandbox.release_network().await;
            return Err(e);
        }
        // The agent's socket: bound here, in the bundle the sandbox never
        // sees, and handed to the init as fd 3 (crate::agent).
        let listener = match bind_agent_socket(&bundle) {
            Ok(listener) => listener,
            Err(e) => {
                let _ = crate::shared::unstage(paths);
                let sandbox = self.sandbox(config.id.clone(), paths.clone());
                let _ = sandbox.release_network().await;
                return Err(e);
            }
        };
        let mut command = self.command(Some(&runtime_log));
        pass_as_fd3(&mut command, &listener);
        command
            .arg("create")
            .arg("--preserve-fds=1")
            .arg(flag("--bundle=", &bundle))
            .arg(flag("--pid-file=", &bundle.join("init.pid")))
            .arg(config.id.as_str())
            // The init's stdio is the runtime's: stdout carries its status
            // line, stderr its and the workload's output.
            .stdin(Stdio::null())
            .stdout(status)
            .stderr(log);
        let outcome = command.status().await;
        drop(listener);
        // A staging mount that would not go stays until `delete`, which
        // unstages before it removes anything.
        let _ = crate::shared::unstage(paths);
        let outcome = outcome.map_err(|source| Error::Spawn {
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

/// Binds the agent's socket in `bundle`, through the directory's
/// descriptor (a socket path is bounded to 108 bytes; data dirs may be
/// longer).
fn bind_agent_socket(bundle: &Path) -> Result<std::os::unix::net::UnixListener> {
    use std::os::fd::AsRawFd;
    let directory = std::fs::File::open(bundle).map_err(|e| Error::io("open", bundle, e))?;
    let path = format!(
        "/proc/self/fd/{}/{}",
        directory.as_raw_fd(),
        crate::agent::SOCKET_NAME
    );
    std::os::unix::net::UnixListener::bind(&path)
        .map_err(|e| Error::io("bind", bundle.join(crate::agent::SOCKET_NAME), e))
}

/// Makes `listener` fd 3 of the runtime's process (not close-on-exec), as
/// `--preserve-fds=1` expects.
fn pass_as_fd3(command: &mut tokio::process::Command, listener: &std::os::unix::net::UnixListener) {
    use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
    let raw = listener.as_raw_fd();
    // SAFETY: between fork and exec, only fcntl and dup2 on descriptors
    // the child owns; the target descriptor is never closed here (it is
    // what the runtime inherits).
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(move || {
            let target = crate::agent::AGENT_FD;
            if raw == target {
                rustix::io::fcntl_setfd(BorrowedFd::borrow_raw(raw), rustix::io::FdFlags::empty())?;
            } else {
                let mut fd3 = std::mem::ManuallyDrop::new(OwnedFd::from_raw_fd(target));
                rustix::io::dup2(BorrowedFd::borrow_raw(raw), &mut fd3)?;
            }
            Ok(())
        });
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

    /// Takes the sandbox off the runtime's bridge, if it is on it (see
    /// `OwnedBridge::release`).
    async fn release_network(&self) -> Result<()> {
        self.runtime
            .inner
            .bridge
            .release(&self.id, &self.paths)
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
        crate::shared::unstage(&self.paths)?;
        let bundle = self.paths.bundle();
        match std::fs::remove_dir_all(&bundle) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &bundle, e)),
        }
    }

    /// Deletes the container and removes the sandbox directory and its
    /// writable layer (not the workspace, which the caller owns).
    pub async fn remove_files(&self) -> Result<()> {
        self.delete().await?;
        let paths = self.paths.clone();
        // Its root layer is a tree the sandbox wrote, of any depth. A
        // layer apart goes first: the directory is what says a sandbox
        // has files here, so it outlives a removal cut short.
        blocking("remove", self.paths.dir(), move || {
            if paths.layer_apart() {
                crate::host::remove_tree(paths.layer())?;
            }
            crate::host::remove_tree(paths.dir())
        })
        .await
    }
}

/// Ids of the containers whose state a runtime (runc or crun: one
/// directory per container) keeps under `root`, sorted; none if there is
/// no `root`.
pub fn container_ids_under(root: &Path) -> Result<Vec<String>> {
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
