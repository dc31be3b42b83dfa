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
