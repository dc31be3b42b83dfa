//! The store failing under a fleet of real processes (issue 13, points 4
//! and 10): a `roost server` whose store fills up (a small tmpfs) or goes
//! out of reach (an S3 store behind a proxy the test cuts), and `roost
//! runner`s driving runc. Each test goes through the three moments a home
//! meets the store: a running save, securing at a stop, and a wake on a
//! runner that does not hold the home. After each, once the store is back:
//! no write a completed save held is missing, the record converged with an
//! honest reason on every event, and no runner deleted a copy of a home
//! while it could be the newest.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};

use crate::durable::Fleet;
use crate::plane::{Api, eventually};
use crate::proxy::Proxy;
use crate::runner_e2e::{sh, wait_sandbox};

/// A tmpfs of `bytes` mounted for one test (a store that can fill up),
/// unmounted when dropped.
struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    fn mount(bytes: u64) -> SmallDisk {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("mount (the tests run as root)");
        assert!(status.success(), "mount a tmpfs");
        SmallDisk(dir)
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.0.path())
            .status();
    }
}

/// What the store suffers in a run, and how it is undone.
enum Fault {
    /// The server's local store on a tmpfs, filled to the last byte by a
    /// file the test deletes to free it.
    Full { disk: SmallDisk },
    /// The server's S3 store behind a proxy the test cuts.
    Unreachable { proxy: Proxy },
}

impl Fault {
    fn filler(disk: &SmallDisk) -> PathBuf {
        disk.path().join("filler")
    }

    fn break_store(&self) {
        match self {
            Fault::Full { disk } => {
                // Written until the disk refuses more: incompressible
                // bytes are not needed, tmpfs stores what it is given.
                use std::io::Write;
                let mut file = std::fs::File::create(Fault::filler(disk)).expect("the filler");
                let chunk = vec![7_u8; 1 << 20];
                loop {
                    if file.write_all(&chunk).is_err() {
                        break;
                    }
                }
                // And the last pages a chunk did not fit in.
                while file.write_all(&[7_u8; 4096]).is_ok() {}
            }
            Fault::Unreachable { proxy } => proxy.cut(),
        }
    }

    fn mend_store(&self) {
        match self {
            Fault::Full { disk } => {
                std::fs::remove_file(Fault::filler(disk)).expect("free the disk");
            }
            Fault::Unreachable { proxy } => proxy.mend(),
        }
    }

    /// Words the save's error carries for this fault: it names the cause.
    fn error_says(&self) -> &'static str {
        match self {
            Fault::Full { .. } => "store full",
            Fault::Unreachable { .. } => "store unreachable",
        }
    }
}

/// [`wait_sandbox`] for up to a minute: after the store comes back, a
/// waiting launch tries again only at its next announced attempt (up to
/// 15 s on), and then restores and starts the sandbox.
async fn wait_after_mend(api: &Api, id: &str, state: &str) -> Value {
    let mut sandbox = wait_sandbox(api, id, state).await;
    if sandbox["state"] != state {
        sandbox = wait_sandbox(api, id, state).await;
    }
    sandbox
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

async fn events(api: &Api, id: &str) -> Vec<Value> {
    api.get(&format!("/v1/sandboxes/{id}/events")).await.body["events"]
        .as_array()
        .expect("events")
        .clone()
}

/// Every event names a reason, and none is a failure: a store that comes
/// back is a wait, never an end.
async fn assert_honest_history(api: &Api, id: &str) -> Vec<(String, String)> {
    let history: Vec<(String, String)> = events(api, id)
        .await
        .iter()
        .map(|e| {
            (
                e["state"].as_str().unwrap_or("").to_owned(),
                e["reason"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert!(
        history
            .iter()
            .all(|(state, reason)| !reason.is_empty() && state != "failed"),
        "{id}: {history:?}"
    );
    history
}

/// Waits until `id`'s save status says `failing` with an error naming
/// `cause`, attempted after `after` (RFC 3339); returns the record.
async fn wait_save_failing(api: &Api, id: &str, cause: &str, after: &str) -> Value {
    let failing = eventually(Duration::from_secs(40), || async {
        let sandbox = api.get(&format!("/v1/sandboxes/{id}")).await.body;
        sandbox["save"]["state"] == "failing"
            && sandbox["save"]["last_attempt_at"].as_str().unwrap_or("") > after
            && sandbox["save"]["last_error"]
                .as_str()
                .is_some_and(|e| e.contains(cause))
    })
    .await;
    let sandbox = api.get(&format!("/v1/sandboxes/{id}")).await.body;
    assert!(failing, "no failing save naming {cause:?}: {sandbox}");
    sandbox
}

/// The matrix for one fault, on one fleet:
///
/// - `waking` (durable, stopped and secured on runner `b`, `b` drained so
///   that its next start must restore it elsewhere from the store);
/// - `saving` (durable, running on runner `a`, saved every second).
///
/// With the store broken: (a) `saving` takes a write its saves cannot
/// hold, and its save status says `failing` naming the cause; (c)
/// `waking` is started on `a`: with a full store it runs (a wake only
/// reads), out of reach it waits `starting` (`store_unreachable`), saying
/// so once in its events and every attempt in its message, while `b` keeps
/// its copy; (b) `saving` is stopped: `securing`, failing, the home kept
/// on `a`. Then the store comes back: `waking` runs with its home,
/// `saving` ends `stopped` with its save `ok`, and woken on `b` it has
/// every write, the one taken while the store was broken included.
async fn through_save_securing_and_wake(fault: Fault, mut fleet: Fleet) {
    // (`fault` is declared first so that it is dropped last: the fleet's
    // processes go before the store's disk or proxy.)
    let b = fleet.runner("b");
    let api = fleet.api().clone();
    let unreachable = matches!(fault, Fault::Unreachable { .. });
    // Stopped while its wake waits for the store (out of reach only: a
    // wake on a full store does not wait).
    let abandoned = if unreachable {
        Some(fleet.create(json!({"storage_class": "durable"})).await)
    } else {
        None
    };
    let waking = fleet.create(json!({"storage_class": "durable"})).await;
    for id in std::iter::once(&waking).chain(&abandoned) {
        sh(&api, id, &format!("echo {id} whole > /workspace/w.txt")).await;
        api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
            .await;
        let secured = wait_sandbox(&api, id, "stopped").await;
        assert_eq!(secured["save"]["state"], "ok", "{secured}");
    }
    let b_id = fleet.runners[b].runner_id.clone();
    let admin = fleet.plane.admin.clone();
    let drained = admin
        .post(&format!("/v1/admin/runners/{b_id}/drain"), json!({}))
        .await;
    assert_eq!(drained.status, 200, "{drained:?}");

    let a = fleet.runner("a");
    let a_id = fleet.runners[a].runner_id.clone();
    let saving = fleet
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    assert_eq!(fleet.get(&saving).await["runner_id"], a_id.as_str());
    let before = now_rfc3339();
    sh(&api, &saving, "echo saved > /workspace/acked-1.txt").await;
    fleet.wait_saved_after(&saving, &before).await;

    fault.break_store();
    let broken = now_rfc3339();

    // (a) A running save.
    sh(&api, &saving, "echo taken > /workspace/acked-2.txt").await;
    let failing = wait_save_failing(&api, &saving, fault.error_says(), &broken).await;
    assert_eq!(failing["state"], "running", "{failing}");
    assert_eq!(failing["state_reason"], "workload_started", "{failing}");

    // (c) A wake on a runner without the home.
    api.post(&format!("/v1/sandboxes/{waking}/start"), json!({}))
        .await;
    let kept_on_b = fleet.runners[b].data_dir.join("volumes/kept").join(&waking);
    match &fault {
        Fault::Full { .. } => {
            let running = wait_sandbox(&api, &waking, "running").await;
            assert_eq!(running["state"], "running", "{running}");
            assert_eq!(running["runner_id"], a_id.as_str(), "{running}");
        }
        Fault::Unreachable { .. } => {
            let waits = eventually(Duration::from_secs(40), || async {
                api.get(&format!("/v1/sandboxes/{waking}")).await.body["state_reason"]
                    == "store_unreachable"
            })
            .await;
            let waiting = fleet.get(&waking).await;
            assert!(waits, "not waiting for the store: {waiting}");
            assert_eq!(waiting["state"], "starting", "{waiting}");
            assert_eq!(waiting["runner_id"], a_id.as_str(), "{waiting}");
            let message = waiting["state_message"].as_str().unwrap_or("").to_owned();
            assert!(
                message.starts_with("cannot download the home: store unreachable")
                    && message.contains("next attempt in"),
                "{waiting}"
            );
            // Tried again (the message announces the next attempt anew),
            // and still one event for the wait, not one per attempt.
            let tried_again = eventually(Duration::from_secs(30), || async {
                let now = api.get(&format!("/v1/sandboxes/{waking}")).await.body;
                now["state_message"].as_str().is_some_and(|m| m != message)
            })
            .await;
            assert!(
                tried_again,
                "no second attempt: {}",
                fleet.get(&waking).await
            );
            let history = assert_honest_history(&api, &waking).await;
            let wait_events = history
                .iter()
                .filter(|(state, reason)| state == "starting" && reason == "store_unreachable")
                .count();
            assert_eq!(wait_events, 1, "{history:?}");
            // The runner the home left keeps its copy until the new
            // placement runs from the store.
            let copies = std::fs::read_dir(&kept_on_b).map_or(0, |d| d.count());
            assert_eq!(copies, 1, "no copy kept on b at {}", kept_on_b.display());

            // Stopped while it waits: it ends `stopped` at once, its last
            // completed save still its home (what the waiting runner holds
            // is at most a part of it, never uploaded in its place).
            let abandoned = abandoned.as_deref().expect("a second sandbox");
            let saved = fleet.get(abandoned).await["save"]["root"].clone();
            api.post(&format!("/v1/sandboxes/{abandoned}/start"), json!({}))
                .await;
            let waits = eventually(Duration::from_secs(40), || async {
                api.get(&format!("/v1/sandboxes/{abandoned}")).await.body["state_reason"]
                    == "store_unreachable"
            })
            .await;
            assert!(waits, "not waiting: {}", fleet.get(abandoned).await);
            api.post(&format!("/v1/sandboxes/{abandoned}/stop"), json!({}))
                .await;
            let stopped = wait_sandbox(&api, abandoned, "stopped").await;
            assert_eq!(stopped["state"], "stopped", "{stopped}");
            assert_eq!(stopped["save"]["root"], saved, "{stopped}");
        }
    }

    // (b) Securing.
    api.post(&format!("/v1/sandboxes/{saving}/stop"), json!({}))
        .await;
    // A scheduled save may still fail while the workload stops; the
    // securing's own attempt fails next, saying the same.
    let securing = eventually(Duration::from_secs(40), || async {
        let sandbox = api.get(&format!("/v1/sandboxes/{saving}")).await.body;
        sandbox["state"] == "securing"
    })
    .await;
    assert!(securing, "not securing: {}", fleet.get(&saving).await);
    let securing = wait_save_failing(&api, &saving, fault.error_says(), &now_rfc3339()).await;
    assert_eq!(securing["state"], "securing", "{securing}");
    let home_on_a = fleet.runners[a]
        .data_dir
        .join("volumes/homes")
        .join(&saving);
    assert_eq!(
        std::fs::read_to_string(home_on_a.join("acked-2.txt")).expect("the home stays on a"),
        "taken\n"
    );

    fault.mend_store();

    let running = wait_after_mend(&api, &waking, "running").await;
    assert_eq!(running["state"], "running", "{running}");
    assert_eq!(running["state_reason"], "workload_started", "{running}");
    assert!(running["state_message"].is_null(), "{running}");
    assert_eq!(
        sh(&api, &waking, "cat /workspace/w.txt").await,
        format!("{waking} whole\n")
    );
    assert_honest_history(&api, &waking).await;
    // Started again with the store back: its home is whole.
    if let Some(abandoned) = &abandoned {
        api.post(&format!("/v1/sandboxes/{abandoned}/start"), json!({}))
            .await;
        let running = wait_sandbox(&api, abandoned, "running").await;
        assert_eq!(running["state"], "running", "{running}");
        assert_eq!(
            sh(&api, abandoned, "cat /workspace/w.txt").await,
            format!("{abandoned} whole\n")
        );
        assert_honest_history(&api, abandoned).await;
    }

    let stopped = wait_after_mend(&api, &saving, "stopped").await;
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert_eq!(stopped["save"]["state"], "ok", "{stopped}");

    // Woken on b, from the store alone: every acknowledged write is there.
    admin
        .post(&format!("/v1/admin/runners/{b_id}/undrain"), json!({}))
        .await;
    admin
        .post(&format!("/v1/admin/runners/{a_id}/drain"), json!({}))
        .await;
    api.post(&format!("/v1/sandboxes/{saving}/start"), json!({}))
        .await;
    let woken = wait_sandbox(&api, &saving, "running").await;
    assert_eq!(woken["runner_id"], b_id.as_str(), "{woken}");
    assert_eq!(
        sh(
            &api,
            &saving,
            "cat /workspace/acked-1.txt /workspace/acked-2.txt"
        )
        .await,
        "saved\ntaken\n"
    );
    assert_honest_history(&api, &saving).await;
}

/// A full store (507 from the block service): saves and securing fail
/// saying the store is full, the home stays on its runner, a wake still
/// runs (it only reads); freed, everything completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_fails_saves_and_securing_visibly_and_loses_nothing() {
    let disk = SmallDisk::mount(64 << 20);
    let store = disk.path().join("store");
    let fleet = Fleet::start_on(Some(store.to_str().expect("utf-8")), &[], &[]).await;
    through_save_securing_and_wake(Fault::Full { disk }, fleet).await;
}

/// An S3 store out of reach (its endpoint refuses connections): saves and
/// securing fail saying so, a wake waits `starting` (`store_unreachable`)
/// instead of failing; back, everything completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_makes_a_wake_wait_and_loses_nothing() {
    let endpoint = std::env::var("AWS_ENDPOINT_URL")
        .expect("S3 tests need the server scripts/test.sh starts (AWS_ENDPOINT_URL unset)");
    let target = endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let proxy = Proxy::start(target).await;
    let bucket = crate::harness::Env::new(crate::harness::Backend::S3);
    let proxied = format!("http://127.0.0.1:{}", proxy.port);
    let fleet = Fleet::start_on(
        Some(&bucket.store),
        &[],
        &[("AWS_ENDPOINT_URL", proxied.as_str())],
    )
    .await;
    through_save_securing_and_wake(Fault::Unreachable { proxy }, fleet).await;
}
