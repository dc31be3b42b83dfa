//! Load generator for `roost server`; `bench/control/run.sh` drives it.
//!
//! Every subcommand prints one JSON object on stdout (progress goes to
//! stderr):
//!
//! - `setup`: an org, a runner token, a registered runner with room for
//!   100,000 sandboxes, and one sandbox to read (`--sandboxes N`: N).
//! - `creates`: `POST /v1/sandboxes {}` from N concurrent clients for a fixed
//!   time; every answer must be 201.
//! - `waiters`: opens W long-polls (`GET /v1/sandboxes/ID?wait_for=running`),
//!   each on its own TCP connection, spread over S sandboxes; once the
//!   server's `roost_long_poll_waiters` shows them all, reads the server's
//!   RSS from `/proc/PID/status`; then reports every sandbox `running` and
//!   checks that every waiter answers `running`.
//! - `wake`: one at a time, a sandbox in `starting`, a long-poll on it
//!   (server A), then the runner's `running` report (server B, A by
//!   default); the time from sending the report to the long-poll's answer.
//!
//! `cargo run --release -p cli --example loadgen -- SUBCOMMAND --help`

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use api::lifecycle::SandboxState;
use clap::{Parser, Subcommand};
use reqwest::Method;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

#[derive(Parser)]
#[command(name = "loadgen", about = "Load generator for roost server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create an org, a runner token, a runner and one sandbox.
    Setup {
        #[arg(long)]
        url: String,
        #[arg(long)]
        admin_token: String,
        /// The org's name (unique per database).
        #[arg(long, default_value = "bench")]
        org: String,
        /// Sandboxes to create for reading (`sandbox_ids`; the first is
        /// also `sandbox_id`).
        #[arg(long, default_value_t = 1)]
        sandboxes: usize,
    },
    /// Create sandboxes from concurrent clients for a fixed time.
    Creates {
        #[arg(long)]
        url: String,
        /// An org token.
        #[arg(long)]
        token: String,
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
    },
    /// Hold many long-poll requests open and read the server's memory.
    Waiters {
        #[arg(long)]
        url: String,
        /// An org token.
        #[arg(long)]
        token: String,
        /// The runner's own credential (setup's `runner_token`), for its
        /// reports.
        #[arg(long)]
        runner_token: String,
        /// The server's process id (for VmRSS).
        #[arg(long)]
        server_pid: u32,
        #[arg(long, default_value_t = 10_000)]
        waiters: usize,
        /// How many sandboxes the waiters are spread over.
        #[arg(long, default_value_t = 100)]
        sandboxes: usize,
        /// Connections being opened at once.
        #[arg(long, default_value_t = 200)]
        connect_concurrency: usize,
        /// New long-polls per second (a burst of 10,000 SYNs overflows the
        /// server's listen backlog, and the kernel's retries take seconds).
        #[arg(long, default_value_t = 2500)]
        rate: u64,
        /// The long-poll timeout asked for, in seconds (at most 25).
        #[arg(long, default_value_t = 25)]
        timeout: u64,
    },
    /// Measure how fast a runner's report wakes a long-poll.
    Wake {
        /// The server the long-poll goes to.
        #[arg(long)]
        url: String,
        /// The server the report goes to (default: `--url`).
        #[arg(long)]
        report_url: Option<String>,
        /// An org token.
        #[arg(long)]
        token: String,
        /// The runner's own credential (setup's `runner_token`), for its
        /// reports.
        #[arg(long)]
        runner_token: String,
        #[arg(long)]
        runner_id: String,
        /// Measured wake-ups.
        #[arg(long, default_value_t = 1000)]
        count: usize,
        /// Unmeasured wake-ups first.
        #[arg(long, default_value_t = 20)]
        warmup: usize,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime.block_on(async move {
        match cli.command {
            Command::Setup {
                url,
                admin_token,
                org,
                sandboxes,
            } => setup(&Api::new(&url)?, &admin_token, &org, sandboxes).await,
            Command::Creates {
                url,
                token,
                concurrency,
                seconds,
            } => creates(&Api::new(&url)?, &token, concurrency, seconds).await,
            Command::Waiters {
                url,
                token,
                runner_token,
                server_pid,
                waiters: count,
                sandboxes,
                connect_concurrency,
                rate,
                timeout,
            } => {
                let plan = WaiterPlan {
                    count,
                    sandboxes,
                    connect_concurrency,
                    rate,
                    timeout,
                };
                waiters(&Api::new(&url)?, &token, &runner_token, server_pid, plan).await
            }
            Command::Wake {
                url,
                report_url,
                token,
                runner_token,
                runner_id,
                count,
                warmup,
            } => {
                let waiter = Api::new(&url)?;
                let reporter = Api::new(report_url.as_deref().unwrap_or(&url))?;
                let tokens = Tokens {
                    org: token,
                    runner: runner_token,
                    runner_id,
                };
                wake(&waiter, &reporter, &tokens, count, warmup).await
            }
        }
    })?;
    println!("{report}");
    Ok(())
}

/// A server's base URL and a keep-alive client for it.
#[derive(Clone)]
struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(base: &str) -> Result<Api> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .context("building the HTTP client")?;
        Ok(Api {
            http,
            base: base.trim_end_matches('/').to_owned(),
        })
    }

    /// The status and the parsed body (`null` if it is not JSON).
    async fn call(
        &self,
        method: Method,
        path: &str,
        token: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value)> {
        let mut request = self
            .http
            .request(method.clone(), format!("{}{path}", self.base))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("{method} {path}"))?;
        let status = response.status().as_u16();
        let bytes = response
            .bytes()
            .await
            .with_context(|| format!("{method} {path}: reading the body"))?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    /// A call that must succeed (2xx).
    async fn post(&self, path: &str, token: &str, body: &Value) -> Result<Value> {
        let (status, value) = self.call(Method::POST, path, token, Some(body)).await?;
        ensure!(
            (200..300).contains(&status),
            "POST {path}: status {status}: {value}"
        );
        Ok(value)
    }

    async fn create_sandbox(&self, token: &str) -> Result<Created> {
        let value = self.post("/v1/sandboxes", token, &json!({})).await?;
        Ok(Created {
            id: text(&value, "id")?,
            state: text(&value, "state")?
                .parse()
                .context("sandbox with an unknown state")?,
            epoch: value["epoch"].as_u64().context("sandbox without epoch")?,
        })
    }

    async fn report_running(&self, tokens: &Tokens, sandbox: &Created) -> Result<()> {
        let body = json!({
            "runner_id": tokens.runner_id,
            "epoch": sandbox.epoch,
            "state": "running",
        });
        self.post(
            &format!("/v1/runner/sandboxes/{}/report", sandbox.id),
            &tokens.runner,
            &body,
        )
        .await?;
        Ok(())
    }

    /// `roost_long_poll_waiters` from `/metrics`, read with the token in
    /// `ROOST_METRICS_TOKEN` (the admin token or the server's metrics
    /// token: `/metrics` answers no other).
    async fn waiters_gauge(&self) -> Result<u64> {
        let token = std::env::var("ROOST_METRICS_TOKEN")
            .context("ROOST_METRICS_TOKEN: the admin token or the server's metrics token")?;
        let text = self
            .http
            .get(format!("{}/metrics", self.base))
            .bearer_auth(token)
            .send()
            .await
            .context("GET /metrics")?
            .text()
            .await
            .context("GET /metrics: reading the body")?;
        text.lines()
            .find_map(|line| line.strip_prefix("roost_long_poll_waiters "))
            .and_then(|value| value.trim().parse().ok())
            .context("no roost_long_poll_waiters in /metrics")
    }

    /// `HOST:PORT` of an `http://HOST:PORT` base URL, for raw connections.
    fn socket_addr(&self) -> Result<SocketAddr> {
        let rest = self
            .base
            .strip_prefix("http://")
            .context("the url must be http://IP:PORT")?;
        rest.parse()
            .with_context(|| format!("the url must be http://IP:PORT, not {}", self.base))
    }
}

fn text(value: &Value, field: &str) -> Result<String> {
    value[field]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("no {field} in {value}"))
}

struct Created {
    id: String,
    state: SandboxState,
    epoch: u64,
}

struct Tokens {
    org: String,
    runner: String,
    runner_id: String,
}

async fn setup(api: &Api, admin_token: &str, org: &str, sandboxes: usize) -> Result<Value> {
    let created = api
        .post("/v1/admin/orgs", admin_token, &json!({ "name": org }))
        .await?;
    let org_token = text(&created, "token")?;
    let runner_token = text(
        &api.post("/v1/admin/runner-tokens", admin_token, &json!({}))
            .await?,
        "token",
    )?;
    let register = json!({
        "name": "bench-runner",
        "placement_class": "on_demand",
        "capabilities": ["image:default", "network:none", "storage:standard"],
        "capacity": {
            "sandboxes": 100_000,
            "memory_mib": 100_000_000_u64,
            "cpus": 100_000,
            "pids": 1_000_000_000_u64,
        },
    });
    // The runner token only enrols; reports go with the runner's own
    // credential, which registering hands out.
    let registered = api
        .post("/v1/runner/register", &runner_token, &register)
        .await?;
    let runner_id = text(&registered, "runner_id")?;
    let runner_credential = text(&registered, "runner_token")?;
    let mut sandbox_ids = Vec::with_capacity(sandboxes);
    for _ in 0..sandboxes.max(1) {
        sandbox_ids.push(api.create_sandbox(&org_token).await?.id);
    }
    Ok(json!({
        "org_token": org_token,
        "runner_token": runner_credential,
        "runner_id": runner_id,
        "sandbox_id": sandbox_ids[0],
        "sandbox_ids": sandbox_ids,
    }))
}

/// Nearest-rank percentile of sorted milliseconds.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn round2(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}

fn latency_summary(mut ms: Vec<f64>) -> Value {
    ms.sort_by(f64::total_cmp);
    let mean = ms.iter().sum::<f64>() / ms.len().max(1) as f64;
    json!({
        "n": ms.len(),
        "p50_ms": round2(percentile(&ms, 50.0)),
        "p90_ms": round2(percentile(&ms, 90.0)),
        "p99_ms": round2(percentile(&ms, 99.0)),
        "max_ms": round2(ms.last().copied().unwrap_or(f64::NAN)),
        "mean_ms": round2(mean),
    })
}

async fn creates(api: &Api, token: &str, concurrency: usize, seconds: u64) -> Result<Value> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let api = api.clone();
        let token = token.to_owned();
        workers.push(tokio::spawn(async move {
            // (latency ms, seconds since start at completion) of each 201,
            // and the statuses of the rest.
            let mut ok: Vec<(f64, f64)> = Vec::new();
            let mut failed: Vec<u16> = Vec::new();
            let body = json!({});
            while Instant::now() < deadline {
                let sent = Instant::now();
                let (status, _) = api
                    .call(Method::POST, "/v1/sandboxes", &token, Some(&body))
                    .await?;
                let done = Instant::now();
                if status == 201 {
                    ok.push((
                        (done - sent).as_secs_f64() * 1000.0,
                        (done - started).as_secs_f64(),
                    ));
                } else {
                    failed.push(status);
                }
            }
            anyhow::Ok((ok, failed))
        }));
    }
    let mut ok = Vec::new();
    let mut failed = Vec::new();
    for worker in workers {
        let (o, f) = worker.await.context("a create worker panicked")??;
        ok.extend(o);
        failed.extend(f);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut per_second = vec![0_u64; elapsed.ceil() as usize];
    for (_, at) in &ok {
        if let Some(slot) = per_second.get_mut(*at as usize) {
            *slot += 1;
        }
    }
    let mut statuses = std::collections::BTreeMap::<u16, u64>::new();
    for status in &failed {
        *statuses.entry(*status).or_default() += 1;
    }
    Ok(json!({
        "concurrency": concurrency,
        "seconds": round2(elapsed),
        "created": ok.len(),
        "failed": failed.len(),
        "failed_statuses": statuses,
        "per_s": round2(ok.len() as f64 / elapsed),
        "per_second": per_second,
        "latency": latency_summary(ok.iter().map(|(ms, _)| *ms).collect()),
    }))
}

/// VmRSS and VmHWM of a process, in MiB.
fn memory_mib(pid: u32) -> Result<(f64, f64)> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let field = |name: &str| -> Result<f64> {
        let kib: f64 = status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .with_context(|| format!("no {name} in {path}"))?;
        Ok(kib / 1024.0)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// One long-poll on its own connection: `Connection: close`, so the
/// answer is everything the server sends before closing.
async fn open_long_poll(addr: SocketAddr, request: &str) -> Result<TcpStream> {
    let mut stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr} (is ulimit -n high enough?)"))?;
    stream
        .write_all(request.as_bytes())
        .await
        .context("sending a long-poll")?;
    Ok(stream)
}

/// The status and whether the answer says `running`.
async fn read_answer(mut stream: TcpStream) -> Result<(u16, bool)> {
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .context("reading a long-poll answer")?;
    let answer = String::from_utf8_lossy(&answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status line in {answer:?}"))?;
    Ok((status, answer.contains("\"state\":\"running\"")))
}

struct WaiterPlan {
    count: usize,
    sandboxes: usize,
    connect_concurrency: usize,
    rate: u64,
    timeout: u64,
}

async fn waiters(
    api: &Api,
    token: &str,
    runner_token: &str,
    server_pid: u32,
    plan: WaiterPlan,
) -> Result<Value> {
    ensure!(plan.sandboxes > 0, "--sandboxes must be at least 1");
    let addr = api.socket_addr()?;
    let mut runner_id = String::new();
    let mut sandboxes = Vec::new();
    for _ in 0..plan.sandboxes {
        let sandbox = api.create_sandbox(token).await?;
        ensure!(
            sandbox.state == SandboxState::Starting,
            "sandbox {} is {}, not starting (no runner capacity?)",
            sandbox.id,
            sandbox.state
        );
        let (status, record) = api
            .call(
                Method::GET,
                &format!("/v1/sandboxes/{}", sandbox.id),
                token,
                None,
            )
            .await?;
        ensure!(status == 200, "GET sandbox: {status}");
        runner_id = text(&record, "runner_id")?;
        sandboxes.push(sandbox);
    }
    let gauge_before = api.waiters_gauge().await?;
    ensure!(
        gauge_before == 0,
        "{gauge_before} long-polls are already waiting"
    );
    let (rss_before, _) = memory_mib(server_pid)?;
    eprintln!(
        "waiters: opening {} long-polls over {} sandboxes",
        plan.count, plan.sandboxes
    );

    let host = addr.to_string();
    let requests: Arc<Vec<String>> = Arc::new(
        sandboxes
            .iter()
            .map(|s| {
                format!(
                    "GET /v1/sandboxes/{}?wait_for=running&timeout={} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n",
                    s.id, plan.timeout
                )
            })
            .collect(),
    );
    let gate = Arc::new(Semaphore::new(plan.connect_concurrency.max(1)));
    let opened = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let opening = Instant::now();
    let mut tasks = Vec::with_capacity(plan.count);
    for i in 0..plan.count {
        let requests = requests.clone();
        let gate = gate.clone();
        let opened = opened.clone();
        let answered = answered.clone();
        let start_at = opening + Duration::from_secs_f64(i as f64 / plan.rate.max(1) as f64);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start_at.into()).await;
            let permit = gate.acquire_owned().await.context("connection gate")?;
            let stream = open_long_poll(addr, &requests[i % requests.len()]).await?;
            drop(permit);
            opened.fetch_add(1, Ordering::Relaxed);
            let answer = read_answer(stream).await;
            answered.fetch_add(1, Ordering::Relaxed);
            let (status, running) = answer?;
            anyhow::Ok((status, running, Instant::now()))
        }));
    }

    // Wait until the server counts every one of them as waiting, but not so
    // long that the first ones reach their timeout.
    let give_up = opening + Duration::from_secs(plan.timeout.saturating_sub(5).max(1));
    let mut gauge = 0;
    while Instant::now() < give_up {
        gauge = api.waiters_gauge().await?;
        if gauge as usize >= plan.count {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all_waiting_after = opening.elapsed().as_secs_f64();
    let reached = gauge as usize >= plan.count;
    // A few samples while they wait: the gauge must stay, RSS is the largest.
    let mut rss_waiting: f64 = 0.0;
    let mut gauge_min = gauge;
    for _ in 0..5 {
        let (rss, _) = memory_mib(server_pid)?;
        rss_waiting = rss_waiting.max(rss);
        gauge_min = gauge_min.min(api.waiters_gauge().await?);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, hwm_waiting) = memory_mib(server_pid)?;
    let answered_early = answered.load(Ordering::Relaxed);
    eprintln!(
        "waiters: gauge {gauge} after {all_waiting_after:.1}s, RSS {rss_waiting:.1} MiB; waking them"
    );

    // Wake everyone: each sandbox reported running.
    let tokens = Tokens {
        org: token.to_owned(),
        runner: runner_token.to_owned(),
        runner_id,
    };
    let waking = Instant::now();
    for sandbox in &sandboxes {
        api.report_running(&tokens, sandbox).await?;
    }
    let mut ok_running = 0;
    let mut other = 0;
    let mut errors = 0;
    let mut last = waking;
    for task in tasks {
        match task.await.context("a waiter panicked")? {
            Ok((200, true, at)) => {
                ok_running += 1;
                last = last.max(at);
            }
            Ok(_) => other += 1,
            Err(err) => {
                if errors == 0 {
                    eprintln!("waiters: first error: {err:#}");
                }
                errors += 1;
            }
        }
    }
    let wake_all_seconds = (last - waking).as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let gauge_after = api.waiters_gauge().await?;
    let (rss_after, hwm_after) = memory_mib(server_pid)?;
    Ok(json!({
        "waiters": plan.count,
        "sandboxes": plan.sandboxes,
        "opened": opened.load(Ordering::Relaxed),
        "all_waiting": reached,
        "gauge_peak": gauge,
        "gauge_min_while_sampling": gauge_min,
        "seconds_to_all_waiting": round2(all_waiting_after),
        "answered_before_wake": answered_early,
        "rss_before_mib": round2(rss_before),
        "rss_waiting_mib": round2(rss_waiting),
        "hwm_waiting_mib": round2(hwm_waiting),
        "woken_running": ok_running,
        "answers_not_running": other,
        "errors": errors,
        "wake_all_seconds": round2(wake_all_seconds),
        "gauge_after": gauge_after,
        "rss_after_mib": round2(rss_after),
        "hwm_after_mib": round2(hwm_after),
    }))
}

async fn wake(
    waiter: &Api,
    reporter: &Api,
    tokens: &Tokens,
    count: usize,
    warmup: usize,
) -> Result<Value> {
    let mut wake_ms = Vec::with_capacity(count);
    let mut report_ms = Vec::with_capacity(count);
    let mut not_running = 0;
    for i in 0..warmup + count {
        let sandbox = waiter.create_sandbox(&tokens.org).await?;
        ensure!(
            sandbox.state == SandboxState::Starting,
            "sandbox {} is {}, not starting",
            sandbox.id,
            sandbox.state
        );
        let poll = {
            let api = waiter.clone();
            let path = format!("/v1/sandboxes/{}?wait_for=running&timeout=25", sandbox.id);
            let token = tokens.org.clone();
            tokio::spawn(async move {
                let (status, record) = api.call(Method::GET, &path, &token, None).await?;
                anyhow::Ok((status, record, Instant::now()))
            })
        };
        // The report goes out only once the server holds the long-poll.
        let registered_by = Instant::now() + Duration::from_secs(5);
        while waiter.waiters_gauge().await? == 0 {
            if Instant::now() > registered_by {
                bail!("the long-poll on {} never registered", sandbox.id);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let sent = Instant::now();
        reporter.report_running(tokens, &sandbox).await?;
        let reported = Instant::now();
        let (status, record, answered) = poll.await.context("the long-poll task panicked")??;
        ensure!(status == 200, "long-poll answered {status}: {record}");
        if record["state"] != "running" {
            not_running += 1;
        }
        if i >= warmup {
            wake_ms.push((answered - sent).as_secs_f64() * 1000.0);
            report_ms.push((reported - sent).as_secs_f64() * 1000.0);
        }
        // The next round waits for the gauge to read 0 again.
        let cleared_by = Instant::now() + Duration::from_secs(5);
        while waiter.waiters_gauge().await? != 0 {
            if Instant::now() > cleared_by {
                bail!("a long-poll is still registered after its answer");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    Ok(json!({
        "count": count,
        "warmup": warmup,
        "not_running": not_running,
        "wake": latency_summary(wake_ms),
        "report_call": latency_summary(report_ms),
    }))
}
