//! `roost server` and `roost admin …`: the control plane and its admin
//! calls. The CLI reaches the server at `ROOST_URL` with `ROOST_TOKEN`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use crate::output::{age, human_bytes, or_dash, print_json, print_record, print_table};

#[derive(Args)]
pub struct ServerArgs {
    /// Address to listen on (`HOST:PORT`; a name such as `localhost` is
    /// resolved, its first address taken).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7070", value_parser = parse_listen)]
    listen: SocketAddr,
    /// Where the server keeps its SQLite database and the admin token.
    #[arg(long, default_value = "/var/lib/roost")]
    data_dir: PathBuf,
    /// `sqlite://PATH` or `postgres://…` (default: SQLite in the data dir).
    #[arg(long, value_name = "URL")]
    database: Option<String>,
    /// The home store: a directory, `file://PATH` or `s3://BUCKET/PREFIX`.
    /// Without one, `durable` storage is refused.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Most sandboxes running at once across every org (a fleet ceiling).
    #[arg(long, value_name = "N")]
    fleet_max_running: Option<u64>,
    /// The most command output one org's records keep, all its commands
    /// together (e.g. `8GiB`): past it, output is not stored (the command
    /// says `stdout_truncated`) until a deleted sandbox's records are
    /// purged.
    #[arg(long, value_name = "SIZE", default_value = "8GiB", value_parser = crate::sandbox::parse_mib)]
    org_output_max: u64,
    /// The most client connections served at once; past it new ones wait
    /// (idle ones end after 30 s without a request). Lowered, with a
    /// warning, to what the open files limit allows.
    #[arg(long, value_name = "N", default_value_t = server::DEFAULT_CONNECTIONS_MAX)]
    max_connections: usize,
    /// The most requests one org may have under way at once on this server
    /// (long-polls, streams and attached terminals included); past it,
    /// 429 `quota_exceeded` (metric `requests_at_once`).
    #[arg(long, value_name = "N", default_value_t = server::DEFAULT_ORG_REQUESTS_MAX)]
    org_requests_max: usize,
    /// A file holding a token (at least 32 characters) a metrics scraper
    /// reads `/metrics` with (`Authorization: Bearer TOKEN`; Prometheus's
    /// `authorization.credentials_file`). Without it only the admin token
    /// reads `/metrics`.
    #[arg(long, value_name = "PATH")]
    metrics_token_file: Option<PathBuf>,
    /// How long ended sandboxes stay readable (e.g. `7d`, `12h`).
    #[arg(long, default_value = "7d", value_parser = crate::sandbox::parse_duration)]
    retention: std::time::Duration,
    /// How long a runner's lease lasts after each heartbeat. Runners beat
    /// every third of it and freeze their sandboxes at two thirds without
    /// an answered beat.
    #[arg(long, default_value = "9s", value_parser = crate::sandbox::parse_duration)]
    lease_ttl: std::time::Duration,
    /// How long past a lease's expiry the server still waits before it
    /// declares the runner lost and recovers its sandboxes elsewhere
    /// (clock drift between servers, the runner's freeze taking time).
    #[arg(long, default_value = "1s", value_parser = crate::sandbox::parse_duration)]
    fence_margin: std::time::Duration,
    /// When this share of the live runners (and at least two) lose their
    /// lease at once, the control plane is the likelier culprit: recovery
    /// holds off for --mass-loss-grace so runners can report in.
    #[arg(long, default_value = "0.5", value_parser = parse_share)]
    mass_loss_threshold: f64,
    /// How long recovery holds off after a mass loss (see
    /// --mass-loss-threshold) for the runners to report in.
    #[arg(long, default_value = "120s", value_parser = crate::sandbox::parse_duration)]
    mass_loss_grace: std::time::Duration,
    /// How often the reconcilers (leases, TTL, retention, scheduling) run.
    #[arg(long, default_value = "1s", value_parser = crate::sandbox::parse_duration)]
    reconcile_interval: std::time::Duration,
    /// How often running durable homes are saved (a create may ask for
    /// another interval within --save-interval-min and --save-interval-max).
    #[arg(long, default_value = "300s", value_parser = crate::sandbox::parse_duration)]
    save_interval: std::time::Duration,
    /// The shortest save interval a create may ask for.
    #[arg(long, default_value = "10s", value_parser = crate::sandbox::parse_duration)]
    save_interval_min: std::time::Duration,
    /// The longest save interval a create may ask for.
    #[arg(long, default_value = "24h", value_parser = crate::sandbox::parse_duration)]
    save_interval_max: std::time::Duration,
    /// How long a running sandbox may go without activity before it
    /// sleeps (an ordinary stop, `state_reason: idle`), unless its create
    /// asks otherwise: 0 (never) or within --idle-timeout-min and
    /// --idle-timeout-max. README "Idle sandboxes" lists what is activity.
    #[arg(long, default_value = "30m", value_parser = crate::sandbox::parse_duration)]
    idle_timeout: std::time::Duration,
    /// The shortest idle timeout (other than 0) a create may ask for.
    #[arg(long, default_value = "10s", value_parser = crate::sandbox::parse_duration)]
    idle_timeout_min: std::time::Duration,
    /// The longest idle timeout a create may ask for.
    #[arg(long, default_value = "7d", value_parser = crate::sandbox::parse_duration)]
    idle_timeout_max: std::time::Duration,
    /// How long a stop waits between SIGTERM and SIGKILL of a sandbox's
    /// workload (runners take it from the server).
    #[arg(long, default_value = "10s", value_parser = crate::sandbox::parse_duration)]
    stop_grace: std::time::Duration,
    /// The key org secrets are sealed with: a file of 64 hex digits, mode
    /// 0600, made with a fresh key if absent [default: DATA_DIR/secret-key].
    /// `ROOST_SECRET_KEY` (64 hex digits) takes precedence. Every server
    /// of a deployment needs the same key.
    #[arg(long, value_name = "PATH", conflicts_with = "no_secret_key")]
    secret_key_file: Option<PathBuf>,
    /// Run without a secret key: `secrets` are refused
    /// (`unsupported_capability`).
    #[arg(long)]
    no_secret_key: bool,
}

/// Where `roost server` and `roost up` take the secret key from.
pub fn secret_key_source(
    data_dir: &std::path::Path,
    file: Option<PathBuf>,
    none: bool,
) -> server::control::secrets::SecretKeySource {
    use server::control::secrets::SecretKeySource;
    if none {
        return SecretKeySource::None;
    }
    match std::env::var("ROOST_SECRET_KEY") {
        Ok(hex) if !hex.is_empty() => SecretKeySource::Hex(hex),
        _ => SecretKeySource::File(file.unwrap_or_else(|| data_dir.join("secret-key"))),
    }
}

/// `roost admin runner drain|preempt|undrain ID`.
async fn runner_action(id: &str, target: &Target, json: bool, action: &str) -> Result<()> {
    let runner = target
        .client()?
        .admin_runner_action(id, action)
        .await
        .with_context(|| format!("runner {action} failed"))?;
    if json {
        return print_record(&runner);
    }
    match &runner.drain {
        Some(drain) => println!(
            "runner {} is being emptied ({drain}): its durable sandboxes move to other runners; {} sandbox(es) still on it",
            runner.id, runner.sandboxes
        ),
        None => println!("runner {} takes sandboxes again", runner.id),
    }
    Ok(())
}

/// A share of the fleet: a number from 0 to 1 (above 1 turns the hold off).
fn parse_share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(share) if share.is_finite() && share > 0.0 => Ok(share),
        _ => Err(format!("{text:?} is not a share above 0, e.g. 0.5")),
    }
}

/// `ROOST_HOME_STORE=false` runs without a store whatever `--store` says:
/// `durable` is then refused and homes are plain directories on their
/// runner.
pub fn home_store_enabled() -> Result<bool> {
    match std::env::var("ROOST_HOME_STORE").as_deref() {
        Err(_) | Ok("true" | "1" | "") => Ok(true),
        Ok("false" | "0") => Ok(false),
        Ok(other) => anyhow::bail!("ROOST_HOME_STORE={other:?}: use true or false"),
    }
}

#[derive(Subcommand)]
pub enum AdminCommand {
    /// Organisations.
    #[command(subcommand)]
    Org(OrgCommand),
    /// Create a token runners register with. `--class`, `--capability`
    /// and `--capacity` bound what the runners it enrols may declare, then
    /// and at every later registration (another class or more capacity is
    /// refused, naming it; an unlisted capability is not recorded); each
    /// left out allows anything.
    RunnerToken {
        /// A placement class they may declare (`spot`, `on_demand`);
        /// repeat for both.
        #[arg(long = "class", value_name = "CLASS")]
        classes: Vec<String>,
        /// A capability they may be offered for, e.g. `storage:durable` or
        /// `filesystem:team`; repeat for each. Given once, a capability a
        /// runner declares that is not listed is not recorded.
        #[arg(long = "capability", value_name = "CAPABILITY")]
        capabilities: Vec<String>,
        /// The most capacity they may declare: `sandboxes=N,memory_mib=M,
        /// cpus=C,pids=P`, any subset (the rest unbounded).
        #[arg(long, value_name = "LIST")]
        capacity: Option<String>,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Revoke an org token or a runner token: refused by the server at
    /// once and by every server within a few seconds (printed). Runners a
    /// runner token registered keep their own credentials.
    RevokeToken {
        /// The token to revoke; `-` or nothing reads it from stdin (a
        /// command line is visible to other users of the host).
        revoked: Option<String>,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Quarantine sandboxes for forensics, and release them.
    #[command(subcommand)]
    Sandbox(AdminSandboxCommand),
    /// Runners: list them, drain one for maintenance, pass on a spot
    /// host's preemption notice.
    #[command(subcommand)]
    Runner(AdminRunnerCommand),
    /// Shared filesystems: which org may mount which filesystem runners
    /// declare (`roost runner --filesystem ID=PATH`).
    #[command(subcommand)]
    Filesystem(AdminFilesystemCommand),
    /// Back up a running deployment into DEST: the records (an online,
    /// consistent copy), then the store (incremental), every root of the
    /// records checked whole in the copy. Reads the data dir, database and
    /// store directly (no server call).
    Backup(crate::backup::BackupArgs),
    /// Bring a deployment back from a backup into an empty data dir (or
    /// database) and store, then check it.
    Restore(crate::backup::RestoreArgs),
    /// Recompute the kept counts (each org's and the fleet's quota counts,
    /// each runner's usage) from the sandboxes and report any drift; exit 1
    /// on drift.
    Counts {
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Check that every durable sandbox's last completed save, every
    /// snapshot's and every image's tree is whole in the store; reports
    /// each one that is not.
    Check(crate::backup::CheckArgs),
}

#[derive(Subcommand)]
pub enum AdminFilesystemCommand {
    /// Let an org's sandboxes mount the filesystem (binding again changes
    /// --read-only for sandboxes created afterwards).
    Bind {
        /// The filesystem's id.
        id: String,
        /// The org, by name or id.
        #[arg(long)]
        org: String,
        /// The org's sandboxes mount it read-only, whatever they ask.
        #[arg(long)]
        read_only: bool,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Withdraw the binding: new creates that mount it are refused;
    /// sandboxes that mount it keep it while they run, and their next
    /// start, wake or recovery waits (`filesystem_unbound`).
    Unbind {
        /// The filesystem's id.
        id: String,
        /// The org, by name or id.
        #[arg(long)]
        org: String,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Every binding.
    List {
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum AdminRunnerCommand {
    /// Every runner with its lease, drain and sandbox count.
    List {
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Empty a runner for maintenance: nothing new lands on it, and its
    /// durable sandboxes are secured and placed elsewhere without loss.
    /// Standard sandboxes stay (their home is on it).
    Drain {
        /// The runner's id (`roost admin runner list`).
        id: String,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// A spot runner's host is being taken back: as drain, at once. (The
    /// runner itself passes on the notice when it gets SIGUSR1.)
    Preempt {
        /// The runner's id (`roost admin runner list`).
        id: String,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Take sandboxes again after a drain.
    Undrain {
        /// The runner's id (`roost admin runner list`).
        id: String,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum AdminSandboxCommand {
    /// Freeze a sandbox: its owner can no longer stop, start, delete it or
    /// run commands in it (409 `quarantined`) until it is released.
    Quarantine {
        /// The sandbox (any org's).
        id: String,
        /// Why, kept on the record (1 to 1024 bytes).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        target: Target,
        /// Print the sandbox record as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Lift a quarantine: the owner can act on the sandbox again.
    Release {
        /// The sandbox (any org's).
        id: String,
        #[command(flatten)]
        target: Target,
        /// Print the sandbox record as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum OrgCommand {
    /// Create an organisation; prints its id and its token (shown once).
    Create {
        /// The org's name: 1-64 of a-z 0-9 - _.
        name: String,
        /// Most sandboxes running at once.
        #[arg(long)]
        max_running: Option<u32>,
        /// Most sandboxes held (running or stopped).
        #[arg(long)]
        max_total: Option<u32>,
        /// Most its objects may take in the content store (its homes'
        /// saves, snapshots, images, pushes, as stored), e.g. `100G`;
        /// past it uploads are refused `quota_exceeded` (`store_bytes`).
        #[arg(long, value_name = "SIZE", value_parser = crate::sandbox::parse_mib)]
        max_store: Option<u64>,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Every org: its quotas, what it uses of them, and the command
    /// output its records keep.
    List {
        #[command(flatten)]
        target: Target,
        /// Print `{"orgs": [...]}` on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Make another token for an org (printed once): to rotate one, make a
    /// new token, move clients to it, then `roost admin revoke-token` the
    /// old one.
    Token {
        /// The org, by name or id.
        org: String,
        #[command(flatten)]
        target: Target,
        /// Print the answer as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub struct Target {
    /// The server's URL [default: the one `roost up` saved, else
    /// http://127.0.0.1:7070].
    #[arg(long, env = "ROOST_URL")]
    url: Option<String>,
    /// An admin token (`roost server` prints it on its first start and
    /// keeps it in DATA_DIR/admin-token) [default: the admin token of the
    /// server `roost up` runs, for its URL].
    #[arg(long, env = "ROOST_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl Target {
    fn client(&self) -> Result<api::client::Client> {
        let target = crate::credentials::resolve_admin(self.url.as_deref(), self.token.as_deref())?;
        Ok(api::client::Client::new(&target.url, &target.token))
    }
}

/// An admin call the server answered as if the endpoint did not exist,
/// as it does for any token but the admin token: says so.
fn admin_token_hint(err: anyhow::Error) -> anyhow::Error {
    let not_admin = err.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<api::client::ClientError>(),
            Some(api::client::ClientError::Api { status: 404, message, .. })
                if message == "no such endpoint"
        )
    });
    if !not_admin {
        return err;
    }
    let cause = err
        .chain()
        .nth(1)
        .map(|cause| format!(": {cause}"))
        .unwrap_or_default();
    anyhow::anyhow!(
        "{err}{cause} (admin endpoints need an admin token, not an org token: `roost server` keeps it in DATA_DIR/admin-token)"
    )
}

/// A listen address: `IP:PORT`, or `HOST:PORT` with the host's first
/// address (`localhost:7070`).
pub fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    if let Ok(address) = text.parse() {
        return Ok(address);
    }
    use std::net::ToSocketAddrs;
    match text.to_socket_addrs() {
        Ok(mut addresses) => addresses
            .next()
            .ok_or_else(|| format!("{text} resolves to no address")),
        Err(err) => Err(format!(
            "expected HOST:PORT, e.g. 127.0.0.1:7070 or localhost:7070 ({err})"
        )),
    }
}

pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn run_server(args: ServerArgs) -> Result<ExitCode> {
    let secret_key = secret_key_source(&args.data_dir, args.secret_key_file, args.no_secret_key);
    let mut config = server::Config::new(args.listen, args.data_dir);
    config.secret_key = secret_key;
    config.database_url = args.database;
    config.store_url = if home_store_enabled()? {
        args.store
    } else {
        None
    };
    config.fleet_max_running = args.fleet_max_running;
    config.save_interval = args.save_interval;
    config.save_interval_min = args.save_interval_min;
    config.save_interval_max = args.save_interval_max;
    config.idle_timeout = args.idle_timeout;
    config.idle_timeout_min = args.idle_timeout_min;
    config.idle_timeout_max = args.idle_timeout_max;
    config.stop_grace = args.stop_grace;
    config.retention = args.retention;
    config.org_output_bytes_max = args.org_output_max.saturating_mul(1 << 20);
    config.connections_max = args.max_connections;
    config.org_requests_max = args.org_requests_max.max(1);
    config.metrics_token = args
        .metrics_token_file
        .as_deref()
        .map(read_metrics_token)
        .transpose()?;
    config.lease_ttl = args.lease_ttl;
    config.fence_margin = args.fence_margin;
    config.mass_loss_threshold = args.mass_loss_threshold;
    config.mass_loss_grace = args.mass_loss_grace;
    config.reconcile_interval = args.reconcile_interval;
    config.failpoint = api::failpoint::Failpoints::from_env();
    runtime()?.block_on(async move {
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        server::serve(config, shutdown, |started| {
            // Written, not printed: a server whose stdout was closed (a
            // supervisor that reads only its first line) serves on; the
            // admin token is in the data dir as well.
            use std::io::Write;
            let mut out = std::io::stdout();
            let _ = writeln!(out, "roost server listening on {}", started.url);
            let _ = match started.admin_token {
                Some(token) => writeln!(out, "admin token (shown once; also in the data dir as admin-token): {token}"),
                None => writeln!(out, "admin token: created earlier (admin-token in the data dir of the server that made it)"),
            };
            let _ = out.flush();
        })
        .await
        .context("server failed")
    })?;
    Ok(ExitCode::SUCCESS)
}

pub fn run_admin(command: AdminCommand) -> Result<ExitCode> {
    // These run their own blocking work (store copies, database dumps).
    let command = match command {
        AdminCommand::Backup(args) => return crate::backup::run_backup(args),
        AdminCommand::Restore(args) => return crate::backup::run_restore(args),
        AdminCommand::Check(args) => return crate::backup::run_check(args),
        command => command,
    };
    let result = runtime()?.block_on(async move {
        match command {
            AdminCommand::Org(OrgCommand::Create {
                name,
                max_running,
                max_total,
                max_store,
                target,
                json,
            }) => {
                let client = target.client()?;
                let request = api::orgs::CreateOrgRequest {
                    name,
                    max_running,
                    max_total,
                    max_store_mib: max_store,
                };
                let org = client
                    .create_org(&request)
                    .await
                    .context("org create failed")?;
                if json {
                    print_json(
                        &json!({ "org_id": org.org_id, "name": org.name, "token": org.token }),
                    );
                } else {
                    println!(
                        "org {} ({})\ntoken (shown once): {}",
                        org.name, org.org_id, org.token
                    );
                }
            }
            AdminCommand::Org(OrgCommand::List { target, json }) => {
                let list = target
                    .client()?
                    .admin_orgs()
                    .await
                    .context("org list failed")?;
                if json {
                    print_record(&list)?;
                } else {
                    let of = |used: u64, limit: Option<u64>| match limit {
                        Some(limit) => format!("{used}/{limit}"),
                        None => used.to_string(),
                    };
                    let rows: Vec<Vec<String>> = list
                        .orgs
                        .iter()
                        .map(|o| {
                            vec![
                                o.org_id.clone(),
                                o.name.clone(),
                                of(o.running, o.max_running),
                                of(o.total, o.max_total),
                                human_bytes(o.output_bytes),
                                o.max_store_mib
                                    .map_or_else(|| "-".to_owned(), |mib| human_bytes(mib << 20)),
                                age(&o.created_at),
                            ]
                        })
                        .collect();
                    print_table(
                        &[
                            "ID",
                            "NAME",
                            "RUNNING",
                            "TOTAL",
                            "OUTPUT",
                            "STORE MAX",
                            "CREATED",
                        ],
                        &rows,
                    );
                }
            }
            AdminCommand::Org(OrgCommand::Token { org, target, json }) => {
                let client = target.client()?;
                let created = client
                    .create_org_token(&org)
                    .await
                    .context("org token failed")?;
                if json {
                    print_json(&json!({ "org_id": created.org_id, "token": created.token }));
                } else {
                    println!(
                        "token for org {} (shown once): {}",
                        created.org_id, created.token
                    );
                }
            }
            AdminCommand::RevokeToken {
                revoked,
                target,
                json,
            } => {
                let revoked = match revoked.as_deref() {
                    None | Some("-") => {
                        let mut line = String::new();
                        std::io::stdin()
                            .read_line(&mut line)
                            .context("reading the token to revoke from stdin")?;
                        line.trim().to_owned()
                    }
                    Some(token) => token.to_owned(),
                };
                let client = target.client()?;
                let done = client
                    .revoke_token(&revoked)
                    .await
                    .context("revoke-token failed")?;
                if json {
                    print_json(&serde_json::to_value(&done).context("encoding the answer")?);
                } else {
                    let whose = done
                        .org_id
                        .as_deref()
                        .map(|org| format!(" of org {org}"))
                        .unwrap_or_default();
                    println!(
                        "revoked a {} token{whose} at {}; every server refuses it within {} ms",
                        done.kind, done.revoked_at, done.refused_everywhere_within_ms
                    );
                }
            }
            AdminCommand::RunnerToken {
                classes,
                capabilities,
                capacity,
                target,
                json,
            } => {
                let unbounded = api::runners::Capacity {
                    sandboxes: u64::MAX,
                    memory_mib: u64::MAX,
                    cpus: f64::MAX,
                    pids: u64::MAX,
                };
                let profile = api::orgs::RunnerProfile {
                    placement_classes: (!classes.is_empty()).then_some(classes),
                    capabilities: (!capabilities.is_empty()).then_some(capabilities),
                    capacity: capacity
                        .map(|list| runner::agent::host::parse_capacity(&list, unbounded))
                        .transpose()
                        .map_err(anyhow::Error::msg)?,
                };
                let client = target.client()?;
                let created = client
                    .create_runner_token(&profile)
                    .await
                    .context("runner-token failed")?;
                if json {
                    print_json(&serde_json::to_value(&created)?);
                } else {
                    println!("runner token (shown once): {}", created.token);
                    let profile = &created.profile;
                    if let Some(classes) = &profile.placement_classes {
                        println!("  placement classes allowed: {}", classes.join(", "));
                    }
                    if let Some(capabilities) = &profile.capabilities {
                        println!("  capabilities allowed: {}", capabilities.join(", "));
                    }
                    if let Some(max) = &profile.capacity {
                        let figure = |value: u64| match value {
                            u64::MAX => "any".to_owned(),
                            n => n.to_string(),
                        };
                        let cpus = if max.cpus == f64::MAX {
                            "any".to_owned()
                        } else {
                            max.cpus.to_string()
                        };
                        println!(
                            "  capacity at most: sandboxes={} memory_mib={} cpus={cpus} pids={}",
                            figure(max.sandboxes),
                            figure(max.memory_mib),
                            figure(max.pids)
                        );
                    }
                }
            }
            AdminCommand::Sandbox(AdminSandboxCommand::Quarantine {
                id,
                reason,
                target,
                json,
            }) => {
                let request = api::sandboxes::QuarantineRequest { reason };
                let sandbox = target
                    .client()?
                    .quarantine_sandbox(&id, &request)
                    .await
                    .context("sandbox quarantine failed")?;
                if json {
                    print_record(&sandbox)?;
                } else {
                    println!(
                        "sandbox {} quarantined ({}; state {})",
                        sandbox.id, request.reason, sandbox.state
                    );
                }
            }
            AdminCommand::Runner(AdminRunnerCommand::List { target, json }) => {
                let runners = target
                    .client()?
                    .admin_runners()
                    .await
                    .context("runner list failed")?;
                if json {
                    print_record(&json!({ "runners": runners }))?;
                } else {
                    let rows: Vec<Vec<String>> = runners
                        .iter()
                        .map(|r| {
                            vec![
                                r.id.clone(),
                                r.name.clone(),
                                r.placement_class.clone(),
                                r.state.clone(),
                                or_dash(r.drain.as_deref()),
                                r.sandboxes.to_string(),
                                r.lease_expires_at.clone(),
                            ]
                        })
                        .collect();
                    print_table(
                        &[
                            "ID",
                            "NAME",
                            "CLASS",
                            "STATE",
                            "DRAIN",
                            "SANDBOXES",
                            "LEASE UNTIL",
                        ],
                        &rows,
                    );
                }
            }
            AdminCommand::Runner(AdminRunnerCommand::Drain { id, target, json }) => {
                runner_action(&id, &target, json, "drain").await?;
            }
            AdminCommand::Runner(AdminRunnerCommand::Preempt { id, target, json }) => {
                runner_action(&id, &target, json, "preempt").await?;
            }
            AdminCommand::Runner(AdminRunnerCommand::Undrain { id, target, json }) => {
                runner_action(&id, &target, json, "undrain").await?;
            }
            AdminCommand::Filesystem(command) => admin_filesystem(command).await?,
            AdminCommand::Counts { target, json } => {
                let checked = target
                    .client()?
                    .admin_counts()
                    .await
                    .context("counts check failed")?;
                if json {
                    print_record(&checked)?;
                } else {
                    for d in &checked.drift {
                        println!(
                            "drift: {} {}: kept {}, recomputed {}",
                            d.scope, d.count, d.kept, d.recomputed
                        );
                    }
                    println!(
                        "counts: {} scopes compared, {}",
                        checked.scopes,
                        if checked.drift.is_empty() {
                            "exact".to_owned()
                        } else {
                            format!("{} counts drifted", checked.drift.len())
                        }
                    );
                }
                if !checked.drift.is_empty() {
                    return Ok(ExitCode::from(1));
                }
            }
            AdminCommand::Backup(_) | AdminCommand::Restore(_) | AdminCommand::Check(_) => {
                unreachable!("run before the runtime starts")
            }
            AdminCommand::Sandbox(AdminSandboxCommand::Release { id, target, json }) => {
                let sandbox = target
                    .client()?
                    .release_sandbox(&id)
                    .await
                    .context("sandbox release failed")?;
                if json {
                    print_record(&sandbox)?;
                } else {
                    println!(
                        "sandbox {} released from quarantine (state {})",
                        sandbox.id, sandbox.state
                    );
                }
            }
        }
        Ok(ExitCode::SUCCESS)
    });
    // An org token gets a hint, not just "no such endpoint".
    result.map_err(admin_token_hint)
}

async fn admin_filesystem(command: AdminFilesystemCommand) -> Result<()> {
    let (binding, verb, json) = match command {
        AdminFilesystemCommand::Bind {
            id,
            org,
            read_only,
            target,
            json,
        } => {
            let request = api::filesystems::BindFilesystemRequest { read_only };
            let binding = target
                .client()?
                .bind_filesystem(&id, &org, &request)
                .await
                .context("filesystem bind failed")?;
            (binding, "bound to", json)
        }
        AdminFilesystemCommand::Unbind {
            id,
            org,
            target,
            json,
        } => {
            let binding = target
                .client()?
                .unbind_filesystem(&id, &org)
                .await
                .context("filesystem unbind failed")?;
            (binding, "unbound from", json)
        }
        AdminFilesystemCommand::List { target, json } => {
            let list = target
                .client()?
                .list_filesystem_bindings()
                .await
                .context("filesystem list failed")?;
            if json {
                print_record(&list)?;
            } else {
                let rows: Vec<Vec<String>> = list
                    .bindings
                    .iter()
                    .map(|b| {
                        vec![
                            b.filesystem.clone(),
                            b.org_name.clone(),
                            b.org_id.clone(),
                            if b.read_only { "ro" } else { "rw" }.to_owned(),
                            b.bound_at.clone(),
                        ]
                    })
                    .collect();
                print_table(&["FILESYSTEM", "ORG", "ORG ID", "MODE", "BOUND AT"], &rows);
            }
            return Ok(());
        }
    };
    if json {
        print_record(&binding)?;
    } else {
        println!(
            "filesystem {} {verb} org {} ({}{})",
            binding.filesystem,
            binding.org_name,
            binding.org_id,
            if binding.read_only { ", read-only" } else { "" }
        );
    }
    Ok(())
}

/// The metrics token in `path`: its first line, at least
/// [`METRICS_TOKEN_CHARS_MIN`] characters (a short one could be guessed).
fn read_metrics_token(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the metrics token file {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim();
    if token.chars().count() < METRICS_TOKEN_CHARS_MIN {
        anyhow::bail!(
            "the metrics token in {} is shorter than {METRICS_TOKEN_CHARS_MIN} characters (make one with `head -c 32 /dev/urandom | base64`)",
            path.display()
        );
    }
    Ok(token.to_owned())
}

const METRICS_TOKEN_CHARS_MIN: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metrics_token_is_a_files_first_line_long_enough_not_to_be_guessed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        std::fs::write(&path, format!("  {}  \nsecond line\n", "k".repeat(40))).expect("write");
        assert_eq!(read_metrics_token(&path).expect("a token"), "k".repeat(40));
        std::fs::write(&path, "short\n").expect("write");
        let refused = read_metrics_token(&path)
            .expect_err("too short")
            .to_string();
        assert!(refused.contains("shorter than 32"), "{refused}");
        let missing = read_metrics_token(&dir.path().join("none")).expect_err("no file");
        assert!(
            missing.to_string().contains("metrics token file"),
            "{missing}"
        );
    }
}
