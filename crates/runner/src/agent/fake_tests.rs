//! The agent driven through its fakes (`testing`): no root, no runc, no
//! server, and simulated time (the tests move the clock; nothing sleeps on
//! the wall clock). Each test names one behaviour and fails if it breaks:
//! a worker's passes (launch, stop, delete, an out-of-band death, launch
//! failures, a container of an earlier placement removed, not adopted),
//! command supervision (an end and its state, a launch failure
//! and its typed reason), the save schedule (a failed save is reported,
//! every interval, until fenced) and the self-fence (heartbeats failing
//! past `freeze_after` pause what runs, a renewal thaws exactly that, a
//! `fenced` answer kills everything and the runner registers again, a hung
//! heartbeat times out on the clock), the assignments loop (what is
//! assigned is launched, leftovers and what is taken away are removed)
//! and preemption notices (retried until the server has one), and the
//! runner's credential (kept at the first registration and registered
//! with after; no new identity over sandboxes still on disk).

use std::time::Duration;

use api::client::OutputStream;
use api::failpoint::Failpoints;
use api::lifecycle::{CommandState, DesiredState, SandboxState, StorageClass};
use oci::config::SandboxId;
use oci::exec::{Outcome, Stream};
use oci::init::InitEnd;
use oci::signal::Signal;
use oci::{DeathCause, Error, LaunchFailure, Status};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::control::ControlPlane;
use super::sandbox::{self, Assigned};
use super::testing::{
    Agent, Call, ExecScript, FAKE_CREDENTIAL, FREEZE_AFTER_MS, HEARTBEAT_MS, Kind, LEASE_TTL_MS,
    Request, STOP_GRACE_MS, Scripted, agent, assignment, command, settle,
};
use super::{AgentError, assignments_loop, fence, heartbeats, notify_preemption, register};

const ID: &str = "sbx_fake0001";

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// An assignment asked for after every report so far: the server's view
/// is current (tests that send a stale view say so with a lower count).
const FRESH: u64 = u64::MAX;

/// Starts the worker of [`ID`] with `assigned`.
fn worker(agent: &Agent, assigned: Assigned) -> (watch::Sender<Option<Assigned>>, JoinHandle<()>) {
    let (sender, receiver) = watch::channel(Some(assigned));
    let id = SandboxId::new(ID.to_owned()).expect("a sandbox id");
    let task = tokio::spawn(sandbox::run(agent.shared.clone(), id, receiver));
    (sender, task)
}

fn sandbox_only(desired: DesiredState, state: SandboxState) -> Assigned {
    Assigned {
        sandbox: assignment(ID, 1, desired, state),
        commands: Vec::new(),
        reports_before: FRESH,
    }
}

fn reported(requests: &[Request], state: SandboxState) -> bool {
    requests
        .iter()
        .any(|r| matches!(r, Request::Sandbox(_, report) if report.state == state))
}

#[tokio::test]
async fn an_assignment_is_launched_and_reported_running() {
    let agent = agent(Failpoints::none());
    let (_assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Starting),
    );
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    assert_eq!(agent.runtime.calls(), [Call::Launch(ID.to_owned())]);
    let reports = agent.control.requests();
    let Some(Request::Sandbox(id, report)) = reports.first() else {
        panic!("the first request is the sandbox's report: {reports:?}");
    };
    assert_eq!(
        (id.as_str(), report.epoch, report.runner_id.as_str()),
        (ID, 1, "rnr_fake")
    );
    assert_eq!(agent.runtime.status(ID), Some(Status::Running));
}

#[tokio::test]
async fn a_desired_stop_stops_then_deletes_the_container_and_reports_stopped() {
    let agent = agent(Failpoints::none());
    agent.runtime.add(ID, Status::Running);
    let (assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Running),
    );
    settle().await;
    assign.send_replace(Some(sandbox_only(
        DesiredState::Stopped,
        SandboxState::Running,
    )));
    agent
        .control
        .wait_until("stopped reported", |r| reported(r, SandboxState::Stopped))
        .await;
    assert_eq!(
        agent.runtime.calls(),
        [Call::Stop(ID.to_owned()), Call::Delete(ID.to_owned())]
    );
    let states: Vec<_> = agent
        .control
        .sandbox_reports()
        .into_iter()
        .map(|(state, reason, _)| (state, reason))
        .collect();
    let stop_requested = Some("stop_requested".to_owned());
    assert_eq!(
        states,
        [
            (SandboxState::Stopping, stop_requested.clone()),
            (SandboxState::Stopped, stop_requested),
        ]
    );
    // Then deleted: every file goes, `deleted` is reported.
    assign.send_replace(Some(sandbox_only(
        DesiredState::Deleted,
        SandboxState::Stopped,
    )));
    agent
        .control
        .wait_until("deleted reported", |r| reported(r, SandboxState::Deleted))
        .await;
    assert_eq!(
        agent.runtime.calls().last(),
        Some(&Call::RemoveFiles(ID.to_owned()))
    );
}

#[tokio::test]
async fn a_container_that_dies_is_reported_failed_with_its_cause() {
    let agent = agent(Failpoints::none());
    agent.runtime.add(ID, Status::Running);
    let (_assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Running),
    );
    settle().await;
    assert!(
        agent.control.sandbox_reports().is_empty(),
        "nothing to report"
    );
    let cause = DeathCause::WorkloadExited {
        end: Some(InitEnd::WorkloadExited { code: 3 }),
    };
    agent.runtime.die(ID, cause);
    agent
        .control
        .wait_until("failed reported", |r| reported(r, SandboxState::Failed))
        .await;
    let (_, reason, message) = agent.control.sandbox_reports().remove(0);
    assert_eq!(reason.as_deref(), Some("workload_exited"));
    assert!(
        message.as_deref().is_some_and(|m| m.contains("code 3")),
        "{message:?}"
    );
}

#[tokio::test]
async fn an_oom_killed_sandbox_is_reported_oom_killed() {
    let agent = agent(Failpoints::none());
    agent.runtime.add(ID, Status::Running);
    let (_assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Running),
    );
    settle().await;
    agent.runtime.die(ID, DeathCause::OomKilled);
    agent
        .control
        .wait_until("failed reported", |r| reported(r, SandboxState::Failed))
        .await;
    let (_, reason, _) = agent.control.sandbox_reports().remove(0);
    assert_eq!(reason.as_deref(), Some("oom_killed"));
}

#[tokio::test]
async fn a_permanent_launch_failure_fails_the_sandbox_with_the_runtimes_words() {
    let agent = agent(Failpoints::none());
    agent
        .runtime
        .fail_next_launch(Error::Invalid("no such seccomp profile".to_owned()));
    let (_assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Starting),
    );
    agent
        .control
        .wait_until("failed reported", |r| reported(r, SandboxState::Failed))
        .await;
    let (_, reason, message) = agent.control.sandbox_reports().remove(0);
    assert_eq!(reason.as_deref(), Some("runtime_error"));
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("no such seccomp profile")),
        "{message:?}"
    );
    assert_eq!(agent.runtime.calls(), [Call::Launch(ID.to_owned())]);
}

#[tokio::test]
async fn a_transient_launch_failure_is_retried_after_a_pause_on_the_clock() {
    let agent = agent(Failpoints::none());
    for _ in 0..2 {
        agent.runtime.fail_next_launch(Error::io(
            "start",
            "/run/fake",
            std::io::Error::other("the runtime could not be started"),
        ));
    }
    let (_assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Starting),
    );
    agent
        .runtime
        .wait_until("a first launch", |calls| !calls.is_empty())
        .await;
    settle().await;
    // No time has passed: no second attempt yet.
    assert_eq!(agent.runtime.calls().len(), 1);
    agent.clock.run_for(ms(2_000), ms(50)).await;
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    let launches = agent.runtime.times_of(|c| matches!(c, Call::Launch(_)));
    assert_eq!(launches.len(), 3, "two failures, then the launch");
    assert!(launches[1] > launches[0], "the retry waited on the clock");
    assert!(
        !reported(&agent.control.requests(), SandboxState::Failed),
        "a transient failure does not fail the sandbox"
    );
}

/// A worker of a running sandbox with one command handed over.
fn with_command(agent: &Agent, argv: &[&str]) -> (watch::Sender<Option<Assigned>>, JoinHandle<()>) {
    agent.runtime.add(ID, Status::Running);
    worker(
        agent,
        Assigned {
            sandbox: assignment(ID, 1, DesiredState::Running, SandboxState::Running),
            commands: vec![command("cmd_fake0001", ID, 1, argv)],
            reports_before: FRESH,
        },
    )
}

fn ended(requests: &[Request]) -> bool {
    requests
        .iter()
        .any(|r| matches!(r, Request::Command(_, report) if report.state != CommandState::Running))
}

#[tokio::test]
async fn a_commands_output_goes_up_before_its_exit_is_reported() {
    let agent = agent(Failpoints::none());
    // More than an end report carries: uploaded by offset first.
    let big = vec![b'x'; api::runners::REPORTED_OUTPUT_BYTES_MAX + 1];
    agent.runtime.next_exec(ExecScript {
        output: vec![(Stream::Stdout, big.clone())],
        outcome: Outcome::Exited { code: 7 },
    });
    let (_assign, _task) = with_command(&agent, &["echo", "hello"]);
    agent.control.wait_until("the command's end", ended).await;
    assert_eq!(
        agent.runtime.calls(),
        [Call::Exec(
            ID.to_owned(),
            vec!["echo".to_owned(), "hello".to_owned()]
        )]
    );
    let requests = agent.control.requests();
    let output = requests
        .iter()
        .position(|r| {
            matches!(r, Request::Output(id, OutputStream::Stdout, 0, bytes)
                if id == "cmd_fake0001" && *bytes == big)
        })
        .expect("the output was uploaded at offset 0");
    let end = requests.iter().position(|r| ended(std::slice::from_ref(r)));
    assert!(end.is_some_and(|end| end > output), "{requests:?}");
    let reports = agent.control.command_reports();
    let states: Vec<_> = reports.iter().map(|r| r.state).collect();
    assert_eq!(states, [CommandState::Running, CommandState::Exited]);
    assert_eq!(reports[1].exit_code, Some(7));
    assert_eq!(reports[1].output, None, "sent twice");
}

/// A command makes one file in the data dir, its launch record (with its
/// end appended), plus a spool file per stream that had output: every file
/// made and removed per command is work for the data dir's filesystem.
#[tokio::test]
async fn a_command_keeps_its_end_in_its_launch_record_and_spools_only_streams_with_output() {
    let agent = agent(Failpoints::none());
    agent.runtime.next_exec(ExecScript {
        output: vec![(Stream::Stderr, b"oops\n".to_vec())],
        outcome: Outcome::Exited { code: 3 },
    });
    let (_assign, _task) = with_command(&agent, &["sh", "-c", "echo oops >&2; exit 3"]);
    agent.control.wait_until("the command's end", ended).await;
    let id = SandboxId::new(ID.to_owned()).expect("a sandbox id");
    let commands = agent.shared.data.commands(&id);
    let dir = agent.shared.data.root().join("commands").join(ID);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("the sandbox's command dir")
        .map(|entry| {
            entry
                .expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    assert_eq!(names, ["cmd_fake0001.launched", "cmd_fake0001.stderr"]);
    assert_eq!(
        commands.record("cmd_fake0001").expect("its record"),
        super::dirs::CommandRecord::Ended(super::dirs::RecordedEnd {
            exit_code: Some(3),
            ..super::dirs::RecordedEnd::new(CommandState::Exited)
        })
    );
    let report = agent
        .control
        .command_reports()
        .into_iter()
        .find(|r| r.state != CommandState::Running)
        .expect("an end");
    let output = report.output.expect("the output with the end");
    assert_eq!(
        (output.stdout, output.stderr),
        (Vec::new(), b"oops\n".to_vec())
    );
}

/// `echo`: a command that ends at once with a little output is reported
/// once, its output with its end (the server stores both in one commit),
/// and nothing is uploaded apart.
#[tokio::test]
async fn a_command_that_ends_at_once_with_a_little_output_sends_it_with_its_end() {
    let agent = agent(Failpoints::none());
    agent.runtime.next_exec(ExecScript {
        output: vec![
            (Stream::Stdout, b"hello\n".to_vec()),
            (Stream::Stderr, b"oops\n".to_vec()),
        ],
        outcome: Outcome::Exited { code: 0 },
    });
    let (_assign, _task) = with_command(&agent, &["echo", "hello"]);
    agent.control.wait_until("the command's end", ended).await;
    let reports = agent.control.command_reports();
    let seen: Vec<_> = reports
        .iter()
        .map(|r| (r.state, r.pid, r.output.clone()))
        .collect();
    assert_eq!(
        seen,
        [(
            CommandState::Exited,
            Some(super::testing::FAKE_PID),
            Some(api::runners::ReportedOutput {
                stdout: b"hello\n".to_vec(),
                stderr: b"oops\n".to_vec(),
            })
        )]
    );
    let uploads: Vec<_> = agent
        .control
        .requests()
        .into_iter()
        .filter(|r| matches!(r, Request::Output(..)))
        .collect();
    assert_eq!(uploads, [], "uploaded apart too");
}

#[tokio::test]
async fn a_command_that_cannot_start_is_launch_failed_with_its_typed_reason() {
    let agent = agent(Failpoints::none());
    agent.runtime.next_exec(ExecScript {
        output: Vec::new(),
        outcome: Outcome::LaunchFailed {
            failure: LaunchFailure::MissingExecutable,
            message: "exec: \"nope\": executable file not found in $PATH".to_owned(),
        },
    });
    let (_assign, _task) = with_command(&agent, &["nope"]);
    agent.control.wait_until("the command's end", ended).await;
    let end = agent
        .control
        .command_reports()
        .into_iter()
        .find(|r| r.state != CommandState::Running)
        .expect("an end");
    assert_eq!(end.state, CommandState::LaunchFailed);
    assert_eq!(end.reason.as_deref(), Some("executable_not_found"));
}

/// A command of a sandbox whose env secrets cannot be read (delivered at
/// launch; here never: the container is adopted and its secrets' tmpfs is
/// gone) ends `launch_failed` (`secret_unavailable`) without running. It
/// used to run silently without them.
#[tokio::test]
async fn a_command_whose_env_secrets_cannot_be_read_is_launch_failed_not_run_without_them() {
    let agent = agent(Failpoints::none());
    agent.runtime.add(ID, Status::Running);
    let mut sandbox = assignment(ID, 1, DesiredState::Running, SandboxState::Running);
    sandbox.secrets = vec![api::sandboxes::Secret {
        name: "token".to_owned(),
        env: Some("TOKEN".to_owned()),
        file: None,
    }];
    let (_assign, _task) = worker(
        &agent,
        Assigned {
            sandbox,
            commands: vec![command("cmd_fake0001", ID, 1, &["env"])],
            reports_before: FRESH,
        },
    );
    agent.control.wait_until("the command's end", ended).await;
    let ends: Vec<_> = agent
        .control
        .command_reports()
        .into_iter()
        .map(|r| (r.state, r.reason))
        .collect();
    assert_eq!(
        ends,
        [(
            CommandState::LaunchFailed,
            Some("secret_unavailable".to_owned())
        )]
    );
    assert!(
        !agent
            .runtime
            .calls()
            .iter()
            .any(|call| matches!(call, Call::Exec(..))),
        "nothing ran"
    );
}

#[tokio::test]
async fn scheduled_saves_run_every_interval_and_report_failures_until_fenced() {
    let agent = agent(Failpoints::none());
    let mut sandbox = assignment(ID, 1, DesiredState::Running, SandboxState::Running);
    sandbox.storage_class = StorageClass::Durable;
    let saves = tokio::spawn(sandbox::save_on_schedule(
        agent.shared.clone(),
        sandbox,
        Duration::from_secs(60),
    ));
    settle().await;
    let saves_reported = |agent: &Agent| {
        agent
            .control
            .requests()
            .into_iter()
            .filter_map(|r| match r {
                Request::Save(id, report) => Some((id, report)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    agent.clock.run_for(ms(59_000), ms(1_000)).await;
    assert!(saves_reported(&agent).is_empty(), "not before the interval");
    agent.clock.run_for(ms(1_000), ms(1_000)).await;
    agent
        .control
        .wait_until("a save reported", |r| {
            r.iter().any(|r| matches!(r, Request::Save(..)))
        })
        .await;
    // No btrfs here: the snapshot cannot be taken, and the report says so.
    let (id, report) = saves_reported(&agent).remove(0);
    assert_eq!(
        (id.as_str(), report.outcome.as_str(), report.epoch),
        (ID, "failed", 1)
    );
    assert!(report.error.is_some_and(|e| !e.is_empty()));
    // Tried again next interval; a fenced answer ends the schedule.
    agent.control.answer(Kind::Save, Scripted::Fenced);
    agent.clock.run_for(ms(60_000), ms(1_000)).await;
    agent
        .control
        .wait_until("a second save reported", |r| {
            r.iter().filter(|r| matches!(r, Request::Save(..))).count() == 2
        })
        .await;
    settle().await;
    assert!(saves.is_finished(), "fenced: no more saves");
}

/// Registers through the fake (a 9 s lease, beats every 3 s, freezing 6 s
/// after the last answered beat was sent) and starts the heartbeats.
async fn registered(agent: &Agent) -> JoinHandle<()> {
    let heartbeat_ms = register(&agent.shared).await.expect("registered");
    assert_eq!(heartbeat_ms, HEARTBEAT_MS);
    let shared = agent.shared.clone();
    let task = tokio::spawn(async move {
        let registration = tokio::sync::Mutex::new(());
        let _ = heartbeats(&shared, &registration, heartbeat_ms).await;
    });
    settle().await;
    task
}

/// Runs the fence as `fence::watch` does, a tick every 100 ms of
/// simulated time, until `until`.
async fn fence_until(agent: &Agent, until: Duration) {
    while agent.clock.elapsed() < until {
        fence::tick(&agent.shared).await;
        agent.clock.advance(ms(100));
        settle().await;
    }
    fence::tick(&agent.shared).await;
}

#[tokio::test]
async fn failing_heartbeats_freeze_before_the_lease_can_expire_and_a_renewal_thaws_exactly_that() {
    let agent = agent(Failpoints::none());
    agent.runtime.add("sbx_a", Status::Running);
    agent.runtime.add("sbx_b", Status::Running);
    // Paused by someone else before: not the fence's to thaw.
    agent.runtime.add("sbx_c", Status::Paused);
    let _beats = registered(&agent).await;
    let frozen = agent.shared.fence.subscribe();
    // The beat at 3 s is answered; from 4 s the link is down.
    fence_until(&agent, ms(4_000)).await;
    agent.control.answer(Kind::Heartbeat, Scripted::Unreachable);
    fence_until(&agent, ms(8_900)).await;
    assert!(
        agent
            .runtime
            .times_of(|c| matches!(c, Call::Pause(_)))
            .is_empty()
    );
    assert!(!*frozen.borrow(), "thawed until freeze_after has passed");
    fence_until(&agent, ms(10_500)).await;
    let paused = agent.runtime.times_of(|c| matches!(c, Call::Pause(_)));
    // freeze_after after the last answered beat was sent (3 s), and at
    // least a heartbeat interval before the server's lease (from 3 s)
    // could expire.
    let freeze_at = ms(3_000 + FREEZE_AFTER_MS);
    assert_eq!(paused, [freeze_at, freeze_at], "both running ones, at once");
    assert!(freeze_at + ms(HEARTBEAT_MS) <= ms(3_000 + LEASE_TTL_MS));
    assert!(*frozen.borrow(), "the workers see the freeze");
    assert_eq!(agent.runtime.status("sbx_a"), Some(Status::Paused));
    // The link heals: the next retried beat (each second) thaws them.
    agent.control.answer(Kind::Heartbeat, Scripted::Ok);
    fence_until(&agent, ms(12_000)).await;
    assert!(!*frozen.borrow(), "thawed");
    let resumed: Vec<_> = agent
        .runtime
        .calls()
        .into_iter()
        .filter(|c| matches!(c, Call::Resume(_)))
        .collect();
    assert_eq!(
        resumed,
        [
            Call::Resume("sbx_a".to_owned()),
            Call::Resume("sbx_b".to_owned())
        ]
    );
    assert_eq!(agent.runtime.status("sbx_a"), Some(Status::Running));
    assert_eq!(agent.runtime.status("sbx_c"), Some(Status::Paused));
    let record =
        std::fs::read_to_string(agent.shared.data.root().join("fence.json")).expect("fence.json");
    assert!(record.contains("\"thawed\""), "{record}");
}

#[tokio::test]
async fn a_pause_that_fails_leaves_the_others_frozen() {
    let agent = agent(Failpoints::none());
    agent.runtime.add("sbx_a", Status::Running);
    let _beats = registered(&agent).await;
    agent
        .runtime
        .pause_fault(Some(super::testing::PauseFault::Fails));
    agent.control.answer(Kind::Heartbeat, Scripted::Unreachable);
    fence_until(&agent, ms(6_500)).await;
    // The freeze went ahead (the workers stop) though the pause failed.
    assert!(*agent.shared.fence.subscribe().borrow());
    assert_eq!(
        agent.runtime.times_of(|c| matches!(c, Call::Pause(_))),
        [ms(FREEZE_AFTER_MS)]
    );
}

#[tokio::test]
async fn a_fenced_heartbeat_kills_every_container_and_the_runner_registers_again() {
    let agent = agent(Failpoints::none());
    agent.runtime.add("sbx_a", Status::Running);
    agent.runtime.add("sbx_p", Status::Paused);
    let _beats = registered(&agent).await;
    agent.control.answer_next(Kind::Heartbeat, Scripted::Fenced);
    fence_until(&agent, ms(3_000)).await;
    agent
        .control
        .wait_until("registered again", |r| {
            r.iter()
                .filter(|r| matches!(r, Request::Register(_)))
                .count()
                == 2
        })
        .await;
    let calls = agent.runtime.calls();
    let kill = |id: &str| Call::Kill(id.to_owned(), Signal::Kill);
    assert!(calls.contains(&kill("sbx_a")), "{calls:?}");
    // A paused one is resumed after its kill, so that the kill lands.
    let killed_p = calls.iter().position(|c| *c == kill("sbx_p"));
    let resumed_p = calls
        .iter()
        .position(|c| *c == Call::Resume("sbx_p".to_owned()));
    assert!(
        killed_p.zip(resumed_p).is_some_and(|(k, r)| k < r),
        "{calls:?}"
    );
    assert_eq!(agent.runtime.status("sbx_a"), Some(Status::Stopped));
    assert_eq!(agent.runtime.status("sbx_p"), Some(Status::Stopped));
    let record =
        std::fs::read_to_string(agent.shared.data.root().join("fence.json")).expect("fence.json");
    assert!(record.contains("\"fenced\""), "{record}");
    // Registered again: the workers may act once more; nothing is thawed.
    fence_until(&agent, ms(3_200)).await;
    assert!(!*agent.shared.fence.subscribe().borrow());
    assert_eq!(
        agent
            .runtime
            .calls()
            .iter()
            .filter(|c| matches!(c, Call::Resume(_)))
            .count(),
        1,
        "only the kill's resume"
    );
}

#[tokio::test]
async fn a_frozen_runner_launches_nothing_until_it_thaws() {
    let agent = agent(Failpoints::none());
    let _beats = registered(&agent).await;
    agent.control.answer(Kind::Heartbeat, Scripted::Unreachable);
    fence_until(&agent, ms(6_100)).await;
    assert!(*agent.shared.fence.subscribe().borrow(), "frozen");
    let (_assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Starting),
    );
    settle().await;
    assert!(agent.runtime.calls().is_empty(), "no launch while frozen");
    agent.control.answer(Kind::Heartbeat, Scripted::Ok);
    fence_until(&agent, ms(7_500)).await;
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    assert_eq!(agent.runtime.calls(), [Call::Launch(ID.to_owned())]);
}

/// A fault point armed to panic fires where the agent reaches it: right
/// after a command's launch, before anything is reported.
#[tokio::test]
async fn a_fault_point_stops_the_agent_where_it_is_armed() {
    let agent = agent(Failpoints::panicking_at("runner:after_command_launch"));
    let (_assign, _task) = with_command(&agent, &["true"]);
    agent
        .runtime
        .wait_until("the exec", |calls| {
            calls.iter().any(|c| matches!(c, Call::Exec(..)))
        })
        .await;
    agent.clock.run_for(ms(1_000), ms(100)).await;
    assert!(
        agent.control.command_reports().is_empty(),
        "nothing reported past the point"
    );
}

#[tokio::test]
async fn output_the_server_refuses_is_dropped_and_the_end_still_reported() {
    let agent = agent(Failpoints::none());
    agent.runtime.next_exec(ExecScript {
        output: vec![
            (
                Stream::Stdout,
                vec![b'x'; api::runners::REPORTED_OUTPUT_BYTES_MAX + 1],
            ),
            (Stream::Stderr, b"two\n".to_vec()),
        ],
        outcome: Outcome::Exited { code: 0 },
    });
    agent.control.answer(Kind::Output, Scripted::Refused);
    let (_assign, _task) = with_command(&agent, &["chatty"]);
    agent.control.wait_until("the command's end", ended).await;
    let uploads: Vec<OutputStream> = agent
        .control
        .requests()
        .into_iter()
        .filter_map(|r| match r {
            Request::Output(_, stream, ..) => Some(stream),
            _ => None,
        })
        .collect();
    // Each stream refused once, never sent again: a refusal of one stream
    // (the server keeps no more of it) leaves the other's going.
    assert_eq!(
        uploads,
        [OutputStream::Stdout, OutputStream::Stderr],
        "each stream refused once, never sent again"
    );
    let end = agent.control.command_reports().pop().expect("an end");
    assert_eq!((end.state, end.exit_code), (CommandState::Exited, Some(0)));
}

#[tokio::test]
async fn a_pause_that_hangs_holds_the_fence_but_the_workers_are_already_frozen() {
    let agent = agent(Failpoints::none());
    agent.runtime.add("sbx_a", Status::Running);
    let _beats = registered(&agent).await;
    agent
        .runtime
        .pause_fault(Some(super::testing::PauseFault::Hangs));
    agent.control.answer(Kind::Heartbeat, Scripted::Unreachable);
    fence_until(&agent, ms(5_900)).await;
    agent.clock.advance(ms(100));
    settle().await;
    let shared = agent.shared.clone();
    let tick = tokio::spawn(async move { fence::tick(&shared).await });
    agent
        .runtime
        .wait_until("the pause", |calls| {
            calls.iter().any(|c| matches!(c, Call::Pause(_)))
        })
        .await;
    // The gate closed before anything was paused: no worker acts.
    assert!(*agent.shared.fence.subscribe().borrow());
    assert!(agent.shared.fence.thawed().await.is_none());
    assert!(!tick.is_finished(), "the tick waits on the runtime");
    tick.abort();
}

#[tokio::test]
async fn heartbeats_that_hang_time_out_on_the_clock_and_the_fence_still_freezes() {
    let agent = agent(Failpoints::none());
    agent.runtime.add("sbx_a", Status::Running);
    let _beats = registered(&agent).await;
    agent.control.answer(Kind::Heartbeat, Scripted::Hangs);
    fence_until(&agent, ms(7_100)).await;
    // Registered at 0 and no beat answered since: frozen at freeze_after.
    assert_eq!(
        agent.runtime.times_of(|c| matches!(c, Call::Pause(_))),
        [ms(FREEZE_AFTER_MS)]
    );
    // The beat sent at 3 s gave up after an interval; the next went at 7 s.
    let beats = agent
        .control
        .requests()
        .into_iter()
        .filter(|r| *r == Request::Heartbeat)
        .count();
    assert_eq!(
        beats, 2,
        "a hung beat holds the next one up only an interval"
    );
}

/// The assignments loop as `run` drives it, with the fake's long-poll.
fn assignments(agent: &Agent) -> JoinHandle<()> {
    let shared = agent.shared.clone();
    tokio::spawn(async move {
        let registration = tokio::sync::Mutex::new(());
        let mut workers = std::collections::HashMap::new();
        let _ = assignments_loop(&shared, &registration, &mut workers).await;
    })
}

#[tokio::test]
async fn the_first_assignments_launch_what_is_assigned_and_remove_leftovers() {
    let agent = agent(Failpoints::none());
    // Left by an earlier run, no longer assigned here.
    agent.runtime.add("sbx_old", Status::Running);
    agent.control.assign(
        vec![assignment(
            ID,
            1,
            DesiredState::Running,
            SandboxState::Starting,
        )],
        Vec::new(),
    );
    let _loop = assignments(&agent);
    agent
        .runtime
        .wait_until("the launch and the removal", |calls| {
            calls.contains(&Call::Launch(ID.to_owned()))
                && calls.contains(&Call::RemoveFiles("sbx_old".to_owned()))
        })
        .await;
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    assert!(
        agent
            .control
            .requests()
            .iter()
            .all(|r| !matches!(r, Request::Sandbox(id, _) if id == "sbx_old")),
        "nothing is reported for what is not assigned"
    );
    // No longer assigned (taken away): its worker removes it.
    agent.control.assign(Vec::new(), Vec::new());
    agent
        .runtime
        .wait_until("the removal", |calls| {
            calls.contains(&Call::RemoveFiles(ID.to_owned()))
        })
        .await;
}

/// The inits' lease (`oci::lease`, DESIGN.md §7: the freeze does not
/// depend on the runner process): written before a launch (the fake
/// refuses a launch without one, as the real init would freeze at once),
/// renewed by every answered beat, halfway from `freeze_after` to the
/// lease's end; never written for a container no worker runs here; left
/// to lapse when the beats fail, after the fence's own freeze and before
/// the lease could expire; renewed again by the beat that gets through.
#[tokio::test]
async fn the_inits_lease_is_written_before_a_launch_and_renewed_only_by_answered_beats() {
    let agent = agent(Failpoints::none());
    // Left by an earlier run, no longer assigned here.
    agent.runtime.add("sbx_old", Status::Running);
    let _beats = registered(&agent).await;
    agent.control.assign(
        vec![assignment(
            ID,
            1,
            DesiredState::Running,
            SandboxState::Starting,
        )],
        Vec::new(),
    );
    let _loop = assignments(&agent);
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    let deadline = |id: &str| {
        let dir = agent
            .shared
            .data
            .root()
            .join("sandboxes")
            .join(id)
            .join("lease");
        oci::lease::read_deadline(&dir)
            .ok()
            .map(|d| d.freeze_at_boottime_ms)
    };
    let grace_ms = FREEZE_AFTER_MS + (LEASE_TTL_MS - FREEZE_AFTER_MS) / 2;
    // Registered at 0.
    assert_eq!(deadline(ID), Some(grace_ms));
    // The beat sent at 3 s is answered.
    fence_until(&agent, ms(3_100)).await;
    assert_eq!(deadline(ID), Some(3_000 + grace_ms));
    agent.control.answer(Kind::Heartbeat, Scripted::Unreachable);
    fence_until(&agent, ms(9_500)).await;
    assert!(
        *agent.shared.fence.subscribe().borrow(),
        "the fence froze at 9 s"
    );
    assert_eq!(deadline(ID), Some(3_000 + grace_ms), "nothing renewed it");
    // The inits act after the fence's own freeze, before the lease ends.
    assert!(FREEZE_AFTER_MS < grace_ms && grace_ms < LEASE_TTL_MS);
    assert_eq!(deadline("sbx_old"), None, "not run here: never renewed");
    agent.control.answer(Kind::Heartbeat, Scripted::Ok);
    fence_until(&agent, ms(11_000)).await;
    assert!(!*agent.shared.fence.subscribe().borrow(), "thawed");
    let renewed = deadline(ID).expect("a deadline");
    assert!(
        renewed >= 9_500 + grace_ms && renewed <= 11_000 + grace_ms,
        "renewed by the beat that got through: {renewed}"
    );
}

#[tokio::test]
async fn a_preemption_notice_is_passed_on_retrying_what_fails_transiently() {
    let agent = agent(Failpoints::none());
    agent
        .control
        .answer_next(Kind::Preempt, Scripted::Unreachable);
    agent
        .control
        .answer_next(Kind::Preempt, Scripted::Unreachable);
    let shared = agent.shared.clone();
    let notice = tokio::spawn(async move { notify_preemption(&shared).await });
    settle().await;
    let preempts = |agent: &Agent| {
        agent
            .control
            .requests()
            .into_iter()
            .filter(|r| *r == Request::Preempt)
            .count()
    };
    assert_eq!(preempts(&agent), 1, "no retry before the pause");
    agent.clock.run_for(ms(1_000), ms(50)).await;
    assert_eq!(preempts(&agent), 3, "retried until the server had it");
    assert!(notice.is_finished());
}

/// The runner ids the registrations named, in order.
fn registered_as(agent: &Agent) -> Vec<Option<String>> {
    agent
        .control
        .requests()
        .into_iter()
        .filter_map(|request| match request {
            Request::Register(register) => Some(register.runner_id),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_new_runner_keeps_its_credential_and_registers_again_with_it() {
    let agent = agent(Failpoints::none());
    // A first start: no id, no credential; the runner token registers.
    agent.control.use_credential(None);
    agent.shared.set_runner_id("");
    register(&agent.shared).await.expect("registered");
    assert!(
        agent.control.has_credential(),
        "calls go with its credential"
    );
    let data = &agent.shared.data;
    assert_eq!(
        data.runner_token().expect("read"),
        Some(FAKE_CREDENTIAL.to_owned())
    );
    assert_eq!(data.runner_id().expect("read"), Some("rnr_fake".to_owned()));
    // Again (a lost lease, or a restart): as itself, by its credential.
    register(&agent.shared).await.expect("registered again");
    assert_eq!(
        registered_as(&agent),
        [None, Some("rnr_fake".to_owned())],
        "the first registration names no runner, the next its own"
    );
}

#[tokio::test]
async fn a_runner_the_server_does_not_know_takes_no_new_identity_over_its_sandboxes() {
    let agent = agent(Failpoints::none());
    let home = agent.shared.data.root().join("homes").join(ID);
    std::fs::create_dir_all(&home).expect("a sandbox's home on disk");
    agent
        .control
        .answer_next(Kind::Register, Scripted::Unauthenticated);
    let refused = register(&agent.shared).await;
    assert!(
        matches!(refused, Err(AgentError::ForeignDataDir { .. })),
        "{refused:?}"
    );
    assert_eq!(
        registered_as(&agent),
        [Some("rnr_fake".to_owned())],
        "no registration as a new runner while its sandboxes are on disk"
    );
    // With nothing on disk, it registers as a new runner.
    std::fs::remove_dir(&home).expect("remove the home");
    agent.control.use_credential(Some(FAKE_CREDENTIAL));
    agent
        .control
        .answer_next(Kind::Register, Scripted::Unauthenticated);
    register(&agent.shared).await.expect("registered anew");
    assert_eq!(
        registered_as(&agent)[1..],
        [Some("rnr_fake".to_owned()), None]
    );
    assert!(agent.control.has_credential());
}

/// Issue 13, point 2: a home no longer assigned here (the runner was
/// fenced or lost and came back, or a failed standard sandbox) is not
/// deleted: it is set aside, read-only and unmounted, and reported; only
/// when the server says it may go is it deleted.
#[tokio::test]
async fn a_home_no_longer_assigned_is_kept_aside_and_reported_until_the_server_lets_it_go() {
    let agent = agent(Failpoints::none());
    let (assign, task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Starting),
    );
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    let home = agent.shared.homes.path(ID).expect("the home's path");
    std::fs::write(home.join("work.txt"), "precious\n").expect("the workload writes");

    // Taken away (the lease was lost meanwhile): the worker leaves.
    assign.send_replace(None);
    agent
        .control
        .wait_until("the kept copy reported", |r| {
            r.iter().any(|r| matches!(r, Request::Kept(_)))
        })
        .await;
    let Some(Request::Kept(report)) = agent
        .control
        .requests()
        .into_iter()
        .find(|r| matches!(r, Request::Kept(_)))
    else {
        unreachable!("waited for it")
    };
    assert_eq!(
        (
            report.sandbox_id.as_str(),
            report.bytes,
            report.secured_root.as_deref()
        ),
        (ID, 9, None),
        "{report:?}"
    );
    let _ = task.await;
    assert!(
        !home.exists(),
        "the home itself is gone from where it was mounted"
    );
    assert!(
        agent
            .runtime
            .calls()
            .contains(&Call::RemoveFiles(ID.to_owned())),
        "the container's files go"
    );
    let copies = agent.shared.homes.kept_copies().expect("kept copies");
    assert_eq!(copies, [(ID.to_owned(), report.name.clone())]);
    let kept = agent
        .shared
        .homes
        .kept_facts(ID, &report.name)
        .expect("the kept copy");
    assert_eq!(kept.bytes, 9);
    let kept_dir = agent
        .shared
        .data
        .root()
        .join("volumes/kept")
        .join(ID)
        .join(&report.name);
    assert_eq!(
        std::fs::read_to_string(kept_dir.join("work.txt")).expect("the work is kept"),
        "precious\n"
    );
    let mode = std::fs::metadata(&kept_dir).expect("kept").permissions();
    assert!(mode.readonly(), "the kept copy is read-only");

    // Reported again while the server keeps it: it stays.
    super::kept::report(&agent.shared, ID, &report.name).await;
    assert_eq!(agent.shared.homes.kept_copies().expect("listed").len(), 1);
    // The server lets it go (discarded, expired, sandbox deleted): deleted.
    agent.control.discard_kept();
    super::kept::report(&agent.shared, ID, &report.name).await;
    assert!(agent.shared.homes.kept_copies().expect("listed").is_empty());
    assert!(!kept_dir.exists());
}

/// Issue 13, point 5: a long-poll answered while the worker's `stopped`
/// report was on its way still shows the sandbox `stopping` with a start
/// asked meanwhile. Read as it stands, that launched the container again,
/// a report the server refused (a `stopped` sandbox cannot be reported
/// running) and the next view killed ("a container runs that its record
/// says must not"). The worker reads such a view with the state it
/// reported: nothing is launched until the server's own view of the start
/// (a new placement) arrives.
#[tokio::test]
async fn a_view_older_than_the_workers_own_report_does_not_undo_it() {
    let agent = agent(Failpoints::none());
    agent.runtime.add(ID, Status::Running);
    let (assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Stopped, SandboxState::Running),
    );
    agent
        .control
        .wait_until("stopped reported", |r| reported(r, SandboxState::Stopped))
        .await;
    // Asked for before the `stopped` report was accepted (the count of
    // accepted reports was 1: `stopping`).
    assign.send_replace(Some(Assigned {
        reports_before: 1,
        ..sandbox_only(DesiredState::Running, SandboxState::Stopping)
    }));
    settle().await;
    assert_eq!(
        agent.runtime.calls(),
        [Call::Stop(ID.to_owned()), Call::Delete(ID.to_owned())],
        "nothing launched on a stale view"
    );
    // The same view asked for after the report is taken as it stands.
    assign.send_replace(Some(sandbox_only(
        DesiredState::Running,
        SandboxState::Stopping,
    )));
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    assert_eq!(
        agent.runtime.calls().last(),
        Some(&Call::Launch(ID.to_owned()))
    );
}

/// Issue 13, point 2: a kept copy listed with salvages is uploaded for
/// them and each is reported, without a placement's epoch (the server
/// checks the runner holds the copy). An upload that fails (here the
/// block service is out of reach) is reported `failed` with one line
/// saying why, and the copy stays: it goes only when the server lets it
/// go. A salvage of a copy this runner does not have says so.
#[tokio::test]
async fn a_kept_copy_listed_for_salvage_is_uploaded_reported_and_kept() {
    let agent = agent(Failpoints::none());
    let (assign, task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Starting),
    );
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    let home = agent.shared.homes.path(ID).expect("the home's path");
    std::fs::write(home.join("work.txt"), "precious\n").expect("the workload writes");
    assign.send_replace(None);
    let _ = task.await;
    let copies = agent.shared.homes.kept_copies().expect("kept copies");
    let [(_, name)] = copies.as_slice() else {
        panic!("one kept copy: {copies:?}")
    };
    let kept_dir = agent
        .shared
        .data
        .root()
        .join("volumes/kept")
        .join(ID)
        .join(name);

    let listed = [
        api::runners::KeptAssignment {
            copy_id: "kpt_fake".to_owned(),
            sandbox_id: ID.to_owned(),
            name: name.clone(),
            org_id: "org_fake".to_owned(),
            salvage: vec!["snp_a".to_owned(), "snp_b".to_owned()],
        },
        api::runners::KeptAssignment {
            copy_id: "kpt_elsewhere".to_owned(),
            sandbox_id: ID.to_owned(),
            name: "k1".to_owned(),
            org_id: "org_fake".to_owned(),
            salvage: vec!["snp_c".to_owned()],
        },
    ];
    let kept_reports = |r: &[Request]| r.iter().filter(|r| matches!(r, Request::Kept(_))).count();
    let before = kept_reports(&agent.control.requests());
    super::kept::sync(&agent.shared, &listed, &agent.shared.kept_syncing);
    agent
        .control
        .wait_until("three salvages reported", |r| {
            r.iter()
                .filter(|r| matches!(r, Request::Snapshot(..)))
                .count()
                == 3
        })
        .await;
    let reports: Vec<(String, api::runners::SnapshotReport)> = agent
        .control
        .requests()
        .into_iter()
        .filter_map(|r| match r {
            Request::Snapshot(id, report) => Some((id, report)),
            _ => None,
        })
        .collect();
    let ids: Vec<&str> = reports.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["snp_a", "snp_b", "snp_c"]);
    for (id, report) in &reports {
        assert_eq!(
            (
                report.runner_id.as_str(),
                report.epoch,
                report.durability.as_str(),
                report.root.as_deref()
            ),
            ("rnr_fake", 0, "failed", None),
            "{id}: {report:?}"
        );
        let message = report.message.as_deref().unwrap_or_default();
        assert!(
            !message.is_empty() && !message.contains('\n'),
            "{id}: {message:?}"
        );
    }
    let missing = reports[2].1.message.as_deref().unwrap_or_default();
    assert!(missing.contains("not on this runner"), "{missing}");
    // The copy stays, as it was; a listed copy is not reported again.
    assert_eq!(
        std::fs::read_to_string(kept_dir.join("work.txt")).expect("the work is kept"),
        "precious\n"
    );
    assert_eq!(kept_reports(&agent.control.requests()), before);
}

/// The wait reports of [`ID`] so far: (reason, message) of each `starting`
/// report that names a reason.
fn waits(agent: &Agent) -> Vec<(String, String)> {
    agent
        .control
        .sandbox_reports()
        .into_iter()
        .filter(|(state, reason, _)| *state == SandboxState::Starting && reason.is_some())
        .map(|(_, reason, message)| (reason.unwrap_or_default(), message.unwrap_or_default()))
        .collect()
}

/// Issue 13, point 4: a home the store cannot deliver (the fake's block
/// service is a closed port) is not a failure: the sandbox stays
/// `starting`, reported `store_unreachable` with what failed and when the
/// next attempt is, and tried again after pauses that double. What the
/// first attempt wrote is a half restore: never kept aside as if it held
/// work, never started from (a home from a snapshot is restored once, and
/// this once is not over). The fakes have no btrfs, so the home is a
/// standard one from a snapshot; a durable one goes the same way
/// (`cli` `store_faults` shows it with real processes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_the_store_cannot_deliver_waits_starting_and_says_why_and_when() {
    let agent = agent(Failpoints::none());
    let mut sandbox = assignment(ID, 1, DesiredState::Running, SandboxState::Starting);
    sandbox.home_root = Some(store::Digest::of(b"a snapshot's home").to_hex());
    let assigned = Assigned {
        sandbox,
        commands: Vec::new(),
        reports_before: FRESH,
    };
    let (_assign, _task) = worker(&agent, assigned);
    agent
        .control
        .wait_until("the wait reported", |r| {
            r.iter()
                .any(|r| matches!(r, Request::Sandbox(_, report) if report.reason.is_some()))
        })
        .await;
    let first = waits(&agent);
    assert_eq!(first.len(), 1, "{:?}", agent.control.sandbox_reports());
    let (reason, message) = &first[0];
    assert_eq!(reason, "store_unreachable");
    assert!(
        message.starts_with("cannot download the home: store unreachable during get of ")
            && message.contains("; next attempt in 1 s (at ")
            && !message.contains('\n'),
        "{message}"
    );

    // Tried again, not before the announced pause, and announcing twice it.
    let reported_at = agent.clock.elapsed();
    while waits(&agent).len() < 2 {
        assert!(
            agent.clock.elapsed() < reported_at + ms(5_000),
            "no second attempt: {:?}",
            agent.control.sandbox_reports()
        );
        agent.clock.run_for(ms(100), ms(100)).await;
        // The attempt itself runs on the wall clock (a refused connection).
        if waits(&agent).len() < 2 {
            tokio::time::sleep(ms(5)).await;
        }
    }
    assert!(
        agent.clock.elapsed() >= reported_at + ms(1_000),
        "tried again after {:?}",
        agent.clock.elapsed() - reported_at
    );
    let second = waits(&agent);
    assert_eq!(second[1].0, "store_unreachable");
    assert!(
        second[1].1.contains("; next attempt in 2 s (at "),
        "{second:?}"
    );
    assert!(
        !agent
            .runtime
            .calls()
            .iter()
            .any(|call| matches!(call, Call::Launch(_))),
        "nothing launches without its home"
    );
    assert_eq!(
        agent.control.sandbox_reports().len(),
        2,
        "only the waits: {:?}",
        agent.control.sandbox_reports()
    );
    assert!(
        agent.shared.homes.kept_copies().expect("listed").is_empty(),
        "a half restore is no work to keep"
    );
    assert!(agent.shared.homes.restore_unfinished(ID));
}

/// Issue 13, point 4: an imported image the store cannot deliver for now
/// is a wait too (`store_unreachable`, naming the image), not
/// `image_unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_the_store_cannot_deliver_waits_starting() {
    let agent = agent(Failpoints::none());
    let mut sandbox = assignment(ID, 1, DesiredState::Running, SandboxState::Starting);
    sandbox.image = "tools".to_owned();
    sandbox.image_root = Some(store::Digest::of(b"an image").to_hex());
    let (_assign, _task) = worker(
        &agent,
        Assigned {
            sandbox,
            commands: Vec::new(),
            reports_before: FRESH,
        },
    );
    agent
        .control
        .wait_until("the wait reported", |r| {
            r.iter()
                .any(|r| matches!(r, Request::Sandbox(_, report) if report.reason.is_some()))
        })
        .await;
    let reports = agent.control.sandbox_reports();
    let [(SandboxState::Starting, Some(reason), Some(message))] = reports.as_slice() else {
        panic!("one wait, nothing else: {reports:?}");
    };
    assert_eq!(reason, "store_unreachable");
    assert!(
        message.starts_with("cannot download the image: store unreachable"),
        "{message}"
    );
}

/// A durable sandbox placed here and stopped before its launch made a
/// home: there is nothing to secure (nothing ran here; the last completed
/// save stays its home), so the stop ends `stopped` at once. It used to
/// report `securing` and retry "the home is missing on this runner"
/// forever, never converging to the stop asked for.
#[tokio::test]
async fn a_durable_sandbox_stopped_before_it_had_a_home_here_stops_without_securing() {
    let agent = agent(Failpoints::none());
    let mut sandbox = assignment(ID, 1, DesiredState::Stopped, SandboxState::Starting);
    sandbox.storage_class = StorageClass::Durable;
    let (_assign, _task) = worker(
        &agent,
        Assigned {
            sandbox,
            commands: Vec::new(),
            reports_before: FRESH,
        },
    );
    agent
        .control
        .wait_until("stopped reported", |r| reported(r, SandboxState::Stopped))
        .await;
    let reports = agent.control.requests();
    assert!(
        !reported(&reports, SandboxState::Securing),
        "nothing to secure: {reports:?}"
    );
    assert!(!agent.shared.homes.holds(ID));
}

/// Issue 13, point 10 (the fault matrix's column "back after its lease,
/// placed back"): a runner back after its lease expired, handed a new
/// placement of a sandbox whose old placement's container it still held
/// (frozen by its init), adopted that container: it renewed its lease,
/// which thawed the old processes at the new epoch, and the home was
/// neither restored nor kept aside. A container launched for an earlier
/// placement is now removed before the new one launches; one of the same
/// placement (a restart within the lease) is still adopted.
#[tokio::test]
async fn a_container_of_an_earlier_placement_is_removed_not_adopted() {
    let agent = agent(Failpoints::none());
    let running_at = |epoch: u64| {
        move |requests: &[Request]| {
            requests
                .iter()
                .filter(|r| {
                    matches!(r, Request::Sandbox(_, report)
                        if report.state == SandboxState::Running && report.epoch == epoch)
                })
                .count()
        }
    };
    let placement = |epoch: u64| Assigned {
        sandbox: assignment(ID, epoch, DesiredState::Running, SandboxState::Starting),
        commands: Vec::new(),
        reports_before: FRESH,
    };
    // Launched for epoch 1; then the runner process goes (the container
    // stays), and comes back with the same placement: adopted.
    for run in 1..=2 {
        let (assign, task) = worker(&agent, placement(1));
        agent
            .control
            .wait_until("running reported", |r| running_at(1)(r) == run)
            .await;
        drop(assign);
        task.await.expect("the worker ends with its runner");
    }
    assert_eq!(agent.runtime.calls(), [Call::Launch(ID.to_owned())]);
    assert_eq!(running_at(1)(&agent.control.requests()), 2);

    // A new placement on this runner: the old container goes first.
    let (_assign, _task) = worker(&agent, placement(2));
    agent
        .control
        .wait_until("running reported at epoch 2", |r| running_at(2)(r) > 0)
        .await;
    assert_eq!(
        agent.runtime.calls(),
        [
            Call::Launch(ID.to_owned()),
            Call::Delete(ID.to_owned()),
            Call::Launch(ID.to_owned()),
        ]
    );
}

#[tokio::test]
async fn a_stop_waits_the_grace_the_server_answered_at_registration() {
    let agent = agent(Failpoints::none());
    assert_eq!(agent.shared.stop_grace(), agent.shared.config.stop_grace);
    register(&agent.shared).await.expect("registered");
    assert_eq!(
        agent.shared.stop_grace(),
        Duration::from_millis(STOP_GRACE_MS),
        "what the deployment publishes is what its runners do"
    );
}

/// Issue 16: an asleep sandbox (stopped as wanted, its container gone)
/// costs the runner nothing per second: its worker waits for an
/// assignment change, with no resync timer asking the runtime about it.
#[tokio::test]
async fn a_sandbox_at_rest_is_not_polled() {
    let agent = agent(Failpoints::none());
    agent.runtime.add(ID, Status::Running);
    let (assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Stopped, SandboxState::Running),
    );
    agent
        .control
        .wait_until("stopped reported", |r| reported(r, SandboxState::Stopped))
        .await;
    assign.send_replace(Some(sandbox_only(
        DesiredState::Stopped,
        SandboxState::Stopped,
    )));
    settle().await;
    let before = agent.runtime.observations();
    agent.clock.run_for(ms(120_000), ms(1_000)).await;
    assert_eq!(
        agent.runtime.observations(),
        before,
        "an asleep sandbox was polled"
    );
    // An assignment change still reaches it at once.
    assign.send_replace(Some(sandbox_only(
        DesiredState::Deleted,
        SandboxState::Stopped,
    )));
    agent
        .control
        .wait_until("deleted reported", |r| reported(r, SandboxState::Deleted))
        .await;
}

/// Issue 16: a long-poll answered `unchanged` (the server read nothing: a
/// fleet at rest) leaves every sandbox as it was; no worker is woken and
/// nothing is removed; a change after it still reaches the worker.
#[tokio::test]
async fn an_unchanged_answer_leaves_every_sandbox_as_it_was() {
    let agent = agent(Failpoints::none());
    agent.control.assign(
        vec![assignment(
            ID,
            1,
            DesiredState::Running,
            SandboxState::Starting,
        )],
        Vec::new(),
    );
    let _loop = assignments(&agent);
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    agent.control.assign(
        vec![assignment(
            ID,
            1,
            DesiredState::Running,
            SandboxState::Running,
        )],
        Vec::new(),
    );
    settle().await;
    let calls = agent.runtime.calls().len();
    let requests = agent.control.requests().len();
    // Several long-polls time out on the same set.
    agent.clock.run_for(ms(120_000), ms(1_000)).await;
    assert!(
        agent.control.unchanged_answers() >= 3,
        "{} unchanged answers",
        agent.control.unchanged_answers()
    );
    let after: Vec<Call> = agent.runtime.calls().into_iter().skip(calls).collect();
    assert!(
        !after.iter().any(|c| matches!(
            c,
            Call::RemoveFiles(_) | Call::Delete(_) | Call::Kill(_, _) | Call::Stop(_)
        )),
        "an unchanged answer removed or stopped something: {after:?}"
    );
    assert!(
        agent
            .control
            .requests()
            .into_iter()
            .skip(requests)
            .all(|r| !matches!(r, Request::Sandbox(_, _))),
        "an unchanged answer made the worker report"
    );
    // A change still reaches it.
    agent.control.assign(
        vec![assignment(
            ID,
            1,
            DesiredState::Stopped,
            SandboxState::Running,
        )],
        Vec::new(),
    );
    agent
        .control
        .wait_until("stopped reported", |r| reported(r, SandboxState::Stopped))
        .await;
}

/// Waits for the sandbox's `stopped` report, then checks `command` was
/// reported `not_launched` before it and nothing was launched.
async fn declined_before_stopped(agent: &Agent, command: &str) {
    agent
        .control
        .wait_until("stopped reported", |r| reported(r, SandboxState::Stopped))
        .await;
    let requests = agent.control.requests();
    let declined = requests.iter().position(|r| {
        matches!(r, Request::Command(id, report)
            if id == command && report.state == CommandState::NotLaunched)
    });
    let stopped = requests.iter().position(
        |r| matches!(r, Request::Sandbox(_, report) if report.state == SandboxState::Stopped),
    );
    assert!(
        declined.is_some_and(|declined| Some(declined) < stopped),
        "{requests:?}"
    );
    assert!(
        !agent
            .runtime
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Exec(..))),
        "launched in a sandbox told to stop"
    );
}

/// A command handed over just before its sandbox is told to stop (a stop,
/// or a drain moving it) is never launched, and this runner says so:
/// `not_launched`, reported before the sandbox's stop, where the record
/// would otherwise end it `unknown` (CI's convergence test met that).
#[tokio::test]
async fn a_command_handed_over_to_a_sandbox_told_to_stop_ends_not_launched() {
    let agent = agent(Failpoints::none());
    agent.runtime.add(ID, Status::Running);
    let (_assign, _task) = worker(
        &agent,
        Assigned {
            sandbox: assignment(ID, 1, DesiredState::Stopped, SandboxState::Running),
            commands: vec![command("cmd_fake0001", ID, 1, &["true"])],
            reports_before: FRESH,
        },
    );
    declined_before_stopped(&agent, "cmd_fake0001").await;
}

/// A command handed over while the sandbox is already being stopped (the
/// stop's pass read an assignment without it: a drain moving the sandbox,
/// undone at once, then an exec) is declined before the stop is reported,
/// not left for the record to end `unknown` (CI's convergence test met
/// that: `unknown`, `sandbox_securing`).
#[tokio::test]
async fn a_command_handed_over_during_a_stop_ends_not_launched_before_the_stop_is_reported() {
    let agent = agent(Failpoints::none());
    agent.runtime.add(ID, Status::Running);
    let (assign, _task) = worker(
        &agent,
        sandbox_only(DesiredState::Running, SandboxState::Running),
    );
    settle().await;
    agent.runtime.hold_stops(true);
    assign.send_replace(Some(sandbox_only(
        DesiredState::Stopped,
        SandboxState::Running,
    )));
    agent
        .runtime
        .wait_until("the stop begun", |calls| {
            calls.contains(&Call::Stop(ID.to_owned()))
        })
        .await;
    // Meanwhile the stop was undone and a command handed over, under the
    // same placement.
    assign.send_replace(Some(Assigned {
        sandbox: assignment(ID, 1, DesiredState::Running, SandboxState::Running),
        commands: vec![command("cmd_fake0001", ID, 1, &["true"])],
        reports_before: FRESH,
    }));
    settle().await;
    agent.runtime.hold_stops(false);
    declined_before_stopped(&agent, "cmd_fake0001").await;
}

#[tokio::test]
async fn a_command_that_ends_at_once_without_output_is_reported_once_with_its_pid() {
    let agent = agent(Failpoints::none());
    agent.runtime.next_exec(ExecScript {
        output: Vec::new(),
        outcome: Outcome::Exited { code: 0 },
    });
    let (_assign, _task) = with_command(&agent, &["true"]);
    agent.control.wait_until("the command's end", ended).await;
    let reports = agent.control.command_reports();
    let seen: Vec<_> = reports.iter().map(|r| (r.state, r.pid)).collect();
    // One report: the server records it started and ended at once.
    assert_eq!(
        seen,
        [(CommandState::Exited, Some(super::testing::FAKE_PID))]
    );
    // One that cannot start carries no pid: it never ran.
    let agent = self::agent(Failpoints::none());
    agent.runtime.next_exec(ExecScript {
        output: Vec::new(),
        outcome: Outcome::LaunchFailed {
            failure: LaunchFailure::MissingExecutable,
            message: "no such file".to_owned(),
        },
    });
    let (_assign, _task) = with_command(&agent, &["nope"]);
    agent.control.wait_until("the command's end", ended).await;
    let seen: Vec<_> = agent
        .control
        .command_reports()
        .iter()
        .map(|r| (r.state, r.pid))
        .collect();
    assert_eq!(seen, [(CommandState::LaunchFailed, None)]);
}

/// A runner given no token over a data dir that holds no credential can
/// never register: it says so before it makes anything on the host (a
/// 256 GiB homes image loop-mounted, runtime state, a bridge).
#[tokio::test]
async fn a_runner_that_cannot_register_touches_nothing_on_the_host() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let data_dir = dir.path().join("runner");
    let config = super::AgentConfig::new(
        "http://127.0.0.1:9",
        "",
        data_dir.clone(),
        oci::config::InitProgram {
            host_path: "/nonexistent/roost".into(),
            args: vec!["init".to_owned()],
        },
    );
    let error = super::run(config, std::future::pending())
        .await
        .expect_err("no token, no credential");
    assert!(matches!(error, AgentError::NoToken { .. }), "{error}");
    for made in ["homes.btrfs", "volumes", "network", "runtime"] {
        assert!(
            !data_dir.join(made).exists(),
            "{made} was made before the token was checked"
        );
    }
}

/// A snapshot whose attempt fails (here the store is out of reach) is
/// tried again after a pause, as DESIGN §3 asks (it keeps trying until
/// replicated or failed by its deadline), not left `local` for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_failed_is_tried_again_after_a_pause() {
    let agent = agent(Failpoints::none());
    agent
        .shared
        .homes
        .durable_without_btrfs
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let mut sandbox = assignment(ID, 1, DesiredState::Stopped, SandboxState::Stopped);
    sandbox.storage_class = StorageClass::Durable;
    sandbox.snapshots = vec![api::runners::SnapshotAssignment {
        snapshot_id: "snp_again".to_owned(),
        durability: "pending".to_owned(),
    }];
    let (_assign, _task) = worker(
        &agent,
        Assigned {
            sandbox,
            commands: Vec::new(),
            reports_before: FRESH,
        },
    );
    let captures = |requests: &[Request]| {
        requests
            .iter()
            .filter(|r| matches!(r, Request::Snapshot(id, report) if id == "snp_again" && report.durability == "local"))
            .count()
    };
    agent
        .control
        .wait_until("captured once", |r| captures(r) == 1)
        .await;
    let first_at = agent.clock.elapsed();
    // The upload fails on the wall clock (a refused connection); then the
    // pause runs on the simulated one.
    while captures(&agent.control.requests()) < 2 {
        assert!(
            agent.clock.elapsed() < first_at + ms(60_000),
            "not tried again: {:?}",
            agent.control.requests()
        );
        agent.clock.run_for(ms(1_000), ms(1_000)).await;
        tokio::time::sleep(ms(20)).await;
    }
    assert!(
        agent.clock.elapsed() >= first_at + ms(5_000),
        "tried again after {:?}, before the pause",
        agent.clock.elapsed() - first_at
    );
    assert!(
        !agent
            .control
            .requests()
            .iter()
            .any(|r| matches!(r, Request::Snapshot(_, report) if report.durability != "local")),
        "neither replicated nor failed: {:?}",
        agent.control.requests()
    );
}

/// A block service whose every answer is 429 `quota_exceeded`: the
/// org is past its bound on the store. Its URL.
async fn block_service_past_the_orgs_bound() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let url = format!("http://{}", listener.local_addr().expect("an address"));
    let refused = || async {
        let body = serde_json::json!({"error": {
            "code": "quota_exceeded",
            "message": "org acme stores 2 MiB, its bound is 1 MiB",
            "details": {"quota": {"metric": "store_bytes", "limit": 1, "current": 2}},
            "request_id": "req_fake",
        }});
        (
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            [("content-type", "application/json"), ("retry-after", "60")],
            body.to_string(),
        )
    };
    let app = axum::Router::new().fallback(refused);
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A stop's securing refused because the org is past its bound on the
/// store is reported with the refusal, the home kept, and tried again
/// after pauses that double to a minute, not every few seconds: each
/// attempt scans the home, and waiting seconds frees no room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_securing_refused_for_room_is_tried_again_ever_less_often() {
    let agent = agent(Failpoints::none());
    agent
        .shared
        .homes
        .durable_without_btrfs
        .store(true, std::sync::atomic::Ordering::Relaxed);
    agent
        .control
        .blocks_at(&block_service_past_the_orgs_bound().await);
    let durable = |desired, state| {
        let mut sandbox = assignment(ID, 1, desired, state);
        sandbox.storage_class = StorageClass::Durable;
        Assigned {
            sandbox,
            commands: Vec::new(),
            reports_before: FRESH,
        }
    };
    let (assign, _task) = worker(
        &agent,
        durable(DesiredState::Running, SandboxState::Starting),
    );
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    let home = agent.shared.homes.path(ID).expect("the home's path");
    std::fs::write(home.join("work.txt"), "unsaved\n").expect("the workload writes");

    assign.send_replace(Some(durable(DesiredState::Stopped, SandboxState::Running)));
    let failures = |requests: &[Request]| -> Vec<String> {
        requests
            .iter()
            .filter_map(|r| match r {
                Request::Save(_, report) if report.outcome == "failed" => {
                    Some(report.error.clone().unwrap_or_default())
                }
                _ => None,
            })
            .collect()
    };
    agent
        .control
        .wait_until("securing failed", |r| !failures(r).is_empty())
        .await;
    let first = failures(&agent.control.requests());
    assert!(
        first[0].contains("quota_exceeded") && first[0].contains("its bound is 1 MiB"),
        "the refusal is reported as it came: {first:?}"
    );
    // Tried again after pauses that double, to a minute: when each of the
    // next four attempts came, on the clock.
    let mut at = vec![agent.clock.elapsed()];
    while at.len() < 5 {
        assert!(
            agent.clock.elapsed() < ms(300_000),
            "attempts at {at:?} in 300 s"
        );
        agent.clock.run_for(ms(1_000), ms(1_000)).await;
        // An attempt runs on the wall clock (a scan, a request).
        tokio::time::sleep(ms(20)).await;
        if failures(&agent.control.requests()).len() > at.len() {
            at.push(agent.clock.elapsed());
        }
    }
    let gaps: Vec<u64> = at.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect();
    assert!(
        gaps[0] >= 4 && gaps.windows(2).all(|g| g[1] >= g[0]) && gaps[3] >= 35,
        "pauses of {gaps:?} s between attempts"
    );
    assert_eq!(
        std::fs::read_to_string(home.join("work.txt")).expect("the home stays"),
        "unsaved\n"
    );
}

/// Runs a durable sandbox (epoch 1), writes `work.txt` in its home after
/// its last save, stops it with the `securing` report failing (the
/// runner drained, `stopping` reported, the container stopped), then
/// starts it again: recorded `stopping`, the container gone, the last
/// completed save as its root. `forget_placement`: the record of the
/// placement launched here is lost first. Returns when the sandbox was
/// launched again or waits for the store (the fake store is out of reach).
async fn started_again_while_stopping(forget_placement: bool) -> (Agent, std::path::PathBuf) {
    let agent = agent(Failpoints::none());
    agent
        .shared
        .homes
        .durable_without_btrfs
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let durable = |desired, state, home_root: Option<String>| {
        let mut sandbox = assignment(ID, 1, desired, state);
        sandbox.storage_class = StorageClass::Durable;
        sandbox.home_root = home_root;
        Assigned {
            sandbox,
            commands: Vec::new(),
            reports_before: FRESH,
        }
    };
    let (assign, task) = worker(
        &agent,
        durable(DesiredState::Running, SandboxState::Starting, None),
    );
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    // A save completed (the record names it), then the workload wrote on.
    let last_save = store::Digest::of(b"the last completed save").to_hex();
    let home = agent.shared.homes.path(ID).expect("the home's path");
    std::fs::write(home.join("work.txt"), "unsaved\n").expect("the workload writes");

    // Stopped: `stopping` is accepted, the `securing` report is not.
    agent.control.answer_next(Kind::Sandbox, Scripted::Ok);
    agent.control.answer(Kind::Sandbox, Scripted::Unreachable);
    assign.send_replace(Some(durable(
        DesiredState::Stopped,
        SandboxState::Running,
        Some(last_save.clone()),
    )));
    agent
        .control
        .wait_until("securing tried", |r| reported(r, SandboxState::Securing))
        .await;
    assert_eq!(agent.runtime.status(ID), None, "the container is gone");
    if forget_placement {
        let placement = agent
            .shared
            .data
            .sandbox_paths(&SandboxId::new(ID.to_owned()).expect("an id"))
            .expect("the sandbox's paths")
            .dir()
            .join("placement");
        std::fs::remove_file(placement).expect("the placement was recorded");
    }

    // Started again.
    agent.control.answer(Kind::Sandbox, Scripted::Ok);
    assign.send_replace(Some(durable(
        DesiredState::Running,
        SandboxState::Stopping,
        Some(last_save),
    )));
    agent
        .control
        .wait_until("launched again, or waiting for the store", |r| {
            running_reports(r) == 2 || store_waits(r) > 0
        })
        .await;
    drop(assign);
    let _ = task.await;
    (agent, home)
}

fn running_reports(requests: &[Request]) -> usize {
    requests
        .iter()
        .filter(
            |r| matches!(r, Request::Sandbox(_, report) if report.state == SandboxState::Running),
        )
        .count()
}

fn store_waits(requests: &[Request]) -> usize {
    requests
        .iter()
        .filter(|r| matches!(r, Request::Sandbox(_, report) if report.state == SandboxState::Starting && report.reason.is_some()))
        .count()
}

/// A durable sandbox started again while its stop had not secured the
/// home used to be launched on the last completed save, undoing every
/// write since it (here, the fake store out of reach, the home was marked
/// an unfinished restore, which nothing secures, and the launch waited).
/// This placement ran on the home: it runs on as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_home_started_again_while_stopping_keeps_its_unsaved_work() {
    let (agent, home) = started_again_while_stopping(false).await;
    assert_eq!(
        running_reports(&agent.control.requests()),
        2,
        "launched on the home as it is: {:?}",
        agent.control.sandbox_reports()
    );
    assert_eq!(
        std::fs::read_to_string(home.join("work.txt")).expect("the work is still there"),
        "unsaved\n"
    );
    assert!(!agent.shared.homes.restore_unfinished(ID));
    assert!(
        agent.shared.homes.kept_copies().expect("listed").is_empty(),
        "the home was run on, not set aside"
    );
}

/// The same, with no record that this placement ran on the home: whatever
/// the record's state (here `stopping`), a home no stop secured is set
/// aside, whole, before the last save is restored over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_no_stop_secured_is_kept_aside_before_a_restore_whatever_the_state() {
    let (agent, _home) = started_again_while_stopping(true).await;
    assert_eq!(
        store_waits(&agent.control.requests()),
        1,
        "the restore waits"
    );
    let copies = agent.shared.homes.kept_copies().expect("listed");
    let [(id, name)] = copies.as_slice() else {
        panic!("one kept copy: {copies:?}");
    };
    let kept = agent
        .shared
        .data
        .root()
        .join("volumes/kept")
        .join(id)
        .join(name);
    assert_eq!(
        std::fs::read_to_string(kept.join("work.txt")).expect("the work is kept"),
        "unsaved\n"
    );
}

/// Audit finding: a snapshot of a stopped sandbox reads the home itself
/// (no read-only copy of it); a start during it let the sandbox's root
/// swap a directory not yet read for a symlink to the host's files, which
/// the scan then read into the org's store. The launch now waits until no
/// such snapshot is reading the home.
#[tokio::test]
async fn a_stopped_sandbox_does_not_start_while_a_snapshot_reads_its_home() {
    let agent = agent(Failpoints::none());
    let home = agent.shared.homes.path(ID).expect("the home's path");
    std::fs::create_dir_all(&home).expect("a home");
    std::fs::write(home.join("notes"), "work").expect("a file");
    let snapshot = api::runners::SnapshotAssignment {
        snapshot_id: "snp_fake0001".to_owned(),
        durability: "replicated".to_owned(),
    };
    let mut stopped = sandbox_only(DesiredState::Stopped, SandboxState::Stopped);
    stopped.sandbox.snapshots = vec![snapshot.clone()];
    // The snapshot's first report never answers: it stays under way.
    agent.control.answer(Kind::Snapshot, Scripted::Hangs);
    let (assign, _task) = worker(&agent, stopped);
    agent
        .control
        .wait_until("the snapshot under way", |r| {
            r.iter().any(|r| matches!(r, Request::Snapshot(..)))
        })
        .await;
    let mut starting = sandbox_only(DesiredState::Running, SandboxState::Starting);
    starting.sandbox.snapshots = vec![snapshot];
    assign.send_replace(Some(starting.clone()));
    agent.clock.run_for(ms(5_000), ms(100)).await;
    assert!(
        !agent
            .runtime
            .calls()
            .iter()
            .any(|call| matches!(call, Call::Launch(_))),
        "launched while the snapshot reads the home: {:?}",
        agent.runtime.calls()
    );
    // The snapshot is done (the server no longer assigns it): the launch
    // goes ahead.
    starting.sandbox.snapshots = Vec::new();
    assign.send_replace(Some(starting));
    agent.clock.run_for(ms(1_000), ms(100)).await;
    agent
        .control
        .wait_until("running reported", |r| reported(r, SandboxState::Running))
        .await;
    assert!(
        agent
            .runtime
            .calls()
            .iter()
            .any(|call| matches!(call, Call::Launch(_)))
    );
}
