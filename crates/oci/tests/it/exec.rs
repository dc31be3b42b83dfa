//! Commands: every end maps to exactly one outcome, told apart the way the
//! runtime lets them be told apart.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use oci::{
    CommandEnd, CommandSpec, Error, Execution, LaunchFailure, Limits, Outcome, Signal, Stream,
};

use crate::support::TestSandbox;

/// Drives `execution` in a task; returns once it printed `ready` on
/// stdout, so a signal finds the program running.
async fn when_ready(execution: Execution) -> tokio::task::JoinHandle<oci::Result<CommandEnd>> {
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let mut ready_tx = Some(ready_tx);
    let waiter = tokio::spawn(execution.wait(move |stream, bytes| {
        if stream == Stream::Stdout
            && bytes.starts_with(b"ready")
            && let Some(tx) = ready_tx.take()
        {
            let _ = tx.send(());
        }
    }));
    tokio::time::timeout(Duration::from_secs(10), ready_rx)
        .await
        .expect("the command printed ready")
        .expect("ready sent");
    waiter
}

#[tokio::test]
async fn exit_codes_output_env_and_cwd() {
    let t = TestSandbox::start("exec", Limits::default()).await;
    let ran = t.sh("echo out; echo err >&2; exit 3").await;
    assert_eq!(ran.end.outcome, Outcome::Exited { code: 3 });
    assert_eq!(ran.stdout, "out\n");
    assert_eq!(ran.stderr, "err\n");

    let mut command = CommandSpec::new(["sh", "-c", "pwd; echo $GREETING; echo $HOME"]);
    command.env = BTreeMap::from([("GREETING".to_owned(), "hi there".to_owned())]);
    command.cwd = Some("/tmp".to_owned());
    let ran = t.run(&command).await;
    assert_eq!(ran.end.outcome, Outcome::Exited { code: 0 });
    assert_eq!(ran.stdout, "/tmp\nhi there\n/workspace\n");

    // Large output arrives whole and in order, in chunks while it runs.
    let ran = t.sh("seq 1 200000").await;
    assert_eq!(ran.end.outcome, Outcome::Exited { code: 0 });
    let expected: String = (1..=200_000).map(|n| format!("{n}\n")).collect();
    assert!(
        ran.stdout == expected,
        "output differs ({} bytes)",
        ran.stdout.len()
    );
}

#[tokio::test]
async fn exit_127_is_the_programs_own_but_a_missing_executable_is_launch_failed() {
    let t = TestSandbox::start("launch", Limits::default()).await;

    let ran = t.sh("exit 127").await;
    assert_eq!(ran.end.outcome, Outcome::Exited { code: 127 });
    // And so is 255, the status runc itself uses for its own failures.
    let ran = t.sh("exit 255").await;
    assert_eq!(ran.end.outcome, Outcome::Exited { code: 255 });
    // A shell that cannot find a program exits 127 itself: it launched.
    let ran = t.sh("no-such-program-here").await;
    assert_eq!(ran.end.outcome, Outcome::Exited { code: 127 });

    let ran = t
        .run(&CommandSpec::new(["no-such-program-here", "x"]))
        .await;
    let Outcome::LaunchFailed { failure, message } = &ran.end.outcome else {
        panic!("missing executable gave {:?}", ran.end.outcome);
    };
    assert_eq!(*failure, LaunchFailure::MissingExecutable, "{message}");
    assert!(message.contains("no-such-program-here"), "{message}");
    assert!(message.contains("not found"), "{message}");

    let ran = t.run(&CommandSpec::new(["/workspace/absent"])).await;
    assert!(
        matches!(
            &ran.end.outcome,
            Outcome::LaunchFailed { failure: LaunchFailure::MissingExecutable, message }
                if message.contains("/workspace/absent")
        ),
        "{:?}",
        ran.end.outcome
    );
}

#[tokio::test]
async fn a_bad_cwd_is_launch_failed() {
    let t = TestSandbox::start("cwd", Limits::default()).await;
    let mut command = CommandSpec::new(["true"]);
    command.cwd = Some("/no/such/dir".to_owned());
    let ran = t.run(&command).await;
    let Outcome::LaunchFailed { failure, message } = &ran.end.outcome else {
        panic!("bad cwd gave {:?}", ran.end.outcome);
    };
    assert_eq!(*failure, LaunchFailure::BadCwd, "{message}");
    assert!(message.contains("/no/such/dir"), "{message}");

    // Relative cwds and empty argvs never reach the runtime.
    command.cwd = Some("relative".to_owned());
    assert!(matches!(
        t.sandbox.exec(&command).await,
        Err(Error::Invalid(_))
    ));
    let empty = CommandSpec::new(Vec::<String>::new());
    assert!(matches!(
        t.sandbox.exec(&empty).await,
        Err(Error::Invalid(_))
    ));
}

#[tokio::test]
async fn a_timeout_ends_the_command_as_timed_out() {
    let t = TestSandbox::start("timeout", Limits::default()).await;
    let mut command = CommandSpec::new(["sleep", "30"]);
    command.timeout = Some(Duration::from_millis(500));
    let started = Instant::now();
    let ran = t.run(&command).await;
    assert_eq!(ran.end.outcome, Outcome::TimedOut);
    assert_eq!(ran.end.runtime_status, Some(128 + 15), "SIGTERM ended it");
    assert!(started.elapsed() < Duration::from_secs(5));

    // A program that ignores SIGTERM gets SIGKILL after the grace; its
    // child in the same process group is ended too.
    let mut command = CommandSpec::new([
        "sh",
        "-c",
        "trap '' TERM; sleep 30 & echo $! > /workspace/child; wait",
    ]);
    command.timeout = Some(Duration::from_millis(300));
    command.kill_grace = Duration::from_millis(300);
    let ran = t.run(&command).await;
    assert_eq!(ran.end.outcome, Outcome::TimedOut);
    assert_eq!(ran.end.runtime_status, Some(128 + 9), "SIGKILL ended it");
    let child = std::fs::read_to_string(t.workspace.join("child")).expect("child pid");
    // Killed at once; give the init a moment to reap the zombie.
    let check = t
        .sh(&format!(
            "for i in $(seq 100); do [ -e /proc/{0} ] || {{ echo gone; exit; }}; sleep 0.02; done; cat /proc/{0}/stat",
            child.trim()
        ))
        .await;
    assert_eq!(check.stdout.trim(), "gone", "the group's sleep survived");
}

#[tokio::test]
async fn a_signal_through_the_api_is_interrupted() {
    let t = TestSandbox::start("signal", Limits::default()).await;
    let execution = t
        .sandbox
        .exec(&CommandSpec::new(["sh", "-c", "echo ready; exec sleep 30"]))
        .await
        .expect("exec");
    let signaller = execution.signaller();
    let waiter = when_ready(execution).await;
    assert!(signaller.send(Signal::Int));
    let end = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("ends")
        .expect("join")
        .expect("wait");
    assert_eq!(
        end.outcome,
        Outcome::Interrupted {
            signal: Signal::Int
        }
    );
    assert!(!signaller.send(Signal::Term), "the command has ended");

    // A signal sent before the process even exists is held and delivered.
    let execution = t
        .sandbox
        .exec(&CommandSpec::new(["sleep", "30"]))
        .await
        .expect("exec");
    execution.signaller().send(Signal::Term);
    let end = tokio::time::timeout(Duration::from_secs(10), execution.wait(|_, _| {}))
        .await
        .expect("ends")
        .expect("wait");
    assert_eq!(
        end.outcome,
        Outcome::Interrupted {
            signal: Signal::Term
        }
    );

    // A program that handles the signal and exits on its own terms keeps
    // its own code.
    let execution = t
        .sandbox
        .exec(&CommandSpec::new([
            "sh",
            "-c",
            "trap 'exit 5' USR1; echo ready; while :; do sleep 0.05; done",
        ]))
        .await
        .expect("exec");
    let signaller = execution.signaller();
    let waiter = when_ready(execution).await;
    signaller.send(Signal::Usr1);
    let end = waiter.await.expect("join").expect("wait");
    assert_eq!(end.outcome, Outcome::Exited { code: 5 });
}

#[tokio::test]
async fn exec_needs_a_running_sandbox() {
    let t = TestSandbox::start("notrunning", Limits::default()).await;
    t.sandbox.stop(Duration::from_secs(10)).await.expect("stop");
    let refused = t
        .sandbox
        .exec(&CommandSpec::new(["true"]))
        .await
        .expect_err("exec into a stopped sandbox");
    assert!(
        matches!(
            refused,
            Error::NotRunning {
                status: oci::Status::Stopped,
                ..
            }
        ),
        "{refused}"
    );
    // Without asking the runtime first (the agent's path), the runtime's
    // own refusal says the same, as a type.
    let ran = t
        .sandbox
        .exec_seen_running(&CommandSpec::new(["true"]))
        .await
        .expect("exec started")
        .wait(|_, _| {})
        .await
        .expect("an end");
    assert!(
        matches!(
            ran.outcome,
            Outcome::LaunchFailed {
                failure: LaunchFailure::SandboxNotRunning,
                ..
            }
        ),
        "{:?}",
        ran.outcome
    );
    t.sandbox.delete().await.expect("delete");
    let refused = t
        .sandbox
        .exec(&CommandSpec::new(["true"]))
        .await
        .expect_err("exec into a deleted sandbox");
    assert!(matches!(refused, Error::NotFound { .. }), "{refused}");
}

#[tokio::test]
async fn commands_killed_by_a_stopping_sandbox_are_interrupted() {
    let t = TestSandbox::start("stopcmd", Limits::default()).await;
    let execution = t
        .sandbox
        .exec(&CommandSpec::new([
            "sh",
            "-c",
            "trap '' TERM; echo ready; sleep 30",
        ]))
        .await
        .expect("exec");
    let waiter = when_ready(execution).await;
    t.sandbox.stop(Duration::from_secs(10)).await.expect("stop");
    let end = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("ends")
        .expect("join")
        .expect("wait");
    assert_eq!(
        end.outcome,
        Outcome::Interrupted {
            signal: Signal::Kill
        }
    );
}
