//! `roost server` and `roost admin`: the real server process on loopback,
//! on SQLite and on the PostgreSQL that `scripts/test.sh` starts.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::{Value, json};

use crate::harness::{BIN, message_lines};
use crate::plane::{Server, postgres_database, start_server, start_server_logging};

fn admin(server_url: &str, token: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("admin")
        .args(args)
        .env("ROOST_URL", server_url)
        .env("ROOST_TOKEN", token)
        .output()
        .expect("run roost admin")
}

fn json_of(output: &Output) -> Value {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("json")
}

fn post(url: &str, token: &str, body: &str) -> (u16, Option<String>, Value) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let response = reqwest::Client::new()
            .post(url)
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("send");
        let status = response.status().as_u16();
        let request_id = response
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = response.json::<Value>().await.expect("json body");
        (status, request_id, body)
    })
}

fn assert_envelope(body: &Value, code: &str, request_id: &Option<String>) {
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(
        !body["error"]["message"]
            .as_str()
            .expect("message")
            .is_empty()
    );
    assert_eq!(
        body["error"]["request_id"].as_str(),
        request_id.as_deref(),
        "{body}"
    );
}

fn admin_contract(server: &Server, admin_token: &str) {
    let url = &server.url;
    let org = json_of(&admin(
        url,
        admin_token,
        &[
            "org",
            "create",
            "acme",
            "--max-running",
            "2",
            "--max-store",
            "2G",
            "--json",
        ],
    ));
    let org_id = org["org_id"].as_str().expect("org_id");
    let org_token = org["token"].as_str().expect("token");
    assert!(
        org_id.starts_with("org_") && org_token.starts_with("roost_org_"),
        "{org}"
    );

    let again = admin(url, admin_token, &["org", "create", "acme"]);
    assert!(!again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        stderr.contains("invalid_state (409)") && message_lines(&stderr).len() == 1,
        "{stderr}"
    );

    let runner = json_of(&admin(url, admin_token, &["runner-token", "--json"]));
    assert!(
        runner["token"]
            .as_str()
            .expect("token")
            .starts_with("roost_runner_")
    );
    assert!(runner.get("profile").is_none(), "{runner}");
    // A token whose runners may declare only what it names.
    let pinned = json_of(&admin(
        url,
        admin_token,
        &[
            "runner-token",
            "--class",
            "spot",
            "--capability",
            "image:default",
            "--capacity",
            "sandboxes=4",
            "--json",
        ],
    ));
    assert_eq!(
        pinned["profile"]["placement_classes"],
        json!(["spot"]),
        "{pinned}"
    );
    assert_eq!(pinned["profile"]["capabilities"], json!(["image:default"]));
    assert_eq!(pinned["profile"]["capacity"]["sandboxes"], 4, "{pinned}");
    assert_eq!(pinned["profile"]["capacity"]["pids"], json!(u64::MAX));
    // A list is an object naming what it lists, as every other list.
    let runners = json_of(&admin(url, admin_token, &["runner", "list", "--json"]));
    assert!(runners["runners"].is_array(), "{runners}");
    let orgs = json_of(&admin(url, admin_token, &["org", "list", "--json"]));
    let acme = orgs["orgs"]
        .as_array()
        .and_then(|orgs| orgs.iter().find(|o| o["org_id"] == org_id))
        .unwrap_or_else(|| panic!("acme listed: {orgs}"));
    assert_eq!(acme["max_running"], 2, "{acme}");
    assert_eq!(acme["max_store_mib"], 2048, "{acme}");
    assert_eq!(acme["output_bytes"], 0, "{acme}");
    let table = admin(url, admin_token, &["org", "list"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.starts_with("ID")
            && table.contains("acme")
            && table.contains("0/2")
            && table.contains("STORE MAX"),
        "{table}"
    );

    let orgs = format!("{url}/v1/admin/orgs");
    let (status, id, body) = post(&orgs, "roost_admin_wrong", r#"{"name":"x"}"#);
    assert_eq!(status, 401);
    assert_envelope(&body, "unauthenticated", &id);
    // An org token does not reach admin endpoints: they do not exist for it.
    let (status, id, body) = post(&orgs, org_token, r#"{"name":"x"}"#);
    assert_eq!(status, 404);
    assert_envelope(&body, "not_found", &id);
    let (status, id, body) = post(&orgs, admin_token, r#"{"nmae":"x"}"#);
    assert_eq!(status, 400);
    assert_envelope(&body, "invalid_request", &id);
    assert!(
        body["error"]["message"]
            .as_str()
            .expect("message")
            .contains("nmae"),
        "names the field: {body}"
    );
    let (status, id, body) = post(&orgs, admin_token, r#"{"name":"../evil"}"#);
    assert_eq!(status, 400);
    assert_envelope(&body, "invalid_request", &id);
    let huge = format!(r#"{{"name":"{}"}}"#, "a".repeat(2 * 1024 * 1024));
    let (status, id, body) = post(&orgs, admin_token, &huge);
    assert_eq!(status, 413);
    assert_envelope(&body, "payload_too_large", &id);
}

#[test]
fn sqlite_server_bootstraps_an_admin_token_and_creates_orgs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let server = start_server(&data_dir, None);
    let admin_token = server
        .admin_token
        .clone()
        .expect("first start prints the admin token");
    let token_file = data_dir.join("admin-token");
    assert_eq!(
        std::fs::read_to_string(&token_file)
            .expect("token file")
            .trim(),
        admin_token
    );
    assert_eq!(
        std::fs::metadata(&token_file)
            .expect("stat")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    admin_contract(&server, &admin_token);
    drop(server);

    // Tokens are stored hashed: the database file never holds one.
    let mut bytes = std::fs::read(data_dir.join("roost.db")).expect("db");
    if let Ok(wal) = std::fs::read(data_dir.join("roost.db-wal")) {
        bytes.extend(wal);
    }
    let needle = admin_token.as_bytes();
    assert!(
        !bytes.windows(needle.len()).any(|w| w == needle),
        "a plaintext token is in the database"
    );

    // A restart prints no new token and the old one still works.
    let restarted = start_server(&data_dir, None);
    assert_eq!(restarted.admin_token, None);
    let runner = json_of(&admin(
        &restarted.url,
        &admin_token,
        &["runner-token", "--json"],
    ));
    assert!(runner["token"].is_string());
}

#[test]
fn two_servers_on_one_postgres_act_as_one_control_plane() {
    let database = postgres_database("control");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dirs: Vec<PathBuf> = ["a", "b"].iter().map(|d| tmp.path().join(d)).collect();
    // Start both at once: exactly one creates the admin token.
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(|| start_server(&dirs[0], Some(&database)));
        let b = scope.spawn(|| start_server(&dirs[1], Some(&database)));
        (a.join().expect("a"), b.join().expect("b"))
    });
    let tokens: Vec<&String> = [&a.admin_token, &b.admin_token]
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(
        tokens.len(),
        1,
        "exactly one server bootstraps the admin token"
    );
    let admin_token = tokens[0].clone();
    admin_contract(&a, &admin_token);
    // The org created through a is known to b.
    let again = admin(&b.url, &admin_token, &["org", "create", "acme"]);
    assert!(String::from_utf8_lossy(&again.stderr).contains("invalid_state"));
}

#[test]
fn every_answer_and_its_log_lines_carry_one_request_id() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let log_path = tmp.path().join("server.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let server = start_server_logging(
        &tmp.path().join("data"),
        &[],
        &[("ROOST_LOG", "server=debug"), ("ROOST_LOG_FORMAT", "json")],
        log,
    );
    let admin_token = server.admin_token.clone().expect("admin token");
    let orgs = format!("{}/v1/admin/orgs", server.url);
    let answers = [
        post(&orgs, &admin_token, r#"{"name": "acme"}"#),
        post(&orgs, &admin_token, r#"{"nmae": "acme"}"#),
        post(&orgs, "roost_admin_wrong", r#"{"name": "acme"}"#),
    ];
    let ids: Vec<String> = answers
        .iter()
        .map(|(_, id, _)| id.clone().expect("x-request-id on every answer"))
        .collect();
    let distinct: std::collections::BTreeSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), 3, "one id per request: {ids:?}");
    drop(server);

    // One JSON object per line; each request's lines name its id, and its
    // closing line says how it was answered.
    let text = std::fs::read_to_string(&log_path).expect("log");
    let lines: Vec<Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    // The request span of a line (`spans` lists the line's spans, outermost first).
    let request_of = |line: &Value| -> Option<String> {
        line["spans"]
            .as_array()?
            .iter()
            .find(|s| s["name"] == "request")
            .map(|s| s["request_id"].as_str().unwrap_or("").to_owned())
    };
    for ((status, _, _), id) in answers.iter().zip(&ids) {
        let answered: Vec<&Value> = lines
            .iter()
            .filter(|l| request_of(l).as_deref() == Some(id.as_str()))
            .filter(|l| l["fields"]["message"] == "answered")
            .collect();
        assert_eq!(answered.len(), 1, "{id} in\n{text}");
        assert_eq!(answered[0]["fields"]["status"], *status, "{text}");
    }
    // Every line logged while a request was handled names it.
    for line in &lines {
        if let Some(id) = request_of(line) {
            assert!(ids.contains(&id), "{line}");
        }
    }
}

/// `roost admin counts`: the kept counts against the records, exact after
/// creates through the API; a count changed behind the server's back is
/// named, and the command exits 1.
#[test]
fn admin_counts_finds_no_drift_after_creates_and_names_one_made_behind_its_back() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let server = start_server(&data_dir, None);
    let admin_token = server.admin_token.clone().expect("admin token");
    let org = json_of(&admin(
        &server.url,
        &admin_token,
        &["org", "create", "counted", "--max-running", "5", "--json"],
    ));
    let org_token = org["token"].as_str().expect("org token").to_owned();
    for _ in 0..3 {
        // No runner: admitted, then refused as unsupported, or waiting;
        // either way the counts must match the records.
        let _ = post(
            &format!("{}/v1/sandboxes", server.url),
            &org_token,
            r#"{"image": "default"}"#,
        );
    }
    let checked = json_of(&admin(&server.url, &admin_token, &["counts", "--json"]));
    assert_eq!(checked["drift"], serde_json::json!([]), "{checked}");
    // Behind the server's back: the fleet said to run one more.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        use sqlx::Connection;
        let url = format!("sqlite://{}", data_dir.join("roost.db").display());
        let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open");
        sqlx::query(
            "INSERT INTO sandbox_counts (scope, slot, running, held) VALUES ('fleet', 99, 1, 0)",
        )
        .execute(&mut conn)
        .await
        .expect("tampered");
    });
    let output = admin(&server.url, &admin_token, &["counts"]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains("drift: fleet running: kept 1, recomputed 0"),
        "{text}"
    );
}

/// A server killed (SIGKILL) while creates and a runner's reports go
/// through it: the other carries on, and the kept counts are exact.
#[test]
fn a_server_killed_under_load_leaves_the_kept_counts_exact() {
    let database = postgres_database("counts_kill");
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = start_server(&tmp.path().join("a"), Some(&database));
    let mut b = start_server(&tmp.path().join("b"), Some(&database));
    let admin_token = a.admin_token.clone().expect("a bootstraps the admin token");
    let org = json_of(&admin(
        &a.url,
        &admin_token,
        &["org", "create", "killed", "--max-running", "1000", "--json"],
    ));
    let org_token = org["token"].as_str().expect("org token").to_owned();
    let runner_token = json_of(&admin(&a.url, &admin_token, &["runner-token", "--json"]))["token"]
        .as_str()
        .expect("runner token")
        .to_owned();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let created = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (urls, org_token2) = ((a.url.clone(), b.url.clone()), org_token.clone());
    let load = runtime.spawn({
        let created = created.clone();
        async move {
            let http = reqwest::Client::new();
            let register = serde_json::json!({
                "name": "r", "placement_class": "on_demand",
                "capabilities": ["image:default", "network:none", "storage:standard"],
                "capacity": {"sandboxes": 1000, "memory_mib": 1048576, "cpus": 1000, "pids": 10000000},
            });
            let registered: Value = http
                .post(format!("{}/v1/runner/register", urls.1))
                .bearer_auth(&runner_token)
                .json(&register)
                .send()
                .await
                .expect("register")
                .json()
                .await
                .expect("json");
            let (runner_id, credential) = (
                registered["runner_id"].as_str().expect("id").to_owned(),
                registered["runner_token"].as_str().expect("credential").to_owned(),
            );
            // Creates through b, each reported running through b, until b
            // is gone; then through a.
            for i in 0..60 {
                let url = if i % 2 == 0 { &urls.1 } else { &urls.0 };
                let Ok(response) = http
                    .post(format!("{url}/v1/sandboxes"))
                    .bearer_auth(&org_token2)
                    .json(&serde_json::json!({"image": "default"}))
                    .send()
                    .await
                else {
                    continue;
                };
                let Ok(sandbox) = response.json::<Value>().await else {
                    continue;
                };
                created.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (Some(id), Some(epoch)) = (sandbox["id"].as_str(), sandbox["epoch"].as_u64())
                else {
                    continue;
                };
                let report = serde_json::json!({"runner_id": runner_id, "epoch": epoch, "state": "running"});
                let _ = http
                    .post(format!("{url}/v1/runner/sandboxes/{id}/report"))
                    .bearer_auth(&credential)
                    .json(&report)
                    .send()
                    .await;
                if i % 3 == 0 {
                    let _ = http
                        .delete(format!("{url}/v1/sandboxes/{id}"))
                        .bearer_auth(&org_token2)
                        .send()
                        .await;
                }
            }
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while created.load(std::sync::atomic::Ordering::SeqCst) < 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "no creates went through"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    b.child.kill().expect("SIGKILL b");
    let _ = b.child.wait();
    runtime.block_on(load).expect("the load ran");
    assert!(created.load(std::sync::atomic::Ordering::SeqCst) > 20);
    let checked = json_of(&admin(&a.url, &admin_token, &["counts", "--json"]));
    assert_eq!(checked["drift"], serde_json::json!([]), "{checked}");
    drop(org_token);
}

/// A server whose stdout is closed before it prints its start-up lines (a
/// supervisor that reads only the first, or none) serves on: printing
/// to a closed pipe panicked and ended it.
#[test]
fn a_server_whose_stdout_is_closed_serves_on() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let data = tempfile::tempdir().expect("tempdir");
    let mut child = Command::new(BIN)
        .args([
            "server",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(data.path())
        .env("ROOST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the server");
    drop(child.stdout.take());
    let url = format!("http://127.0.0.1:{port}/healthz");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let served = loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the server ended: {status}");
        }
        let answer = runtime.block_on(reqwest::get(&url));
        if answer.is_ok_and(|a| a.status().is_success()) {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(served, "the server never answered");
}

/// `GET /v1/whoami` with `token`: its status.
fn whoami_status(server_url: &str, token: &str) -> u16 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        reqwest::Client::new()
            .get(format!("{server_url}/v1/whoami"))
            .bearer_auth(token)
            .send()
            .await
            .expect("send")
            .status()
            .as_u16()
    })
}

/// `roost admin revoke-token` with the token on stdin.
fn revoke(server_url: &str, admin_token: &str, revoked: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(BIN)
        .args(["admin", "revoke-token", "--json"])
        .env("ROOST_URL", server_url)
        .env("ROOST_TOKEN", admin_token)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run roost admin revoke-token");
    writeln!(child.stdin.take().expect("stdin"), "{revoked}").expect("write the token");
    child.wait_with_output().expect("revoke-token ends")
}

/// Issue 21, point 3: a token revoked through one server is refused by it
/// at once and by the other server (which had it cached) within the
/// stated time; the org's other token, the admin and a retried revoke are
/// unaffected; the admin token and unknown tokens cannot be revoked.
#[test]
fn a_token_revoked_on_one_server_is_refused_by_every_server() {
    let database = postgres_database("revoke");
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = start_server(&tmp.path().join("a"), Some(&database));
    let b = start_server(&tmp.path().join("b"), Some(&database));
    let admin_token = a
        .admin_token
        .clone()
        .or_else(|| b.admin_token.clone())
        .expect("one server made the admin token");
    let org = json_of(&admin(
        &a.url,
        &admin_token,
        &["org", "create", "acme", "--json"],
    ));
    let first = org["token"].as_str().expect("org token").to_owned();
    let second = json_of(&admin(
        &b.url,
        &admin_token,
        &["org", "token", "acme", "--json"],
    ));
    assert_eq!(second["org_id"], org["org_id"]);
    let second = second["token"].as_str().expect("second token").to_owned();
    assert_ne!(first, second);
    // Both servers verify (and so cache) the token about to be revoked.
    for server in [&a, &b] {
        assert_eq!(whoami_status(&server.url, &first), 200);
        assert_eq!(whoami_status(&server.url, &second), 200);
    }

    let revoked = json_of(&revoke(&a.url, &admin_token, &first));
    assert_eq!(revoked["kind"], "org", "{revoked}");
    assert_eq!(revoked["org_id"], org["org_id"], "{revoked}");
    let within = revoked["refused_everywhere_within_ms"]
        .as_u64()
        .expect("a stated delay");
    assert!(within > 0, "{revoked}");
    assert_eq!(
        whoami_status(&a.url, &first),
        401,
        "the revoking server refuses it at once"
    );
    // The other server had it cached: refused once the cache entry ages out.
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(within * 10);
    while whoami_status(&b.url, &first) != 401 {
        assert!(
            std::time::Instant::now() < deadline,
            "server b still took a token revoked {within} ms x 10 ago"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    for server in [&a, &b] {
        assert_eq!(
            whoami_status(&server.url, &second),
            200,
            "the org's other token"
        );
    }
    // A retried revoke (through the other server) answers the same.
    let again = json_of(&revoke(&b.url, &admin_token, &first));
    assert_eq!(again["revoked_at"], revoked["revoked_at"], "{again}");

    // The admin token is not revocable; unknown and malformed ones are named.
    let refused = revoke(&a.url, &admin_token, &admin_token);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("invalid_request"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert_eq!(whoami_status(&a.url, &admin_token), 200);
    let unknown = revoke(&a.url, &admin_token, "roost_org_0000");
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("not_found"));
    let (status, _, body) = post(
        &format!("{}/v1/admin/tokens/revoke", a.url),
        &admin_token,
        &format!(r#"{{"token": "{}"}}"#, "x".repeat(300)),
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );
    let (status, _, body) = post(
        &format!("{}/v1/admin/tokens/revoke", a.url),
        &admin_token,
        &format!(r#"{{"token": "{second}", "also": 1}}"#),
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );
    // Only the admin may revoke: an org's token gets 404, as for any
    // admin endpoint, and revokes nothing.
    let (status, _, _) = post(
        &format!("{}/v1/admin/tokens/revoke", a.url),
        &second,
        &format!(r#"{{"token": "{second}"}}"#),
    );
    assert_eq!(status, 404);
    assert_eq!(whoami_status(&a.url, &second), 200);

    // A revoked runner token registers nothing more.
    let runner = json_of(&admin(&a.url, &admin_token, &["runner-token", "--json"]));
    let runner = runner["token"].as_str().expect("runner token").to_owned();
    let revoked = json_of(&revoke(&b.url, &admin_token, &runner));
    assert_eq!(revoked["kind"], "runner", "{revoked}");
    assert_eq!(whoami_status(&b.url, &runner), 401);
}
