//! Bounds an outside audit found missing at the org → server boundary,
//! each checked over HTTP: refused 400 with a stable code naming the
//! field (in E2B's shape under `/e2b`), where before the server answered
//! a negative offset, spun, or failed with a 500.

use serde_json::Value;

use crate::support::{TestServer, running_sandbox};

/// An org's token, and a running sandbox of it with a command.
struct Running {
    token: String,
    sandbox_id: String,
    command_id: String,
}

async fn running_command(server: &TestServer) -> Running {
    let running = running_sandbox(server, None).await;
    let command = running
        .org
        .create_command(
            &running.sandbox_id,
            &serde_json::from_value(serde_json::json!({ "argv": ["true"] })).expect("a command"),
            None,
        )
        .await
        .expect("a command");
    Running {
        token: running.org_token,
        sandbox_id: running.sandbox_id,
        command_id: command.id,
    }
}

/// `count` commands of `running`'s sandbox, each `echo` of `bytes` bytes
/// of argv; their ids in order.
async fn large_commands(
    running: &crate::support::RunningSandbox,
    count: usize,
    bytes: usize,
) -> Vec<String> {
    let big = "a".repeat(bytes);
    let mut ids = Vec::new();
    for _ in 0..count {
        let command = running
            .org
            .create_command(
                &running.sandbox_id,
                &serde_json::from_value(serde_json::json!({ "argv": ["echo", big] }))
                    .expect("a command"),
                None,
            )
            .await
            .expect("a command");
        ids.push(command.id);
    }
    ids
}

/// The answer's status and JSON body.
async fn answer(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.expect("an answer");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// A 400 `invalid_request` envelope naming `field`.
fn assert_refused(what: &str, (status, body): (u16, Value), field: &str) {
    assert_eq!(status, 400, "{what}: {body}");
    assert_eq!(body["error"]["code"], "invalid_request", "{what}: {body}");
    assert_eq!(body["error"]["details"]["field"], field, "{what}: {body}");
}

/// A 400 `invalid_request` in E2B's shape, its message naming `field`.
fn assert_e2b_refused(what: &str, (status, body): (u16, Value), field: &str) {
    assert_eq!(status, 400, "{what}: {body}");
    assert_eq!(body["code"], 400, "{what}: {body}");
    assert_eq!(body["error_code"], "invalid_request", "{what}: {body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains(field), "{what}: {body}");
}

/// Audit finding: `offset` above `i64::MAX` became negative: the output
/// answered 200 with a negative next offset, and an attach spun without
/// pause (three queries and an empty frame a turn).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_offset_past_i64_is_refused_by_output_and_attach() {
    let server = TestServer::start().await;
    let run = running_command(&server).await;
    let http = reqwest::Client::new();
    let base = format!(
        "{}/v1/sandboxes/{}/commands/{}",
        server.url, run.sandbox_id, run.command_id
    );
    let past = 1u64 << 63;
    let output = http
        .get(format!("{base}/output?offset={past}"))
        .bearer_auth(&run.token);
    assert_refused("output", answer(output).await, "offset");
    // Refused before the upgrade: no session starts.
    let attach = http
        .get(format!("{base}/attach?offset={past}"))
        .bearer_auth(&run.token)
        .header("connection", "upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==");
    assert_refused("attach", answer(attach).await, "offset");
    // The largest offset the records hold is only past the end.
    let last = http
        .get(format!("{base}/output?offset={}", i64::MAX))
        .bearer_auth(&run.token);
    let (status, body) = answer(last).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("past the end")),
        "{body}"
    );
}

/// Audit finding: label filters were unbounded; 1,001 made SQLite refuse
/// the statement ("Expression tree is too large"), a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_filters_past_their_bound_are_refused_in_both_apis() {
    let server = TestServer::start().await;
    let org = server.create_org("acme").await;
    let http = reqwest::Client::new();
    // `limits::LABEL_FILTERS_MAX`, as the OpenAPI document states it.
    let most = 32;
    let labels = |n: usize| -> Vec<(String, String)> {
        (0..n)
            .map(|i| ("label".to_owned(), format!("k{i}=")))
            .collect()
    };
    let list = |query: Vec<(String, String)>| {
        http.get(format!("{}/v1/sandboxes", server.url))
            .bearer_auth(&org.token)
            .query(&query)
    };
    let (status, body) = answer(list(labels(most))).await;
    assert_eq!(status, 200, "{most} filters: {body}");
    for n in [most + 1, 1001] {
        assert_refused(
            &format!("{n} filters"),
            answer(list(labels(n))).await,
            "label",
        );
    }

    // E2B's `metadata` filter: `k=v&k2=v2`, encoded once more.
    let metadata = |n: usize| -> String {
        (0..n)
            .map(|i| format!("k{i}=v"))
            .collect::<Vec<_>>()
            .join("&")
    };
    let e2b_list = |value: String| {
        http.get(format!("{}/e2b/v2/sandboxes", server.url))
            .header("x-api-key", &org.token)
            .query(&[("metadata", value)])
    };
    let (status, body) = answer(e2b_list(metadata(most))).await;
    assert_eq!(status, 200, "{most} pairs: {body}");
    for n in [most + 1, 1001] {
        assert_e2b_refused(
            &format!("{n} pairs"),
            answer(e2b_list(metadata(n))).await,
            "metadata",
        );
    }
}

/// Audit finding: a multipart upload's boundary had no bound, and one of
/// 400 KB cost 400 KB of searching per byte of a body sent a byte at a
/// time. Past RFC 2046's 70 characters it is refused before any is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_with_a_boundary_past_rfc_2046_is_refused() {
    let server = TestServer::start().await;
    let run = running_command(&server).await;
    let boundary = "b".repeat(71);
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\nhello\r\n--{boundary}--\r\n"
    );
    let upload = reqwest::Client::new()
        .post(format!("{}/e2b/envd/files?path=/tmp/a.txt", server.url))
        .header("x-api-key", &run.token)
        .header("e2b-sandbox-id", &run.sandbox_id)
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(body);
    assert_e2b_refused("a 71-character boundary", answer(upload).await, "boundary");
}

/// Audit finding: admission took memory from 1 MiB, pids from 1 and cpus
/// from 0.001, where the runtime refuses less than 8 MiB, 8 pids and a
/// 1 ms quota: `{"pids": 4}` was answered 201, then the sandbox failed
/// `runtime_error`. Below the minimums is a 400 naming field and minimum;
/// at them a sandbox is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_below_the_runtimes_minimums_are_refused_at_admission() {
    let server = TestServer::start().await;
    let running = running_sandbox(&server, None).await;
    let http = reqwest::Client::new();
    let create = |resources: Value| {
        http.post(format!("{}/v1/sandboxes", server.url))
            .bearer_auth(&running.org_token)
            .json(&serde_json::json!({ "resources": resources }))
    };
    for (field, resources, minimum) in [
        ("resources.pids", serde_json::json!({"pids": 4}), "8"),
        (
            "resources.memory_mib",
            serde_json::json!({"memory_mib": 7}),
            "8",
        ),
        ("resources.cpus", serde_json::json!({"cpus": 0.005}), "0.01"),
    ] {
        let refused = answer(create(resources)).await;
        let message = refused.1["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("between {minimum} and")),
            "{field} names its minimum: {message}"
        );
        assert_refused(field, refused, field);
    }
    let (status, body) = answer(create(
        serde_json::json!({"memory_mib": 8, "cpus": 0.01, "pids": 8}),
    ))
    .await;
    assert_eq!(status, 201, "at the minimums: {body}");
}

/// `api` states the runtime's minimums for admission and the OpenAPI
/// document; `oci` (which depends on no `api`) enforces them. They must
/// be the same numbers, as the runner converts them
/// (`runner::agent::assignment`: MiB × 2^20, cpus as given).
#[test]
fn resource_minimums_are_the_runtimes() {
    use api::sandboxes::{CPUS_MIN, MEMORY_MIB_MIN, PIDS_MIN};
    assert_eq!(MEMORY_MIB_MIN << 20, oci::config::MEMORY_BYTES_MIN);
    assert_eq!(PIDS_MIN, oci::config::PIDS_MIN);
    let quota = |cpus: f64| {
        oci::config::Limits {
            cpus: Some(cpus),
            ..Default::default()
        }
        .cpu_quota_us()
    };
    assert_eq!(quota(CPUS_MIN), Some(oci::config::CPU_QUOTA_US_MIN));
    assert_eq!(quota(CPUS_MIN * 0.9), None, "just below is refused");
}

/// Audit finding: a sandbox's env secrets were unbounded together (64
/// secrets of 64 KiB each), while the runner hands them to the sandbox's
/// agent in one frame with each command: every command of such a sandbox
/// ended `launch_failed`. Together they are bounded as a create's `env`
/// is (413 `payload_too_large`), at create and when a new value of one
/// would push a sandbox that may launch again past the bound; file
/// secrets do not count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_env_secrets_together_stay_within_one_env() {
    let server = TestServer::start().await;
    let running = running_sandbox(&server, None).await;
    let http = reqwest::Client::new();
    let set = |name: &str, bytes: usize| {
        http.put(format!("{}/v1/secrets/{name}", server.url))
            .bearer_auth(&running.org_token)
            .json(&serde_json::json!({ "value": "s".repeat(bytes) }))
    };
    let create = |secrets: Value| {
        http.post(format!("{}/v1/sandboxes", server.url))
            .bearer_auth(&running.org_token)
            .json(&serde_json::json!({ "secrets": secrets }))
    };
    let limit = server::control::secrets::ENV_SECRETS_BYTES_MAX;
    let (status, body) = answer(set("big", limit * 5 / 8)).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = answer(set("other", limit / 2)).await;
    assert_eq!(status, 200, "{body}");

    let (status, body) = answer(create(serde_json::json!([
        {"name": "big", "env": "BIG"},
        {"name": "other", "env": "OTHER"},
    ])))
    .await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "payload_too_large", "{body}");
    assert_eq!(body["error"]["details"]["field"], "secrets", "{body}");

    // As a file, the second one takes no room in the environment.
    let (status, body) = answer(create(serde_json::json!([
        {"name": "big", "env": "BIG"},
        {"name": "other", "file": "other"},
    ])))
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = answer(set("small", 16)).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = answer(create(serde_json::json!([
        {"name": "big", "env": "BIG"},
        {"name": "small", "env": "SMALL"},
    ])))
    .await;
    assert_eq!(status, 201, "{body}");
    let sandbox = body["id"].as_str().expect("an id").to_owned();

    // A new value that would not fit that sandbox's environment is
    // refused, naming it; one that fits is taken.
    let (status, body) = answer(set("small", limit / 2)).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["details"]["field"], "value", "{body}");
    assert_eq!(body["error"]["details"]["sandbox_id"], sandbox, "{body}");
    let (status, body) = answer(set("small", 1024)).await;
    assert_eq!(status, 200, "{body}");
}

/// Audit finding: a query or path axum could not decode was answered in
/// axum's plain text under `/e2b`, which E2B's SDKs cannot read. It is
/// E2B's JSON error, 400 `invalid_request`, naming the part at fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_query_or_path_under_e2b_is_refused_in_e2bs_shape() {
    let server = TestServer::start().await;
    let org = server.create_org("acme").await;
    let http = reqwest::Client::new();
    // A path segment that is not UTF-8 once decoded.
    let path = http
        .get(format!("{}/e2b/sandboxes/%FF%FE", server.url))
        .header("x-api-key", &org.token);
    assert_e2b_refused("a non-UTF-8 id", answer(path).await, "path");
    // A query envd's file endpoint cannot read (a field given twice).
    let file = http.get(format!("{}/e2b/envd/files?path=/a&path=/b", server.url));
    assert_e2b_refused("a path given twice", answer(file).await, "query");
}

/// Audit finding: E2B's `List` gathered every running process, each with
/// up to 320 KiB of argv and env, into one answer held in the shared
/// server's memory. Past what one answer holds it is refused
/// (`resource_exhausted`, naming the native list that pages).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_e2b_process_list_past_what_one_answer_holds_is_refused() {
    let server = TestServer::start().await;
    let run = running_sandbox(&server, None).await;
    // 70 commands of 250 KB of argv: 17.5 MB, past the answer's 16 MiB.
    let ids = large_commands(&run, 70, 250_000).await;
    let assigned = run
        .runner
        .runner_assignments(&run.runner_id, "", 0)
        .await
        .expect("handed over");
    assert_eq!(assigned.commands.len(), 70);
    for (n, id) in ids.iter().enumerate() {
        let report = api::runners::CommandReport {
            runner_id: run.runner_id.clone(),
            epoch: assigned.sandboxes[0].epoch,
            state: api::lifecycle::CommandState::Running,
            exit_code: None,
            signal: None,
            reason: None,
            pid: Some(100 + n as i32),
            output: None,
        };
        run.runner
            .runner_report_command(id, &report)
            .await
            .expect("running");
    }
    let list = reqwest::Client::new()
        .post(format!("{}/e2b/envd/process.Process/List", server.url))
        .header("x-access-token", &run.org_token)
        .header("e2b-sandbox-id", &run.sandbox_id)
        .header("content-type", "application/json")
        .body("{}");
    let (status, body) = answer(list).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["code"], "resource_exhausted", "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("commands?state=running")),
        "{body}"
    );
}

/// Audit finding: E2B's `timeout` wrote a sandbox's TTL from a row read
/// outside its transaction, without the check every other change makes:
/// an owner could set a quarantined sandbox to end in a second (and have
/// the TTL pass terminate it). It is refused, as stop and delete are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_e2b_timeout_is_refused_on_a_quarantined_sandbox() {
    let server = TestServer::start().await;
    let run = running_sandbox(&server, None).await;
    server
        .admin
        .quarantine_sandbox(
            &run.sandbox_id,
            &serde_json::from_value(serde_json::json!({ "reason": "forensics" }))
                .expect("a quarantine request"),
        )
        .await
        .expect("quarantined");
    let timeout = reqwest::Client::new()
        .post(format!(
            "{}/e2b/sandboxes/{}/timeout",
            server.url, run.sandbox_id
        ))
        .header("x-api-key", &run.org_token)
        .header("content-type", "application/json")
        .body(r#"{"timeout": 1}"#);
    let (status, body) = answer(timeout).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error_code"], "quarantined", "{body}");
    let sandbox = run.org.get_sandbox(&run.sandbox_id).await.expect("read");
    assert_eq!(sandbox.expires_at, None, "no TTL was set: {sandbox:?}");
}

/// Audit finding: a sandbox's events came back whole, however many its
/// history held (each E2B `timeout` adds one): an answer is now at most
/// `EVENTS_PAGE_MAX`, with the cursor of the next; the client reads them
/// all, page by page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_events_come_in_pages() {
    let server = TestServer::start().await;
    let run = running_sandbox(&server, None).await;
    let http = reqwest::Client::new();
    let page_max = api::sandboxes::EVENTS_PAGE_MAX;
    for _ in 0..page_max {
        let timeout = http
            .post(format!(
                "{}/e2b/sandboxes/{}/timeout",
                server.url, run.sandbox_id
            ))
            .header("x-api-key", &run.org_token)
            .header("content-type", "application/json")
            .body(r#"{"timeout": 3600}"#);
        let (status, body) = answer(timeout).await;
        assert_eq!(status, 204, "{body}");
    }
    let events = |query: String| {
        http.get(format!(
            "{}/v1/sandboxes/{}/events{query}",
            server.url, run.sandbox_id
        ))
        .bearer_auth(&run.org_token)
    };
    let (status, first) = answer(events(String::new())).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["events"].as_array().map(Vec::len), Some(page_max));
    let cursor = first["next_cursor"]
        .as_str()
        .expect("a next page")
        .to_owned();
    assert_eq!(
        first["events"][page_max - 1]["seq"].to_string(),
        cursor,
        "the cursor is the last seq"
    );
    let (status, second) = answer(events(format!("?cursor={cursor}"))).await;
    assert_eq!(status, 200, "{second}");
    let rest = second["events"].as_array().map(Vec::len).unwrap_or(0);
    assert!(rest >= 1, "{second}");
    assert_eq!(second["next_cursor"], Value::Null, "{second}");
    let all = run
        .org
        .sandbox_events(&run.sandbox_id)
        .await
        .expect("every event");
    assert_eq!(all.events.len(), page_max + rest);
    assert!(all.events.windows(2).all(|w| w[0].seq < w[1].seq));
    let (status, bad) = answer(events("?cursor=x".to_owned())).await;
    assert_eq!(status, 400, "{bad}");
}

/// Audit finding (HTTP surface, data path): nothing bounded one org's
/// requests under way on a server, so one token's long-polls, streams and
/// terminals could hold every connection the server serves. Past its
/// share an org is answered 429 `quota_exceeded` (`requests_at_once`) at
/// once, another org is served meanwhile, and the share comes back as its
/// requests end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_orgs_requests_under_way_are_bounded_and_other_orgs_are_served() {
    let server = TestServer::start_configured(None, |config| config.org_requests_max = 2).await;
    let running = running_sandbox(&server, None).await;
    let http = reqwest::Client::new();
    let record = format!("{}/v1/sandboxes/{}", server.url, running.sandbox_id);
    let poll = || {
        let request = http
            .get(format!("{record}?wait_for=stopped&timeout=12"))
            .bearer_auth(&running.org_token);
        tokio::spawn(request.send())
    };
    let mut polls: Vec<_> = (0..2).map(|_| poll()).collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(12);
    let refused = loop {
        // A long-poll that found the share taken by this loop's own
        // request (429, on a busy machine) is sent again: the two places
        // are to be held by the long-polls.
        for slot in &mut polls {
            if slot.is_finished() {
                let answer = std::mem::replace(slot, poll())
                    .await
                    .expect("joined")
                    .expect("an answer");
                assert_eq!(answer.status(), 429, "a long-poll ended before its timeout");
            }
        }
        let answer = http
            .get(&record)
            .bearer_auth(&running.org_token)
            .send()
            .await
            .expect("an answer");
        if answer.status() == 429 {
            break answer.json::<Value>().await.expect("an envelope");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a third request was served while two long-polls held the org's share"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(refused["error"]["code"], "quota_exceeded", "{refused}");
    assert_eq!(
        refused["error"]["details"]["quota"]["metric"], "requests_at_once",
        "{refused}"
    );
    // No header takes a request out of its org's share: an `Upgrade`
    // (only an attach's is one) is counted as any other.
    let upgrade = http
        .get(&record)
        .bearer_auth(&running.org_token)
        .header("upgrade", "h2c")
        .header("connection", "upgrade")
        .send()
        .await
        .expect("an answer");
    assert_eq!(upgrade.status(), 429, "an Upgrade header skipped the share");
    let other = server.create_org("other").await;
    let theirs = http
        .get(format!("{}/v1/sandboxes", server.url))
        .bearer_auth(&other.token)
        .send()
        .await
        .expect("an answer");
    assert_eq!(
        theirs.status(),
        200,
        "another org waits on this one's share"
    );
    for poll in polls {
        let answer = poll.await.expect("joined").expect("the long-poll's answer");
        assert_eq!(answer.status(), 200);
    }
    let again = http
        .get(&record)
        .bearer_auth(&running.org_token)
        .send()
        .await
        .expect("an answer");
    assert_eq!(again.status(), 200, "the share came back");
}

/// An org name spelled as org ids are (`org_…`) is refused: where an org
/// is named by its id or its name (`roost admin filesystem bind --org`),
/// it could stand for another org. A name merely starting with "org" is
/// a name like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_org_name_spelled_as_an_org_id_is_refused() {
    let server = crate::support::TestServer::start().await;
    let taken = server.create_org("acme").await;
    for name in [taken.org_id.as_str(), "org_0123456789abcdef"] {
        let err = server
            .admin
            .create_org(&api::orgs::CreateOrgRequest {
                name: name.to_owned(),
                max_running: None,
                max_total: None,
                max_store_mib: None,
            })
            .await
            .expect_err("refused");
        let message = err.to_string();
        assert!(
            message.contains("invalid_request") && message.contains("starts org ids"),
            "{name}: {message}"
        );
    }
    server.create_org("organic").await;
}

/// Audit finding (HTTP surface): an answer whose size was known (a whole
/// one) gave its org's place back as its handler returned, before a byte
/// was sent, so a client reading megabytes slowly held memory and a
/// connection outside every org's share. The place is now held until the
/// answer's last byte is sent, a whole answer keeping its length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_read_slowly_holds_its_orgs_place_until_sent() {
    use store::Objects;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = TestServer::start_configured(None, |config| config.org_requests_max = 1).await;
    let created = server.create_org("acme").await;
    let token = created.token.clone();
    let org: store::OrgId = created.org_id.parse().expect("a store org");
    let client = api::client::Client::new(&server.url, &token);
    // Three blocks of 2.5 MiB no one can compress: a fetch of them
    // answers 7.5 MiB whole (under the answer's 8 MiB bound), more than a
    // small receive window and the server's send buffer (4 MiB) take.
    let names: Vec<String> = tokio::task::spawn_blocking({
        let objects = api::blocks::RemoteBackend::new(client, tokio::runtime::Handle::current());
        let org = org.clone();
        move || {
            (0..3u8)
                .map(|seed| {
                    let mut plain = vec![0u8; 5 << 19];
                    let mut state = u64::from(seed) + 1;
                    for byte in &mut plain {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        *byte = state as u8;
                    }
                    let digest = store::Digest::of(&plain);
                    let object = store::store::ObjectId::block(digest);
                    objects
                        .put_batch(&org, &[(object, store::block::encode(&plain).as_slice())])
                        .expect("stored");
                    format!("blocks/{}", digest.to_hex())
                })
                .collect()
        }
    })
    .await
    .expect("uploaded");

    // A client with a tiny receive window asks for both, reads the status
    // line and stops reading.
    let address: std::net::SocketAddr = server
        .url
        .trim_start_matches("http://")
        .parse()
        .expect("an address");
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.set_recv_buffer_size(4096).expect("a small window");
    let mut slow = socket.connect(address).await.expect("connected");
    let body = serde_json::json!({ "objects": names }).to_string();
    let request = format!(
        "POST /v1/blocks/{}/fetch HTTP/1.1\r\nhost: {address}\r\nauthorization: Bearer {token}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        org.as_str(),
        body.len()
    );
    slow.write_all(request.as_bytes()).await.expect("sent");
    let mut head = [0u8; 12];
    slow.read_exact(&mut head).await.expect("a status line");
    assert_eq!(&head, b"HTTP/1.1 200", "{}", String::from_utf8_lossy(&head));

    // While it is not read, the org's one place is taken.
    let http = reqwest::Client::new();
    let listed = format!("{}/v1/sandboxes", server.url);
    let answer = http
        .get(&listed)
        .bearer_auth(&token)
        .send()
        .await
        .expect("an answer");
    assert_eq!(answer.status(), 429, "the slow answer gave its place back");
    // Read whole (or dropped), the place comes back.
    let mut rest = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        let mut buf = [0u8; 1 << 16];
        loop {
            let n = slow.read(&mut buf).await.expect("read");
            rest.extend_from_slice(&buf[..n]);
            if n == 0 || rest.len() >= 15 << 19 {
                break;
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the answer came whole");
    drop(slow);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let answer = http
            .get(&listed)
            .bearer_auth(&token)
            .send()
            .await
            .expect("an answer");
        if answer.status() == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the place never came back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Audit finding (HTTP surface): a page of commands (or sandboxes) was
/// bounded by count only; 200 commands of 320 KiB of argv and env each
/// made one answer of hundreds of megabytes, held whole in the shared
/// server's memory. A page now ends where its rows pass 2 MiB stored
/// (`records::PAGE_BYTES_MAX`), and the cursor goes on from there: every
/// command is listed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_large_commands_is_bounded_by_bytes_and_the_cursor_goes_on() {
    let server = TestServer::start().await;
    let running = running_sandbox(&server, None).await;
    let made = large_commands(&running, 12, 250 * 1024).await;
    let mut listed = Vec::new();
    let mut pages = 0;
    let mut cursor: Option<String> = None;
    loop {
        let page = running
            .org
            .list_commands(&running.sandbox_id, None, Some(200), cursor.as_deref())
            .await
            .expect("a page");
        pages += 1;
        assert!(
            page.commands.len() <= 9,
            "{} commands of 250 KiB in one page",
            page.commands.len()
        );
        listed.extend(page.commands.into_iter().map(|c| c.id));
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(listed, made, "each once, in order");
    assert_eq!(pages, 2);
}

/// Audit finding (E2B surface): the `envdAccessToken` roost answered with
/// was the org's own token, so whoever was handed one sandbox's envd token
/// held every sandbox of the org and its whole API. It is now minted per
/// sandbox: good for that sandbox's envd, refused for another sandbox of
/// the same org, for E2B's control plane and for roost's API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envd_access_token_reaches_its_own_sandbox_only() {
    let server = TestServer::start().await;
    let run = running_sandbox(&server, None).await;
    let other = run
        .org
        .create_sandbox(
            &serde_json::from_value(serde_json::json!({ "image": "default" }))
                .expect("a create request"),
            None,
        )
        .await
        .expect("another sandbox of the org");
    let http = reqwest::Client::new();
    let (status, detail) = answer(
        http.get(format!("{}/e2b/sandboxes/{}", server.url, run.sandbox_id))
            .header("x-api-key", &run.org_token),
    )
    .await;
    assert_eq!(status, 200, "{detail}");
    let token = detail["envdAccessToken"]
        .as_str()
        .expect("a token")
        .to_owned();
    assert!(
        token.starts_with("roost_envd_") && token != run.org_token,
        "{token}"
    );

    let list = |token: &str, sandbox: &str| {
        http.post(format!("{}/e2b/envd/process.Process/List", server.url))
            .header("x-access-token", token)
            .header("e2b-sandbox-id", sandbox)
            .header("content-type", "application/json")
            .body("{}")
    };
    let (status, body) = answer(list(&token, &run.sandbox_id)).await;
    assert_eq!(status, 200, "its own sandbox: {body}");
    let (status, body) = answer(list(&token, &other.id)).await;
    assert_eq!(status, 401, "another sandbox of the org: {body}");
    let last = if token.ends_with('0') { '1' } else { '0' };
    let forged = format!("{}{last}", &token[..token.len() - 1]);
    let (status, body) = answer(list(&forged, &run.sandbox_id)).await;
    assert_eq!(status, 401, "a token altered: {body}");
    let (status, body) = answer(
        http.get(format!("{}/e2b/v2/sandboxes", server.url))
            .header("x-api-key", &token),
    )
    .await;
    assert_eq!(status, 401, "E2B's control plane: {body}");
    let (status, body) = answer(
        http.get(format!("{}/v1/sandboxes", server.url))
            .bearer_auth(&token),
    )
    .await;
    assert_eq!(status, 401, "roost's API: {body}");
}
