//! What the web dashboard needs from the server: `/ui` served from the
//! binary under a strict Content-Security-Policy, small, with no inline
//! script; the events long-poll that keeps an open timeline live; the
//! list's `If-None-Match` long-poll; the admin's orgs with quota use. (The
//! page itself runs in a real browser in `crates/cli/tests/it/dashboard.rs`.)

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{TestServer, register_request};

/// A server with one runner registered (nothing is admitted without one;
/// no runner process runs: sandboxes stay where admission leaves them).
async fn server_with_runner() -> TestServer {
    let server = TestServer::start().await;
    let token = server
        .admin
        .create_runner_token(&Default::default())
        .await
        .expect("a runner token")
        .token;
    api::client::Client::new(&server.url, &token)
        .runner_register(&register_request("r"))
        .await
        .expect("registered");
    server
}

async fn send(
    server: &TestServer,
    method: reqwest::Method,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, Vec<u8>) {
    let mut request = reqwest::Client::new().request(method, format!("{}{path}", server.url));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (
        status,
        headers,
        response.bytes().await.expect("a body").to_vec(),
    )
}

async fn get_json(server: &TestServer, path: &str, token: &str) -> Value {
    let (status, _, body) = send(server, reqwest::Method::GET, path, Some(token), None, &[]).await;
    assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).expect("JSON")
}

/// An org (with quotas) and its token.
async fn org(server: &TestServer, name: &str, quotas: Value) -> (String, String) {
    let mut body = json!({"name": name});
    body.as_object_mut()
        .expect("an object")
        .extend(quotas.as_object().expect("quotas").clone());
    let (status, _, answer) = send(
        server,
        reqwest::Method::POST,
        "/v1/admin/orgs",
        Some(&server.admin_token),
        Some(body),
        &[],
    )
    .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&answer));
    let created: Value = serde_json::from_slice(&answer).expect("JSON");
    (
        created["org_id"].as_str().expect("id").to_owned(),
        created["token"].as_str().expect("token").to_owned(),
    )
}

async fn create(server: &TestServer, token: &str, labels: Value) -> String {
    let (status, _, body) = send(
        server,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(token),
        Some(json!({"labels": labels})),
        &[],
    )
    .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let created: Value = serde_json::from_slice(&body).expect("JSON");
    created["id"].as_str().expect("id").to_owned()
}

#[tokio::test]
async fn the_dashboard_is_served_from_the_binary_under_a_strict_policy() {
    let server = TestServer::start().await;
    let mut transfer = 0;
    for (path, content_type) in [
        ("/ui", "text/html"),
        ("/ui/", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/style.css", "text/css"),
    ] {
        // No token: the page is public, the data behind it is not.
        let (status, headers, body) =
            send(&server, reqwest::Method::GET, path, None, None, &[]).await;
        assert_eq!(status, 200, "{path}");
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        };
        assert!(header("content-type").starts_with(content_type), "{path}");
        assert_eq!(header("x-content-type-options"), "nosniff", "{path}");
        let policy = header("content-security-policy");
        assert!(policy.contains("default-src 'none'"), "{policy}");
        assert!(policy.contains("script-src 'self';"), "{policy}");
        assert!(policy.contains("connect-src 'self'"), "{policy}");
        assert!(
            !policy.contains("unsafe-inline") && !policy.contains("unsafe-eval"),
            "{policy}"
        );
        if path != "/ui/" {
            transfer += body.len();
        }
    }
    assert!(transfer <= 300 * 1024, "the page is {transfer} bytes");

    // Under that policy an inline script would not run: there is none,
    // and the script builds no HTML from strings.
    let html = server::http::ui::INDEX_HTML;
    for (at, _) in html.match_indices("<script") {
        let tag = &html[at..at + html[at..].find('>').expect("a closed tag")];
        assert!(tag.contains(" src="), "inline script: {tag}");
    }
    for handler in ["onclick=", "onload=", "onerror=", "onsubmit="] {
        assert!(!html.contains(handler), "inline handler {handler}");
    }
    let js = server::http::ui::APP_JS;
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
    ] {
        assert!(!js.contains(sink), "app.js uses {sink}");
    }
    // The token never goes into a URL or a log.
    for leak in ["console.", "?token", "&token"] {
        assert!(!js.contains(leak), "app.js has {leak}");
    }
}

#[tokio::test]
async fn the_dashboards_states_are_the_apis() {
    let server = TestServer::start().await;
    let doc = get_json(&server, "/v1/openapi.json", &server.admin_token).await;
    let states: Vec<String> = doc["components"]["schemas"]["SandboxState"]["enum"]
        .as_array()
        .expect("the states")
        .iter()
        .map(|s| format!("{s}"))
        .collect();
    let js = server::http::ui::APP_JS;
    let start = js.find("SANDBOX_STATES = [").expect("the list") + "SANDBOX_STATES = ".len();
    let end = start + js[start..].find(']').expect("its end") + 1;
    let listed: Vec<String> = serde_json::from_str::<Vec<String>>(&js[start..end])
        .expect("a JSON array")
        .iter()
        .map(|s| format!("{s:?}"))
        .collect();
    assert_eq!(listed, states);
}

#[tokio::test]
async fn an_open_timeline_gets_the_next_event_as_it_is_recorded() {
    let server = server_with_runner().await;
    let (_, token) = org(&server, "timeline", json!({})).await;
    let id = create(&server, &token, json!({})).await;
    let all = get_json(&server, &format!("/v1/sandboxes/{id}/events"), &token).await;
    let last = all["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["seq"].as_u64())
        .max()
        .expect("the admission event");
    // Nothing after the last: the long-poll waits (here 1 s) and answers
    // with none.
    let started = Instant::now();
    let none = get_json(
        &server,
        &format!("/v1/sandboxes/{id}/events?after={last}&timeout=1"),
        &token,
    )
    .await;
    assert_eq!(none["events"], json!([]));
    assert!(started.elapsed() >= Duration::from_millis(900));

    // A waiter answers when the next event is recorded (a stop asks for
    // it), long before its timeout.
    let waiter = {
        let (url, token, id) = (server.url.clone(), token.clone(), id.clone());
        tokio::spawn(async move {
            let answer = reqwest::Client::new()
                .get(format!(
                    "{url}/v1/sandboxes/{id}/events?after={last}&timeout=25"
                ))
                .bearer_auth(token)
                .send()
                .await
                .expect("answered");
            answer.json::<Value>().await.expect("JSON")
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let asked = Instant::now();
    let (status, _, _) = send(
        &server,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{id}/stop"),
        Some(&token),
        Some(json!({})),
        &[],
    )
    .await;
    assert_eq!(status, 202);
    let woken = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter answers before its timeout")
        .expect("joined");
    assert!(asked.elapsed() < Duration::from_secs(20));
    let events = woken["events"].as_array().expect("events");
    assert!(!events.is_empty(), "{woken}");
    assert!(
        events.iter().all(|e| e["seq"].as_u64() > Some(last)),
        "{woken}"
    );

    // `after` past the end is no error: nothing yet.
    let later = get_json(
        &server,
        &format!("/v1/sandboxes/{id}/events?after=999999"),
        &token,
    )
    .await;
    assert_eq!(later["events"], json!([]));
    let (status, _, _) = send(
        &server,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{id}/events?timeout=26"),
        Some(&token),
        None,
        &[],
    )
    .await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn the_list_answers_304_until_its_page_changes() {
    let server = server_with_runner().await;
    let (_, token) = org(&server, "lists", json!({})).await;
    let (_, other) = org(&server, "others", json!({})).await;
    let first = create(&server, &token, json!({"team": "a"})).await;
    let (status, headers, _) = send(
        &server,
        reqwest::Method::GET,
        "/v1/sandboxes?label=team=a",
        Some(&token),
        None,
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let etag = headers
        .get("etag")
        .and_then(|v| v.to_str().ok())
        .expect("an ETag")
        .to_owned();

    // Unchanged: 304 at the timeout, with the same ETag.
    let (status, headers, body) = send(
        &server,
        reqwest::Method::GET,
        "/v1/sandboxes?label=team=a&timeout=1",
        Some(&token),
        None,
        &[("if-none-match", &etag)],
    )
    .await;
    assert_eq!(status, 304);
    assert!(body.is_empty());
    assert_eq!(
        headers.get("etag").and_then(|v| v.to_str().ok()),
        Some(etag.as_str())
    );

    // Another org's change wakes the waiter, which still answers 304;
    // this org's new sandbox answers at once with the new page.
    let waiter = {
        let (url, token, etag) = (server.url.clone(), token.clone(), etag.clone());
        tokio::spawn(async move {
            let answer = reqwest::Client::new()
                .get(format!("{url}/v1/sandboxes?label=team=a&timeout=25"))
                .bearer_auth(token)
                .header("if-none-match", etag)
                .send()
                .await
                .expect("answered");
            (
                answer.status().as_u16(),
                answer.json::<Value>().await.unwrap_or(Value::Null),
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    create(&server, &other, json!({"team": "a"})).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished(), "another org's sandbox is not news");
    let second = create(&server, &token, json!({"team": "a"})).await;
    let (status, page) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter answers before its timeout")
        .expect("joined");
    assert_eq!(status, 200);
    let ids: Vec<&str> = page["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(ids, [first.as_str(), second.as_str()]);

    // Without If-None-Match a timeout changes nothing: answered at once.
    let started = Instant::now();
    let (status, _, _) = send(
        &server,
        reqwest::Method::GET,
        "/v1/sandboxes?timeout=25",
        Some(&token),
        None,
        &[],
    )
    .await;
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[tokio::test]
async fn the_admin_sees_every_org_with_its_quota_use() {
    let server = server_with_runner().await;
    let (limited, token) = org(
        &server,
        "limited",
        json!({"max_running": 3, "max_total": 5}),
    )
    .await;
    let (free, _) = org(&server, "free", json!({})).await;
    create(&server, &token, json!({})).await;
    create(&server, &token, json!({})).await;
    let list = get_json(&server, "/v1/admin/orgs", &server.admin_token).await;
    let orgs = list["orgs"].as_array().expect("orgs");
    let find = |id: &str| {
        orgs.iter()
            .find(|o| o["org_id"] == id)
            .unwrap_or_else(|| panic!("{id} in {list}"))
            .clone()
    };
    let limited = find(&limited);
    assert_eq!(limited["name"], "limited");
    assert_eq!(limited["max_running"], 3);
    assert_eq!(limited["max_total"], 5);
    assert_eq!(limited["total"], 2, "{limited}");
    assert!(limited["created_at"].is_string());
    let free = find(&free);
    assert_eq!(free["max_running"], Value::Null);
    assert_eq!(
        (free["running"].as_u64(), free["total"].as_u64()),
        (Some(0), Some(0))
    );

    // An org token does not see it.
    let (status, _, _) = send(
        &server,
        reqwest::Method::GET,
        "/v1/admin/orgs",
        Some(&token),
        None,
        &[],
    )
    .await;
    assert_eq!(status, 404);
}
