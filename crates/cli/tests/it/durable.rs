//! Durable homes end to end: a server with a store, real runner processes
//! (each its own "host": own data dir, homes on a loop-mounted btrfs), and
//! sandboxes whose homes are secured on stop, saved while running, brought
//! back elsewhere from the last completed save, and snapshotted.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::plane::{Api, Plane, block_downloads, eventually, metric};
use crate::runner_e2e::{
    RunnerProcess, create_running, force_delete_containers, sh, unmount_homes, wait_sandbox,
};

/// A server with a store (short leases, saves every second allowed) and
/// runners started on demand, each in its own data dir.
pub(crate) struct Fleet {
    pub(crate) plane: Plane,
    store: tempfile::TempDir,
    dir: tempfile::TempDir,
    pub(crate) runners: Vec<RunnerProcess>,
}

impl Fleet {
    async fn start(extra: &[&str]) -> Fleet {
        Fleet::start_on(None, extra, &[]).await
    }

    /// A fleet whose server keeps homes at `store` (a directory or an
    /// `s3://` url; `None`: a directory of its own) and runs with `env`.
    pub(crate) async fn start_on(
        store_at: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Fleet {
        let store = tempfile::tempdir().expect("store dir");
        let store_arg = match store_at {
            Some(at) => at.to_owned(),
            None => store.path().to_str().expect("utf-8").to_owned(),
        };
        let mut args = vec![
            "--store",
            &store_arg,
            "--lease-ttl",
            "3s",
            "--save-interval-min",
            "1s",
        ];
        args.extend_from_slice(extra);
        let plane = Plane::start_with(&args, env, None).await;
        let dir = tempfile::Builder::new()
            .prefix("roost-durable-")
            .tempdir()
            .expect("tempdir");
        Fleet {
            plane,
            store,
            dir,
            runners: Vec::new(),
        }
    }

    pub(crate) fn api(&self) -> &Api {
        &self.plane.org
    }

    fn data_dir(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Starts runner `name` (its data dir named after it); returns its index.
    pub(crate) fn runner(&mut self, name: &str) -> usize {
        let runner = RunnerProcess::start(
            &self.plane.server.url,
            &self.plane.runner_token,
            &self.data_dir(name),
            &[],
        );
        self.runners.push(runner);
        self.runners.len() - 1
    }

    /// kill -9 the runner and delete its data dir: the host is gone (its
    /// containers with it: they would otherwise outlive their state dir).
    fn destroy(&mut self, index: usize) {
        let runner = &mut self.runners[index];
        runner.kill9();
        force_delete_containers(&runner.runtime_root());
        let data = runner.data_dir.clone();
        unmount_homes(&data);
        std::fs::remove_dir_all(&data).expect("delete the runner's data dir");
    }

    pub(crate) async fn create(&self, body: Value) -> String {
        create_running(self.api(), body).await
    }

    pub(crate) async fn get(&self, id: &str) -> Value {
        self.api().get(&format!("/v1/sandboxes/{id}")).await.body
    }

    /// Waits until the sandbox's last completed save is after `after`
    /// (RFC 3339, compared as text: same format and zone).
    pub(crate) async fn wait_saved_after(&self, id: &str, after: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let sandbox = self.get(id).await;
            let saved = sandbox["save"]["last_completed_at"].as_str().unwrap_or("");
            if saved > after {
                return sandbox;
            }
            assert!(
                Instant::now() < deadline,
                "no save completed after {after}: {sandbox}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until everything written to the home before `after` (RFC
    /// 3339) is in a completed save: `save.safe_until` is past it (a save
    /// that finds the home unchanged moves it without a new commit).
    pub(crate) async fn wait_safe_after(&self, id: &str, after: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let sandbox = self.get(id).await;
            let safe = sandbox["save"]["safe_until"].as_str().unwrap_or("");
            if safe > after {
                return sandbox;
            }
            assert!(
                Instant::now() < deadline,
                "nothing written before {after} is known saved: {sandbox}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Object GETs the block service answered (runners' downloads).
    async fn downloads(&self) -> u64 {
        block_downloads(self.api()).await
    }

    /// Stored bytes uploaded through the block service so far.
    async fn uploaded_bytes(&self) -> u64 {
        metric(self.api(), "roost_block_bytes_total{direction=\"in\"}").await
    }

    fn store_path(&self) -> &Path {
        self.store.path()
    }

    /// Starts runner `name` and waits until sandbox `id` runs on it (its
    /// runner was lost); returns the runner's index.
    async fn recovered_on(&mut self, name: &str, id: &str) -> usize {
        let index = self.runner(name);
        let runner_id = self.runners[index].runner_id.clone();
        let api = self.api();
        assert!(
            eventually(Duration::from_secs(30), || async {
                let sandbox = api.get(&format!("/v1/sandboxes/{id}")).await.body;
                sandbox["state"] == "running" && sandbox["runner_id"] == runner_id.as_str()
            })
            .await,
            "the sandbox did not come back on runner {name}: {}",
            self.get(id).await
        );
        index
    }
}

/// Takes a snapshot of sandbox `id` and waits (up to a minute, long-polling)
/// until it is `replicated`; returns the snapshot's id.
pub(crate) async fn replicated_snapshot(api: &Api, id: &str) -> String {
    let snapshot = api
        .post(
            &format!("/v1/sandboxes/{id}/snapshots"),
            json!({"durability": "replicated"}),
        )
        .await;
    assert_eq!(snapshot.status, 201, "{snapshot:?}");
    let snapshot_id = snapshot.str("id");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = api
            .get(&format!(
                "/v1/snapshots/{snapshot_id}?wait_for=replicated&timeout=10"
            ))
            .await;
        let durability = &answer.body["durability"];
        if durability == "replicated" {
            return snapshot_id;
        }
        assert!(
            durability != "failed" && Instant::now() < deadline,
            "the snapshot did not replicate: {answer:?}"
        );
    }
}

/// The saved tree `root` of org `org_id` in the local store at `store_dir`,
/// materialised into a fresh temp dir (read from the store itself, not
/// through any runner).
pub(crate) fn materialize_saved(store_dir: &Path, org_id: &str, root: &str) -> tempfile::TempDir {
    let store = store::Store::open(store_dir.to_str().expect("utf-8")).expect("store");
    let org: store::OrgId = org_id.parse().expect("org id");
    let digest: store::Digest = root.parse().expect("a root digest");
    let dest = tempfile::tempdir().expect("dest");
    store::pull::materialize(
        &store,
        &org,
        "check",
        &digest,
        dest.path(),
        &store::pull::PullOptions {
            cache: None,
            fill_cache: false,
            index_path: None,
            store_id: "test".to_owned(),
            index_dev: None,
            check_room: false,
            room_also: None,
        },
        &store::progress::NoProgress,
    )
    .expect("materialise a save");
    dest
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // Runners go before the server (their Drop unmounts their homes).
        self.runners.clear();
    }
}

/// Every file under the home with its mode and content hash, for comparing
/// homes byte for byte.
pub(crate) const LISTING: &str = "cd /workspace && find . -path ./.cache -prune -o -print | sort | while read -r p; do if [ -L \"$p\" ]; then echo \"$p -> $(readlink \"$p\")\"; elif [ -f \"$p\" ]; then echo \"$p $(stat -c %a \"$p\") $(sha256sum < \"$p\" | cut -c1-16)\"; else echo \"$p/ $(stat -c %a \"$p\")\"; fi; done";

const WRITE_HOME: &str = "cd /workspace && mkdir -p src/deep/er notes && printf 'hello\\n' > notes/a.txt \
    && head -c 3000000 /dev/urandom > big.bin && printf '#!/bin/sh\\necho hi\\n' > src/run.sh \
    && chmod 0750 src/run.sh && chmod 0700 notes && ln -s notes/a.txt link \
    && echo deep > src/deep/er/f && mkdir -p __pycache__ && echo junk > __pycache__/x.pyc";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_home_is_secured_on_stop_and_wakes_on_another_runner() {
    let mut fleet = Fleet::start(&[]).await;
    let first = fleet.runner("a");
    let id = fleet.create(json!({"storage_class": "durable"})).await;
    let api = fleet.api();
    sh(api, &id, WRITE_HOME).await;
    let before = sh(api, &id, LISTING).await;
    assert!(before.contains("./src/run.sh 750"), "{before}");

    // Stop: stopping → securing → stopped, the save recorded.
    assert_eq!(
        api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
            .await
            .status,
        202
    );
    let stopped = wait_sandbox(api, &id, "stopped").await;
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert_eq!(stopped["save"]["state"], "ok", "{stopped}");
    assert!(
        stopped["save"]["last_completed_at"].is_string(),
        "{stopped}"
    );
    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.body;
    let events = events["events"].as_array().expect("events");
    // The commit of the securing says so, while it is still `securing`.
    assert!(
        events
            .iter()
            .any(|e| e["state"] == "securing" && e["reason"] == "securing_committed"),
        "{events:#?}"
    );
    let states: Vec<&str> = events
        .iter()
        .filter(|e| e["reason"] != "securing_committed")
        .filter_map(|e| e["state"].as_str())
        .collect();
    let securing = states
        .iter()
        .position(|s| *s == "securing")
        .expect("securing event");
    assert_eq!(states[securing - 1], "stopping", "{states:?}");
    assert_eq!(states[securing + 1], "stopped", "{states:?}");

    // The first runner is drained (maintenance): the start lands on
    // another, which wakes the home from the store.
    let second = fleet.runner("b");
    let api = fleet.api();
    let first_id = fleet.runners[first].runner_id.clone();
    let drained = fleet
        .plane
        .admin
        .post(&format!("/v1/admin/runners/{first_id}/drain"), json!({}))
        .await;
    assert_eq!(drained.status, 200, "{drained:?}");
    assert_eq!(drained.body["drain"], "drain", "{drained:?}");
    assert_eq!(
        api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
            .await
            .status,
        202
    );
    let running = wait_sandbox(api, &id, "running").await;
    assert_eq!(
        running["runner_id"],
        fleet.runners[second].runner_id.as_str(),
        "{running}"
    );
    let after = sh(api, &id, LISTING).await;
    let expected: String = before
        .lines()
        .filter(|l| !l.contains("__pycache__"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(after, expected, "the home came back different");
    assert!(!after.contains("x.pyc"), "an excluded file was saved");

    // Stop and start on the same runner: (almost) nothing comes down.
    sh(api, &id, "echo more > /workspace/more.txt").await;
    api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    assert_eq!(wait_sandbox(api, &id, "stopped").await["state"], "stopped");
    let downloads = fleet.downloads().await;
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    let again = wait_sandbox(api, &id, "running").await;
    assert_eq!(again["runner_id"], fleet.runners[second].runner_id.as_str());
    assert!(
        fleet.downloads().await - downloads <= 2,
        "a wake on the last runner downloaded objects"
    );
    assert_eq!(sh(api, &id, "cat /workspace/more.txt").await, "more\n");
    fleet.runners[second].assert_no_errors();

    // What the saves and wakes cost is on /metrics: two securings, a wake
    // elsewhere that downloaded the home, one here that downloaded nothing.
    let count = |name: &'static str| metric(api, name);
    assert!(count("roost_save_duration_seconds_count").await >= 2);
    assert!(count("roost_save_uploaded_bytes_count").await >= 2);
    assert_eq!(
        count("roost_wake_downloaded_bytes_count{runner=\"other\"}").await,
        1
    );
    assert_eq!(
        count("roost_wake_downloaded_bytes_count{runner=\"same\"}").await,
        1
    );
    assert_eq!(
        count("roost_wake_downloaded_bytes_bucket{runner=\"same\",le=\"1000\"}").await,
        1,
        "a wake on the same runner downloaded something"
    );
    assert_eq!(
        count("roost_wake_downloaded_bytes_bucket{runner=\"other\",le=\"1000\"}").await,
        0,
        "the wake elsewhere downloaded under 1 kB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_save_brings_the_home_back_after_its_host_dies() {
    let mut fleet = Fleet::start(&[]).await;
    let first = fleet.runner("a");
    let id = fleet
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    let api = fleet.api();
    let created = fleet.get(&id).await;
    assert_eq!(created["save"]["interval_s"], 1, "{created}");
    sh(api, &id, "echo precious > /workspace/work.txt").await;
    let written = fleet.get(&id).await["updated_at"]
        .as_str()
        .expect("time")
        .to_owned();
    let now = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let saved = fleet.wait_safe_after(&id, &now.max(written)).await;
    // A save completed without error. (`delayed` may show by the time the
    // record is read on a loaded machine: the runner can freeze for want
    // of a timely heartbeat and skip a 1 s interval; that is honest, and
    // not what this test is about.)
    assert_ne!(saved["save"]["state"], "failing", "{saved}");
    assert!(saved["save"]["last_error"].is_null(), "{saved}");
    assert!(saved["save"]["root"].is_string(), "{saved}");

    fleet.destroy(first);
    fleet.recovered_on("b", &id).await;
    let api = fleet.api();
    let recovered = fleet.get(&id).await;
    assert!(recovered["epoch"].as_u64() > Some(1), "{recovered}");
    assert_eq!(sh(api, &id, "cat /workspace/work.txt").await, "precious\n");
    // Running saves were timed, their snapshots too; the lag is short.
    assert!(metric(api, "roost_save_snapshot_seconds_count").await >= 1);
    let text = crate::plane::metrics_text(api).await;
    let lag: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("roost_save_lag_seconds_max "))
        .and_then(|v| v.parse().ok())
        .expect("roost_save_lag_seconds_max");
    assert!(lag < 60.0, "save lag {lag} s with a 1 s interval");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_save_is_one_instant_of_the_home() {
    let mut fleet = Fleet::start(&[]).await;
    fleet.runner("a");
    let id = fleet
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    let api = fleet.api();
    // Replaces a, then b (each whole, by rename), forever: at any instant
    // b is a or a - 1.
    let writer = api
        .post(
            &format!("/v1/sandboxes/{id}/commands"),
            json!({"argv": ["sh", "-c", "cd /workspace; i=0; while :; do i=$((i+1)); echo $i > a.new; mv a.new a; echo $i > b.new; mv b.new b; done"]}),
        )
        .await;
    assert_eq!(writer.status, 201, "{writer:?}");
    let mut roots: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while roots.len() < 3 {
        assert!(
            Instant::now() < deadline,
            "saves did not complete: {roots:?}"
        );
        let sandbox = fleet.get(&id).await;
        if let Some(root) = sandbox["save"]["root"].as_str()
            && !roots.iter().any(|r| r == root)
        {
            roots.push(root.to_owned());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut counters = Vec::new();
    for root in &roots {
        let dest = materialize_saved(fleet.store_path(), &fleet.plane.org_id, root);
        let read = |name: &str| -> u64 {
            std::fs::read_to_string(dest.path().join(name))
                .unwrap_or_default()
                .trim()
                .parse()
                .unwrap_or(0)
        };
        let (a, b) = (read("a"), read("b"));
        assert!(
            a == b || a == b + 1,
            "save {root} is not one instant: a={a} b={b}"
        );
        counters.push(a);
    }
    assert!(counters.windows(2).all(|w| w[0] <= w[1]), "{counters:?}");
    assert!(counters.iter().any(|c| *c > 0), "{counters:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_files_of_two_homes_are_stored_once_and_the_store_switch_refuses_durable() {
    let mut fleet = Fleet::start(&[]).await;
    fleet.runner("a");
    let api = fleet.api();
    let toolchain = "mkdir -p /workspace/.toolchain && seq 1 2000000 > /workspace/.toolchain/lib.a";
    let one = fleet.create(json!({"storage_class": "durable"})).await;
    sh(api, &one, toolchain).await;
    api.post(&format!("/v1/sandboxes/{one}/stop"), json!({}))
        .await;
    assert_eq!(wait_sandbox(api, &one, "stopped").await["state"], "stopped");
    let after_first = fleet.uploaded_bytes().await;
    let two = fleet.create(json!({"storage_class": "durable"})).await;
    sh(api, &two, toolchain).await;
    api.post(&format!("/v1/sandboxes/{two}/stop"), json!({}))
        .await;
    assert_eq!(wait_sandbox(api, &two, "stopped").await["state"], "stopped");
    let second_upload = fleet.uploaded_bytes().await - after_first;
    // The 14 MB file compresses to a few MB; its blocks went up once.
    assert!(after_first > 1_000_000, "first upload {after_first}");
    assert!(
        second_upload < 100_000,
        "the second home uploaded {second_upload} bytes"
    );

    let bare = Plane::start_with(
        &["--store", fleet.store_path().to_str().expect("utf-8")],
        &[("ROOST_HOME_STORE", "false")],
        None,
    )
    .await;
    let refused = bare
        .org
        .post("/v1/sandboxes", json!({"storage_class": "durable"}))
        .await;
    refused.assert_error(422, "unsupported_capability");
    assert_eq!(
        refused.body["error"]["details"]["missing"],
        json!(["storage_class:durable"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_replicate_give_children_and_fail_past_their_deadline() {
    let mut fleet = Fleet::start(&[]).await;
    let runner = fleet.runner("a");
    let id = fleet.create(json!({"storage_class": "standard"})).await;
    let api = fleet.api();
    sh(api, &id, "echo parent > /workspace/p.txt").await;

    let request = |durability: &str| json!({"durability": durability});
    let first = api
        .post_with(
            &format!("/v1/sandboxes/{id}/snapshots"),
            request("replicated"),
            &[("idempotency-key", "snap-1")],
        )
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.body["durability"], "pending");
    let again = api
        .post_with(
            &format!("/v1/sandboxes/{id}/snapshots"),
            request("replicated"),
            &[("idempotency-key", "snap-1")],
        )
        .await;
    assert_eq!(
        again.body["id"], first.body["id"],
        "the same key made a second snapshot"
    );
    let snapshot_id = first.str("id");
    let replicated = api
        .get(&format!(
            "/v1/snapshots/{snapshot_id}?wait_for=replicated&timeout=20"
        ))
        .await;
    assert_eq!(
        replicated.body["durability"], "replicated",
        "{replicated:?}"
    );
    assert!(replicated.body["root"].is_string());
    assert!(replicated.body["captured_at"].is_string());

    // A child starts as the snapshot, then has its own future.
    sh(api, &id, "echo changed > /workspace/p.txt").await;
    let child = fleet
        .create(json!({"storage_class": "durable", "from_snapshot": snapshot_id}))
        .await;
    let child_record = fleet.get(&child).await;
    assert_eq!(child_record["from_snapshot"], snapshot_id.as_str());
    assert_eq!(sh(api, &child, "cat /workspace/p.txt").await, "parent\n");
    sh(api, &child, "echo child > /workspace/c.txt").await;
    assert_eq!(
        sh(api, &id, "cat /workspace/p.txt; ls /workspace").await,
        "changed\np.txt\n"
    );

    // A runner that cannot act (stopped with SIGSTOP) misses a deadline.
    fleet.runners[runner].signal(rustix::process::Signal::STOP);
    let late = api
        .post(
            &format!("/v1/sandboxes/{id}/snapshots"),
            json!({"durability": "replicated", "deadline": 1}),
        )
        .await;
    assert_eq!(late.status, 201, "{late:?}");
    let failed = api
        .get(&format!(
            "/v1/snapshots/{}?wait_for=replicated&timeout=10",
            late.str("id")
        ))
        .await;
    fleet.runners[runner].signal(rustix::process::Signal::CONT);
    assert_eq!(failed.body["durability"], "failed", "{failed:?}");
    assert_eq!(failed.body["reason"], "durability_deadline_exceeded");

    let listed = api.get(&format!("/v1/snapshots?sandbox_id={id}")).await;
    assert_eq!(listed.body["snapshots"].as_array().map(Vec::len), Some(2));
    assert_eq!(
        api.delete(&format!("/v1/snapshots/{snapshot_id}"))
            .await
            .status,
        200
    );
    api.get(&format!("/v1/snapshots/{snapshot_id}"))
        .await
        .assert_error(404, "not_found");
    // The child keeps its home whatever happens to the snapshot.
    assert_eq!(sh(api, &child, "cat /workspace/p.txt").await, "parent\n");
}

/// The commit of a save is a compare-and-swap guarded by the placement:
/// a stale epoch or another runner is `fenced` and changes nothing; a root
/// that is not in the store is refused; only then does the record move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_commit_from_a_stale_placement_is_fenced_and_changes_nothing() {
    let fleet = Fleet::start(&[]).await;
    let plane = &fleet.plane;
    let runner = plane.runner("r1", "on_demand", crate::plane::ALL).await;
    let other = plane.runner("r2", "on_demand", crate::plane::ALL).await;
    let sandbox = plane
        .running_sandbox(&runner, json!({"storage_class": "durable"}))
        .await;
    let id = sandbox["id"].as_str().expect("id");
    let epoch = sandbox["epoch"].as_u64().expect("epoch");
    let org_id = &plane.org_id;

    // A one-file tree, uploaded through the block service as a runner would.
    let content = b"saved content";
    let block = store::Digest::of(content);
    let mut tree = store::tree::Tree::default();
    tree.entries.push(store::tree::Entry {
        name: b"f".to_vec(),
        mode: 0o644,
        size: content.len() as u64,
        mtime_ns: 0,
        kind: store::tree::EntryKind::File {
            blocks: vec![block],
        },
    });
    let (root, tree_bytes) = tree.encode().expect("tree");
    let put = |path: String, body: Vec<u8>| {
        let api = Api::new(&runner.api.url, &runner.api.token);
        async move {
            api.send(reqwest::Method::PUT, &path, Some(body), &[])
                .await
                .expect("request")
        }
    };
    let save = |runner_id: &str, epoch: u64, root: &str| json!({"runner_id": runner_id, "epoch": epoch, "outcome": "completed", "root": root});
    let saves = format!("/v1/runner/sandboxes/{id}/saves");

    // Nothing uploaded yet: the root is not there.
    runner
        .api
        .post(&saves, save(&runner.id, epoch, &root.to_hex()))
        .await
        .assert_error(409, "invalid_state");
    assert_eq!(
        put(
            format!("/v1/blocks/{org_id}/blocks/{}", block.to_hex()),
            store::block::encode(content)
        )
        .await
        .status,
        204
    );
    assert_eq!(
        put(
            format!("/v1/blocks/{org_id}/trees/{}", root.to_hex()),
            store::block::encode(&tree_bytes)
        )
        .await
        .status,
        204
    );
    // A stale epoch, or another runner: fenced, the record keeps no root.
    for (by, at) in [(&runner, epoch - 1), (&other, epoch)] {
        let refused = by.api.post(&saves, save(&by.id, at, &root.to_hex())).await;
        refused.assert_error(409, "fenced");
    }
    // Another runner naming this one: no such runner, for its credential.
    other
        .api
        .post(&saves, save(&runner.id, epoch, &root.to_hex()))
        .await
        .assert_error(404, "not_found");
    let unchanged = fleet.get(id).await;
    assert!(unchanged["save"]["root"].is_null(), "{unchanged}");
    assert!(
        unchanged["save"]["last_completed_at"].is_null(),
        "{unchanged}"
    );
    // The current placement commits.
    let committed = runner
        .api
        .post(&saves, save(&runner.id, epoch, &root.to_hex()))
        .await;
    assert_eq!(committed.status, 200, "{committed:?}");
    assert_eq!(committed.body["save"]["root"], root.to_hex());
    assert_eq!(committed.body["save"]["state"], "ok");
    // A failed attempt says so on the record, and the root stays.
    let failed = runner
        .api
        .post(
            &saves,
            json!({"runner_id": runner.id, "epoch": epoch, "outcome": "failed", "error": "disk full"}),
        )
        .await;
    assert_eq!(failed.body["save"]["state"], "failing", "{failed:?}");
    assert_eq!(failed.body["save"]["last_error"], "disk full");
    assert_eq!(failed.body["save"]["root"], root.to_hex());
}

/// A one-file tree uploaded through the block service as a runner would;
/// returns its root.
async fn upload_one_file_tree(
    runner: &crate::plane::TestRunner,
    org_id: &str,
    content: &[u8],
) -> store::Digest {
    let block = store::Digest::of(content);
    let mut tree = store::tree::Tree::default();
    tree.entries.push(store::tree::Entry {
        name: b"f".to_vec(),
        mode: 0o644,
        size: content.len() as u64,
        mtime_ns: 0,
        kind: store::tree::EntryKind::File {
            blocks: vec![block],
        },
    });
    let (root, tree_bytes) = tree.encode().expect("tree");
    let api = Api::new(&runner.api.url, &runner.api.token);
    for (path, body) in [
        (
            format!("/v1/blocks/{org_id}/blocks/{}", block.to_hex()),
            store::block::encode(content),
        ),
        (
            format!("/v1/blocks/{org_id}/trees/{}", root.to_hex()),
            store::block::encode(&tree_bytes),
        ),
    ] {
        let put = api
            .send(reqwest::Method::PUT, &path, Some(body), &[])
            .await
            .expect("request");
        assert_eq!(put.status, 204, "{path}");
    }
    root
}

/// Audit finding (2026-12-07): a save whose commit waited (a gc holding the
/// store's commit lock, a slow store) behind a later save of the same
/// placement moved the record and the store's `{id}` back to the older
/// capture, and a wake restored it. Now the later save stands, the older
/// one is answered with the record as it is, and `{id}` names the record's
/// root even after a save that left it behind (a lost pointer write) or
/// one refused for an incomplete tree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_committed_after_a_later_one_of_its_placement_never_moves_the_home_back() {
    let fleet = Fleet::start(&[]).await;
    let plane = &fleet.plane;
    let runner = plane.runner("r1", "on_demand", crate::plane::ALL).await;
    let sandbox = plane
        .running_sandbox(&runner, json!({"storage_class": "durable"}))
        .await;
    let id = sandbox["id"].as_str().expect("id");
    let epoch = sandbox["epoch"].as_u64().expect("epoch");
    let org_id = &plane.org_id;
    let earlier = upload_one_file_tree(&runner, org_id, b"the home at one").await;
    let later = upload_one_file_tree(&runner, org_id, b"the home at two").await;
    let saves = format!("/v1/runner/sandboxes/{id}/saves");
    let save = |root: &store::Digest, captured_at_ms: i64| {
        json!({"runner_id": runner.id, "epoch": epoch, "outcome": "completed",
               "root": root.to_hex(), "captured_at_ms": captured_at_ms})
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let store = store::Store::open(fleet.store.path().to_str().expect("utf-8")).expect("store");
    let org: store::OrgId = org_id.parse().expect("org");
    let home: store::HomeName = id.parse().expect("home name");
    let pointer = || store.read_home(&org, &home).expect("read the pointer");

    let committed = runner.api.post(&saves, save(&later, now_ms - 1_000)).await;
    assert_eq!(committed.status, 200, "{committed:?}");
    let saved_at = committed.body["save"]["last_completed_at"].clone();
    // The earlier capture's commit arrives after: the record keeps the later.
    let stale = runner
        .api
        .post(&saves, save(&earlier, now_ms - 5_000))
        .await;
    assert_eq!(stale.status, 200, "{stale:?}");
    assert_eq!(stale.body["save"]["root"], later.to_hex(), "{stale:?}");
    let record = fleet.get(id).await;
    assert_eq!(record["save"]["root"], later.to_hex(), "{record}");
    assert_eq!(record["save"]["last_completed_at"], saved_at, "{record}");
    assert_eq!(pointer(), Some(later), "the store's home moved back");

    // `{id}` lost (a pointer write that never happened): the next save,
    // even one refused for a tree not uploaded, first points it back at
    // the record's root before `{id}-next` moves on.
    store.delete_home(&org, &home).expect("delete the pointer");
    let absent = store::Digest::of(b"never uploaded");
    runner
        .api
        .post(&saves, save(&absent, now_ms))
        .await
        .assert_error(409, "invalid_state");
    assert_eq!(pointer(), Some(later), "the record's root is unpinned");

    // A later capture commits as ever.
    let next = upload_one_file_tree(&runner, org_id, b"the home at three").await;
    let newer = runner.api.post(&saves, save(&next, now_ms + 1)).await;
    assert_eq!(newer.body["save"]["root"], next.to_hex(), "{newer:?}");
    assert_eq!(pointer(), Some(next));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_on_an_s3_store_secures_homes_there_and_wakes_them_elsewhere() {
    // The S3-compatible server scripts/test.sh starts; the server process
    // inherits its AWS_* settings. Runners never see them.
    let bucket = crate::harness::Env::new(crate::harness::Backend::S3);
    let plane = Plane::start(&["--store", &bucket.store, "--lease-ttl", "3s"]).await;
    let dir = tempfile::Builder::new()
        .prefix("roost-durable-s3-")
        .tempdir()
        .expect("tempdir");
    // Runners get no store credentials: everything goes through the
    // server's block service.
    let start_runner = |name: &str| {
        RunnerProcess::start(
            &plane.server.url,
            &plane.runner_token,
            &dir.path().join(name),
            &[
                ("AWS_ACCESS_KEY_ID", "none"),
                ("AWS_SECRET_ACCESS_KEY", "none"),
            ],
        )
    };
    let first = start_runner("a");
    let api = &plane.org;
    let created = api
        .post("/v1/sandboxes", json!({"storage_class": "durable"}))
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let id = created.str("id");
    assert_eq!(wait_sandbox(api, &id, "running").await["state"], "running");
    sh(api, &id, WRITE_HOME).await;
    let before = sh(api, &id, LISTING).await;
    api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    assert_eq!(wait_sandbox(api, &id, "stopped").await["state"], "stopped");

    // The home is in the bucket.
    let url = bucket.store.clone();
    // The store crate is synchronous (it runs its own runtime for S3).
    let objects = tokio::task::spawn_blocking(move || {
        store::backend::open(&url)
            .expect("the S3 store")
            .list("")
            .expect("list the bucket")
    })
    .await
    .expect("list");
    assert!(
        objects.iter().any(|o| o.key.ends_with(".pack"))
            && objects.iter().any(|o| o.key.ends_with(".idx")),
        "no packs of objects in {}: {objects:?}",
        bucket.store
    );

    // Woken on another runner (the first drained), from the bucket.
    let second = start_runner("b");
    let drained = plane
        .admin
        .post(
            &format!("/v1/admin/runners/{}/drain", first.runner_id),
            json!({}),
        )
        .await;
    assert_eq!(drained.status, 200, "{drained:?}");
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    let running = wait_sandbox(api, &id, "running").await;
    assert_eq!(running["runner_id"], second.runner_id.as_str(), "{running}");
    let after = sh(api, &id, LISTING).await;
    let expected: String = before
        .lines()
        .filter(|l| !l.contains("__pycache__"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(after, expected, "the home came back different");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn securing_shows_the_bytes_still_to_go_and_a_start_meanwhile_runs_it_again() {
    let mut fleet = Fleet::start(&[]).await;
    fleet.runner("a");
    let id = fleet.create(json!({"storage_class": "durable"})).await;
    let api = fleet.api();
    // Incompressible, so the upload takes a few seconds here.
    sh(
        api,
        &id,
        "head -c 400000000 /dev/urandom > /workspace/big.bin",
    )
    .await;
    api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let pending = loop {
        let sandbox = fleet.get(&id).await;
        if sandbox["state"] == "securing"
            && let Some(pending) = sandbox["save"]["bytes_pending"].as_u64()
            && pending > 0
        {
            break pending;
        }
        assert!(
            sandbox["state"] != "stopped",
            "secured without ever showing bytes to go: {sandbox}"
        );
        assert!(Instant::now() < deadline, "not securing: {sandbox}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        pending <= 400_000_000,
        "more to go than the home holds: {pending}"
    );

    // Started again while still securing: once the home is secured, it
    // runs again by itself, with everything in it.
    let started = api
        .post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    assert_eq!(started.status, 202, "{started:?}");
    let running = wait_sandbox(api, &id, "running").await;
    assert_eq!(running["state"], "running", "{running}");
    assert_eq!(running["save"]["state"], "ok", "{running}");
    assert_eq!(
        sh(api, &id, "stat -c %s /workspace/big.bin").await,
        "400000000\n"
    );
    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.body;
    let states: Vec<(String, String)> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            (
                e["state"].as_str().unwrap_or("").to_owned(),
                e["reason"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    let secured = states
        .iter()
        .position(|(s, _)| s == "stopped")
        .unwrap_or_else(|| panic!("never stopped: {states:?}"));
    // The start asked while securing waited for the stop (said while
    // securing), then followed it: wanted running, then placed.
    assert!(
        states[..secured].contains(&("securing".to_owned(), "start_requested".to_owned())),
        "{states:?}"
    );
    assert_eq!(
        states[secured + 1..secured + 3],
        [
            ("stopped".to_owned(), "start_requested".to_owned()),
            ("pending".to_owned(), "start_requested".to_owned())
        ],
        "{states:?}"
    );
}

/// Makes a directory tree immutable (even root cannot write in it) until
/// dropped: a store that stops taking writes.
struct Immutable(PathBuf);

impl Immutable {
    fn new(path: &Path) -> Immutable {
        let status = std::process::Command::new("chattr")
            .args(["-R", "+i"])
            .arg(path)
            .status()
            .expect("chattr");
        assert!(status.success(), "chattr +i {}", path.display());
        Immutable(path.to_path_buf())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr")
            .args(["-R", "-i"])
            .arg(&self.0)
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_securing_that_fails_says_so_keeps_the_home_and_ends_once_the_store_takes_writes() {
    let mut fleet = Fleet::start(&[]).await;
    let first = fleet.runner("a");
    let id = fleet.create(json!({"storage_class": "durable"})).await;
    let api = fleet.api();
    sh(api, &id, "echo precious > /workspace/work.txt").await;
    let home_file = fleet.runners[first]
        .data_dir
        .join("volumes/homes")
        .join(&id)
        .join("work.txt");

    let frozen_store = Immutable::new(fleet.store_path());
    api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            let sandbox = api.get(&format!("/v1/sandboxes/{id}")).await.body;
            sandbox["state"] == "securing" && sandbox["save"]["state"] == "failing"
        })
        .await,
        "the failed securing does not say so: {}",
        fleet.get(&id).await
    );
    let failing = fleet.get(&id).await;
    assert!(
        failing["save"]["last_error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{failing}"
    );
    // Nothing is deleted before it is in the store.
    assert_eq!(
        std::fs::read_to_string(&home_file).expect("the home is kept"),
        "precious\n"
    );

    drop(frozen_store);
    let stopped = wait_sandbox(api, &id, "stopped").await;
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert_eq!(stopped["save"]["state"], "ok", "{stopped}");
    // What was secured is what comes back elsewhere.
    let second = fleet.runner("b");
    let first_id = fleet.runners[first].runner_id.clone();
    let api = fleet.api();
    fleet
        .plane
        .admin
        .post(&format!("/v1/admin/runners/{first_id}/drain"), json!({}))
        .await;
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    let running = wait_sandbox(api, &id, "running").await;
    assert_eq!(
        running["runner_id"],
        fleet.runners[second].runner_id.as_str(),
        "{running}"
    );
    assert_eq!(sh(api, &id, "cat /workspace/work.txt").await, "precious\n");
}

/// Issue 14: a home nested 700 directories deep (`mkdir -p d/d/…`, no
/// crafting) overflowed the runner's stack on its next save and took every
/// other org's sandbox on that runner down with it. Now that sandbox's
/// saves fail with a reason naming the bound, and the runner keeps serving
/// its neighbour, which keeps running and saving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_nested_too_deep_fails_its_own_saves_and_a_neighbour_keeps_saving() {
    let mut fleet = Fleet::start(&[]).await;
    fleet.runner("a");
    let body = json!({"storage_class": "durable", "save_interval_s": 1});
    let hostile = fleet.create(body.clone()).await;
    let neighbour = fleet.create(body).await;
    let api = fleet.api();
    sh(
        api,
        &hostile,
        "cd /workspace && p=d && i=1 && while [ $i -lt 700 ]; do p=$p/d; i=$((i+1)); done && mkdir -p $p",
    )
    .await;
    assert!(
        eventually(Duration::from_secs(40), || async {
            let sandbox = api.get(&format!("/v1/sandboxes/{hostile}")).await.body;
            sandbox["save"]["last_error"]
                .as_str()
                .is_some_and(|error| error.contains("too deep"))
        })
        .await,
        "no save failed naming the bound: {}",
        fleet.get(&hostile).await
    );
    sh(api, &neighbour, "echo still here > /workspace/n.txt").await;
    let now = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let saved = fleet.wait_safe_after(&neighbour, &now).await;
    assert!(saved["save"]["last_error"].is_null(), "{saved}");
    assert_eq!(saved["state"], "running", "{saved}");
    assert_eq!(fleet.get(&hostile).await["state"], "running");
    assert_eq!(
        sh(api, &neighbour, "cat /workspace/n.txt").await,
        "still here\n"
    );
}

/// Issue 13, points 1 and 2, through real processes: a runner killed
/// (kill -9, at `runner:secure_before_upload`) while a durable sandbox
/// with no completed save secures its home. The record is `recovering`
/// (never `stopped` with a save that does not exist) and says it restores
/// an empty home; the runner, back on the same data dir after its lease
/// expired, keeps the home aside (read-only, unmounted) instead of
/// deleting the only copy, the record lists it, a salvage makes it a
/// snapshot whose child has the work back, a start runs from what the
/// record said, and a discard deletes the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_lost_while_securing_keeps_the_only_copy_aside_and_the_record_says_so() {
    let mut fleet = Fleet::start(&[]).await;
    let first = fleet.runner("a");
    let id = fleet.create(json!({"storage_class": "durable"})).await;
    let api = fleet.api();
    sh(
        api,
        &id,
        "mkdir -p /workspace/many && cd /workspace/many && for i in $(seq 1 2000); do echo $i > f$i; done && echo precious > /workspace/work.txt",
    )
    .await;
    fleet.runners[first].restart(&[("ROOST_FAILPOINT", "runner:secure_before_upload")]);
    let runner_id = fleet.runners[first].runner_id.clone();
    let api = fleet.api();
    api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !fleet.runners[first].exited() {
        assert!(
            Instant::now() < deadline,
            "the runner never reached securing: {}",
            fleet.get(&id).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let api = fleet.api();
    assert!(
        eventually(Duration::from_secs(30), || async {
            api.get(&format!("/v1/sandboxes/{id}")).await.body["state"] == "recovering"
        })
        .await,
        "not recovering after the lease: {}",
        fleet.get(&id).await
    );
    let lost = fleet.get(&id).await;
    assert_eq!(lost["state_reason"], "node_lost", "{lost}");
    assert_eq!(lost["desired"], "stopped", "{lost}");
    assert_eq!(lost["save"]["state"], "failing", "{lost}");
    assert!(lost["save"]["root"].is_null(), "{lost}");
    assert_eq!(lost["recovery"]["restores"], "empty", "{lost}");

    // The runner comes back on the same data dir: the home is kept aside.
    fleet.runners[first].restart(&[]);
    let api = fleet.api();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let sandbox = api.get(&format!("/v1/sandboxes/{id}")).await.body;
            sandbox["kept_copies"]
                .as_array()
                .is_some_and(|c| c.len() == 1)
        })
        .await,
        "the kept copy is not listed: {}",
        fleet.get(&id).await
    );
    let listed = fleet.get(&id).await;
    let copy = &listed["kept_copies"][0];
    assert_eq!(copy["runner_id"], runner_id.as_str(), "{listed}");
    assert_eq!(copy["reason"], "unsaved_writes", "{listed}");
    assert!(copy["bytes"].as_u64().is_some_and(|b| b > 2000), "{listed}");
    assert!(copy["kept_at"].is_string(), "{listed}");
    let copy_id = copy["id"].as_str().expect("a copy id").to_owned();
    let kept_root = fleet.runners[first].data_dir.join("volumes/kept").join(&id);
    let names: Vec<PathBuf> = std::fs::read_dir(&kept_root)
        .expect("the kept copies' dir")
        .map(|entry| entry.expect("an entry").path())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let kept = &names[0];
    assert_eq!(
        std::fs::read_to_string(kept.join("work.txt")).expect("the work is kept"),
        "precious\n"
    );
    assert_eq!(
        std::fs::read_dir(kept.join("many")).expect("many").count(),
        2000
    );
    assert!(
        std::fs::write(kept.join("work.txt"), "overwritten\n").is_err(),
        "the kept copy is read-only, even for root"
    );

    // Salvaged into a snapshot with the CLI (a retry with the same key is
    // the same snapshot): the runner holding the copy uploads it (the
    // sandbox is placed nowhere: only the salvage lets it into the org's
    // objects), and a child created from it has the work back. The copy
    // stays.
    let salvage = || {
        let mut command = std::process::Command::new(crate::harness::BIN);
        command
            .args([
                "sandbox",
                "salvage-kept",
                &id,
                &copy_id,
                "--idempotency-key",
                "salvage-1",
                "--json",
            ])
            .env("ROOST_URL", &api.url)
            .env("ROOST_TOKEN", &api.token)
            .env_remove("ROOST_LOG");
        async move {
            let output = tokio::task::spawn_blocking(move || command.output().expect("run roost"))
                .await
                .expect("join");
            assert!(
                output.status.success(),
                "salvage-kept: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            serde_json::from_slice::<Value>(&output.stdout).expect("one JSON snapshot")
        }
    };
    let receipt = salvage().await;
    assert_eq!(receipt["sandbox_id"], id.as_str(), "{receipt}");
    assert_eq!(
        receipt["salvaged_from"]["copy_id"],
        copy_id.as_str(),
        "{receipt}"
    );
    assert_eq!(receipt["salvaged_from"]["runner_id"], runner_id.as_str());
    assert_eq!(receipt["salvaged_from"]["kept_at"], copy["kept_at"]);
    let snapshot_id = receipt["id"].as_str().expect("an id").to_owned();
    assert_eq!(salvage().await["id"], snapshot_id.as_str(), "the retry");
    let deadline = Instant::now() + Duration::from_secs(120);
    let salvaged = loop {
        let answer = api
            .get(&format!(
                "/v1/snapshots/{snapshot_id}?wait_for=replicated&timeout=20"
            ))
            .await
            .body;
        if answer["durability"] == "replicated" || answer["durability"] == "failed" {
            break answer;
        }
        assert!(
            Instant::now() < deadline,
            "the salvage never ended: {answer}"
        );
    };
    assert_eq!(salvaged["durability"], "replicated", "{salvaged}");
    assert!(salvaged["root"].is_string(), "{salvaged}");
    assert_eq!(salvaged["salvaged_from"], receipt["salvaged_from"]);
    let child = fleet
        .create(json!({"storage_class": "durable", "from_snapshot": snapshot_id}))
        .await;
    let api = fleet.api();
    assert_eq!(
        sh(api, &child, "cat /workspace/work.txt").await,
        "precious\n"
    );
    assert_eq!(
        sh(
            api,
            &child,
            "ls /workspace/many | wc -l && cat /workspace/many/f1234"
        )
        .await,
        "2000\n1234\n"
    );
    assert!(kept.join("work.txt").is_file(), "the salvaged copy stays");
    assert_eq!(
        fleet.get(&id).await["kept_copies"][0]["id"],
        copy_id.as_str()
    );

    // Started: it runs from what the record said (an empty home); the
    // kept copy is not what it mounts.
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    let running = wait_sandbox(api, &id, "running").await;
    assert_eq!(running["state"], "running", "{running}");
    assert_eq!(sh(api, &id, "ls -A /workspace | wc -l").await, "0\n");
    sh(api, &id, "echo new > /workspace/work.txt").await;
    assert_eq!(
        std::fs::read_to_string(kept.join("work.txt")).expect("still kept"),
        "precious\n"
    );

    // Discarded by its org: the runner deletes it.
    let discarded = api
        .post(
            &format!("/v1/sandboxes/{id}/kept/{copy_id}/discard"),
            json!({}),
        )
        .await;
    assert_eq!(discarded.status, 200, "{discarded:?}");
    assert!(discarded.body.get("kept_copies").is_none(), "{discarded:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while kept.exists() {
        assert!(Instant::now() < deadline, "the discarded copy stays");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Issue 13, point 7: a home that cannot be woken because an object of its
/// save is corrupt ended `failed`/`home_unavailable` with an event reading
/// "invalid sandbox setting: …", as if the caller had asked for something
/// wrong. It now names the object and what is wrong with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_with_a_corrupt_object_fails_naming_the_object_not_a_setting() {
    let mut fleet = Fleet::start(&[]).await;
    let first = fleet.runner("a");
    let id = fleet.create(json!({"storage_class": "durable"})).await;
    let api = fleet.api();
    let content = format!("the only copy of {id}\n");
    sh(
        api,
        &id,
        &format!("printf '{content}' > /workspace/work.txt"),
    )
    .await;
    api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    let stopped = wait_sandbox(api, &id, "stopped").await;
    assert_eq!(stopped["save"]["state"], "ok", "{stopped}");

    // The block holding work.txt is damaged in the store.
    let org: store::OrgId = fleet.plane.org_id.parse().expect("org id");
    let block = store::store::ObjectId::block(store::Digest::of(content.as_bytes()));
    // In the pack that holds it: its bytes there become garbage.
    let store_dir = fleet.store_path().to_owned();
    let at = store::Store::open(store_dir.to_str().expect("utf-8"))
        .expect("the store")
        .locate(&org, &block)
        .expect("locate")
        .expect("the block is in a pack");
    let pack = store_dir.join(store::Store::pack_key(
        &org,
        &at.pack,
        store::store::PackPart::Data,
    ));
    let mut bytes = std::fs::read(&pack).expect("read the pack");
    let range = at.offset as usize..(at.offset + u64::from(at.length)) as usize;
    bytes[range].fill(0);
    std::fs::write(&pack, bytes).expect("damage the object");

    // Woken on another runner, which must fetch it.
    fleet.runner("b");
    let api = fleet.api();
    let first_id = fleet.runners[first].runner_id.clone();
    let drained = fleet
        .plane
        .admin
        .post(&format!("/v1/admin/runners/{first_id}/drain"), json!({}))
        .await;
    assert_eq!(drained.status, 200, "{drained:?}");
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    let failed = wait_sandbox(api, &id, "failed").await;
    assert_eq!(failed["state_reason"], "home_unavailable", "{failed}");
    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.body;
    let message = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .rev()
        .find(|e| e["reason"] == "home_unavailable")
        .and_then(|e| e["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(
        !message.contains("invalid sandbox setting"),
        "a damaged object is not a setting: {message}"
    );
    assert!(
        message.contains(&block.digest.to_hex()) && message.contains("work.txt"),
        "the message names the object and its file: {message}"
    );
    // Issue 13, point 4: and says what its owner can do, on the record too.
    assert!(
        message.contains("from_snapshot") && message.contains("delete it"),
        "the message says what can be done: {message}"
    );
    assert_eq!(failed["state_message"], message.as_str(), "{failed}");
}

/// The `roost` binary against the fleet's server with its org token.
pub(crate) fn roost_output(fleet: &Fleet, args: &[&str]) -> std::process::Output {
    std::process::Command::new(crate::harness::BIN)
        .args(args)
        .env("ROOST_URL", &fleet.plane.server.url)
        .env("ROOST_TOKEN", &fleet.api().token)
        .env_remove("ROOST_LOG")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run roost")
}

fn roost_json(fleet: &Fleet, args: &[&str]) -> Value {
    let output = roost_output(fleet, args);
    assert!(
        output.status.success(),
        "roost {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("one JSON document")
}

/// Seconds since the Unix epoch of an RFC 3339 time.
fn unix_seconds(rfc3339: &str) -> f64 {
    humantime::parse_rfc3339_weak(rfc3339)
        .expect("an RFC 3339 time")
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
}

fn now_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
}

/// Issue 23: `roost info` states the flags the server runs with and what
/// follows from them; `save.safe_until` moves forward with each completed
/// save and never past the last one, `save.at_risk_s` counts from it, and
/// `/metrics` exports the fleet's worst; after saves, a stop and start and
/// a forced host loss, the observed figures are present and plausible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deployment_publishes_what_a_host_failure_can_cost() {
    let mut fleet = Fleet::start(&[
        "--save-interval",
        "7s",
        "--stop-grace",
        "4s",
        "--fence-margin",
        "1500ms",
    ])
    .await;
    let info = roost_json(&fleet, &["info", "--json"]);
    let configured = &info["configured"];
    assert_eq!(configured["save_interval_s"], 7.0, "{info}");
    assert_eq!(configured["save_interval_min_s"], 1.0, "{info}");
    assert_eq!(configured["stop_grace_s"], 4.0, "{info}");
    assert_eq!(configured["fence_margin_s"], 1.5, "{info}");
    assert_eq!(configured["lease_ttl_s"], 3.0, "{info}");
    assert_eq!(configured["heartbeat_interval_s"], 1.0, "{info}");
    assert_eq!(configured["freeze_after_s"], 2.0, "{info}");
    // lease + margin − a heartbeat, to lease + margin + a reconcile pass.
    assert_eq!(info["bounds"]["detection_min_s"], 3.5, "{info}");
    assert_eq!(info["bounds"]["detection_max_s"], 5.5, "{info}");
    assert_eq!(info["store"]["kind"], "local", "{info}");
    assert_eq!(info["after_host_loss"]["commands_rerun"], false, "{info}");
    assert_eq!(info["observed"]["save_duration"]["count"], 0, "{info}");
    assert!(
        info["observed"]["save_duration"]["p50_s"].is_null(),
        "{info}"
    );

    let first = fleet.runner("a");
    let id = fleet
        .create(json!({"storage_class": "durable", "save_interval_s": 1}))
        .await;
    // A home that keeps changing: every save completes (a save that finds
    // the home unchanged commits nothing, and the observed figures below
    // count completed saves).
    let ticker = fleet
        .api()
        .post(
            &format!("/v1/sandboxes/{id}/commands"),
            json!({"argv": ["sh", "-c", "while true; do date +%s%N > /workspace/tick; sleep 0.3; done"]}),
        )
        .await;
    assert_eq!(ticker.status, 201, "{ticker:?}");
    // safe_until: the last completed save's capture, moving forward only.
    let mut seen: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    while seen.len() < 3 {
        assert!(Instant::now() < deadline, "fewer than 3 saves: {seen:?}");
        let asked_at = now_seconds();
        let sandbox = fleet.get(&id).await;
        let save = &sandbox["save"];
        let at_risk = save["at_risk_s"].as_f64().expect("at_risk_s");
        if let Some(safe) = save["safe_until"].as_str() {
            // The later of the last completed save's capture and a later
            // save's finding the home unchanged since.
            let completed = save["last_completed_at"].as_str().unwrap_or("");
            let unchanged = save["last_unchanged_at"].as_str().unwrap_or("");
            assert_eq!(safe, completed.max(unchanged), "{sandbox}");
            assert!(unix_seconds(safe) <= now_seconds(), "{sandbox}");
            if let Some(last) = seen.last() {
                assert!(
                    unix_seconds(safe) >= unix_seconds(last),
                    "went back: {sandbox}"
                );
            }
            if sandbox["state"] == "running" {
                // At least the time since safe_until when we asked (ms
                // rounding aside), and bounded while saves succeed.
                let since = asked_at - unix_seconds(safe);
                assert!(at_risk >= since - 0.01, "{at_risk} < {since}: {sandbox}");
                assert!(at_risk < 60.0, "{sandbox}");
            }
            if seen.last().map(String::as_str) != Some(safe) {
                seen.push(safe.to_owned());
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let text = roost_output(&fleet, &["sandbox", "get", &id]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("safe until") && text.contains("at risk"),
        "{text}"
    );
    let metrics = crate::plane::metrics_text(fleet.api()).await;
    let worst: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("roost_save_at_risk_seconds_max "))
        .and_then(|v| v.parse().ok())
        .expect("roost_save_at_risk_seconds_max");
    assert!(worst > 0.0 && worst < 60.0, "worst at risk {worst}");

    // A stop secures the home (nothing at risk) and a start wakes it on
    // the same runner.
    let api = fleet.api();
    api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    let stopped = wait_sandbox(api, &id, "stopped").await;
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert_eq!(stopped["save"]["at_risk_s"], 0.0, "{stopped}");
    assert!(
        unix_seconds(stopped["save"]["safe_until"].as_str().expect("saved"))
            >= unix_seconds(seen.last().expect("a save")),
        "{stopped}"
    );
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    let running = wait_sandbox(api, &id, "running").await;
    assert_eq!(running["state"], "running", "{running}");

    // A forced host loss: recovered on another runner.
    fleet.destroy(first);
    fleet.recovered_on("b", &id).await;
    let api = fleet.api();

    let deployment = api.get("/v1/deployment").await.body;
    let observed = &deployment["observed"];
    let figure = |name: &str| -> (u64, f64, f64) {
        let figure = &observed[name];
        let count = figure["count"].as_u64().expect("count");
        let p50 = figure["p50_s"]
            .as_f64()
            .unwrap_or_else(|| panic!("{name} p50: {deployment}"));
        let max = figure["max_s"]
            .as_f64()
            .unwrap_or_else(|| panic!("{name} max: {deployment}"));
        assert!(
            0.0 <= p50 && p50 <= max && max < 120.0,
            "{name}: {deployment}"
        );
        (count, p50, max)
    };
    let (saves, _, longest) = figure("save_duration");
    assert!(saves >= 3, "{deployment}");
    let (lags, lag_p50, _) = figure("save_lag");
    // Each save starts an interval (1 s) after the one before ended.
    assert!(lags >= 2 && lag_p50 >= 0.9, "{deployment}");
    let (recoveries, _, recovery_max) = figure("host_loss_to_running");
    assert!(recoveries >= 1 && recovery_max > 0.0, "{deployment}");
    let (same, _, _) = figure("wake_same_runner");
    assert!(same >= 1, "{deployment}");
    let (other, _, _) = figure("wake_other_runner");
    assert!(other >= 1, "{deployment}");
    let bounds = &deployment["bounds"];
    assert_eq!(bounds["longest_save_s"], longest, "{deployment}");
    assert_eq!(
        bounds["durable_loss_max_s"],
        7.0 + 2.0 * longest,
        "{deployment}"
    );
}
