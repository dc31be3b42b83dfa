//! Latency benchmark of a warm runner; `bench/runner/run.sh` drives it
//! against a real `roost server` and `roost runner`.
//!
//! Prints one JSON object on stdout (progress on stderr) with, in ms:
//!
//! - `create_to_running`: `POST /v1/sandboxes` until the long-poll
//!   `GET …?wait_for=running` answers `running`, one sandbox at a time
//!   (each deleted, untimed, before the next);
//! - `exec_true`: `POST …/commands {"argv":["true"]}` until the long-poll
//!   `GET …?wait_for=ended` answers `exited` 0, one at a time, in one
//!   running sandbox;
//! - `at_once`: N sandboxes created at the same moment: each one's create →
//!   running, and the time until all run; then one `true` in each, at once;
//! - `first_byte`: `POST …/commands {"argv":["echo","hi"]}`, then a
//!   WebSocket attach (`GET …/attach`), until its first output byte
//!   arrives, one at a time;
//! - `idle_agent_rss_kib`: the resident memory of an idle sandbox's init
//!   (its agent), from `/proc/PID/status`;
//! - `peer`: the same container config run by `runc` directly, each
//!   measurement right after roost's: `runc create` + `runc start` (the
//!   floor under create → running), `runc exec ID true` (the floor under an
//!   exec round trip), and N containers created and started at once.
//!
//! `cargo run --release -p cli --example runner_bench -- --help`

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use api::client::Client;
use api::commands::CreateCommandRequest;
use api::lifecycle::{CommandState, SandboxState};
use api::sandboxes::{CreateSandboxRequest, Resources};
use clap::Parser;
use serde_json::{Value, json};

#[derive(Parser)]
#[command(name = "runner_bench", about = "Latency of a warm roost runner")]
struct Args {
    #[arg(long)]
    url: String,
    /// An org token.
    #[arg(long)]
    token: String,
    /// The runner's data dir (to copy a sandbox's OCI bundle for the peer).
    #[arg(long)]
    runner_data_dir: PathBuf,
    /// Sandboxes created one at a time.
    #[arg(long, default_value_t = 50)]
    sandboxes: usize,
    /// `true` commands run one at a time.
    #[arg(long, default_value_t = 100)]
    execs: usize,
    /// Sandboxes created at once.
    #[arg(long, default_value_t = 20)]
    at_once: usize,
    /// Unmeasured rounds first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Rounds of one `true` in each of the `at_once` sandboxes at once,
    /// after the first (which is each sandbox's first command).
    #[arg(long, default_value_t = 10)]
    at_once_rounds: usize,
    /// `true` commands one at a time after the rounds at once, to measure
    /// the CPU one costs.
    #[arg(long, default_value_t = 100)]
    alone_execs: usize,
    /// The server's pid, to split the machine's CPU per command by process.
    #[arg(long)]
    server_pid: Option<u32>,
    /// The runner's pid (as `--server-pid`).
    #[arg(long)]
    runner_pid: Option<u32>,
}

/// CPU time `pid` has used so far, in ms: its own (utime, stime) and that
/// of its children it has reaped (cutime, cstime): for a sandbox's init,
/// the commands it forked.
fn process_cpu_ms(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The fields after the command name, which is in parentheses and may
    // hold spaces: state is field 3, utime..cstime fields 14..17.
    let after_name = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("an unreadable /proc/PID/stat")?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    ensure!(fields.len() > 14, "a short /proc/{pid}/stat");
    let ticks: u64 = fields[11..15]
        .iter()
        .map(|field| field.parse::<u64>().unwrap_or(0))
        .sum();
    Ok(ticks as f64 * 10.0)
}

/// CPU used so far by the parts of one round trip: the server, the runner,
/// the sandboxes' inits with the commands they reaped, this client; and
/// the machine as a whole.
fn cpu_by_part(server: Option<u32>, runner: Option<u32>, inits: &[u32]) -> Result<[f64; 5]> {
    let of = |pid: Option<u32>| {
        pid.map(process_cpu_ms)
            .transpose()
            .map(Option::unwrap_or_default)
    };
    let mut sandboxes = 0.0;
    for &pid in inits {
        sandboxes += process_cpu_ms(pid)?;
    }
    Ok([
        of(server)?,
        of(runner)?,
        sandboxes,
        process_cpu_ms(std::process::id())?,
        machine_busy_ms()?,
    ])
}

/// CPU ms per command by part between two [`cpu_by_part`] readings, to
/// two decimals.
fn cpu_per_command(before: [f64; 5], after: [f64; 5], commands: usize) -> serde_json::Value {
    let per = |i: usize| ((after[i] - before[i]) / commands.max(1) as f64 * 100.0).round() / 100.0;
    json!({
        "server": per(0),
        "runner": per(1),
        "sandboxes_inits_and_commands": per(2),
        "bench_client": per(3),
        "machine": per(4),
    })
}

/// One `true` in each sandbox, all at once: each round trip.
async fn exec_true_in_each(client: &Client, ids: &[String]) -> Result<Vec<Duration>> {
    let mut execs = tokio::task::JoinSet::new();
    for id in ids {
        let (client, id) = (client.clone(), id.clone());
        execs.spawn(async move { exec_true(&client, &id).await });
    }
    let mut each = Vec::new();
    while let Some(joined) = execs.join_next().await {
        each.push(joined??);
    }
    Ok(each)
}

/// The pid of a running sandbox's init, from its bundle.
fn sandbox_init_pid(runner_data_dir: &Path, sandbox_id: &str) -> Result<u32> {
    let path = runner_data_dir
        .join("sandboxes")
        .join(sandbox_id)
        .join("bundle/init.pid");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.trim()
        .parse()
        .with_context(|| format!("an unreadable pid in {}", path.display()))
}

/// CPU time the whole machine has spent busy so far (every process: the
/// server, the runner, the sandboxes' inits, this client), in ms, from the
/// first line of `/proc/stat` (user, nice, system, irq, softirq, steal).
fn machine_busy_ms() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let cpu = stat.lines().next().context("an empty /proc/stat")?;
    let fields: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .map(|field| field.parse().unwrap_or(0))
        .collect();
    ensure!(fields.len() >= 8, "a short cpu line in /proc/stat: {cpu}");
    let busy: u64 = [0, 1, 2, 5, 6, 7].iter().map(|&i| fields[i]).sum();
    // USER_HZ is 100 on every Linux ABI the runner supports.
    Ok(busy as f64 * 10.0)
}

/// The server's default sandbox (512 MiB, 1 CPU, 1024 pids). Not a small
/// CPU share: `runc create` and `runc exec` run their own Go helper inside
/// the sandbox's cgroup, so a 0.1-CPU quota would measure CFS throttling.
fn request() -> CreateSandboxRequest {
    CreateSandboxRequest {
        image: "default".to_owned(),
        storage_class: "standard".to_owned(),
        resources: Resources::default(),
        network: "none".to_owned(),
        placement: "spot_first".to_owned(),
        ..CreateSandboxRequest::default()
    }
}

/// p50, p99, min, max in ms of `samples`.
fn summary(samples: &[Duration]) -> Value {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if ms.is_empty() {
            return 0.0;
        }
        let rank = ((q * ms.len() as f64).ceil() as usize).clamp(1, ms.len());
        (ms[rank - 1] * 10.0).round() / 10.0
    };
    json!({
        "n": ms.len(),
        "p50": at(0.50),
        "p99": at(0.99),
        "min": at(0.0),
        "max": at(1.0),
    })
}

async fn create_running(client: &Client) -> Result<(String, Duration)> {
    let started = Instant::now();
    let created = client.create_sandbox(&request(), None).await?;
    let mut sandbox = created;
    while sandbox.state != SandboxState::Running {
        ensure!(
            !(sandbox.state.is_terminal() || sandbox.state == SandboxState::Stopped),
            "sandbox {} ended {} ({:?})",
            sandbox.id,
            sandbox.state,
            sandbox.state_reason
        );
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "sandbox {} not running after 60 s",
            sandbox.id
        );
        sandbox = client.wait_sandbox(&sandbox.id, "running", 25).await?;
    }
    Ok((sandbox.id, started.elapsed()))
}

async fn delete(client: &Client, id: &str) -> Result<()> {
    client.delete_sandbox(id).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sandbox = client.wait_sandbox(id, "deleted", 25).await?;
        if sandbox.state == SandboxState::Deleted {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "sandbox {id} not deleted");
    }
}

async fn exec_true(client: &Client, sandbox_id: &str) -> Result<Duration> {
    let started = Instant::now();
    let request = CreateCommandRequest {
        argv: vec!["true".to_owned()],
        ..CreateCommandRequest::default()
    };
    let mut command = client.create_command(sandbox_id, &request, None).await?;
    while command.ended_at.is_none() {
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "command {} has not ended",
            command.id
        );
        command = client
            .wait_command(sandbox_id, &command.id, "ended", 25)
            .await?;
    }
    ensure!(
        command.state == CommandState::Exited && command.exit_code == Some(0),
        "`true` ended {} ({:?})",
        command.state,
        command.exit_code
    );
    Ok(started.elapsed())
}

/// `echo hi` created, then attached over a WebSocket: until the first
/// output byte arrives.
async fn first_byte(client: &Client, url: &str, token: &str, sandbox_id: &str) -> Result<Duration> {
    use futures::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let started = Instant::now();
    let request = CreateCommandRequest {
        argv: vec!["echo".to_owned(), "hi".to_owned()],
        ..CreateCommandRequest::default()
    };
    let command = client.create_command(sandbox_id, &request, None).await?;
    let ws = format!(
        "{}/v1/sandboxes/{sandbox_id}/commands/{}/attach",
        url.replacen("http://", "ws://", 1),
        command.id
    );
    let mut upgrade = ws.into_client_request()?;
    upgrade
        .headers_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let (mut socket, _) = tokio_tungstenite::connect_async(upgrade).await?;
    loop {
        match socket.next().await {
            Some(Ok(Message::Binary(bytes))) if !bytes.is_empty() => return Ok(started.elapsed()),
            Some(Ok(_)) => {}
            other => bail!("the attach ended before any output: {other:?}"),
        }
    }
}

fn runc(root: &Path, args: &[&str]) -> Result<()> {
    let status = Command::new("runc")
        .arg(format!("--root={}", root.display()))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("running runc")?;
    ensure!(status.success(), "runc {args:?} failed: {status}");
    Ok(())
}

/// runc alone on a copy of a roost sandbox's bundle (the same config.json,
/// its own root directory, workspace and cgroup per container).
struct Peer {
    scratch: tempfile::TempDir,
    root: PathBuf,
    config: Value,
    next: usize,
}

impl Peer {
    fn prepare(sandbox_dir: &Path) -> Result<Peer> {
        let scratch = tempfile::Builder::new()
            .prefix("roost-runner-bench-peer-")
            .tempdir()?;
        let root = scratch.path().join("state");
        let config_text = std::fs::read_to_string(sandbox_dir.join("bundle/config.json"))
            .context("reading the sandbox's config.json")?;
        let mut config: Value = serde_json::from_str(&config_text)?;
        let rootfs = scratch.path().join("rootfs");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(sandbox_dir.join("rootfs"))
            .arg(&rootfs)
            .status()?;
        ensure!(copied.success(), "copying the rootfs");
        let workspace = scratch.path().join("workspace");
        std::fs::create_dir(&workspace)?;
        config["root"]["path"] = json!(rootfs);
        if let Some(mounts) = config["mounts"].as_array_mut() {
            for mount in mounts.iter_mut() {
                if mount["destination"] == "/workspace" {
                    mount["source"] = json!(workspace);
                }
            }
            // runc alone has no runner renewing a lease: no lease mount (its
            // source is the sandbox's, gone once that sandbox is deleted).
            mounts.retain(|mount| mount["destination"] != "/.roost/lease");
        }
        // ...and no lease for its init to watch (it would stop the peer's
        // processes once the copied deadline passed).
        // ...and no agent (runc alone passes it no socket; `runc exec` is
        // what the peer measures).
        if let Some(args) = config["process"]["args"].as_array_mut() {
            for flag in ["--lease-dir", "--agent-fd"] {
                if let Some(at) = args.iter().position(|arg| arg == flag) {
                    args.drain(at..(at + 2).min(args.len()));
                }
            }
        }
        Ok(Peer {
            scratch,
            root,
            config,
            next: 0,
        })
    }

    /// Writes a bundle for a new container; returns its id.
    fn bundle(&mut self) -> Result<(String, String)> {
        self.next += 1;
        let id = format!("peer-{}-{}", std::process::id(), self.next);
        let bundle = self.scratch.path().join(&id);
        std::fs::create_dir(&bundle)?;
        let mut config = self.config.clone();
        config["linux"]["cgroupsPath"] = json!(format!("/roost-bench/{id}"));
        std::fs::write(bundle.join("config.json"), serde_json::to_vec(&config)?)?;
        Ok((id, format!("--bundle={}", bundle.display())))
    }

    /// `runc create` + `runc start` of a fresh container, timed.
    fn create_start(&mut self) -> Result<(String, Duration)> {
        let (id, bundle) = self.bundle()?;
        let started = Instant::now();
        runc(&self.root, &["create", &bundle, &id])?;
        runc(&self.root, &["start", &id])?;
        Ok((id, started.elapsed()))
    }

    fn exec_true(&self, id: &str) -> Result<Duration> {
        let started = Instant::now();
        runc(&self.root, &["exec", id, "true"])?;
        Ok(started.elapsed())
    }

    fn delete(&self, id: &str) -> Result<()> {
        runc(&self.root, &["delete", "--force", id])
    }

    /// `count` containers created and started at once (one thread each):
    /// the time until all run.
    fn at_once(&mut self, count: usize) -> Result<Duration> {
        let bundles = (0..count)
            .map(|_| self.bundle())
            .collect::<Result<Vec<_>>>()?;
        let root = self.root.clone();
        let started = Instant::now();
        std::thread::scope(|scope| {
            let handles: Vec<_> = bundles
                .iter()
                .map(|(id, bundle)| {
                    let root = &root;
                    scope.spawn(move || {
                        runc(root, &["create", bundle, id])?;
                        runc(root, &["start", id])
                    })
                })
                .collect();
            for handle in handles {
                handle
                    .join()
                    .map_err(|_| anyhow::anyhow!("a runc thread panicked"))??;
            }
            Ok::<(), anyhow::Error>(())
        })?;
        let took = started.elapsed();
        for (id, _) in &bundles {
            self.delete(id)?;
        }
        Ok(took)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let client = std::sync::Arc::new(Client::new(&args.url, &args.token));

    eprintln!("warming up ({} sandboxes)", args.warmup);
    for _ in 0..args.warmup {
        let (id, _) = create_running(&client).await?;
        delete(&client, &id).await?;
    }
    // A running sandbox for the execs, and its bundle for the peer.
    let (exec_sandbox, _) = create_running(&client).await?;
    let sandbox_dir = args.runner_data_dir.join("sandboxes").join(&exec_sandbox);
    if !sandbox_dir.join("bundle/config.json").is_file() {
        bail!("no bundle at {}", sandbox_dir.display());
    }
    let mut peer = Peer::prepare(&sandbox_dir)?;

    // Each roost measurement is followed by its peer's, so both see the
    // same moment of a noisy machine.
    eprintln!(
        "create → running, {} one at a time (and runc alone)",
        args.sandboxes
    );
    let mut create = Vec::new();
    let mut peer_create = Vec::new();
    for _ in 0..args.sandboxes {
        let (id, took) = create_running(&client).await?;
        create.push(took);
        delete(&client, &id).await?;
        let (id, took) = peer.create_start()?;
        peer_create.push(took);
        peer.delete(&id)?;
    }

    eprintln!("exec `true`, {} one at a time (and runc exec)", args.execs);
    let (peer_exec_id, _) = peer.create_start()?;
    for _ in 0..args.warmup {
        exec_true(&client, &exec_sandbox).await?;
        peer.exec_true(&peer_exec_id)?;
    }
    let mut exec = Vec::new();
    let mut peer_exec = Vec::new();
    for _ in 0..args.execs {
        exec.push(exec_true(&client, &exec_sandbox).await?);
        peer_exec.push(peer.exec_true(&peer_exec_id)?);
    }
    peer.delete(&peer_exec_id)?;

    eprintln!(
        "first output byte over an attach, {} one at a time",
        args.execs
    );
    let mut first_bytes = Vec::new();
    for _ in 0..args.execs {
        first_bytes.push(first_byte(&client, &args.url, &args.token, &exec_sandbox).await?);
    }
    let init_pid = std::fs::read_to_string(sandbox_dir.join("bundle/init.pid"))
        .context("the sandbox's init.pid")?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", init_pid.trim()))
        .context("the init's /proc status")?;
    let rollup = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", init_pid.trim()))
        .context("the init's smaps_rollup")?;
    let kib = |text: &str, field: &str| -> Option<u64> {
        text.lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
    };
    let idle_agent_rss_kib = kib(&status, "VmRSS:").context("VmRSS of the init")?;
    // What one more sandbox costs: its own pages (anonymous), and its
    // share of the binary's pages that every init maps (Pss).
    let idle_agent_anon_kib = kib(&status, "RssAnon:").context("RssAnon of the init")?;
    let idle_agent_pss_kib = kib(&rollup, "Pss:").context("Pss of the init")?;
    delete(&client, &exec_sandbox).await?;

    eprintln!("{} sandboxes at once (and runc alone)", args.at_once);
    let started = Instant::now();
    let mut creates = tokio::task::JoinSet::new();
    for _ in 0..args.at_once {
        let client = client.clone();
        creates.spawn(async move { create_running(&client).await });
    }
    let mut ids = Vec::new();
    let mut each = Vec::new();
    while let Some(joined) = creates.join_next().await {
        let (id, took) = joined??;
        ids.push(id);
        each.push(took);
    }
    let all_running = started.elapsed();
    let started = Instant::now();
    let exec_each = exec_true_in_each(&client, &ids).await?;
    let all_executed = started.elapsed();
    // The first round above is each sandbox's first command; these are
    // what an agent harness driving many warm sandboxes sees.
    eprintln!(
        "{} more rounds of one `true` in each of the {} at once",
        args.at_once_rounds, args.at_once
    );
    let mut warm_each = Vec::new();
    let mut warm_round_p50 = Vec::new();
    let mut warm_all_executed = Vec::new();
    let inits = ids
        .iter()
        .map(|id| sandbox_init_pid(&args.runner_data_dir, id))
        .collect::<Result<Vec<_>>>()?;
    let cpu_before = cpu_by_part(args.server_pid, args.runner_pid, &inits)?;
    for _ in 0..args.at_once_rounds {
        let started = Instant::now();
        let round = exec_true_in_each(&client, &ids).await?;
        warm_all_executed.push(started.elapsed());
        warm_round_p50.push(summary(&round)["p50"].clone());
        warm_each.extend(round);
    }
    let cpu_after = cpu_by_part(args.server_pid, args.runner_pid, &inits)?;
    let cpu_split = cpu_per_command(cpu_before, cpu_after, args.at_once_rounds * ids.len());
    // The same CPU per command one at a time, in a warm sandbox.
    let alone_count = args.alone_execs.max(1);
    eprintln!("{alone_count} more `true` one at a time, for their CPU");
    let cpu_before = cpu_by_part(args.server_pid, args.runner_pid, &inits[..1])?;
    for _ in 0..alone_count {
        exec_true(&client, &ids[0]).await?;
    }
    let cpu_after = cpu_by_part(args.server_pid, args.runner_pid, &inits[..1])?;
    let alone_cpu_split = cpu_per_command(cpu_before, cpu_after, alone_count);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    for id in &ids {
        delete(&client, id).await?;
    }
    let peer_at_once = peer.at_once(args.at_once)?;

    let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
    let report = json!({
        "create_to_running": summary(&create),
        "exec_true": summary(&exec),
        "first_byte": summary(&first_bytes),
        "idle_agent_rss_kib": idle_agent_rss_kib,
        "idle_agent_anon_kib": idle_agent_anon_kib,
        "idle_agent_pss_kib": idle_agent_pss_kib,
        "at_once": {
            "sandboxes": args.at_once,
            "all_running_ms": ms(all_running),
            "create_to_running": summary(&each),
            "all_executed_ms": ms(all_executed),
            "exec_true": summary(&exec_each),
            "warm_rounds": args.at_once_rounds,
            "warm_exec_true": summary(&warm_each),
            "warm_round_p50s": warm_round_p50,
            "warm_all_executed": summary(&warm_all_executed),
            "warm_machine_cpu_ms_per_command": cpu_split["machine"],
            "alone_machine_cpu_ms_per_command": alone_cpu_split["machine"],
            "warm_cpu_ms_per_command_by_part": cpu_split,
            "alone_cpu_ms_per_command_by_part": alone_cpu_split,
            "loadavg": load.trim(),
        },
        "peer": {
            "runc_create_start": summary(&peer_create),
            "runc_exec_true": summary(&peer_exec),
            "runc_at_once_all_running_ms": ms(peer_at_once),
        },
    });
    println!("{report:#}");
    Ok(())
}
