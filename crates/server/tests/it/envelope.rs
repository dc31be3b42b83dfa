//! Every error is the JSON envelope with a request id, in the right order:
//! a caller learns nothing of an endpoint its token may not use (404 before
//! the body is read), and bad query values, unknown parameters, paths that
//! are not UTF-8 and garbage cursors are 400 envelopes naming the problem.
//! Raw HTTP, so nothing between the test and the server fixes a request up.

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::TestServer;

/// One HTTP/1.1 request on a fresh connection: the status, the
/// content type and the body.
async fn raw(server: &TestServer, request: &str) -> (u16, String, String) {
    let address = server.url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect to the test server");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .expect("read the answer");
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let content_type = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    (status, content_type, body.to_owned())
}

fn request(method: &str, path: &str, token: &str, body: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// The answer is the envelope: JSON with `error.code` and a request id.
fn envelope(status: u16, content_type: &str, body: &str) -> (u16, String, String) {
    assert!(
        content_type.starts_with("application/json"),
        "{status} answered {content_type:?}: {body}"
    );
    let value: Value = serde_json::from_str(body).expect("a JSON body");
    let error = &value["error"];
    assert!(
        error["request_id"]
            .as_str()
            .is_some_and(|id| !id.is_empty()),
        "no request id: {body}"
    );
    (
        status,
        error["code"].as_str().unwrap_or_default().to_owned(),
        error["message"].as_str().unwrap_or_default().to_owned(),
    )
}

async fn tokens(server: &TestServer) -> (String, String) {
    let org = server.create_org("acme").await;
    let runner = server
        .admin
        .create_runner_token(&Default::default())
        .await
        .expect("a runner token");
    let registered = api::client::Client::new(&server.url, &runner.token)
        .runner_register(&crate::support::register_request("r1"))
        .await
        .expect("a runner registers");
    (
        org.token,
        registered.runner_token.expect("a runner's credential"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_are_envelopes_and_name_the_problem() {
    let server = TestServer::start().await;
    let (org, runner) = tokens(&server).await;

    // A bad query value, and an unknown parameter of a typed query.
    let (status, kind, body) = raw(
        &server,
        &request("GET", "/v1/sandboxes/sbx_1?timeout=soon", &org, ""),
    )
    .await;
    let (status, code, _) = envelope(status, &kind, &body);
    assert_eq!((status, code.as_str()), (400, "invalid_request"));
    let (status, kind, body) = raw(
        &server,
        &request(
            "GET",
            "/v1/runner/assignments?runner_id=r&bogus=1",
            &runner,
            "",
        ),
    )
    .await;
    let (status, code, message) = envelope(status, &kind, &body);
    assert_eq!(
        (status, code.as_str()),
        (400, "invalid_request"),
        "{message}"
    );
    assert!(message.contains("bogus"), "names the parameter: {message}");

    // A path segment that is not UTF-8.
    let (status, kind, body) =
        raw(&server, &request("GET", "/v1/sandboxes/%FF%FE", &org, "")).await;
    let (status, code, _) = envelope(status, &kind, &body);
    assert_eq!((status, code.as_str()), (400, "invalid_request"));

    // A garbage cursor is refused, not read as the first page.
    let (status, kind, body) = raw(
        &server,
        &request("GET", "/v1/sandboxes?cursor=zzz", &org, ""),
    )
    .await;
    let (status, code, message) = envelope(status, &kind, &body);
    assert_eq!(
        (status, code.as_str()),
        (400, "invalid_request"),
        "{message}"
    );
    assert!(message.contains("cursor"), "{message}");

    // A huge resource names its bound.
    let (status, kind, body) = raw(
        &server,
        &request(
            "POST",
            "/v1/sandboxes",
            &org,
            r#"{"resources": {"memory_mib": 99999999999}}"#,
        ),
    )
    .await;
    let (status, code, message) = envelope(status, &kind, &body);
    assert_eq!(
        (status, code.as_str()),
        (400, "invalid_request"),
        "{message}"
    );
    assert!(message.contains("1073741824"), "names the bound: {message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_of_the_wrong_kind_gets_404_before_its_body_is_read() {
    let server = TestServer::start().await;
    let (org, runner) = tokens(&server).await;
    let enrolment = server
        .admin
        .create_runner_token(&Default::default())
        .await
        .expect("a runner token")
        .token;
    // Not even valid JSON: a runner endpoint must not tell an org token so.
    for (method, path, token) in [
        ("POST", "/v1/runner/register", org.as_str()),
        ("POST", "/v1/runner/heartbeat", org.as_str()),
        ("POST", "/v1/sandboxes", runner.as_str()),
        ("POST", "/v1/admin/orgs", org.as_str()),
        ("POST", "/v1/admin/orgs", runner.as_str()),
        // A runner token only registers: the rest of the runner protocol
        // takes a runner's own credential.
        ("POST", "/v1/runner/heartbeat", enrolment.as_str()),
        (
            "POST",
            "/v1/runner/sandboxes/sbx_1/report",
            enrolment.as_str(),
        ),
    ] {
        let (status, kind, body) = raw(&server, &request(method, path, token, "{not json")).await;
        let (status, code, message) = envelope(status, &kind, &body);
        assert_eq!(
            (status, code.as_str()),
            (404, "not_found"),
            "{method} {path}: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_scheme_is_case_insensitive() {
    let server = TestServer::start().await;
    let (org, _) = tokens(&server).await;
    for scheme in ["bearer", "BEARER", "Bearer"] {
        let request = format!(
            "GET /v1/whoami HTTP/1.1\r\nHost: test\r\nAuthorization: {scheme} {org}\r\nConnection: close\r\n\r\n"
        );
        let (status, _, body) = raw(&server, &request).await;
        assert_eq!(status, 200, "{scheme}: {body}");
    }
    let request = "GET /v1/whoami HTTP/1.1\r\nHost: test\r\nAuthorization: Basic abc\r\nConnection: close\r\n\r\n";
    let (status, kind, body) = raw(&server, request).await;
    let (status, code, _) = envelope(status, &kind, &body);
    assert_eq!((status, code.as_str()), (401, "unauthenticated"));
}

/// A mutation's handler runs on a task of its own (so a client going away
/// cannot cut it short after its commit): should it panic, the caller gets
/// the 500 envelope, what it committed stays, and the server serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mutation_whose_handler_panics_after_its_commit_answers_500_and_its_record_stays() {
    let server = TestServer::start_configured(None, |config| {
        config.failpoint = api::failpoint::Failpoints::panicking_at("after_commit:create_sandbox");
    })
    .await;
    let (org, _) = tokens(&server).await;
    let (status, kind, body) = raw(&server, &request("POST", "/v1/sandboxes", &org, "{}")).await;
    let (status, code, _) = envelope(status, &kind, &body);
    assert_eq!((status, code.as_str()), (500, "internal"), "{body}");
    let listed = api::client::Client::new(&server.url, &org)
        .list_sandboxes(&api::client::SandboxListQuery::default())
        .await
        .expect("the server still serves");
    assert_eq!(listed.sandboxes.len(), 1, "{listed:?}");
}

/// An encoded NUL byte in a URL's path or query is 400 naming it, on every
/// engine: PostgreSQL refuses NUL in any text it compares, and such a GET
/// was answered 500 `internal` there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_byte_in_a_path_or_query_is_a_400_on_every_engine() {
    let mut databases = vec![None];
    if let Ok(base) = std::env::var("ROOST_TEST_POSTGRES_URL") {
        databases.push(Some(
            crate::control::postgres_database(&base, "envelope_nul").await,
        ));
    }
    for database in databases {
        let engine = if database.is_some() {
            "postgres"
        } else {
            "sqlite"
        };
        let server =
            TestServer::start_configured(None, |config| config.database_url = database).await;
        let (org, _) = tokens(&server).await;
        for path in [
            "/v1/sandboxes/%00",
            "/v1/sandboxes/sbx_%00abc",
            "/v1/sandboxes/%00/commands",
            "/v1/snapshots/%00",
            "/v1/sandboxes?label=a%3D%00",
        ] {
            let (status, kind, body) = raw(&server, &request("GET", path, &org, "")).await;
            let (status, code, message) = envelope(status, &kind, &body);
            assert_eq!(
                (status, code.as_str()),
                (400, "invalid_request"),
                "{engine} GET {path}: {body}"
            );
            assert!(message.contains("NUL"), "{engine} GET {path}: {message}");
        }
        // E2B's surface answers in E2B's shape.
        let (status, _, body) = raw(&server, &request("GET", "/e2b/sandboxes/%00", &org, "")).await;
        let error: Value = serde_json::from_str(&body).expect("a JSON body");
        assert_eq!(
            (status, error["code"].as_u64()),
            (400, Some(400)),
            "{engine}: {body}"
        );
        assert!(
            error["message"].as_str().is_some_and(|m| m.contains("NUL")),
            "{engine}: {body}"
        );
        // The server still serves.
        let (status, _, body) = raw(&server, &request("GET", "/v1/whoami", &org, "")).await;
        assert_eq!(status, 200, "{engine}: {body}");
    }
}

/// Audit finding (HTTP surface): API answers (E2B's carry the org token as
/// `envdAccessToken`) said nothing of caching or sniffing, and E2B clients
/// authenticate with headers a shared cache does not know to keep
/// private. Every answer is `no-store` and `nosniff`, errors included; the
/// dashboard keeps its own caching.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_answers_are_never_stored_nor_sniffed() {
    let server = TestServer::start().await;
    let client = reqwest::Client::new();
    let admin_token = server.admin_token.clone();
    for (path, token, status) in [
        ("/v1/deployment", Some(admin_token.as_str()), 200),
        ("/v1/sandboxes/sbx_nope", Some(admin_token.as_str()), 404),
        ("/e2b/sandboxes", None, 401),
        ("/healthz", None, 200),
    ] {
        let mut request = client.get(format!("{}{path}", server.url));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let answer = request.send().await.expect("an answer");
        assert_eq!(answer.status().as_u16(), status, "{path}");
        let header = |name: &str| {
            answer
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        assert_eq!(
            header("cache-control").as_deref(),
            Some("no-store"),
            "{path}"
        );
        assert_eq!(
            header("x-content-type-options").as_deref(),
            Some("nosniff"),
            "{path}"
        );
    }
    let ui = client
        .get(format!("{}/ui", server.url))
        .send()
        .await
        .expect("the dashboard");
    assert_eq!(
        ui.headers()
            .get("cache-control")
            .and_then(|v| v.to_str().ok()),
        Some("no-cache")
    );
}
