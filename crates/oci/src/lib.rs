//! The OCI layer: turns "a sandbox with these settings" into a real
//! container under runc or crun, watches it, and runs commands in it with
//! honest outcomes.
//!
//! - [`security`]: the policy every sandbox runs under (capabilities,
//!   masked paths, the seccomp filter, file limits).
//! - [`probe`]: what the host offers (its system directories for the
//!   default image; the init's ELF interpreter and libraries).
//! - [`spec`]: the `config.json` (namespaces, mounts, cgroup limits, the
//!   default image built from the host's own system).
//! - [`rootfs`]: the sandbox's root directory on the host (a plain
//!   directory, or an overlay over an imported image).
//! - [`runtime`]: [`Runtime`] (which binary, `--root`, the cgroup layout) and
//!   [`Sandbox`] (create, start, state, kill, pause, resume, stop, delete,
//!   observing a death and its cause).
//! - [`seam`]: the traits the agent holds the driver by,
//!   [`ContainerRuntime`] and [`Container`] (its tests fake them).
//! - [`exec`]: commands: output streamed while they run, timeout, signals,
//!   one [`Outcome`] each.
//! - [`network`]: `bridge` networking (a runner bridge, a veth per sandbox,
//!   isolation between sandboxes, outbound NAT, address leases).
//! - [`shared`]: shared filesystems' directories, opened beneath their
//!   root and staged for the runtime's bind mounts.
//! - [`volumes`]: where sandbox homes live (btrfs subvolumes, snapshots).
//! - [`init`]: the PID 1 every sandbox runs (the `roost init` entry point).
//! - [`lease`]: the runner's lease deadline, which the init enforces when
//!   the runner cannot (the file, its clock, the freeze rule).
//! - [`cgroup`]: the host's cgroup layout and the counters read from it.
//! - [`state`]: what the runtime reports and what a death is put down to.
//! - [`tmpfs`]: a directory backed by memory (a runner's secrets).
//! - [`host`]: the host helpers every module shares (binary lookup, the
//!   one runner of host tools, atomic and durable writes, the blocking
//!   bridge); it imports nothing of the crate but [`Error`].
//!
//! Only this crate spawns the runtime binary. It knows nothing of the
//! control plane or its protocol (it depends on neither `api` nor `store`):
//! the runner agent (`runner::agent`) above it does. Everything is async
//! (tokio) except [`init::run`], which builds its own small runtime.
//!
//! ```no_run
//! # async fn example() -> oci::Result<()> {
//! use oci::*;
//! let runtime = Runtime::open(RuntimeConfig::new(RuntimeChoice::Auto, "/run/roost/oci"))?;
//! let config = SandboxConfig::new(
//!     SandboxId::new("sbx_0123")?,
//!     SandboxPaths::new("/var/lib/roost/sandboxes/sbx_0123")?,
//!     "/var/lib/roost/homes/sbx_0123",
//!     InitProgram { host_path: "/usr/bin/roost".into(), args: vec!["init".into()] },
//! );
//! let sandbox = runtime.launch(&config).await?;
//! let end = sandbox
//!     .run(&CommandSpec::new(["make", "test"]), |stream, bytes| {
//!         let _ = (stream, bytes); // forward the chunk
//!     })
//!     .await?;
//! println!("{}", end.outcome.state());
//! sandbox.stop(std::time::Duration::from_secs(10)).await?;
//! sandbox.delete().await?;
//! # Ok(())
//! # }
//! ```

pub mod agent;
pub mod cgroup;
pub mod config;
mod error;
pub mod exec;
pub mod host;
pub mod init;
pub mod lease;
pub mod network;
pub mod probe;
pub mod rootfs;
pub mod runtime;
pub mod seam;
pub mod security;
pub mod shared;
pub mod signal;
pub mod spec;
pub mod state;
pub mod tmpfs;
pub mod volumes;

pub use agent::client::AgentExecution;
pub use agent::files_client::{
    AgentDownload, FileEntry, FileInfo, FileKind, FileListing, FileWriter, TarSummary, TarWriter,
};
pub use config::{
    InitProgram, Limits, Network, RootImage, SandboxConfig, SandboxId, SandboxPaths, SharedMount,
};
pub use error::{Error, Result};
pub use exec::{CommandEnd, CommandSpec, Execution, Outcome, RuntimeExecution, Signaller, Stream};
pub use init::InitEnd;
pub use network::{BridgeConfig, BridgeNetwork, Ipv4Subnet, Lease};
pub use runtime::log::LaunchFailure;
pub use runtime::{Runtime, RuntimeChoice, RuntimeConfig, RuntimeKind, Sandbox};
pub use seam::{BoxFuture, CommandStdin, Container, ContainerRuntime, RunningCommand};
pub use seam::{FileDownload, FileUpload, TarUpload};
pub use signal::Signal;
pub use state::{CgroupCounters, DeathCause, Observation, RuntimeState, Status};
