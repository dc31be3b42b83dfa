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
    let mut execs = tokio::task::JoinSet::new();
    for id in &ids {
        let (client, id) = (client.clone(), id.clone());
        execs.spawn(async move { exec_true(&client, &id).await });
    }
    let mut exec_each = Vec::new();
    while let Some(joined) = execs.join_next().await {
        exec_each.push(joined??);
    }
    let all_executed = started.elapsed();
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
