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
    planes_with(name, false).await
}

/// [`planes`], with a content store (`store`: durable homes allowed).
async fn planes_with(name: &str, store: bool) -> Vec<Plane> {
    planes_configured(name, store, |_| {}).await
}

/// [`planes_with`], each config changed by `tweak` first.
async fn planes_configured(
    name: &str,
    store: bool,
    tweak: impl Fn(&mut server::Config),
) -> Vec<Plane> {
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
        // Idle timeouts of a second or two keep the idle tests short.
        config.idle_timeout_min = std::time::Duration::from_secs(1);
        if store {
            config.store_url = Some(data.path().join("store").display().to_string());
        }
        tweak(&mut config);
        let state = server::open_state(config)
            .await
            .expect("the control plane opens");
        planes.push(Plane { state, _data: data });
    }
    planes
}

pub(crate) async fn postgres_database(base: &str, name: &str) -> String {
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
        self.register(None, sandboxes).await
    }

    /// Registers a runner offering durable homes too (again as `id`).
    async fn register(&self, id: Option<&str>, sandboxes: u64) -> String {
        let request = RegisterRequest {
            runner_id: id.map(str::to_owned),
            name: "r1".to_owned(),
            placement_class: "on_demand".to_owned(),
            labels: BTreeMap::new(),
            capabilities: [
                "image:default",
                "network:none",
                "storage:standard",
                "storage:durable",
            ]
            .map(str::to_owned)
            .to_vec(),
            capacity: Capacity {
                sandboxes,
                memory_mib: 64 * 1024,
                cpus: 64.0,
                pids: 1 << 20,
            },
            data_url: None,
            data_key: None,
        };
        // A runner registers again by its own credential, never a token.
        let registrant = match id {
            Some(id) => runner_protocol::Registrant::Runner(id.to_owned()),
            None => runner_protocol::Registrant::Enrolment { profile: None },
        };
        runner_protocol::register(&self.state, &registrant, &request)
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
        // Issue 13, point 7: the runner names no reason for `running`; the
        // record still carries a stable one, and so does every event.
        assert_eq!(running.state_reason.as_deref(), Some("workload_started"));
        let events = plane.events(&starting.id).await;
        let states: Vec<&str> = events.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(states, ["pending", "starting", "running"]);
        assert!(
            events.iter().all(|(_, reason)| reason.is_some()),
            "an event without a reason: {events:?}"
        );
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

/// Audit finding (2026-12-07): a shared filesystem's binding was checked
/// at create only. Unbound from the org, or rebound read-only, a sandbox
/// created before mounted it read-write again at every start, wake and
/// recovery. Each placement now mounts what the bindings allow then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filesystem_unbound_or_made_read_only_reaches_the_next_placement() {
    for plane in planes("fs_rebind").await {
        let org = plane.org("org_fs", None).await;
        let mut request = RegisterRequest {
            runner_id: None,
            name: "fs".to_owned(),
            placement_class: "on_demand".to_owned(),
            labels: BTreeMap::new(),
            capabilities: [
                "image:default",
                "network:none",
                "storage:standard",
                "filesystem:team",
            ]
            .map(str::to_owned)
            .to_vec(),
            capacity: Capacity {
                sandboxes: 4,
                memory_mib: 64 * 1024,
                cpus: 64.0,
                pids: 1 << 20,
            },
            data_url: None,
            data_key: None,
        };
        let runner = runner_protocol::register(
            &plane.state,
            &runner_protocol::Registrant::Enrolment { profile: None },
            &request,
        )
        .await
        .expect("the runner registers")
        .runner_id;
        request.runner_id = Some(runner.clone());
        let bind = |read_only: bool| {
            let state = plane.state.clone();
            let org = org.clone();
            async move {
                server::control::filesystems::bind(
                    &state,
                    "team",
                    &org,
                    &api::filesystems::BindFilesystemRequest { read_only },
                )
                .await
                .expect("bound")
            }
        };
        bind(false).await;
        let mut create: CreateSandboxRequest = serde_json::from_value(serde_json::json!({
            "image": "default",
            "mounts": [{"filesystem": "team", "path": "/mnt/team"}],
        }))
        .expect("a create request");
        let mut row = admission::prepare(&plane.state, &org, &mut create).expect("prepared");
        let mut tx = plane.state.db.write().await.expect("tx");
        admission::admit(&plane.state, &mut tx, &mut row, &create)
            .await
            .expect("admitted");
        tx.commit().await.expect("commit");
        let row = plane.load(&row.id).await;
        assert_eq!(row.runner_id.as_deref(), Some(runner.as_str()));
        let row = plane
            .report(&row, &runner, SandboxState::Starting)
            .await
            .expect("starting");
        let row = plane
            .report(&row, &runner, SandboxState::Running)
            .await
            .expect("running");
        plane.change(&org, &row.id, "stop").await.expect("stop");
        let row = plane
            .report(&plane.load(&row.id).await, &runner, SandboxState::Stopped)
            .await
            .expect("stopped");
        assert_eq!(row.state, SandboxState::Stopped);

        // Unbound: a start waits, and says why.
        server::control::filesystems::unbind(&plane.state, "team", &org)
            .await
            .expect("unbound");
        let waiting = plane.change(&org, &row.id, "start").await.expect("start");
        assert_eq!(
            (waiting.state, waiting.state_reason.as_deref()),
            (SandboxState::Pending, Some("filesystem_unbound")),
            "placed without its binding: {waiting:?}"
        );

        // Bound again read-only: the waiting sandbox's next placement (the
        // reconciler's pass) mounts it read-only.
        bind(true).await;
        server::reconcile::schedule_pending(&plane.state)
            .await
            .expect("a scheduling pass");
        let placed = plane.load(&row.id).await;
        assert_eq!(placed.state, SandboxState::Starting, "{placed:?}");
        assert_eq!(
            placed.runner_id.as_deref(),
            Some(runner.as_str()),
            "{placed:?}"
        );
        let mounts = placed.to_api().mounts;
        assert!(mounts[0].read_only, "{mounts:?}");
    }
}

/// Audit finding (2026-12-07): a delete recorded the sandbox's running
/// command `interrupted` at the request, before its runner had done
/// anything; the runner's report that it exited 0 was then refused and its
/// last output with it. `deleting` is the request: the command's end is
/// the runner's report, and only what is left open when the sandbox is
/// `deleted` ends `interrupted` (queued ones `not_launched`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_leaves_a_commands_end_to_what_its_runner_reports() {
    for plane in planes("delete_commands").await {
        let org = plane.org("org_d", None).await;
        let runner = plane.runner(4).await;
        let row = plane.create(&org).await.expect("admitted");
        plane
            .report(&row, &runner, SandboxState::Starting)
            .await
            .expect("starting");
        let row = plane
            .report(&row, &runner, SandboxState::Running)
            .await
            .expect("running");
        let mut commands_made = Vec::new();
        for argv in [["sleep", "1"], ["sleep", "2"]] {
            let request = serde_json::from_value(serde_json::json!({ "argv": argv }))
                .expect("a command request");
            let mut tx = plane.state.db.write().await.expect("tx");
            let queued = commands::create(&plane.state, &mut tx, &org, &row.id, &request)
                .await
                .expect("queued");
            tx.commit().await.expect("commit");
            commands_made.push(queued.id);
        }
        runner_protocol::read_assignments(&plane.state, &runner)
            .await
            .expect("assignments");
        let report = |state, exit_code| CommandReport {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            state,
            reason: None,
            exit_code,
            signal: None,
            pid: Some(7),
            output: None,
        };
        for id in &commands_made {
            runner_protocol::report_command(&plane.state, id, &report(CommandState::Running, None))
                .await
                .expect("running");
        }
        let deleting = plane.change(&org, &row.id, "delete").await.expect("delete");
        assert_eq!(deleting.state, SandboxState::Deleting);
        let command_state = |id: String| {
            let plane = &plane;
            async move {
                let mut tx = plane.state.db.write().await.expect("tx");
                server::records::commands::load(&mut tx, &id)
                    .await
                    .expect("read")
                    .expect("the command")
                    .state
            }
        };
        assert_eq!(
            command_state(commands_made[0].clone()).await,
            CommandState::Running,
            "a delete's request is not its runner's doing"
        );
        let exited = runner_protocol::report_command(
            &plane.state,
            &commands_made[0],
            &report(CommandState::Exited, Some(0)),
        )
        .await
        .expect("the runner's report of the end is taken");
        assert_eq!(exited.state, CommandState::Exited);
        plane
            .report(&deleting, &runner, SandboxState::Deleted)
            .await
            .expect("deleted");
        assert_eq!(
            command_state(commands_made[0].clone()).await,
            CommandState::Exited
        );
        assert_eq!(
            command_state(commands_made[1].clone()).await,
            CommandState::Interrupted,
            "left open at the sandbox's deletion"
        );
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
        let queued = commands::create(&plane.state, &mut tx, &org, &row.id, &request)
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
            pid: None,
            output: None,
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
        // The record keeps a stream's first OUTPUT_STREAM_BYTES_MAX bytes:
        // what fits is stored, the rest refused and marked as not stored.
        let bound = api::commands::OUTPUT_STREAM_BYTES_MAX;
        let near = vec![b'y'; (bound - 3 - 2) as usize];
        let length =
            runner_protocol::append_output(&plane.state, &queued.id, Stream::Stderr, &at(0), &near)
                .await
                .expect("appended");
        assert_eq!(length, bound - 5);
        let past = runner_protocol::append_output(
            &plane.state,
            &queued.id,
            Stream::Stderr,
            &at(bound - 5),
            b"0123456789",
        )
        .await;
        assert_eq!(code(past), ErrorCode::PayloadTooLarge);
        let stored = plane.load_command(&queued.id).await;
        assert_eq!(stored.stderr_bytes as u64, bound);
        assert!(stored.stderr_truncated && !stored.stdout_truncated);
        let tail = server::records::commands::read_output(
            &plane.state.db.pool,
            &queued.id,
            Stream::Stderr,
            (bound - 5) as i64,
            64,
        )
        .await
        .expect("output");
        assert_eq!(tail, b"01234");
        // A retry of stored bytes is answered as before; more is refused.
        let retry = runner_protocol::append_output(
            &plane.state,
            &queued.id,
            Stream::Stderr,
            &at(bound - 5),
            b"01234",
        )
        .await
        .expect("a retry");
        assert_eq!(retry, bound);
        let more = runner_protocol::append_output(
            &plane.state,
            &queued.id,
            Stream::Stderr,
            &at(bound),
            b"z",
        )
        .await;
        assert_eq!(code(more), ErrorCode::PayloadTooLarge);
        // The other stream goes on.
        let length = runner_protocol::append_output(
            &plane.state,
            &queued.id,
            Stream::Stdout,
            &at(3),
            b"more\n",
        )
        .await
        .expect("stdout goes on");
        assert_eq!(length, 8);
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
            (CommandState::Exited, Some(0), 8)
        );
        assert!(exited.to_api().stderr_truncated);
        assert!(exited.ended());
    }
}

impl Plane {
    /// Creates a durable sandbox, placed on a runner.
    async fn create_durable(&self, org: &str) -> SandboxRow {
        let mut request = create_request();
        request.storage_class = "durable".to_owned();
        let mut row = admission::prepare(&self.state, org, &mut request).expect("in bounds");
        let mut tx = self.state.db.write().await.expect("tx");
        admission::admit(&self.state, &mut tx, &mut row, &request)
            .await
            .expect("admitted");
        let row = sandboxes::reload(&mut tx, &row.id).await.expect("reload");
        tx.commit().await.expect("commit");
        row
    }

    async fn load(&self, id: &str) -> SandboxRow {
        let mut tx = self.state.db.write().await.expect("tx");
        sandboxes::reload(&mut tx, id).await.expect("the sandbox")
    }

    /// The runner's lease runs out now, and the lease watcher sees it.
    async fn lose(&self, runner: &str) {
        sqlx::query("UPDATE runner_leases SET expires_at_ms = 0 WHERE runner_id = $1")
            .bind(runner)
            .execute(&self.state.db.pool)
            .await
            .expect("lease expired");
        server::reconcile::expire_leases(&self.state)
            .await
            .expect("the lease watcher runs");
    }

    async fn change(
        &self,
        org: &str,
        id: &str,
        what: &str,
    ) -> Result<SandboxRow, server::control::ControlError> {
        let mut tx = self.state.db.write().await?;
        let row = match what {
            "stop" => sandboxes::stop(&self.state, &mut tx, org, id).await?,
            "start" => sandboxes::start(&self.state, &mut tx, org, id).await?,
            _ => sandboxes::delete(&self.state, &mut tx, org, id).await?,
        };
        tx.commit().await?;
        Ok(row)
    }

    async fn keep(
        &self,
        runner: &str,
        id: &str,
        name: &str,
        secured_root: Option<&str>,
    ) -> api::runners::KeptCopyAnswer {
        let report = api::runners::KeptCopyReport {
            runner_id: runner.to_owned(),
            sandbox_id: id.to_owned(),
            name: name.to_owned(),
            bytes: 12_345,
            kept_at_ms: server::db::now_ms(),
            secured_root: secured_root.map(str::to_owned),
        };
        server::control::kept::report(&self.state, &report)
            .await
            .expect("the report is taken")
    }

    async fn kept_listed(&self, runner: &str) -> Vec<String> {
        runner_protocol::read_assignments(&self.state, runner)
            .await
            .expect("assignments")
            .kept
            .into_iter()
            .map(|copy| copy.copy_id)
            .collect()
    }

    async fn discard(
        &self,
        org: &str,
        id: &str,
        copy: &str,
    ) -> Result<SandboxRow, server::control::ControlError> {
        let mut tx = self.state.db.write().await?;
        let row = server::control::kept::discard(&self.state, &mut tx, Some(org), id, copy).await?;
        tx.commit().await?;
        Ok(row)
    }
}

/// Issue 13, point 1: a durable sandbox whose runner is lost while it
/// secures (no save ever completed) was recorded `stopped` with
/// `save.state: ok` and no root, a save that did not exist. It is
/// `recovering` now, fenced, its save status failing with why, its
/// record saying it restores an empty home; a start places it from there.
#[tokio::test]
async fn a_runner_lost_while_securing_leaves_the_sandbox_recovering_and_says_what_it_restores() {
    for plane in planes_with("lostsecuring", true).await {
        let org = plane.org("org_l", None).await;
        let runner = plane.runner(4).await;
        let row = plane.create_durable(&org).await;
        let row = plane
            .report(&row, &runner, SandboxState::Running)
            .await
            .expect("running");
        plane.change(&org, &row.id, "stop").await.expect("stop");
        let row = plane
            .report(&row, &runner, SandboxState::Stopping)
            .await
            .expect("stopping");
        let row = plane
            .report(&row, &runner, SandboxState::Securing)
            .await
            .expect("securing");

        plane.lose(&runner).await;
        let lost = plane.load(&row.id).await;
        let record = lost.to_api();
        assert_eq!(record.state, SandboxState::Recovering, "{}", plane.engine());
        assert_eq!(record.state_reason.as_deref(), Some("node_lost"));
        assert_eq!(record.desired, DesiredState::Stopped);
        assert_eq!(lost.epoch, row.epoch + 1, "the lost runner is fenced");
        assert_eq!(lost.runner_id, None);
        let save = record.save.expect("a durable sandbox's save status");
        assert_eq!(save.state, "failing", "{save:?}");
        assert_eq!(save.root, None);
        assert_eq!(save.last_completed_at, None);
        assert!(
            save.last_error
                .as_deref()
                .is_some_and(|e| e.contains("securing did not complete")),
            "{save:?}"
        );
        let recovery = record
            .recovery
            .expect("a recovering record says what it restores");
        assert_eq!(recovery.restores, "empty");
        assert_eq!(recovery.root, None);
        let events = plane.events(&row.id).await;
        assert_eq!(
            events.last(),
            Some(&("recovering".to_owned(), Some("node_lost".to_owned())))
        );
        // A report of the old placement is fenced.
        let late = plane.report(&row, &runner, SandboxState::Stopped).await;
        assert_eq!(code(late), ErrorCode::Fenced);

        // Started: placed from its last save (none: an empty home).
        let runner = plane.register(Some(&runner), 4).await;
        let started = plane.change(&org, &row.id, "start").await.expect("start");
        assert_eq!(started.state, SandboxState::Starting, "placed at once");
        assert_eq!(started.epoch, lost.epoch + 1);
        let assignments = runner_protocol::read_assignments(&plane.state, &runner)
            .await
            .expect("assignments");
        assert_eq!(assignments.sandboxes[0].home_root, None);
    }
}

/// Issue 13, point 2: a home a returning runner holds with writes after
/// the last completed save is kept and listed on the record (runner, time,
/// bytes, why) until its org discards it; a discarded copy is no longer
/// listed to its runner, whose report is then answered `keep: false`.
#[tokio::test]
async fn a_kept_copy_is_listed_on_the_record_until_discarded() {
    for plane in planes_with("keptcopy", true).await {
        let org = plane.org("org_k", None).await;
        let runner = plane.runner(4).await;
        let row = plane.create_durable(&org).await;
        let row = plane
            .report(&row, &runner, SandboxState::Running)
            .await
            .expect("running");
        plane.lose(&runner).await;
        let runner = plane.register(Some(&runner), 0).await;

        let answer = plane.keep(&runner, &row.id, "k1", None).await;
        assert!(answer.keep, "{answer:?}");
        assert_eq!(answer.reason, "unsaved_writes");
        let copy_id = answer.copy_id.clone().expect("a copy id");
        // Reporting it again is the same copy.
        assert_eq!(plane.keep(&runner, &row.id, "k1", None).await, answer);
        let record = plane.load(&row.id).await.to_api();
        assert_eq!(record.kept_copies.len(), 1, "{record:?}");
        let kept = &record.kept_copies[0];
        assert_eq!(
            (
                kept.id.as_str(),
                kept.runner_id.as_str(),
                kept.bytes,
                kept.reason.as_str()
            ),
            (copy_id.as_str(), runner.as_str(), 12_345, "unsaved_writes")
        );
        assert_eq!(plane.kept_listed(&runner).await, vec![copy_id.clone()]);

        // Another org cannot see or discard it.
        let other = plane.org("org_other", None).await;
        assert_eq!(
            code(plane.discard(&other, &row.id, &copy_id).await),
            ErrorCode::NotFound
        );
        let discarded = plane
            .discard(&org, &row.id, &copy_id)
            .await
            .expect("discarded");
        assert!(discarded.to_api().kept_copies.is_empty());
        assert!(plane.kept_listed(&runner).await.is_empty());
        let again = plane.keep(&runner, &row.id, "k1", None).await;
        assert_eq!((again.keep, again.reason.as_str()), (false, "discarded"));
        assert_eq!(
            code(plane.discard(&org, &row.id, &copy_id).await),
            ErrorCode::NotFound
        );
    }
}

/// Issue 13, point 2: a copy equal to the last completed save (a stop
/// secured it) is kept until the sandbox runs again from the store; a
/// failed standard sandbox's home until the sandbox is deleted.
#[tokio::test]
async fn kept_copies_go_once_the_home_runs_elsewhere_or_its_sandbox_is_deleted() {
    for plane in planes_with("keptends", true).await {
        let org = plane.org("org_x", None).await;
        let first = plane.runner(4).await;
        let durable = plane.create_durable(&org).await;
        let standard = plane.create(&org).await.expect("admitted");
        let standard = plane
            .report(&standard, &first, SandboxState::Running)
            .await
            .expect("running");
        let durable = plane
            .report(&durable, &first, SandboxState::Running)
            .await
            .expect("running");
        // As if a save had committed this root.
        sqlx::query(
            "UPDATE sandboxes SET home_root = 'abc123', home_saved_at_ms = 1 WHERE id = $1",
        )
        .bind(&durable.id)
        .execute(&plane.state.db.pool)
        .await
        .expect("a root");
        plane.lose(&first).await;
        assert_eq!(plane.load(&standard.id).await.state, SandboxState::Failed);
        let recovering = plane.load(&durable.id).await.to_api();
        let recovery = recovering.recovery.expect("what it restores");
        assert_eq!(
            (recovery.restores.as_str(), recovery.root.as_deref()),
            ("last_save", Some("abc123"))
        );
        let first = plane.register(Some(&first), 0).await;

        let same = plane.keep(&first, &durable.id, "k1", Some("abc123")).await;
        assert_eq!(
            (same.keep, same.reason.as_str()),
            (true, "awaiting_new_placement")
        );
        let newer = plane.keep(&first, &durable.id, "k2", None).await;
        assert_eq!(
            (newer.keep, newer.reason.as_str()),
            (true, "unsaved_writes")
        );
        let failed = plane.keep(&first, &standard.id, "k1", None).await;
        assert_eq!((failed.keep, failed.reason.as_str()), (true, "node_lost"));

        // The durable sandbox is placed on another runner: the copy equal
        // to its save is kept until that placement runs.
        let second = plane.runner(4).await;
        server::reconcile::schedule_pending(&plane.state)
            .await
            .expect("placed");
        let placed = plane.load(&durable.id).await;
        assert_eq!(placed.runner_id.as_deref(), Some(second.as_str()));
        assert_eq!(plane.kept_listed(&first).await.len(), 3);
        plane
            .report(&placed, &second, SandboxState::Running)
            .await
            .expect("running");
        let listed = plane.kept_listed(&first).await;
        assert_eq!(
            listed.len(),
            2,
            "the duplicate of the save may go: {listed:?}"
        );
        let gone = plane.keep(&first, &durable.id, "k1", Some("abc123")).await;
        assert_eq!((gone.keep, gone.reason.as_str()), (false, "restored"));
        // The newer copy stays while the sandbox runs.
        assert!(plane.keep(&first, &durable.id, "k2", None).await.keep);

        // The failed standard sandbox's home stays until it is deleted.
        plane
            .change(&org, &standard.id, "delete")
            .await
            .expect("deleted");
        assert_eq!(plane.kept_listed(&first).await.len(), 1);
        let deleted = plane.keep(&first, &standard.id, "k1", None).await;
        assert_eq!(
            (deleted.keep, deleted.reason.as_str()),
            (false, "sandbox_deleted")
        );
    }
}

/// A salvage as `POST /v1/sandboxes/{id}/kept/{copy}/salvage` makes it
/// (`org`: `None` for an admin), committed.
async fn salvage(
    plane: &Plane,
    org: Option<&str>,
    id: &str,
    copy: &str,
) -> Result<server::records::snapshots::SnapshotRow, server::control::ControlError> {
    let mut tx = plane.state.db.write().await?;
    let request = api::snapshots::SalvageRequest::default();
    let row =
        server::control::kept::salvage(&plane.state, &mut tx, org, id, copy, &request).await?;
    tx.commit().await?;
    Ok(row)
}

/// A runner's report on snapshot `id`: `replicated` with `root`, or
/// `failed` with `message`.
async fn report_snapshot(
    plane: &Plane,
    id: &str,
    runner: &str,
    epoch: u64,
    outcome: Result<&str, &str>,
) -> Result<server::records::snapshots::SnapshotRow, server::control::ControlError> {
    let (durability, root, message) = match outcome {
        Ok(root) => ("replicated", Some(root.to_owned()), None),
        Err(message) => ("failed", None, Some(message.to_owned())),
    };
    let report = api::runners::SnapshotReport {
        runner_id: runner.to_owned(),
        epoch,
        durability: durability.to_owned(),
        root,
        files: Some(2),
        captured_at_ms: None,
        message,
    };
    server::control::snapshots::report(&plane.state, id, &report).await
}

/// A snapshot of `org`'s sandbox `id` as `POST …/snapshots` makes it,
/// committed.
async fn snapshot_of(
    plane: &Plane,
    org: &str,
    id: &str,
) -> server::records::snapshots::SnapshotRow {
    let mut tx = plane.state.db.write().await.expect("tx");
    let snapshot =
        server::control::snapshots::create(&plane.state, &mut tx, org, id, &Default::default())
            .await
            .expect("a snapshot");
    tx.commit().await.expect("commit");
    snapshot
}

async fn snapshot(plane: &Plane, id: &str) -> api::snapshots::Snapshot {
    let mut tx = plane.state.db.write().await.expect("tx");
    server::records::snapshots::load(&mut tx, id)
        .await
        .expect("read")
        .expect("the snapshot")
        .to_api()
}

/// The salvages the runner is told to upload, per kept copy.
async fn salvages_listed(plane: &Plane, runner: &str) -> Vec<(String, String, Vec<String>)> {
    runner_protocol::read_assignments(&plane.state, runner)
        .await
        .expect("assignments")
        .kept
        .into_iter()
        .map(|copy| (copy.copy_id, copy.org_id, copy.salvage))
        .collect()
}

/// A tree of `files` (name, content) uploaded into `org`'s store as a
/// runner's upload would put it; its root.
fn upload_files(plane: &Plane, org: &str, files: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("a dir");
    for (name, content) in files {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().expect("in the dir")).expect("mkdir");
        std::fs::write(path, content).expect("write");
    }
    let store = plane.state.store.clone().expect("a store");
    let store_org: store::OrgId = org.parse().expect("an org");
    store::push::upload_tree(
        &*store,
        &store_org,
        dir.path(),
        &store::push::UploadOptions::everything(),
        &store::progress::NoProgress,
    )
    .and_then(store::push::Upload::finish)
    .expect("uploaded")
    .root
    .expect("a root")
    .to_hex()
}

/// A snapshot's store home (its pin for gc) names the tree its record
/// names, whatever reaches the server after it is replicated: a second
/// `replicated` report of another tree (a runner that captured again
/// after its first report's answer was lost, or a compromised one) is
/// answered with the record as it stands and leaves the pin where the
/// record is. Before, the second report pinned its own tree first, and
/// gc would then have taken the recorded one.
#[tokio::test]
async fn a_snapshot_replicated_twice_keeps_its_pin_on_the_tree_it_records() {
    for plane in planes_with("snapshot_pin", true).await {
        let org = plane.org("org_p", None).await;
        let runner = plane.runner(4).await;
        let row = plane.create_durable(&org).await;
        let row = plane
            .report(&row, &runner, SandboxState::Running)
            .await
            .expect("running");
        let pending = snapshot_of(&plane, &org, &row.id).await;
        let first = upload_files(&plane, &org, &[("notes.txt", "first capture\n")]);
        let second = upload_files(&plane, &org, &[("notes.txt", "second capture\n")]);
        let epoch = row.epoch as u64;

        let done = report_snapshot(&plane, &pending.id, &runner, epoch, Ok(&first))
            .await
            .expect("replicated");
        assert_eq!(done.root.as_deref(), Some(first.as_str()));
        let again = report_snapshot(&plane, &pending.id, &runner, epoch, Ok(&second))
            .await
            .expect("answered as recorded");
        assert_eq!(
            (again.durability.as_str(), again.root.as_deref()),
            ("replicated", Some(first.as_str())),
            "{}",
            plane.engine()
        );
        let store = plane.state.store.clone().expect("a store");
        let store_org: store::OrgId = org.parse().expect("an org");
        let home: store::HomeName = pending.id.parse().expect("a home name");
        assert_eq!(
            store
                .read_home(&store_org, &home)
                .expect("read")
                .map(|r| r.to_hex()),
            Some(first.clone()),
            "the pin names the recorded tree ({})",
            plane.engine()
        );

        // A pin moved away from the record (a report that died between
        // its pin and its look at the record) is put back by the next.
        let second_digest: store::Digest = second.parse().expect("a digest");
        store
            .write_home(&store_org, &home, &second_digest)
            .expect("moved");
        report_snapshot(&plane, &pending.id, &runner, epoch, Ok(&second))
            .await
            .expect("answered as recorded");
        assert_eq!(
            store
                .read_home(&store_org, &home)
                .expect("read")
                .map(|r| r.to_hex()),
            Some(first),
            "{}",
            plane.engine()
        );
    }
}

/// Issue 13, point 2: a kept copy salvaged into a snapshot. The snapshot
/// is `pending` until the runner holding the copy (told so with its
/// assignments, and let into the org's objects for it) uploaded it and
/// reported a root the server finds complete; then it is replicated,
/// says which copy of which runner it came from, and a child created from
/// it starts as that tree. The copy stays. A runner lost, or an upload
/// that failed, fails the snapshot with a reason and leaves the copy.
/// Refused: another org (404), a discarded or expired copy (404 /
/// invalid_state), a runner reporting for a copy it does not hold (404)
/// or, holding one, for a snapshot of a placement not its own (fenced).
#[tokio::test]
async fn a_kept_copy_salvaged_becomes_a_snapshot_its_runner_uploads_and_the_copy_stays() {
    for plane in planes_with("salvage", true).await {
        let org = plane.org("org_s", None).await;
        let holder = plane.runner(4).await;
        let row = plane.create_durable(&org).await;
        plane
            .report(&row, &holder, SandboxState::Running)
            .await
            .expect("running");
        plane.lose(&holder).await;
        let holder = plane.register(Some(&holder), 0).await;
        let copy = plane.keep(&holder, &row.id, "k1", None).await;
        let copy_id = copy.copy_id.expect("kept");
        let kept_at = plane.load(&row.id).await.to_api().kept_copies[0]
            .kept_at
            .clone();
        // Another runner, holding nothing of the org.
        let stranger = plane.register(None, 0).await;

        // Another org does not see the copy; an admin may salvage it.
        let other = plane.org("org_other", None).await;
        assert_eq!(
            code(salvage(&plane, Some(&other), &row.id, &copy_id).await),
            ErrorCode::NotFound,
            "{}",
            plane.engine()
        );
        let pending = salvage(&plane, Some(&org), &row.id, &copy_id)
            .await
            .expect("salvage")
            .to_api();
        assert_eq!(pending.durability, "pending", "{pending:?}");
        assert_eq!(pending.sandbox_id, row.id);
        let from = pending.salvaged_from.clone().expect("where it comes from");
        assert_eq!(
            (
                from.copy_id.as_str(),
                from.runner_id.as_str(),
                &from.kept_at
            ),
            (copy_id.as_str(), holder.as_str(), &kept_at)
        );
        assert_eq!(pending.captured_at.as_ref(), Some(&kept_at));
        let by_admin = salvage(&plane, None, &row.id, &copy_id)
            .await
            .expect("an admin salvages too");
        assert_eq!(by_admin.org_id, org, "the snapshot is the sandbox's org's");

        // The runner holding the copy is told, and may use the org's
        // objects for it; no other runner.
        assert_eq!(
            salvages_listed(&plane, &holder).await,
            vec![(
                copy_id.clone(),
                org.clone(),
                vec![pending.id.clone(), by_admin.id.clone()]
            )]
        );
        let pool = &plane.state.db.pool;
        assert!(
            server::records::runners::holds_org(pool, &holder, &org)
                .await
                .expect("read")
        );
        assert!(
            !server::records::runners::holds_org(pool, &stranger, &org)
                .await
                .expect("read")
        );

        // A tree uploaded as the runner would (the copy's files).
        let root = upload_files(
            &plane,
            &org,
            &[("work.txt", "precious\n"), ("many/f1", "1\n")],
        );

        // A runner not holding the copy cannot report it; nor can the
        // holder report a root the store does not have whole.
        assert_eq!(
            code(report_snapshot(&plane, &pending.id, &stranger, 0, Ok(&root)).await),
            ErrorCode::NotFound
        );
        let absent = "ab".repeat(32);
        assert_eq!(
            code(report_snapshot(&plane, &pending.id, &holder, 0, Ok(&absent)).await),
            ErrorCode::InvalidState
        );
        assert_eq!(snapshot(&plane, &pending.id).await.durability, "pending");

        let done = report_snapshot(&plane, &pending.id, &holder, 0, Ok(&root))
            .await
            .expect("replicated")
            .to_api();
        assert_eq!(
            (done.durability.as_str(), done.root.as_deref()),
            ("replicated", Some(root.as_str())),
            "{done:?}"
        );
        assert_eq!(done.salvaged_from, Some(from.clone()));
        // The copy stays, listed on the record and to its runner.
        assert_eq!(
            plane.load(&row.id).await.to_api().kept_copies[0].id,
            copy_id
        );
        assert_eq!(
            salvages_listed(&plane, &holder).await,
            vec![(copy_id.clone(), org.clone(), vec![by_admin.id.clone()])]
        );

        // A child created from it starts as the copy's tree.
        let mut request = create_request();
        request.storage_class = "durable".to_owned();
        request.from_snapshot = Some(done.id.clone());
        let mut child = admission::prepare(&plane.state, &org, &mut request).expect("in bounds");
        let mut tx = plane.state.db.write().await.expect("tx");
        admission::admit(&plane.state, &mut tx, &mut child, &request)
            .await
            .expect("a child");
        tx.commit().await.expect("commit");
        assert_eq!(plane.load(&child.id).await.home.root, Some(root.clone()));

        // The upload failed on the runner: failed, saying why; copy kept.
        let failed = report_snapshot(&plane, &by_admin.id, &holder, 0, Err("disk on fire"))
            .await
            .expect("failed")
            .to_api();
        assert_eq!(failed.durability, "failed");
        assert_eq!(failed.reason.as_deref(), Some("runner_error: disk on fire"));
        assert_eq!(plane.load(&row.id).await.to_api().kept_copies.len(), 1);

        // Holding a copy is no right to report a placement's snapshot.
        let third = plane.runner(4).await;
        let elsewhere = plane.create(&org).await.expect("placed");
        assert_eq!(elsewhere.runner_id.as_deref(), Some(third.as_str()));
        let theirs = snapshot_of(&plane, &org, &elsewhere.id).await;
        assert_eq!(
            code(
                report_snapshot(
                    &plane,
                    &theirs.id,
                    &holder,
                    elsewhere.epoch as u64,
                    Ok(&root)
                )
                .await
            ),
            ErrorCode::Fenced
        );
        assert_eq!(snapshot(&plane, &theirs.id).await.durability, "pending");

        // The runner is lost mid-salvage: failed (runner_lost); the copy
        // stays listed. Salvaged while it is away: failed at once.
        let midway = salvage(&plane, Some(&org), &row.id, &copy_id)
            .await
            .expect("salvage");
        // Nor is a salvage for the sandbox's placement to capture.
        assert_eq!(
            plane.load(&row.id).await.runner_id.as_deref(),
            Some(third.as_str()),
            "recovered on the runner with room"
        );
        let on_third = runner_protocol::read_assignments(&plane.state, &third)
            .await
            .expect("assignments");
        let listed: Vec<String> = on_third
            .sandboxes
            .iter()
            .flat_map(|s| s.snapshots.iter().map(|s| s.snapshot_id.clone()))
            .collect();
        assert_eq!(listed, vec![theirs.id.clone()]);
        plane.lose(&holder).await;
        server::control::snapshots::expire(&plane.state)
            .await
            .expect("expiry runs");
        let lost = snapshot(&plane, &midway.id).await;
        assert_eq!(lost.durability, "failed", "{lost:?}");
        assert!(
            lost.reason
                .as_deref()
                .is_some_and(|r| r.starts_with("runner_lost: ") && !r.contains('\n')),
            "{lost:?}"
        );
        let away = salvage(&plane, Some(&org), &row.id, &copy_id)
            .await
            .expect("salvage")
            .to_api();
        assert_eq!(away.durability, "failed");
        assert!(
            away.reason
                .as_deref()
                .is_some_and(|r| r.starts_with("runner_lost: ")),
            "{away:?}"
        );
        assert_eq!(plane.load(&row.id).await.to_api().kept_copies.len(), 1);
        let holder = plane.register(Some(&holder), 0).await;

        // Discarded while a salvage waits: the salvage fails, and a
        // discarded copy cannot be salvaged.
        let waiting = salvage(&plane, Some(&org), &row.id, &copy_id)
            .await
            .expect("salvage");
        plane
            .discard(&org, &row.id, &copy_id)
            .await
            .expect("discarded");
        let gone = snapshot(&plane, &waiting.id).await;
        assert_eq!(gone.durability, "failed");
        assert!(
            gone.reason
                .as_deref()
                .is_some_and(|r| r.starts_with("kept_copy_gone: ")),
            "{gone:?}"
        );
        assert_eq!(
            code(salvage(&plane, Some(&org), &row.id, &copy_id).await),
            ErrorCode::NotFound
        );
        assert_eq!(
            code(report_snapshot(&plane, &waiting.id, &holder, 0, Ok(&root)).await),
            ErrorCode::NotFound,
            "a copy discarded is no longer the runner's to report"
        );

        // A copy past the retention window: invalid_state until the
        // expiry lets it go, then 404.
        let old = plane.keep(&holder, &row.id, "k2", None).await;
        let old_id = old.copy_id.expect("kept");
        sqlx::query("UPDATE kept_copies SET kept_at_ms = 1 WHERE id = $1")
            .bind(&old_id)
            .execute(&plane.state.db.pool)
            .await
            .expect("aged");
        assert_eq!(
            code(salvage(&plane, Some(&org), &row.id, &old_id).await),
            ErrorCode::InvalidState
        );
        server::control::kept::expire(&plane.state)
            .await
            .expect("expiry runs");
        assert_eq!(
            code(salvage(&plane, Some(&org), &row.id, &old_id).await),
            ErrorCode::NotFound
        );
    }
}

/// Issue 13, point 4: the rule for a runner's "still starting, waiting for
/// the store" report. It changes the record's reason and message and
/// nothing else; an event is written when the reason changes, not for
/// every retry (each only rewrites the message, which says when the next
/// attempt is); `running` brings the usual reason back and clears the
/// message. Any other repeat of the recorded state, or a wait reason for
/// a sandbox not `starting`, changes nothing, and a stale placement's
/// wait is fenced.
#[tokio::test]
async fn a_starting_sandbox_waiting_for_the_store_says_so_once_per_reason() {
    for plane in planes("store_wait").await {
        let org = plane.org("org_w", None).await;
        let runner = plane.runner(4).await;
        let starting = plane.create(&org).await.expect("admitted and placed");
        let wait = |row: &SandboxRow, state: SandboxState, reason: &str, message: &str| {
            let report = SandboxReport {
                runner_id: runner.clone(),
                epoch: row.epoch as u64,
                state,
                reason: Some(reason.to_owned()),
                message: Some(message.to_owned()),
                wake: None,
            };
            let (state, id) = (plane.state.clone(), row.id.clone());
            async move { runner_protocol::report_sandbox(&state, &id, &report).await }
        };
        let first = wait(
            &starting,
            SandboxState::Starting,
            "store_unreachable",
            "cannot download the home: …; next attempt in 1 s",
        )
        .await
        .expect("a wait is recorded");
        assert_eq!(first.state, SandboxState::Starting, "{}", plane.engine());
        assert_eq!(first.state_reason.as_deref(), Some("store_unreachable"));
        assert_eq!(
            first.to_api().state_message.as_deref(),
            Some("cannot download the home: …; next attempt in 1 s")
        );
        let again = wait(
            &first,
            SandboxState::Starting,
            "store_unreachable",
            "cannot download the home: …; next attempt in 2 s",
        )
        .await
        .expect("a retry is recorded");
        assert_eq!(
            again.state_message.as_deref(),
            Some("cannot download the home: …; next attempt in 2 s")
        );
        // Not a wait: no change at all.
        let ignored = wait(&again, SandboxState::Starting, "placed", "anything")
            .await
            .expect("a repeat is accepted");
        assert_eq!(ignored.state_reason.as_deref(), Some("store_unreachable"));
        assert_eq!(ignored.state_message, again.state_message);
        let full = wait(
            &again,
            SandboxState::Starting,
            "store_full",
            "cannot download the home: store full …; next attempt in 4 s",
        )
        .await
        .expect("another cause is recorded");
        assert_eq!(full.state_reason.as_deref(), Some("store_full"));
        // A stale placement's wait is fenced, and writes nothing.
        let mut stale = full.clone();
        stale.epoch += 1;
        let fenced = wait(&stale, SandboxState::Starting, "store_unreachable", "x").await;
        assert_eq!(code(fenced), ErrorCode::Fenced);

        let running = plane
            .report(&full, &runner, SandboxState::Running)
            .await
            .expect("starting → running");
        assert_eq!(running.state_reason.as_deref(), Some("workload_started"));
        assert_eq!(running.state_message, None);
        // Running: a wait reason changes nothing.
        let ignored = wait(&running, SandboxState::Running, "store_unreachable", "x")
            .await
            .expect("a repeat is accepted");
        assert_eq!(ignored.state_reason.as_deref(), Some("workload_started"));

        let events = plane.events(&starting.id).await;
        let expected: Vec<(String, Option<String>)> = [
            ("pending", "admitted"),
            ("starting", "placed"),
            ("starting", "store_unreachable"),
            ("starting", "store_full"),
            ("running", "workload_started"),
        ]
        .iter()
        .map(|(s, r)| ((*s).to_owned(), Some((*r).to_owned())))
        .collect();
        assert_eq!(events, expected, "{}", plane.engine());
    }
}

impl Plane {
    /// A one-file tree uploaded to the plane's store (as a runner's upload
    /// through the block service would leave it); its root.
    fn upload_home(&self, org: &str, content: &str) -> String {
        let dir = tempfile::tempdir().expect("a home");
        std::fs::write(dir.path().join("work.txt"), content).expect("a file");
        let store = self.state.store.clone().expect("a store");
        let org: store::OrgId = org.parse().expect("a store org");
        let upload = store::push::upload_tree(
            &*store,
            &org,
            dir.path(),
            &store::push::UploadOptions::everything(),
            &store::progress::NoProgress,
        )
        .expect("uploaded");
        let report = upload.finish().expect("finished");
        report.root.expect("a root").to_hex()
    }

    /// The runner's save report of a completed save of `root`.
    async fn commit_save(
        &self,
        row: &SandboxRow,
        runner: &str,
        root: &str,
        securing: bool,
    ) -> Result<SandboxRow, server::control::ControlError> {
        let report = api::runners::SaveReport {
            runner_id: runner.to_owned(),
            epoch: row.epoch as u64,
            outcome: "completed".to_owned(),
            root: Some(root.to_owned()),
            captured_at_ms: Some(server::db::now_ms()),
            bytes_pending: None,
            error: None,
            snapshot_ms: None,
            uploaded_bytes: Some(1),
            securing,
        };
        server::control::saves::report_save(&self.state, &row.id, &report).await
    }

    /// A sandbox of `org` created, placed on `runner` and reported running.
    async fn running(&self, org: &str, runner: &str) -> SandboxRow {
        let row = self.create(org).await.expect("admitted");
        self.report(&row, runner, SandboxState::Running)
            .await
            .expect("running")
    }

    /// A command of `org` in the running sandbox `row`, handed over to
    /// `runner` and reported running there: its id.
    async fn running_command(&self, org: &str, row: &SandboxRow, runner: &str) -> String {
        let request = serde_json::from_value(serde_json::json!({ "argv": ["sleep", "60"] }))
            .expect("a command request");
        let mut tx = self.state.db.write().await.expect("tx");
        let command = commands::create(&self.state, &mut tx, org, &row.id, &request)
            .await
            .expect("created");
        tx.commit().await.expect("commit");
        runner_protocol::read_assignments(&self.state, runner)
            .await
            .expect("handed over");
        let running = CommandReport {
            runner_id: runner.to_owned(),
            epoch: row.epoch as u64,
            state: CommandState::Running,
            reason: None,
            exit_code: None,
            signal: None,
            pid: Some(7),
            output: None,
        };
        runner_protocol::report_command(&self.state, &command.id, &running)
            .await
            .expect("running");
        command.id
    }
}

/// Issue 13, point 10 (the fault matrix's `runner:secure_after_commit`): a
/// runner lost after its stop's securing committed, before it reported
/// `stopped`. The record said `recovering` with `save.state: failing` and
/// "securing did not complete … before the home was committed", of a home
/// that was. The commit now says so in the history, and the lease watcher
/// records the sandbox `stopped` (`node_lost`), its save intact; one
/// started again meanwhile is `recovering`, from that save.
#[tokio::test]
async fn a_runner_lost_after_its_securing_committed_leaves_the_sandbox_stopped_and_its_save_intact()
{
    for plane in planes_with("securedlost", true).await {
        let org = plane.org("org_s", None).await;
        let runner = plane.runner(4).await;
        for wanted_again in [false, true] {
            let row = plane.create_durable(&org).await;
            let row = plane
                .report(&row, &runner, SandboxState::Running)
                .await
                .expect("running");
            // A running save's commit is not a securing's.
            let running_root = plane.upload_home(&org, "running\n");
            plane
                .commit_save(&row, &runner, &running_root, false)
                .await
                .expect("a running save");
            plane.change(&org, &row.id, "stop").await.expect("stop");
            let row = plane
                .report(&row, &runner, SandboxState::Stopping)
                .await
                .expect("stopping");
            let row = plane
                .report(&row, &runner, SandboxState::Securing)
                .await
                .expect("securing");
            let secured_root = plane.upload_home(&org, &format!("secured {wanted_again}\n"));
            let secured = plane
                .commit_save(&row, &runner, &secured_root, true)
                .await
                .expect("the securing commits");
            assert_eq!(secured.state, SandboxState::Securing);
            let events = plane.events(&row.id).await;
            assert_eq!(
                events.last(),
                Some(&("securing".to_owned(), Some("securing_committed".to_owned()))),
                "{events:?}"
            );
            if wanted_again {
                plane.change(&org, &row.id, "start").await.expect("start");
            }

            plane.lose(&runner).await;
            let lost = plane.load(&row.id).await;
            let record = lost.to_api();
            let save = record.save.clone().expect("a save status");
            assert_eq!(save.state, "ok", "{}: {save:?}", plane.engine());
            assert_eq!(save.last_error, None);
            assert_eq!(save.root.as_deref(), Some(secured_root.as_str()));
            assert_eq!(lost.runner_id, None);
            if wanted_again {
                // The start asked during the stop waited for it: the loss
                // ended the stop (`stopped`, the home secured), then the
                // start followed, from the secured save.
                let events = plane.events(&row.id).await;
                assert!(
                    events.contains(&("stopped".to_owned(), Some("node_lost".to_owned()))),
                    "{events:?}"
                );
                assert_eq!(record.state, SandboxState::Pending, "{record:?}");
                assert_eq!(record.desired, DesiredState::Running);
                let stopped_at = events
                    .iter()
                    .position(|e| e == &("stopped".to_owned(), Some("node_lost".to_owned())));
                let pending_at = events
                    .iter()
                    .position(|e| e == &("pending".to_owned(), Some("start_requested".to_owned())));
                assert!(
                    stopped_at < pending_at && stopped_at.is_some(),
                    "{events:?}"
                );
                assert_eq!(lost.home.root.as_deref(), Some(secured_root.as_str()));
            } else {
                assert_eq!(record.state_reason.as_deref(), Some("node_lost"));
                assert_eq!(record.state, SandboxState::Stopped, "{record:?}");
                assert_eq!(lost.epoch, row.epoch);
                // A late report of the lost placement changes nothing.
                let late = plane.report(&row, &runner, SandboxState::Stopped).await;
                assert_eq!(code(late), ErrorCode::Fenced);
                let runner = plane.register(Some(&runner), 4).await;
                let started = plane.change(&org, &row.id, "start").await.expect("start");
                assert_eq!(started.state, SandboxState::Starting, "placed at once");
                let assignments = runner_protocol::read_assignments(&plane.state, &runner)
                    .await
                    .expect("assignments");
                let assigned = assignments
                    .sandboxes
                    .iter()
                    .find(|s| s.sandbox_id == row.id)
                    .expect("assigned");
                assert_eq!(assigned.home_root.as_deref(), Some(secured_root.as_str()));
            }
            plane.register(Some(&runner), 4).await;
        }
    }
}

// Issue 16: sleeping when idle, waking on use.

impl Plane {
    /// A sandbox (durable when asked) with `idle_s` as its idle timeout,
    /// placed on `runner` and reported running there.
    async fn running_with_idle(
        &self,
        org: &str,
        runner: &str,
        durable: bool,
        idle_s: u64,
    ) -> SandboxRow {
        let mut request = create_request();
        if durable {
            request.storage_class = "durable".to_owned();
        }
        request.idle_timeout_s = Some(idle_s);
        let mut row = admission::prepare(&self.state, org, &mut request).expect("in bounds");
        let mut tx = self.state.db.write().await.expect("tx");
        admission::admit(&self.state, &mut tx, &mut row, &request)
            .await
            .expect("admitted");
        let row = sandboxes::reload(&mut tx, &row.id).await.expect("reload");
        tx.commit().await.expect("commit");
        assert_eq!(row.runner_id.as_deref(), Some(runner), "placed");
        self.report(&row, runner, SandboxState::Running)
            .await
            .expect("running")
    }

    async fn command(
        &self,
        org: &str,
        id: &str,
    ) -> Result<server::records::CommandRow, server::control::ControlError> {
        let request = serde_json::from_value(serde_json::json!({ "argv": ["true"] }))
            .expect("a command request");
        let mut tx = self.state.db.write().await?;
        let command = commands::create(&self.state, &mut tx, org, id, &request).await?;
        tx.commit().await?;
        Ok(command)
    }

    async fn load_command(&self, id: &str) -> server::records::CommandRow {
        let mut tx = self.state.db.write().await.expect("tx");
        server::records::commands::load(&mut tx, id)
            .await
            .expect("read")
            .expect("the command")
    }

    /// The runner's report of `row`'s state with `reason`, as a runner
    /// stopping for a desired `stopped` says (`stop_requested`).
    async fn report_why(
        &self,
        row: &SandboxRow,
        runner: &str,
        state: SandboxState,
        reason: &str,
    ) -> Result<SandboxRow, server::control::ControlError> {
        let report = SandboxReport {
            runner_id: runner.to_owned(),
            epoch: row.epoch as u64,
            state,
            reason: Some(reason.to_owned()),
            message: None,
            wake: None,
        };
        runner_protocol::report_sandbox(&self.state, &row.id, &report).await
    }

    /// The runner stops the sandbox as asked: `stopping`, then `securing`
    /// and a committed save for a durable one, then `stopped`.
    async fn runner_stops(&self, org: &str, row: &SandboxRow, runner: &str) -> SandboxRow {
        let mut row = self
            .report_why(row, runner, SandboxState::Stopping, "stop_requested")
            .await
            .expect("stopping");
        if row.storage_class == api::lifecycle::StorageClass::Durable {
            row = self
                .report_why(&row, runner, SandboxState::Securing, "stop_requested")
                .await
                .expect("securing");
            let root = self.upload_home(org, "last words\n");
            self.commit_save(&row, runner, &root, true)
                .await
                .expect("secured");
        }
        self.report_why(&row, runner, SandboxState::Stopped, "stop_requested")
            .await
            .expect("stopped")
    }

    /// Commands handed to `runner` now, by id.
    async fn handed(&self, runner: &str) -> Vec<String> {
        runner_protocol::read_assignments(&self.state, runner)
            .await
            .expect("assignments")
            .commands
            .into_iter()
            .map(|c| c.command_id)
            .collect()
    }

    async fn event_messages(&self, id: &str) -> Vec<(String, Option<String>, Option<String>)> {
        sqlx::query_as(
            "SELECT state, reason, message FROM events WHERE sandbox_id = $1 ORDER BY seq",
        )
        .bind(id)
        .fetch_all(&self.state.db.pool)
        .await
        .expect("events")
    }
}

/// Issue 16, points 1, 3, 4 and 6: at its deadline an idle sandbox goes to
/// sleep (an ordinary stop, `idle` on the desired change and every state
/// it goes through); a command sent while it sleeps wakes it under the
/// same id, on the runner that held it, and runs once it is running; the
/// events name the command and the save it comes back from.
#[tokio::test]
async fn an_idle_sandbox_sleeps_and_a_command_wakes_it_where_it_was() {
    for plane in planes_with("idlewake", true).await {
        let org = plane.org("org_i", None).await;
        let runner = plane.runner(4).await;
        for durable in [false, true] {
            let row = plane.running_with_idle(&org, &runner, durable, 2).await;
            let record = row.to_api();
            assert_eq!(record.idle_timeout_s, 2);
            assert_eq!(record.last_activity.as_deref(), Some("started"));
            let deadline = row
                .idle
                .deadline_ms
                .expect("a running sandbox has a deadline");
            assert_eq!(
                deadline,
                row.idle.last_activity_at_ms.expect("an activity") + 2_000
            );
            // Not before the deadline.
            let slept = server::control::idle::sleep_due(&plane.state, deadline - 1)
                .await
                .expect("the idle pass");
            assert_eq!(slept, 0);
            assert_eq!(plane.load(&row.id).await.desired, DesiredState::Running);
            // At it.
            let slept = server::control::idle::sleep_due(&plane.state, deadline)
                .await
                .expect("the idle pass");
            assert_eq!(slept, 1, "{}", plane.engine());
            let asleep = plane.load(&row.id).await;
            assert_eq!(asleep.desired, DesiredState::Stopped);
            assert_eq!(asleep.desired_reason.as_deref(), Some("idle"));
            assert_eq!(asleep.idle.deadline_ms, None);
            let stopped = plane.runner_stops(&org, &asleep, &runner).await;
            assert_eq!(stopped.state, SandboxState::Stopped);
            assert_eq!(stopped.state_reason.as_deref(), Some("idle"));
            let events = plane.event_messages(&row.id).await;
            for state in ["stopping", "stopped"] {
                assert!(
                    events
                        .iter()
                        .any(|(s, reason, _)| s == state && reason.as_deref() == Some("idle")),
                    "{state} says idle: {events:?}"
                );
            }
            // A second pass finds nothing: an asleep sandbox is not due.
            let again = server::control::idle::sleep_due(&plane.state, i64::MAX / 2)
                .await
                .expect("the idle pass");
            assert_eq!(again, 0);

            let command = plane.command(&org, &row.id).await.expect("woken");
            assert!(command.waited_for_wake);
            assert_eq!(command.state, CommandState::Queued);
            let waking = plane.load(&row.id).await;
            assert_eq!(waking.id, row.id, "the same sandbox");
            assert_eq!(waking.desired, DesiredState::Running);
            assert_eq!(waking.state, SandboxState::Starting, "placed at once");
            assert_eq!(
                waking.runner_id.as_deref(),
                Some(runner.as_str()),
                "where it was"
            );
            let events = plane.event_messages(&row.id).await;
            let (_, reason, message) = events
                .iter()
                .rev()
                .find(|(state, _, _)| state == "starting")
                .expect("a starting event");
            assert_eq!(reason.as_deref(), Some("placed"));
            let message = message.clone().unwrap_or_default();
            assert!(
                message.contains(&format!("woken by command {}", command.id)),
                "{message}"
            );
            if durable {
                let root = waking.home.root.clone().expect("a secured root");
                assert!(message.contains(&root[..16]), "names the save: {message}");
            }
            assert!(
                events.iter().any(|(state, reason, _)| state == "pending"
                    && reason.as_deref() == Some("woken_by_command")),
                "{events:?}"
            );
            // Not handed over before the sandbox runs; then exactly once.
            assert!(!plane.handed(&runner).await.contains(&command.id));
            let running = plane
                .report(&waking, &runner, SandboxState::Running)
                .await
                .expect("running");
            assert!(plane.handed(&runner).await.contains(&command.id));
            let report = CommandReport {
                runner_id: runner.clone(),
                epoch: running.epoch as u64,
                state: CommandState::Running,
                reason: None,
                exit_code: None,
                signal: None,
                pid: None,
                output: None,
            };
            runner_protocol::report_command(&plane.state, &command.id, &report)
                .await
                .expect("started");
        }
        let metrics = plane.state.metrics.render(
            &[],
            0,
            &server::metrics::SaveLag {
                max_seconds: 0.0,
                delayed: 0,
            },
            0.0,
        );
        for line in [
            "roost_sleeps_total{reason=\"idle\"} 2",
            "roost_wakes_total{trigger=\"command\"} 2",
            "roost_idle_sleep_decisions_total 2",
            "roost_wake_latency_seconds_count 2",
        ] {
            assert!(metrics.contains(line), "{line} in {metrics}");
        }
    }
}

/// Issue 16, point 3 and "a command arriving exactly at the deadline": in
/// either order, and at once, the command runs and is never lost: before
/// the decision it cancels the sleep; after it, it wakes the sandbox
/// (which stops, then starts again for it).
#[tokio::test]
async fn a_command_at_the_deadline_cancels_the_sleep_or_wakes_the_sandbox() {
    for plane in planes_with("idledeadline", true).await {
        let org = plane.org("org_d", None).await;
        let runner = plane.runner(8).await;
        // The command first: the sleep is no longer due.
        let row = plane.running_with_idle(&org, &runner, true, 1).await;
        let deadline = row.idle.deadline_ms.expect("a deadline");
        let first = plane.command(&org, &row.id).await.expect("queued");
        assert!(!first.waited_for_wake);
        let slept = server::control::idle::sleep_due(&plane.state, deadline)
            .await
            .expect("the idle pass");
        assert_eq!(slept, 0);
        assert_eq!(plane.load(&row.id).await.desired, DesiredState::Running);
        assert_eq!(plane.handed(&runner).await, vec![first.id.clone()]);

        // The sleep first: the command wakes what is stopping.
        let row = plane.running_with_idle(&org, &runner, false, 1).await;
        let deadline = row.idle.deadline_ms.expect("a deadline");
        let slept = server::control::idle::sleep_due(&plane.state, deadline)
            .await
            .expect("the idle pass");
        assert_eq!(slept, 1);
        let second = plane.command(&org, &row.id).await.expect("queued");
        assert!(second.waited_for_wake);
        let woken = plane.load(&row.id).await;
        // The runner may be stopping it already: the stop goes on, and the
        // command is not handed to a runner that is stopping the sandbox
        // (it would be cut short); the wake waits for the stop.
        assert_eq!(woken.desired, DesiredState::Stopped);
        assert!(!plane.handed(&runner).await.contains(&second.id));
        let events = plane.event_messages(&row.id).await;
        assert!(
            events
                .iter()
                .any(|(_, reason, _)| reason.as_deref() == Some("wake_requested")),
            "{events:?}"
        );
        let stopped = plane.runner_stops(&org, &woken, &runner).await;
        assert_eq!(
            plane.load_command(&second.id).await.state,
            CommandState::Queued,
            "still waiting"
        );
        let again = plane.load(&stopped.id).await;
        assert_eq!(again.state, SandboxState::Starting, "placed again");
        plane
            .report(&again, &runner, SandboxState::Running)
            .await
            .expect("running");
        assert!(plane.handed(&runner).await.contains(&second.id));

        // At once, many times: whichever wins, no command ends unrun.
        for _ in 0..5 {
            let row = plane.running_with_idle(&org, &runner, false, 1).await;
            let deadline = row.idle.deadline_ms.expect("a deadline");
            let (slept, command) = tokio::join!(
                server::control::idle::sleep_due(&plane.state, deadline),
                plane.command(&org, &row.id)
            );
            slept.expect("the idle pass");
            let command = command.expect("queued");
            let now = plane.load(&row.id).await;
            if now.desired == DesiredState::Running {
                // The command came first: no sleep.
                assert!(plane.handed(&runner).await.contains(&command.id));
            } else {
                // The sleep came first: the command waits for it, then wakes it.
                assert!(command.waited_for_wake, "{}", plane.engine());
                assert!(!plane.handed(&runner).await.contains(&command.id));
                plane.runner_stops(&org, &now, &runner).await;
                let again = plane.load(&row.id).await;
                plane
                    .report(&again, &runner, SandboxState::Running)
                    .await
                    .expect("running");
                assert!(plane.handed(&runner).await.contains(&command.id));
            }
            plane
                .change(&org, &row.id, "delete")
                .await
                .expect("deleted");
        }
    }
}

/// Issue 16: "two commands racing to wake the same sandbox (one wake, both
/// run once)".
#[tokio::test]
async fn two_commands_racing_to_wake_a_sandbox_make_one_wake_and_both_run_once() {
    for plane in planes_with("idlerace", true).await {
        let org = plane.org("org_r", None).await;
        let runner = plane.runner(4).await;
        let row = plane.running_with_idle(&org, &runner, true, 1).await;
        plane.change(&org, &row.id, "stop").await.expect("stop");
        let row = plane.load(&row.id).await;
        plane.runner_stops(&org, &row, &runner).await;
        let (a, b) = tokio::join!(plane.command(&org, &row.id), plane.command(&org, &row.id));
        let (a, b) = (a.expect("queued"), b.expect("queued"));
        assert!(a.waited_for_wake && b.waited_for_wake);
        let events = plane.event_messages(&row.id).await;
        let wakes = events
            .iter()
            .filter(|(_, reason, _)| reason.as_deref() == Some("woken_by_command"))
            .count();
        // The desired change and the move to `pending`, once.
        assert_eq!(wakes, 2, "one wake: {events:?}");
        let waking = plane.load(&row.id).await;
        plane
            .report(&waking, &runner, SandboxState::Running)
            .await
            .expect("running");
        let mut handed = plane.handed(&runner).await;
        handed.sort();
        let mut both = vec![a.id.clone(), b.id.clone()];
        both.sort();
        assert_eq!(handed, both);
        // Handed over once: a second read hands nothing new, and both are
        // `starting` under the one epoch.
        for id in [&a.id, &b.id] {
            let command = plane.load_command(id).await;
            assert_eq!(command.state, CommandState::Starting);
            assert_eq!(command.epoch, Some(waking.epoch));
        }
    }
}

/// Issue 16, points 1, 2 and the bad input: the idle timeout's bounds (400
/// naming the field and them), a policy change moving the deadline, a
/// keepalive (activity; 404 once deleted, 409 on a stopped sandbox, which
/// it does not wake), `auto_wake: false` (409), and a running command
/// keeping its sandbox awake until it ends.
#[tokio::test]
async fn the_idle_policy_keepalive_and_running_commands_decide_when_a_sandbox_sleeps() {
    for plane in planes_with("idlepolicy", true).await {
        let org = plane.org("org_p", None).await;
        let runner = plane.runner(4).await;
        for bad in [u64::MAX, 604_801] {
            let mut request = create_request();
            request.idle_timeout_s = Some(bad);
            let refused =
                admission::prepare(&plane.state, &org, &mut request).expect_err("refused");
            assert_eq!(refused.code, ErrorCode::InvalidRequest);
            assert!(
                refused.message.contains("idle_timeout_s") && refused.message.contains("604800"),
                "{}",
                refused.message
            );
        }
        let row = plane.running_with_idle(&org, &runner, false, 30).await;
        let update = |timeout: Option<u64>, auto_wake: Option<bool>| {
            let request = api::sandboxes::UpdateSandboxRequest {
                idle_timeout_s: timeout,
                auto_wake,
            };
            let (state, org, id) = (plane.state.clone(), org.clone(), row.id.clone());
            async move {
                let mut tx = state.db.write().await?;
                let row =
                    server::control::idle::update(&state, &mut tx, &org, &id, &request).await?;
                tx.commit().await?;
                Ok::<_, server::control::ControlError>(row)
            }
        };
        let refused = update(Some(0x7fff_ffff_ffff_fffe), None).await;
        assert_eq!(code(refused), ErrorCode::InvalidRequest);
        // Another org's sandbox is not there, for a change or a keepalive.
        let other = plane.org("org_p_other", None).await;
        let mut tx = plane.state.db.write().await.expect("tx");
        let request = api::sandboxes::UpdateSandboxRequest {
            idle_timeout_s: Some(60),
            auto_wake: Some(false),
        };
        let foreign =
            server::control::idle::update(&plane.state, &mut tx, &other, &row.id, &request).await;
        assert_eq!(code(foreign), ErrorCode::NotFound);
        let foreign =
            server::control::idle::keepalive(&plane.state, &mut tx, &other, &row.id).await;
        assert_eq!(code(foreign), ErrorCode::NotFound);
        drop(tx);
        assert_eq!(plane.load(&row.id).await.idle.timeout_s, 30, "unchanged");
        let changed = update(Some(5), None).await.expect("changed");
        let activity = changed.idle.last_activity_at_ms.expect("an activity");
        assert_eq!(changed.idle.deadline_ms, Some(activity + 5_000));
        // The same body twice: the same record.
        let again = update(Some(5), None).await.expect("changed");
        assert_eq!(again.idle.deadline_ms, changed.idle.deadline_ms);
        let never = update(Some(0), None).await.expect("never");
        assert_eq!(never.idle.deadline_ms, None);
        update(Some(5), None).await.expect("back");

        // Keepalive: activity.
        let mut tx = plane.state.db.write().await.expect("tx");
        let kept = server::control::idle::keepalive(&plane.state, &mut tx, &org, &row.id)
            .await
            .expect("kept alive");
        tx.commit().await.expect("commit");
        assert_eq!(kept.idle.last_activity.as_deref(), Some("keepalive"));
        assert!(kept.idle.deadline_ms >= changed.idle.deadline_ms);

        // A running command keeps it awake until it ends.
        let command = plane.command(&org, &row.id).await.expect("queued");
        plane.handed(&runner).await;
        let report = |state, exit_code| CommandReport {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            state,
            reason: None,
            exit_code,
            signal: None,
            pid: None,
            output: None,
        };
        runner_protocol::report_command(
            &plane.state,
            &command.id,
            &report(CommandState::Running, None),
        )
        .await
        .expect("running");
        let deadline = plane
            .load(&row.id)
            .await
            .idle
            .deadline_ms
            .expect("a deadline");
        let slept = server::control::idle::sleep_due(&plane.state, deadline)
            .await
            .expect("the idle pass");
        assert_eq!(slept, 0, "a running command keeps it awake");
        let busy = plane.load(&row.id).await;
        assert_eq!(busy.idle.last_activity.as_deref(), Some("command_running"));
        assert!(busy.idle.deadline_ms > Some(deadline));
        runner_protocol::report_command(
            &plane.state,
            &command.id,
            &report(CommandState::Exited, Some(0)),
        )
        .await
        .expect("exited");
        let ended = plane.load(&row.id).await;
        assert_eq!(ended.idle.last_activity.as_deref(), Some("command_ended"));
        let slept = server::control::idle::sleep_due(
            &plane.state,
            ended.idle.deadline_ms.expect("a deadline"),
        )
        .await
        .expect("the idle pass");
        assert_eq!(slept, 1, "idle once the command ended");

        // A keepalive does not wake a stopped sandbox; auto_wake off refuses.
        let stopped = plane
            .runner_stops(&org, &plane.load(&row.id).await, &runner)
            .await;
        let mut tx = plane.state.db.write().await.expect("tx");
        let refused =
            server::control::idle::keepalive(&plane.state, &mut tx, &org, &stopped.id).await;
        drop(tx);
        assert_eq!(code(refused), ErrorCode::InvalidState);
        update(None, Some(false)).await.expect("auto_wake off");
        let refused = plane.command(&org, &row.id).await;
        assert_eq!(code(refused), ErrorCode::InvalidState);
        assert_eq!(
            plane.load(&row.id).await.state,
            SandboxState::Stopped,
            "not woken"
        );
        plane
            .change(&org, &row.id, "delete")
            .await
            .expect("deleted");
        let mut tx = plane.state.db.write().await.expect("tx");
        let gone = server::control::idle::keepalive(&plane.state, &mut tx, &org, &row.id).await;
        assert_eq!(code(gone), ErrorCode::NotFound);
    }
}

/// Issue 16: "a wake of a sandbox whose home store is unreachable (the
/// command ends not_launched with a reason, the sandbox's record says
/// why)", and "a host lost while a sandbox is waking (recovered as today,
/// the queued command runs once)".
#[tokio::test]
async fn a_wake_that_waits_for_the_store_ends_its_command_and_one_whose_host_is_lost_runs_it_once()
{
    for plane in planes_with("idlefaults", true).await {
        let org = plane.org("org_f", None).await;
        let runner = plane.runner(4).await;
        let row = plane.running_with_idle(&org, &runner, true, 1).await;
        plane.change(&org, &row.id, "stop").await.expect("stop");
        plane
            .runner_stops(&org, &plane.load(&row.id).await, &runner)
            .await;
        let command = plane.command(&org, &row.id).await.expect("woken");
        let waking = plane.load(&row.id).await;
        plane
            .report_why(
                &waking,
                &runner,
                SandboxState::Starting,
                "store_unreachable",
            )
            .await
            .expect("waiting for the store");
        let ended = plane.load_command(&command.id).await;
        assert_eq!(ended.state, CommandState::NotLaunched);
        assert_eq!(
            ended.state_reason.as_deref(),
            Some("sandbox_store_unreachable")
        );
        let record = plane.load(&row.id).await;
        assert_eq!(record.state, SandboxState::Starting);
        assert_eq!(record.state_reason.as_deref(), Some("store_unreachable"));

        // Another sandbox: its runner is lost while it wakes.
        let row = plane.running_with_idle(&org, &runner, true, 1).await;
        plane.change(&org, &row.id, "stop").await.expect("stop");
        plane
            .runner_stops(&org, &plane.load(&row.id).await, &runner)
            .await;
        let command = plane.command(&org, &row.id).await.expect("woken");
        assert_eq!(plane.load(&row.id).await.state, SandboxState::Starting);
        plane.lose(&runner).await;
        let lost = plane.load(&row.id).await;
        assert_eq!(lost.state, SandboxState::Recovering, "recovered as today");
        assert_eq!(
            plane.load_command(&command.id).await.state,
            CommandState::Queued,
            "the command still waits"
        );
        let other = plane.runner(4).await;
        server::reconcile::schedule_pending(&plane.state)
            .await
            .expect("scheduled");
        let placed = plane.load(&row.id).await;
        assert_eq!(placed.runner_id.as_deref(), Some(other.as_str()));
        plane
            .report(&placed, &other, SandboxState::Running)
            .await
            .expect("running");
        assert_eq!(plane.handed(&other).await, vec![command.id.clone()]);
    }
}

/// Issue 16, point 5: a scheduled save that found the home as its last
/// completed save is recorded as such: `safe_until` moves on,
/// `last_completed_at` does not; only the last completed save's root can
/// be found unchanged.
#[tokio::test]
async fn a_parked_home_found_unchanged_moves_safe_until_and_nothing_else() {
    for plane in planes_with("parked", true).await {
        let org = plane.org("org_k", None).await;
        let runner = plane.runner(4).await;
        let row = plane.running_with_idle(&org, &runner, true, 0).await;
        let root = plane.upload_home(&org, "parked\n");
        let saved = plane
            .commit_save(&row, &runner, &root, false)
            .await
            .expect("saved");
        let before = saved.to_api().save.expect("a save status");
        let unchanged = |root: &str, at: i64| api::runners::SaveReport {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            outcome: "unchanged".to_owned(),
            root: Some(root.to_owned()),
            captured_at_ms: Some(at),
            bytes_pending: None,
            error: None,
            snapshot_ms: None,
            uploaded_bytes: Some(0),
            securing: false,
        };
        let later = saved.home.saved_at_ms.expect("saved") + 60_000;
        let parked =
            server::control::saves::report_save(&plane.state, &row.id, &unchanged(&root, later))
                .await
                .expect("taken");
        let after = parked.to_api().save.expect("a save status");
        assert_eq!(after.last_completed_at, before.last_completed_at);
        assert_eq!(after.root, before.root);
        // Recorded as found (never later than the server's clock).
        assert!(after.last_unchanged_at.is_some(), "{after:?}");
        assert!(
            after.last_unchanged_at >= before.last_completed_at,
            "{after:?}"
        );
        assert_eq!(after.safe_until, after.last_unchanged_at);
        let other = plane.upload_home(&org, "not the last save\n");
        let refused =
            server::control::saves::report_save(&plane.state, &row.id, &unchanged(&other, later))
                .await;
        assert_eq!(code(refused), ErrorCode::InvalidState);
    }
}

/// The kept counts (`records::counts`) as `roost admin counts` checks them:
/// no drift, or the test fails naming what drifted.
async fn assert_no_drift(plane: &Plane, step: &str) {
    let (scopes, drift) = server::records::counts::drift(&plane.state.db.pool)
        .await
        .expect("the counts check runs");
    assert!(
        drift.is_empty(),
        "{} after {step}: {drift:?}",
        plane.engine()
    );
    assert!(scopes > 0, "{step}: nothing compared");
}

#[tokio::test]
async fn kept_counts_follow_every_change_and_the_check_finds_no_drift() {
    for plane in planes("counts").await {
        let org = plane.org("org_c", Some(100)).await;
        let small = plane.runner(2).await;
        let big = plane.runner(50).await;
        assert_no_drift(&plane, "registering").await;
        // Creates at once, across the two runners.
        let plane = std::sync::Arc::new(plane);
        let mut creates = Vec::new();
        for _ in 0..8 {
            let (plane, org) = (plane.clone(), org.clone());
            creates.push(tokio::spawn(async move { plane.create(&org).await }));
        }
        let mut rows = Vec::new();
        for create in creates {
            rows.push(create.await.expect("joined").expect("admitted"));
        }
        assert_no_drift(&plane, "creates").await;
        let on_small: Vec<&SandboxRow> = rows
            .iter()
            .filter(|r| r.runner_id.as_deref() == Some(&small))
            .collect();
        assert!(on_small.len() <= 2, "the small runner was overfilled");
        // Running, then stopped, started again, deleted.
        let running = plane
            .report(
                &rows[0],
                rows[0].runner_id.as_deref().expect("placed"),
                SandboxState::Running,
            )
            .await
            .expect("reported running");
        assert_no_drift(&plane, "a report").await;
        plane
            .change(&org, &running.id, "stop")
            .await
            .expect("stopped");
        assert_no_drift(&plane, "a stop").await;
        let runner = running.runner_id.clone().expect("placed");
        let stopping = plane.load(&running.id).await;
        plane
            .report(&stopping, &runner, SandboxState::Stopped)
            .await
            .expect("reported stopped");
        assert_no_drift(&plane, "stopped").await;
        plane
            .change(&org, &running.id, "start")
            .await
            .expect("started");
        assert_no_drift(&plane, "a start").await;
        plane
            .change(&org, &rows[1].id, "delete")
            .await
            .expect("deleted");
        assert_no_drift(&plane, "a delete").await;
        // A lost runner: its sandboxes fail and release its capacity.
        plane.lose(&small).await;
        assert_no_drift(&plane, "a lost runner").await;
        let usage: Option<(i64,)> =
            sqlx::query_as("SELECT sandboxes FROM runner_usage WHERE runner_id = $1")
                .bind(&small)
                .fetch_optional(&plane.state.db.pool)
                .await
                .expect("usage");
        assert!(usage.is_none_or(|(n,)| n == 0), "{usage:?}");
        // TTL and retention passes.
        server::reconcile::pass(&plane.state, true)
            .await
            .expect("a pass");
        assert_no_drift(&plane, "a reconcile pass").await;
        let _ = big;
        // The check does find drift: a count changed behind its back.
        sqlx::query("UPDATE sandbox_counts SET running = running + 1 WHERE scope = 'fleet' AND slot = (SELECT MIN(slot) FROM sandbox_counts WHERE scope = 'fleet')")
            .execute(&plane.state.db.pool)
            .await
            .expect("tampered");
        let (_, drift) = server::records::counts::drift(&plane.state.db.pool)
            .await
            .expect("the check runs");
        assert_eq!(drift.len(), 1, "{drift:?}");
        assert_eq!(
            (drift[0].scope.as_str(), drift[0].count.as_str()),
            ("fleet", "running")
        );
    }
}

#[tokio::test]
async fn admission_and_placement_read_the_kept_counts_not_the_sandboxes() {
    for plane in planes("counts_read").await {
        let org = plane.org("org_k", Some(2)).await;
        let runner = plane.runner(2).await;
        plane.create(&org).await.expect("admitted");
        // Said full by the kept rows alone: refused, though one sandbox
        // exists; and a runner said full takes nothing.
        sqlx::query("INSERT INTO sandbox_counts (scope, slot, running, held) VALUES ('org:org_k', 99, 1, 0)")
            .execute(&plane.state.db.pool)
            .await
            .expect("a count row");
        assert_eq!(code(plane.create(&org).await), ErrorCode::QuotaExceeded);
        sqlx::query("DELETE FROM sandbox_counts WHERE slot = 99")
            .execute(&plane.state.db.pool)
            .await
            .expect("removed");
        sqlx::query("UPDATE runner_usage SET sandboxes = sandboxes + 1 WHERE runner_id = $1")
            .bind(&runner)
            .execute(&plane.state.db.pool)
            .await
            .expect("usage");
        let waiting = plane.create(&org).await.expect("admitted");
        assert_eq!(waiting.state, SandboxState::Pending, "{}", plane.engine());
        assert_eq!(waiting.state_reason.as_deref(), Some("no_capacity"));
    }
}

#[tokio::test]
async fn every_pass_reads_only_what_is_due_through_an_index() {
    // SQLite's plans (PostgreSQL picks by table statistics): no pass's
    // read of what is due scans a whole table.
    let plane = planes("due").await.remove(0);
    for (pass, sql, index) in server::reconcile::due_queries() {
        let plan: Vec<(i64, i64, i64, String)> =
            sqlx::query_as(&format!("EXPLAIN QUERY PLAN {sql}"))
                .bind(0_i64)
                .bind(0_i64)
                .fetch_all(&plane.state.db.pool)
                .await
                .unwrap_or_else(|err| panic!("{pass}: {err}"));
        let steps: Vec<&str> = plan.iter().map(|(_, _, _, step)| step.as_str()).collect();
        assert!(
            steps.iter().all(|step| !step.starts_with("SCAN")),
            "the {pass} pass scans: {steps:?}"
        );
        assert!(
            steps
                .iter()
                .any(|step| step.contains(&format!("INDEX {index} "))),
            "the {pass} pass does not use {index}: {steps:?}"
        );
    }
}

/// Audit finding (HTTP surface): a token not shaped as the server makes
/// them is refused before any query, even one whose hash a row holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_token_is_refused_without_a_lookup() {
    use server::auth;
    for plane in planes("malformed").await {
        let db = &plane.state.db;
        let org = plane.org("org_m", None).await;
        let made_up = "not-a-roost-token";
        auth::store_token(db, made_up, "org", Some(&org))
            .await
            .expect("stored");
        assert_eq!(
            auth::authenticate(db, made_up).await.expect("read"),
            None,
            "{}: a malformed token was looked up",
            plane.engine()
        );
    }
}

#[tokio::test]
async fn a_verified_token_costs_no_query_until_its_cache_entry_ages_out() {
    use server::auth::{self, Principal};
    for plane in planes("tokens").await {
        let db = &plane.state.db;
        let org = plane.org("org_t", None).await;
        let token = auth::new_token("org").expect("a token");
        // Unknown tokens are not remembered: a token made afterwards (on
        // any server) works at once.
        assert_eq!(auth::authenticate(db, &token).await.expect("read"), None);
        auth::store_token(db, &token, "org", Some(&org))
            .await
            .expect("stored");
        let principal = Principal::Org {
            org_id: org.clone(),
        };
        assert_eq!(
            auth::authenticate(db, &token).await.expect("read"),
            Some(principal.clone())
        );
        // Removed from the records behind this server's back (as another
        // server would): still trusted from the cache, for at most the TTL.
        sqlx::query("DELETE FROM tokens WHERE hash = $1")
            .bind(auth::hash_token(&token))
            .execute(&db.pool)
            .await
            .expect("deleted");
        assert_eq!(
            auth::authenticate(db, &token).await.expect("cached"),
            Some(principal.clone()),
            "{}: the cache answered without the database",
            plane.engine()
        );
        let deadline = std::time::Instant::now() + auth::TOKEN_CACHE_TTL * 3;
        loop {
            if auth::authenticate(db, &token)
                .await
                .expect("read")
                .is_none()
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "a removed token was still trusted after {:?}",
                auth::TOKEN_CACHE_TTL * 3
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        // On the server that removes one: at once.
        let second = auth::new_token("org").expect("a token");
        auth::store_token(db, &second, "org", Some(&org))
            .await
            .expect("stored");
        assert!(
            auth::authenticate(db, &second)
                .await
                .expect("read")
                .is_some()
        );
        sqlx::query("DELETE FROM tokens WHERE hash = $1")
            .bind(auth::hash_token(&second))
            .execute(&db.pool)
            .await
            .expect("deleted");
        db.tokens.forget(&auth::hash_token(&second));
        assert_eq!(auth::authenticate(db, &second).await.expect("read"), None);
    }
}

#[tokio::test]
async fn one_lost_runner_among_hundreds_is_the_only_one_declared_lost() {
    for plane in planes("many_runners").await {
        let mut runners = Vec::new();
        for _ in 0..300 {
            runners.push(plane.runner(4).await);
        }
        plane.lose(&runners[150]).await;
        let lost: Vec<(String,)> = sqlx::query_as("SELECT id FROM runners WHERE state <> 'live'")
            .fetch_all(&plane.state.db.pool)
            .await
            .expect("runners");
        assert_eq!(lost, vec![(runners[150].clone(),)], "{}", plane.engine());
    }
}

#[tokio::test]
async fn a_burst_of_runners_registering_at_once_all_get_in() {
    for plane in planes("burst").await {
        let plane = std::sync::Arc::new(plane);
        let mut registering = Vec::new();
        for _ in 0..200 {
            let plane = plane.clone();
            registering.push(tokio::spawn(async move { plane.runner(4).await }));
        }
        let mut ids = Vec::new();
        for task in registering {
            ids.push(task.await.expect("registered"));
        }
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 200, "{}", plane.engine());
        // And they take work at once: a create lands on one of them.
        let org = plane.org("org_b", None).await;
        let placed = plane.create(&org).await.expect("admitted");
        assert!(ids.contains(placed.runner_id.as_ref().expect("placed")));
        assert_no_drift(&plane, "a burst").await;
    }
}

/// Issue 16, "a start asked while a stop is under way": the runner may be
/// acting on the stop already, so the start does not flip `desired` (a
/// command sent right after it would reach a runner stopping the sandbox
/// and end `unknown`): the stop goes on, the command waits, and once the
/// stop is done the sandbox starts and the command runs, once. A stop
/// asked after such a start is the last word.
#[tokio::test]
async fn a_start_during_a_stop_waits_for_it_and_a_command_after_it_runs_once() {
    for plane in planes_with("startafterstop", true).await {
        let org = plane.org("org_s", None).await;
        let runner = plane.runner(4).await;
        for durable in [false, true] {
            let row = plane.running_with_idle(&org, &runner, durable, 0).await;
            let stopping = plane.change(&org, &row.id, "stop").await.expect("stop");
            assert_eq!(stopping.desired, DesiredState::Stopped);
            let started = plane.change(&org, &row.id, "start").await.expect("start");
            assert_eq!(
                started.desired,
                DesiredState::Stopped,
                "the stop goes on ({})",
                plane.engine()
            );
            assert!(started.start_after_stop);
            // Asked twice: the same answer, one event.
            plane.change(&org, &row.id, "start").await.expect("again");
            let asked = plane
                .event_messages(&row.id)
                .await
                .into_iter()
                .filter(|(_, reason, message)| {
                    reason.as_deref() == Some("start_requested")
                        && message
                            .as_deref()
                            .is_some_and(|m| m.contains("once the stop is done"))
                })
                .count();
            assert_eq!(asked, 1);
            let command = plane.command(&org, &row.id).await.expect("queued");
            assert!(command.waited_for_wake);
            assert!(!plane.handed(&runner).await.contains(&command.id));

            let stopped = plane.runner_stops(&org, &started, &runner).await;
            let again = plane.load(&stopped.id).await;
            assert_eq!(again.desired, DesiredState::Running);
            assert_eq!(again.state, SandboxState::Starting, "placed again");
            assert!(!again.start_after_stop);
            assert!(!plane.handed(&runner).await.contains(&command.id));
            plane
                .report(&again, &runner, SandboxState::Running)
                .await
                .expect("running");
            let handed = plane.handed(&runner).await;
            assert_eq!(
                handed.iter().filter(|id| **id == command.id).count(),
                1,
                "handed over once"
            );

            // A stop after the start: nothing starts once the stop is done.
            let report = CommandReport {
                runner_id: runner.clone(),
                epoch: plane.load(&row.id).await.epoch as u64,
                state: CommandState::Exited,
                reason: None,
                exit_code: Some(0),
                signal: None,
                pid: None,
                output: None,
            };
            runner_protocol::report_command(&plane.state, &command.id, &report)
                .await
                .expect("ended");
            let running = plane.load(&row.id).await;
            plane.change(&org, &row.id, "stop").await.expect("stop");
            plane.change(&org, &row.id, "start").await.expect("start");
            let last = plane.change(&org, &row.id, "stop").await.expect("stop");
            assert!(!last.start_after_stop);
            let stopped = plane.runner_stops(&org, &running, &runner).await;
            let after = plane.load(&stopped.id).await;
            assert_eq!(
                (after.state, after.desired),
                (SandboxState::Stopped, DesiredState::Stopped)
            );
        }
    }
}

#[tokio::test]
async fn a_command_that_ends_before_its_running_report_is_recorded_started_and_ended_at_once() {
    for plane in planes("ended_at_once").await {
        let org = plane.org("org_e", None).await;
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
        let queue = |argv: &str| {
            let plane = &plane;
            let org = org.clone();
            let id = row.id.clone();
            let argv = argv.to_owned();
            async move {
                let request = serde_json::from_value(serde_json::json!({ "argv": [argv] }))
                    .expect("a command request");
                let mut tx = plane.state.db.write().await.expect("tx");
                let queued = commands::create(&plane.state, &mut tx, &org, &id, &request)
                    .await
                    .expect("queued");
                tx.commit().await.expect("commit");
                queued
            }
        };
        let quick = queue("true").await;
        let missing = queue("nonexistent").await;
        let assignments = runner_protocol::read_assignments(&plane.state, &runner)
            .await
            .expect("assignments");
        assert_eq!(assignments.commands.len(), 2);
        let report = |state, exit_code, reason: Option<&str>, pid| CommandReport {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            state,
            reason: reason.map(str::to_owned),
            exit_code,
            signal: None,
            pid,
            output: None,
        };
        // Its end straight from `starting`, with its pid: it ran.
        let ended = runner_protocol::report_command(
            &plane.state,
            &quick.id,
            &report(CommandState::Exited, Some(0), None, Some(42)),
        )
        .await
        .expect("exited");
        assert_eq!(
            (ended.state, ended.exit_code, ended.pid),
            (CommandState::Exited, Some(0), Some(42)),
            "{}",
            plane.engine()
        );
        let (started, end) = (
            ended.started_at_ms.expect("recorded started"),
            ended.ended_at_ms.expect("recorded ended"),
        );
        assert!(ended.created_at_ms <= started && started <= end);
        // A command that never started ends without a start or a pid.
        let failed = runner_protocol::report_command(
            &plane.state,
            &missing.id,
            &report(
                CommandState::LaunchFailed,
                None,
                Some("executable_not_found"),
                None,
            ),
        )
        .await
        .expect("launch_failed");
        assert_eq!(failed.state, CommandState::LaunchFailed);
        assert_eq!((failed.started_at_ms, failed.pid), (None, None));
        // A pid with an end is a pid: zero or less is refused.
        let third = queue("true").await;
        runner_protocol::read_assignments(&plane.state, &runner)
            .await
            .expect("assignments");
        let refused = runner_protocol::report_command(
            &plane.state,
            &third.id,
            &report(CommandState::Exited, Some(0), None, Some(0)),
        )
        .await;
        assert_eq!(code(refused), ErrorCode::InvalidRequest);
    }
}

/// Issue 15 (the first output byte): an end straight from `starting` may
/// carry the command's whole output; one commit records it started,
/// written and ended, and a retried report stores nothing twice. Output
/// over the bound, or with a state that is not an end, is refused and
/// changes nothing.
#[tokio::test]
async fn an_end_report_carries_a_quick_commands_output_in_its_own_commit() {
    use api::runners::{REPORTED_OUTPUT_BYTES_MAX, ReportedOutput};
    for plane in planes("output_with_end").await {
        let org = plane.org("org_o", None).await;
        let runner = plane.runner(4).await;
        let row = plane.running_with_idle(&org, &runner, false, 3600).await;
        let echo = plane.command(&org, &row.id).await.expect("queued");
        assert_eq!(plane.handed(&runner).await, vec![echo.id.clone()]);
        let report = |state, output: Option<ReportedOutput>| CommandReport {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            state,
            reason: None,
            exit_code: Some(0).filter(|_| state == CommandState::Exited),
            signal: None,
            pid: Some(42),
            output,
        };
        let small = ReportedOutput {
            stdout: b"hello\n".to_vec(),
            stderr: b"\xffoops".to_vec(),
        };
        // Refused: too much, or with `running`; nothing stored.
        let mut big = small.clone();
        big.stdout = vec![b'x'; REPORTED_OUTPUT_BYTES_MAX + 1];
        for (state, output) in [
            (CommandState::Exited, big),
            (CommandState::Running, small.clone()),
        ] {
            let refused = runner_protocol::report_command(
                &plane.state,
                &echo.id,
                &report(state, Some(output)),
            )
            .await;
            assert_eq!(
                code(refused),
                ErrorCode::InvalidRequest,
                "{}",
                plane.engine()
            );
        }
        let before = plane.load_command(&echo.id).await;
        assert_eq!(
            (before.state, before.stdout_bytes, before.stderr_bytes),
            (CommandState::Starting, 0, 0)
        );
        // Taken, twice (a retry after a lost answer).
        for _ in 0..2 {
            let ended = runner_protocol::report_command(
                &plane.state,
                &echo.id,
                &report(CommandState::Exited, Some(small.clone())),
            )
            .await
            .expect("exited with its output");
            assert_eq!(
                (
                    ended.state,
                    ended.pid,
                    ended.stdout_bytes,
                    ended.stderr_bytes
                ),
                (CommandState::Exited, Some(42), 6, 5),
                "{}",
                plane.engine()
            );
            assert!(ended.started_at_ms.is_some());
        }
        for (stream, expected) in [
            (Stream::Stdout, &small.stdout),
            (Stream::Stderr, &small.stderr),
        ] {
            let stored = server::records::commands::read_output(
                &plane.state.db.pool,
                &echo.id,
                stream,
                0,
                1 << 20,
            )
            .await
            .expect("read");
            assert_eq!(&stored, expected, "{}", plane.engine());
        }
    }
}

/// Issue 21, point 1: migration 0016 fills the kept counts right on a
/// database that already holds sandboxes in many states (an upgrade from
/// a version before counts were kept). The counts are removed and 0016
/// applied again on a populated database; the check then finds them
/// exactly what the sandboxes say.
#[tokio::test]
async fn migration_0016_fills_the_kept_counts_from_a_populated_database() {
    for plane in planes("counts_backfill").await {
        let db = &plane.state.db;
        let first = plane.org("org_b1", Some(100)).await;
        let second = plane.org("org_b2", Some(100)).await;
        let runner = plane.runner(20).await;
        let lost = plane.runner(20).await;
        let mut rows = Vec::new();
        for org in [&first, &first, &first, &second, &second] {
            rows.push(plane.create(org).await.expect("admitted"));
        }
        // Running, stopped, deleted, on a lost runner, pending.
        for row in &rows[..3] {
            let on = row.runner_id.clone().expect("placed");
            plane
                .report(row, &on, SandboxState::Running)
                .await
                .expect("reported running");
        }
        plane
            .change(&first, &rows[1].id, "stop")
            .await
            .expect("stop");
        let stopping = plane.load(&rows[1].id).await;
        let on = stopping.runner_id.clone().expect("placed");
        plane
            .report(&stopping, &on, SandboxState::Stopped)
            .await
            .expect("reported stopped");
        plane
            .change(&second, &rows[3].id, "delete")
            .await
            .expect("delete");
        plane.lose(&lost).await;
        assert_no_drift(&plane, "the changes").await;
        let kept = |table: &'static str| async move {
            let query = match table {
                "sandbox_counts" => {
                    "SELECT scope, CAST(SUM(running) AS BIGINT), CAST(SUM(held) AS BIGINT) FROM sandbox_counts GROUP BY scope HAVING SUM(running) <> 0 OR SUM(held) <> 0 ORDER BY scope"
                }
                _ => {
                    "SELECT runner_id, sandboxes, memory_mib FROM runner_usage WHERE sandboxes <> 0 ORDER BY runner_id"
                }
            };
            sqlx::query_as::<_, (String, i64, i64)>(query)
                .fetch_all(&db.pool)
                .await
                .expect("counts read")
        };
        let (counts_before, usage_before) = (kept("sandbox_counts").await, kept("usage").await);
        assert!(
            counts_before.iter().any(|(_, running, _)| *running > 0),
            "{counts_before:?}"
        );
        assert!(!usage_before.is_empty(), "{usage_before:?}");
        let _ = runner;

        // As a database from before 0016: no counts, no due indexes.
        for statement in [
            "DROP TABLE sandbox_counts",
            "DROP TABLE runner_usage",
            "DROP INDEX IF EXISTS runners_by_lease",
            "DROP INDEX sandboxes_ttl_due",
            "DROP INDEX sandboxes_retention_due",
            "DROP INDEX sandboxes_homes_to_release",
            "DELETE FROM schema_migrations WHERE version = 16",
        ] {
            sqlx::query(statement)
                .execute(&db.pool)
                .await
                .unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
        db.migrate().await.expect("0016 applied again");
        assert_no_drift(&plane, "migration 0016 on a populated database").await;
        assert_eq!(
            kept("sandbox_counts").await,
            counts_before,
            "{}",
            plane.engine()
        );
        assert_eq!(kept("usage").await, usage_before, "{}", plane.engine());
    }
}

/// Issue 21: heartbeats arriving together are committed in groups (a
/// fleet's heartbeats cost a few commits, not one each), and each is still
/// answered only for its own runner: a live runner's lease is renewed
/// past what it was, a runner declared lost stays lost (fenced).
#[tokio::test]
async fn heartbeats_arriving_together_are_committed_in_groups() {
    use api::runners::HeartbeatRequest;
    use server::control::runner_protocol;
    for plane in planes("renewals").await {
        let plane = std::sync::Arc::new(plane);
        let mut live = Vec::new();
        for _ in 0..30 {
            live.push(plane.runner(1).await);
        }
        let lost = plane.runner(1).await;
        plane.lose(&lost).await;
        let leases = |plane: std::sync::Arc<Plane>| async move {
            sqlx::query_as::<_, (String, i64)>("SELECT runner_id, expires_at_ms FROM runner_leases")
                .fetch_all(&plane.state.db.pool)
                .await
                .expect("leases")
                .into_iter()
                .collect::<BTreeMap<String, i64>>()
        };
        let before = leases(plane.clone()).await;
        assert_eq!(before.len(), live.len());
        // Past every lease written at registration.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let batches_before = plane.state.renewals.batches();
        let mut heartbeats = Vec::new();
        for round in 0..4 {
            for runner in live.iter().chain([&lost]) {
                let (plane, request) = (
                    plane.clone(),
                    HeartbeatRequest {
                        runner_id: runner.clone(),
                    },
                );
                heartbeats.push((
                    runner.clone(),
                    round,
                    tokio::spawn(async move {
                        runner_protocol::heartbeat(&plane.state, &request).await
                    }),
                ));
            }
        }
        let sent = heartbeats.len() as u64;
        for (runner, round, heartbeat) in heartbeats {
            let answer = heartbeat.await.expect("joined");
            if runner == lost {
                let refused = answer.expect_err("a lost runner's heartbeat");
                assert_eq!(refused.code, api::ErrorCode::Fenced, "round {round}");
            } else {
                answer.unwrap_or_else(|e| panic!("{runner}, round {round}: {e:?}"));
            }
        }
        let batches = plane.state.renewals.batches() - batches_before;
        assert!(
            batches <= sent / 4,
            "{}: {sent} heartbeats took {batches} commits",
            plane.engine()
        );
        let after = leases(plane.clone()).await;
        for runner in &live {
            assert!(after[runner] > before[runner], "{runner}: not renewed");
        }
        assert!(!after.contains_key(&lost), "a lost runner came back live");
    }
}

/// A command sent to a durable sandbox while its runner is being drained:
/// the runner is told to stop the sandbox (it moves), so the command is
/// not handed to it (CI's convergence test met it handed over, never
/// launched, and ended `unknown`); it waits through the move and is
/// handed to the runner the sandbox runs on next. A standard sandbox on
/// the same runner keeps running there, and its commands are handed over
/// as before.
#[tokio::test]
async fn a_draining_runner_is_handed_no_command_of_a_durable_sandbox_it_must_move() {
    for plane in planes_with("draincmd", true).await {
        let org = plane.org("org_d", None).await;
        let runner = plane.runner(4).await;
        let durable = plane.running_with_idle(&org, &runner, true, 3600).await;
        let standard = plane.running_with_idle(&org, &runner, false, 3600).await;
        server::control::drain::set_drain(&plane.state, &runner, Some("drain"))
            .await
            .expect("drained");
        let moving = plane.command(&org, &durable.id).await.expect("a command");
        let staying = plane.command(&org, &standard.id).await.expect("a command");
        let handed = plane.handed(&runner).await;
        assert_eq!(handed, vec![staying.id.clone()], "{}", plane.engine());
        assert_eq!(
            plane.load_command(&moving.id).await.state,
            CommandState::Queued,
            "{}",
            plane.engine()
        );
        let moved = plane.runner_stops(&org, &durable, &runner).await;
        assert_eq!(moved.state, SandboxState::Pending, "{}", plane.engine());
        assert_eq!(
            plane.load_command(&moving.id).await.state,
            CommandState::Queued,
            "{}: the command waits through the move",
            plane.engine()
        );
        let other = plane.runner(4).await;
        server::reconcile::schedule_pending(&plane.state)
            .await
            .expect("scheduled");
        let placed = plane.load(&durable.id).await;
        assert_eq!(placed.runner_id.as_deref(), Some(other.as_str()));
        plane
            .report(&placed, &other, SandboxState::Running)
            .await
            .expect("running");
        assert_eq!(
            plane.handed(&other).await,
            vec![moving.id.clone()],
            "{}",
            plane.engine()
        );
    }
}

/// A sandbox's or a command's row by id, read through sqlx's pool.
async fn row_through_sqlx(plane: &Plane, table: &str, id: &str) -> sqlx::any::AnyRow {
    let columns = match table {
        "sandboxes" => server::records::SANDBOX_COLUMNS,
        _ => server::records::COMMAND_COLUMNS,
    };
    sqlx::query(&format!("SELECT {columns} FROM {table} WHERE id = $1"))
        .bind(id)
        .fetch_one(&plane.state.db.pool)
        .await
        .expect("the row through sqlx")
}

/// On SQLite, a sandbox and a command are read on the request's own thread
/// (`db::SqliteReads`): it answers what sqlx reads of the same row, every
/// field, and sees each commit at once (a long-poll re-reads right after
/// the commit that woke it). PostgreSQL reads through its pool.
#[tokio::test]
async fn reads_on_sqlites_direct_path_are_the_records_as_committed() {
    for plane in planes("direct_reads").await {
        let db = &plane.state.db;
        let org = plane.org("org_d", None).await;
        let runner = plane.runner(4).await;
        let created = plane.create(&org).await.expect("admitted");
        let since = plane.state.retained_since_ms();
        let before = db.sqlite_reads.as_ref().map(|reads| reads.counts());

        let read = server::records::sandboxes::visible(db, &org, &created.id, since)
            .await
            .expect("a read")
            .expect("the sandbox");
        let through_sqlx = row_through_sqlx(&plane, "sandboxes", &created.id).await;
        let through_sqlx = SandboxRow::from_row(&through_sqlx).expect("decoded");
        assert_eq!(
            format!("{read:?}"),
            format!("{through_sqlx:?}"),
            "{}",
            plane.engine()
        );

        // A commit is seen by the next read.
        let running = plane
            .report(&created, &runner, SandboxState::Running)
            .await
            .expect("running");
        let read = server::records::sandboxes::visible(db, &org, &created.id, since)
            .await
            .expect("a read")
            .expect("the sandbox");
        assert_eq!(read.state, SandboxState::Running);
        assert_eq!(read.updated_at_ms, running.updated_at_ms);
        // A command (an exec's long-poll reads it again and again).
        let command = plane.command(&org, &created.id).await.expect("a command");
        let read = server::records::commands::visible(db, &org, &created.id, &command.id)
            .await
            .expect("a read")
            .expect("the command");
        let through_sqlx = row_through_sqlx(&plane, "commands", &command.id).await;
        let through_sqlx = server::records::CommandRow::from_row(&through_sqlx).expect("decoded");
        assert_eq!(format!("{read:?}"), format!("{through_sqlx:?}"));
        let elsewhere =
            server::records::commands::visible(db, "org_other", &created.id, &command.id)
                .await
                .expect("a read");
        assert!(elsewhere.is_none(), "{elsewhere:?}");
        // Another org's, or no such sandbox: none, on either path.
        for (org, id) in [("org_other", created.id.as_str()), (org.as_str(), "sbx_0")] {
            let none = server::records::sandboxes::visible(db, org, id, since)
                .await
                .expect("a read");
            assert!(none.is_none(), "{org} {id}: {none:?}");
        }

        match (&db.sqlite_reads, before) {
            (Some(reads), Some((answered, declined))) => {
                assert_eq!(
                    reads.counts(),
                    (answered + 6, declined),
                    "every read answered on the direct path"
                );
            }
            (None, None) => assert_eq!(plane.engine(), "postgres"),
            (reads, _) => panic!(
                "{}: direct reads {}",
                plane.engine(),
                if reads.is_some() { "on" } else { "off" }
            ),
        }
        // A row the direct reader cannot decode is declined to sqlx, whose
        // answer stands (here an error naming the column).
        if let Some(reads) = &db.sqlite_reads {
            sqlx::query("UPDATE sandboxes SET epoch = 'not a number' WHERE id = $1")
                .bind(&created.id)
                .execute(&db.pool)
                .await
                .expect("a corrupt row");
            let (answered, declined) = reads.counts();
            let read = server::records::sandboxes::visible(db, &org, &created.id, since).await;
            assert!(
                read.as_ref()
                    .is_err_and(|err| err.to_string().contains("epoch")),
                "{read:?}"
            );
            assert_eq!(reads.counts(), (answered, declined + 1));
        }
    }
}

/// Creates wait in line for a row every create locks (`WriteTx::take_turn`):
/// on PostgreSQL a turn is held until its transaction ends, the next in
/// line gets it first, and a transaction not allowed to wait (it may hold
/// locks) never does. SQLite has one writer: no line.
#[tokio::test]
async fn creates_wait_in_line_for_a_contended_row_first_come_first_served() {
    use std::time::Duration;
    let pending = Duration::from_millis(200);
    let deadline = Duration::from_secs(30);
    for plane in planes("turns").await {
        let db = &plane.state.db;
        if plane.engine().starts_with("sqlite") {
            let mut tx = db.write().await.expect("tx");
            tx.allow_turn();
            tokio::time::timeout(deadline, tx.take_turn("admission"))
                .await
                .expect("no line on SQLite");
            tx.commit().await.expect("commit");
            continue;
        }
        let mut first = db.write().await.expect("tx");
        first.allow_turn();
        first.take_turn("runner:r1").await;

        let mut second = db.write().await.expect("tx");
        second.allow_turn();
        let mut third = db.write().await.expect("tx");
        third.allow_turn();
        {
            let second_turn = second.take_turn("runner:r1");
            let third_turn = third.take_turn("runner:r1");
            tokio::pin!(second_turn, third_turn);
            // Both wait while the first holds the turn, in arrival order.
            assert!(
                tokio::time::timeout(pending, &mut second_turn)
                    .await
                    .is_err()
            );
            assert!(
                tokio::time::timeout(pending, &mut third_turn)
                    .await
                    .is_err()
            );

            // A transaction not allowed in line goes straight on.
            let mut unqueued = db.write().await.expect("tx");
            tokio::time::timeout(deadline, unqueued.take_turn("runner:r1"))
                .await
                .expect("not in line");
            unqueued.commit().await.expect("commit");

            // The first ends: the second (not the third) has the turn.
            first.commit().await.expect("commit");
            tokio::time::timeout(deadline, &mut second_turn)
                .await
                .expect("the second's turn once the first committed");
            assert!(
                tokio::time::timeout(pending, &mut third_turn)
                    .await
                    .is_err()
            );
        }
        // The second rolls back (dropped): the third's turn.
        drop(second);
        tokio::time::timeout(deadline, third.take_turn("runner:r1"))
            .await
            .expect("the third's turn once the second rolled back");
        third.commit().await.expect("commit");
    }
}

/// The hottest read, a sandbox by id, answers each caller as its own
/// query would, however many ask at once: on PostgreSQL the reads waiting
/// together go in one query (`db::GatheredReads`), and what that query no
/// longer asks (the org, the retention) is checked for each caller.
#[tokio::test]
async fn sandbox_reads_asked_together_answer_each_caller_as_alone() {
    for plane in planes("gathered").await {
        let engine = plane.engine().to_owned();
        let (a, b) = (
            plane.org("org_a", None).await,
            plane.org("org_b", None).await,
        );
        plane.runner(100).await;
        let mut ours = Vec::new();
        for _ in 0..5 {
            ours.push(plane.create(&a).await.expect("created").id);
        }
        let theirs = plane.create(&b).await.expect("created").id;
        let ended = plane.create(&a).await.expect("created").id;
        sqlx::query("UPDATE sandboxes SET ended_at_ms = 1000 WHERE id = $1")
            .bind(&ended)
            .execute(&plane.state.db.pool)
            .await
            .expect("ended");
        // (org, id, retained since, found)
        let mut asks: Vec<(&str, &str, i64, bool)> = Vec::new();
        for id in &ours {
            asks.push((&a, id, 0, true));
            asks.push((&b, id, 0, false));
        }
        asks.extend([
            (a.as_str(), theirs.as_str(), 0, false),
            (&b, &theirs, 0, true),
            (&a, &ended, 999, true),
            (&a, &ended, 1000, false),
            (&b, &ended, 0, false),
            (&a, "sb_none", 0, false),
            (&a, &ours[0], 0, true),
        ]);
        let before = plane
            .state
            .db
            .sandbox_reads
            .as_ref()
            .map(|reads| reads.counts());
        // Polled together on this one thread: every read is queued before
        // a gatherer runs.
        let answers = futures::future::join_all(asks.iter().map(|&(org, id, since, _)| {
            server::records::sandboxes::visible(&plane.state.db, org, id, since)
        }))
        .await;
        for (&(org, id, since, found), answer) in asks.iter().zip(answers) {
            let answer = answer.expect("the read answers");
            assert_eq!(
                answer
                    .as_ref()
                    .map(|row| (row.id.as_str(), row.org_id.as_str())),
                found.then_some((id, org)),
                "{engine}: {org} reads {id}, retained since {since}"
            );
        }
        match (&plane.state.db.sandbox_reads, before) {
            (Some(reads), Some((answered, queries))) => {
                let (answered_now, queries_now) = reads.counts();
                assert_eq!(
                    answered_now - answered,
                    asks.len() as u64,
                    "{engine}: all gathered"
                );
                assert_eq!(queries_now - queries, 1, "{engine}: in one query");
            }
            _ => assert!(engine.starts_with("sqlite"), "{engine} gathers its reads"),
        }
    }
}

/// A value PostgreSQL cannot hold in text (a NUL byte) that reaches a
/// query is the caller's error, 400 `invalid_request`, not a 500: what
/// the URL check and the bodies' validation do not catch still ends so.
#[tokio::test]
async fn a_nul_byte_postgres_refuses_is_an_invalid_request() {
    let Ok(base) = std::env::var("ROOST_TEST_POSTGRES_URL") else {
        return;
    };
    let url = postgres_database(&base, "nul_text").await;
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    let refused = sqlx::query("SELECT $1::text")
        .bind("a\u{0}b")
        .fetch_one(&pool)
        .await
        .expect_err("PostgreSQL refuses NUL in text");
    let error = server::control::ControlError::from(refused);
    assert_eq!(error.code, ErrorCode::InvalidRequest, "{}", error.message);
}

/// Audit finding: runner text cut with `String::truncate(1024)` panicked
/// when byte 1024 fell inside a character (1,023 ASCII bytes, then "é"),
/// in a sandbox's report, a save's report (after the store pointer was
/// moved) and a failed snapshot's report. Each is kept, cut at the
/// character before.
#[tokio::test]
async fn runner_text_cut_inside_a_character_is_kept_without_a_panic() {
    let text = format!("{}é", "a".repeat(1023));
    let kept = "a".repeat(1023);
    for plane in planes_with("runnertext", true).await {
        let org = plane.org("org_t", None).await;
        let runner = plane.runner(4).await;
        let row = plane.create_durable(&org).await;
        let report = SandboxReport {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            state: SandboxState::Running,
            reason: None,
            message: Some(text.clone()),
            wake: None,
        };
        let running = runner_protocol::report_sandbox(&plane.state, &row.id, &report)
            .await
            .expect("the report is taken");
        assert_eq!(running.state, SandboxState::Running);

        let root = plane.upload_home(&org, "saved\n");
        for outcome in ["failed", "completed"] {
            let report = api::runners::SaveReport {
                runner_id: runner.clone(),
                epoch: row.epoch as u64,
                outcome: outcome.to_owned(),
                root: (outcome == "completed").then(|| root.clone()),
                captured_at_ms: Some(server::db::now_ms()),
                bytes_pending: None,
                error: Some(text.clone()),
                snapshot_ms: None,
                uploaded_bytes: Some(1),
                securing: false,
            };
            let saved = server::control::saves::report_save(&plane.state, &row.id, &report)
                .await
                .unwrap_or_else(|err| panic!("the {outcome} save is taken: {err:?}"));
            let save = saved.to_api().save.expect("a save status");
            if outcome == "failed" {
                assert_eq!(save.last_error.as_deref(), Some(kept.as_str()));
            } else {
                assert_eq!(save.root.as_deref(), Some(root.as_str()), "{save:?}");
            }
        }

        let mut tx = plane.state.db.write().await.expect("tx");
        let taken = server::control::snapshots::create(
            &plane.state,
            &mut tx,
            &org,
            &row.id,
            &Default::default(),
        )
        .await
        .expect("a snapshot");
        tx.commit().await.expect("commit");
        let failed = report_snapshot(&plane, &taken.id, &runner, row.epoch as u64, Err(&text))
            .await
            .expect("the failure is taken")
            .to_api();
        assert_eq!(failed.reason, Some(format!("runner_error: {kept}")));
    }
}

/// Audit finding: a runner that once held a sandbox could report copies
/// c0…cN without end, each rewriting the record's list of them under the
/// write lock (quadratic). New copies past the bounds, per runner and per
/// sandbox, are refused `quota_exceeded`; a copy already recorded is still
/// answered, and room made by a discard is room again.
#[tokio::test]
async fn kept_copies_of_a_sandbox_are_bounded_per_runner_and_in_all() {
    use server::control::kept::{KEPT_COPIES_PER_RUNNER_MAX, KEPT_COPIES_PER_SANDBOX_MAX};
    for plane in planes_with("keptbound", true).await {
        let org = plane.org("org_b", None).await;
        let runner = plane.runner(4).await;
        let row = plane.create_durable(&org).await;
        plane
            .report(&row, &runner, SandboxState::Running)
            .await
            .expect("running");
        plane.lose(&runner).await;
        let runner = plane.register(Some(&runner), 0).await;
        let report = |name: &str| api::runners::KeptCopyReport {
            runner_id: runner.clone(),
            sandbox_id: row.id.clone(),
            name: name.to_owned(),
            bytes: 1,
            kept_at_ms: server::db::now_ms(),
            secured_root: None,
        };
        let mut first = None;
        for i in 0..KEPT_COPIES_PER_RUNNER_MAX {
            let answer = plane.keep(&runner, &row.id, &format!("k{i}"), None).await;
            assert!(answer.keep, "{answer:?}");
            first.get_or_insert(answer);
        }
        let refused = server::control::kept::report(&plane.state, &report("k-past")).await;
        let refused = refused.expect_err("one copy past the bound");
        assert_eq!(refused.code, ErrorCode::QuotaExceeded, "{}", plane.engine());
        assert_eq!(refused.details["quota"]["metric"], "kept_copies_per_runner");
        let record = plane.load(&row.id).await.to_api();
        assert_eq!(record.kept_copies.len() as i64, KEPT_COPIES_PER_RUNNER_MAX);
        // A copy already recorded is answered as before.
        let first = first.expect("a first copy");
        assert_eq!(plane.keep(&runner, &row.id, "k0", None).await, first);
        // Discarded, it makes room.
        let copy_id = first.copy_id.clone().expect("a copy id");
        plane
            .discard(&org, &row.id, &copy_id)
            .await
            .expect("discarded");
        assert!(plane.keep(&runner, &row.id, "k-past", None).await.keep);

        // Copies on other runners count toward the sandbox's bound: with
        // room on this runner (one discarded), none for the sandbox.
        let discard_one = plane.load(&row.id).await.to_api().kept_copies[0].id.clone();
        plane
            .discard(&org, &row.id, &discard_one)
            .await
            .expect("discarded");
        let others = KEPT_COPIES_PER_SANDBOX_MAX - (KEPT_COPIES_PER_RUNNER_MAX - 1);
        for i in 0..others {
            sqlx::query(
                "INSERT INTO kept_copies (id, sandbox_id, org_id, runner_id, name, bytes, kept_at_ms, reason, state, ended_reason)
                 VALUES ($1, $2, $3, $4, 'k', 1, $5, 'unsaved_writes', 'kept', NULL)",
            )
            .bind(format!("kpt_other{i}"))
            .bind(&row.id)
            .bind(&org)
            .bind(format!("run_other{i}"))
            .bind(server::db::now_ms())
            .execute(&plane.state.db.pool)
            .await
            .expect("a copy on another runner");
        }
        let refused = server::control::kept::report(&plane.state, &report("k-other")).await;
        let refused = refused.expect_err("room on the runner, none for the sandbox");
        assert_eq!(refused.code, ErrorCode::QuotaExceeded);
        assert_eq!(
            refused.details["quota"]["metric"],
            "kept_copies_per_sandbox"
        );
    }
}

/// Signals asked between two of a runner's polls are each handed over
/// (numbered, oldest first), not only the last; a command keeps only the
/// latest `SIGNALS_KEPT`, so an org asking without end stores no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_signal_asked_between_polls_is_assigned_and_only_the_latest_are_kept() {
    for plane in planes("signal_queue").await {
        let org = plane.org("org_s", None).await;
        let runner = plane.runner(4).await;
        let row = plane.running(&org, &runner).await;
        let command_id = plane.running_command(&org, &row, &runner).await;
        let names = ["INT", "HUP", "USR1", "USR2", "QUIT", "TERM"];
        let kept = api::commands::SIGNALS_KEPT as usize;
        let asked = kept + 4;
        for n in 0..asked {
            let mut tx = plane.state.db.write().await.expect("tx");
            let current = server::records::commands::load(&mut tx, &command_id)
                .await
                .expect("read")
                .expect("the command");
            commands::signal(&mut tx, &current, names[n % names.len()])
                .await
                .expect("signalled");
            tx.commit().await.expect("commit");
        }
        let assigned = runner_protocol::read_assignments(&plane.state, &runner)
            .await
            .expect("assignments");
        let command = &assigned.commands[0];
        let got: Vec<(u64, &str)> = command
            .signals
            .iter()
            .map(|s| (s.seq, s.signal.as_str()))
            .collect();
        let expected: Vec<(u64, &str)> = (asked - kept..asked)
            .map(|n| (n as u64 + 1, names[n % names.len()]))
            .collect();
        assert_eq!(got, expected, "{}", plane.engine());
        assert_eq!(command.signal_seq, asked as u64, "{}", plane.engine());
        let stored: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM command_signals")
            .fetch_one(&plane.state.db.pool)
            .await
            .expect("count");
        assert_eq!(stored, kept as i64, "{}", plane.engine());
    }
}

/// An org's commands together keep at most `org_output_bytes_max` of
/// output in the records every org shares: past it, what does not fit is
/// not stored (the stream marked truncated) and the runner hears 429
/// `quota_exceeded` naming `output_bytes`; other orgs are untouched; a
/// purged sandbox's commands give theirs back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orgs_stored_output_is_bounded_and_given_back_when_its_sandbox_is_purged() {
    for plane in planes_configured("output_quota", false, |config| {
        config.org_output_bytes_max = 100;
    })
    .await
    {
        let runner = plane.runner(8).await;
        let at = |row: &SandboxRow, offset| runner_protocol::OutputAt {
            runner_id: runner.clone(),
            epoch: row.epoch as u64,
            offset,
        };
        let org = plane.org("org_out", None).await;
        let row = plane.running(&org, &runner).await;
        let first = plane.running_command(&org, &row, &runner).await;
        let second = plane.running_command(&org, &row, &runner).await;
        let sixty = [b'y'; 60];
        runner_protocol::append_output(&plane.state, &first, Stream::Stdout, &at(&row, 0), &sixty)
            .await
            .expect("60 of 100");
        let past = runner_protocol::append_output(
            &plane.state,
            &second,
            Stream::Stdout,
            &at(&row, 0),
            &sixty,
        )
        .await;
        let Err(err) = past else {
            panic!("{}: 120 bytes of 100 stored", plane.engine());
        };
        assert_eq!(err.code, ErrorCode::QuotaExceeded, "{}", plane.engine());
        assert_eq!(
            err.details["quota"]["metric"],
            "output_bytes",
            "{}: {:?}",
            plane.engine(),
            err.details
        );
        let cut = plane.load_command(&second).await;
        assert_eq!(
            cut.stdout_bytes,
            40,
            "{}: what fits is stored",
            plane.engine()
        );
        assert!(cut.stdout_truncated, "{}", plane.engine());
        let usage = server::records::orgs::usage(&plane.state.db.pool)
            .await
            .expect("usage");
        let ours = usage.iter().find(|o| o.org_id == org).expect("the org");
        assert_eq!(ours.output_bytes, 100, "{}", plane.engine());

        // Another org stores its own.
        let other = plane.org("org_other", None).await;
        let other_row = plane.running(&other, &runner).await;
        let theirs = plane.running_command(&other, &other_row, &runner).await;
        runner_protocol::append_output(
            &plane.state,
            &theirs,
            Stream::Stdout,
            &at(&other_row, 0),
            &sixty,
        )
        .await
        .expect("another org's output is its own");

        // The org's sandbox deleted, then purged: its output is given back.
        let deleting = plane.change(&org, &row.id, "delete").await.expect("delete");
        plane
            .report(&deleting, &runner, SandboxState::Deleted)
            .await
            .expect("deleted");
        let mut tx = plane.state.db.write().await.expect("tx");
        server::records::sandboxes::purge_deleted(&mut tx, i64::MAX)
            .await
            .expect("purged");
        assert_eq!(
            server::records::counts::output_bytes(&mut tx, &org)
                .await
                .expect("count"),
            0,
            "{}",
            plane.engine()
        );
        tx.commit().await.expect("commit");
        let row = plane.running(&org, &runner).await;
        let again = plane.running_command(&org, &row, &runner).await;
        runner_protocol::append_output(&plane.state, &again, Stream::Stdout, &at(&row, 0), &sixty)
            .await
            .expect("room again after the purge");
    }
}

/// A quarantine freezes a sandbox for forensics: the automatic passes
/// (TTL, idle sleep, retention) leave it alone until it is released, as
/// its owner's changes are refused. Before, its TTL ended it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_sandbox_is_not_ended_by_its_ttl_until_released() {
    for plane in planes("quarantine_ttl").await {
        let org = plane.org("org_q", None).await;
        let runner = plane.runner(4).await;
        let row = plane.running(&org, &runner).await;
        let mut tx = plane.state.db.write().await.expect("tx");
        server::records::sandboxes::set_expires_at(&mut tx, &row, 1, "timeout_set")
            .await
            .expect("expired long ago");
        server::records::sandboxes::set_quarantine(&mut tx, &row.id, Some("forensics"))
            .await
            .expect("quarantined");
        tx.commit().await.expect("commit");
        server::reconcile::pass(&plane.state, false)
            .await
            .expect("a pass");
        let held = plane.load(&row.id).await;
        assert_eq!(
            (held.state, held.desired),
            (SandboxState::Running, DesiredState::Running),
            "{}",
            plane.engine()
        );
        let mut tx = plane.state.db.write().await.expect("tx");
        server::records::sandboxes::set_quarantine(&mut tx, &row.id, None)
            .await
            .expect("released");
        tx.commit().await.expect("commit");
        server::reconcile::pass(&plane.state, false)
            .await
            .expect("a pass");
        let released = plane.load(&row.id).await;
        assert_eq!(
            released.desired,
            DesiredState::Terminated,
            "{}: the TTL applies once released",
            plane.engine()
        );
    }
}

/// Audit finding: a runner's `captured_at_ms` had no lower bound: one of
/// `i64::MIN` wrapped the published figures' arithmetic (a panic in a
/// debug build) and made the sandbox look saved at the start of time. It
/// is taken within the sandbox's life: not before its creation (less ten
/// minutes of a runner's clock behind), not after now.
#[tokio::test]
async fn a_saves_capture_time_is_within_the_sandboxs_life() {
    for plane in planes_with("capture_bounds", true).await {
        let org = plane.org("org_c", None).await;
        let runner = plane.runner(4).await;
        let row = plane.running_with_idle(&org, &runner, true, 0).await;
        let root = plane.upload_home(&org, "captured\n");
        // A runner's clock may be behind the server's by ten minutes.
        let earliest = row.created_at_ms - 10 * 60 * 1000;
        for (forged, within) in [(i64::MIN, earliest), (i64::MAX, i64::MAX)] {
            let report = api::runners::SaveReport {
                runner_id: runner.clone(),
                epoch: row.epoch as u64,
                outcome: "completed".to_owned(),
                root: Some(root.clone()),
                captured_at_ms: Some(forged),
                bytes_pending: None,
                error: None,
                snapshot_ms: None,
                uploaded_bytes: Some(1),
                securing: false,
            };
            let saved = server::control::saves::report_save(&plane.state, &row.id, &report)
                .await
                .expect("taken");
            let at = saved.home.saved_at_ms.expect("saved");
            if within == i64::MAX {
                assert!(at <= server::db::now_ms(), "{}: {at}", plane.engine());
            } else {
                assert!(at >= within, "{}: {at} before creation", plane.engine());
            }
        }
        // The deployment's figures read the saves without overflowing.
        server::control::deployment::deployment(&plane.state)
            .await
            .expect("the deployment's figures");
    }
}
