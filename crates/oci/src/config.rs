//! What a sandbox is made of, as this layer sees it: its id, where its files
//! live on the host, its limits, its network mode, its init and workload.
//! Everything here is validated before any file is written or any runtime
//! is called, so a bad setting is an [`Error::Invalid`] that names it.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A container id: also the runtime's state directory name and the leaf of
/// the cgroup path, so it is kept to characters every runtime and every
/// filesystem accept (`sbx_…` ids from the control plane fit).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxId(String);

/// Longest id accepted; ids become cgroup and file names.
pub const SANDBOX_ID_BYTES_MAX: usize = 128;

impl SandboxId {
    pub fn new(id: impl Into<String>) -> Result<Self> {
        let id = id.into();
        let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
        let starts_well = id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
        if id.is_empty()
            || id.len() > SANDBOX_ID_BYTES_MAX
            || !starts_well
            || !id.chars().all(valid_char)
        {
            return Err(Error::Invalid(format!(
                "sandbox id {id:?}: use 1-{SANDBOX_ID_BYTES_MAX} of A-Z a-z 0-9 _ - ., starting with a letter or digit"
            )));
        }
        Ok(SandboxId(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Cgroup limits. `None` leaves that resource unlimited by this sandbox's
/// own cgroup (the parent's limits still apply).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    /// CPUs as a fraction (`0.5` = half a CPU), turned into a CFS quota over
    /// a 100 ms period.
    pub cpus: Option<f64>,
    pub pids: Option<u64>,
}

/// The smallest memory limit accepted: below this the runtime itself
/// cannot start the init.
pub const MEMORY_BYTES_MIN: u64 = 8 << 20;
/// The CFS period the `cpus` quota is expressed over.
pub const CPU_PERIOD_US: u64 = 100_000;
/// The kernel refuses quotas under 1 ms.
pub const CPU_QUOTA_US_MIN: i64 = 1_000;
/// The init, the runtime's exec helper and a shell need a few pids.
pub const PIDS_MIN: u64 = 8;

impl Limits {
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(bytes) = self.memory_bytes
            && bytes < MEMORY_BYTES_MIN
        {
            return Err(Error::Invalid(format!(
                "memory limit {bytes} bytes is below the minimum of {MEMORY_BYTES_MIN}"
            )));
        }
        if let Some(cpus) = self.cpus
            && (!cpus.is_finite() || cpus <= 0.0 || self.cpu_quota_us().is_none())
        {
            return Err(Error::Invalid(format!(
                "cpus {cpus} must be a positive number of at least {}",
                CPU_QUOTA_US_MIN as f64 / CPU_PERIOD_US as f64
            )));
        }
        if let Some(pids) = self.pids
            && pids < PIDS_MIN
        {
            return Err(Error::Invalid(format!(
                "pids limit {pids} is below the minimum of {PIDS_MIN}"
            )));
        }
        Ok(())
    }

    /// The CFS quota for `cpus`, or `None` when unset or out of range.
    pub fn cpu_quota_us(&self) -> Option<i64> {
        let cpus = self.cpus?;
        let quota = (cpus * CPU_PERIOD_US as f64).round();
        if quota.is_finite() && quota >= CPU_QUOTA_US_MIN as f64 && quota <= i64::MAX as f64 {
            Some(quota as i64)
        } else {
            None
        }
    }
}

/// Network mode, named as the API names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Network {
    /// Its own network namespace with only loopback.
    None,
    /// Its own network namespace with loopback and a veth into the
    /// runner's bridge: an address, a default route, outbound NAT (see
    /// [`crate::network`]). Only a [`crate::Runtime`] whose bridge is set up
    /// creates such a sandbox; any other refuses it with
    /// [`Error::Unsupported`], never falling back to `none`.
    Bridge,
}

impl Network {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "none" => Ok(Network::None),
            "bridge" => Ok(Network::Bridge),
            other => Err(Error::Invalid(format!(
                "network {other:?}: use none or bridge"
            ))),
        }
    }
}

/// The init binary on the host and the arguments that select its init
/// mode, e.g. `/usr/bin/roost` with `["init"]`. It is bind-mounted
/// read-only at [`crate::spec::INIT_PATH`] and started as
/// `INIT_PATH ARGS… [-- WORKLOAD…]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitProgram {
    pub host_path: PathBuf,
    pub args: Vec<String>,
}

/// What a sandbox's root filesystem is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootImage {
    /// The default image: the host's own system, read-only, under a plain
    /// writable directory (see [`crate::spec`]).
    Host,
    /// An imported image materialised on this host: a directory used as
    /// the read-only lower layer of an overlay whose upper layer is the
    /// sandbox's own (`DIR/upper`). It must not change while in use.
    Tree(PathBuf),
}

/// Where a sandbox's files live on the host:
///
/// ```text
/// DIR/rootfs/   the container's root: its writable top layer (kept with the
///               sandbox on this node, `standard` storage); the host's system
///               directories are bind-mounted read-only over it. With an
///               imported image it is an overlay mount of the image under
///               DIR/upper (the writable layer; DIR/work is overlay's)
/// DIR/lease/    the runner's lease deadline, mounted read-only for the
///               init (see crate::lease)
/// DIR/shared/   while a create runs: each shared mount's directory,
///               bind-mounted here from a descriptor opened beneath its
///               filesystem's root (crate::shared); unmounted once the
///               runtime has made its own mounts
/// DIR/bundle/   runtime bundle: config.json, init.status, init.log,
///               resolv.conf (`bridge`) and per-command scratch files;
///               rebuilt at every create and removed by delete
/// ```
///
/// The writable layer (`rootfs/`, or `upper/` and `work/` with an
/// imported image) is under LAYER, which is DIR unless the runner puts it
/// elsewhere ([`SandboxPaths::with_layer`]): a btrfs subvolume of its own
/// with a quota, so that what a sandbox writes outside its home is
/// bounded (`runner::agent::homes`). Everything else stays in DIR, where a
/// full layer cannot keep the runner from writing its own files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxPaths {
    dir: PathBuf,
    layer: PathBuf,
}

impl SandboxPaths {
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        if !dir.is_absolute() {
            return Err(Error::Invalid(format!(
                "sandbox directory {} must be an absolute path",
                dir.display()
            )));
        }
        Ok(SandboxPaths {
            layer: dir.clone(),
            dir,
        })
    }

    /// The same paths with the writable layer under `layer` (absolute).
    pub fn with_layer(self, layer: impl Into<PathBuf>) -> Result<Self> {
        let layer = layer.into();
        if !layer.is_absolute() {
            return Err(Error::Invalid(format!(
                "sandbox layer directory {} must be an absolute path",
                layer.display()
            )));
        }
        Ok(SandboxPaths { layer, ..self })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// Where the writable layer is: [`dir`](Self::dir) unless placed
    /// elsewhere with [`with_layer`](Self::with_layer).
    pub fn layer(&self) -> &Path {
        &self.layer
    }
    /// Whether the writable layer is apart from [`dir`](Self::dir).
    pub fn layer_apart(&self) -> bool {
        self.layer != self.dir
    }
    pub fn rootfs(&self) -> PathBuf {
        self.layer.join("rootfs")
    }
    pub fn bundle(&self) -> PathBuf {
        self.dir.join("bundle")
    }
    /// The writable layer over an imported image.
    pub fn upper(&self) -> PathBuf {
        self.layer.join("upper")
    }
    /// Where a create stages shared mounts (see [`crate::shared`]).
    pub fn shared(&self) -> PathBuf {
        self.dir.join("shared")
    }
    /// overlayfs's scratch directory (same filesystem as `upper`).
    pub fn overlay_work(&self) -> PathBuf {
        self.layer.join("work")
    }
    /// The runner's lease deadline for this sandbox's init (see
    /// [`crate::lease`]); outside the bundle, which a create clears.
    pub fn lease(&self) -> PathBuf {
        self.dir.join("lease")
    }
    pub fn config_json(&self) -> PathBuf {
        self.bundle().join("config.json")
    }
    /// The init's stdout: one line per end it reports (see [`crate::init`]).
    pub fn init_status(&self) -> PathBuf {
        self.bundle().join("init.status")
    }
    /// The init's and the workload's stderr (and stdout of the workload).
    pub fn init_log(&self) -> PathBuf {
        self.bundle().join("init.log")
    }
    /// A `bridge` sandbox's `/etc/resolv.conf` (see
    /// [`crate::network::sandbox_resolv_conf`]), mounted read-only.
    pub fn resolv_conf(&self) -> PathBuf {
        self.bundle().join("resolv.conf")
    }
    pub(crate) fn runtime_log(&self, op: &str) -> PathBuf {
        self.bundle().join(format!("{op}.runtime.log"))
    }
    pub(crate) fn exec_dir(&self) -> PathBuf {
        self.bundle().join("exec")
    }
}

/// A directory of a shared filesystem mounted on the host, bind-mounted
/// into the sandbox (`nosuid,nodev`). It is opened beneath `root` (no
/// symlink or `..` leads out of it) and must exist: nothing is created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedMount {
    /// For messages: the filesystem's id, never its host path.
    pub name: String,
    /// The filesystem's root on the host.
    pub root: PathBuf,
    /// Relative to `root`; empty: the root itself.
    pub subpath: String,
    /// [`crate::spec::WORKSPACE_PATH`] (the sandbox's own home then moves
    /// to [`crate::spec::PRIVATE_PATH`]) or a path below `/mnt`.
    pub destination: String,
    pub read_only: bool,
}

impl SharedMount {
    fn validate(&self) -> Result<()> {
        let normal = |path: &str| {
            path.split('/')
                .all(|c| !c.is_empty() && c != "." && c != "..")
        };
        let destination_ok = self.destination == crate::spec::WORKSPACE_PATH
            || self.destination.strip_prefix("/mnt/").is_some_and(normal);
        if !self.root.is_absolute()
            || self.subpath.starts_with('/')
            || self.subpath.split('/').any(|c| c == "..")
            || self.subpath.contains('\0')
            || !destination_ok
        {
            return Err(Error::Invalid(format!(
                "shared mount {}:{:?} at {:?}: a relative subpath without `..`, at /workspace or below /mnt",
                self.name, self.subpath, self.destination
            )));
        }
        Ok(())
    }
}

/// Everything needed to create one sandbox.
#[derive(Clone, Debug, PartialEq)]
pub struct SandboxConfig {
    pub id: SandboxId,
    pub paths: SandboxPaths,
    /// The host directory bind-mounted read-write at `/workspace` (also
    /// `$HOME` and the default cwd), or at `/private` when a shared mount
    /// owns `/workspace`. It must exist.
    pub workspace: PathBuf,
    /// Shared filesystems' directories mounted in the sandbox.
    pub shared: Vec<SharedMount>,
    pub init: InitProgram,
    pub image: RootImage,
    /// The workload the init starts and supervises; empty = none: the init
    /// idles as PID 1, reaping, until asked to stop.
    pub workload: Vec<String>,
    /// Environment of the init, the workload and every command (a
    /// command's own env wins).
    pub env: BTreeMap<String, String>,
    pub limits: Limits,
    pub network: Network,
    /// Host paths hidden inside the sandbox besides the built-in list
    /// ([`crate::security::MASKED_PATHS`]), e.g. the runner's own config
    /// directory under `/etc`.
    pub masked_paths: Vec<String>,
    /// The host directory holding the runner's lease deadline (see
    /// [`crate::lease`]), bind-mounted read-only at
    /// [`crate::lease::LEASE_PATH`] and watched by the init; `None` = no
    /// watch (a sandbox without a runner, as in this crate's tests).
    pub lease_dir: Option<PathBuf>,
    /// A host directory on a tmpfs holding the sandbox's delivered secret
    /// files, bind-mounted read-only at [`crate::spec::SECRETS_PATH`];
    /// `None` = no secrets. On a tmpfs so that no value reaches a disk.
    pub secrets_dir: Option<PathBuf>,
}

impl SandboxConfig {
    /// A config with defaults: no workload, no extra env, no limits,
    /// network `none`.
    pub fn new(
        id: SandboxId,
        paths: SandboxPaths,
        workspace: impl Into<PathBuf>,
        init: InitProgram,
    ) -> Self {
        SandboxConfig {
            id,
            paths,
            workspace: workspace.into(),
            shared: Vec::new(),
            init,
            image: RootImage::Host,
            workload: Vec::new(),
            env: BTreeMap::new(),
            limits: Limits::default(),
            network: Network::None,
            masked_paths: Vec::new(),
            lease_dir: None,
            secrets_dir: None,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        self.limits.validate()?;
        validate_env(&self.env)?;
        for (what, path) in [
            ("workspace", &self.workspace),
            ("init binary", &self.init.host_path),
        ]
        .into_iter()
        .chain(self.lease_dir.iter().map(|dir| ("lease directory", dir)))
        .chain(
            self.secrets_dir
                .iter()
                .map(|dir| ("secrets directory", dir)),
        ) {
            if !path.is_absolute() {
                return Err(Error::Invalid(format!(
                    "{what} {} must be an absolute path",
                    path.display()
                )));
            }
        }
        for path in &self.masked_paths {
            if !path.starts_with('/') {
                return Err(Error::Invalid(format!(
                    "masked path {path:?} must be absolute"
                )));
            }
        }
        for (i, mount) in self.shared.iter().enumerate() {
            mount.validate()?;
            if self.shared[..i]
                .iter()
                .any(|m| m.destination == mount.destination)
            {
                return Err(Error::Invalid(format!(
                    "two shared mounts at {}",
                    mount.destination
                )));
            }
        }
        if self.workload.first().is_some_and(|arg| arg.is_empty()) {
            return Err(Error::Invalid("workload program name is empty".to_owned()));
        }
        Ok(())
    }
}

pub(crate) fn validate_env(env: &BTreeMap<String, String>) -> Result<()> {
    for (name, value) in env {
        if name.is_empty() || name.contains('=') || name.contains('\0') {
            return Err(Error::Invalid(format!(
                "environment variable name {name:?}"
            )));
        }
        if value.contains('\0') {
            return Err(Error::Invalid(format!(
                "environment variable {name} contains a NUL byte"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids() {
        for good in ["sbx_018f3a2b4c5d0123456789abcdef", "a", "A.b-c_d"] {
            assert!(SandboxId::new(good).is_ok(), "{good}");
        }
        let long = "a".repeat(SANDBOX_ID_BYTES_MAX + 1);
        for bad in ["", "_x", "-x", ".x", "a/b", "a b", "é", "..", long.as_str()] {
            assert!(SandboxId::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cpu_quota() {
        let limits = |cpus| Limits {
            cpus: Some(cpus),
            ..Limits::default()
        };
        assert_eq!(limits(0.5).cpu_quota_us(), Some(50_000));
        assert_eq!(limits(2.0).cpu_quota_us(), Some(200_000));
        assert_eq!(limits(0.01).cpu_quota_us(), Some(1_000));
        assert_eq!(limits(0.001).cpu_quota_us(), None);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 0.001] {
            assert!(limits(bad).validate().is_err(), "{bad}");
        }
        assert!(limits(1.5).validate().is_ok());
    }

    #[test]
    fn other_limits() {
        let memory = |bytes| Limits {
            memory_bytes: Some(bytes),
            ..Limits::default()
        };
        assert!(memory(MEMORY_BYTES_MIN - 1).validate().is_err());
        assert!(memory(MEMORY_BYTES_MIN).validate().is_ok());
        let pids = |n| Limits {
            pids: Some(n),
            ..Limits::default()
        };
        assert!(pids(PIDS_MIN - 1).validate().is_err());
        assert!(pids(PIDS_MIN).validate().is_ok());
    }

    #[test]
    fn env_names() {
        let env = |name: &str, value: &str| BTreeMap::from([(name.to_owned(), value.to_owned())]);
        assert!(validate_env(&env("A", "b=c")).is_ok());
        assert!(validate_env(&env("", "x")).is_err());
        assert!(validate_env(&env("A=B", "x")).is_err());
        assert!(validate_env(&env("A", "x\0")).is_err());
    }

    #[test]
    fn network_names() {
        assert_eq!(Network::parse("none").ok(), Some(Network::None));
        assert_eq!(Network::parse("bridge").ok(), Some(Network::Bridge));
        assert!(Network::parse("host").is_err());
    }
}
