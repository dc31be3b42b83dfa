//! Runner credentials (issue 14, point 3): a runner token only enrols; each
//! registration gets its own credential, which speaks for that runner
//! alone. Every test here is an attack by one runner on another runner's
//! sandboxes, or on an org it runs nothing for, and what it gets: 404
//! `not_found` for anything naming another runner, `fenced` for a report
//! on a sandbox placed elsewhere, 404 for another org's objects.

use api::ErrorCode;
use api::client::{Client, ClientError};
use api::lifecycle::{CommandState, SandboxState};
use api::runners::{
    CommandReport, HeartbeatRequest, PreemptRequest, SandboxReport, SaveReport, SnapshotReport,
};
use api::sandboxes::CreateSandboxRequest;

use crate::support::{TestServer, register_request};

/// A registered runner: its id and a client holding its credential.
struct Runner {
    id: String,
    client: Client,
    credential: String,
}

async fn enrol(server: &TestServer, runner_token: &str, name: &str) -> Runner {
    let registered = Client::new(&server.url, runner_token)
        .runner_register(&register_request(name))
        .await
        .expect("a runner token registers a new runner");
    let credential = registered
        .runner_token
        .expect("a new runner gets its own credential");
    Runner {
        client: Client::new(&server.url, &credential),
        id: registered.runner_id,
        credential,
    }
}

async fn runner_token(server: &TestServer) -> String {
    server
        .admin
        .create_runner_token(&Default::default())
        .await
        .expect("a runner token")
        .token
}

fn refused<T: std::fmt::Debug>(answer: Result<T, ClientError>) -> ErrorCode {
    match answer {
        Ok(value) => panic!("expected a refusal, got {value:?}"),
        Err(err) => err.code().unwrap_or_else(|| panic!("no error code: {err}")),
    }
}

fn create_request() -> CreateSandboxRequest {
    serde_json::from_value(serde_json::json!({
        "image": "default",
        "env": { "API_KEY": "org-a-secret" },
    }))
    .expect("a create request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_cannot_read_or_report_as_another_runner() {
    let server = TestServer::start().await;
    let token = runner_token(&server).await;
    let (org, _) = server.org("acme").await;
    // A is the only runner when the sandbox is created: it lands there.
    let a = enrol(&server, &token, "a").await;
    let sandbox = org
        .create_sandbox(&create_request(), None)
        .await
        .expect("a sandbox");
    let b = enrol(&server, &token, "b").await;
    assert_ne!(a.id, b.id);
    let assigned = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("A reads its own assignments");
    assert_eq!(assigned.sandboxes.len(), 1);
    assert_eq!(assigned.sandboxes[0].sandbox_id, sandbox.id);
    let epoch = assigned.sandboxes[0].epoch;
    let running = SandboxReport {
        runner_id: a.id.clone(),
        epoch,
        state: SandboxState::Running,
        reason: None,
        message: None,
        wake: None,
    };
    a.client
        .runner_report_sandbox(&sandbox.id, &running)
        .await
        .expect("A reports its own sandbox running");
    let command = org
        .create_command(
            &sandbox.id,
            &serde_json::from_value(serde_json::json!({ "argv": ["true"] })).expect("a command"),
            None,
        )
        .await
        .expect("a command");
    let snapshot = org
        .create_snapshot(
            &sandbox.id,
            &serde_json::from_value(serde_json::json!({})).expect("a snapshot request"),
            None,
        )
        .await
        .expect("a snapshot");
    let assigned = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("A reads its own assignments");
    assert_eq!(assigned.commands.len(), 1, "{assigned:?}");
    let before = org.get_sandbox(&sandbox.id).await.expect("the sandbox");

    // B names A: every call is 404, as if A did not exist for it.
    assert_eq!(
        refused(b.client.runner_assignments(&a.id, "", 0).await),
        ErrorCode::NotFound,
        "B reads A's assignments (another org's env)"
    );
    assert_eq!(
        refused(
            b.client
                .runner_heartbeat(&HeartbeatRequest {
                    runner_id: a.id.clone()
                })
                .await
        ),
        ErrorCode::NotFound
    );
    let as_a = SandboxReport {
        runner_id: a.id.clone(),
        epoch,
        state: SandboxState::Failed,
        reason: Some("oom".to_owned()),
        message: None,
        wake: None,
    };
    assert_eq!(
        refused(b.client.runner_report_sandbox(&sandbox.id, &as_a).await),
        ErrorCode::NotFound
    );
    let save = SaveReport {
        runner_id: a.id.clone(),
        epoch,
        outcome: "failed".to_owned(),
        root: None,
        captured_at_ms: None,
        bytes_pending: None,
        error: Some("forged".to_owned()),
        snapshot_ms: None,
        uploaded_bytes: None,
        securing: false,
    };
    assert_eq!(
        refused(b.client.runner_report_save(&sandbox.id, &save).await),
        ErrorCode::NotFound
    );
    assert_eq!(
        refused(
            b.client
                .runner_preempt(&PreemptRequest {
                    runner_id: a.id.clone()
                })
                .await
        ),
        ErrorCode::NotFound
    );
    {
        let report = CommandReport {
            runner_id: a.id.clone(),
            epoch,
            state: CommandState::Running,
            exit_code: None,
            signal: None,
            reason: None,
            pid: None,
            output: None,
        };
        assert_eq!(
            refused(b.client.runner_report_command(&command.id, &report).await),
            ErrorCode::NotFound
        );
        assert_eq!(
            refused(
                b.client
                    .runner_append_output(
                        &command.id,
                        api::client::OutputStream::Stdout,
                        (&a.id, epoch),
                        0,
                        b"forged".to_vec()
                    )
                    .await
            ),
            ErrorCode::NotFound
        );
    }
    {
        let report = SnapshotReport {
            runner_id: a.id.clone(),
            epoch,
            durability: "failed".to_owned(),
            root: None,
            files: None,
            captured_at_ms: None,
            message: Some("forged".to_owned()),
        };
        assert_eq!(
            refused(b.client.runner_report_snapshot(&snapshot.id, &report).await),
            ErrorCode::NotFound
        );
    }
    // B as itself, about A's sandbox: not its placement, so `fenced`.
    let as_b = SandboxReport {
        runner_id: b.id.clone(),
        ..as_a.clone()
    };
    let command_as_b = CommandReport {
        runner_id: b.id.clone(),
        epoch,
        state: CommandState::Running,
        exit_code: None,
        signal: None,
        reason: None,
        pid: None,
        output: None,
    };
    assert_eq!(
        refused(
            b.client
                .runner_report_command(&command.id, &command_as_b)
                .await
        ),
        ErrorCode::Fenced
    );
    assert_eq!(
        refused(b.client.runner_report_sandbox(&sandbox.id, &as_b).await),
        ErrorCode::Fenced
    );
    // Nor can B attach a "kept copy" to A's sandbox, as A or as itself:
    // it never ran there.
    for runner_id in [&a.id, &b.id] {
        let kept = api::runners::KeptCopyReport {
            runner_id: runner_id.clone(),
            sandbox_id: sandbox.id.clone(),
            name: "forged".to_owned(),
            bytes: 1,
            kept_at_ms: 0,
            secured_root: None,
        };
        assert_eq!(
            refused(b.client.runner_report_kept(&kept).await),
            ErrorCode::NotFound,
            "B reporting a kept copy as {runner_id}"
        );
    }
    assert!(
        org.get_sandbox(&sandbox.id)
            .await
            .expect("the sandbox")
            .kept_copies
            .is_empty()
    );
    // B cannot take A's identity by registering under its id, with its
    // own credential or with the runner token.
    let mut claim = register_request("a");
    claim.runner_id = Some(a.id.clone());
    assert_eq!(
        refused(b.client.runner_register(&claim).await),
        ErrorCode::NotFound
    );
    assert_eq!(
        refused(
            Client::new(&server.url, &token)
                .runner_register(&claim)
                .await
        ),
        ErrorCode::NotFound
    );
    // The runner token itself reads and reports nothing.
    let enrolment = Client::new(&server.url, &token);
    assert_eq!(
        refused(enrolment.runner_assignments(&a.id, "", 0).await),
        ErrorCode::NotFound
    );
    assert_eq!(
        refused(enrolment.runner_report_sandbox(&sandbox.id, &as_a).await),
        ErrorCode::NotFound
    );

    // None of it changed anything: A's sandbox, its command and snapshot,
    // A's drain are as they were, and A still reads and reports.
    let record = org.get_sandbox(&sandbox.id).await.expect("the sandbox");
    assert_eq!(
        (record.state, record.epoch, record.save.clone()),
        (before.state, before.epoch, before.save.clone()),
        "{record:?}"
    );
    let command_now = org
        .get_command(&sandbox.id, &command.id)
        .await
        .expect("the command");
    assert_eq!(command_now.state, CommandState::Starting, "{command_now:?}");
    let snapshot_now = org.get_snapshot(&snapshot.id).await.expect("the snapshot");
    assert_eq!(snapshot_now.durability, snapshot.durability);
    let runners = server.admin.admin_runners().await.expect("runners");
    let a_record = runners.iter().find(|r| r.id == a.id).expect("A listed");
    assert_eq!(a_record.drain, None, "B preempted A");
    a.client
        .runner_heartbeat(&HeartbeatRequest {
            runner_id: a.id.clone(),
        })
        .await
        .expect("A renews its own lease");
    let assigned = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("A reads its own assignments");
    assert_eq!(assigned.sandboxes[0].env["API_KEY"], "org-a-secret");
    let whoami = a.client.whoami().await.expect("whoami");
    assert_eq!(
        (whoami.kind.as_str(), whoami.runner_id.as_deref()),
        ("runner_credential", Some(a.id.as_str()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_reaches_only_the_objects_of_orgs_it_runs_a_sandbox_for() {
    let server = TestServer::start().await;
    let token = runner_token(&server).await;
    let (org, org_id) = server.org("acme").await;
    let (other, other_id) = server.org("globex").await;
    let a = enrol(&server, &token, "a").await;
    let sandbox = org
        .create_sandbox(&create_request(), None)
        .await
        .expect("a sandbox");
    let b = enrol(&server, &token, "b").await;
    let object = vec![format!("blocks/{}", "0".repeat(64))];
    let org_id = org_id.to_string();
    let other_id = other_id.to_string();

    // A holds a sandbox of acme: it may use acme's objects, no one else's.
    a.client
        .missing_objects(&org_id, &object)
        .await
        .expect("A uses the objects of the org it runs a sandbox for");
    assert_eq!(
        refused(a.client.missing_objects(&other_id, &object).await),
        ErrorCode::NotFound,
        "A reaches an org it runs nothing for"
    );
    // An object globex stored is there for globex, and absent for A.
    let content = b"globex's private bytes";
    let stored = format!("blocks/{}", store::Digest::of(content).to_hex());
    other
        .put_object(&other_id, &stored, store::block::encode(content))
        .await
        .expect("globex stores an object");
    assert!(
        other
            .get_object(&other_id, &stored)
            .await
            .expect("globex reads it")
            .is_some()
    );
    assert_eq!(
        a.client
            .get_object(&other_id, &stored)
            .await
            .expect("a 404 is an absent object to the client"),
        None,
        "A reads an object of an org it runs nothing for"
    );
    // B runs nothing: every org's objects are 404 to it.
    assert_eq!(
        refused(b.client.missing_objects(&org_id, &object).await),
        ErrorCode::NotFound,
        "B reaches the objects of an org whose sandbox is on A"
    );
    assert_eq!(
        refused(b.client.fetch_objects(&org_id, &object).await),
        ErrorCode::NotFound
    );
    assert_eq!(
        refused(b.client.put_objects(&org_id, Vec::new()).await),
        ErrorCode::NotFound
    );
    // Neither does the runner token.
    assert_eq!(
        refused(
            Client::new(&server.url, &token)
                .missing_objects(&org_id, &object)
                .await
        ),
        ErrorCode::NotFound
    );

    // Once the sandbox is deleted, A loses acme's objects too.
    org.delete_sandbox(&sandbox.id).await.expect("delete");
    let assigned = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    let epoch = assigned.sandboxes[0].epoch;
    a.client
        .runner_report_sandbox(
            &sandbox.id,
            &SandboxReport {
                runner_id: a.id.clone(),
                epoch,
                state: SandboxState::Deleted,
                reason: None,
                message: None,
                wake: None,
            },
        )
        .await
        .expect("A reports the sandbox deleted");
    assert_eq!(
        refused(a.client.missing_objects(&org_id, &object).await),
        ErrorCode::NotFound,
        "A keeps an org's objects after its last sandbox of it went"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_registering_again_with_its_credential_keeps_its_identity() {
    let server = TestServer::start().await;
    let token = runner_token(&server).await;
    let (org, _) = server.org("acme").await;
    let a = enrol(&server, &token, "a").await;
    let sandbox = org
        .create_sandbox(&create_request(), None)
        .await
        .expect("a sandbox");
    // A restart: the same credential, naming its own id (or none).
    for runner_id in [Some(a.id.clone()), None] {
        let mut again = register_request("a");
        again.runner_id = runner_id;
        let registered = a
            .client
            .runner_register(&again)
            .await
            .expect("A registers again with its credential");
        assert_eq!(registered.runner_id, a.id);
        assert_eq!(
            registered.runner_token, None,
            "the credential is shown only once"
        );
    }
    let assigned = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("A reads its assignments with the same credential");
    assert_eq!(assigned.sandboxes[0].sandbox_id, sandbox.id);
    // A credential no server issued is refused.
    let forged = Client::new(&server.url, &format!("{}0", a.credential));
    assert_eq!(
        refused(forged.runner_register(&register_request("a")).await),
        ErrorCode::Unauthenticated
    );
    // The runner token still enrols another runner, never A again.
    let c = enrol(&server, &token, "c").await;
    assert_ne!(c.id, a.id);
    assert_ne!(c.credential, a.credential);
}

/// How many assignments long-polls this server answered `how` (`read` or
/// `unchanged`), from its metrics.
async fn assignment_answers(server: &TestServer, how: &str) -> u64 {
    let text = reqwest::Client::new()
        .get(format!("{}/metrics", server.url))
        .bearer_auth(&server.admin_token)
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let line = format!("roost_runner_assignments_total{{answer=\"{how}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&line))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line} in {text}"))
}

/// Issue 16: a runner whose sandboxes are at rest costs the server no
/// reads: once nothing is written anywhere, its long-poll is answered
/// `unchanged` at the timeout without reading its set (the server saw no
/// notification since the read that gave the runner its etag); a change
/// still answers at once with the new set; an etag the server did not
/// answer is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_at_rest_is_answered_unchanged_without_a_read() {
    let server = TestServer::start().await;
    let token = runner_token(&server).await;
    let (org, _) = server.org("acme").await;
    let a = enrol(&server, &token, "a").await;
    let sandbox = org
        .create_sandbox(&create_request(), None)
        .await
        .expect("a sandbox");
    let first = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    assert!(!first.unchanged);
    assert_eq!(first.sandboxes.len(), 1);
    let running = SandboxReport {
        runner_id: a.id.clone(),
        epoch: first.sandboxes[0].epoch,
        state: SandboxState::Running,
        reason: None,
        message: None,
        wake: None,
    };
    a.client
        .runner_report_sandbox(&sandbox.id, &running)
        .await
        .expect("running");
    let settled = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    assert_eq!(settled.sandboxes[0].state, SandboxState::Running);

    // At rest: a poll on the settled etag waits out its timeout and is
    // answered without a read. (Another write anywhere, such as a
    // reconciler's, would make it read: polled until one is not.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let reads = assignment_answers(&server, "read").await;
        let answer = a
            .client
            .runner_assignments(&a.id, &settled.etag, 1)
            .await
            .expect("assignments");
        assert_eq!(answer.etag, settled.etag, "{answer:?}");
        if answer.unchanged {
            assert!(answer.sandboxes.is_empty() && answer.commands.is_empty());
            if assignment_answers(&server, "read").await == reads {
                break;
            }
        } else {
            assert_eq!(
                answer.sandboxes, settled.sandboxes,
                "a full answer is the set"
            );
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never answered unchanged without a read"
        );
    }
    assert!(assignment_answers(&server, "unchanged").await >= 1);

    // A change answers the waiting poll at once, with the new set.
    let poll = {
        let client = a.client.clone();
        let (id, etag) = (a.id.clone(), settled.etag.clone());
        tokio::spawn(async move { client.runner_assignments(&id, &etag, 25).await })
    };
    let command = org
        .create_command(
            &sandbox.id,
            &serde_json::from_value(serde_json::json!({ "argv": ["true"] })).expect("a command"),
            None,
        )
        .await
        .expect("a command");
    let changed = tokio::time::timeout(std::time::Duration::from_secs(20), poll)
        .await
        .expect("answered before its timeout")
        .expect("the poll")
        .expect("assignments");
    assert!(!changed.unchanged);
    assert_ne!(changed.etag, settled.etag);
    assert_eq!(changed.commands.len(), 1, "{changed:?}");
    assert_eq!(changed.commands[0].command_id, command.id);
    assert_eq!(changed.commands[0].state, CommandState::Starting);

    // The read that handed the command over answered the set as it now
    // stands: the runner's next poll, on that answer's etag, is not read
    // again (the hand-over wakes the command's waiters but changes no
    // runner's set). Counted as a change, it made every poll after a hand-
    // over read. A background write to the set could make one poll read:
    // one round of three must not.
    let mut latest = changed;
    let mut unread = false;
    for _ in 0..3 {
        let reads = assignment_answers(&server, "read").await;
        let again = a
            .client
            .runner_assignments(&a.id, &latest.etag, 1)
            .await
            .expect("assignments");
        if again.unchanged && assignment_answers(&server, "read").await == reads {
            unread = true;
            break;
        }
        let command = org
            .create_command(
                &sandbox.id,
                &serde_json::from_value(serde_json::json!({ "argv": ["true"] }))
                    .expect("a command"),
                None,
            )
            .await
            .expect("a command");
        latest = a
            .client
            .runner_assignments(&a.id, &latest.etag, 10)
            .await
            .expect("assignments");
        assert!(
            latest.commands.iter().any(|c| c.command_id == command.id),
            "{latest:?}"
        );
    }
    assert!(unread, "every poll after a hand-over read the set again");

    // An etag this server never answered is read, never taken on trust.
    let unknown = a
        .client
        .runner_assignments(&a.id, "0123456789abcdef0123456789abcdef", 1)
        .await
        .expect("assignments");
    assert!(!unknown.unchanged);
    assert_eq!(unknown.etag, latest.etag);
}

/// Issue 21: a fleet's long-polls time out by the hundred each second
/// while its API load writes all the time. A runner whose set nothing was
/// written to since this server read it is not read again, neither when
/// its poll begins nor at its timeout, however much is written to other
/// runners' sets meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_set_is_not_read_again_while_other_runners_sets_change() {
    let server = TestServer::start().await;
    let token = runner_token(&server).await;
    let (org, _) = server.org("acme").await;
    // B is the only runner when the sandbox is created: it lands there.
    let b = enrol(&server, &token, "b").await;
    let sandbox = org
        .create_sandbox(&create_request(), None)
        .await
        .expect("a sandbox");
    let on_b = b
        .client
        .runner_assignments(&b.id, "", 0)
        .await
        .expect("assignments");
    assert_eq!(on_b.sandboxes[0].sandbox_id, sandbox.id);
    let a = enrol(&server, &token, "a").await;
    let settled = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    assert!(settled.sandboxes.is_empty());

    // Writes to B's set (commands on its sandbox) while A polls, twice.
    let command: api::commands::CreateCommandRequest =
        serde_json::from_value(serde_json::json!({ "argv": ["true"] })).expect("a command");
    let reads = assignment_answers(&server, "read").await;
    for _ in 0..2 {
        let poll = {
            let client = a.client.clone();
            let (id, etag) = (a.id.clone(), settled.etag.clone());
            tokio::spawn(async move { client.runner_assignments(&id, &etag, 2).await })
        };
        while !poll.is_finished() {
            org.create_command(&sandbox.id, &command, None)
                .await
                .expect("a command");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let answer = poll.await.expect("the poll").expect("assignments");
        assert!(answer.unchanged, "{answer:?}");
        assert_eq!(answer.etag, settled.etag);
    }
    assert_eq!(
        assignment_answers(&server, "read").await,
        reads,
        "neither poll read A's set"
    );
}

/// Issue 21: a fleet starting at once long-polls every new runner's set
/// in the same seconds as its first heartbeats. A runner just registered
/// has an empty set, so its first poll is answered without a read, with
/// the ETag a read of an empty set gives; a placement on it is read at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_runners_first_poll_is_answered_without_a_read() {
    let server = TestServer::start().await;
    let token = runner_token(&server).await;
    let (org, _) = server.org("acme").await;
    let a = enrol(&server, &token, "a").await;
    let reads = assignment_answers(&server, "read").await;
    let first = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    assert!(!first.unchanged);
    assert!(first.sandboxes.is_empty() && first.commands.is_empty() && first.kept.is_empty());
    assert_eq!(
        assignment_answers(&server, "read").await,
        reads,
        "the first poll read nothing"
    );

    // Placed on A: the next poll, even one naming the empty set's ETag,
    // is read and has it.
    let sandbox = org
        .create_sandbox(&create_request(), None)
        .await
        .expect("a sandbox");
    let placed = a
        .client
        .runner_assignments(&a.id, &first.etag, 0)
        .await
        .expect("assignments");
    assert_eq!(placed.sandboxes.len(), 1, "{placed:?}");
    assert_eq!(placed.sandboxes[0].sandbox_id, sandbox.id);
    assert!(assignment_answers(&server, "read").await > reads);

    // Deleted again, the set read empty has the first answer's ETag.
    org.delete_sandbox(&sandbox.id).await.expect("delete");
    let deleted = SandboxReport {
        runner_id: a.id.clone(),
        epoch: placed.sandboxes[0].epoch,
        state: SandboxState::Deleted,
        reason: None,
        message: None,
        wake: None,
    };
    a.client
        .runner_report_sandbox(&sandbox.id, &deleted)
        .await
        .expect("deleted");
    let reads = assignment_answers(&server, "read").await;
    let empty = a
        .client
        .runner_assignments(&a.id, &placed.etag, 0)
        .await
        .expect("assignments");
    assert!(empty.sandboxes.is_empty(), "{empty:?}");
    assert_eq!(empty.etag, first.etag, "the same ETag as a read's");
    assert_eq!(assignment_answers(&server, "read").await, reads + 1);
}

/// What an answer stands on is every record in it, not only the runner's:
/// a change that notifies just the record (the runner's own report of a
/// command running, of a snapshot taken) is read at the poll's timeout,
/// never answered `unchanged`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_to_a_record_in_the_set_is_read_though_the_runner_was_not_notified() {
    let server = TestServer::start().await;
    let token = runner_token(&server).await;
    let (org, _) = server.org("acme").await;
    let a = enrol(&server, &token, "a").await;
    let sandbox = org
        .create_sandbox(&create_request(), None)
        .await
        .expect("a sandbox");
    let first = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    let epoch = first.sandboxes[0].epoch;
    let running = SandboxReport {
        runner_id: a.id.clone(),
        epoch,
        state: SandboxState::Running,
        reason: None,
        message: None,
        wake: None,
    };
    a.client
        .runner_report_sandbox(&sandbox.id, &running)
        .await
        .expect("running");
    let command = org
        .create_command(
            &sandbox.id,
            &serde_json::from_value(serde_json::json!({ "argv": ["sleep", "60"] }))
                .expect("a command"),
            None,
        )
        .await
        .expect("a command");
    let snapshot = org
        .create_snapshot(
            &sandbox.id,
            &serde_json::from_value(serde_json::json!({})).expect("a snapshot request"),
            None,
        )
        .await
        .expect("a snapshot");
    // Read until the hand-over has settled: an answer that stands.
    let mut settled = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    loop {
        let again = a
            .client
            .runner_assignments(&a.id, &settled.etag, 1)
            .await
            .expect("assignments");
        if again.unchanged {
            break;
        }
        settled = again;
    }
    assert_eq!(
        settled.commands[0].state,
        CommandState::Starting,
        "{settled:?}"
    );
    assert_eq!(settled.sandboxes[0].snapshots[0].durability, "pending");

    let poll_past = |etag: String| {
        let client = a.client.clone();
        let id = a.id.clone();
        tokio::spawn(async move { client.runner_assignments(&id, &etag, 2).await })
    };
    // The command's report notifies the command, not the runner.
    let poll = poll_past(settled.etag.clone());
    let report = CommandReport {
        runner_id: a.id.clone(),
        epoch,
        state: CommandState::Running,
        exit_code: None,
        signal: None,
        reason: None,
        pid: Some(42),
        output: None,
    };
    a.client
        .runner_report_command(&command.id, &report)
        .await
        .expect("running");
    let answer = poll.await.expect("the poll").expect("assignments");
    assert!(!answer.unchanged, "{answer:?}");
    assert_ne!(answer.etag, settled.etag);
    assert_eq!(answer.commands[0].state, CommandState::Running);

    // The snapshot's report notifies the snapshot, not the runner.
    let poll = poll_past(answer.etag.clone());
    let taken = SnapshotReport {
        runner_id: a.id.clone(),
        epoch,
        durability: "local".to_owned(),
        root: None,
        files: None,
        captured_at_ms: None,
        message: None,
    };
    a.client
        .runner_report_snapshot(&snapshot.id, &taken)
        .await
        .expect("taken");
    let after = poll.await.expect("the poll").expect("assignments");
    assert!(!after.unchanged, "{after:?}");
    assert_eq!(after.sandboxes[0].snapshots[0].durability, "local");
}

/// The assignments long-poll's query is bounded like any input: a wrong
/// type for `unchanged`, an unknown parameter or an over-long wait is a
/// 400 before anything is read or handed over, and the runner's set is as
/// it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_assignments_query_is_refused_and_changes_nothing() {
    let server = TestServer::start().await;
    let token = runner_token(&server).await;
    let a = enrol(&server, &token, "a").await;
    let before = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    for query in [
        format!("runner_id={}&unchanged=perhaps", a.id),
        format!("runner_id={}&unchanged=true&surprise=1", a.id),
        format!("runner_id={}&timeout=100000", a.id),
    ] {
        let answer = reqwest::Client::new()
            .get(format!("{}/v1/runner/assignments?{query}", server.url))
            .bearer_auth(&a.credential)
            .send()
            .await
            .expect("an answer");
        assert_eq!(answer.status().as_u16(), 400, "{query}");
    }
    let after = a
        .client
        .runner_assignments(&a.id, "", 0)
        .await
        .expect("assignments");
    assert_eq!(after, before);
}

/// The message of a refusal with `code`.
fn refused_with<T: std::fmt::Debug>(answer: Result<T, ClientError>, code: ErrorCode) -> String {
    match answer {
        Err(ClientError::Api {
            code: got, message, ..
        }) if got == code => message,
        other => panic!("expected {code:?}, got {other:?}"),
    }
}

/// A runner token an administrator made with a profile bounds what the
/// runners it enrols declare: a placement class or a capacity beyond it is
/// refused, naming what, at enrolment and at every later registration with
/// the runner's own credential, and nothing is enrolled or changed; a
/// capability beyond it (a shared filesystem the host lacks, say) is not
/// recorded, so nothing is placed there for it. A token made without one
/// allows anything, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_declares_no_more_than_its_enrolment_token_allows() {
    let server = TestServer::start().await;
    let profile: api::orgs::RunnerProfile = serde_json::from_value(serde_json::json!({
        "placement_classes": ["spot"],
        "capabilities": ["image:default", "network:none", "storage:standard"],
        "capacity": {"sandboxes": 8, "memory_mib": 65536, "cpus": 64, "pids": 1048576},
    }))
    .expect("a profile");
    let created = server
        .admin
        .create_runner_token(&profile)
        .await
        .expect("a profiled runner token");
    assert_eq!(created.profile, profile);
    let enrolment = Client::new(&server.url, &created.token);
    let within = || {
        let mut request = register_request("pinned");
        request.placement_class = "spot".to_owned();
        request
    };

    let mut on_demand = within();
    on_demand.placement_class = "on_demand".to_owned();
    let mut more_capacity = within();
    more_capacity.capacity.sandboxes = 9;
    let mut more_cpus = within();
    more_cpus.capacity.cpus = 64.5;
    for (request, named) in [
        (on_demand, "placement_class"),
        (more_capacity, "capacity.sandboxes"),
        (more_cpus, "capacity.cpus"),
    ] {
        let message = refused_with(
            enrolment.runner_register(&request).await,
            ErrorCode::InvalidRequest,
        );
        assert!(message.contains(named), "{named}: {message}");
    }
    let runners = server.admin.admin_runners().await.expect("runners");
    assert!(
        runners.is_empty(),
        "a refused registration enrolled {runners:?}"
    );

    // Within the profile: enrolled, with only the capabilities it allows;
    // its own credential keeps the profile.
    let mut claims_more = within();
    claims_more.capabilities.push("filesystem:team".to_owned());
    let registered = enrolment
        .runner_register(&claims_more)
        .await
        .expect("a registration within the profile");
    let offered = |records: &[api::runners::RunnerRecord]| records[0].capabilities.clone();
    let records = server.admin.admin_runners().await.expect("runners");
    assert_eq!(records.len(), 1);
    assert_eq!(
        offered(&records),
        ["image:default", "network:none", "storage:standard"],
        "a capability the profile does not allow was recorded"
    );
    let credential = registered.runner_token.expect("a credential");
    let runner = Client::new(&server.url, &credential);
    let mut again = within();
    again.runner_id = Some(registered.runner_id.clone());
    again.placement_class = "on_demand".to_owned();
    let message = refused_with(
        runner.runner_register(&again).await,
        ErrorCode::InvalidRequest,
    );
    assert!(message.contains("placement_class"), "{message}");
    again.placement_class = "spot".to_owned();
    again.capabilities.push("storage:durable".to_owned());
    again.capacity.sandboxes = 4;
    runner
        .runner_register(&again)
        .await
        .expect("registering again within the profile");
    let records = server.admin.admin_runners().await.expect("runners");
    assert!(
        !offered(&records).contains(&"storage:durable".to_owned()),
        "its own credential registered past the profile: {records:?}"
    );

    // A token without a profile: anything, as before.
    let open = runner_token(&server).await;
    let mut anything = register_request("open");
    anything.capabilities.push("filesystem:team".to_owned());
    Client::new(&server.url, &open)
        .runner_register(&anything)
        .await
        .expect("an unprofiled token enrols anything");

    // A profile itself is bounded.
    let bad: api::orgs::RunnerProfile =
        serde_json::from_value(serde_json::json!({"placement_classes": ["fast"]})).expect("parses");
    let message = refused_with(
        server.admin.create_runner_token(&bad).await,
        ErrorCode::InvalidRequest,
    );
    assert!(message.contains("spot"), "{message}");
}
