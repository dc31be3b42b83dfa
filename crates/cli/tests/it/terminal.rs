//! `roost shell` as a person uses it (issue 15, point 3): inside tmux, with
//! keys sent and the screen read back: a prompt, typed commands and an
//! interactive program's answers, a window resize reaching the sandbox's
//! terminal, and the shell's exit status becoming roost's.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

use crate::harness::BIN;
use crate::runner_e2e::Stack;

/// A tmux server of this test's own (its socket name), killed when done.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let output = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux (scripts/test.sh installs it)");
        assert!(output.status.success(), "tmux {args:?}: {output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "t"])
    }

    /// Waits until the screen shows `needle`.
    fn wait_for(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let screen = self.screen();
            if screen.contains(needle) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "never saw {needle:?} on the screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "t"];
        args.extend_from_slice(keys);
        self.run(&args);
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .arg("kill-server")
            .output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roost_shell_in_tmux_is_a_real_terminal() {
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    assert!(Path::new(BIN).exists());
    let tmux = Tmux {
        socket: format!("roost-test-{}", std::process::id()),
    };
    let status_dir = tempfile::tempdir().expect("tempdir");
    let status_file = status_dir.path().join("status");
    // roost's exit status goes to a file when it ends (read below).
    let shell = format!(
        "env ROOST_URL={} ROOST_TOKEN={} {BIN} shell {sid} --env PS1='roost$ ' -- sh; echo $? > {}",
        api.url,
        api.token,
        status_file.display()
    );
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "t",
        "-x",
        "100",
        "-y",
        "30",
        &shell,
    ]);
    // The pane stays after roost exits.
    tmux.run(&["set-option", "-t", "t", "remain-on-exit", "on"]);
    tmux.wait_for("roost$");

    // Typed at the prompt; the shell's own arithmetic answers.
    tmux.keys(&["echo $((6*7))", "Enter"]);
    tmux.wait_for("42");
    // An interactive program reads a line typed on the terminal.
    tmux.keys(&["read name; echo \"hello, $name\"", "Enter"]);
    tmux.keys(&["world", "Enter"]);
    tmux.wait_for("hello, world");
    // It is a terminal, and it has the window's size; a resize follows.
    tmux.keys(&["tty; stty size", "Enter"]);
    tmux.wait_for("30 100");
    tmux.run(&["resize-window", "-t", "t", "-x", "120", "-y", "40"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        tmux.keys(&["stty size", "Enter"]);
        std::thread::sleep(Duration::from_millis(300));
        if tmux.screen().contains("40 120") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the resize never reached the sandbox:\n{}",
            tmux.screen()
        );
    }
    // Ctrl-C goes to the sandbox (raw mode), not to roost.
    tmux.keys(&["sleep 100", "Enter"]);
    std::thread::sleep(Duration::from_millis(300));
    tmux.keys(&["C-c"]);
    tmux.keys(&["echo after-interrupt", "Enter"]);
    tmux.wait_for("after-interrupt\n");
    // The shell's exit status is roost's.
    tmux.keys(&["exit 3", "Enter"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = std::fs::read_to_string(&status_file).unwrap_or_default();
        if status.trim() == "3" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "roost shell did not exit 3: {status:?}\n{}",
            tmux.screen()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The command's record says so too, with its terminal.
    let commands = api.get(&format!("/v1/sandboxes/{sid}/commands")).await;
    let shell_record = &commands.body["commands"][0];
    assert_eq!(shell_record["state"], "exited", "{commands:?}");
    assert_eq!(shell_record["exit_code"], 3);
    assert_eq!(shell_record["tty"], json!({"rows": 30, "cols": 100}));
    stack.runner.assert_no_errors();
}

/// Reads a WebSocket until `needle` arrived (binary output, in order) or
/// the exit message; returns the bytes and the exit message, if any.
async fn read_socket<S>(socket: &mut S, needle: Option<&str>) -> (String, Option<serde_json::Value>)
where
    S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    use futures::StreamExt;
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if needle.is_some_and(|n| text.contains(n)) {
            return (text, None);
        }
        let message = tokio::time::timeout_at(deadline, socket.next())
            .await
            .unwrap_or_else(|_| panic!("nothing more on the socket; so far {text:?}"));
        match message {
            Some(Ok(Message::Binary(bytes))) => text.push_str(&String::from_utf8_lossy(&bytes)),
            Some(Ok(Message::Text(exit))) => {
                return (text, serde_json::from_str(&exit).ok());
            }
            Some(Ok(_)) => {}
            None | Some(Err(_)) => return (text, None),
        }
    }
}

async fn connect(
    api: &crate::plane::Api,
    path: &str,
) -> Result<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    tokio_tungstenite::tungstenite::Error,
> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let url = format!("{}{path}", api.url.replacen("http://", "ws://", 1));
    let mut request = url.into_client_request().expect("request");
    request.headers_mut().insert(
        "authorization",
        format!("Bearer {}", api.token).parse().expect("header"),
    );
    tokio_tungstenite::connect_async(request)
        .await
        .map(|(socket, _)| socket)
}

/// Issue 15, points 3 and 4: a command attached over a WebSocket is
/// attached again from an offset (nothing repeated), another org cannot
/// attach, and when the sandbox stops the stream ends at once with the
/// command's honest end, never hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_resumes_from_its_offset_and_ends_with_the_commands_end() {
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let created = api
        .post(
            &commands,
            json!({"argv": ["sh", "-c", "echo one; read line; echo two; exec sleep 1000"], "stdin": true}),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let cid = created.str("id");
    let attach = format!("{commands}/{cid}/attach");

    let mut first = connect(&api, &format!("{attach}?offset=0"))
        .await
        .expect("attach");
    let (seen, _) = read_socket(&mut first, Some("one\n")).await;
    assert_eq!(seen, "one\n");
    // Input over the socket reaches the command's stdin.
    {
        use futures::SinkExt;
        first
            .send(Message::Binary(b"go\n".to_vec().into()))
            .await
            .expect("send");
    }
    let (seen, _) = read_socket(&mut first, Some("two\n")).await;
    assert_eq!(seen, "two\n");
    drop(first);

    // Again from byte 4: only what came after "one\n".
    let mut again = connect(&api, &format!("{attach}?offset=4"))
        .await
        .expect("attach");
    let (seen, _) = read_socket(&mut again, Some("two\n")).await;
    assert_eq!(seen, "two\n");

    // Another org: refused before any upgrade.
    let (other, _) = crate::plane::new_org(&stack.plane.admin, "org-attach", json!({})).await;
    let refused = connect(&other, &format!("{attach}?offset=0")).await;
    match refused {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 404)
        }
        other => panic!("another org attached: {:?}", other.map(|_| ())),
    }

    // The sandbox stops: the stream ends with the command's end.
    let stopped = api
        .post(&format!("/v1/sandboxes/{sid}/stop"), json!({}))
        .await;
    assert_eq!(stopped.status, 202, "{stopped:?}");
    let (_, exit) = read_socket(&mut again, None).await;
    let exit = exit.expect("an exit message before the close");
    assert_eq!(exit["type"], "exit");
    assert_eq!(exit["state"], "interrupted", "{exit}");
    assert_eq!(exit["state_reason"], "sandbox_stopped", "{exit}");
    stack.runner.assert_no_errors();
}

/// Audit finding (data path): an attached session checked its token once,
/// at the upgrade; a revoked token's terminal kept taking input (code run
/// in the sandbox) for as long as the socket stayed open. The session now
/// ends soon after the revoke, and what is sent after it reaches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attached_session_ends_when_its_token_is_revoked() {
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    // A second token of the org, attached with, then revoked.
    let org_id = sandbox["org_id"].as_str().expect("org").to_owned();
    let minted = stack
        .plane
        .admin
        .post(&format!("/v1/admin/orgs/{org_id}/tokens"), json!({}))
        .await;
    assert_eq!(minted.status, 201, "{minted:?}");
    let leaked = crate::plane::Api::new(&api.url, &minted.str("token"));
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let created = api
        .post(
            &commands,
            json!({"argv": ["sh", "-c", "echo up; while read line; do echo \"$line\" >> /workspace/typed; done"], "stdin": true}),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let cid = created.str("id");
    let mut socket = connect(&leaked, &format!("{commands}/{cid}/attach"))
        .await
        .expect("attach");
    let (seen, _) = read_socket(&mut socket, Some("up")).await;
    assert!(seen.contains("up"), "{seen:?}");
    {
        use futures::SinkExt;
        socket
            .send(Message::Binary(b"before\n".to_vec().into()))
            .await
            .expect("send");
    }
    let typed = crate::plane::eventually(Duration::from_secs(20), || async {
        crate::runner_e2e::sh(&api, &sid, "cat /workspace/typed 2>/dev/null; true").await
            == "before\n"
    })
    .await;
    assert!(typed, "input before the revoke reached the command");

    let revoked = stack
        .plane
        .admin
        .post("/v1/admin/tokens/revoke", json!({"token": leaked.token}))
        .await;
    assert_eq!(revoked.status, 200, "{revoked:?}");
    // The session ends (well within read_socket's deadline).
    let (_, exit) = read_socket(&mut socket, None).await;
    assert!(exit.is_none(), "the command did not end: {exit:?}");
    {
        use futures::SinkExt;
        let _ = socket
            .send(Message::Binary(b"after\n".to_vec().into()))
            .await;
    }
    let command = api.get(&format!("{commands}/{cid}")).await;
    assert_eq!(command.body["state"], "running", "{command:?}");
    assert_eq!(
        crate::runner_e2e::sh(&api, &sid, "cat /workspace/typed").await,
        "before\n",
        "input after the revoke reached the command"
    );
    stack.runner.assert_no_errors();
}

/// Issue 15, point 4: when the sandbox dies under an attached command
/// (its init killed from the host), the stream ends promptly with the
/// command's honest end, it does not hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_ends_when_its_sandbox_dies() {
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let created = api
        .post(
            &commands,
            json!({"argv": ["sh", "-c", "echo up; exec sleep 1000"], "tty": {"rows": 24, "cols": 80}}),
        )
        .await;
    let cid = created.str("id");
    let mut socket = connect(&api, &format!("{commands}/{cid}/attach"))
        .await
        .expect("attach");
    let (seen, _) = read_socket(&mut socket, Some("up")).await;
    assert!(seen.contains("up"), "{seen:?}");
    let pid = stack.runner.init_pid(&sid);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the init");
    let (_, exit) = read_socket(&mut socket, None).await;
    let exit = exit.expect("an exit message before the close");
    assert_eq!(exit["type"], "exit");
    let state = exit["state"].as_str().unwrap_or("");
    assert!(
        ["interrupted", "unknown"].contains(&state),
        "an honest end for a command whose sandbox died: {exit}"
    );
}

/// An attached client sending a message past the bound (1 MiB) loses its
/// connection; the server and the command go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_attach_message_closes_that_connection_only() {
    use futures::SinkExt;
    let stack = Stack::start_full(&[], &[]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let created = api
        .post(
            &commands,
            json!({"argv": ["sh", "-c", "echo up; read line; echo \"read $line\""], "stdin": true}),
        )
        .await;
    let cid = created.str("id");
    let attach = format!("{commands}/{cid}/attach");
    let mut socket = connect(&api, &attach).await.expect("attach");
    let (seen, _) = read_socket(&mut socket, Some("up")).await;
    assert_eq!(seen, "up\n");
    let _ = socket
        .send(Message::Binary(vec![b'x'; 2 * 1024 * 1024].into()))
        .await;
    let (_, exit) = read_socket(&mut socket, None).await;
    assert!(
        exit.is_none(),
        "the connection closed without an end: {exit:?}"
    );
    // Attached again: the command still runs and takes a normal line.
    let mut again = connect(&api, &format!("{attach}?offset=3"))
        .await
        .expect("attach");
    again
        .send(Message::Binary(b"fine\n".to_vec().into()))
        .await
        .expect("send");
    let (seen, exit) = read_socket(&mut again, None).await;
    assert_eq!(seen, "read fine\n");
    assert_eq!(exit.expect("its end")["state"], "exited");
}
