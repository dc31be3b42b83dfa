//! `roost sandbox …`: create, inspect, list, stop, start and delete
//! sandboxes, and read their events, through the server's API with an org
//! token. Human output is aligned text; `--json` prints the API's records.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use api::client::{Client, ClientError, SandboxListQuery};
use api::lifecycle::SandboxState;
use api::sandboxes::{CreateSandboxRequest, Resources, Sandbox, SandboxList};
use api::snapshots::SalvageRequest;
use clap::{Args, Subcommand};
use tokio::time::Instant;

use crate::control::runtime;
use crate::output::{
    age, collect_pages, or_dash, print_fields, print_record, print_table, time_and_age,
};

/// The longest one long-poll may ask the server to wait (its maximum).
pub const LONG_POLL_SECONDS_MAX: u64 = 25;

/// Where the server is and who is asking (an org).
#[derive(Args)]
pub struct OrgServer {
    /// The server's URL [default: the one `roost up` saved, else
    /// http://127.0.0.1:7070].
    #[arg(long, env = "ROOST_URL")]
    url: Option<String>,
    /// An org token (`roost admin org create` prints it) [default: the one
    /// `roost up` saved, for its URL].
    #[arg(long, env = "ROOST_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl OrgServer {
    /// A client for the given URL and token, or those `roost up` saved.
    pub fn client(&self) -> Result<Client> {
        let target = crate::credentials::resolve(self.url.as_deref(), self.token.as_deref())?;
        Ok(Client::new(&target.url, &target.token))
    }
}

/// [`OrgServer`], and how to print.
#[derive(Args)]
pub struct OrgTarget {
    #[command(flatten)]
    server: OrgServer,
    /// Print the API's JSON record(s) on stdout instead of text; stderr
    /// then carries nothing but errors.
    #[arg(long)]
    pub json: bool,
}

impl OrgTarget {
    /// A client for the given URL and token, or those `roost up` saved.
    pub fn client(&self) -> Result<Client> {
        self.server.client()
    }
}

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox; prints its record (placed, usually not yet running).
    Create(Box<CreateArgs>),
    /// Show a sandbox's record, optionally waiting for a state.
    #[command(
        after_help = "With --wait-for, exits 1 when the sandbox did not reach the state (an end \
                      state made it unreachable, or --timeout passed); the record is printed \
                      either way."
    )]
    Get {
        /// The sandbox's id (`sbx_…`).
        id: String,
        /// Wait until the sandbox is in this state (or an end state makes it
        /// unreachable), e.g. `running` or `stopped`.
        #[arg(long, value_name = "STATE")]
        wait_for: Option<String>,
        /// Longest to wait with --wait-for (seconds, or e.g. `30s`, `5m`).
        #[arg(
            long,
            value_name = "DURATION",
            default_value = "60s",
            value_parser = parse_duration,
            requires = "wait_for"
        )]
        timeout: Duration,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// List the org's sandboxes, oldest first, in pages.
    List {
        /// Only sandboxes in this state (repeat for any of several):
        /// pending, starting, running, stopping, securing, stopped,
        /// recovering, failed, terminated, deleting, deleted.
        #[arg(long = "state", value_name = "STATE")]
        states: Vec<String>,
        /// Only sandboxes with this label (repeat: all must match).
        #[arg(long = "label", value_name = "K=V", value_parser = parse_pair)]
        labels: Vec<(String, String)>,
        /// Sandboxes per page (1 to 200; the server's default is 50).
        #[arg(long, value_name = "N")]
        limit: Option<u32>,
        /// Follow every page to the end instead of printing the first.
        #[arg(long)]
        all: bool,
        /// Also list deleted sandboxes (their records are kept for the
        /// deployment's retention); without --state they are left out.
        #[arg(long)]
        deleted: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Ask a sandbox to stop: its compute goes, its home stays.
    Stop {
        /// The sandbox's id.
        id: String,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Ask a stopped sandbox to run again (on the runner holding its home,
    /// for standard storage).
    Start {
        /// The sandbox's id.
        id: String,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Change a sandbox's idle policy (absent flags stay as they are).
    Set {
        /// The sandbox's id.
        id: String,
        /// Sleep after this long without activity (e.g. `15m`; `0`:
        /// never; within the deployment's bounds).
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        idle_timeout: Option<Duration>,
        /// Whether a command sent while it is stopped starts it.
        #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set)]
        auto_wake: Option<bool>,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Count as activity now: the running sandbox's idle deadline moves on
    /// (a stopped one is not woken: send a command or start it).
    Keepalive {
        /// The sandbox's id.
        id: String,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Delete a sandbox and release everything it holds.
    Delete {
        /// The sandbox's id.
        id: String,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Discard a kept copy of a sandbox's home (listed as `kept_copies` on
    /// its record): the runner holding it deletes it.
    DiscardKept {
        /// The sandbox's id.
        id: String,
        /// The kept copy's id (`kpt_…`).
        copy: String,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Salvage a kept copy of a sandbox's home into a snapshot (the runner
    /// holding it uploads it); prints the snapshot's receipt. Create a
    /// sandbox from it (`--from-snapshot`) to get the work back.
    #[command(
        after_help = "The snapshot is pending until the runner holding the copy has uploaded it, \
                      then replicated, or failed with a reason (the runner is gone, the upload \
                      failed). The copy stays until discarded or expired. With --wait, waits \
                      for the end and exits 1 if the snapshot failed."
    )]
    SalvageKept {
        /// The sandbox's id.
        id: String,
        /// The kept copy's id (`kpt_…`).
        copy: String,
        /// How long the upload may take (e.g. `10m`); past it the snapshot
        /// fails.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        deadline: Option<Duration>,
        /// Makes the request safe to retry: the same key returns the same
        /// snapshot.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
        /// Wait until the snapshot is replicated (or failed).
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Show a sandbox's state changes, oldest first.
    Events {
        /// The sandbox's id.
        id: String,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Wait until a sandbox is in STATE (or an end state makes it
    /// unreachable); prints the record, exits 1 if it is not in STATE.
    Wait {
        /// The sandbox's id.
        id: String,
        /// The state to wait for, e.g. `running` or `stopped`.
        state: String,
        /// Longest to wait (seconds, or e.g. `30s`, `5m`).
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
        timeout: Duration,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Run a command in a sandbox (the same as `roost exec`).
    Exec(crate::exec::ExecArgs),
}

#[derive(Args)]
#[command(
    after_help = "With --wait, exits 1 when the sandbox did not reach running (it ended, \
                  stopped, or --wait-timeout passed); the record is printed either way."
)]
pub struct CreateArgs {
    /// The image (`default`: the runner host's own system).
    #[arg(long, value_name = "NAME", default_value = "default")]
    image: String,
    /// `standard` keeps the home on its runner; `durable` saves it to the
    /// home store, so it survives the runner.
    #[arg(long, value_name = "CLASS", default_value = "standard", value_parser = ["standard", "durable"])]
    storage_class: String,
    /// Memory limit: a size such as `512MiB`, `2GiB`, `768M`, `1G`, or a
    /// number of MiB (server default 512 MiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_mib, conflicts_with = "memory_mib")]
    memory: Option<u64>,
    /// Memory limit in MiB (the same as --memory N).
    #[arg(long, value_name = "N")]
    memory_mib: Option<u64>,
    /// CPU limit, fractions allowed (server default 1).
    #[arg(long, value_name = "X")]
    cpus: Option<f64>,
    /// Process limit (server default 1024).
    #[arg(long, value_name = "N")]
    pids: Option<u64>,
    /// The most the home (/workspace) may hold, e.g. `10g`, `512m`, or a
    /// number of MiB: past it a write fails "Disk quota exceeded" inside
    /// the sandbox. Needs runners that bound homes (`home:bounded`).
    #[arg(long, value_name = "SIZE", value_parser = parse_mib)]
    home_max: Option<u64>,
    /// `none`: loopback only; `bridge`: outbound network.
    #[arg(long, value_name = "MODE", default_value = "none", value_parser = ["none", "bridge"])]
    network: String,
    /// How long the sandbox may live (e.g. `90m`, `2h`, `7d`); then it is
    /// terminated (`ttl_expired`) and its storage kept until delete.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    ttl: Option<Duration>,
    /// `spot_first`: spot runners, on-demand as fallback; `non_preemptible`:
    /// on-demand runners only.
    #[arg(long, value_name = "PLACEMENT", default_value = "spot_first", value_parser = ["spot_first", "non_preemptible"])]
    placement: String,
    /// An environment variable for the sandbox (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_pair)]
    env: Vec<(String, String)>,
    /// A label, for filtering lists (repeatable).
    #[arg(long = "label", value_name = "K=V", value_parser = parse_pair)]
    labels: Vec<(String, String)>,
    /// A shared filesystem's existing directory to mount (repeatable):
    /// `FILESYSTEM[:SUBPATH]=PATH[:ro]`, PATH being /workspace (the
    /// sandbox's own home then is /private) or below /mnt, e.g.
    /// `--mount team:checkouts/app=/workspace`, `--mount data=/mnt/data:ro`.
    #[arg(long = "mount", value_name = "FS[:SUB]=PATH[:ro]", value_parser = parse_mount)]
    mounts: Vec<api::sandboxes::Mount>,
    /// Deliver the org secret NAME as the environment variable VAR of
    /// every command (repeatable; `roost secret set NAME` first).
    #[arg(long = "secret-env", value_name = "NAME=VAR", value_parser = parse_pair)]
    secret_env: Vec<(String, String)>,
    /// Deliver the org secret NAME as the file /run/secrets/FILE (tmpfs,
    /// mode 0400; FILE defaults to NAME; repeatable).
    #[arg(long = "secret-file", value_name = "NAME[=FILE]")]
    secret_file: Vec<String>,
    /// How often a running durable home is saved (e.g. `60s`; within the
    /// deployment's bounds; default: the deployment's interval).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    save_interval: Option<Duration>,
    /// Start the home as a snapshot's files (`snp_…`, replicated).
    #[arg(long, value_name = "SNAPSHOT_ID")]
    from_snapshot: Option<String>,
    /// Sleep after this long without activity (e.g. `15m`; `0`: never;
    /// default: the deployment's, see `roost info`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    idle_timeout: Option<Duration>,
    /// Refuse commands while stopped instead of waking (409).
    #[arg(long)]
    no_auto_wake: bool,
    /// Makes the create safe to retry: the same key with the same request
    /// returns the sandbox the first one made, never a second sandbox.
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
    /// Wait until the sandbox runs (or ends), then print its record.
    #[arg(long)]
    wait: bool,
    /// Longest to wait with --wait.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_duration, requires = "wait")]
    wait_timeout: Duration,
    #[command(flatten)]
    target: OrgTarget,
}

/// Attempts at a read that failed transiently (server restarting, a
/// dropped connection), with pauses doubling from half a second (about
/// 15 s in all), so a long wait survives a blip but not an outage.
const READ_ATTEMPTS_MAX: u32 = 6;
const READ_PAUSE_MAX: Duration = Duration::from_secs(8);

/// Runs `read` (an idempotent request) again while it fails transiently.
pub async fn retrying<T, F, Fut>(mut read: F) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let mut pause = Duration::from_millis(500);
    let mut attempt = 1;
    loop {
        match read().await {
            Err(err) if err.is_transient() && attempt < READ_ATTEMPTS_MAX => {
                tracing::debug!(%err, attempt, "retrying a read");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(READ_PAUSE_MAX);
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// `KEY=VALUE`, split at the first `=` (the value may hold more).
/// `--secret-env NAME=VAR` and `--secret-file NAME[=FILE]` as the
/// request's `secrets`.
fn secrets_of(env: &[(String, String)], files: &[String]) -> Vec<api::sandboxes::Secret> {
    let as_env = env.iter().map(|(name, var)| api::sandboxes::Secret {
        name: name.clone(),
        env: Some(var.clone()),
        file: None,
    });
    let as_file = files.iter().map(|spec| {
        let (name, file) = spec.split_once('=').unwrap_or((spec, spec));
        api::sandboxes::Secret {
            name: name.to_owned(),
            env: None,
            file: Some(file.to_owned()),
        }
    });
    as_env.chain(as_file).collect()
}

pub fn parse_pair(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {text:?}")),
    }
}

/// `--mount FILESYSTEM[:SUBPATH]=PATH[:ro]`.
pub fn parse_mount(text: &str) -> Result<api::sandboxes::Mount, String> {
    let Some((source, path)) = text.split_once('=') else {
        return Err(format!(
            "expected FILESYSTEM[:SUBPATH]=PATH[:ro], got {text:?}"
        ));
    };
    let (filesystem, subpath) = source.split_once(':').unwrap_or((source, ""));
    let (path, read_only) = match path.strip_suffix(":ro") {
        Some(path) => (path, true),
        None => (path, false),
    };
    if filesystem.is_empty() || path.is_empty() {
        return Err(format!(
            "expected FILESYSTEM[:SUBPATH]=PATH[:ro], got {text:?}"
        ));
    }
    Ok(api::sandboxes::Mount {
        filesystem: filesystem.to_owned(),
        subpath: subpath.to_owned(),
        path: path.to_owned(),
        read_only,
    })
}

/// Every duration flag: a bare number is seconds (`90`), else a number
/// with a unit (`30s`, `5m`, `2h`, `7d`, `1500ms`, `1h 30m`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<u64>() {
        return Ok(Duration::from_secs(seconds));
    }
    humantime::parse_duration(text).map_err(|_| {
        format!("{text:?} is not a duration: give seconds (90) or a number with a unit (30s, 5m, 2h, 7d)")
    })
}

/// A memory size in MiB: `512MiB`, `2GiB`, `768M`, `1G`, `1048576KiB`, or
/// a plain number of MiB. Binary units either way (`M` = MiB), as memory
/// limits are.
pub fn parse_mib(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let not_a_size =
        || format!("{text:?} is not a size: use e.g. 768M, 1G, 512MiB, 2GiB or a number of MiB");
    let number: u64 = number.parse().map_err(|_| not_a_size())?;
    let kib_per_unit: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "m" | "mi" | "mib" | "mb" => 1024,
        "g" | "gi" | "gib" | "gb" => 1024 * 1024,
        "k" | "ki" | "kib" | "kb" => 1,
        _ => return Err(not_a_size()),
    };
    let kib = number
        .checked_mul(kib_per_unit)
        .ok_or_else(|| format!("{text:?} is too large"))?;
    if kib % 1024 != 0 || kib == 0 {
        return Err(format!("{text:?}: give a whole number of MiB, at least 1"));
    }
    Ok(kib / 1024)
}

/// Whole seconds, rounded up, so `--ttl 1500ms` is not sent as 1.
pub fn seconds_rounded_up(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

pub fn run(command: SandboxCommand) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        match command {
            SandboxCommand::Create(args) => create(*args).await,
            SandboxCommand::Get {
                id,
                wait_for,
                timeout,
                target,
            } => get("sandbox get", &id, wait_for.as_deref(), timeout, &target).await,
            SandboxCommand::List {
                mut states,
                labels,
                limit,
                all,
                deleted,
                target,
            } => {
                // What is gone is history: listed when asked for.
                if states.is_empty() && !deleted {
                    states = SandboxState::ALL
                        .iter()
                        .filter(|state| **state != SandboxState::Deleted)
                        .map(|state| state.as_str().to_owned())
                        .collect();
                }
                let query = SandboxListQuery {
                    states,
                    labels,
                    limit,
                    cursor: None,
                };
                list(query, all, &target).await
            }
            SandboxCommand::Set {
                id,
                idle_timeout,
                auto_wake,
                target,
            } => {
                let request = api::sandboxes::UpdateSandboxRequest {
                    idle_timeout_s: idle_timeout.map(seconds_rounded_up),
                    auto_wake,
                };
                let sandbox = target
                    .client()?
                    .update_sandbox(&id, &request)
                    .await
                    .context("sandbox set failed")?;
                print_sandbox(&sandbox, &target)?;
                Ok(ExitCode::SUCCESS)
            }
            SandboxCommand::Keepalive { id, target } => {
                let sandbox = target
                    .client()?
                    .keepalive(&id)
                    .await
                    .context("keepalive failed")?;
                if target.json {
                    print_record(&sandbox)?;
                } else {
                    println!(
                        "sandbox {} sleeps at {} unless active again",
                        sandbox.id,
                        sandbox.idle_deadline.as_deref().unwrap_or("- (never)")
                    );
                }
                Ok(ExitCode::SUCCESS)
            }
            SandboxCommand::Stop { id, target } => {
                let sandbox = target
                    .client()?
                    .stop_sandbox(&id)
                    .await
                    .context("sandbox stop failed")?;
                print_change(&sandbox, "stop requested", &target)
            }
            SandboxCommand::Start { id, target } => {
                let sandbox = target
                    .client()?
                    .start_sandbox(&id)
                    .await
                    .context("sandbox start failed")?;
                // Asked while a stop is under way, the start follows it.
                let what = if sandbox.desired == api::lifecycle::DesiredState::Stopped {
                    "start requested: it starts once the stop under way is done"
                } else {
                    "start requested"
                };
                print_change(&sandbox, what, &target)
            }
            SandboxCommand::Delete { id, target } => {
                let sandbox = target
                    .client()?
                    .delete_sandbox(&id)
                    .await
                    .context("sandbox delete failed")?;
                print_change(&sandbox, "delete requested", &target)
            }
            SandboxCommand::DiscardKept { id, copy, target } => {
                let sandbox = target
                    .client()?
                    .discard_kept_copy(&id, &copy)
                    .await
                    .context("discarding the kept copy failed")?;
                print_change(&sandbox, "kept copy discarded", &target)
            }
            SandboxCommand::SalvageKept {
                id,
                copy,
                deadline,
                idempotency_key,
                wait,
                target,
            } => {
                let client = target.client()?;
                let request = SalvageRequest {
                    deadline: deadline.map(|d| d.as_secs().max(1)),
                };
                let snapshot = client
                    .salvage_kept_copy(&id, &copy, &request, idempotency_key.as_deref())
                    .await
                    .context("salvaging the kept copy failed")?;
                if !wait {
                    crate::snapshot::print_snapshot(&snapshot, target.json)?;
                    return Ok(ExitCode::SUCCESS);
                }
                crate::snapshot::wait_for(&client, &snapshot.id, "replicated", &target).await
            }
            SandboxCommand::Events { id, target } => events(&id, &target).await,
            SandboxCommand::Wait {
                id,
                state,
                timeout,
                target,
            } => get("sandbox wait", &id, Some(&state), timeout, &target).await,
            SandboxCommand::Exec(args) => crate::exec::exec(args).await,
        }
    })
}

async fn create(args: CreateArgs) -> Result<ExitCode> {
    let request = CreateSandboxRequest {
        image: args.image,
        storage_class: args.storage_class,
        resources: Resources {
            memory_mib: args.memory.or(args.memory_mib),
            cpus: args.cpus,
            pids: args.pids,
            home_mib: args.home_max,
        },
        network: args.network,
        ttl: args.ttl.map(seconds_rounded_up),
        placement: args.placement,
        env: args.env.into_iter().collect::<BTreeMap<_, _>>(),
        labels: args.labels.into_iter().collect::<BTreeMap<_, _>>(),
        mounts: args.mounts,
        secrets: secrets_of(&args.secret_env, &args.secret_file),
        save_interval_s: args.save_interval.map(seconds_rounded_up),
        from_snapshot: args.from_snapshot,
        idle_timeout_s: args.idle_timeout.map(seconds_rounded_up),
        auto_wake: args.no_auto_wake.then_some(false),
    };
    let client = args.target.client()?;
    let created = client
        .create_sandbox(&request, args.idempotency_key.as_deref())
        .await
        .context("sandbox create failed")?;
    if !args.wait {
        print_sandbox(&created, &args.target)?;
        return Ok(ExitCode::SUCCESS);
    }
    let deadline = Instant::now() + args.wait_timeout;
    let record = wait_for_state(&client, &created.id, "running", deadline)
        .await
        .with_context(|| format!("sandbox create failed: waiting for {}", created.id))?;
    print_sandbox(&record, &args.target)?;
    Ok(reached(&record, "running", &args.target))
}

/// `sandbox get` and `sandbox wait` (`command` names it in errors).
async fn get(
    command: &str,
    id: &str,
    wait_for: Option<&str>,
    timeout: Duration,
    target: &OrgTarget,
) -> Result<ExitCode> {
    let client = target.client()?;
    let failed = || format!("{command} failed");
    let Some(state) = wait_for else {
        let sandbox = client.get_sandbox(id).await.with_context(failed)?;
        print_sandbox(&sandbox, target)?;
        return Ok(ExitCode::SUCCESS);
    };
    let deadline = Instant::now() + timeout;
    let record = wait_for_state(&client, id, state, deadline)
        .await
        .with_context(failed)?;
    print_sandbox(&record, target)?;
    Ok(reached(&record, state, target))
}

/// Success when the record is in `state`; otherwise one line on stderr
/// (not with `--json`, whose record says it) and exit status 1.
fn reached(record: &Sandbox, state: &str, target: &OrgTarget) -> ExitCode {
    if record.state.as_str() == state {
        return ExitCode::SUCCESS;
    }
    if !target.json {
        eprintln!(
            "roost: sandbox {} is {}, not {state}",
            record.id,
            state_with_reason(record.state.as_str(), record.state_reason.as_deref())
        );
    }
    ExitCode::FAILURE
}

/// Long-polls until the sandbox is in `state`, or nothing will move it
/// there any more, or `deadline` passes; returns the last record read.
async fn wait_for_state(
    client: &Client,
    id: &str,
    state: &str,
    deadline: Instant,
) -> Result<Sandbox, ClientError> {
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let timeout_s = seconds_rounded_up(remaining).min(LONG_POLL_SECONDS_MAX);
        let record = retrying(|| client.wait_sandbox(id, state, timeout_s)).await?;
        if settled(&record, state) || Instant::now() >= deadline {
            return Ok(record);
        }
    }
}

/// The sandbox is in `state` or will not reach it by itself: the server's
/// own wait rule. (A state the server does not know never gets here: the
/// long-poll refuses it.)
fn settled(record: &Sandbox, state: &str) -> bool {
    match state.parse::<SandboxState>() {
        Ok(target) => record.state.settles_wait_for(target, record.desired),
        Err(_) => record.state.is_terminal(),
    }
}

async fn list(query: SandboxListQuery, all: bool, target: &OrgTarget) -> Result<ExitCode> {
    let client = target.client()?;
    let (sandboxes, next_cursor) = collect_pages(all, |cursor| {
        let (client, mut query) = (&client, query.clone());
        async move {
            if cursor.is_some() {
                query.cursor = cursor;
            }
            let page = client
                .list_sandboxes(&query)
                .await
                .context("sandbox list failed")?;
            Ok((page.sandboxes, page.next_cursor))
        }
    })
    .await?;
    let listed = SandboxList {
        sandboxes,
        next_cursor,
    };
    if target.json {
        print_record(&listed)?;
        return Ok(ExitCode::SUCCESS);
    }
    if listed.sandboxes.is_empty() {
        println!("no sandboxes");
    } else {
        let rows: Vec<Vec<String>> = listed
            .sandboxes
            .iter()
            .map(|s| {
                vec![
                    s.id.clone(),
                    s.state.to_string(),
                    or_dash(s.state_reason.as_deref()),
                    s.desired.to_string(),
                    or_dash(s.runner_id.as_deref()),
                    s.epoch.to_string(),
                    age(&s.created_at),
                ]
            })
            .collect();
        print_table(
            &["ID", "STATE", "REASON", "DESIRED", "RUNNER", "EPOCH", "AGE"],
            &rows,
        );
    }
    if listed.next_cursor.is_some() {
        eprintln!("roost: more sandboxes than shown: add --all (or a larger --limit)");
    }
    Ok(ExitCode::SUCCESS)
}

async fn events(id: &str, target: &OrgTarget) -> Result<ExitCode> {
    let events = target
        .client()?
        .sandbox_events(id)
        .await
        .context("sandbox events failed")?;
    if target.json {
        print_record(&events)?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = events
        .events
        .iter()
        .map(|e| {
            vec![
                e.seq.to_string(),
                e.at.clone(),
                e.state.to_string(),
                or_dash(e.reason.as_deref()),
                e.epoch.to_string(),
                or_dash(e.runner_id.as_deref()),
                or_dash(e.message.as_deref()),
            ]
        })
        .collect();
    print_table(
        &["SEQ", "AT", "STATE", "REASON", "EPOCH", "RUNNER", "MESSAGE"],
        &rows,
    );
    Ok(ExitCode::SUCCESS)
}

/// After stop, start or delete: the record's desired and observed state.
fn print_change(sandbox: &Sandbox, what: &str, target: &OrgTarget) -> Result<ExitCode> {
    if target.json {
        print_record(sandbox)?;
    } else {
        println!(
            "sandbox {}: {what}; desired {}, state {}",
            sandbox.id,
            sandbox.desired,
            state_with_reason(sandbox.state.as_str(), sandbox.state_reason.as_deref())
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn state_with_reason(state: &str, reason: Option<&str>) -> String {
    match reason {
        Some(reason) => format!("{state} ({reason})"),
        None => state.to_owned(),
    }
}

fn print_sandbox(sandbox: &Sandbox, target: &OrgTarget) -> Result<()> {
    if target.json {
        return print_record(sandbox);
    }
    let resources = &sandbox.resources;
    let limit = |value: Option<String>, unit: &str| match value {
        Some(value) => format!("{value}{unit}"),
        None => format!("default{unit}"),
    };
    let pairs = |map: &BTreeMap<String, String>| {
        if map.is_empty() {
            "-".to_owned()
        } else {
            map.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    // Env values may be secrets: names only on screen (--json has all).
    let env_names = if sandbox.env.is_empty() {
        "-".to_owned()
    } else {
        sandbox.env.keys().cloned().collect::<Vec<_>>().join(", ")
    };
    // Durable homes: how fresh the last completed save is.
    let save = match &sandbox.save {
        None => "-".to_owned(),
        Some(save) => {
            let last = match &save.last_completed_at {
                Some(at) => format!("last {} ago", age(at)),
                None => "none yet".to_owned(),
            };
            let error = save
                .last_error
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default();
            format!("{}, {last}, every {}s{error}", save.state, save.interval_s)
        }
    };
    print_fields(&[
        ("id", sandbox.id.clone()),
        (
            "state",
            state_with_reason(sandbox.state.as_str(), sandbox.state_reason.as_deref()),
        ),
        ("message", or_dash(sandbox.state_message.as_deref())),
        ("desired", sandbox.desired.to_string()),
        ("runner", or_dash(sandbox.runner_id.as_deref())),
        ("epoch", sandbox.epoch.to_string()),
        ("image", sandbox.image.clone()),
        ("storage class", sandbox.storage_class.to_string()),
        ("save", save),
        (
            "safe until",
            match &sandbox.save {
                None => "-".to_owned(),
                Some(save) => match &save.safe_until {
                    Some(at) => at.clone(),
                    None => "- (no save completed yet)".to_owned(),
                },
            },
        ),
        (
            "at risk",
            match &sandbox.save {
                None => "-".to_owned(),
                Some(save) => format!(
                    "{} of work a host failure would lose now",
                    api::deployment::seconds_text(save.at_risk_s.round())
                ),
            },
        ),
        (
            "idle",
            // An ended sandbox never sleeps nor wakes again.
            if sandbox.state.is_terminal() {
                "-".to_owned()
            } else if sandbox.idle_timeout_s == 0 {
                "never sleeps".to_owned()
            } else {
                format!(
                    "sleeps after {} without activity{}",
                    api::deployment::seconds_text(sandbox.idle_timeout_s as f64),
                    match &sandbox.idle_deadline {
                        Some(at) => format!(" (at {at})"),
                        None => String::new(),
                    }
                )
            },
        ),
        (
            "last activity",
            match (&sandbox.last_activity, &sandbox.last_activity_at) {
                (Some(what), Some(at)) => format!("{what}, {}", time_and_age(Some(at))),
                _ => "-".to_owned(),
            },
        ),
        (
            "auto wake",
            if sandbox.auto_wake { "yes" } else { "no" }.to_owned(),
        ),
        ("from snapshot", or_dash(sandbox.from_snapshot.as_deref())),
        (
            "resources",
            format!(
                "{} memory, {} {}, {} pids{}",
                limit(resources.memory_mib.map(|m| m.to_string()), " MiB"),
                limit(resources.cpus.map(|c| c.to_string()), ""),
                if resources.cpus == Some(1.0) {
                    "cpu"
                } else {
                    "cpus"
                },
                limit(resources.pids.map(|p| p.to_string()), ""),
                resources
                    .home_mib
                    .map(|mib| format!(", home at most {mib} MiB"))
                    .unwrap_or_default(),
            ),
        ),
        ("network", sandbox.network.to_string()),
        ("placement", sandbox.placement.to_string()),
        ("labels", pairs(&sandbox.labels)),
        ("env", env_names),
        (
            "quarantined",
            if sandbox.quarantined { "yes" } else { "no" }.to_owned(),
        ),
        ("created", time_and_age(Some(&sandbox.created_at))),
        ("updated", time_and_age(Some(&sandbox.updated_at))),
        ("expires", or_dash(sandbox.expires_at.as_deref())),
        ("ended", time_and_age(sandbox.ended_at.as_deref())),
    ]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_split_at_the_first_equals_sign() {
        assert_eq!(parse_pair("A=1"), Ok(("A".to_owned(), "1".to_owned())));
        assert_eq!(parse_pair("A=b=c"), Ok(("A".to_owned(), "b=c".to_owned())));
        assert_eq!(parse_pair("A="), Ok(("A".to_owned(), String::new())));
        assert!(parse_pair("A").is_err());
        assert!(parse_pair("=1").is_err());
    }

    #[test]
    fn memory_sizes_are_mib() {
        assert_eq!(parse_mib("512"), Ok(512));
        assert_eq!(parse_mib("512MiB"), Ok(512));
        assert_eq!(parse_mib("2GiB"), Ok(2048));
        assert_eq!(parse_mib("1G"), Ok(1024));
        assert_eq!(parse_mib("2048KiB"), Ok(2));
        assert!(parse_mib("1000KiB").is_err());
        assert!(parse_mib("0").is_err());
        assert!(parse_mib("lots").is_err());
        assert!(parse_mib("3TB").is_err());
    }

    #[test]
    fn memory_sizes_that_do_not_parse_list_the_forms_that_do() {
        for bad in ["12XB", "lots", "3TB"] {
            let err = parse_mib(bad).expect_err(bad);
            assert!(
                ["768M", "1G", "512MiB", "2GiB"]
                    .iter()
                    .all(|form| err.contains(form)),
                "{err}"
            );
        }
    }

    #[test]
    fn durations_are_seconds_or_carry_a_unit() {
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        let err = parse_duration("forever").expect_err("not a duration");
        assert!(err.contains("\"forever\"") && err.contains("30s"), "{err}");
    }

    #[test]
    fn durations_are_sent_as_whole_seconds_rounded_up() {
        assert_eq!(seconds_rounded_up(Duration::from_secs(7200)), 7200);
        assert_eq!(seconds_rounded_up(Duration::from_millis(1500)), 2);
        assert_eq!(seconds_rounded_up(Duration::ZERO), 0);
    }
}
