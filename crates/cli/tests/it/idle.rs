//! Sleeping when idle and waking on use, end to end (issue 16): a real
//! server, real runners (homes on btrfs), the `roost` binary.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::durable::{Fleet, roost_output};
use crate::plane::{eventually, metric};
use crate::runner_e2e::{sh, wait_sandbox};

/// A fleet whose sandboxes may ask for idle timeouts of a second.
async fn fleet() -> Fleet {
    Fleet::start_on(None, &["--idle-timeout-min", "1s"], &[]).await
}

/// Points 2, 3, 4 and 6: with nothing running, a durable sandbox goes to
/// sleep at its deadline through `securing` (reason `idle` throughout),
/// its save complete; `roost exec` on it just works, saying "waking" on
/// stderr: the sandbox comes back under the same id, here on another
/// runner, with the last write before the sleep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_durable_sandbox_sleeps_and_roost_exec_wakes_it_elsewhere_with_its_last_write() {
    let mut fleet = fleet().await;
    let first = fleet.runner("a");
    let id = fleet
        .create(json!({"storage_class": "durable", "idle_timeout_s": 3}))
        .await;
    let api = fleet.api();
    sh(api, &id, "echo last-words > /workspace/note.txt").await;
    // A file call is activity too.
    let put = api
        .send(
            reqwest::Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=/workspace/put.txt"),
            Some(b"put".to_vec()),
            &[],
        )
        .await
        .expect("PUT");
    assert_eq!(put.status, 201, "{put:?}");
    let record = fleet.get(&id).await;
    assert_eq!(record["last_activity"], "files", "{record}");
    assert!(record["idle_deadline"].is_string(), "{record}");
    // Writing a command's stdin, and resizing its terminal, are activity.
    let reader = api
        .post(
            &format!("/v1/sandboxes/{id}/commands"),
            json!({"argv": ["cat"], "stdin": true}),
        )
        .await;
    assert_eq!(reader.status, 201, "{reader:?}");
    let fed = api
        .send(
            reqwest::Method::POST,
            &format!(
                "/v1/sandboxes/{id}/commands/{}/stdin?close=true",
                reader.str("id")
            ),
            Some(b"fed\n".to_vec()),
            &[],
        )
        .await
        .expect("stdin");
    assert_eq!(fed.status, 200, "{fed:?}");
    assert_eq!(fleet.get(&id).await["last_activity"], "stdin");
    let terminal = api
        .post(
            &format!("/v1/sandboxes/{id}/commands"),
            json!({"argv": ["sh", "-c", "sleep 5"], "tty": {"rows": 24, "cols": 80}}),
        )
        .await;
    assert_eq!(terminal.status, 201, "{terminal:?}");
    crate::runner_e2e::wait_command(api, &id, &terminal.str("id"), "running").await;
    let resized = api
        .post(
            &format!("/v1/sandboxes/{id}/commands/{}/resize", terminal.str("id")),
            json!({"rows": 30, "cols": 100}),
        )
        .await;
    assert_eq!(resized.status, 200, "{resized:?}");
    assert_eq!(fleet.get(&id).await["last_activity"], "attach");

    let asleep = wait_sandbox(api, &id, "stopped").await;
    assert_eq!(asleep["state"], "stopped", "{asleep}");
    assert_eq!(asleep["state_reason"], "idle", "{asleep}");
    assert_eq!(asleep["desired"], "stopped", "{asleep}");
    assert_eq!(asleep["save"]["state"], "ok", "{asleep}");
    assert!(asleep["idle_deadline"].is_null(), "{asleep}");
    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.body;
    let events = events["events"].as_array().expect("events").clone();
    for state in ["stopping", "securing", "stopped"] {
        assert!(
            events
                .iter()
                .any(|e| e["state"] == state && e["reason"] == "idle"),
            "{state} (idle) in {events:#?}"
        );
    }
    assert!(
        events.iter().any(|e| e["reason"] == "securing_committed"),
        "the save completed before stopped: {events:#?}"
    );

    // The runner it slept on goes into maintenance: the wake lands on
    // another, from the store.
    let second = fleet.runner("b");
    let first_id = fleet.runners[first].runner_id.clone();
    let drained = fleet
        .plane
        .admin
        .post(&format!("/v1/admin/runners/{first_id}/drain"), json!({}))
        .await;
    assert_eq!(drained.status, 200, "{drained:?}");
    let output = roost_output(
        &fleet,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "cat /workspace/note.txt /workspace/put.txt",
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "roost exec: {stderr}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "last-words\nput");
    assert!(stderr.contains("waking"), "{stderr}");

    let api = fleet.api();
    let awake = fleet.get(&id).await;
    assert_eq!(awake["id"], id.as_str());
    assert_eq!(awake["state"], "running", "{awake}");
    assert_eq!(
        awake["runner_id"],
        fleet.runners[second].runner_id.as_str(),
        "{awake}"
    );
    let commands = api.get(&format!("/v1/sandboxes/{id}/commands")).await.body;
    let woke = commands["commands"]
        .as_array()
        .expect("commands")
        .iter()
        .filter(|c| c["waited_for_wake"] == true)
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(woke.len(), 1, "{commands}");
    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.body;
    let starting = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .rev()
        .find(|e| e["state"] == "starting" && e["reason"] == "placed")
        .cloned()
        .expect("a starting event");
    let message = starting["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&format!(
            "woken by command {}",
            woke[0]["id"].as_str().unwrap_or("?")
        )) && message.contains("restoring the home's last completed save"),
        "{starting}"
    );
    assert_eq!(metric(api, "roost_sleeps_total{reason=\"idle\"}").await, 1);
    assert_eq!(
        metric(api, "roost_wakes_total{trigger=\"command\"}").await,
        1
    );
    assert_eq!(metric(api, "roost_wake_latency_seconds_count").await, 1);
}

/// Point 5: a running durable sandbox nobody touches is still saved on its
/// interval, but a save that finds the home as the last completed one
/// left it uploads and commits nothing: `save.last_unchanged_at` moves
/// (and `safe_until` with it), `last_completed_at` does not. A write makes
/// the next save a whole one again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_durable_sandbox_skips_saves_that_would_store_nothing_new() {
    let mut fleet = fleet().await;
    fleet.runner("a");
    let id = fleet
        .create(json!({"storage_class": "durable", "idle_timeout_s": 0, "save_interval_s": 1}))
        .await;
    let api = fleet.api();
    sh(
        api,
        &id,
        "head -c 100000 /dev/urandom > /workspace/data.bin",
    )
    .await;
    let saved = fleet.wait_saved_after(&id, "").await;
    let completed = saved["save"]["last_completed_at"]
        .as_str()
        .expect("a save")
        .to_owned();
    // Whatever the first saves still carried, from a save found unchanged
    // on, nothing more goes up.
    let deadline = Instant::now() + Duration::from_secs(40);
    let parked = loop {
        let record = fleet.get(&id).await;
        let unchanged = record["save"]["last_unchanged_at"].as_str().unwrap_or("");
        let last = record["save"]["last_completed_at"].as_str().unwrap_or("");
        if !unchanged.is_empty() && unchanged > last {
            break record;
        }
        assert!(
            Instant::now() < deadline,
            "no save found the home unchanged: {record}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(parked["save"]["last_completed_at"].as_str() >= Some(completed.as_str()));
    let uploaded = metric(api, "roost_block_bytes_total{direction=\"in\"}").await;
    let completed = parked["save"]["last_completed_at"]
        .as_str()
        .expect("a save")
        .to_owned();
    let unchanged = parked["save"]["last_unchanged_at"]
        .as_str()
        .expect("found")
        .to_owned();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let record = fleet.get(&id).await;
            record["save"]["last_unchanged_at"].as_str() > Some(unchanged.as_str())
        })
        .await,
        "saves go on finding it unchanged"
    );
    let record = fleet.get(&id).await;
    assert_eq!(
        record["save"]["last_completed_at"],
        completed.as_str(),
        "{record}"
    );
    assert_eq!(record["save"]["state"], "ok", "{record}");
    assert_eq!(
        record["save"]["safe_until"], record["save"]["last_unchanged_at"],
        "{record}"
    );
    assert_eq!(
        metric(api, "roost_block_bytes_total{direction=\"in\"}").await,
        uploaded,
        "a parked home uploaded something"
    );
    // A write: the next save completes again.
    sh(api, &id, "echo more > /workspace/more.txt").await;
    let resaved = fleet.wait_saved_after(&id, &completed).await;
    assert_eq!(resaved["save"]["state"], "ok", "{resaved}");
}

/// A file transfer longer than the idle timeout keeps its sandbox awake
/// until it ends. A request was activity once, as it started: a trickling
/// upload was slept through and cut at the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_longer_than_the_idle_timeout_is_not_slept_through() {
    let mut fleet = fleet().await;
    fleet.runner("a");
    let id = fleet
        .create(json!({"storage_class": "durable", "idle_timeout_s": 2}))
        .await;
    let api = fleet.api();
    // 16 chunks of 1 KiB half a second apart: 8 s, four idle timeouts.
    let chunks = futures::stream::unfold(0, |sent| async move {
        if sent == 16 {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        Some((Ok::<_, std::io::Error>(vec![b'x'; 1024]), sent + 1))
    });
    let answer = reqwest::Client::new()
        .put(format!(
            "{}/v1/sandboxes/{id}/files?path=/workspace/slow.bin",
            api.url
        ))
        .bearer_auth(&api.token)
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .expect("PUT");
    let status = answer.status();
    let body = answer.text().await.unwrap_or_default();
    assert_eq!(status, 201, "{body}");
    let record = fleet.get(&id).await;
    assert_eq!(record["state"], "running", "{record}");
    assert_eq!(record["last_activity"], "files", "{record}");
    assert_eq!(
        sh(api, &id, "wc -c < /workspace/slow.bin").await.trim(),
        "16384"
    );
    // Left alone afterwards, it sleeps as ever.
    let asleep = wait_sandbox(api, &id, "stopped").await;
    assert_eq!(asleep["state_reason"], "idle", "{asleep}");
}
