//! The control layer in process, without HTTP or spawned processes: each
//! rule runs against SQLite, and against PostgreSQL too where
//! `ROOST_TEST_POSTGRES_URL` names a server (the test script starts one),
//! since the admission lock and the guarded writes are database rules.

use std::collections::BTreeMap;

use api::ErrorCode;
use api::lifecycle::{CommandState, DesiredState, SandboxState};
use api::runners::{Capacity, CommandReport, RegisterRequest, SandboxReport};
use api::sandboxes::CreateSandboxRequest;
use server::control::{AppState, admission, commands, runner_protocol, sandboxes};
use server::records::SandboxRow;
use server::records::commands::Stream;

/// A control plane on one database, with its data dir kept alive.
struct Plane {
    state: AppState,
    _data: tempfile::TempDir,
}

/// Every database engine this machine offers: SQLite always, PostgreSQL
/// when the test script started one.
async fn planes(name: &str) -> Vec<Plane> {
    let mut urls = vec![None];
    if let Ok(base) = std::env::var("ROOST_TEST_POSTGRES_URL") {
        urls.push(Some(postgres_database(&base, name).await));
    }
    let mut planes = Vec::new();
    for url in urls {
        let data = tempfile::Builder::new()
            .prefix("roost-control-")
            .tempdir()
            .expect("a temp data dir");
        let listen = "127.0.0.1:0".parse().expect("an address");
        let mut config = server::Config::new(listen, data.path().join("server"));
        config.database_url = url;
        let state = server::open_state(config)
            .await
            .expect("the control plane opens");
        planes.push(Plane { state, _data: data });
    }
    planes
}

async fn postgres_database(base: &str, name: &str) -> String {
    use sqlx::Connection;
    let name = format!("roost_control_{name}_{}", std::process::id());
    let mut conn = sqlx::PgConnection::connect(base)
        .await
        .expect("connect to postgres");
    for statement in [
        format!("DROP DATABASE IF EXISTS {name}"),
        format!("CREATE DATABASE {name}"),
    ] {
        sqlx::query(&statement)
            .execute(&mut conn)
            .await
            .expect("a fresh database");
    }
    let (prefix, _) = base.rsplit_once('/').expect("a url with a database");
    format!("{prefix}/{name}")
}

impl Plane {
    fn engine(&self) -> &str {
        &self.state.db.url[..8]
    }

    async fn org(&self, id: &str, max_running: Option<i64>) -> String {
        sqlx::query(
            "INSERT INTO orgs (id, name, max_running, max_total, created_at_ms) VALUES ($1, $1, $2, NULL, 0)",
        )
        .bind(id)
        .bind(max_running)
        .execute(&self.state.db.pool)
        .await
        .expect("an org");
        id.to_owned()
    }

    async fn runner(&self, sandboxes: u64) -> String {
        let request = RegisterRequest {
            runner_id: None,
            name: "r1".to_owned(),
            placement_class: "on_demand".to_owned(),
            labels: BTreeMap::new(),
            capabilities: ["image:default", "network:none", "storage:standard"]
                .map(str::to_owned)
                .to_vec(),
            capacity: Capacity {
                sandboxes,
                memory_mib: 64 * 1024,
                cpus: 64.0,
                pids: 1 << 20,
            },
        };
        runner_protocol::register(
            &self.state,
            &runner_protocol::Registrant::Enrolment,
            &request,
        )
        .await
        .expect("the runner registers")
        .runner_id
    }

    /// Creates a sandbox as `POST /v1/sandboxes` does, committed.
    async fn create(&self, org: &str) -> Result<SandboxRow, server::control::ControlError> {
        let mut request = create_request();
        let mut row = admission::prepare(&self.state, org, &mut request)?;
        let mut tx = self.state.db.write().await?;
        admission::admit(&self.state, &mut tx, &mut row, &request).await?;
        let row = sandboxes::reload(&mut tx, &row.id).await?;
        tx.commit().await?;
        Ok(row)
    }

    async fn events(&self, id: &str) -> Vec<(String, Option<String>)> {
        let rows: Vec<(String, Option<String>)> =
            sqlx::query_as("SELECT state, reason FROM events WHERE sandbox_id = $1 ORDER BY seq")
                .bind(id)
                .fetch_all(&self.state.db.pool)
                .await
                .expect("events");
        rows
    }

    async fn report(
        &self,
        row: &SandboxRow,
        runner: &str,
        state: SandboxState,
    ) -> Result<SandboxRow, server::control::ControlError> {
        let report = SandboxReport {
            runner_id: runner.to_owned(),
            epoch: row.epoch as u64,
            state,
            reason: None,
            message: None,
            wake: None,
        };
        runner_protocol::report_sandbox(&self.state, &row.id, &report).await
    }
}

fn create_request() -> CreateSandboxRequest {
    serde_json::from_value(serde_json::json!({ "image": "default" })).expect("a create request")
}

fn code(result: Result<impl std::fmt::Debug, server::control::ControlError>) -> ErrorCode {
    match result {
        Ok(value) => panic!("expected a refusal, got {value:?}"),
        Err(err) => err.code,
    }
}

#[tokio::test]
async fn admission_refuses_what_no_runner_offers_and_places_what_one_does() {
    for plane in planes("admission").await {
        let org = plane.org("org_a", None).await;
        // No runner: nothing would run it.
        let refused = plane.create(&org).await;
        assert_eq!(
            code(refused),
            ErrorCode::UnsupportedCapability,
            "{}",
            plane.engine()
        );
        // No store in this deployment: durable homes cannot be kept.
        let mut durable = create_request();
        durable.storage_class = "durable".to_owned();
        let mut row = admission::prepare(&plane.state, &org, &mut durable).expect("in bounds");
        let mut tx = plane.state.db.write().await.expect("tx");
        let refused = admission::admit(&plane.state, &mut tx, &mut row, &durable).await;
        assert_eq!(code(refused), ErrorCode::UnsupportedCapability);
        drop(tx);

        let runner = plane.runner(4).await;
        let row = plane.create(&org).await.expect("admitted");
        assert_eq!(row.state, SandboxState::Starting, "placed at once");
        assert_eq!(row.runner_id.as_deref(), Some(runner.as_str()));
        let expected: Vec<(String, Option<String>)> =
            [("pending", "admitted"), ("starting", "placed")]
                .iter()
                .map(|(s, r)| ((*s).to_owned(), Some((*r).to_owned())))
                .collect();
        assert_eq!(plane.events(&row.id).await, expected);
    }
}

#[tokio::test]
async fn every_change_to_what_a_sandbox_wants_or_why_it_waits_has_an_event() {
    for plane in planes("events").await {
        let org = plane.org("org_e", None).await;
        // A runner with no room: the sandbox waits, saying why.
        plane.runner(0).await;
        let row = plane.create(&org).await.expect("admitted");
        assert_eq!(row.runner_id, None);
        assert_eq!(row.state_reason.as_deref(), Some("no_capacity"), "{row:?}");
        let mut tx = plane.state.db.write().await.expect("tx");
        let stopped = sandboxes::stop(&plane.state, &mut tx, &org, &row.id)
            .await
            .expect("stopped");
        tx.commit().await.expect("commit");
        // Unplaced: nothing to give back, so it is stopped at once.
        assert_eq!(stopped.state, SandboxState::Stopped);
        assert_eq!(stopped.desired, DesiredState::Stopped);
        let events = plane.events(&row.id).await;
        let expected: Vec<(String, Option<String>)> = [
            ("pending", "admitted"),
            ("pending", "no_capacity"),
            ("pending", "stop_requested"),
            ("stopped", "stop_requested"),
        ]
        .iter()
        .map(|(s, r)| ((*s).to_owned(), Some((*r).to_owned())))
        .collect();
        assert_eq!(events, expected, "{}", plane.engine());
    }
}

#[tokio::test]
async fn runner_reports_follow_the_transition_table_and_the_fence() {
    for plane in planes("reports").await {
        let org = plane.org("org_r", None).await;
        let runner = plane.runner(4).await;
        let starting = plane.create(&org).await.expect("admitted and placed");
        assert_eq!(starting.state, SandboxState::Starting);
        // A report from another runner, or another epoch, is fenced.
        let other = plane.runner(4).await;
        let stranger = plane.report(&starting, &other, SandboxState::Running).await;
        assert_eq!(code(stranger), ErrorCode::Fenced, "{}", plane.engine());
        let mut stale = starting.clone();
        stale.epoch += 1;
        let stale = plane.report(&stale, &runner, SandboxState::Running).await;
        assert_eq!(code(stale), ErrorCode::Fenced);
        // A move the table does not allow changes nothing.
        let backwards = plane
            .report(&starting, &runner, SandboxState::Pending)
            .await;
        assert_eq!(code(backwards), ErrorCode::InvalidState);
        let running = plane
            .report(&starting, &runner, SandboxState::Running)
            .await
            .expect("starting → running");
        assert_eq!(running.state, SandboxState::Running);
        let states: Vec<String> = plane
            .events(&starting.id)
            .await
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(states, ["pending", "starting", "running"]);
    }
}

#[tokio::test]
async fn concurrent_creates_cannot_race_past_a_quota() {
    for plane in planes("quota").await {
        let org = plane.org("org_q", Some(3)).await;
        plane.runner(100).await;
        let plane = std::sync::Arc::new(plane);
        let mut creates = Vec::new();
        for _ in 0..8 {
            let plane = plane.clone();
            let org = org.clone();
            creates.push(tokio::spawn(async move { plane.create(&org).await }));
        }
        let (mut admitted, mut refused) = (0, 0);
        for create in creates {
            match create.await.expect("joined") {
                Ok(_) => admitted += 1,
                Err(err) => {
                    assert_eq!(err.code, ErrorCode::QuotaExceeded, "{err:?}");
                    refused += 1;
                }
            }
        }
        assert_eq!((admitted, refused), (3, 5), "{}", plane.engine());
    }
}

#[tokio::test]
async fn a_command_goes_from_queue_to_exit_through_its_runner() {
    for plane in planes("commands").await {
        let org = plane.org("org_c", None).await;
        let runner = plane.runner(4).await;
        let row = plane.create(&org).await.expect("admitted");
        let row = plane
            .report(&row, &runner, SandboxState::Starting)
            .await
            .expect("starting");
        let row = plane
            .report(&row, &runner, SandboxState::Running)
            .await
            .expect("running");
        let request = serde_json::from_value(serde_json::json!({ "argv": ["true"] }))
            .expect("a command request");
        let mut tx = plane.state.db.write().await.expect("tx");
        let queued = commands::create(&mut tx, &org, &row.id, &request)
            .await
            .expect("queued");
        tx.commit().await.expect("commit");
        assert_eq!(queued.state, CommandState::Queued);
        // Handed over in the runner's assignments, under the sandbox's epoch.
        let assignments = runner_protocol::read_assignments(&plane.state, &runner)
            .await
            .expect("assignments");
        let handed = &assignments.commands[0];
        assert_eq!(handed.command_id, queued.id);
        assert_eq!(handed.state, CommandState::Starting);
        let report = |state, exit_code| CommandReport {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            state,
            reason: None,
            exit_code,
            signal: None,
        };
        let running = runner_protocol::report_command(
            &plane.state,
            &queued.id,
            &report(CommandState::Running, None),
        )
        .await
        .expect("running");
        assert!(running.started_at_ms.is_some());
        // Output lands at the stream's end; a gap is refused.
        let at = |offset| runner_protocol::OutputAt {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            offset,
        };
        let length = runner_protocol::append_output(
            &plane.state,
            &queued.id,
            Stream::Stdout,
            &at(0),
            b"hi\n",
        )
        .await
        .expect("appended");
        assert_eq!(length, 3);
        let gap =
            runner_protocol::append_output(&plane.state, &queued.id, Stream::Stdout, &at(9), b"x")
                .await;
        assert_eq!(code(gap), ErrorCode::InvalidState);
        // An exit needs its code.
        let missing = runner_protocol::report_command(
            &plane.state,
            &queued.id,
            &report(CommandState::Exited, None),
        )
        .await;
        assert_eq!(code(missing), ErrorCode::InvalidRequest);
        let exited = runner_protocol::report_command(
            &plane.state,
            &queued.id,
            &report(CommandState::Exited, Some(0)),
        )
        .await
        .expect("exited");
        assert_eq!(
            (exited.state, exited.exit_code, exited.stdout_bytes),
            (CommandState::Exited, Some(0), 3)
        );
        assert!(exited.ended());
    }
}
