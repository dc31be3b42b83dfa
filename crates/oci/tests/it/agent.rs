//! The sandbox's agent (`oci::agent`): commands run by the init itself,
//! attached again after their reader went away, stdin, listings with pids,
//! and requests a hostile or confused peer could send.

use std::time::Duration;

use oci::{CommandSpec, Error, Limits, Outcome, Stream};

use crate::support::TestSandbox;

/// Collects output by stream.
#[derive(Default)]
struct Collected {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl Collected {
    fn take(&mut self, stream: Stream, bytes: &[u8]) {
        match stream {
            Stream::Stdout => self.stdout.extend_from_slice(bytes),
            Stream::Stderr => self.stderr.extend_from_slice(bytes),
        }
    }
}

#[tokio::test]
async fn a_command_survives_its_reader_and_is_attached_again_with_every_byte_once() {
    let t = TestSandbox::start("attach", Limits::default()).await;
    let sandbox = &t.sandbox;
    let listing = sandbox.agent_listing().await.expect("listing");
    // Two streams, 2 MB each, far past what the agent holds unread: the
    // command blocks on its writes while nobody reads (back-pressure).
    let script = "i=0; while [ $i -lt 20000 ]; do echo \"out $i padding-padding-padding-padding-padding-padding-padding-padding-padding\"; echo \"err $i\" >&2; i=$((i+1)); done; exit 7";
    let command = CommandSpec::new(["sh", "-c", script]);
    let first = sandbox
        .run_in_agent("cmd_attach", &listing.incarnation, &command, [0, 0])
        .await
        .expect("run");
    assert!(first.fresh());
    let pid = first.pid().expect("a pid");
    // Read a little, then go away mid-run (as a runner restart would).
    let mut collected = Collected::default();
    {
        let mut partial = Collected::default();
        let reading = first.wait(|stream, bytes| partial.take(stream, bytes));
        let _ = tokio::time::timeout(Duration::from_millis(50), reading).await;
        collected.stdout.extend(partial.stdout);
        collected.stderr.extend(partial.stderr);
    }
    let listed = sandbox.agent_listing().await.expect("listing");
    assert_eq!(listed.incarnation, listing.incarnation);
    let entry = listed
        .commands
        .iter()
        .find(|c| c.id == "cmd_attach")
        .expect("the command is listed");
    assert_eq!(entry.pid, pid);

    // Attached again from what was taken: the rest, once, then the end.
    let from = [collected.stdout.len() as u64, collected.stderr.len() as u64];
    let again = sandbox
        .run_in_agent("cmd_attach", &listing.incarnation, &command, from)
        .await
        .expect("attach");
    assert!(
        !again.fresh(),
        "asking again attaches, never starts it twice"
    );
    assert_eq!(again.pid(), Some(pid));
    let end = again
        .wait(|stream, bytes| collected.take(stream, bytes))
        .await
        .expect("an end");
    assert_eq!(end.outcome, Outcome::Exited { code: 7 });
    let expected_out: String = (0..20000)
        .map(|i| {
            format!(
                "out {i} padding-padding-padding-padding-padding-padding-padding-padding-padding\n"
            )
        })
        .collect();
    let expected_err: String = (0..20000).map(|i| format!("err {i}\n")).collect();
    assert!(
        collected.stdout == expected_out.as_bytes(),
        "stdout differs ({} bytes)",
        collected.stdout.len()
    );
    assert!(
        collected.stderr == expected_err.as_bytes(),
        "stderr differs ({} bytes)",
        collected.stderr.len()
    );

    // An ended command stays until forgotten (a runner that has not
    // recorded the end may still ask), then is gone.
    let listed = sandbox.agent_listing().await.expect("listing");
    assert!(
        listed
            .commands
            .iter()
            .any(|c| c.id == "cmd_attach" && !c.running)
    );
    sandbox.agent_forget("cmd_attach").await.expect("forget");
    let listed = sandbox.agent_listing().await.expect("listing");
    assert!(listed.commands.iter().all(|c| c.id != "cmd_attach"));

    // An offset the agent no longer holds is refused by code.
    let late = sandbox
        .run_in_agent(
            "cmd_attach2",
            &listing.incarnation,
            &CommandSpec::new(["true"]),
            [5, 0],
        )
        .await
        .expect_err("an offset past a fresh command's output");
    assert!(
        matches!(&late, Error::Agent { code, .. } if code == "offset_unavailable"),
        "{late}"
    );
}

#[tokio::test]
async fn stdin_reaches_the_command_and_closing_it_ends_the_input() {
    let t = TestSandbox::start("stdin", Limits::default()).await;
    let sandbox = &t.sandbox;
    let incarnation = sandbox.agent_listing().await.expect("listing").incarnation;
    let mut command = CommandSpec::new(["sh", "-c", "wc -c; echo done >&2"]);
    command.stdin = true;
    let execution = sandbox
        .run_in_agent("cmd_stdin", &incarnation, &command, [0, 0])
        .await
        .expect("run");
    let mut stdin = sandbox.agent_stdin("cmd_stdin").await.expect("stdin");
    // 3 MiB: more than one frame and more than a pipe holds.
    let bytes = vec![b'x'; 3 * 1024 * 1024];
    let writing = async {
        stdin.write(&bytes).await.expect("write");
        stdin.close().await.expect("close");
    };
    let mut collected = Collected::default();
    let (end, ()) = tokio::join!(execution.wait(|s, b| collected.take(s, b)), writing);
    assert_eq!(end.expect("end").outcome, Outcome::Exited { code: 0 });
    assert_eq!(
        String::from_utf8_lossy(&collected.stdout).trim(),
        (3 * 1024 * 1024).to_string()
    );
    assert_eq!(collected.stderr, b"done\n");

    // Written after its end, or to a command without stdin: a code.
    let refused = match sandbox.agent_stdin("cmd_stdin").await {
        Ok(mut again) => match again.write(b"late").await {
            Ok(()) => again.close().await.expect_err("stdin is gone"),
            Err(err) => err,
        },
        Err(err) => err,
    };
    assert!(
        matches!(&refused, Error::Agent { code, .. } if code == "stdin_unavailable"),
        "{refused}"
    );
}

#[tokio::test]
async fn hostile_requests_get_a_code_and_the_agent_keeps_serving() {
    let t = TestSandbox::start("hostile", Limits::default()).await;
    let sandbox = &t.sandbox;
    let incarnation = sandbox.agent_listing().await.expect("listing").incarnation;
    let refused = |result: oci::Result<oci::AgentExecution>| match result {
        Err(Error::Agent { code, .. }) => code,
        Err(other) => panic!("not the agent's refusal: {other}"),
        Ok(_) => panic!("accepted"),
    };
    let nul = CommandSpec::new(["echo", "a\0b"]);
    assert_eq!(
        refused(
            sandbox
                .run_in_agent("cmd_nul", &incarnation, &nul, [0, 0])
                .await
        ),
        "bad_request"
    );
    let plain = CommandSpec::new(["true"]);
    assert_eq!(
        refused(
            sandbox
                .run_in_agent("../x", &incarnation, &plain, [0, 0])
                .await
        ),
        "bad_request"
    );
    assert_eq!(
        refused(
            sandbox
                .run_in_agent("cmd_other", "not-this-one", &plain, [0, 0])
                .await
        ),
        "incarnation_mismatch"
    );
    // A signal to an ended command is dropped, not sent to a reused pid.
    let ran = sandbox
        .run_in_agent("cmd_ended", &incarnation, &plain, [0, 0])
        .await
        .expect("run");
    let signaller = ran.signaller();
    let end = ran.wait(|_, _| {}).await.expect("end");
    assert_eq!(end.outcome, Outcome::Exited { code: 0 });
    assert!(!signaller.send(oci::Signal::Term), "the command has ended");

    // Still serving.
    assert_eq!(t.sh_ok("echo fine").await, "fine\n");
}

/// A command on a terminal of its own (issue 15, point 3): it sees a tty
/// of the asked size as its controlling terminal, reads input typed into
/// it, sees a resize, and ends with its own status; sizes of 0 or 65535
/// are refused by code.
#[tokio::test]
async fn a_terminal_command_reads_typed_input_and_follows_a_resize() {
    let t = TestSandbox::start("tty", Limits::default()).await;
    let sandbox = &t.sandbox;
    let incarnation = sandbox.agent_listing().await.expect("listing").incarnation;
    let script = "stty size; tty >/dev/null && echo on-a-tty; read line; echo \"got $line\"; \
                  trap 'stty size; exit 5' WINCH; echo ready; while true; do sleep 0.05; done";
    let mut command = CommandSpec::new(["sh", "-c", script]);
    command.tty = Some((24, 80));
    let execution = sandbox
        .run_in_agent("cmd_tty", &incarnation, &command, [0, 0])
        .await
        .expect("run");
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    let driving = tokio::spawn(execution.wait(move |stream, bytes| {
        assert_eq!(stream, Stream::Stdout, "a terminal has one stream");
        let _ = seen_tx.send(bytes.to_vec());
    }));
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut wait_for = async |needle: &'static str, seen: &mut Vec<u8>| {
        loop {
            if String::from_utf8_lossy(seen).contains(needle) {
                return;
            }
            let chunk = tokio::time::timeout_at(deadline, seen_rx.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!("never saw {needle:?}: {}", String::from_utf8_lossy(seen))
                })
                .expect("output");
            seen.extend(chunk);
        }
    };
    wait_for("on-a-tty", &mut seen).await;
    assert!(
        String::from_utf8_lossy(&seen).contains("24 80"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    let mut stdin = sandbox.agent_stdin("cmd_tty").await.expect("stdin");
    stdin.write(b"typed words\r").await.expect("type");
    wait_for("ready", &mut seen).await;
    let text = String::from_utf8_lossy(&seen).into_owned();
    assert!(text.contains("typed words"), "the terminal echoes: {text}");
    assert!(text.contains("got typed words"), "{text}");
    for (rows, cols) in [(0, 80), (24, 0), (65535, 80)] {
        let refused = sandbox
            .agent_resize("cmd_tty", rows, cols)
            .await
            .expect_err("refused");
        assert!(
            matches!(&refused, Error::Agent { code, .. } if code == "bad_request"),
            "{refused}"
        );
    }
    sandbox
        .agent_resize("cmd_tty", 40, 120)
        .await
        .expect("resize");
    let end = driving.await.expect("join").expect("an end");
    while let Ok(chunk) = seen_rx.try_recv() {
        seen.extend(chunk);
    }
    assert_eq!(end.outcome, Outcome::Exited { code: 5 });
    assert!(
        String::from_utf8_lossy(&seen).contains("40 120"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    // A command without a terminal cannot be resized.
    let plain = sandbox
        .run_in_agent(
            "cmd_plain",
            &incarnation,
            &CommandSpec::new(["sleep", "5"]),
            [0, 0],
        )
        .await
        .expect("run");
    let refused = sandbox
        .agent_resize("cmd_plain", 10, 10)
        .await
        .expect_err("no terminal");
    assert!(
        matches!(&refused, Error::Agent { code, .. } if code == "no_terminal"),
        "{refused}"
    );
    plain.signaller().send(oci::Signal::Kill);
    drop(plain);
}
