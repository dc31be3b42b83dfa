//! `roost runner` (the agent on each host) and `roost init` (the PID 1 it
//! puts in every sandbox: this same binary, bind-mounted read-only).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;
use runner::agent::{AgentConfig, host};
use runner::{InitProgram, RuntimeChoice};
use tokio::signal::unix::{SignalKind, signal};

use crate::control::runtime;
use crate::sandbox::parse_pair;

#[derive(Args)]
#[command(after_long_help = RUNNER_SIGNALS)]
pub struct RunnerArgs {
    /// The control plane's URL.
    #[arg(long, env = "ROOST_URL", value_name = "URL")]
    server: String,
    /// A runner token (`roost admin runner-token`). It only registers the
    /// runner the first time: the runner then keeps its own credential in
    /// the data dir and restarts with that. A value given here shows in
    /// the host's process list (`ps`): prefer --token-file or the
    /// environment.
    #[arg(long, env = "ROOST_RUNNER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A file holding the runner token (keep it readable by root alone).
    /// Used instead of --token and ROOST_RUNNER_TOKEN when given.
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Where the runner keeps its id, sandboxes' files and homes, and
    /// command records; a restart with the same one loses nothing.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/roost/runner")]
    data_dir: PathBuf,
    /// The OCI runtime: `auto` picks crun on a pure cgroup v2 host, runc
    /// otherwise.
    #[arg(long, default_value = "auto", value_parser = ["auto", "runc", "crun"])]
    runtime: String,
    /// Labels shown on the runner, `k=v,…`.
    #[arg(long, value_name = "K=V,…")]
    labels: Option<String>,
    /// `spot` (may go away at any time) or `on_demand`.
    #[arg(long, default_value = "on_demand", value_parser = ["spot", "on_demand"])]
    placement_class: String,
    /// What this runner offers, any of `sandboxes=N,memory_mib=M,cpus=C,pids=P`
    /// (default: 64 sandboxes and the host's CPUs, memory and pid limit).
    #[arg(long, value_name = "LIST")]
    capacity: Option<String>,
    /// The runner's name in the server's records (default: the host name).
    #[arg(long)]
    name: Option<String>,
    /// Where the data dir is not on btrfs, homes live on a btrfs image
    /// file of this size in it (sparse: it costs what homes use), so that
    /// running homes can be snapshotted for saves. E.g. `256GiB`.
    #[arg(long, value_name = "SIZE", default_value = "256GiB", value_parser = crate::sandbox::parse_mib)]
    homes_image_size: u64,
    /// The most each sandbox's root file system may take on this host
    /// beyond its image (what it writes outside `/workspace`, `/tmp` and
    /// `/run`: installed packages, `/var`, `/opt`): a write past it fails
    /// in the sandbox with "Disk quota exceeded". Enforced where the homes'
    /// volume is btrfs with quota groups on (the runner's own image is);
    /// `none`: only the volume's free space bounds it.
    #[arg(long, value_name = "SIZE|none", default_value = "10GiB", value_parser = parse_size_or_none)]
    sandbox_disk_max: SizeOrNone,
    /// The most imported images' trees (and the block cache that speeds
    /// up their next versions) may take on this host: past it, trees no
    /// sandbox here uses are removed, least recently used first (a later
    /// sandbox of that image downloads it again). `none`: no bound.
    #[arg(long, value_name = "SIZE|none", default_value = "32GiB", value_parser = parse_size_or_none)]
    image_cache_max: SizeOrNone,
    /// The cgroup every sandbox's cgroup goes under. One runner per host
    /// needs no other; several runners on one machine (tests, demos) each
    /// need their own, since a sandbox's cgroup is named after it.
    #[arg(long, value_name = "NAME", default_value = "roost")]
    cgroup_parent: String,
    /// A shared filesystem mounted on this host (an NFS, CephFS or EFS
    /// mount, the same on every runner that declares it), offered as
    /// `filesystem:ID`. Repeatable. The path never reaches a sandbox or
    /// the server.
    #[arg(long = "filesystem", value_name = "ID=PATH")]
    filesystems: Vec<String>,
    /// Where delivered secrets are held: the runner mounts a tmpfs there
    /// (unless it is one already), so no value reaches a disk; keep it
    /// outside the data dir [default: /run/roost/secrets/NAME, NAME from
    /// the data dir].
    #[arg(long, value_name = "DIR")]
    secrets_dir: Option<PathBuf>,
    /// Where the data listener listens: servers stream to this runner's
    /// sandboxes there (a command's stdin), each request with a token
    /// minted for it under this runner's key; `off`: no data path. Servers
    /// must reach it: on a multi-host deployment, an address they can
    /// dial, e.g. `0.0.0.0:7071` with --data-url.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    data_listen: String,
    /// The URL servers reach the data listener at [default: http:// and
    /// the address it bound].
    #[arg(long, value_name = "URL")]
    data_url: Option<String>,
}

/// How `roost runner` answers signals (after `--help`'s options).
const RUNNER_SIGNALS: &str = "\
Signals:
  SIGTERM, SIGINT  stop the runner; its sandboxes keep running and the next
                   start re-adopts them.
  SIGUSR1          preemption notice: the host is going away (send it from a
                   cloud's spot-interruption hook). The runner tells the
                   server, which has the durable sandboxes here secured and
                   placed elsewhere; the runner keeps running meanwhile.

If the runner cannot renew its lease with the server, it freezes (pauses)
its sandboxes before the lease can expire, thaws them once a heartbeat gets
through in time, and kills them if the server declared it lost; the state
is recorded in DATA_DIR/fence.json.";

/// The `roost` binary itself, as every sandbox's init.
pub fn init_program() -> Result<InitProgram> {
    let exe = std::env::current_exe().context("finding the roost binary (the sandboxes' init)")?;
    Ok(InitProgram {
        host_path: exe,
        args: vec!["init".to_owned()],
    })
}

pub fn absolute(path: PathBuf) -> Result<PathBuf> {
    std::path::absolute(&path).with_context(|| format!("resolving {}", path.display()))
}

/// Resolves when the process is asked to stop (Ctrl-C or SIGTERM).
pub async fn stop_requested() {
    let terminate = async {
        match signal(SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}

/// The runner token from --token-file, else --token or the environment;
/// empty when none is given (a runner that registered before needs none).
fn runner_token(args: &RunnerArgs) -> Result<String> {
    match &args.token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the runner token from {}", path.display()))?;
            let token = text.trim();
            if token.is_empty() {
                anyhow::bail!("{} holds no runner token", path.display());
            }
            Ok(token.to_owned())
        }
        None => Ok(args.token.clone().unwrap_or_default().trim().to_owned()),
    }
}

pub fn run(args: RunnerArgs) -> Result<ExitCode> {
    let token = runner_token(&args)?;
    let mut config = AgentConfig::new(
        &args.server,
        &token,
        absolute(args.data_dir)?,
        init_program()?,
    );
    config.runtime = RuntimeChoice::parse(&args.runtime)?;
    config.placement_class = args.placement_class;
    if let Some(name) = args.name {
        config.name = name;
    }
    if let Some(labels) = args.labels {
        for pair in labels.split(',').filter(|p| !p.trim().is_empty()) {
            let (key, value) = parse_pair(pair.trim()).map_err(anyhow::Error::msg)?;
            config.labels.insert(key, value);
        }
    }
    if let Some(capacity) = args.capacity {
        config.capacity =
            host::parse_capacity(&capacity, config.capacity).map_err(anyhow::Error::msg)?;
    }
    config.homes_image_bytes = args.homes_image_size.saturating_mul(1 << 20);
    config.sandbox_disk_bytes = args.sandbox_disk_max.bytes();
    config.image_cache_bytes = args.image_cache_max.bytes();
    config.cgroup_parent = args.cgroup_parent;
    for declared in &args.filesystems {
        let Some((id, path)) = declared.split_once('=') else {
            anyhow::bail!("--filesystem {declared:?}: use ID=PATH");
        };
        if !server::control::admission::filesystem_id_ok(id) {
            anyhow::bail!(
                "--filesystem {declared:?}: the id is 1-64 of a-z 0-9 - _, starting with a letter or digit"
            );
        }
        let path = absolute(PathBuf::from(path))?;
        if !path.is_dir() {
            anyhow::bail!("--filesystem {id}: {} is not a directory", path.display());
        }
        if config.filesystems.insert(id.to_owned(), path).is_some() {
            anyhow::bail!("--filesystem {id} given twice");
        }
    }
    config.secrets_dir = args.secrets_dir;
    config.data_listen = match args.data_listen.as_str() {
        "off" => None,
        address => Some(address.parse().with_context(|| {
            format!("--data-listen {address:?}: an address such as 0.0.0.0:7071, or off")
        })?),
    };
    config.data_url = args.data_url;
    config.failpoint = api::failpoint::Failpoints::from_env();
    runtime()?.block_on(async move {
        // Listening replaces SIGUSR1's default action (the end of the
        // process) before the agent starts.
        let mut preemption = signal(SignalKind::user_defined1())
            .context("listening for SIGUSR1 (preemption notices)")?;
        // Notices that arrive while one is being passed on are one notice.
        let (notify, notices) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            while preemption.recv().await.is_some() {
                let _ = notify.try_send(());
            }
        });
        runner::agent::run_with_preemption(config, stop_requested(), notices)
            .await
            .context("runner failed")
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `roost init [-- WORKLOAD…]`: PID 1 of a sandbox.
pub fn run_init(args: impl IntoIterator<Item = std::ffi::OsString>) -> ExitCode {
    runner::init::run_from_args(args)
}

/// A bound given as a size or `none` (`--sandbox-disk-max`,
/// `--image-cache-max`): MiB, or `None` for `none`.
#[derive(Clone, Copy, Debug)]
struct SizeOrNone(Option<u64>);

impl SizeOrNone {
    fn bytes(self) -> Option<u64> {
        self.0.map(|mib| mib.saturating_mul(1 << 20))
    }
}

fn parse_size_or_none(text: &str) -> Result<SizeOrNone, String> {
    if text.trim().eq_ignore_ascii_case("none") {
        return Ok(SizeOrNone(None));
    }
    crate::sandbox::parse_mib(text).map(|mib| SizeOrNone(Some(mib)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_is_a_size_or_none() {
        assert_eq!(
            parse_size_or_none("10GiB").expect("a size").0,
            Some(10 << 10)
        );
        assert_eq!(
            parse_size_or_none("10GiB").expect("a size").bytes(),
            Some(10 << 30)
        );
        assert_eq!(parse_size_or_none("512M").expect("a size").0, Some(512));
        assert_eq!(parse_size_or_none("none").expect("none").0, None);
        assert_eq!(parse_size_or_none("NONE").expect("none").0, None);
        for bad in ["0", "", "lots", "-1G"] {
            assert!(parse_size_or_none(bad).is_err(), "{bad:?}");
        }
    }
}
