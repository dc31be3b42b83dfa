//! The control plane's contract (DESIGN.md §2–§4, §7) through the real
//! server process: records, idempotency, quotas, admission, leases,
//! fencing, long-poll, commands. Runners are `plane::TestRunner`s.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::plane::{
    ALL, Api, Plane, STANDARD, TestRunner, eventually, new_org, postgres_database,
    start_server_with,
};

fn states(events: &Value) -> Vec<String> {
    events["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            format!(
                "{}/{}",
                e["state"].as_str().unwrap_or(""),
                e["reason"].as_str().unwrap_or("")
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_lifecycle_records_observed_state_and_events() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let created = plane
        .org
        .post(
            "/v1/sandboxes",
            json!({"labels": {"team": "a"}, "env": {"A": "1"}, "resources": {"memory_mib": 256}}),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let id = created.str("id");
    // Placed, but the workload is not observed yet: not running.
    assert_eq!(created.body["state"], "starting");
    assert_eq!(created.body["desired"], "running");
    assert_eq!(created.body["runner_id"], runner.id.as_str());
    assert_eq!(created.body["epoch"], 1);
    assert_eq!(created.body["storage_class"], "standard");
    assert_eq!(created.body["resources"]["memory_mib"], 256);
    assert!(created.body["created_at"].is_string() && created.body["expires_at"].is_null());

    let assigned = runner.assignment(&id).await;
    assert_eq!(assigned["desired"], "running");
    assert_eq!(assigned["env"]["A"], "1");
    runner.report(&id, "running", None).await;
    let got = plane.org.get(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!(got.body["state"], "running");

    // Stop changes desired only; state follows the runner's reports.
    let stopped = plane
        .org
        .post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    assert_eq!(stopped.status, 202, "{stopped:?}");
    assert_eq!(stopped.body["state"], "running");
    assert_eq!(stopped.body["desired"], "stopped");
    assert_eq!(runner.assignment(&id).await["desired"], "stopped");
    runner.report(&id, "stopping", None).await;
    runner.report(&id, "stopped", Some("stop_requested")).await;

    // Start goes back to the runner holding the standard home.
    let started = plane
        .org
        .post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    assert_eq!(started.status, 202, "{started:?}");
    assert_eq!(started.body["state"], "starting");
    assert_eq!(started.body["runner_id"], runner.id.as_str());
    assert_eq!(started.body["epoch"], 2);
    runner.report(&id, "running", None).await;

    let deleted = plane.org.delete(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!(deleted.status, 202, "{deleted:?}");
    assert_eq!(deleted.body["state"], "deleting");
    plane
        .org
        .delete(&format!("/v1/sandboxes/{id}"))
        .await
        .assert_error(404, "not_found");
    runner.report(&id, "deleted", None).await;
    let gone = plane.org.get(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!(gone.body["state"], "deleted");
    assert!(gone.body["ended_at"].is_string());
    assert!(
        runner.assignment(&id).await.is_null(),
        "released from its runner"
    );

    let events = plane
        .org
        .get(&format!("/v1/sandboxes/{id}/events"))
        .await
        .body;
    assert_eq!(
        states(&events),
        [
            "pending/admitted",
            "starting/placed",
            // A state reported without a reason carries its usual one.
            "running/workload_started",
            // What was asked is in the history too, the state repeated.
            "running/stop_requested",
            "stopping/stop_requested",
            "stopped/stop_requested",
            "stopped/start_requested",
            "pending/start_requested",
            "starting/placed",
            "running/workload_started",
            "running/delete_requested",
            "deleting/delete_requested",
            "deleted/deleted",
        ]
    );
    assert!(events["events"][0]["at"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_orgs_sandboxes_and_commands_are_not_found() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");
    let (other, _) = new_org(&plane.admin, "other", json!({})).await;
    other
        .get(&format!("/v1/sandboxes/{id}"))
        .await
        .assert_error(404, "not_found");
    other
        .get(&format!("/v1/sandboxes/{id}/events"))
        .await
        .assert_error(404, "not_found");
    other
        .post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await
        .assert_error(404, "not_found");
    other
        .delete(&format!("/v1/sandboxes/{id}"))
        .await
        .assert_error(404, "not_found");
    other
        .post(
            &format!("/v1/sandboxes/{id}/commands"),
            json!({"argv": ["true"]}),
        )
        .await
        .assert_error(404, "not_found");
    let listed = other.get("/v1/sandboxes").await;
    assert_eq!(listed.body["sandboxes"], json!([]));
    // Runner endpoints do not exist for an org token, nor org ones for a runner.
    plane
        .org
        .post("/v1/runner/heartbeat", json!({"runner_id": runner.id}))
        .await
        .assert_error(404, "not_found");
    runner
        .api
        .get("/v1/sandboxes")
        .await
        .assert_error(404, "not_found");
    Api::new(&plane.server.url, "roost_org_nope")
        .get("/v1/sandboxes")
        .await
        .assert_error(401, "unauthenticated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_filters_by_state_and_label_and_pages() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let team = if i % 2 == 0 { "a" } else { "b" };
        let created = plane
            .org
            .post("/v1/sandboxes", json!({"labels": {"team": team}}))
            .await;
        ids.push(created.str("id"));
    }
    runner.report(&ids[0], "running", None).await;
    runner.report(&ids[2], "running", None).await;
    let running = plane.org.get("/v1/sandboxes?state=running").await.body;
    let got: Vec<&str> = running["sandboxes"]
        .as_array()
        .expect("list")
        .iter()
        .map(|s| s["id"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(got, [ids[0].as_str(), ids[2].as_str()]);
    let team_b = plane.org.get("/v1/sandboxes?label=team=b").await.body;
    assert_eq!(team_b["sandboxes"].as_array().map(Vec::len), Some(2));
    let both = plane
        .org
        .get("/v1/sandboxes?label=team=a&state=pending")
        .await
        .body;
    // The runner holds four: the fifth waits, saying why.
    assert_eq!(both["sandboxes"][0]["id"], ids[4].as_str());
    assert_eq!(both["sandboxes"][0]["state_reason"], "no_capacity");
    // Pages of two, in creation order, until no cursor.
    let mut seen = Vec::new();
    let mut cursor = String::new();
    loop {
        let page = plane
            .org
            .get(&format!("/v1/sandboxes?limit=2&cursor={cursor}"))
            .await
            .body;
        for s in page["sandboxes"].as_array().expect("page") {
            seen.push(s["id"].as_str().unwrap_or("").to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(next) => cursor = next.to_owned(),
            None => break,
        }
    }
    assert_eq!(seen, ids);
    plane
        .org
        .get("/v1/sandboxes?state=runing")
        .await
        .assert_error(400, "invalid_request");
    plane
        .org
        .get("/v1/sandboxes?colour=red")
        .await
        .assert_error(400, "invalid_request");
}

async fn idempotent_creates(plane: &Plane) {
    let _runner = plane.runner("r1", "spot", STANDARD).await;
    let key = [("idempotency-key", "create-1")];
    let first = plane
        .org
        .post_with("/v1/sandboxes", json!({"labels": {"k": "v"}}), &key)
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = plane
        .org
        .post_with("/v1/sandboxes", json!({"labels": {"k": "v"}}), &key)
        .await;
    assert_eq!(again.status, 201);
    assert!(again.replayed);
    assert_eq!(again.body, first.body, "the original response, replayed");
    plane
        .org
        .post_with("/v1/sandboxes", json!({"labels": {"k": "w"}}), &key)
        .await
        .assert_error(409, "idempotency_conflict");

    // 50 at once with one key: one sandbox, every answer names it.
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let org = plane.org.clone();
        tasks.push(tokio::spawn(async move {
            org.post_with("/v1/sandboxes", json!({}), &[("idempotency-key", "burst")])
                .await
        }));
    }
    let mut ids = std::collections::BTreeSet::new();
    for task in tasks {
        let answer = task.await.expect("task");
        assert_eq!(answer.status, 201, "{answer:?}");
        ids.insert(answer.str("id"));
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let all = plane.org.get("/v1/sandboxes?limit=200").await.body;
    assert_eq!(all["sandboxes"].as_array().map(Vec::len), Some(2), "{all}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_replay_conflict_and_survive_concurrency_on_sqlite() {
    idempotent_creates(&Plane::start(&[]).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_replay_conflict_and_survive_concurrency_on_postgres() {
    let database = postgres_database("idem");
    idempotent_creates(&Plane::start_with(&[], &[], Some(&database)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_retried_after_the_server_died_between_commit_and_answer_returns_the_same_sandbox()
{
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut crashing = start_server_with(
        &data,
        &[],
        &[("ROOST_FAILPOINT", "after_commit:create_sandbox")],
    );
    let admin = Api::new(
        &crashing.url,
        crashing.admin_token.as_deref().expect("token"),
    );
    let (org, _) = new_org(&admin, "acme", json!({})).await;
    let runner_token = admin
        .post("/v1/admin/runner-tokens", json!({}))
        .await
        .str("token");
    TestRunner::register(&crashing.url, &runner_token, "r1", "spot", STANDARD, 4).await;
    let body = json!({"labels": {"try": "1"}});
    let key = [("idempotency-key", "retry-me")];
    let lost = org
        .send(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(body.to_string().into_bytes()),
            &key,
        )
        .await;
    assert!(lost.is_err(), "the server died before answering: {lost:?}");
    let status = crashing.child.wait().expect("wait");
    assert!(!status.success(), "aborted");

    let restarted = start_server_with(&data, &[], &[]);
    let org = Api::new(&restarted.url, &org.token);
    let retried = org.post_with("/v1/sandboxes", body, &key).await;
    assert_eq!(retried.status, 201, "{retried:?}");
    assert!(retried.replayed, "answered from the committed key");
    let all = org.get("/v1/sandboxes").await.body;
    let listed = all["sandboxes"].as_array().expect("list");
    assert_eq!(listed.len(), 1, "one sandbox, not two: {all}");
    assert_eq!(listed[0]["id"], retried.body["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_name_the_limit_hit_and_clear_as_documented() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let (org, _) = new_org(
        &plane.admin,
        "small",
        json!({"max_running": 2, "max_total": 3}),
    )
    .await;
    let a = org.post("/v1/sandboxes", json!({})).await.str("id");
    let _b = org.post("/v1/sandboxes", json!({})).await.str("id");
    let refused = org.post("/v1/sandboxes", json!({})).await;
    refused.assert_error(429, "quota_exceeded");
    assert_eq!(
        refused.body["error"]["details"]["quota"],
        json!({"metric": "sandboxes.running", "limit": 2, "current": 2})
    );
    assert!(refused.retry_after.is_some(), "{refused:?}");

    // sandboxes.running clears when one stops.
    org.post(&format!("/v1/sandboxes/{a}/stop"), json!({}))
        .await;
    runner.report(&a, "stopped", None).await;
    let c = org.post("/v1/sandboxes", json!({})).await;
    assert_eq!(c.status, 201, "{c:?}");

    // Three held (two running, one stopped): sandboxes.total.
    let refused = org.post("/v1/sandboxes", json!({})).await;
    refused.assert_error(429, "quota_exceeded");
    assert_eq!(
        refused.body["error"]["details"]["quota"],
        json!({"metric": "sandboxes.total", "limit": 3, "current": 3})
    );
    // Starting the stopped one would run three.
    let start = org
        .post(&format!("/v1/sandboxes/{a}/start"), json!({}))
        .await;
    start.assert_error(429, "quota_exceeded");
    // sandboxes.total clears only on delete.
    assert_eq!(org.delete(&format!("/v1/sandboxes/{a}")).await.status, 202);
    runner.report(&a, "deleted", None).await;
    assert_eq!(
        org.post("/v1/sandboxes", json!({})).await.status,
        429,
        "running: 2 of 2"
    );

    let text = crate::plane::metrics_text(&plane.org).await;
    assert!(
        text.contains("roost_quota_rejections_total{metric=\"sandboxes.running\"} 3"),
        "{text}"
    );
    assert!(text.contains("roost_quota_rejections_total{metric=\"sandboxes.total\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_postgres_never_exceed_the_fleet_ceiling() {
    let database = postgres_database("fleet");
    let ceiling = "7";
    let a = Plane::start_with(&["--fleet-max-running", ceiling], &[], Some(&database)).await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let b = start_server_with(
        &tmp.path().join("b"),
        &["--database", &database, "--fleet-max-running", ceiling],
        &[],
    );
    let runner =
        TestRunner::register(&a.server.url, &a.runner_token, "r1", "spot", STANDARD, 1000).await;
    let (second_org, _) = new_org(&a.admin, "second", json!({})).await;
    let mut tasks = Vec::new();
    for i in 0..40 {
        let url = if i % 2 == 0 { &a.server.url } else { &b.url };
        let token = if i % 3 == 0 {
            &a.org.token
        } else {
            &second_org.token
        };
        let api = Api::new(url, token);
        tasks.push(tokio::spawn(async move {
            api.post("/v1/sandboxes", json!({})).await
        }));
    }
    let mut created = 0;
    for task in tasks {
        let answer = task.await.expect("task");
        match answer.status {
            201 => created += 1,
            429 => {
                assert_eq!(
                    answer.body["error"]["details"]["quota"]["metric"],
                    "fleet.sandboxes.running"
                );
                assert!(answer.body["error"]["details"]["quota"]["current"].as_i64() <= Some(7));
            }
            other => panic!("unexpected {other}: {answer:?}"),
        }
    }
    assert_eq!(created, 7, "exactly the ceiling, never more");
    let placed = runner.assignments().await["sandboxes"]
        .as_array()
        .map(Vec::len);
    assert_eq!(placed, Some(7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_wakes_on_a_report_landing_on_another_server() {
    let database = postgres_database("wake");
    let a = Plane::start_with(&[], &[], Some(&database)).await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let b = start_server_with(&tmp.path().join("b"), &["--database", &database], &[]);
    let runner_a = a.runner("r1", "spot", STANDARD).await;
    let id = a.org.post("/v1/sandboxes", json!({})).await.str("id");
    let runner_b = TestRunner {
        api: Api::new(&b.url, &runner_a.api.token),
        id: runner_a.id.clone(),
    };
    let org = a.org.clone();
    let path = format!("/v1/sandboxes/{id}?wait_for=running&timeout=20");
    let waiter = tokio::spawn(async move {
        let answer = org.get(&path).await;
        (answer, Instant::now())
    });
    // Let the waiter settle into its wait, then report through server B.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "still waiting for running");
    let reported = Instant::now();
    runner_b.report(&id, "running", None).await;
    let (answer, woke) = waiter.await.expect("waiter");
    assert_eq!(answer.body["state"], "running", "{answer:?}");
    assert!(
        woke.duration_since(reported) < Duration::from_secs(5),
        "woken by the report, not by the 20 s timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_returns_on_the_state_an_end_state_or_the_timeout() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let id = plane.org.post("/v1/sandboxes", json!({})).await.str("id");
    // Timeout: the current record, after about the time asked for.
    let started = Instant::now();
    let timed_out = plane
        .org
        .get(&format!("/v1/sandboxes/{id}?wait_for=running&timeout=1"))
        .await;
    assert_eq!(timed_out.body["state"], "starting");
    assert!(started.elapsed() >= Duration::from_millis(900));
    // An end state makes `running` unreachable: the waiter returns then.
    let org = plane.org.clone();
    let path = format!("/v1/sandboxes/{id}?wait_for=running&timeout=20");
    let waiter = tokio::spawn(async move { org.get(&path).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    runner.report(&id, "failed", Some("workload_exited")).await;
    let answer = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woke")
        .expect("task");
    assert_eq!(answer.body["state"], "failed");
    assert_eq!(answer.body["state_reason"], "workload_exited");
    plane
        .org
        .get(&format!("/v1/sandboxes/{id}?wait_for=running&timeout=26"))
        .await
        .assert_error(400, "invalid_request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_refuses_what_nothing_would_enforce_naming_it() {
    let plane = Plane::start(&[]).await;
    let refused = plane.org.post("/v1/sandboxes", json!({})).await;
    refused.assert_error(422, "unsupported_capability");
    assert_eq!(
        refused.body["error"]["details"]["missing"],
        json!(["runner"])
    );
    let _spot = plane.runner("r1", "spot", STANDARD).await;
    let cases = [
        (json!({"storage_class": "fast"}), "storage_class:fast"),
        // No --store: durable is withdrawn, whatever runners offer.
        (json!({"storage_class": "durable"}), "storage_class:durable"),
        (json!({"network": "bridge"}), "network:bridge"),
        (json!({"network": "host"}), "network:host"),
        (json!({"image": "ubuntu-24.04"}), "image:ubuntu-24.04"),
        (
            json!({"placement": "non_preemptible"}),
            "placement:non_preemptible",
        ),
        (
            json!({"resources": {"memory_mib": 1_000_000}}),
            "resources.memory_mib:1000000",
        ),
        (
            json!({"resources": {"pids": 2_000_000}}),
            "resources.pids:2000000",
        ),
        (
            json!({"mounts": [{"filesystem": "fs1", "subpath": "data", "path": "/mnt/data"}]}),
            "filesystem:fs1",
        ),
        // No runner can bound a home: the bound is refused, not dropped.
        (json!({"resources": {"home_mib": 1024}}), "home:bounded"),
    ];
    for (body, missing) in cases {
        let refused = plane.org.post("/v1/sandboxes", body.clone()).await;
        refused.assert_error(422, "unsupported_capability");
        let named = refused.body["error"]["details"]["missing"]
            .as_array()
            .expect("missing")
            .iter()
            .any(|m| m == missing);
        assert!(named, "{body}: {refused:?}");
    }
    let listed = plane.org.get("/v1/sandboxes").await.body;
    assert_eq!(listed["sandboxes"], json!([]), "nothing was created");

    // With a store and a runner offering it, durable is accepted; an
    // on-demand runner makes non_preemptible placeable (and only there).
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    let with_store = Plane::start(&["--store", store.to_str().expect("utf8")]).await;
    let _spot = with_store.runner("spot", "spot", ALL).await;
    let on_demand = with_store.runner("od", "on_demand", ALL).await;
    let durable = with_store
        .org
        .post("/v1/sandboxes", json!({"storage_class": "durable"}))
        .await;
    assert_eq!(durable.status, 201, "{durable:?}");
    let pinned = with_store
        .org
        .post("/v1/sandboxes", json!({"placement": "non_preemptible"}))
        .await;
    assert_eq!(pinned.body["runner_id"], on_demand.id.as_str());

    // A bounded home goes only where homes are bounded, and says so.
    let bounding = [STANDARD, &["home:bounded"]].concat();
    let bounded_runner = with_store.runner("bounded", "spot", &bounding).await;
    for _ in 0..3 {
        let bounded = with_store
            .org
            .post("/v1/sandboxes", json!({"resources": {"home_mib": 1024}}))
            .await;
        assert_eq!(bounded.status, 201, "{bounded:?}");
        assert_eq!(bounded.body["runner_id"], bounded_runner.id.as_str());
        assert_eq!(bounded.body["resources"]["home_mib"], 1024);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_input_is_refused_with_codes_naming_the_field() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");
    let commands = format!("/v1/sandboxes/{id}/commands");
    let big_argv: Vec<String> = (0..300).map(|_| "x".repeat(1000)).collect();
    let answer = plane.org.post(&commands, json!({"argv": big_argv})).await;
    answer.assert_error(413, "payload_too_large");
    assert_eq!(answer.body["error"]["details"]["field"], "argv");
    let env: serde_json::Map<String, Value> =
        (0..200).map(|i| (format!("V{i}"), json!("x"))).collect();
    let answer = plane.org.post("/v1/sandboxes", json!({"env": env})).await;
    answer.assert_error(400, "invalid_request");
    assert_eq!(answer.body["error"]["details"]["field"], "env");
    for home_mib in [0, 15, (1u64 << 24) + 1] {
        let body = json!({"resources": {"home_mib": home_mib}});
        let answer = plane.org.post("/v1/sandboxes", body).await;
        answer.assert_error(400, "invalid_request");
        assert_eq!(
            answer.body["error"]["details"]["field"],
            "resources.home_mib"
        );
    }
    let answer = plane
        .org
        .post("/v1/sandboxes", json!({"env": {"NOT-A-NAME": "x"}}))
        .await;
    answer.assert_error(400, "invalid_request");
    let labels: serde_json::Map<String, Value> =
        (0..40).map(|i| (format!("l{i}"), json!("x"))).collect();
    let answer = plane
        .org
        .post("/v1/sandboxes", json!({"labels": labels}))
        .await;
    answer.assert_error(400, "invalid_request");
    assert_eq!(answer.body["error"]["details"]["field"], "labels");
    let answer = plane
        .org
        .post("/v1/sandboxes", json!({"image": "x".repeat(300)}))
        .await;
    answer.assert_error(400, "invalid_request");
    assert_eq!(answer.body["error"]["details"]["field"], "image");
    let answer = plane
        .org
        .post_raw("/v1/sandboxes", r#"{"imgae":"x"}"#)
        .await;
    answer.assert_error(400, "invalid_request");
    assert!(
        answer.body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("imgae")
    );
    let answer = plane
        .org
        .post_raw("/v1/sandboxes", r#"{"ttl":"soon"}"#)
        .await;
    answer.assert_error(400, "invalid_request");
    assert!(
        answer.body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("ttl")
    );
    let answer = plane
        .org
        .post_raw(&commands, r#"{"argv": ["ls"], "cwd": "relative"}"#)
        .await;
    answer.assert_error(400, "invalid_request");
    let huge = format!(r#"{{"argv": ["{}"]}}"#, "a".repeat(2 * 1024 * 1024));
    plane
        .org
        .post_raw(&commands, &huge)
        .await
        .assert_error(413, "payload_too_large");
    let long_key = "k".repeat(300);
    plane
        .org
        .post_with(
            "/v1/sandboxes",
            json!({}),
            &[("idempotency-key", &long_key)],
        )
        .await
        .assert_error(400, "invalid_request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_belong_to_one_org_and_outlive_the_records_retention() {
    let plane = Plane::start(&["--retention", "1s", "--reconcile-interval", "100ms"]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let key = [("idempotency-key", "nightly-1")];
    let body = json!({"labels": {"job": "nightly"}});
    let first = plane
        .org
        .post_with("/v1/sandboxes", body.clone(), &key)
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    let id = first.str("id");

    // The same key in another org is another org's: a sandbox of its own.
    let (other, _) = new_org(&plane.admin, "other", json!({})).await;
    let theirs = other.post_with("/v1/sandboxes", body.clone(), &key).await;
    assert_eq!(theirs.status, 201, "{theirs:?}");
    assert!(!theirs.replayed);
    assert_ne!(theirs.str("id"), id);

    // The sandbox ends and its record passes the retention window...
    runner.report(&id, "failed", Some("workload_exited")).await;
    let hidden = eventually(Duration::from_secs(8), || async {
        plane.org.get(&format!("/v1/sandboxes/{id}")).await.status == 404
    })
    .await;
    assert!(hidden, "the ended record is hidden after retention");
    // ...but a retry of its create still replays, creating nothing.
    let retried = plane.org.post_with("/v1/sandboxes", body, &key).await;
    assert_eq!(retried.status, 201, "{retried:?}");
    assert!(retried.replayed, "answered from the kept key");
    assert_eq!(retried.body, first.body);
    let listed = plane.org.get("/v1/sandboxes").await.body;
    assert_eq!(listed["sandboxes"], json!([]), "nothing new: {listed}");
}

/// Audit finding (HTTP surface): the server served any number of
/// connections within its open files limit, so idle clients could take
/// every descriptor it needs for its own work. It serves at most
/// `--max-connections` at once, fewer if the limit (raised from a soft
/// 1,024 to the hard one at start) leaves less room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_raises_its_open_files_limit_and_caps_connections_below_it() {
    use rustix::process::{Resource, getrlimit};
    let hard = getrlimit(Resource::Nofile).maximum.unwrap_or(u64::MAX);
    let room = hard - (hard / 4).max(256);
    let plane = Plane::start(&[]).await;
    let served = crate::plane::metric(&plane.org, "roost_http_connections_max ").await;
    assert_eq!(served, room.min(16_384));
    let capped = Plane::start(&["--max-connections", "100"]).await;
    assert_eq!(
        crate::plane::metric(&capped.org, "roost_http_connections_max ").await,
        100
    );

    // Started with a soft limit of 1,024 under that hard one: raised.
    use std::io::BufRead;
    let data = tempfile::tempdir().expect("tempdir");
    let mut lowered = std::process::Command::new("sh")
        .args(["-c", "ulimit -S -n 1024 && exec \"$@\"", "sh"])
        .arg(crate::harness::BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data.path())
        .arg("--metrics-token-file")
        .arg(crate::plane::metrics_token_file())
        .env("ROOST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start a server");
    // Kept open until the server is killed: it prints more lines.
    let mut lines = std::io::BufReader::new(lowered.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("a line").expect("read");
    let url = first
        .strip_prefix("roost server listening on ")
        .expect("the listening line")
        .to_owned();
    let metrics = Api::new(&url, crate::plane::METRICS_TOKEN)
        .get("/metrics")
        .await;
    let _ = lowered.kill();
    let _ = lowered.wait();
    drop(lines);
    let text = String::from_utf8_lossy(&metrics.bytes);
    let served: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("roost_http_connections_max ")?.parse().ok())
        .unwrap_or_else(|| panic!("no connections gauge: {text}"));
    assert_eq!(served, room.min(16_384), "the soft limit was not raised");
}

/// Ages every idempotency key of the plane's SQLite records by `days`,
/// and waits until a retention pass has run since: a key row of its own,
/// naming nothing and two days old, is gone.
async fn age_idempotency_keys(plane: &Plane, days: i64) {
    use sqlx::Connection;
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_millis() as i64
    };
    let db = plane._tmp.path().join("data").join("roost.db");
    let url = format!("sqlite://{}", db.display());
    let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open");
    sqlx::query("UPDATE idempotency_keys SET created_at_ms = created_at_ms - $1")
        .bind(days * 24 * 3600 * 1000)
        .execute(&mut conn)
        .await
        .expect("age the keys");
    sqlx::query(
        "INSERT INTO idempotency_keys (org_id, scope, key, request_hash, status, response, resource_id, created_at_ms)
         VALUES ('nobody', 'marker', 'marker', '', 201, '{}', 'nothing', $1)",
    )
    .bind(now_ms() - 2 * 24 * 3600 * 1000)
    .execute(&mut conn)
    .await
    .expect("the marker key");
    let passed = eventually(Duration::from_secs(20), || {
        let url = url.clone();
        async move {
            let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open");
            let (left,): (i64,) =
                sqlx::query_as("SELECT COUNT(*) FROM idempotency_keys WHERE scope = 'marker'")
                    .fetch_one(&mut conn)
                    .await
                    .expect("count");
            left == 0
        }
    })
    .await;
    assert!(passed, "no retention pass removed the marker key");
}

/// DESIGN §3: a key is kept at least a day after the resource it created
/// has ended. A snapshot lives on after its sandbox, as long as its org
/// keeps it: its key is kept while it exists, however old, and a day after
/// it is deleted; then it goes, and the same key makes a new snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshots_idempotency_key_is_kept_while_it_exists_and_a_day_after() {
    let store = tempfile::tempdir().expect("tempdir");
    let store_dir = store.path().to_str().expect("utf-8");
    let args = [
        "--retention",
        "1s",
        "--reconcile-interval",
        "100ms",
        "--store",
        store_dir,
    ];
    let plane = Plane::start(&args).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");
    let path = format!("/v1/sandboxes/{id}/snapshots");
    let key = [("idempotency-key", "keep-1")];
    let snapshot = || {
        plane
            .org
            .post_with(&path, json!({"durability": "local"}), &key)
    };
    let first = snapshot().await;
    assert_eq!(first.status, 201, "{first:?}");
    let snapshot_id = first.str("id");

    // Two days on, the snapshot still exists: its key still replays.
    age_idempotency_keys(&plane, 2).await;
    let retried = snapshot().await;
    assert_eq!(retried.status, 201, "{retried:?}");
    assert!(retried.replayed, "the key of a living snapshot was dropped");
    assert_eq!(retried.str("id"), snapshot_id);

    // Deleted: its day starts now, so a retention pass keeps the key.
    let deleted = plane
        .org
        .delete(&format!("/v1/snapshots/{snapshot_id}"))
        .await;
    assert_eq!(deleted.status, 200, "{deleted:?}");
    age_idempotency_keys(&plane, 0).await;
    let after_delete = snapshot().await;
    assert!(
        after_delete.replayed,
        "the key went with its snapshot: {after_delete:?}"
    );
    assert_eq!(after_delete.str("id"), snapshot_id);

    // A day after the delete, the key is gone: the same key is a new request.
    age_idempotency_keys(&plane, 2).await;
    let anew = snapshot().await;
    assert_eq!(anew.status, 201, "{anew:?}");
    assert!(!anew.replayed, "a key outlived its day: {anew:?}");
    assert_ne!(anew.str("id"), snapshot_id);
}

/// A database of its own, reached through a proxy the test can cut: the
/// proxy, and the database's URL through it.
async fn proxied_postgres_database(name: &str) -> (crate::proxy::Proxy, String) {
    let database = postgres_database(name);
    let direct = std::env::var("ROOST_TEST_POSTGRES_URL").expect("PostgreSQL url");
    let (_, host_and_rest) = direct
        .split_once('@')
        .expect("postgres://user@host:port/db");
    let (address, _) = host_and_rest.split_once('/').expect("host:port/db");
    let proxy = crate::proxy::Proxy::start(address.to_owned()).await;
    let proxied = database.replacen(address, &format!("127.0.0.1:{}", proxy.port), 1);
    (proxy, proxied)
}

/// Issue 21 (faults): PostgreSQL out of reach under two servers (every
/// connection dropped, new ones refused, as while it restarts), then back.
/// Meanwhile a request is answered 503 `unavailable` with Retry-After and
/// no server dies; afterwards both serve again, no acknowledged create is
/// lost, a long-poll through one server sees a write through the other,
/// and the kept counts are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_out_of_reach_then_back_loses_nothing_and_both_servers_carry_on() {
    let (proxy, proxied) = proxied_postgres_database("outage").await;
    // A lease long enough that the outage cannot expire the test runner's.
    let args = ["--lease-ttl", "120s"];
    let a = Plane::start_with(&args, &[], Some(&proxied)).await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let b = start_server_with(
        &tmp.path().join("b"),
        &[&args[..], &["--database", &proxied]].concat(),
        &[],
    );
    let org_b = Api::new(&b.url, &a.org.token);
    let runner = TestRunner::register(&b.url, &a.runner_token, "r", "spot", STANDARD, 1000).await;
    let mut acknowledged = Vec::new();
    let create_through = |api: Api| async move { api.post("/v1/sandboxes", json!({})).await };
    for api in [&a.org, &org_b, &a.org, &org_b] {
        let answer = create_through(api.clone()).await;
        assert_eq!(answer.status, 201, "{answer:?}");
        acknowledged.push(answer.str("id"));
    }
    runner.report(&acknowledged[0], "running", None).await;

    proxy.cut();
    for api in [&a.org, &org_b] {
        let answer = create_through(api.clone()).await;
        answer.assert_error(503, "unavailable");
        assert!(answer.retry_after.is_some(), "{answer:?}");
    }
    proxy.mend();

    // Back: both servers serve again (their pools reconnect).
    for api in [&a.org, &org_b] {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let created = create_through(api.clone()).await;
            if created.status == 201 {
                acknowledged.push(created.str("id"));
                break;
            }
            created.assert_error(503, "unavailable");
            assert!(
                Instant::now() < deadline,
                "{} never served a create again",
                api.url
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // A long-poll through b answers a create through a with the sandbox,
    // never `unchanged`: b cannot know what it missed while cut off, so
    // it may not trust its memory of what it last read.
    let etag = runner.assignments().await["etag"]
        .as_str()
        .expect("etag")
        .to_owned();
    let poll = {
        let (api, id, etag) = (runner.api.clone(), runner.id.clone(), etag.clone());
        tokio::spawn(async move {
            api.get(&format!(
                "/v1/runner/assignments?runner_id={id}&etag={etag}&timeout=25&unchanged=true"
            ))
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let woken_by = create_through(a.org.clone()).await;
    assert_eq!(woken_by.status, 201, "{woken_by:?}");
    let woken_by = woken_by.str("id");
    acknowledged.push(woken_by.clone());
    let answer = poll.await.expect("the long-poll");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_ne!(answer.body["unchanged"], json!(true), "{}", answer.body);
    let listed = answer.body["sandboxes"].as_array().expect("sandboxes");
    assert!(
        listed
            .iter()
            .any(|s| s["sandbox_id"] == json!(woken_by.as_str())),
        "{}",
        answer.body
    );

    // Nothing acknowledged was lost; the counts are exact.
    for id in &acknowledged {
        for api in [&a.org, &org_b] {
            let read = api.get(&format!("/v1/sandboxes/{id}")).await;
            assert_eq!(read.status, 200, "{id} through {}: {read:?}", api.url);
        }
    }
    let checked = a.admin.get("/v1/admin/counts").await;
    assert_eq!(checked.status, 200, "{checked:?}");
    assert_eq!(checked.body["drift"], json!([]), "{checked:?}");
    let total = a.admin.get("/v1/admin/orgs").await;
    let acme = total.body["orgs"]
        .as_array()
        .and_then(|orgs| orgs.iter().find(|o| o["name"] == "acme").cloned())
        .expect("acme listed");
    assert_eq!(acme["total"], json!(acknowledged.len()), "{acme}");
}

/// Issue 21: a pooled PostgreSQL connection is not pinged before every
/// query (a round trip ahead of each), only once it has sat idle a while
/// (`server::db`); so connections PostgreSQL dropped while nobody used
/// them are replaced before a request gets them: the first requests after
/// it is back all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_postgres_dropped_are_replaced_before_a_request_uses_them() {
    let (proxy, proxied) = proxied_postgres_database("idle_cut").await;
    let plane = Plane::start_with(&["--lease-ttl", "120s"], &[], Some(&proxied)).await;
    // Several connections in the pool, all used.
    let reads = (0..8).map(|_| {
        let org = plane.org.clone();
        async move { org.get("/v1/sandboxes").await }
    });
    for read in futures::future::join_all(reads).await {
        assert_eq!(read.status, 200, "{read:?}");
    }
    // PostgreSQL drops them all (as a restart does) while they sit idle.
    proxy.cut();
    proxy.mend();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let reads = (0..8).map(|_| {
        let org = plane.org.clone();
        async move { org.get("/v1/sandboxes").await }
    });
    for read in futures::future::join_all(reads).await {
        assert_eq!(read.status, 200, "{read:?}");
    }
}
