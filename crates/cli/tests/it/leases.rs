//! Runners, leases and fencing, the scheduler, TTL, retention and
//! quarantine, through the real server process.

use std::time::Duration;

use serde_json::{Value, json};

use crate::plane::{ALL, Api, Plane, STANDARD, TestRunner, eventually};

async fn record(plane: &Plane, id: &str) -> Value {
    plane.org.get(&format!("/v1/sandboxes/{id}")).await.body
}

async fn command(plane: &Plane, sandbox: &str, id: &str) -> Value {
    plane
        .org
        .get(&format!("/v1/sandboxes/{sandbox}/commands/{id}"))
        .await
        .body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_recovers_durable_fails_standard_and_ends_commands_honestly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    let plane = Plane::start(&[
        "--store",
        store.to_str().expect("utf8"),
        "--lease-ttl",
        "1500ms",
        "--reconcile-interval",
        "100ms",
    ])
    .await;
    let runner = plane.runner("doomed", "spot", ALL).await;
    let durable = plane
        .running_sandbox(&runner, json!({"storage_class": "durable"}))
        .await;
    let standard = plane.running_sandbox(&runner, json!({})).await;
    let (durable, standard) = (
        durable["id"].as_str().expect("id").to_owned(),
        standard["id"].as_str().expect("id").to_owned(),
    );
    let commands = format!("/v1/sandboxes/{standard}/commands");
    let running = plane
        .org
        .post(&commands, json!({"argv": ["sleep", "1000"]}))
        .await
        .str("id");
    let handed = plane
        .org
        .post(&commands, json!({"argv": ["make"]}))
        .await
        .str("id");
    // The runner takes both; it confirms only the first.
    let assigned = runner.assignments().await;
    assert_eq!(
        assigned["commands"].as_array().map(Vec::len),
        Some(2),
        "{assigned}"
    );
    let ok = runner
        .report_command(&running, 1, json!({"state": "running"}))
        .await;
    assert_eq!(ok.status, 200, "{ok:?}");
    let queued_durable = plane
        .org
        .post(
            &format!("/v1/sandboxes/{durable}/commands"),
            json!({"argv": ["true"]}),
        )
        .await
        .str("id");

    // The runner goes silent; the lease watcher calls it lost.
    let lost = eventually(Duration::from_secs(10), || async {
        record(&plane, &standard).await["state"] == "failed"
    })
    .await;
    assert!(lost, "standard sandbox failed after the lease expired");
    let s = record(&plane, &standard).await;
    assert_eq!(s["state_reason"], "node_lost");
    assert!(s["runner_id"].is_null());
    let d = record(&plane, &durable).await;
    assert_eq!(d["state"], "recovering", "{d}");
    assert_eq!(d["state_reason"], "node_lost");
    assert_eq!(d["epoch"], 2, "the epoch is bumped, fencing the old host");
    assert!(d["runner_id"].is_null(), "nowhere else to go: {d}");
    assert_eq!(
        command(&plane, &standard, &running).await["state"],
        "infrastructure_lost"
    );
    assert_eq!(
        command(&plane, &standard, &handed).await["state"],
        "unknown"
    );
    assert_eq!(
        command(&plane, &durable, &queued_durable).await["state"],
        "not_launched"
    );

    // The old runner is fenced: its reports and heartbeats change nothing.
    runner.heartbeat().await.assert_error(409, "fenced");
    let before = record(&plane, &durable).await;
    runner
        .report_at(&durable, 1, "running", None)
        .await
        .assert_error(409, "fenced");
    assert_eq!(record(&plane, &durable).await, before);

    // Back under a new registration, a stale epoch is still refused.
    let back = TestRunner::register(
        &plane.server.url,
        &plane.runner_token,
        "fresh",
        "spot",
        ALL,
        4,
    )
    .await;
    let placed = eventually(Duration::from_secs(5), || async {
        record(&plane, &durable).await["runner_id"] == back.id.as_str()
    })
    .await;
    assert!(placed, "the recovering sandbox is placed on a live runner");
    let d = record(&plane, &durable).await;
    assert_eq!(d["state"], "starting");
    assert_eq!(d["epoch"], 3);
    back.report_at(&durable, 2, "running", None)
        .await
        .assert_error(409, "fenced");
    assert_eq!(record(&plane, &durable).await["state"], "starting");
    back.report_at(&durable, 3, "running", None).await;
    assert_eq!(record(&plane, &durable).await["state"], "running");

    let events = plane
        .org
        .get(&format!("/v1/sandboxes/{durable}/events"))
        .await
        .body;
    let story: Vec<String> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| format!("{}@{}", e["state"].as_str().unwrap_or(""), e["epoch"]))
        .collect();
    assert_eq!(
        story,
        [
            "pending@0",
            "starting@1",
            "running@1",
            "recovering@2",
            "starting@3",
            "running@3"
        ]
    );
    let text = crate::plane::metrics_text(&plane.org).await;
    assert!(text.contains("roost_lease_expiries_total 1"), "{text}");
    assert!(
        text.contains("roost_sandboxes{state=\"failed\"} 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_a_lease_alive() {
    let plane = Plane::start(&["--lease-ttl", "1s", "--reconcile-interval", "100ms"]).await;
    let runner = plane.runner("steady", "spot", STANDARD).await;
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(runner.heartbeat().await.status, 200);
    }
    assert_eq!(record(&plane, id).await["state"], "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_prefers_spot_then_the_last_runner_and_waits_for_capacity() {
    let plane = Plane::start(&[]).await;
    let on_demand = TestRunner::register(
        &plane.server.url,
        &plane.runner_token,
        "od",
        "on_demand",
        STANDARD,
        1,
    )
    .await;
    let spot = TestRunner::register(
        &plane.server.url,
        &plane.runner_token,
        "spot",
        "spot",
        STANDARD,
        1,
    )
    .await;
    let first = plane.org.post("/v1/sandboxes", json!({})).await;
    assert_eq!(first.body["runner_id"], spot.id.as_str(), "spot first");
    let second = plane.org.post("/v1/sandboxes", json!({})).await;
    assert_eq!(
        second.body["runner_id"],
        on_demand.id.as_str(),
        "on-demand fallback"
    );
    let third = plane.org.post("/v1/sandboxes", json!({})).await;
    assert_eq!(third.body["state"], "pending");
    assert_eq!(third.body["state_reason"], "no_capacity");
    assert!(third.body["runner_id"].is_null());
    let pinned = plane
        .org
        .post("/v1/sandboxes", json!({"placement": "non_preemptible"}))
        .await;
    assert_eq!(pinned.body["state"], "pending");

    // Capacity frees on the spot runner: the oldest waiting one goes there,
    // the non-preemptible one keeps waiting for on-demand capacity.
    let first_id = first.str("id");
    spot.report(&first_id, "running", None).await;
    plane
        .org
        .post(&format!("/v1/sandboxes/{first_id}/stop"), json!({}))
        .await;
    spot.report(&first_id, "stopped", None).await;
    let third_id = third.str("id");
    let placed = eventually(Duration::from_secs(5), || async {
        record(&plane, &third_id).await["runner_id"] == spot.id.as_str()
    })
    .await;
    assert!(placed);
    let pinned_id = pinned.str("id");
    assert_eq!(record(&plane, &pinned_id).await["state"], "pending");
    let second_id = second.str("id");
    plane
        .org
        .post(&format!("/v1/sandboxes/{second_id}/stop"), json!({}))
        .await;
    on_demand.report(&second_id, "stopped", None).await;
    let placed = eventually(Duration::from_secs(5), || async {
        record(&plane, &pinned_id).await["runner_id"] == on_demand.id.as_str()
    })
    .await;
    assert!(placed, "non_preemptible lands on on-demand only");

    // A standard sandbox restarts on the runner holding its home, and
    // waits for it rather than going elsewhere.
    let started = plane
        .org
        .post(&format!("/v1/sandboxes/{second_id}/start"), json!({}))
        .await;
    assert_eq!(started.body["state"], "pending", "{started:?}");
    assert_eq!(started.body["state_reason"], "no_capacity");
    assert_eq!(
        started.body["runner_id"],
        on_demand.id.as_str(),
        "its home stays assigned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_terminates_and_retention_hides_ended_records() {
    let plane = Plane::start(&["--retention", "2s", "--reconcile-interval", "100ms"]).await;
    let runner = TestRunner::register(
        &plane.server.url,
        &plane.runner_token,
        "r",
        "spot",
        STANDARD,
        1,
    )
    .await;
    let running = plane.running_sandbox(&runner, json!({"ttl": 1})).await;
    let running = running["id"].as_str().expect("id").to_owned();
    assert!(record(&plane, &running).await["expires_at"].is_string());
    // No capacity left: this one waits, so nothing runs it.
    let waiting = plane
        .org
        .post("/v1/sandboxes", json!({"ttl": 1}))
        .await
        .str("id");
    let ended = eventually(Duration::from_secs(5), || async {
        record(&plane, &waiting).await["state"] == "terminated"
    })
    .await;
    assert!(ended, "{}", record(&plane, &waiting).await);
    assert_eq!(
        record(&plane, &waiting).await["state_reason"],
        "ttl_expired"
    );
    // A running one is ended by its runner, which sees it wanted terminated.
    let wanted = eventually(Duration::from_secs(5), || async {
        runner.assignment(&running).await["desired"] == "terminated"
    })
    .await;
    assert!(wanted);
    assert_eq!(
        record(&plane, &running).await["state"],
        "running",
        "until observed"
    );
    runner
        .report(&running, "terminated", Some("ttl_expired"))
        .await;
    let r = record(&plane, &running).await;
    assert_eq!(
        (r["state"].as_str(), r["state_reason"].as_str()),
        (Some("terminated"), Some("ttl_expired"))
    );
    // Terminated is final.
    plane
        .org
        .post(&format!("/v1/sandboxes/{running}/start"), json!({}))
        .await
        .assert_error(409, "invalid_state");

    // After the retention window the ended records answer 404.
    let hidden = eventually(Duration::from_secs(8), || async {
        plane
            .org
            .get(&format!("/v1/sandboxes/{waiting}"))
            .await
            .status
            == 404
            && plane
                .org
                .get(&format!("/v1/sandboxes/{running}"))
                .await
                .status
                == 404
    })
    .await;
    assert!(hidden);
    let listed = plane.org.get("/v1/sandboxes").await.body;
    assert_eq!(listed["sandboxes"], json!([]), "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_is_idempotent_by_outcome_and_quarantine_refuses_it() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r", "spot", STANDARD).await;
    let failed = plane.running_sandbox(&runner, json!({})).await;
    let failed = failed["id"].as_str().expect("id").to_owned();
    runner.report(&failed, "failed", Some("oom_killed")).await;
    // A failed sandbox still holds its home on the runner: delete accepted.
    let deleted = plane.org.delete(&format!("/v1/sandboxes/{failed}")).await;
    assert_eq!(deleted.status, 202, "{deleted:?}");
    assert_eq!(runner.assignment(&failed).await["desired"], "deleted");
    plane
        .org
        .delete(&format!("/v1/sandboxes/{failed}"))
        .await
        .assert_error(404, "not_found");
    runner.report(&failed, "deleted", None).await;
    plane
        .org
        .delete(&format!("/v1/sandboxes/{failed}"))
        .await
        .assert_error(404, "not_found");

    let kept = plane.running_sandbox(&runner, json!({})).await;
    let kept = kept["id"].as_str().expect("id").to_owned();
    let quarantine = format!("/v1/admin/sandboxes/{kept}/quarantine");
    let q = plane
        .admin
        .post(&quarantine, json!({"reason": "incident 42"}))
        .await;
    assert_eq!(q.status, 200, "{q:?}");
    assert_eq!(q.body["quarantined"], true);
    plane
        .org
        .post(&quarantine, json!({"reason": "mine"}))
        .await
        .assert_error(404, "not_found");
    for answer in [
        plane.org.delete(&format!("/v1/sandboxes/{kept}")).await,
        plane
            .org
            .post(&format!("/v1/sandboxes/{kept}/stop"), json!({}))
            .await,
        plane
            .org
            .post(
                &format!("/v1/sandboxes/{kept}/commands"),
                json!({"argv": ["rm", "-rf", "/"]}),
            )
            .await,
    ] {
        answer.assert_error(409, "quarantined");
    }
    assert_eq!(record(&plane, &kept).await["desired"], "running");
    assert_eq!(plane.admin.delete(&quarantine).await.status, 200);
    assert_eq!(
        plane
            .org
            .delete(&format!("/v1/sandboxes/{kept}"))
            .await
            .status,
        202
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_protocol_checks_transitions_and_registration() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r", "spot", STANDARD).await;
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");
    // The control plane's own verdicts are not the runner's to report.
    for state in ["recovering", "pending", "starting", "deleting", "deleted"] {
        runner
            .report_at(id, 1, state, None)
            .await
            .assert_error(409, "invalid_state");
    }
    // A state no one knows is a malformed report (the lifecycle is typed),
    // named in the answer.
    let unknown = runner.report_at(id, 1, "sleeping", None).await;
    unknown.assert_error(400, "invalid_request");
    assert!(
        unknown.body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("sleeping")),
        "{unknown:?}"
    );
    // Re-reporting the current state is a no-op, not a new event.
    runner.report(id, "running", None).await;
    let events = plane
        .org
        .get(&format!("/v1/sandboxes/{id}/events"))
        .await
        .body;
    assert_eq!(events["events"].as_array().map(Vec::len), Some(3));
    // Another runner cannot report for a sandbox placed elsewhere.
    let other = plane.runner("other", "spot", STANDARD).await;
    other
        .report_at(id, 1, "stopped", None)
        .await
        .assert_error(409, "fenced");
    // Registration is validated.
    let bad = runner
        .api
        .post(
            "/v1/runner/register",
            json!({"name": "x", "placement_class": "cheap", "capabilities": [], "capacity": {"sandboxes": 1, "memory_mib": 1, "cpus": 1, "pids": 1}}),
        )
        .await;
    bad.assert_error(400, "invalid_request");
    // Assignments long-poll: returns at once for a stale etag, waits for a
    // change otherwise.
    let now = runner.assignments().await;
    let etag = now["etag"].as_str().expect("etag").to_owned();
    let api = runner.api.clone();
    let path = format!(
        "/v1/runner/assignments?runner_id={}&etag={etag}&timeout=20",
        runner.id
    );
    let waiter = tokio::spawn(async move { api.get(&path).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    plane
        .org
        .post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    let changed = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woke")
        .expect("task");
    assert_ne!(changed.body["etag"], etag.as_str());
    assert_eq!(changed.body["sandboxes"][0]["desired"], "stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_and_metrics_describe_the_api() {
    let plane = Plane::start(&[]).await;
    let doc = plane.org.get("/v1/openapi.json").await.body;
    assert!(doc["openapi"].as_str().unwrap_or("").starts_with("3."));
    for path in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}",
        "/v1/sandboxes/{id}/events",
        "/v1/sandboxes/{id}/commands",
        "/v1/sandboxes/{id}/commands/{command_id}/output",
        "/v1/runner/register",
        "/v1/runner/assignments",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} documented");
    }
    assert!(doc["components"]["schemas"]["Sandbox"]["properties"]["epoch"].is_object());
    let runner = plane.runner("r", "spot", STANDARD).await;
    plane.running_sandbox(&runner, json!({})).await;
    // Audit finding: `/metrics` answered anyone, its fleet-wide counts
    // included. Only the admin token and the metrics token read it now;
    // an org's token finds nothing there.
    let refused = plane.org.get("/metrics").await;
    refused.assert_error(404, "not_found");
    let refused = Api::new(&plane.server.url, "").get("/metrics").await;
    refused.assert_error(401, "unauthenticated");
    let refused = Api::new(
        &plane.server.url,
        "roost-test-metrics-token-0123456789abcdeX",
    )
    .get("/metrics")
    .await;
    assert_eq!(refused.status, 401, "{refused:?}");
    let by_admin = plane.admin.get("/metrics").await;
    assert_eq!(by_admin.status, 200, "{by_admin:?}");
    let metrics = Api::new(&plane.server.url, crate::plane::METRICS_TOKEN)
        .get("/metrics")
        .await;
    assert_eq!(metrics.status, 200, "{metrics:?}");
    assert!(metrics.request_id.is_some());
    let text = String::from_utf8_lossy(&metrics.bytes);
    for needle in [
        "roost_http_requests_total{method=\"POST\",route=\"/v1/sandboxes\",status=\"201\"} 1",
        "roost_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/sandboxes/{id}\"} 1",
        "roost_sandboxes{state=\"running\"} 1",
        "roost_lease_expiries_total 0",
        "roost_sqlite_direct_reads_total{result=\"declined\"} 0",
    ] {
        assert!(text.contains(needle), "{needle} in\n{text}");
    }
    // The GET above was read on SQLite's direct path.
    let answered = text
        .lines()
        .find_map(|line| line.strip_prefix("roost_sqlite_direct_reads_total{result=\"answered\"} "))
        .and_then(|count| count.parse::<u64>().ok());
    assert!(answered.is_some_and(|n| n >= 1), "{answered:?} in\n{text}");
}
