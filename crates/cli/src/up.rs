//! `roost up`: the whole platform in one process on embedded defaults: the
//! control plane (SQLite, a local directory home store) and one runner,
//! all under one data dir. The first start creates an org `default` and a
//! runner token through the server's own admin API; every start writes the
//! URL, the org token and the admin token file's path where the CLI finds
//! them without flags (`crate::credentials`).
//!
//! ```text
//! DIR/server/   the server's data dir: roost.db, admin-token
//! DIR/store/    the home store (local directory)
//! DIR/runner/   the runner's data dir (sandboxes, homes, command records)
//! DIR/up.json   the org and runner tokens this made (mode 0600)
//! ```

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Args;
use runner::RuntimeChoice;
use runner::agent::AgentConfig;
use serde_json::json;

use crate::control::runtime;
use crate::credentials::{self, Saved};
use crate::output::print_json;
use crate::runner::{absolute, init_program, stop_requested};

/// How many times its CPUs `roost up`'s runner offers.
const UP_CPU_SHARING: f64 = 8.0;

#[derive(Args)]
pub struct UpArgs {
    /// Where everything is kept (default `$XDG_DATA_HOME/roost` or
    /// `~/.local/share/roost`).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Address the API listens on (`HOST:PORT`; `localhost:7070` works).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7070", value_parser = crate::control::parse_listen)]
    listen: SocketAddr,
    /// The OCI runtime: `auto`, `runc` or `crun`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "runc", "crun"])]
    runtime: String,
    /// Once up, print one JSON object on stdout instead of the banner:
    /// `url`, `data_dir`, `credentials` and `admin_token_file` (paths).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct PurgeArgs {
    /// The data dir `roost up` used (default as `roost up`'s:
    /// `$XDG_DATA_HOME/roost` or `~/.local/share/roost`).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// The OCI runtime `roost up` ran sandboxes with: `auto`, `runc` or
    /// `crun`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "runc", "crun"])]
    runtime: String,
    /// Go ahead: every sandbox, home and saved home in the data dir is
    /// deleted, for good. Without it nothing is touched.
    #[arg(long)]
    yes: bool,
    /// Print one JSON object on stdout: what was removed.
    #[arg(long)]
    json: bool,
}

fn default_data_dir() -> Result<PathBuf> {
    let absolute = |name: &str| {
        std::env::var_os(name)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    absolute("XDG_DATA_HOME")
        .or_else(|| absolute("HOME").map(|home| home.join(".local").join("share")))
        .map(|dir| dir.join("roost"))
        .context("no data dir: pass --data-dir (neither XDG_DATA_HOME nor HOME is set)")
}

/// The tokens the first start made, kept for the next ones.
struct Made {
    org_token: String,
    runner_token: String,
}

fn read_made(path: &Path) -> Result<Option<Made>> {
    let fields = credentials::read_secret_fields(path, ["org_token", "runner_token"])?;
    Ok(fields.map(|[org_token, runner_token]| Made {
        org_token,
        runner_token,
    }))
}

fn write_made(path: &Path, org_id: &str, made: &Made) -> Result<()> {
    let body = json!({
        "org": "default",
        "org_id": org_id,
        "org_token": made.org_token,
        "runner_token": made.runner_token,
    });
    credentials::write_secret_json(path, &body)
}

/// The org and runner tokens: made once, through the admin API.
async fn org_and_runner_tokens(url: &str, data_dir: &Path) -> Result<Made> {
    let made_path = data_dir.join("up.json");
    if let Some(made) = read_made(&made_path)? {
        return Ok(made);
    }
    let admin_path = data_dir.join("server").join("admin-token");
    let admin_token = std::fs::read_to_string(&admin_path)
        .with_context(|| format!("reading the admin token {}", admin_path.display()))?;
    let admin = api::client::Client::new(url, admin_token.trim());
    let org = admin
        .create_org(&api::orgs::CreateOrgRequest {
            name: "default".to_owned(),
            max_running: None,
            max_total: None,
            max_store_mib: None,
        })
        .await
        .context("creating the org `default`")?;
    let runner = admin
        .create_runner_token(&Default::default())
        .await
        .context("creating a runner token")?;
    let made = Made {
        org_token: org.token,
        runner_token: runner.token,
    };
    write_made(&made_path, &org.org_id, &made)?;
    Ok(made)
}

/// Searched when the process has no `PATH` (as the runner does).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What `roost up` needs from the host, checked before anything starts, so
/// a fresh machine hears in one line what is missing and how to get it
/// (`scripts/up.sh` installs all of it): an OCI runtime, or nothing runs;
/// btrfs-progs, or homes are standard only (said, not refused).
fn preflight(runtime: &str) -> Result<()> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
    let wanted: &[&str] = match runtime {
        "runc" => &["runc"],
        "crun" => &["crun"],
        _ => &["runc", "crun"],
    };
    if !wanted
        .iter()
        .any(|name| runner::find_binary(&path, name).is_some())
    {
        bail!(
            "roost up needs an OCI runtime and found no {} on PATH ({}): install it with `apt-get install {}` (scripts/up.sh installs everything roost up needs)",
            wanted.join(" or "),
            path.to_string_lossy(),
            wanted[0]
        );
    }
    if runner::find_binary(&path, "btrfs").is_none()
        || runner::find_binary(&path, "mkfs.btrfs").is_none()
    {
        eprintln!(
            "roost up: durable homes need btrfs-progs, not found on PATH: sandboxes get standard homes only (install it with `apt-get install btrfs-progs`)"
        );
    }
    Ok(())
}

pub fn run(args: UpArgs) -> Result<ExitCode> {
    let data_dir = match args.data_dir {
        Some(dir) => absolute(dir)?,
        None => default_data_dir()?,
    };
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    let mut server_config = server::Config::new(args.listen, data_dir.join("server"));
    server_config.secret_key =
        crate::control::secret_key_source(&data_dir.join("server"), None, false);
    server_config.store_url =
        crate::control::home_store_enabled()?.then(|| data_dir.join("store").display().to_string());
    let runtime_choice = RuntimeChoice::parse(&args.runtime)?;
    preflight(&args.runtime)?;
    let init = init_program()?;
    let json = args.json;
    runtime()?.block_on(async move {
        let (stop_server, server_stopping) = tokio::sync::oneshot::channel::<()>();
        let (started_tx, started) = tokio::sync::oneshot::channel::<String>();
        let server = tokio::spawn(server::serve(
            server_config,
            async {
                let _ = server_stopping.await;
            },
            move |started| {
                let _ = started_tx.send(started.url);
            },
        ));
        let url = match started.await {
            Ok(url) => url,
            Err(_) => {
                return match server.await {
                    Ok(Err(err)) => Err(err).context("the server failed to start"),
                    _ => bail!("the server failed to start"),
                };
            }
        };
        let made = org_and_runner_tokens(&url, &data_dir).await?;
        let admin_token_file = data_dir.join("server").join("admin-token");
        let credentials_path = credentials::save(&Saved {
            url: url.clone(),
            token: made.org_token.clone(),
            admin_token_file: Some(admin_token_file.clone()),
        })?;

        let mut agent = AgentConfig::new(&url, &made.runner_token, data_dir.join("runner"), init);
        agent.runtime = runtime_choice;
        // On one machine, sandboxes share its CPUs: a CPU limit caps a
        // sandbox, it reserves nothing, so offering only the host's count
        // would turn away the third sandbox on a two-core laptop.
        agent.capacity.cpus *= UP_CPU_SHARING;
        agent.failpoint = api::failpoint::Failpoints::from_env();
        let (stop_runner, runner_stopping) = tokio::sync::oneshot::channel::<()>();
        let (registered_tx, registered) = tokio::sync::oneshot::channel::<()>();
        let mut runner = tokio::spawn(runner::agent::run_with(
            agent,
            async {
                let _ = runner_stopping.await;
            },
            move |_| {
                let _ = registered_tx.send(());
            },
        ));
        // Up means usable: until the runner has registered, every create
        // would be refused (no runner offers what it needs).
        tokio::select! {
            answer = registered => {
                if answer.is_err() {
                    return match (&mut runner).await {
                        Ok(Err(err)) => Err(err).context("the runner failed to start"),
                        _ => bail!("the runner failed to start"),
                    };
                }
            }
            () = stop_requested() => {
                let _ = stop_runner.send(());
                let _ = stop_server.send(());
                return Ok(ExitCode::SUCCESS);
            }
        }

        if json {
            print_json(&json!({
                "url": url,
                "data_dir": data_dir,
                "credentials": credentials_path,
                "admin_token_file": admin_token_file,
            }));
        } else {
            println!("roost is up at {url}");
            println!("  data:        {}", data_dir.display());
            println!(
                "  credentials: {} (the CLI uses them when ROOST_URL and ROOST_TOKEN are unset)",
                credentials_path.display()
            );
            println!(
                "  admin token: {} (`roost admin …` reads it when ROOST_TOKEN is unset)",
                admin_token_file.display()
            );
            println!("try: roost sandbox create --wait");
        }
        let _ = std::io::stdout().flush();

        let result = tokio::select! {
            () = stop_requested() => Ok(()),
            ended = &mut runner => match ended {
                Ok(Ok(())) => bail!("the runner stopped on its own"),
                Ok(Err(err)) => Err(err).context("the runner failed"),
                Err(join) => bail!("the runner task failed: {join}"),
            },
        };
        // The runner first (its sandboxes keep running and their files stay
        // on disk; the next `roost up` re-adopts them), then the server.
        let _ = stop_runner.send(());
        if !runner.is_finished() {
            let _ = runner.await;
        }
        let _ = stop_server.send(());
        match server.await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::warn!(%err, "the server ended with an error"),
            Err(join) => tracing::warn!(%join, "the server task failed"),
        }
        eprintln!(
            "roost stopped; sandboxes and homes are kept in {}",
            data_dir.display()
        );
        result.map(|()| ExitCode::SUCCESS)
    })
}

/// `roost purge`: removes everything `roost up` made with data dir DIR:
/// its sandboxes (containers killed, network namespaces, mounts), its
/// secrets tmpfs, DIR itself (the database, the store, every home), and
/// the saved credentials when they are this DIR's. Refused while `roost
/// up` runs on DIR (its runner holds the runner dir's lock).
pub fn purge(args: PurgeArgs) -> Result<ExitCode> {
    let data_dir = match args.data_dir {
        Some(dir) => absolute(dir)?,
        None => default_data_dir()?,
    };
    if !args.yes {
        bail!(
            "roost purge deletes every sandbox, home and saved home in {} for good: pass --yes to go ahead",
            data_dir.display()
        );
    }
    let runtime_choice = RuntimeChoice::parse(&args.runtime)?;
    let purged = runtime()?
        .block_on(runner::purge::purge(
            &data_dir.join("runner"),
            runtime_choice,
            None,
        ))
        .with_context(|| {
            format!(
                "purging {} (is roost up still running there?)",
                data_dir.display()
            )
        })?;
    let removed = data_dir.exists();
    if removed {
        // Sandboxes' root layers and homes are in it, of any depth.
        oci::host::remove_tree(&data_dir)
            .with_context(|| format!("removing {}", data_dir.display()))?;
    }
    // The credentials `roost up` saved for this DIR (its admin token file
    // is inside it); others' are left.
    let mut credentials_removed = None;
    if let Some(saved) = credentials::load()?
        && saved
            .admin_token_file
            .as_deref()
            .is_some_and(|file| file.starts_with(&data_dir))
        && let Some(path) = credentials::path()
    {
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        credentials_removed = Some(path);
    }
    if args.json {
        print_json(&json!({
            "data_dir": data_dir,
            "removed": removed,
            "containers": purged.containers,
            "unmounted": purged.unmounted,
            "credentials_removed": credentials_removed,
            "bridge_left": purged.bridge_left,
        }));
    } else {
        if removed {
            println!(
                "removed {} ({} containers)",
                data_dir.display(),
                purged.containers.len()
            );
        } else {
            println!("nothing at {}", data_dir.display());
        }
        if let Some(path) = &credentials_removed {
            println!("removed {}", path.display());
        }
        if let Some(bridge) = &purged.bridge_left {
            println!(
                "left the host's bridge {bridge} and its iptables chains (any runner on this host may use them; see README)"
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
