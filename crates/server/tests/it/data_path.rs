//! The data path against a fake runner: a loopback axum listener stands
//! in for a runner's data listener and gives answers no sound runner
//! gives. Each test pins a finding of an outside audit.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use api::ErrorCode;
use api::client::ClientError;
use axum::http::StatusCode;
use axum::response::IntoResponse;

use crate::support::{RunningSandbox, TestServer, running_sandbox};

/// Serves `app` on a loopback port; its URL.
async fn listen(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let address = listener.local_addr().expect("its address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{address}")
}

fn refused<T>(answer: Result<T, ClientError>) -> ErrorCode {
    match answer {
        Ok(_) => panic!("expected a refusal"),
        Err(err) => err.code().unwrap_or_else(|| panic!("no error code: {err}")),
    }
}

/// E2B's envd: a GET of `/files` and a `Stat`, as the SDK sends them;
/// each answer's status and body.
async fn e2b_read_and_stat(server: &TestServer, running: &RunningSandbox) -> [(u16, String); 2] {
    let http = reqwest::Client::new();
    let read = http
        .get(format!("{}/e2b/envd/files", server.url))
        .query(&[("path", "/workspace/a")])
        .header("x-access-token", &running.org_token)
        .header("e2b-sandbox-id", &running.sandbox_id)
        .send()
        .await
        .expect("an answer");
    let stat = http
        .post(format!(
            "{}/e2b/envd/filesystem.Filesystem/Stat",
            server.url
        ))
        .header("x-access-token", &running.org_token)
        .header("e2b-sandbox-id", &running.sandbox_id)
        .header("content-type", "application/json")
        .body(r#"{"path":"/workspace/a"}"#)
        .send()
        .await
        .expect("an answer");
    let mut answers = Vec::new();
    for answer in [read, stat] {
        let status = answer.status().as_u16();
        answers.push((status, answer.text().await.expect("a body")));
    }
    answers.try_into().expect("two answers")
}

/// Audit finding 1: the relay followed a runner's redirect, so a
/// compromised runner could have the server fetch any URL (cloud
/// metadata) and stream it to an org as a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_redirect_is_never_followed() {
    let fetched = Arc::new(AtomicUsize::new(0));
    let secret = listen(axum::Router::new().fallback({
        let fetched = fetched.clone();
        move || async move {
            fetched.fetch_add(1, Ordering::SeqCst);
            "metadata-secret"
        }
    }))
    .await;
    let location = format!("{secret}/latest/meta-data/iam");
    let runner = listen(axum::Router::new().fallback(move || async move {
        (StatusCode::FOUND, [("location", location)], "moved").into_response()
    }))
    .await;
    let server = TestServer::start().await;
    let running = running_sandbox(&server, Some(&runner)).await;

    let download = running
        .org
        .get_file(&running.sandbox_id, "/workspace/a", None)
        .await;
    assert_eq!(refused(download), ErrorCode::Unavailable);
    let listed = running
        .org
        .list_files(&running.sandbox_id, "/workspace", 1)
        .await;
    assert_eq!(refused(listed), ErrorCode::Unavailable);
    for (status, body) in e2b_read_and_stat(&server, &running).await {
        assert_eq!(status, 503, "{body}");
        assert!(!body.contains("metadata-secret"), "{body}");
    }
    assert_eq!(
        fetched.load(Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
}

/// Audit finding 2: a runner refusing the server's own credential (it
/// restarted with a new key, clocks apart) reached the client as 401, as
/// if the org's token were bad; the E2B SDK raised an auth error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_refusing_the_servers_credential_is_unavailable_not_unauthenticated() {
    let runner = listen(axum::Router::new().fallback(|| async {
        let body = serde_json::json!({ "error": {
            "code": "unauthenticated",
            "message": "the data token's MAC does not match",
            "request_id": "req_runner",
        }});
        (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response()
    }))
    .await;
    let server = TestServer::start().await;
    let running = running_sandbox(&server, Some(&runner)).await;

    let download = running
        .org
        .get_file(&running.sandbox_id, "/workspace/a", None)
        .await;
    match download {
        Err(ClientError::Api { code, message, .. }) => {
            assert_eq!(code, ErrorCode::Unavailable);
            assert!(
                message.contains("refused this server's credential"),
                "{message}"
            );
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    // A command's stdin and terminal go through the same relay.
    let command = running
        .org
        .create_command(
            &running.sandbox_id,
            &serde_json::from_value(serde_json::json!({ "argv": ["cat"], "stdin": true }))
                .expect("a command"),
            None,
        )
        .await
        .expect("a command");
    let handed = running
        .runner
        .runner_assignments(&running.runner_id, "", 0)
        .await
        .expect("the command is handed over");
    assert_eq!(handed.commands.len(), 1);
    let written = running
        .org
        .send_stdin(
            &running.sandbox_id,
            &command.id,
            reqwest::Body::from("hi"),
            true,
        )
        .await;
    assert_eq!(refused(written), ErrorCode::Unavailable);
    for (status, body) in e2b_read_and_stat(&server, &running).await {
        assert_eq!(status, 503, "{body}");
        assert!(
            body.contains("unavailable") || body.contains("503"),
            "{body}"
        );
    }
}

/// The gauge `name` in a `/metrics` text.
fn gauge(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
}

/// Audit finding (HTTP surface): nothing bounded the connections served at
/// once, and the open files limit stayed at its soft 1,024: clients that
/// connect and hold idle sockets, with no token, took every descriptor,
/// and the server could open neither a database connection nor a
/// runner's stream for any tenant. Past the cap, connections wait in the
/// backlog and are served once idle ones end; never more are open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_and_are_served_once_idle_ones_end() {
    let server = TestServer::start_configured(None, |config| {
        config.header_read_timeout = Duration::from_secs(1);
        config.connections_max = 4;
    })
    .await;
    let address = server.url.trim_start_matches("http://");
    let mut silent = Vec::new();
    for _ in 0..12 {
        silent.push(
            tokio::net::TcpStream::connect(address)
                .await
                .expect("a connection, if only in the backlog"),
        );
    }
    let metrics = reqwest::Client::new()
        .get(format!("{}/metrics", server.url))
        .bearer_auth(&server.admin_token)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("served once idle connections end")
        .text()
        .await
        .expect("the metrics");
    assert_eq!(gauge(&metrics, "roost_http_connections_max"), 4);
    let open = gauge(&metrics, "roost_http_connections_open");
    assert!((1..=4).contains(&open), "{open} connections open at once");
    server
        .admin
        .deployment()
        .await
        .expect("the server still answers");
    drop(silent);
}

/// Audit finding 5: without a timer, hyper never timed out a connection
/// that sends no request, so idle connections held descriptors forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_sends_nothing_is_closed() {
    use tokio::io::AsyncReadExt;
    let server = TestServer::start_configured(None, |config| {
        config.header_read_timeout = Duration::from_secs(1);
    })
    .await;
    let address = server.url.trim_start_matches("http://");
    let mut silent = tokio::net::TcpStream::connect(address)
        .await
        .expect("a connection");
    // Generous: the server closes it after about a second.
    let mut buffer = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match silent.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                // hyper may answer 408 before it closes.
                Ok(_) => continue,
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "a silent connection was kept open for 60 s");
    // A client that talks is still served.
    server
        .admin
        .deployment()
        .await
        .expect("the server still answers");
}
