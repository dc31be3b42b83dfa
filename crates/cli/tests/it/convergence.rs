//! Quick interleavings of what an org and an administrator ask of a
//! sandbox (stop, start, delete, drain, and doing nothing for a while)
//! through the API, against a real server and real runner processes: every
//! sequence converges to the last desired state, with no spurious failure
//! on the way (issue 13, point 5).
//!
//! The randomized test is seeded and replayable: each sequence prints its
//! seed, and `ROOST_CONVERGENCE_SEED=N` runs that one sequence alone.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::plane::{Api, Plane};
use crate::runner_e2e::{RunnerProcess, create_running, exec, sh};

/// A server with a local store and short leases, and two runners (so a
/// drained runner's durable sandboxes have somewhere to go).
struct Rig {
    plane: Plane,
    runners: Vec<RunnerProcess>,
    _store: tempfile::TempDir,
    _dir: tempfile::TempDir,
}

impl Rig {
    async fn start() -> Rig {
        let store = tempfile::tempdir().expect("store dir");
        let store_arg = store.path().to_str().expect("utf-8").to_owned();
        let plane = Plane::start(&["--store", &store_arg, "--lease-ttl", "5s"]).await;
        let dir = tempfile::Builder::new()
            .prefix("roost-converge-")
            .tempdir()
            .expect("tempdir");
        let runners = ["a", "b"]
            .iter()
            .map(|name| {
                RunnerProcess::start(
                    &plane.server.url,
                    &plane.runner_token,
                    &dir.path().join(name),
                    &[],
                )
            })
            .collect();
        Rig {
            plane,
            runners,
            _store: store,
            _dir: dir,
        }
    }

    fn api(&self) -> &Api {
        &self.plane.org
    }

    async fn drain(&self, runner: usize, drain: bool) {
        let verb = if drain { "drain" } else { "undrain" };
        let id = &self.runners[runner].runner_id;
        let answer = self
            .plane
            .admin
            .post(&format!("/v1/admin/runners/{id}/{verb}"), json!({}))
            .await;
        assert_eq!(answer.status, 200, "{verb} {id}: {answer:?}");
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // Runners go before the server (their Drop unmounts their homes).
        self.runners.clear();
    }
}

/// What an org or an administrator does next.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Stop,
    Start,
    Delete,
    /// Drain one runner (the other is undrained first, so one always
    /// takes work).
    Drain(usize),
    Undrain,
    /// Nothing for a while: whatever was in flight gets further.
    Idle(Duration),
}

/// A splitmix64 generator: the sequences must replay from a seed, and a
/// test needs no more randomness than this.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A sequence of 4 to 9 operations and the pauses before each (0 to
/// 150 ms); it ends at a delete, if one is drawn.
fn sequence(rng: &mut Rng) -> Vec<(Duration, Op)> {
    let length = 4 + rng.below(6);
    let mut ops = Vec::new();
    for _ in 0..length {
        let op = match rng.below(100) {
            0..=33 => Op::Stop,
            34..=67 => Op::Start,
            68..=77 => Op::Drain(rng.below(2) as usize),
            78..=83 => Op::Undrain,
            84..=95 => Op::Idle(Duration::from_millis(300 + rng.below(1200))),
            _ => Op::Delete,
        };
        let pause = Duration::from_millis(rng.below(151));
        ops.push((pause, op));
        if op == Op::Delete {
            break;
        }
    }
    ops
}

/// The state a sequence must end in: the last of stop, start and delete
/// decides (a sandbox starts running); drains move it, never end it.
fn expected_end(ops: &[(Duration, Op)]) -> &'static str {
    ops.iter()
        .rev()
        .find_map(|(_, op)| match op {
            Op::Stop => Some("stopped"),
            Op::Start => Some("running"),
            Op::Delete => Some("deleted"),
            _ => None,
        })
        .unwrap_or("running")
}

/// Sends `op`; refusals that say the request does not apply now (a stop
/// of a sandbox already stopping, say) are fine, anything else is not.
async fn apply(rig: &Rig, id: &str, op: Op) {
    let api = rig.api();
    let answer = match op {
        Op::Stop => {
            api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
                .await
        }
        Op::Start => {
            api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
                .await
        }
        Op::Delete => api.delete(&format!("/v1/sandboxes/{id}")).await,
        Op::Drain(runner) => {
            rig.drain(1 - runner, false).await;
            rig.drain(runner, true).await;
            return;
        }
        Op::Undrain => {
            rig.drain(0, false).await;
            rig.drain(1, false).await;
            return;
        }
        Op::Idle(pause) => {
            tokio::time::sleep(pause).await;
            return;
        }
    };
    assert!(
        answer.status == 202 || answer.status == 200,
        "{op:?} of {id} was refused: {answer:?}"
    );
}

async fn events(api: &Api, id: &str) -> Vec<Value> {
    let answer = api.get(&format!("/v1/sandboxes/{id}/events")).await;
    answer.body["events"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Waits until the sandbox rests in `expected` (desired and observed
/// agree) and checks the way there: no `failed` state, a reason on every
/// event, and (while it exists) the file written before the sequence.
/// A sequence's last drain can still be on its way to the runner when the
/// record first agrees (the test undoes it at once): a command then ends
/// `not_launched` (the sandbox left `running` for it), which is honest;
/// the sandbox must still come to rest, and the file be there.
async fn assert_converged(api: &Api, id: &str, expected: &str, context: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        wait_converged(api, id, expected, context, deadline).await;
        if expected != "running" {
            return;
        }
        let (command, stdout, stderr) = exec(
            api,
            id,
            json!({"argv": ["sh", "-c", "cat /workspace/marker"]}),
        )
        .await;
        if command["state"] == "not_launched" && Instant::now() < deadline {
            continue;
        }
        assert_eq!(
            (command["state"].as_str(), command["exit_code"].as_i64()),
            (Some("exited"), Some(0)),
            "{context}: {command}\nstdout: {stdout}\nstderr: {stderr}"
        );
        assert_eq!(stdout, "kept\n", "{context}: the home lost its file");
        return;
    }
}

async fn wait_converged(api: &Api, id: &str, expected: &str, context: &str, deadline: Instant) {
    loop {
        let answer = api.get(&format!("/v1/sandboxes/{id}")).await;
        let sandbox = answer.body;
        let state = sandbox["state"].as_str().unwrap_or("");
        if expected == "deleted" {
            // Deleted records stay readable for the retention window.
            if state == "deleted" {
                break;
            }
        } else if state == expected && sandbox["desired"] == expected {
            break;
        }
        assert!(
            state != "failed",
            "{context}: the sandbox failed on the way to {expected}: {sandbox}\nevents: {:#?}",
            events(api, id).await
        );
        assert!(
            Instant::now() < deadline,
            "{context}: never converged to {expected}: {sandbox}\nevents: {:#?}",
            events(api, id).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let events = events(api, id).await;
    for event in &events {
        assert_ne!(event["state"], "failed", "{context}: {events:#?}");
        assert!(
            event["reason"].is_string(),
            "{context}: an event without a reason: {events:#?}"
        );
    }
}

/// The reproduction: `stop`, `start`, `stop`, `start` 50 ms apart ended
/// the sandbox `failed`/`workload_exited` with `desired: running`, the
/// runner killing a container its (stale) record said must not run. Both
/// storage classes, ten tries each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_start_stop_start_50ms_apart_ends_running() {
    let rig = Rig::start().await;
    let api = rig.api();
    for class in ["standard", "durable"] {
        let id = create_running(api, json!({"storage_class": class})).await;
        sh(api, &id, "echo kept > /workspace/marker").await;
        for round in 0..10 {
            for op in [Op::Stop, Op::Start, Op::Stop, Op::Start] {
                apply(&rig, &id, op).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let context = format!("{class} sandbox, round {round}");
            assert_converged(api, &id, "running", &context).await;
        }
    }
}

/// Seeded random sequences of stop, start, delete, drain and idle, each
/// on a fresh sandbox (standard and durable in turn): each converges to the
/// last desired state with no spurious failure. A failure names its seed
/// and its operations; `ROOST_CONVERGENCE_SEED` replays one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sequences_of_stop_start_delete_drain_and_idle_converge() {
    let seeds: Vec<u64> = match std::env::var("ROOST_CONVERGENCE_SEED") {
        Ok(seed) => vec![seed.parse().expect("ROOST_CONVERGENCE_SEED is a number")],
        Err(_) => (1..=24).collect(),
    };
    let rig = Rig::start().await;
    let api = rig.api();
    for seed in seeds {
        let mut rng = Rng(seed);
        let class = if seed % 2 == 0 { "durable" } else { "standard" };
        let ops = sequence(&mut rng);
        let expected = expected_end(&ops);
        let context = format!("seed {seed} ({class}): {ops:?}");
        eprintln!("convergence: {context} → {expected}");
        let id = create_running(api, json!({"storage_class": class})).await;
        sh(api, &id, "echo kept > /workspace/marker").await;
        for (pause, op) in &ops {
            tokio::time::sleep(*pause).await;
            apply(&rig, &id, *op).await;
        }
        // Nobody stays drained: a standard sandbox cannot leave its runner,
        // and the next sequence needs both.
        rig.drain(0, false).await;
        rig.drain(1, false).await;
        assert_converged(api, &id, expected, &context).await;
        if expected != "deleted" {
            api.delete(&format!("/v1/sandboxes/{id}")).await;
        }
    }
}
