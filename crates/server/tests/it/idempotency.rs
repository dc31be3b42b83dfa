//! `Idempotency-Key` under concurrency: creates with one key that race
//! each other answer as one request (the same sandbox), on every engine,
//! in both APIs.

use api::client::Client;
use serde_json::{Value, json};

use crate::support::{TestServer, register_request};

/// Rounds of racing creates: each round a fresh org whose quota the
/// first create fills.
const ROUNDS: usize = 8;
/// Creates racing in one round.
const RACERS: usize = 4;

/// A server on each engine this machine offers (PostgreSQL when
/// `ROOST_TEST_POSTGRES_URL` names one).
async fn servers(name: &str) -> Vec<(&'static str, TestServer)> {
    let mut databases = vec![("sqlite", None)];
    if let Ok(base) = std::env::var("ROOST_TEST_POSTGRES_URL") {
        databases.push((
            "postgres",
            Some(crate::control::postgres_database(&base, name).await),
        ));
    }
    let mut servers = Vec::new();
    for (engine, database) in databases {
        let server =
            TestServer::start_configured(None, |config| config.database_url = database).await;
        servers.push((engine, server));
    }
    servers
}

/// A runner with room for every round's sandbox, durable ones too: its
/// client and id.
async fn runner(server: &TestServer) -> (Client, String) {
    let enrolment = server
        .admin
        .create_runner_token(&Default::default())
        .await
        .expect("a runner token")
        .token;
    let mut request = register_request("r1");
    request.capacity.sandboxes = 64;
    // E2B's creates are durable where the server has a store.
    request.capabilities.push("storage:durable".to_owned());
    let registered = Client::new(&server.url, &enrolment)
        .runner_register(&request)
        .await
        .expect("a runner registers");
    let runner = Client::new(
        &server.url,
        &registered.runner_token.expect("a runner's credential"),
    );
    (runner, registered.runner_id)
}

/// An org allowed one running sandbox: its token.
async fn org_of_one(server: &TestServer, name: &str) -> String {
    server
        .admin
        .create_org(&api::orgs::CreateOrgRequest {
            name: name.to_owned(),
            max_running: Some(1),
            max_total: None,
            max_store_mib: None,
        })
        .await
        .expect("an org")
        .token
}

/// `RACERS` creates sent at once, each with the key `key`: their
/// statuses and bodies.
async fn race(request: impl Fn() -> reqwest::RequestBuilder) -> Vec<(u16, Value)> {
    let sent = (0..RACERS).map(|_| {
        let request = request();
        async move {
            let response = request.send().await.expect("the server answers");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    });
    futures::future::join_all(sent).await
}

/// Audit finding: the replay check ran before the create's transaction
/// and the key was compared only at its commit, so of two creates with
/// one key the second, counting the first's sandbox against the org's
/// quota, was refused 429 before its key was compared: a retry told its
/// first attempt had failed. A keyed request that fails now looks for a
/// committed answer of its key before it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_creates_with_one_key_answer_one_sandbox_at_the_quota() {
    for (engine, server) in servers("idempotent_race").await {
        let _runner = runner(&server).await;
        let http = reqwest::Client::new();
        for round in 0..ROUNDS {
            let token = org_of_one(&server, &format!("o{round}")).await;
            let answers = race(|| {
                http.post(format!("{}/v1/sandboxes", server.url))
                    .bearer_auth(&token)
                    .header("idempotency-key", "one-key")
                    .json(&json!({}))
            })
            .await;
            let first = &answers[0].1["id"];
            for (status, body) in &answers {
                assert_eq!(*status, 201, "{engine}, round {round}: {answers:?}");
                assert_eq!(&body["id"], first, "{engine}, round {round}: {answers:?}");
            }
        }
    }
}

/// The same race through E2B's create, which answers once the sandbox
/// runs (a runner here reports each of its sandboxes running).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_e2b_creates_with_one_key_answer_one_sandbox_at_the_quota() {
    for (engine, server) in servers("idempotent_race_e2b").await {
        let (runner, runner_id) = runner(&server).await;
        let reporting = tokio::spawn(async move {
            loop {
                let assigned = runner
                    .runner_assignments(&runner_id, "", 0)
                    .await
                    .expect("the runner's assignments");
                for sandbox in assigned.sandboxes {
                    if sandbox.state == api::lifecycle::SandboxState::Running {
                        continue;
                    }
                    let running = api::runners::SandboxReport {
                        runner_id: runner_id.clone(),
                        epoch: sandbox.epoch,
                        state: api::lifecycle::SandboxState::Running,
                        reason: None,
                        message: None,
                        wake: None,
                    };
                    // A report the server refuses (a stale epoch) is
                    // retried with the next assignments.
                    let _ = runner
                        .runner_report_sandbox(&sandbox.sandbox_id, &running)
                        .await;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        });
        let http = reqwest::Client::new();
        for round in 0..ROUNDS {
            let token = org_of_one(&server, &format!("o{round}")).await;
            let answers = race(|| {
                http.post(format!("{}/e2b/v2/sandboxes", server.url))
                    .header("x-api-key", &token)
                    .header("idempotency-key", "one-key")
                    .json(&json!({"templateID": "base"}))
            })
            .await;
            let first = &answers[0].1["sandboxID"];
            for (status, body) in &answers {
                assert_eq!(*status, 201, "{engine}, round {round}: {answers:?}");
                assert_eq!(
                    &body["sandboxID"], first,
                    "{engine}, round {round}: {answers:?}"
                );
            }
        }
        reporting.abort();
    }
}
