//! Fleet simulator for `roost server` (issue 21); `bench/fleet/run.sh`
//! drives it. A load generator, not a toy control plane: it speaks the
//! real protocol to real servers.
//!
//! - Runners (protocol only, no containers): each registers (all at once,
//!   a burst), heartbeats every `--heartbeat-ms`, long-polls its
//!   assignments, and reports what a real runner would observe: `starting`
//!   wanted running → `running`; wanted stopped or terminated → that;
//!   wanted deleted → `deleted`. A runner whose server stops answering
//!   moves to the next URL, as a runner behind a load balancer would.
//! - API clients: create a sandbox, read it, long-poll it to `running`,
//!   delete it, again, for the run's length.
//! - One runner (`--lose-at-s`) stops heartbeating mid-run: the time from
//!   its last answered heartbeat until a server says it is lost.
//!
//! Prints one JSON object on stdout (latencies in ms); progress on stderr.
//! `cargo run --release -p cli --example fleet -- --help`

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use api::client::{Client, ClientError};
use api::lifecycle::{DesiredState, SandboxState};
use api::runners::{Capacity, HeartbeatRequest, RegisterRequest, SandboxReport};
use clap::Parser;
use serde_json::json;

#[derive(Parser)]
#[command(name = "fleet", about = "Fleet simulator for roost server")]
struct Args {
    /// The servers, comma separated; runner i starts on server i % n.
    #[arg(long, value_delimiter = ',')]
    urls: Vec<String>,
    #[arg(long)]
    admin_token: String,
    #[arg(long, default_value_t = 1000)]
    runners: usize,
    /// Sandboxes each runner takes.
    #[arg(long, default_value_t = 16)]
    capacity: u64,
    /// Registrations in flight at once (the burst).
    #[arg(long, default_value_t = 1000)]
    register_concurrency: usize,
    #[arg(long, default_value_t = 3000)]
    heartbeat_ms: u64,
    /// How long each assignments long-poll waits for a change (a real
    /// runner's wait; the server allows at most 25).
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u64).range(0..=25))]
    assignments_wait_s: u64,
    /// Seconds of steady load after every runner registered.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// API clients, each looping create → read → wait running → delete.
    #[arg(long, default_value_t = 8)]
    api_clients: usize,
    /// When (seconds into the steady load) one runner goes silent; 0: never.
    #[arg(long, default_value_t = 20)]
    lose_at_s: u64,
    /// The org's name (unique per database).
    #[arg(long, default_value = "fleet")]
    org: String,
}

/// Latencies (µs) and errors by kind.
#[derive(Default)]
struct Stats {
    latencies: Mutex<BTreeMap<&'static str, Vec<u64>>>,
    /// Heartbeat latencies by the 10 s window of the run they were sent
    /// in: whether a tail is the start's storm or the steady state's.
    heartbeat_windows: Mutex<BTreeMap<u64, Vec<u64>>>,
    /// By second of the run: heartbeat latencies (by when sent) and
    /// assignment long-polls answered (by when answered), to line a
    /// heartbeat tail up with what else arrived at once.
    seconds: Mutex<BTreeMap<u64, (Vec<u64>, u64)>>,
    errors: Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    fn record(&self, kind: &'static str, started: Instant) {
        let us = started.elapsed().as_micros() as u64;
        let mut latencies = self.latencies.lock().unwrap_or_else(|p| p.into_inner());
        latencies.entry(kind).or_default().push(us);
    }

    fn record_heartbeat(&self, run_started: Instant, sent: Instant) {
        let us = sent.elapsed().as_micros() as u64;
        let window = sent.saturating_duration_since(run_started).as_secs() / 10 * 10;
        self.record("heartbeat", sent);
        let mut windows = self
            .heartbeat_windows
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        windows.entry(window).or_default().push(us);
        drop(windows);
        let second = sent.saturating_duration_since(run_started).as_secs();
        let mut seconds = self.seconds.lock().unwrap_or_else(|p| p.into_inner());
        seconds.entry(second).or_default().0.push(us);
    }

    fn record_poll_answered(&self, run_started: Instant) {
        let second = run_started.elapsed().as_secs();
        let mut seconds = self.seconds.lock().unwrap_or_else(|p| p.into_inner());
        seconds.entry(second).or_default().1 += 1;
    }

    fn error(&self, kind: &str, err: &dyn std::fmt::Display) {
        // Grouped by what went wrong: without the request id or the URL.
        let mut text = err.to_string();
        if let Some(at) = text.find(" (request ") {
            text.truncate(at);
        }
        if let Some(at) = text.find(" at http") {
            text.truncate(at);
        }
        text.truncate(80);
        let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        *errors.entry(format!("{kind}: {text}")).or_default() += 1;
    }

    fn summary(&self, seconds: f64) -> serde_json::Value {
        let latencies = self.latencies.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = serde_json::Map::new();
        for (kind, values) in latencies.iter() {
            let mut sorted = values.clone();
            sorted.sort_unstable();
            let at = |q: f64| quantile_ms(&sorted, q);
            out.insert(
                (*kind).to_owned(),
                json!({
                    "count": sorted.len(),
                    "per_s": sorted.len() as f64 / seconds,
                    "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0),
                }),
            );
        }
        let windows: Vec<serde_json::Value> = self
            .heartbeat_windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(from_s, values)| {
                let mut sorted = values.clone();
                sorted.sort_unstable();
                let at = |q: f64| quantile_ms(&sorted, q);
                json!({"from_s": from_s, "count": sorted.len(), "p50_ms": at(0.5), "p99_ms": at(0.99)})
            })
            .collect();
        out.insert("heartbeat_windows".to_owned(), json!(windows));
        let by_second: Vec<serde_json::Value> = self
            .seconds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(second, (values, polls))| {
                let mut sorted = values.clone();
                sorted.sort_unstable();
                json!({"s": second, "heartbeats": sorted.len(),
                       "p99_ms": quantile_ms(&sorted, 0.99), "max_ms": quantile_ms(&sorted, 1.0),
                       "polls_answered": polls})
            })
            .collect();
        out.insert("by_second".to_owned(), json!(by_second));
        // The steady state: every heartbeat but the first window's (the
        // start's storm of first reads and heartbeats).
        let mut steady: Vec<u64> = self
            .heartbeat_windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .range(10..)
            .flat_map(|(_, values)| values.iter().copied())
            .collect();
        steady.sort_unstable();
        out.insert(
            "heartbeat_after_10s".to_owned(),
            json!({"count": steady.len(), "p50_ms": quantile_ms(&steady, 0.5), "p99_ms": quantile_ms(&steady, 0.99)}),
        );
        let errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        out.insert("errors".to_owned(), json!(*errors));
        serde_json::Value::Object(out)
    }
}

/// The `q` quantile of sorted microseconds, in milliseconds.
fn quantile_ms(sorted: &[u64], q: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
        .map_or(0.0, |&us| us as f64 / 1000.0)
}

/// One simulated runner's connection to the servers.
struct Sim {
    clients: Vec<Client>,
    at: AtomicUsize,
}

impl Sim {
    fn client(&self) -> Client {
        self.clients[self.at.load(Ordering::Relaxed) % self.clients.len()].clone()
    }

    /// The server did not answer: the next one (a load balancer's move).
    fn fail_over(&self, err: &ClientError) {
        if err.code().is_none() {
            self.at.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(run(args))?;
    println!("{result}");
    // Long-polls still open are simply dropped.
    runtime.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}

async fn run(args: Args) -> Result<serde_json::Value> {
    let admin = Client::new(&args.urls[0], &args.admin_token);
    let org = admin
        .create_org(&api::orgs::CreateOrgRequest {
            name: args.org.clone(),
            max_running: None,
            max_total: None,
            max_store_mib: None,
        })
        .await
        .context("create the org")?;
    let runner_token = admin.create_runner_token(&Default::default()).await?.token;
    // One connection pool per server, shared by every simulated runner.
    let bases: Vec<Client> = args
        .urls
        .iter()
        .map(|url| Client::new(url, &runner_token))
        .collect();
    let stats = Arc::new(Stats::default());

    // The burst: every runner registers at once (up to the concurrency).
    eprintln!("registering {} runners", args.runners);
    let started = Instant::now();
    let gate = Arc::new(tokio::sync::Semaphore::new(args.register_concurrency));
    let mut registering = Vec::new();
    for i in 0..args.runners {
        let (gate, stats) = (gate.clone(), stats.clone());
        let base = bases[i % bases.len()].clone();
        let capacity = args.capacity;
        registering.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await.ok()?;
            let request = RegisterRequest {
                runner_id: None,
                name: format!("sim-{i}"),
                placement_class: "on_demand".to_owned(),
                labels: BTreeMap::new(),
                capabilities: ["image:default", "network:none", "storage:standard"]
                    .map(str::to_owned)
                    .to_vec(),
                capacity: Capacity {
                    sandboxes: capacity,
                    memory_mib: capacity * 1024,
                    cpus: capacity as f64,
                    pids: capacity * 4096,
                },
                data_url: None,
                data_key: None,
            };
            for _ in 0..5 {
                let t = Instant::now();
                match base.runner_register(&request).await {
                    Ok(registered) => {
                        stats.record("register", t);
                        return Some(registered);
                    }
                    Err(err) => stats.error("register", &err),
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            None
        }));
    }
    let mut runners = Vec::new();
    for (i, task) in registering.into_iter().enumerate() {
        if let Some(registered) = task.await? {
            let credential = registered.runner_token.clone().unwrap_or_default();
            let clients = bases.iter().map(|b| b.with_token(&credential)).collect();
            runners.push((
                registered.runner_id,
                Arc::new(Sim {
                    clients,
                    at: AtomicUsize::new(i),
                }),
                registered.lease_ttl_ms,
            ));
        }
    }
    let register_s = started.elapsed().as_secs_f64();
    eprintln!("{} registered in {register_s:.1}s", runners.len());

    let stop = Arc::new(AtomicBool::new(false));
    let lost_leases = Arc::new(AtomicU64::new(0));
    let reports = Arc::new(AtomicU64::new(0));
    let silent_id = runners.first().map(|(id, _, _)| id.clone());
    let silent = Arc::new(AtomicBool::new(false));
    let last_heartbeat_of_silent = Arc::new(Mutex::new(None::<Instant>));
    let mut tasks = Vec::new();
    let heartbeat = Duration::from_millis(args.heartbeat_ms);
    let assignments_wait_s = args.assignments_wait_s;
    let run_started = Instant::now();
    let n = runners.len().max(1);
    for (i, (runner_id, sim, _)) in runners.iter().enumerate() {
        // Heartbeats spread evenly over the interval.
        let offset = heartbeat * i as u32 / n as u32;
        let is_silent = Some(runner_id) == silent_id.as_ref();
        let (hb_sim, hb_stats, hb_stop, lost) = (
            sim.clone(),
            stats.clone(),
            stop.clone(),
            lost_leases.clone(),
        );
        let (hb_runner, silent, last) = (
            runner_id.clone(),
            silent.clone(),
            last_heartbeat_of_silent.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let (sim, stats, stop, runner_id) = (hb_sim, hb_stats, hb_stop, hb_runner);
            tokio::time::sleep(offset).await;
            let mut tick = tokio::time::interval(heartbeat);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                if is_silent && silent.load(Ordering::Relaxed) {
                    return;
                }
                let t = Instant::now();
                let request = HeartbeatRequest {
                    runner_id: runner_id.clone(),
                };
                match sim.client().runner_heartbeat(&request).await {
                    Ok(_) => {
                        stats.record_heartbeat(run_started, t);
                        if is_silent {
                            *last.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
                        }
                    }
                    Err(err) => {
                        if err.code() == Some(api::ErrorCode::Fenced) {
                            lost.fetch_add(1, Ordering::Relaxed);
                            stats.error("heartbeat", &err);
                            return;
                        }
                        sim.fail_over(&err);
                        stats.error("heartbeat", &err);
                    }
                }
            }
        }));
        let (poll_sim, poll_stats, poll_stop, reports) =
            (sim.clone(), stats.clone(), stop.clone(), reports.clone());
        let poll_runner = runner_id.clone();
        tasks.push(tokio::spawn(async move {
            let (sim, stats, stop, runner_id) = (poll_sim, poll_stats, poll_stop, poll_runner);
            tokio::time::sleep(offset).await;
            let mut etag = String::new();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let client = sim.client();
                let answer = match client
                    .runner_assignments(&runner_id, &etag, assignments_wait_s)
                    .await
                {
                    Ok(answer) => answer,
                    Err(err) => {
                        sim.fail_over(&err);
                        if err.code() == Some(api::ErrorCode::Fenced) {
                            return;
                        }
                        stats.error("assignments", &err);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                };
                stats.record("assignments", t);
                stats.record_poll_answered(run_started);
                etag = answer.etag.clone();
                for sandbox in &answer.sandboxes {
                    let to = match (sandbox.desired, sandbox.state) {
                        (DesiredState::Deleted, state) if state != SandboxState::Deleted => {
                            SandboxState::Deleted
                        }
                        (DesiredState::Running, SandboxState::Starting) => SandboxState::Running,
                        (
                            DesiredState::Stopped,
                            SandboxState::Starting | SandboxState::Running | SandboxState::Stopping,
                        ) => SandboxState::Stopped,
                        (
                            DesiredState::Terminated,
                            SandboxState::Starting | SandboxState::Running | SandboxState::Stopping,
                        ) => SandboxState::Terminated,
                        _ => continue,
                    };
                    let report = SandboxReport {
                        runner_id: runner_id.clone(),
                        epoch: sandbox.epoch,
                        state: to,
                        reason: None,
                        message: None,
                        wake: None,
                    };
                    let t = Instant::now();
                    match client
                        .runner_report_sandbox(&sandbox.sandbox_id, &report)
                        .await
                    {
                        Ok(_) => {
                            stats.record("report", t);
                            reports.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(err) => stats.error("report", &err),
                    }
                }
            }
        }));
    }

    // The API load.
    let org_clients: Vec<Client> = args
        .urls
        .iter()
        .map(|url| Client::new(url, &org.token))
        .collect();
    for c in 0..args.api_clients {
        let (client, stats, stop) = (
            org_clients[c % org_clients.len()].clone(),
            stats.clone(),
            stop.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let request: api::sandboxes::CreateSandboxRequest =
                serde_json::from_value(json!({ "image": "default" })).expect("a request");
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let sandbox = match client.create_sandbox(&request, None).await {
                    Ok(sandbox) => sandbox,
                    Err(err) => {
                        stats.error("create", &err);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                stats.record("create", t);
                let t = Instant::now();
                match client.get_sandbox(&sandbox.id).await {
                    Ok(_) => stats.record("get", t),
                    Err(err) => stats.error("get", &err),
                }
                let t = Instant::now();
                match client.wait_sandbox(&sandbox.id, "running", 20).await {
                    Ok(s) if s.state == SandboxState::Running => stats.record("to_running", t),
                    Ok(s) => stats.error("to_running", &format!("ended {}", s.state)),
                    Err(err) => stats.error("to_running", &err),
                }
                let t = Instant::now();
                match client.delete_sandbox(&sandbox.id).await {
                    Ok(_) => stats.record("delete", t),
                    Err(err) => stats.error("delete", &err),
                }
            }
        }));
    }

    // Mid-run, one runner goes silent: how long until a server says lost.
    let steady = Instant::now();
    let mut lost_after_ms = None;
    if args.lose_at_s > 0
        && args.lose_at_s < args.seconds
        && let Some((runner_id, sim, lease_ms)) = runners.first()
    {
        tokio::time::sleep(Duration::from_secs(args.lose_at_s)).await;
        silent.store(true, Ordering::Relaxed);
        eprintln!("runner {runner_id} goes silent (lease {lease_ms} ms)");
        // Asked without renewing anything: an assignments read with no wait
        // answers 409 `fenced` once the runner is lost.
        while steady.elapsed() < Duration::from_secs(args.seconds) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Err(err) = sim.client().runner_assignments(runner_id, "", 0).await
                && err.code() == Some(api::ErrorCode::Fenced)
            {
                let last = last_heartbeat_of_silent
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .unwrap_or(steady);
                lost_after_ms = Some(last.elapsed().as_millis() as u64);
                eprintln!(
                    "declared lost {} ms after its last heartbeat",
                    lost_after_ms.unwrap_or(0)
                );
                break;
            }
        }
    }
    let left = Duration::from_secs(args.seconds).saturating_sub(steady.elapsed());
    tokio::time::sleep(left).await;
    stop.store(true, Ordering::Relaxed);
    let seconds = steady.elapsed().as_secs_f64();
    let mut summary = stats.summary(seconds);
    summary["runners"] = json!(runners.len());
    summary["register_seconds"] = json!(register_s);
    summary["steady_seconds"] = json!(seconds);
    // The silent runner's lease is the one expected to go.
    summary["leases_lost_wrongly"] = json!(lost_leases.load(Ordering::Relaxed));
    summary["reports"] = json!(reports.load(Ordering::Relaxed));
    summary["lost_after_ms"] = json!(lost_after_ms);
    summary["lease_ttl_ms"] = json!(runners.first().map(|r| r.2));
    for task in tasks {
        task.abort();
    }
    Ok(summary)
}
