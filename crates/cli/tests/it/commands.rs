//! Commands through the real server: queued, handed to the runner under
//! an epoch, output appended and read by offset, signals, idempotency.

use std::time::Duration;

use serde_json::json;

use crate::plane::{Plane, STANDARD};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_runs_streams_output_and_ends_exited() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r", "spot", STANDARD).await;
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let sid = sandbox["id"].as_str().expect("id");
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let created = plane
        .org
        .post(
            &commands,
            json!({"argv": ["make", "test"], "env": {"CI": "1"}, "cwd": "/workspace", "timeout": 60}),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    assert_eq!(created.body["state"], "queued");
    let cid = created.str("id");

    let assigned = runner.assignments().await;
    let handed = &assigned["commands"][0];
    assert_eq!(handed["command_id"], cid.as_str());
    assert_eq!(handed["argv"], json!(["make", "test"]));
    assert_eq!(handed["epoch"], 1);
    let path = format!("{commands}/{cid}");
    assert_eq!(plane.org.get(&path).await.body["state"], "starting");
    assert_eq!(
        runner
            .report_command(&cid, 1, json!({"state": "running"}))
            .await
            .status,
        200
    );

    // Output: appended by offset (a retried chunk is not duplicated), read
    // by offset, long-polled for new bytes.
    let output = format!("{path}/output");
    assert_eq!(
        runner
            .append_output(&cid, 1, "stdout", 0, b"hello ")
            .await
            .status,
        200
    );
    assert_eq!(
        runner
            .append_output(&cid, 1, "stdout", 0, b"hello ")
            .await
            .status,
        200
    );
    assert_eq!(
        runner
            .append_output(&cid, 1, "stdout", 6, b"world\n")
            .await
            .status,
        200
    );
    runner
        .append_output(&cid, 1, "stdout", 100, b"gap")
        .await
        .assert_error(409, "invalid_state");
    assert_eq!(
        runner
            .append_output(&cid, 1, "stderr", 0, b"warn\n")
            .await
            .status,
        200
    );
    let read = plane.org.get(&format!("{output}?offset=0")).await;
    assert_eq!(read.bytes, b"hello world\n");
    assert_eq!(read.headers["x-roost-next-offset"], "12");
    assert_eq!(read.headers["x-roost-complete"], "false");
    let tail = plane.org.get(&format!("{output}?offset=6")).await;
    assert_eq!(tail.bytes, b"world\n");
    let err = plane.org.get(&format!("{output}?stream=stderr")).await;
    assert_eq!(err.bytes, b"warn\n");

    let org = plane.org.clone();
    let follow = format!("{output}?offset=12&timeout=20");
    let waiter = tokio::spawn(async move { org.get(&follow).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "waits for bytes past the offset");
    runner.append_output(&cid, 1, "stdout", 12, b"more\n").await;
    let more = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woke")
        .expect("task");
    assert_eq!(more.bytes, b"more\n");

    let org = plane.org.clone();
    let wait = format!("{path}?wait_for=ended&timeout=20");
    let ended = tokio::spawn(async move { org.get(&wait).await });
    let done = runner
        .report_command(&cid, 1, json!({"state": "exited", "exit_code": 3}))
        .await;
    assert_eq!(done.status, 200, "{done:?}");
    let ended = ended.await.expect("task");
    assert_eq!(ended.body["state"], "exited");
    assert_eq!(ended.body["exit_code"], 3);
    assert_eq!(ended.body["stdout_bytes"], 17);
    let last = plane.org.get(&format!("{output}?offset=17")).await;
    assert_eq!(last.headers["x-roost-complete"], "true");
    // An ended command stays ended.
    runner
        .report_command(&cid, 1, json!({"state": "running"}))
        .await
        .assert_error(409, "invalid_state");
    assert!(
        runner.assignments().await["commands"]
            .as_array()
            .is_some_and(Vec::is_empty)
    );
    let listed = plane.org.get(&commands).await.body;
    assert_eq!(listed["commands"][0]["id"], cid.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_are_idempotent_signalled_and_refused_on_a_stopped_sandbox() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r", "spot", STANDARD).await;
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let sid = sandbox["id"].as_str().expect("id");
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let key = [("idempotency-key", "deploy-1")];
    let first = plane
        .org
        .post_with(&commands, json!({"argv": ["deploy"]}), &key)
        .await;
    let again = plane
        .org
        .post_with(&commands, json!({"argv": ["deploy"]}), &key)
        .await;
    assert!(again.replayed);
    assert_eq!(first.body["id"], again.body["id"]);
    plane
        .org
        .post_with(&commands, json!({"argv": ["deploy", "--force"]}), &key)
        .await
        .assert_error(409, "idempotency_conflict");
    let listed = plane.org.get(&commands).await.body;
    assert_eq!(
        listed["commands"].as_array().map(Vec::len),
        Some(1),
        "ran once"
    );

    // Signal: a started command gets it through the runner.
    let cid = first.str("id");
    runner.assignments().await;
    runner
        .report_command(&cid, 1, json!({"state": "running"}))
        .await;
    let signalled = plane
        .org
        .post(
            &format!("{commands}/{cid}/signal"),
            json!({"signal": "TERM"}),
        )
        .await;
    assert_eq!(signalled.status, 202, "{signalled:?}");
    assert_eq!(runner.assignments().await["commands"][0]["signal"], "TERM");
    runner
        .report_command(&cid, 1, json!({"state": "interrupted", "signal": "TERM"}))
        .await;
    let ended = plane.org.get(&format!("{commands}/{cid}")).await.body;
    assert_eq!(
        (ended["state"].as_str(), ended["signal"].as_str()),
        (Some("interrupted"), Some("TERM"))
    );
    plane
        .org
        .post(
            &format!("{commands}/{cid}/signal"),
            json!({"signal": "KILL"}),
        )
        .await
        .assert_error(409, "invalid_state");
    plane
        .org
        .post(
            &format!("{commands}/{cid}/signal"),
            json!({"signal": "BOOM"}),
        )
        .await
        .assert_error(400, "invalid_request");

    // A queued command asked to end never starts.
    let queued = plane
        .org
        .post(&commands, json!({"argv": ["later"]}))
        .await
        .str("id");
    plane
        .org
        .post(
            &format!("{commands}/{queued}/signal"),
            json!({"signal": "INT"}),
        )
        .await;
    let q = plane.org.get(&format!("{commands}/{queued}")).await.body;
    assert_eq!(q["state"], "not_launched");

    // Stopping the sandbox ends what was still queued: not_launched; what
    // the runner had running and left unreported: interrupted.
    let pending = plane
        .org
        .post(&commands, json!({"argv": ["queued"]}))
        .await
        .str("id");
    let live = plane.org.post(&commands, json!({"argv": ["live"]})).await;
    let live = live.str("id");
    let assigned = runner.assignments().await;
    assert_eq!(assigned["commands"].as_array().map(Vec::len), Some(2));
    runner
        .report_command(&live, 1, json!({"state": "running"}))
        .await;
    let not_yet = plane
        .org
        .post(&commands, json!({"argv": ["never"]}))
        .await
        .str("id");
    plane
        .org
        .post(&format!("/v1/sandboxes/{sid}/stop"), json!({}))
        .await;
    runner.report(sid, "stopped", None).await;
    let state = |id: String| {
        let org = plane.org.clone();
        let path = format!("{commands}/{id}");
        async move { org.get(&path).await.body["state"].clone() }
    };
    assert_eq!(state(live).await, "interrupted");
    assert_eq!(
        state(pending).await,
        "unknown",
        "handed over, never confirmed"
    );
    assert_eq!(state(not_yet).await, "not_launched");
    // A stopped sandbox whose auto_wake is off refuses commands; with it on
    // (the default) a command wakes it and waits for it.
    let patch = |auto_wake: bool| {
        let org = plane.org.clone();
        let path = format!("/v1/sandboxes/{sid}");
        async move {
            let body = serde_json::to_vec(&json!({"auto_wake": auto_wake})).expect("json");
            org.send(reqwest::Method::PATCH, &path, Some(body), &[])
                .await
                .expect("PATCH")
        }
    };
    let before = plane.org.get(&format!("/v1/sandboxes/{sid}")).await.body;
    // A millisecond at least between the record's two changes.
    tokio::time::sleep(Duration::from_millis(2)).await;
    let patched = patch(false).await.body;
    assert_eq!(patched["auto_wake"], false);
    assert!(
        patched["updated_at"].as_str() > before["updated_at"].as_str(),
        "a changed policy is a change of the record: {before} then {patched}"
    );
    plane
        .org
        .post(&commands, json!({"argv": ["true"]}))
        .await
        .assert_error(409, "invalid_state");
    assert_eq!(patch(true).await.body["auto_wake"], true);
    let woken = plane.org.post(&commands, json!({"argv": ["true"]})).await;
    assert_eq!(woken.status, 201, "{woken:?}");
    assert_eq!(woken.body["waited_for_wake"], true, "{woken:?}");
    let sandbox = plane.org.get(&format!("/v1/sandboxes/{sid}")).await.body;
    assert_eq!(sandbox["desired"], "running", "{sandbox}");
}
