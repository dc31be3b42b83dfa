//! `roost sandbox`, `roost exec`, `roost command` and `roost admin sandbox`:
//! the real binary against a real `roost server`, with a `TestRunner`
//! playing the runner side (reporting states, appending output).

use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{BIN, assert_plain_stderr, message_lines};
use crate::plane::{Api, Plane, STANDARD, TestRunner, eventually, new_org, start_server_listening};

/// How long a test waits for the CLI or the server before failing.
const PATIENCE: Duration = Duration::from_secs(30);

/// The `roost` binary pointed at one server with one token.
#[derive(Clone)]
struct Roost {
    url: String,
    token: String,
}

impl Roost {
    fn new(url: &str, token: &str) -> Roost {
        Roost {
            url: url.to_owned(),
            token: token.to_owned(),
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(BIN);
        command
            .args(args)
            .env("ROOST_URL", &self.url)
            .env("ROOST_TOKEN", &self.token)
            .env_remove("ROOST_LOG")
            .stdin(Stdio::null());
        command
    }

    /// Runs to completion (off the async workers).
    async fn run(&self, args: &[&str]) -> Output {
        let mut command = self.command(args);
        tokio::task::spawn_blocking(move || command.output().expect("run roost"))
            .await
            .expect("join")
    }

    /// A `--json` run: must succeed, print one JSON document, and nothing
    /// on stderr.
    async fn json(&self, args: &[&str]) -> Value {
        let output = self.run(args).await;
        assert!(
            output.status.success(),
            "roost {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_plain_stderr(args, &output.stderr);
        serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
            panic!(
                "roost {args:?}: not JSON ({e}): {}",
                String::from_utf8_lossy(&output.stdout)
            )
        })
    }

    /// A human run: must succeed; returns stdout.
    async fn text(&self, args: &[&str]) -> String {
        let output = self.run(args).await;
        assert!(
            output.status.success(),
            "roost {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).expect("utf-8")
    }

    /// A run that must fail with status 1, nothing on stdout and exactly
    /// one `roost: error: …` line on stderr, which is returned.
    async fn error(&self, args: &[&str]) -> String {
        let output = self.run(args).await;
        assert_eq!(output.status.code(), Some(1), "roost {args:?}: {output:?}");
        assert!(output.stdout.is_empty(), "roost {args:?}: {output:?}");
        let stderr = String::from_utf8(output.stderr).expect("utf-8");
        let lines = message_lines(&stderr);
        assert_eq!(lines.len(), 1, "one line: {stderr}");
        assert!(lines[0].starts_with("roost: error: "), "{stderr}");
        lines[0].to_owned()
    }

    /// Starts the binary with stdout and stderr captured as they arrive.
    fn spawn(&self, args: &[&str]) -> Running {
        let mut child = self
            .command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn roost");
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let readers = vec![
            collect(child.stdout.take().expect("stdout"), stdout.clone()),
            collect(child.stderr.take().expect("stderr"), stderr.clone()),
        ];
        Running {
            child,
            stdout,
            stderr,
            readers,
        }
    }
}

/// Copies `from` into `into` as bytes arrive, until end of file.
fn collect(
    mut from: impl Read + Send + 'static,
    into: Arc<Mutex<Vec<u8>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buffer = [0_u8; 4096];
        while let Ok(n) = from.read(&mut buffer) {
            if n == 0 {
                break;
            }
            into.lock().expect("lock").extend_from_slice(&buffer[..n]);
        }
    })
}

/// A `roost` process still running; killed if dropped unfinished.
struct Running {
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Running {
    fn stdout(&self) -> Vec<u8> {
        self.stdout.lock().expect("lock").clone()
    }

    fn stderr(&self) -> Vec<u8> {
        self.stderr.lock().expect("lock").clone()
    }

    fn exited(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_some()
    }

    /// Waits for the exit; returns the status code, stdout and stderr.
    async fn finish(mut self) -> (Option<i32>, Vec<u8>, Vec<u8>) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "roost did not exit; stdout {:?}, stderr {:?}",
                String::from_utf8_lossy(&self.stdout()),
                String::from_utf8_lossy(&self.stderr())
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        for reader in std::mem::take(&mut self.readers) {
            reader.join().expect("reader");
        }
        (status.code(), self.stdout(), self.stderr())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of `name` in the CLI's `name  value` record view.
fn field(text: &str, name: &str) -> String {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(name)
                .filter(|rest| rest.starts_with("  "))
                .map(|rest| rest.trim().to_owned())
        })
        .unwrap_or_else(|| panic!("no {name:?} in:\n{text}"))
}

/// A table's rows (header first), split into columns.
fn table(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .map(|line| line.split_whitespace().map(str::to_owned).collect())
        .collect()
}

fn ids(list: &Value, key: &str) -> Vec<String> {
    list[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} in {list}"))
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_owned())
        .collect()
}

/// The command handed to `runner` in `sandbox_id` whose argv is `argv`.
async fn assigned_command(runner: &TestRunner, sandbox_id: &str, argv: &[&str]) -> Value {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let assignments = runner.assignments().await;
        let found = assignments["commands"]
            .as_array()
            .expect("commands")
            .iter()
            .find(|c| c["sandbox_id"] == sandbox_id && c["argv"] == json!(argv))
            .cloned();
        if let Some(command) = found {
            return command;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no command {argv:?} assigned: {assignments}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn report_command(runner: &TestRunner, command: &Value, body: Value) {
    let id = command["command_id"].as_str().expect("command_id");
    let epoch = command["epoch"].as_u64().expect("epoch");
    let answer = runner.report_command(id, epoch, body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
}

async fn append(runner: &TestRunner, command: &Value, stream: &str, offset: u64, data: &[u8]) {
    let id = command["command_id"].as_str().expect("command_id");
    let epoch = command["epoch"].as_u64().expect("epoch");
    let answer = runner.append_output(id, epoch, stream, offset, data).await;
    assert_eq!(answer.status, 200, "{answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_commands_print_records_tables_and_json() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let roost = Roost::new(&plane.server.url, &plane.org.token);

    let first = roost
        .json(&[
            "sandbox",
            "create",
            "--label",
            "team=a",
            "--env",
            "A=x=y",
            "--memory-mib",
            "256",
            "--cpus",
            "0.5",
            "--ttl",
            "2h",
            "--json",
        ])
        .await;
    let a = first["id"].as_str().expect("id").to_owned();
    assert!(a.starts_with("sbx_"), "{first}");
    assert_eq!(first["org_id"], plane.org_id.as_str());
    assert_eq!(first["state"], "starting");
    assert_eq!(first["desired"], "running");
    assert_eq!(first["runner_id"], runner.id.as_str());
    assert_eq!(first["labels"], json!({"team": "a"}));
    assert_eq!(first["env"], json!({"A": "x=y"}));
    assert_eq!(first["resources"]["memory_mib"], 256);
    assert_eq!(first["resources"]["cpus"], 0.5);
    assert_eq!(first["storage_class"], "standard");
    assert_eq!(first["network"], "none");
    assert_eq!(first["placement"], "spot_first");
    // 2h is sent as 7200 seconds.
    let created = humantime::parse_rfc3339(first["created_at"].as_str().expect("created_at"))
        .expect("rfc3339");
    let expires = humantime::parse_rfc3339(first["expires_at"].as_str().expect("expires_at"))
        .expect("rfc3339");
    assert_eq!(
        expires.duration_since(created).expect("later"),
        Duration::from_secs(7200)
    );

    let shown = roost
        .text(&[
            "sandbox",
            "create",
            "--label",
            "team=b",
            "--env",
            "SECRET=hunter2",
        ])
        .await;
    let b = field(&shown, "id");
    assert!(b.starts_with("sbx_") && b != a, "{shown}");
    assert_eq!(field(&shown, "state"), "starting (placed)");
    assert_eq!(field(&shown, "runner"), runner.id);
    assert_eq!(field(&shown, "labels"), "team=b");
    assert_eq!(field(&shown, "env"), "SECRET", "names only on screen");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert_eq!(field(&shown, "quarantined"), "no");

    runner.report(&a, "running", None).await;
    let got = roost.json(&["sandbox", "get", &a, "--json"]).await;
    assert_eq!(got["state"], "running");
    assert_eq!(got["id"], a.as_str());
    let shown = roost.text(&["sandbox", "get", &a]).await;
    assert_eq!(field(&shown, "state"), "running (workload_started)");
    assert_eq!(field(&shown, "epoch"), "1");
    assert_eq!(
        field(&shown, "resources"),
        "256 MiB memory, 0.5 cpus, 1024 pids"
    );
    let waited = roost
        .json(&[
            "sandbox",
            "get",
            &a,
            "--wait-for",
            "running",
            "--timeout",
            "5",
            "--json",
        ])
        .await;
    assert_eq!(waited["state"], "running");

    // Lists: JSON in creation order, filters, pages, and the table.
    let all = roost.json(&["sandbox", "list", "--json"]).await;
    assert_eq!(ids(&all, "sandboxes"), [a.clone(), b.clone()]);
    assert!(all["next_cursor"].is_null());
    let running = roost
        .json(&["sandbox", "list", "--state", "running", "--json"])
        .await;
    assert_eq!(ids(&running, "sandboxes"), [a.as_str()]);
    let either = roost
        .json(&[
            "sandbox", "list", "--state", "running", "--state", "starting", "--json",
        ])
        .await;
    assert_eq!(ids(&either, "sandboxes"), [a.clone(), b.clone()]);
    let team_b = roost
        .json(&["sandbox", "list", "--label", "team=b", "--json"])
        .await;
    assert_eq!(ids(&team_b, "sandboxes"), [b.as_str()]);
    let page = roost
        .json(&["sandbox", "list", "--limit", "1", "--json"])
        .await;
    assert_eq!(ids(&page, "sandboxes"), [a.as_str()]);
    assert_eq!(page["next_cursor"], a.as_str());
    let followed = roost
        .json(&["sandbox", "list", "--limit", "1", "--all", "--json"])
        .await;
    assert_eq!(ids(&followed, "sandboxes"), [a.clone(), b.clone()]);
    assert!(followed["next_cursor"].is_null());

    let listed = roost.text(&["sandbox", "list"]).await;
    let rows = table(&listed);
    assert_eq!(
        rows[0],
        ["ID", "STATE", "REASON", "DESIRED", "RUNNER", "EPOCH", "AGE"]
    );
    assert_eq!(rows.len(), 3, "{listed}");
    assert_eq!(
        rows[1][..6],
        [
            a.as_str(),
            "running",
            "workload_started",
            "running",
            runner.id.as_str(),
            "1"
        ]
    );
    assert_eq!(
        rows[2][..6],
        [
            b.as_str(),
            "starting",
            "placed",
            "running",
            runner.id.as_str(),
            "1"
        ]
    );
    assert!(rows[1][6].ends_with('s'), "an age in seconds: {listed}");
    // Aligned: every column starts where its header does.
    let lines: Vec<&str> = listed.lines().collect();
    for header in ["STATE", "REASON", "DESIRED", "RUNNER", "EPOCH", "AGE"] {
        let at = lines[0].find(header).expect("header");
        for line in &lines[1..] {
            assert!(
                line[..at].ends_with("  ") && !line[at..].starts_with(' '),
                "{header} misaligned:\n{listed}"
            );
        }
    }

    // Stop, start, delete: JSON and human, desired first, state following.
    let stopped = roost.json(&["sandbox", "stop", &a, "--json"]).await;
    assert_eq!(stopped["desired"], "stopped");
    assert_eq!(stopped["state"], "running");
    runner.report(&a, "stopping", None).await;
    runner.report(&a, "stopped", Some("stop_requested")).await;
    let started = roost.text(&["sandbox", "start", &a]).await;
    assert_eq!(
        started.trim_end(),
        format!("sandbox {a}: start requested; desired running, state starting (placed)")
    );
    runner.report(&a, "running", None).await;
    let deleted = roost.json(&["sandbox", "delete", &a, "--json"]).await;
    assert_eq!(deleted["desired"], "deleted");
    assert_eq!(deleted["state"], "deleting");
    runner.report(&a, "deleted", None).await;
    let shown = roost.text(&["sandbox", "get", &a]).await;
    assert_eq!(field(&shown, "state"), "deleted (deleted)", "{shown}");
    assert_eq!(
        field(&shown, "idle"),
        "-",
        "an ended sandbox has no idle policy"
    );
    // A deleted sandbox is listed only when asked for.
    let listed = roost.json(&["sandbox", "list", "--json"]).await;
    assert_eq!(ids(&listed, "sandboxes"), [b.as_str()]);
    let with_deleted = roost
        .json(&["sandbox", "list", "--deleted", "--json"])
        .await;
    assert_eq!(ids(&with_deleted, "sandboxes"), [a.clone(), b.clone()]);
    let only_deleted = roost
        .json(&["sandbox", "list", "--state", "deleted", "--json"])
        .await;
    assert_eq!(ids(&only_deleted, "sandboxes"), [a.as_str()]);
    let stopped_b = roost.text(&["sandbox", "stop", &b]).await;
    assert_eq!(
        stopped_b.trim_end(),
        format!("sandbox {b}: stop requested; desired stopped, state starting (placed)")
    );

    let events = roost.json(&["sandbox", "events", &a, "--json"]).await;
    let states: Vec<&str> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["state"].as_str().unwrap_or(""))
        .collect();
    // Each request appears too, with the state it found.
    let expected = [
        "pending", "starting", "running", "running", "stopping", "stopped", "stopped", "pending",
        "starting", "running", "running", "deleting", "deleted",
    ];
    assert_eq!(states, expected);
    let shown = roost.text(&["sandbox", "events", &a]).await;
    let rows = table(&shown);
    assert_eq!(
        rows[0],
        ["SEQ", "AT", "STATE", "REASON", "EPOCH", "RUNNER", "MESSAGE"]
    );
    let column: Vec<&str> = rows[1..].iter().map(|r| r[2].as_str()).collect();
    assert_eq!(column, expected);
    assert_eq!(
        rows[1][..5],
        ["1", rows[1][1].as_str(), "pending", "admitted", "0"]
    );
    assert_eq!(rows[6][3], "stop_requested");
    assert_eq!(rows[9][4], "2", "placed again: epoch 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_wait_returns_running_or_fails_when_the_sandbox_ends() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let roost = Roost::new(&plane.server.url, &plane.org.token);

    let mut waiting = roost.spawn(&["sandbox", "create", "--wait", "--label", "n=1", "--json"]);
    let id = wait_for_assignment(&runner, 1).await;
    // Placed, not yet running: the CLI is still waiting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.exited() && waiting.stdout().is_empty(),
        "still waiting"
    );
    runner.report(&id, "running", None).await;
    let (code, stdout, stderr) = waiting.finish().await;
    assert_eq!(code, Some(0), "{}", String::from_utf8_lossy(&stderr));
    assert_plain_stderr(&["sandbox", "get"], &stderr);
    let record: Value = serde_json::from_slice(&stdout).expect("json");
    assert_eq!(record["id"], id.as_str());
    assert_eq!(record["state"], "running");

    let mut failing = roost.spawn(&["sandbox", "create", "--wait", "--label", "n=2"]);
    let id = wait_for_assignment(&runner, 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!failing.exited(), "still waiting");
    runner.report(&id, "failed", Some("workload_exited")).await;
    let (code, stdout, stderr) = failing.finish().await;
    assert_eq!(code, Some(1));
    let stdout = String::from_utf8(stdout).expect("utf-8");
    assert_eq!(field(&stdout, "id"), id);
    assert_eq!(field(&stdout, "state"), "failed (workload_exited)");
    assert_eq!(
        String::from_utf8_lossy(&stderr).trim_end(),
        format!("roost: sandbox {id} is failed (workload_exited), not running")
    );

    // get --wait-for gives up at its timeout, printing the record as is.
    let starting = plane.org.post("/v1/sandboxes", json!({})).await.str("id");
    let output = roost
        .run(&[
            "sandbox",
            "get",
            &starting,
            "--wait-for",
            "running",
            "--timeout",
            "1",
            "--json",
        ])
        .await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert_plain_stderr(&["sandbox", "get"], &output.stderr);
    let record: Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(record["state"], "starting");
}

/// Waits until `runner` holds `count` sandboxes; returns the newest one.
async fn wait_for_assignment(runner: &TestRunner, count: usize) -> String {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let assignments = runner.assignments().await;
        let sandboxes = assignments["sandboxes"].as_array().expect("sandboxes");
        if sandboxes.len() >= count {
            let mut ids: Vec<&str> = sandboxes
                .iter()
                .map(|s| s["sandbox_id"].as_str().expect("id"))
                .collect();
            ids.sort_unstable();
            return ids[count - 1].to_owned();
        }
        assert!(tokio::time::Instant::now() < deadline, "{assignments}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_streams_output_as_it_arrives_and_exits_with_the_programs_code() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let roost = Roost::new(&plane.server.url, &plane.org.token);
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");

    let argv = ["sh", "-c", "echo it's; exit 3"];
    let mut exec = roost.spawn(&[
        "exec",
        id,
        "--env",
        "CI=1",
        "--cwd",
        "/tmp",
        "--timeout",
        "90s",
        "--",
        argv[0],
        argv[1],
        argv[2],
    ]);
    let command = assigned_command(&runner, id, &argv).await;
    assert_eq!(command["env"], json!({"CI": "1"}));
    assert_eq!(command["cwd"], "/tmp");
    assert_eq!(command["timeout"], 90);
    report_command(&runner, &command, json!({"state": "running"})).await;

    // Bytes reach our stdout and stderr while the command still runs,
    // unchanged (not UTF-8 here).
    append(&runner, &command, "stdout", 0, b"first \xff\x00").await;
    append(&runner, &command, "stderr", 0, b"warning\n").await;
    let streamed = eventually(PATIENCE, || async {
        exec.stdout() == b"first \xff\x00" && exec.stderr() == b"warning\n"
    })
    .await;
    assert!(
        streamed,
        "streamed while running: {:?} / {:?}",
        exec.stdout(),
        exec.stderr()
    );
    assert!(!exec.exited(), "still running");
    append(&runner, &command, "stdout", 8, b"second\n").await;
    report_command(
        &runner,
        &command,
        json!({"state": "exited", "exit_code": 3}),
    )
    .await;
    let (code, stdout, stderr) = exec.finish().await;
    assert_eq!(code, Some(3), "{}", String::from_utf8_lossy(&stderr));
    assert_eq!(stdout, b"first \xff\x00second\n");
    assert_eq!(stderr, b"warning\n", "the program's stderr, nothing else");

    // The record, the list and the output, read back.
    let command_id = command["command_id"].as_str().expect("id");
    let got = roost
        .json(&["command", "get", id, command_id, "--json"])
        .await;
    assert_eq!(got["state"], "exited");
    assert_eq!(got["exit_code"], 3);
    assert_eq!(got["argv"], json!(argv));
    assert_eq!(got["stdout_bytes"], 15);
    let shown = roost.text(&["command", "get", id, command_id]).await;
    assert_eq!(field(&shown, "state"), "exited");
    assert_eq!(field(&shown, "exit code"), "3");
    assert_eq!(field(&shown, "argv"), r"sh -c 'echo it'\''s; exit 3'");
    assert_eq!(field(&shown, "stdout"), "15 B");
    let waited = roost
        .json(&[
            "command",
            "get",
            id,
            command_id,
            "--wait-for",
            "ended",
            "--json",
        ])
        .await;
    assert_eq!(waited["state"], "exited");

    let list = roost.json(&["command", "list", id, "--json"]).await;
    assert_eq!(ids(&list, "commands"), [command_id]);
    let listed = roost.text(&["command", "list", id]).await;
    let rows = table(&listed);
    assert_eq!(
        rows[0],
        [
            "ID", "STATE", "REASON", "EXIT", "PID", "STDOUT", "STDERR", "AGE", "ARGV"
        ]
    );
    // This runner reported no pid: `-`.
    assert_eq!(rows[1][..6], [command_id, "exited", "-", "3", "-", "15"]);

    let out = roost.run(&["command", "output", id, command_id]).await;
    assert!(out.status.success(), "{out:?}");
    assert_plain_stderr(&["command", "output"], &out.stderr);
    assert_eq!(out.stdout, b"first \xff\x00second\n");
    let err = roost
        .run(&[
            "command", "output", id, command_id, "--stream", "stderr", "--follow",
        ])
        .await;
    assert!(err.status.success(), "{err:?}");
    assert_eq!(err.stdout, b"warning\n");
    let as_json = roost
        .json(&[
            "command", "output", id, command_id, "--stream", "stderr", "--json",
        ])
        .await;
    assert_eq!(
        as_json,
        json!({
            "sandbox_id": id, "command_id": command_id, "stream": "stderr",
            "bytes": 8, "next_offset": 8, "state": "exited", "complete": true,
            "text": "warning\n",
        })
    );

    // Exit 0 is 0.
    let zero = roost.spawn(&["exec", id, "--", "true"]);
    let command = assigned_command(&runner, id, &["true"]).await;
    report_command(
        &runner,
        &command,
        json!({"state": "exited", "exit_code": 0}),
    )
    .await;
    let (code, stdout, stderr) = zero.finish().await;
    assert_eq!((code, stdout.len(), stderr.len()), (Some(0), 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_keeps_streaming_across_a_server_restart() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let listen = format!("127.0.0.1:{port}");
    let server = start_server_listening(&data, &listen, &[], &[]);
    let admin = Api::new(&server.url, server.admin_token.as_deref().expect("token"));
    let (org, _) = new_org(&admin, "acme", json!({})).await;
    let runner_token = admin
        .post("/v1/admin/runner-tokens", json!({}))
        .await
        .str("token");
    let runner = TestRunner::register(&server.url, &runner_token, "r1", "spot", STANDARD, 4).await;
    let id = org.post("/v1/sandboxes", json!({})).await.str("id");
    runner.report(&id, "running", None).await;

    let roost = Roost::new(&server.url, &org.token);
    let exec = roost.spawn(&["exec", &id, "--", "make"]);
    let command = assigned_command(&runner, &id, &["make"]).await;
    report_command(&runner, &command, json!({"state": "running"})).await;
    append(&runner, &command, "stdout", 0, b"before\n").await;
    let streamed = eventually(PATIENCE, || async { exec.stdout() == b"before\n" }).await;
    assert!(streamed, "{:?}", exec.stdout());

    // The server dies mid long-poll and comes back where it was; the
    // CLI's reads fail meanwhile and are retried.
    drop(server);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let _server = start_server_listening(&data, &listen, &[], &[]);
    let runner = TestRunner {
        api: Api::new(&format!("http://{listen}"), &runner.api.token),
        id: runner.id.clone(),
    };
    append(&runner, &command, "stdout", 7, b"after\n").await;
    report_command(
        &runner,
        &command,
        json!({"state": "exited", "exit_code": 0}),
    )
    .await;
    let (code, stdout, stderr) = exec.finish().await;
    assert_eq!(code, Some(0), "{}", String::from_utf8_lossy(&stderr));
    assert_eq!(stdout, b"before\nafter\n");
    assert_plain_stderr(&["exec"], &stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_exits_124_on_timeout_and_125_on_other_ends() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let roost = Roost::new(&plane.server.url, &plane.org.token);
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");

    let exec = roost.spawn(&["exec", id, "--timeout", "1s", "--", "sleep", "100"]);
    let command = assigned_command(&runner, id, &["sleep", "100"]).await;
    assert_eq!(command["timeout"], 1);
    report_command(&runner, &command, json!({"state": "running"})).await;
    append(&runner, &command, "stderr", 0, b"zzz\n").await;
    report_command(
        &runner,
        &command,
        json!({"state": "timed_out", "signal": "TERM"}),
    )
    .await;
    let (code, stdout, stderr) = exec.finish().await;
    assert_eq!(code, Some(124), "{}", String::from_utf8_lossy(&stderr));
    assert!(stdout.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&stderr),
        "zzz\nroost: command ended timed_out\n"
    );

    // --json: the final record instead of the output; the same status.
    let exec = roost.spawn(&["exec", id, "--json", "--", "make", "test"]);
    let command = assigned_command(&runner, id, &["make", "test"]).await;
    report_command(&runner, &command, json!({"state": "running"})).await;
    append(&runner, &command, "stdout", 0, b"not printed\n").await;
    report_command(
        &runner,
        &command,
        json!({"state": "interrupted", "reason": "stop_requested"}),
    )
    .await;
    let (code, stdout, stderr) = exec.finish().await;
    assert_eq!(code, Some(125), "{}", String::from_utf8_lossy(&stderr));
    assert_plain_stderr(&["exec"], &stderr);
    let record: Value = serde_json::from_slice(&stdout).expect("one JSON record");
    assert_eq!(record["state"], "interrupted");
    assert_eq!(record["state_reason"], "stop_requested");
    assert_eq!(record["stdout_bytes"], 12);

    // A queued command signalled before it starts never launches: the
    // waiting exec says so and exits 125; --detach returns at once.
    let queued_in = plane.org.post("/v1/sandboxes", json!({})).await.str("id");
    let detached = roost
        .json(&["exec", &queued_in, "--detach", "--json", "--", "ls"])
        .await;
    assert_eq!(detached["state"], "queued");
    let command_id = detached["id"].as_str().expect("id");
    let exec = roost.spawn(&["exec", &queued_in, "--", "ls", "-l"]);
    let second = eventually(PATIENCE, || async {
        let list = plane
            .org
            .get(&format!("/v1/sandboxes/{queued_in}/commands"))
            .await;
        list.body["commands"].as_array().map(Vec::len) == Some(2)
    })
    .await;
    assert!(second, "the second command was created");
    let list = plane
        .org
        .get(&format!("/v1/sandboxes/{queued_in}/commands"))
        .await;
    let waited_id = list.body["commands"][1]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let signalled = roost
        .text(&["command", "signal", &queued_in, &waited_id, "sigterm"])
        .await;
    assert_eq!(
        signalled.trim_end(),
        format!("command {waited_id}: TERM requested; state not_launched (cancelled)")
    );
    let (code, stdout, stderr) = exec.finish().await;
    assert_eq!(code, Some(125));
    assert!(stdout.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&stderr),
        "roost: command ended not_launched (cancelled)\n"
    );
    let cancelled = roost
        .json(&[
            "command", "signal", &queued_in, command_id, "KILL", "--json",
        ])
        .await;
    assert_eq!(cancelled["state"], "not_launched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_print_one_line_naming_the_call_and_the_code() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let roost = Roost::new(&plane.server.url, &plane.org.token);

    let missing = roost.error(&["sandbox", "get", "sbx_nope"]).await;
    assert!(
        missing.starts_with("roost: error: sandbox get failed: not_found (404): "),
        "{missing}"
    );
    assert!(missing.contains("(request "), "{missing}");
    // --json changes nothing about errors: one line on stderr, stdout empty.
    let missing = roost
        .error(&["command", "get", "sbx_nope", "cmd_nope", "--json"])
        .await;
    assert!(
        missing.starts_with("roost: error: command get failed: not_found (404)"),
        "{missing}"
    );
    // An id cannot walk to another path.
    let walked = roost.error(&["sandbox", "get", "../admin/orgs"]).await;
    assert!(walked.contains("not_found (404)"), "{walked}");

    let (small, _) = new_org(&plane.admin, "small", json!({"max_running": 1})).await;
    let small = Roost::new(&plane.server.url, &small.token);
    small.json(&["sandbox", "create", "--json"]).await;
    let refused = small.error(&["sandbox", "create", "--json"]).await;
    assert!(
        refused.starts_with(
            "roost: error: sandbox create failed: quota_exceeded (429): quota sandboxes.running reached (1 of 1)"
        ),
        "{refused}"
    );
    let unsupported = roost
        .error(&["sandbox", "create", "--network", "bridge"])
        .await;
    assert!(
        unsupported.contains("sandbox create failed: unsupported_capability (422)"),
        "{unsupported}"
    );
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");
    let bad_signal = roost
        .error(&["command", "signal", id, "cmd_nope", "STOP"])
        .await;
    assert!(
        bad_signal.contains("command signal failed: invalid_request (400)"),
        "{bad_signal}"
    );
    roost.json(&["sandbox", "stop", id, "--json"]).await;
    let set = roost
        .json(&["sandbox", "set", id, "--auto-wake", "false", "--json"])
        .await;
    assert_eq!(set["auto_wake"], false, "{set}");
    let stopped = roost.error(&["exec", id, "--", "true"]).await;
    assert!(
        stopped.starts_with("roost: error: exec failed: invalid_state (409)"),
        "{stopped}"
    );

    let wrong_token = Roost::new(&plane.server.url, "roost_org_wrong");
    let denied = wrong_token.error(&["sandbox", "list"]).await;
    assert!(
        denied.contains("sandbox list failed: unauthenticated (401)"),
        "{denied}"
    );
    let nowhere = Roost::new("http://127.0.0.1:1", &plane.org.token);
    let unreachable = nowhere.error(&["sandbox", "list", "--json"]).await;
    assert!(
        unreachable.contains("sandbox list failed: server unreachable at http://127.0.0.1:1/"),
        "{unreachable}"
    );
    assert!(
        unreachable
            .trim_end()
            .ends_with("; is the server running (roost up)?"),
        "{unreachable}"
    );
    // A local path is checked before the server is asked anything.
    let no_image = nowhere
        .error(&["image", "import", "img", "/nonexistent/rootfs"])
        .await;
    assert!(
        no_image.starts_with("roost: error: cannot read /nonexistent/rootfs: "),
        "{no_image}"
    );
    let ftp = Roost::new("ftp://host/", &plane.org.token);
    let refused = ftp.error(&["sandbox", "list"]).await;
    assert!(
        refused
            .starts_with("roost: error: invalid server URL ftp://host/: use http:// or https://"),
        "{refused}"
    );
    // A failed wait names the command that was run.
    let bogus = roost.error(&["sandbox", "wait", "sbx_nope", "bogus"]).await;
    assert!(
        bogus.starts_with("roost: error: sandbox wait failed: "),
        "{bogus}"
    );

    // Flags are checked before anything is sent.
    let output = roost
        .run(&["sandbox", "create", "--label", "no-equals-sign"])
        .await;
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("expected KEY=VALUE"),
        "{output:?}"
    );
    let listed = plane.org.get("/v1/sandboxes").await.body;
    assert_eq!(ids(&listed, "sandboxes"), [id], "nothing else was created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_quarantine_freezes_a_sandbox_until_released() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let org = Roost::new(&plane.server.url, &plane.org.token);
    let admin = Roost::new(&plane.server.url, &plane.admin.token);
    let sandbox = plane.running_sandbox(&runner, json!({})).await;
    let id = sandbox["id"].as_str().expect("id");

    let frozen = admin
        .json(&[
            "admin",
            "sandbox",
            "quarantine",
            id,
            "--reason",
            "forensics",
            "--json",
        ])
        .await;
    assert_eq!(frozen["quarantined"], true);
    let refused = org.error(&["sandbox", "stop", id]).await;
    assert!(
        refused.contains("sandbox stop failed: quarantined (409)"),
        "{refused}"
    );
    let refused = org.error(&["exec", id, "--", "ls"]).await;
    assert!(refused.contains("quarantined (409)"), "{refused}");
    assert_eq!(
        field(&org.text(&["sandbox", "get", id]).await, "quarantined"),
        "yes"
    );
    // An org token does not reach the admin endpoint.
    let denied = org.error(&["admin", "sandbox", "release", id]).await;
    assert!(
        denied.contains("sandbox release failed: not_found (404)"),
        "{denied}"
    );
    assert!(
        denied.contains("admin endpoints need an admin token"),
        "{denied}"
    );
    // An admin token on a missing sandbox gets no such hint.
    let missing = admin
        .error(&["admin", "sandbox", "release", "sbx_nope"])
        .await;
    assert!(
        missing.contains("not_found (404)") && !missing.contains("admin token"),
        "{missing}"
    );

    let released = admin.text(&["admin", "sandbox", "release", id]).await;
    assert_eq!(
        released.trim_end(),
        format!("sandbox {id} released from quarantine (state running)")
    );
    let stopped = org.json(&["sandbox", "stop", id, "--json"]).await;
    assert_eq!(stopped["desired"], "stopped");
    assert_eq!(stopped["quarantined"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_wait_exec_and_memory_sizes_have_the_documented_shapes() {
    let plane = Plane::start(&[]).await;
    let runner = plane.runner("r1", "spot", STANDARD).await;
    let roost = Roost::new(&plane.server.url, &plane.org.token);
    let created = roost
        .json(&["sandbox", "create", "--memory", "1GiB", "--json"])
        .await;
    assert_eq!(created["resources"]["memory_mib"], 1024);
    let id = created["id"].as_str().expect("id").to_owned();
    let waiting = roost.spawn(&[
        "sandbox",
        "wait",
        &id,
        "running",
        "--timeout",
        "20s",
        "--json",
    ]);
    runner.report(&id, "running", None).await;
    let (status, stdout, _) = waiting.finish().await;
    assert_eq!(status, Some(0));
    let waited: Value = serde_json::from_slice(&stdout).expect("json");
    assert_eq!(waited["state"], "running");
    // Not reached in time: the record, and exit status 1.
    let output = roost
        .run(&[
            "sandbox",
            "wait",
            &id,
            "stopped",
            "--timeout",
            "1s",
            "--json",
        ])
        .await;
    assert_eq!(output.status.code(), Some(1));
    let queued = roost
        .json(&[
            "sandbox", "exec", &id, "--detach", "--json", "--", "echo", "hi",
        ])
        .await;
    assert_eq!(queued["argv"], json!(["echo", "hi"]));
    assert_eq!(queued["state"], "queued");
    let bad = roost.run(&["sandbox", "create", "--memory", "lots"]).await;
    assert_eq!(bad.status.code(), Some(2), "a usage error from clap");
}
