//! The whole stack for real: a `roost server` process, a `roost runner`
//! process driving runc, and containers running `roost init` as PID 1.
//! Every state asserted here was observed by the runner and reported
//! through the protocol; nothing is faked. Needs root and runc
//! (`scripts/test.sh` installs runc).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{BIN, message_lines};
use crate::plane::{Api, Plane, eventually};

/// A `roost runner` process with its data dir; on drop it is killed and
/// every container it left is force-deleted, however the test ended.
pub(crate) struct RunnerProcess {
    child: Child,
    pub(crate) data_dir: PathBuf,
    url: String,
    token: String,
    /// A network namespace it runs in (its own "host network"), if any.
    netns: Option<String>,
    args: Vec<String>,
    logs: Arc<Mutex<Vec<String>>>,
    pub(crate) runner_id: String,
}

impl RunnerProcess {
    pub(crate) fn start(
        url: &str,
        token: &str,
        data_dir: &Path,
        env: &[(&str, &str)],
    ) -> RunnerProcess {
        RunnerProcess::start_in(url, token, data_dir, env, None, &[])
    }

    /// Starts the runner inside network namespace `netns` (entered with
    /// `nsenter --net`, so it shares the host's mounts), with extra
    /// `roost runner` arguments.
    pub(crate) fn start_in(
        url: &str,
        token: &str,
        data_dir: &Path,
        env: &[(&str, &str)],
        netns: Option<&str>,
        args: &[&str],
    ) -> RunnerProcess {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let netns = netns.map(str::to_owned);
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let (child, runner_id) = spawn(url, token, data_dir, env, netns.as_deref(), &args, &logs);
        RunnerProcess {
            child,
            data_dir: data_dir.to_path_buf(),
            url: url.to_owned(),
            token: token.to_owned(),
            netns,
            args,
            logs,
            runner_id,
        }
    }

    /// The runtime's status of a container (`running`, `paused`, …), or
    /// `None` when it has none by that id.
    pub(crate) fn container_status(&self, sandbox_id: &str) -> Option<String> {
        let output = Command::new("runc")
            .arg(format!("--root={}", self.runtime_root().display()))
            .args(["state", sandbox_id])
            .stderr(Stdio::null())
            .output()
            .expect("runc state");
        if !output.status.success() {
            return None;
        }
        let state: Value = serde_json::from_slice(&output.stdout).expect("state json");
        state["status"].as_str().map(str::to_owned)
    }

    /// SIGKILL, as a crash would: no clean-up of any kind.
    pub(crate) fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kill -9 and start again on the same data dir.
    pub(crate) fn restart(&mut self, env: &[(&str, &str)]) {
        self.kill9();
        let (child, runner_id) = spawn(
            &self.url,
            &self.token,
            &self.data_dir,
            env,
            self.netns.as_deref(),
            &self.args,
            &self.logs,
        );
        self.child = child;
        self.runner_id = runner_id;
    }

    /// Whether the process has ended (a failpoint killed it, say).
    pub(crate) fn exited(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_some()
    }

    pub(crate) fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).expect("pid");
        rustix::process::kill_process(pid, signal).expect("signal the runner");
    }

    pub(crate) fn runtime_root(&self) -> PathBuf {
        self.data_dir.join("runtime")
    }

    /// The init's host pid, as runc reports it.
    pub(crate) fn init_pid(&self, sandbox_id: &str) -> i32 {
        let output = Command::new("runc")
            .arg(format!("--root={}", self.runtime_root().display()))
            .args(["state", sandbox_id])
            .output()
            .expect("runc state");
        assert!(
            output.status.success(),
            "runc state {sandbox_id}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let state: Value = serde_json::from_slice(&output.stdout).expect("state json");
        assert_eq!(state["status"], "running", "{state}");
        state["pid"].as_i64().expect("pid") as i32
    }

    /// Log lines at ERROR, other than a failpoint's.
    fn errors(&self) -> Vec<String> {
        self.logs
            .lock()
            .expect("logs")
            .iter()
            .filter(|l| l.contains("\"level\":\"ERROR\"") && !l.contains("failpoint"))
            .cloned()
            .collect()
    }

    pub(crate) fn assert_no_errors(&self) {
        let errors = self.errors();
        assert!(errors.is_empty(), "the runner logged errors: {errors:#?}");
    }

    /// The runner's log lines (JSON) containing every one of `needles`.
    pub(crate) fn log_lines_with(&self, needles: &[&str]) -> usize {
        self.logs
            .lock()
            .expect("logs")
            .iter()
            .filter(|line| needles.iter().all(|needle| line.contains(needle)))
            .count()
    }
}

/// Starts `roost runner` (its log lines go to `logs` and the test's
/// output); returns once it has registered, with its runner id.
fn spawn(
    url: &str,
    token: &str,
    data_dir: &Path,
    env: &[(&str, &str)],
    netns: Option<&str>,
    args: &[String],
    logs: &Arc<Mutex<Vec<String>>>,
) -> (Child, String) {
    assert!(
        rustix::process::geteuid().is_root(),
        "the runner's end-to-end tests need root (scripts/test.sh runs them as root)"
    );
    let mut command = match netns {
        Some(netns) => {
            let mut command = Command::new("nsenter");
            command.arg(format!("--net=/run/netns/{netns}")).arg(BIN);
            command
        }
        None => Command::new(BIN),
    };
    command
        .args(["runner", "--server", url, "--data-dir"])
        .arg(data_dir)
        .args(["--runtime", "runc", "--capacity", "cpus=64,sandboxes=16"])
        .args(args)
        .env_remove("ROOST_RUNNER_TOKEN");
    // The runner token from a file (an argument would show in `ps`); an
    // empty one: none at all (a restart with the runner's own credential).
    if !token.is_empty() {
        let token_file = data_dir.with_extension("token");
        std::fs::write(&token_file, format!("{token}\n")).expect("write the runner token file");
        command.arg("--token-file").arg(&token_file);
    }
    command
        .env("ROOST_LOG", "info")
        .env("ROOST_LOG_FORMAT", "json")
        .env_remove("ROOST_FAILPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().expect("start roost runner");
    let (registered_tx, registered_rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().expect("stderr");
    let collected = logs.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("runner: {line}");
            if let Ok(entry) = serde_json::from_str::<Value>(&line)
                && entry["fields"]["message"] == "registered"
                && let Some(id) = entry["fields"]["runner_id"].as_str()
            {
                let _ = registered_tx.send(id.to_owned());
            }
            collected.lock().expect("logs").push(line);
        }
    });
    let runner_id = registered_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the runner registers");
    (child, runner_id)
}

impl Drop for RunnerProcess {
    fn drop(&mut self) {
        self.kill9();
        force_delete_containers(&self.runtime_root());
        delete_sandbox_netns(&self.data_dir);
        unmount_homes(&self.data_dir);
        let secrets = secrets_root(&self.data_dir);
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&secrets)
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir(&secrets);
    }
}

/// Where a runner of `data_dir` keeps delivered secrets by default (its
/// own tmpfs, named after the data dir).
pub(crate) fn secrets_root(data_dir: &Path) -> PathBuf {
    Path::new("/run/roost/secrets").join(
        data_dir
            .to_string_lossy()
            .trim_matches('/')
            .replace(|c: char| !(c.is_ascii_alphanumeric() || c == '-'), "_"),
    )
}

/// A killed runner leaves its bridge sandboxes' named network namespaces
/// (`roost-ID`, bind mounts under /run/netns) behind: remove them.
fn delete_sandbox_netns(data_dir: &Path) {
    let Ok(listing) = std::fs::read_dir(data_dir.join("sandboxes")) else {
        return;
    };
    for entry in listing.flatten() {
        let name = format!("roost-{}", entry.file_name().to_string_lossy());
        if Path::new("/run/netns").join(&name).exists() {
            let _ = Command::new("ip")
                .args(["netns", "delete", &name])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The runner's homes image stays mounted after a kill -9: unmount it so
/// the test's temp dir can go (and no loop device leaks).
pub(crate) fn unmount_homes(data_dir: &Path) {
    let _ = Command::new("umount")
        .arg("-l")
        .arg(data_dir.join("volumes"))
        .stderr(Stdio::null())
        .status();
}

pub(crate) fn force_delete_containers(runtime_root: &Path) {
    let Ok(listing) = std::fs::read_dir(runtime_root) else {
        return;
    };
    for entry in listing.flatten() {
        let _ = Command::new("runc")
            .arg(format!("--root={}", runtime_root.display()))
            .args(["delete", "--force"])
            .arg(entry.file_name())
            .stderr(Stdio::null())
            .status();
    }
}

/// A server (SQLite) with an org, and a runner on it. Fields drop in
/// order: the runner goes before its server.
pub(crate) struct Stack {
    pub(crate) runner: RunnerProcess,
    pub(crate) plane: Plane,
    _dir: tempfile::TempDir,
}

impl Stack {
    async fn start() -> Stack {
        Self::start_with(&[]).await
    }

    async fn start_with(runner_env: &[(&str, &str)]) -> Stack {
        Self::start_full(&[], runner_env).await
    }

    /// A server, and a runner started with `runner_args`.
    async fn start_with_runner_args(runner_args: &[&str]) -> Stack {
        Self::start_with_args(&[], runner_args).await
    }

    /// A server started with `server_args`, and a runner with
    /// `runner_args`.
    pub(crate) async fn start_with_args(server_args: &[&str], runner_args: &[&str]) -> Stack {
        Self::start_parts(server_args, &[], runner_args).await
    }

    /// A server started with `server_args`, and a runner.
    pub(crate) async fn start_full(server_args: &[&str], runner_env: &[(&str, &str)]) -> Stack {
        Self::start_parts(server_args, runner_env, &[]).await
    }

    async fn start_parts(
        server_args: &[&str],
        runner_env: &[(&str, &str)],
        runner_args: &[&str],
    ) -> Stack {
        let plane = Plane::start(server_args).await;
        let dir = tempfile::Builder::new()
            .prefix("roost-e2e-")
            .tempdir()
            .expect("tempdir");
        let runner = RunnerProcess::start_in(
            &plane.server.url,
            &plane.runner_token,
            &dir.path().join("runner"),
            runner_env,
            None,
            runner_args,
        );
        Stack {
            plane,
            runner,
            _dir: dir,
        }
    }

    pub(crate) fn api(&self) -> &Api {
        &self.plane.org
    }

    /// Creates a sandbox and waits until it runs.
    pub(crate) async fn running_sandbox(&self, body: Value) -> Value {
        let created = self.api().post("/v1/sandboxes", body).await;
        assert_eq!(created.status, 201, "{created:?}");
        let id = created.str("id");
        let sandbox = wait_sandbox(self.api(), &id, "running").await;
        assert_eq!(sandbox["state"], "running", "{sandbox}");
        assert_eq!(sandbox["runner_id"], self.runner.runner_id.as_str());
        sandbox
    }

    /// Where the runner keeps the sandbox's home (see runner::agent::homes).
    fn home(&self, sandbox_id: &str) -> PathBuf {
        self.runner.data_dir.join("volumes/homes").join(sandbox_id)
    }
}

/// Creates a sandbox and waits until it runs; returns its id.
pub(crate) async fn create_running(api: &Api, body: Value) -> String {
    let created = api.post("/v1/sandboxes", body).await;
    assert_eq!(created.status, 201, "{created:?}");
    let id = created.str("id");
    let sandbox = wait_sandbox(api, &id, "running").await;
    assert_eq!(sandbox["state"], "running", "{sandbox}");
    id
}

/// Long-polls the sandbox until `state` (or an end state), at most 30 s.
pub(crate) async fn wait_sandbox(api: &Api, id: &str, state: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = api
            .get(&format!("/v1/sandboxes/{id}?wait_for={state}&timeout=10"))
            .await;
        assert_eq!(answer.status, 200, "{answer:?}");
        let done = answer.body["state"] == state
            || ["failed", "terminated", "deleted"]
                .contains(&answer.body["state"].as_str().unwrap_or(""));
        if done || Instant::now() >= deadline {
            return answer.body;
        }
    }
}

/// Runs a command to its end; returns the record, stdout and stderr.
pub(crate) async fn exec(api: &Api, sandbox_id: &str, body: Value) -> (Value, String, String) {
    let created = api
        .post(&format!("/v1/sandboxes/{sandbox_id}/commands"), body)
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let command = wait_command(api, sandbox_id, &created.str("id"), "ended").await;
    let stdout = output(api, sandbox_id, &created.str("id"), "stdout").await;
    let stderr = output(api, sandbox_id, &created.str("id"), "stderr").await;
    (command, stdout, stderr)
}

/// `sh -c SCRIPT`, which must exit 0; returns its stdout.
pub(crate) async fn sh(api: &Api, sandbox_id: &str, script: &str) -> String {
    let (command, stdout, stderr) =
        exec(api, sandbox_id, json!({"argv": ["sh", "-c", script]})).await;
    assert_eq!(
        (command["state"].as_str(), command["exit_code"].as_i64()),
        (Some("exited"), Some(0)),
        "`{script}`: {command}\nstdout: {stdout}\nstderr: {stderr}"
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runaway_commands_record_keeps_the_bound_of_its_output_and_says_so() {
    let stack = Stack::start().await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let bound = api::commands::OUTPUT_STREAM_BYTES_MAX;
    let script = format!("head -c {} /dev/zero; echo done >&2", bound + 1024 * 1024);
    let created = api
        .post(
            &format!("/v1/sandboxes/{sid}/commands"),
            json!({"argv": ["sh", "-c", script]}),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let cid = created.str("id");
    let ended = wait_command(&api, &sid, &cid, "ended").await;
    assert_eq!(
        (ended["state"].as_str(), ended["exit_code"].as_i64()),
        (Some("exited"), Some(0)),
        "{ended}"
    );
    assert_eq!(ended["stdout_bytes"].as_u64(), Some(bound), "{ended}");
    assert_eq!(ended["stdout_truncated"], true, "{ended}");
    assert_eq!(ended["stderr_truncated"], false, "{ended}");
    assert_eq!(output(&api, &sid, &cid, "stderr").await, "done\n");
    stack.runner.assert_no_errors();
}

/// `resources.home_mib`: the runner bounds the home it gives the sandbox.
/// A write past the bound fails inside the sandbox ("Disk quota
/// exceeded") and the home never holds more; deleting frees room; another
/// sandbox's home on the same runner is not bounded by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_home_takes_no_write_past_its_bound() {
    let stack = Stack::start().await;
    let sandbox = stack
        .running_sandbox(json!({"resources": {"home_mib": 32}}))
        .await;
    assert_eq!(sandbox["resources"]["home_mib"], 32, "{sandbox}");
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let fill = "dd if=/dev/zero of=/workspace/big bs=1M count=64 conv=fsync";
    let (command, _, stderr) = exec(&api, &sid, json!({"argv": ["sh", "-c", fill]})).await;
    assert_eq!(command["state"], "exited", "{command}");
    assert_ne!(command["exit_code"], 0, "64 MiB went into a 32 MiB home");
    assert!(stderr.contains("Disk quota exceeded"), "{stderr}");
    let size = sh(&api, &sid, "stat -c %s /workspace/big").await;
    let size: u64 = size.trim().parse().expect("a size");
    assert!(size <= 32 << 20, "the home holds {size} bytes");
    sh(
        &api,
        &sid,
        "rm /workspace/big && dd if=/dev/zero of=/workspace/small bs=1M count=16 conv=fsync",
    )
    .await;
    // No way around the bound through a subvolume of its own (counted
    // apart from the home): refused.
    let (made, _, stderr) = exec(
        &api,
        &sid,
        json!({"argv": ["btrfs", "subvolume", "create", "/workspace/sub"]}),
    )
    .await;
    assert_ne!(made["exit_code"], 0, "a subvolume was made: {made}");
    assert!(stderr.contains("Operation not permitted"), "{stderr}");
    // An upload past the bound: 507, and nothing under the final name.
    let upload = crate::files::send(
        &api,
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{sid}/files?path=/workspace/upload.bin"),
        Some(vec![1u8; 24 << 20]),
        &[],
    )
    .await;
    upload.assert_error(507, "insufficient_storage");
    assert_eq!(sh(&api, &sid, "ls -A /workspace").await, "small\n");

    // Unbounded beside it on the same runner.
    let other = stack.running_sandbox(json!({})).await;
    let other = other["id"].as_str().expect("id");
    sh(&api, other, fill).await;
    stack.runner.assert_no_errors();
}

/// Audit finding: a sandbox could write without bound outside its home
/// (`/var`, `/srv`: its root layer, on the runner's own disk), filling it
/// for every sandbox and the runner. The root layer is a subvolume of the
/// homes' volume bounded by `--sandbox-disk-max`; a full one keeps the
/// sandbox, its runner and its neighbours working, and goes at delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_root_layer_takes_no_write_past_the_runners_bound() {
    let stack = Stack::start_with_runner_args(&["--sandbox-disk-max", "32MiB"]).await;
    let api = stack.api().clone();
    let sid = stack.running_sandbox(json!({})).await["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let layer = stack.runner.data_dir.join("volumes/roots").join(&sid);
    assert!(layer.join("rootfs").is_dir(), "the layer is in the volume");

    let fill = "dd if=/dev/zero of=/var/tmp/big bs=1M count=64 conv=fsync";
    let (command, _, stderr) = exec(&api, &sid, json!({"argv": ["sh", "-c", fill]})).await;
    assert_eq!(command["state"], "exited", "{command}");
    assert_ne!(command["exit_code"], 0, "64 MiB went into a 32 MiB layer");
    assert!(stderr.contains("Disk quota exceeded"), "{stderr}");
    let size: u64 = sh(&api, &sid, "stat -c %s /var/tmp/big")
        .await
        .trim()
        .parse()
        .expect("a size");
    assert!(size <= 32 << 20, "the layer holds {size} bytes");
    // The home is not the layer's: it takes what the layer would not.
    sh(
        &api,
        &sid,
        "dd if=/dev/zero of=/workspace/big bs=1M count=40 conv=fsync",
    )
    .await;

    // With its layer full, the sandbox still stops and starts: what the
    // runner writes for it is not in the layer.
    let stop = api
        .post(&format!("/v1/sandboxes/{sid}/stop"), json!({}))
        .await;
    assert_eq!(stop.status, 202, "{stop:?}");
    assert_eq!(
        wait_sandbox(&api, &sid, "stopped").await["state"],
        "stopped"
    );
    let start = api
        .post(&format!("/v1/sandboxes/{sid}/start"), json!({}))
        .await;
    assert_eq!(start.status, 202, "{start:?}");
    assert_eq!(
        wait_sandbox(&api, &sid, "running").await["state"],
        "running"
    );
    assert_eq!(
        sh(&api, &sid, "rm /var/tmp/big && echo freed").await,
        "freed\n"
    );

    // A neighbour on the same runner has a bound of its own.
    let other = stack.running_sandbox(json!({})).await;
    let other = other["id"].as_str().expect("id");
    sh(
        &api,
        other,
        "dd if=/dev/zero of=/var/tmp/big bs=1M count=24 conv=fsync",
    )
    .await;

    let deleted = api.delete(&format!("/v1/sandboxes/{sid}")).await;
    assert_eq!(deleted.status, 202, "{deleted:?}");
    assert_eq!(
        wait_sandbox(&api, &sid, "deleted").await["state"],
        "deleted"
    );
    assert!(!layer.exists(), "the layer goes with the sandbox");
    stack.runner.assert_no_errors();
}

/// Audit finding: a sandbox can write a tree tens of thousands of levels
/// deep in its root layer (`mkdir a; cd a` in a loop); the runner removed
/// the sandbox's directory with `std::fs::remove_dir_all`, which recursed
/// past its thread's stack and aborted the runner, every sandbox on it
/// with it. Deleted now as any other, and the runner serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_with_a_tree_deeper_than_any_stack_is_deleted_and_the_runner_serves_on() {
    let mut stack = Stack::start().await;
    let api = stack.api().clone();
    let deep = stack.running_sandbox(json!({})).await;
    let deep = deep["id"].as_str().expect("id").to_owned();
    let other = stack.running_sandbox(json!({})).await;
    let other = other["id"].as_str().expect("id").to_owned();
    // The default image is the host's /usr: python3 is there, and walks
    // down by relative paths (a shell's `cd` keeps the whole path).
    let build = "import os\nos.chdir('/var/tmp')\nfor _ in range(30000):\n    os.mkdir('a')\n    os.chdir('a')\nprint('deep')";
    assert_eq!(
        sh(&api, &deep, &format!("printf \"{build}\" | python3")).await,
        "deep\n"
    );

    let deleted = api.delete(&format!("/v1/sandboxes/{deep}")).await;
    assert_eq!(deleted.status, 202, "{deleted:?}");
    let gone = wait_sandbox(&api, &deep, "deleted").await;
    assert_eq!(gone["state"], "deleted", "{gone}");
    assert!(!stack.runner.data_dir.join("sandboxes").join(&deep).exists());
    assert!(
        !stack
            .runner
            .data_dir
            .join("volumes/roots")
            .join(&deep)
            .exists(),
        "its root layer went too"
    );
    assert!(
        stack.runner.child.try_wait().expect("wait").is_none(),
        "the runner died"
    );
    assert_eq!(sh(&api, &other, "echo still").await, "still\n");
    stack.runner.assert_no_errors();
}

pub(crate) async fn wait_command(api: &Api, sandbox_id: &str, id: &str, state: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let answer = api
            .get(&format!(
                "/v1/sandboxes/{sandbox_id}/commands/{id}?wait_for={state}&timeout=10"
            ))
            .await;
        assert_eq!(answer.status, 200, "{answer:?}");
        let ended = answer.body["ended_at"].is_string();
        if answer.body["state"] == state || ended || Instant::now() >= deadline {
            return answer.body;
        }
    }
}

async fn output(api: &Api, sandbox_id: &str, id: &str, stream: &str) -> String {
    let answer = api
        .get(&format!(
            "/v1/sandboxes/{sandbox_id}/commands/{id}/output?stream={stream}"
        ))
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.headers["x-roost-complete"], "true", "{answer:?}");
    String::from_utf8_lossy(&answer.bytes).into_owned()
}

fn state_of(command: &Value) -> (&str, Option<&str>) {
    (
        command["state"].as_str().unwrap_or(""),
        command["state_reason"].as_str(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_end_honestly_and_the_sandbox_is_confined() {
    let stack = Stack::start().await;
    let api = stack.api();
    let sandbox = stack
        .running_sandbox(json!({"resources": {"memory_mib": 64}}))
        .await;
    let sid = sandbox["id"].as_str().expect("id");

    // Output and exit codes are the program's own.
    let (command, stdout, _) = exec(api, sid, json!({"argv": ["echo", "hi"]})).await;
    assert_eq!(state_of(&command).0, "exited", "{command}");
    assert_eq!(command["exit_code"], 0);
    assert_eq!(stdout, "hi\n");
    let (command, stdout, stderr) = exec(
        api,
        sid,
        json!({"argv": ["sh", "-c", "echo out; echo err >&2; exit 3"]}),
    )
    .await;
    assert_eq!(
        (state_of(&command).0, command["exit_code"].as_i64()),
        ("exited", Some(3))
    );
    assert_eq!((stdout.as_str(), stderr.as_str()), ("out\n", "err\n"));

    // A missing executable never started: told apart from a program's 127.
    let (command, _, _) = exec(api, sid, json!({"argv": ["no-such-program"]})).await;
    assert_eq!(
        state_of(&command),
        ("launch_failed", Some("executable_not_found")),
        "{command}"
    );
    let (command, _, _) = exec(api, sid, json!({"argv": ["sh", "-c", "exit 127"]})).await;
    assert_eq!(
        (state_of(&command).0, command["exit_code"].as_i64()),
        ("exited", Some(127))
    );

    // A timeout ends it, soon after the second.
    let started = Instant::now();
    let (command, _, _) = exec(api, sid, json!({"argv": ["sleep", "30"], "timeout": 1})).await;
    assert_eq!(state_of(&command).0, "timed_out", "{command}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    // A signal through the API interrupts it.
    let created = api
        .post(
            &format!("/v1/sandboxes/{sid}/commands"),
            json!({"argv": ["sleep", "30"]}),
        )
        .await;
    let cid = created.str("id");
    let running = wait_command(api, sid, &cid, "running").await;
    assert_eq!(running["state"], "running", "{running}");
    let signalled = api
        .post(
            &format!("/v1/sandboxes/{sid}/commands/{cid}/signal"),
            json!({"signal": "TERM"}),
        )
        .await;
    assert_eq!(signalled.status, 202, "{signalled:?}");
    let command = wait_command(api, sid, &cid, "ended").await;
    assert_eq!(
        state_of(&command),
        ("interrupted", Some("signal_requested")),
        "{command}"
    );
    assert_eq!(command["signal"], "TERM");

    // Over the memory limit: the OOM killer ends it, the sandbox lives on.
    let (command, _, _) = exec(
        api,
        sid,
        json!({"argv": ["sh", "-c", "head -c 400000000 /dev/zero | tail"]}),
    )
    .await;
    assert_eq!(
        state_of(&command),
        ("resource_exhausted", Some("oom_killed")),
        "{command}"
    );
    let limit = sh(
        api,
        sid,
        "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes",
    )
    .await;
    assert_eq!(limit.trim(), (64u64 << 20).to_string());
    let after = api.get(&format!("/v1/sandboxes/{sid}")).await;
    assert_eq!(after.body["state"], "running", "{after:?}");

    // Confinement: only its own processes, no new privileges, a reduced
    // capability set.
    let processes = sh(api, sid, "ps -e -o pid=,args=").await;
    let lines: Vec<&str> = processes.lines().map(str::trim).collect();
    assert_eq!(
        lines.first(),
        Some(&"1 /.roost/init init --lease-dir /.roost/lease --agent-fd 3"),
        "{processes}"
    );
    assert!(
        lines.len() <= 6
            && !processes.contains("roost runner")
            && !processes.contains("roost server"),
        "the sandbox sees host processes:\n{processes}"
    );
    let entries = sh(api, sid, "ls /proc | grep -c '^[0-9]'").await;
    assert!(
        entries.trim().parse::<u32>().expect("count") <= 6,
        "{entries}"
    );
    let status = sh(api, sid, "cat /proc/self/status").await;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(str::trim)
            .unwrap_or_else(|| panic!("{name} in {status}"))
            .to_owned()
    };
    assert_eq!(field("NoNewPrivs"), "1");
    let effective = u64::from_str_radix(&field("CapEff"), 16).expect("hex");
    for (bit, name) in [
        (21, "SYS_ADMIN"),
        (13, "NET_RAW"),
        (19, "SYS_PTRACE"),
        (16, "SYS_MODULE"),
        (12, "NET_ADMIN"),
    ] {
        assert_eq!(effective & (1 << bit), 0, "CAP_{name} in {effective:x}");
    }
    assert_eq!(field("CapBnd"), field("CapEff"));
    assert_eq!(u64::from_str_radix(&field("CapInh"), 16).expect("hex"), 0);
    assert_eq!(u64::from_str_radix(&field("CapAmb"), 16).expect("hex"), 0);
    stack.runner.assert_no_errors();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_see_neither_each_other_nor_the_host() {
    let stack = Stack::start().await;
    let api = stack.api();
    let a = stack.running_sandbox(json!({})).await;
    let b = stack.running_sandbox(json!({})).await;
    let (a, b) = (a["id"].as_str().expect("id"), b["id"].as_str().expect("id"));
    let probe = format!("roost-probe-{a}");

    sh(api, a, "echo secret > /workspace/secret").await;
    assert!(stack.home(a).join("secret").is_file());
    // The image is read-only: a write under /usr fails and lands nowhere.
    let (command, _, stderr) = exec(
        api,
        a,
        json!({"argv": ["sh", "-c", format!("echo x > /usr/{probe}")]}),
    )
    .await;
    assert_ne!(command["exit_code"], 0, "{command}");
    assert!(stderr.contains("Read-only file system"), "{stderr}");
    // A write at the top level lands in A's own layer only.
    sh(api, a, &format!("mkdir -p /opt && echo x > /opt/{probe}")).await;
    assert!(!Path::new(&format!("/usr/{probe}")).exists());
    assert!(!Path::new(&format!("/opt/{probe}")).exists());

    let seen_by_b = sh(
        api,
        b,
        &format!(
            "ls -A /workspace; test -e /usr/{probe} && echo usr; test -e /opt/{probe} && echo opt; test -e {} && echo host-home; true",
            stack.home(a).display()
        ),
    )
    .await;
    assert_eq!(seen_by_b, "", "B sees A's files");
    assert_eq!(sh(api, a, "cat /workspace/secret").await, "secret\n");

    // TTL: expiry terminates the runtime; the record says why.
    let short = stack.running_sandbox(json!({"ttl": 1})).await;
    let short_id = short["id"].as_str().expect("id");
    let ended = wait_sandbox(api, short_id, "terminated").await;
    assert_eq!(
        (ended["state"].as_str(), ended["state_reason"].as_str()),
        (Some("terminated"), Some("ttl_expired")),
        "{ended}"
    );
    let runtime_root = stack.runner.runtime_root();
    assert!(
        eventually(Duration::from_secs(5), || {
            let gone = !runtime_root.join(short_id).exists();
            async move { gone }
        })
        .await,
        "a terminated sandbox's container is removed"
    );
    stack.runner.assert_no_errors();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_init_from_the_host_is_failed_workload_exited_within_2s() {
    let stack = Stack::start().await;
    let api = stack.api();
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id");
    let pid = stack.runner.init_pid(sid);

    let killed_at = Instant::now();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the init");
    let answer = api
        .get(&format!("/v1/sandboxes/{sid}?wait_for=failed&timeout=5"))
        .await;
    let noticed = killed_at.elapsed();
    assert_eq!(
        (
            answer.body["state"].as_str(),
            answer.body["state_reason"].as_str()
        ),
        (Some("failed"), Some("workload_exited")),
        "{answer:?}"
    );
    assert!(
        noticed < Duration::from_secs(2),
        "reported after {noticed:?}"
    );
    let events = api.get(&format!("/v1/sandboxes/{sid}/events")).await;
    let last = events.body["events"]
        .as_array()
        .and_then(|e| e.last())
        .cloned()
        .expect("events");
    assert!(
        last["message"].as_str().unwrap_or("").contains("killed"),
        "{last}"
    );
    stack.runner.assert_no_errors();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_keeps_the_home_start_comes_back_and_queued_commands_are_not_launched() {
    let mut stack = Stack::start().await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    sh(&api, &sid, "echo kept > /workspace/notes").await;

    let stop = api
        .post(&format!("/v1/sandboxes/{sid}/stop"), json!({}))
        .await;
    assert_eq!(stop.status, 202, "{stop:?}");
    let stopped = wait_sandbox(&api, &sid, "stopped").await;
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert!(
        !stack.runner.runtime_root().join(&sid).exists(),
        "no container while stopped"
    );
    assert!(
        stack.home(&sid).join("notes").is_file(),
        "the home stays on its runner"
    );

    let start = api
        .post(&format!("/v1/sandboxes/{sid}/start"), json!({}))
        .await;
    assert_eq!(start.status, 202, "{start:?}");
    let running = wait_sandbox(&api, &sid, "running").await;
    assert_eq!(running["state"], "running", "{running}");
    assert_eq!(running["runner_id"], stack.runner.runner_id.as_str());
    assert_eq!(running["epoch"], 2);
    assert_eq!(sh(&api, &sid, "cat /workspace/notes").await, "kept\n");

    // A command queued while the sandbox is being placed again, then
    // stopped before it ran: the runner is frozen so nothing can hand the
    // command over in between.
    api.post(&format!("/v1/sandboxes/{sid}/stop"), json!({}))
        .await;
    assert_eq!(
        wait_sandbox(&api, &sid, "stopped").await["state"],
        "stopped"
    );
    stack.runner.signal(rustix::process::Signal::STOP);
    let start = api
        .post(&format!("/v1/sandboxes/{sid}/start"), json!({}))
        .await;
    assert_eq!(start.body["state"], "starting", "{start:?}");
    let queued = api
        .post(
            &format!("/v1/sandboxes/{sid}/commands"),
            json!({"argv": ["sh", "-c", "echo ran >> /workspace/ran"]}),
        )
        .await;
    assert_eq!(queued.body["state"], "queued", "{queued:?}");
    api.post(&format!("/v1/sandboxes/{sid}/stop"), json!({}))
        .await;
    stack.runner.signal(rustix::process::Signal::CONT);
    let command = wait_command(&api, &sid, &queued.str("id"), "ended").await;
    assert_eq!(state_of(&command).0, "not_launched", "{command}");
    assert_eq!(
        wait_sandbox(&api, &sid, "stopped").await["state"],
        "stopped"
    );
    assert!(!stack.home(&sid).join("ran").exists());

    // Delete releases everything on the runner.
    let deleted = api.delete(&format!("/v1/sandboxes/{sid}")).await;
    assert_eq!(deleted.status, 202, "{deleted:?}");
    let gone = wait_sandbox(&api, &sid, "deleted").await;
    assert_eq!(gone["state"], "deleted", "{gone}");
    assert!(!stack.home(&sid).exists());
    assert!(!stack.runner.data_dir.join("sandboxes").join(&sid).exists());
    assert!(!stack.runner.runtime_root().join(&sid).exists());
    stack.runner.assert_no_errors();
    stack.runner.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_restart_readopts_sandboxes_and_never_runs_a_command_twice() {
    let mut stack = Stack::start_with(&[("ROOST_FAILPOINT", "runner:after_command_launch")]).await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let pid = stack.runner.init_pid(&sid);
    let count = stack.home(&sid).join("count");

    // The runner dies (SIGKILL, at the failpoint) right after launching.
    // It outlives the runner: its output after the restart comes through
    // the sandbox's agent, which held it.
    let body = json!({"argv": ["sh", "-c", "echo run >> /workspace/count; echo started; sleep 1; echo finished; echo to-stderr >&2"]});
    let key = [("idempotency-key", "count-once")];
    let created = api
        .post_with(&format!("/v1/sandboxes/{sid}/commands"), body.clone(), &key)
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let cid = created.str("id");
    let deadline = Instant::now() + Duration::from_secs(20);
    while stack.runner.child.try_wait().expect("wait").is_none() {
        assert!(Instant::now() < deadline, "the failpoint never fired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ran_once = eventually(Duration::from_secs(10), || {
        let text = std::fs::read_to_string(&count).unwrap_or_default();
        async move { text == "run\n" }
    })
    .await;
    assert!(ran_once, "the launched command ran");

    // Restarted, the runner re-adopts the container (same init) and
    // attaches again to the command through the agent: it ends `exited`
    // with all its output, and it ran once.
    stack.runner.restart(&[]);
    let command = wait_command(&api, &sid, &cid, "ended").await;
    assert_eq!(state_of(&command), ("exited", None), "{command}");
    assert_eq!(command["exit_code"], 0, "{command}");
    assert!(command["pid"].as_i64().is_some_and(|p| p > 1), "{command}");
    assert_eq!(
        output(&api, &sid, &cid, "stdout").await,
        "started\nfinished\n"
    );
    assert_eq!(output(&api, &sid, &cid, "stderr").await, "to-stderr\n");
    let retried = api
        .post_with(&format!("/v1/sandboxes/{sid}/commands"), body, &key)
        .await;
    assert_eq!(retried.str("id"), cid, "{retried:?}");
    assert!(retried.replayed);
    assert_eq!(sh(&api, &sid, "cat /workspace/count").await, "run\n");
    assert_eq!(
        stack.runner.init_pid(&sid),
        pid,
        "the sandbox was restarted"
    );

    // A plain kill -9 and restart: still the same container, still usable.
    stack.runner.restart(&[]);
    assert_eq!(
        stack.runner.init_pid(&sid),
        pid,
        "the sandbox was restarted"
    );
    assert_eq!(sh(&api, &sid, "echo again").await, "again\n");
    let record = api.get(&format!("/v1/sandboxes/{sid}")).await;
    assert_eq!(
        (record.body["state"].as_str(), record.body["epoch"].as_u64()),
        (Some("running"), Some(1))
    );
    let events = api.get(&format!("/v1/sandboxes/{sid}/events")).await;
    let states: Vec<&str> = events.body["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["state"].as_str())
        .collect();
    assert_eq!(states, ["pending", "starting", "running"], "{events:?}");

    // Its own credential is in the data dir, for root alone; restarted
    // with no runner token at all, it registers with that credential as
    // the same runner and goes on serving its sandbox.
    {
        use std::os::unix::fs::PermissionsExt;
        let credential = stack.runner.data_dir.join("runner-token");
        let mode = std::fs::metadata(&credential)
            .expect("the runner's credential")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{}", credential.display());
    }
    let runner_id = stack.runner.runner_id.clone();
    stack.runner.token = String::new();
    stack.runner.restart(&[]);
    assert_eq!(stack.runner.runner_id, runner_id, "a new identity");
    assert_eq!(
        stack.runner.init_pid(&sid),
        pid,
        "the sandbox was restarted"
    );
    assert_eq!(sh(&api, &sid, "echo still").await, "still\n");
    stack.runner.assert_no_errors();
}

/// Audit findings: a runner restarted while a command ran delivered the
/// command's last requested signal again when it attached to it anew (a
/// program that counts its SIGINTs got two for one request), and a second
/// request for the signal asked last was dropped. Each request has its
/// number; what was delivered is in the command's launch record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_signal_asked_is_delivered_once_between_polls_and_across_a_restart() {
    let mut stack = Stack::start().await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let got = stack.home(&sid).join("got");
    // Counts its signals in a file, ticks on stdout, ends on SIGTERM.
    let script = "for s in INT HUP USR1 USR2; do trap \"echo $s >> /workspace/got\" $s; done; while :; do echo tick; sleep 0.1; done";
    let created = api
        .post(
            &format!("/v1/sandboxes/{sid}/commands"),
            json!({"argv": ["sh", "-c", script]}),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let cid = created.str("id");
    let running = wait_command(&api, &sid, &cid, "running").await;
    assert_eq!(running["state"], "running", "{running}");
    let signal = |name: &'static str| {
        let api = api.clone();
        let path = format!("/v1/sandboxes/{sid}/commands/{cid}/signal");
        async move {
            let answer = api.post(&path, json!({ "signal": name })).await;
            assert_eq!(answer.status, 202, "{name}: {answer:?}");
        }
    };
    signal("INT").await;
    let counted = eventually(Duration::from_secs(20), || {
        let text = std::fs::read_to_string(&got).unwrap_or_default();
        async move { text == "INT\n" }
    })
    .await;
    assert!(counted, "the SIGINT was delivered");

    // The output's length: it grows again once the restarted runner has
    // attached to the command anew (and would have signalled it again).
    let stdout_bytes = || {
        let api = api.clone();
        let path = format!("/v1/sandboxes/{sid}/commands/{cid}/output?stream=stdout");
        async move { api.get(&path).await.bytes.len() }
    };
    stack.runner.restart(&[]);
    let at_restart = stdout_bytes().await;
    // Ten ticks after the restart: a SIGINT delivered on attaching would
    // have run its trap (within one tick) by then.
    let attached = eventually(Duration::from_secs(40), || {
        let bytes = stdout_bytes();
        async move { bytes.await >= at_restart + 10 * "tick\n".len() }
    })
    .await;
    assert!(attached, "the restarted runner attached to the command");
    assert_eq!(
        std::fs::read_to_string(&got).expect("the count"),
        "INT\n",
        "one SIGINT asked, one delivered"
    );
    // A second request for the same signal is a new request: delivered.
    signal("INT").await;
    let counted = eventually(Duration::from_secs(20), || {
        let text = std::fs::read_to_string(&got).unwrap_or_default();
        async move { text == "INT\nINT\n" }
    })
    .await;
    assert!(
        counted,
        "the second SIGINT: {:?}",
        std::fs::read_to_string(&got)
    );
    // Three signals asked while the runner cannot poll (frozen): each is
    // delivered once it polls again, not only the last.
    stack.runner.signal(rustix::process::Signal::STOP);
    for name in ["HUP", "USR1", "USR2"] {
        signal(name).await;
    }
    stack.runner.signal(rustix::process::Signal::CONT);
    let all_delivered = |text: &str| {
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort_unstable();
        lines == ["HUP", "INT", "INT", "USR1", "USR2"]
    };
    let counted = eventually(Duration::from_secs(20), || {
        let text = std::fs::read_to_string(&got).unwrap_or_default();
        async move { all_delivered(&text) }
    })
    .await;
    assert!(
        counted,
        "HUP, USR1 and USR2 asked between two polls: {:?}",
        std::fs::read_to_string(&got)
    );
    signal("TERM").await;
    let ended = wait_command(&api, &sid, &cid, "ended").await;
    assert_eq!(
        state_of(&ended),
        ("interrupted", Some("signal_requested")),
        "{ended}"
    );
    let text = std::fs::read_to_string(&got).expect("the count");
    assert!(
        all_delivered(&text),
        "each asked once, delivered once: {text:?}"
    );
    stack.runner.assert_no_errors();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roost_up_serves_the_cli_without_flags_and_roost_purge_removes_all_it_made() {
    let tmp = tempfile::Builder::new()
        .prefix("roost-up-")
        .tempdir()
        .expect("tempdir");
    let config_home = tmp.path().join("config");
    let isolated = |command: &mut Command| {
        command
            .env("XDG_CONFIG_HOME", &config_home)
            .env("HOME", tmp.path().join("home"))
            .env_remove("ROOST_URL")
            .env_remove("ROOST_TOKEN")
            .env_remove("ROOST_FAILPOINT");
    };
    let mut up = Command::new(BIN);
    up.args([
        "up",
        "--listen",
        "127.0.0.1:0",
        "--runtime",
        "runc",
        "--json",
        "--data-dir",
    ])
    .arg(tmp.path().join("data"))
    .env("ROOST_LOG", "warn")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    isolated(&mut up);
    let mut child = up.spawn().expect("start roost up");
    let stderr = child.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("roost up: {line}");
        }
    });
    struct Up(Child, PathBuf);
    impl Drop for Up {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            force_delete_containers(&self.1);
            if let Some(data) = self.1.parent() {
                unmount_homes(data);
            }
        }
    }
    let mut up = Up(child, tmp.path().join("data/runner/runtime"));
    let mut lines = BufReader::new(up.0.stdout.take().expect("stdout")).lines();
    // With --json, one object once it is up.
    let first = lines.next().expect("a line").expect("read");
    let printed: Value = serde_json::from_str(&first)
        .unwrap_or_else(|e| panic!("unexpected first line {first:?}: {e}"));
    let url = printed["url"].as_str().expect("url").to_owned();
    let admin_token_file = tmp.path().join("data/server/admin-token");
    assert_eq!(
        printed["admin_token_file"],
        admin_token_file.to_str().expect("utf-8"),
        "{printed}"
    );
    std::thread::spawn(move || for _ in lines {});

    let credentials = config_home.join("roost/credentials.json");
    assert_eq!(printed["credentials"], credentials.to_str().expect("utf-8"));
    let mode = std::fs::metadata(&credentials).expect("credentials written");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o777, 0o600);
    let saved: Value =
        serde_json::from_slice(&std::fs::read(&credentials).expect("read")).expect("json");
    assert_eq!(saved["url"], url.as_str());
    assert!(
        saved["token"]
            .as_str()
            .is_some_and(|t| t.starts_with("roost_")),
        "{saved}"
    );

    let roost = |args: &[&str]| {
        let mut command = Command::new(BIN);
        command.args(args);
        isolated(&mut command);
        command.output().expect("run roost")
    };
    // Admin commands find the admin token without --token.
    assert_eq!(saved["admin_token_file"], printed["admin_token_file"]);
    let runners = roost(&["admin", "runner", "list", "--json"]);
    assert!(
        runners.status.success(),
        "{}",
        String::from_utf8_lossy(&runners.stderr)
    );
    let runners: Value = serde_json::from_slice(&runners.stdout).expect("json");
    assert_eq!(
        runners["runners"].as_array().map(Vec::len),
        Some(1),
        "{runners}"
    );
    let created = roost(&["sandbox", "create", "--wait", "--json"]);
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let sandbox: Value = serde_json::from_slice(&created.stdout).expect("record");
    assert_eq!(sandbox["state"], "running", "{sandbox}");
    let sid = sandbox["id"].as_str().expect("id");
    let hi = roost(&["exec", sid, "--", "echo", "hi"]);
    assert_eq!(String::from_utf8_lossy(&hi.stdout), "hi\n");
    assert_eq!(hi.status.code(), Some(0));
    let three = roost(&["exec", sid, "--", "sh", "-c", "exit 3"]);
    assert_eq!(three.status.code(), Some(3));
    let deleted = roost(&["sandbox", "delete", sid]);
    assert!(
        deleted.status.success(),
        "{}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    // One left running, with work in its home and a secret on the
    // runner's secrets tmpfs, for `roost purge` below.
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "s3cret").expect("a secret's value");
    let set = roost(&[
        "secret",
        "set",
        "api-key",
        "--from-file",
        secret.to_str().expect("utf-8"),
    ]);
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let kept = roost(&[
        "sandbox",
        "create",
        "--wait",
        "--json",
        "--secret-file",
        "api-key",
    ]);
    assert!(
        kept.status.success(),
        "{}",
        String::from_utf8_lossy(&kept.stderr)
    );
    let kept: Value = serde_json::from_slice(&kept.stdout).expect("record");
    let kept_id = kept["id"].as_str().expect("id").to_owned();
    let wrote = roost(&[
        "exec",
        &kept_id,
        "--",
        "sh",
        "-c",
        "echo work > /workspace/notes",
    ]);
    assert_eq!(wrote.status.code(), Some(0));
    let data = tmp.path().join("data");
    let secrets = std::path::Path::new("/run/roost/secrets").join(
        data.join("runner")
            .to_str()
            .expect("utf-8")
            .trim_matches('/')
            .replace(|c: char| !(c.is_ascii_alphanumeric() || c == '-'), "_"),
    );
    assert!(
        std::fs::read_to_string("/proc/self/mountinfo")
            .expect("mountinfo")
            .contains(secrets.to_str().expect("utf-8")),
        "the secrets tmpfs {} is mounted",
        secrets.display()
    );
    let data_arg = data.to_str().expect("utf-8");
    // Without --yes nothing is touched; while up runs, nothing either.
    let unasked = roost(&["purge", "--data-dir", data_arg]);
    assert!(!unasked.status.success());
    assert!(
        String::from_utf8_lossy(&unasked.stderr).contains("--yes"),
        "{}",
        String::from_utf8_lossy(&unasked.stderr)
    );
    let while_up = roost(&[
        "purge",
        "--data-dir",
        data_arg,
        "--runtime",
        "runc",
        "--yes",
    ]);
    assert!(!while_up.status.success());
    assert!(
        String::from_utf8_lossy(&while_up.stderr).contains("in use"),
        "{}",
        String::from_utf8_lossy(&while_up.stderr)
    );
    let still = roost(&["exec", &kept_id, "--", "cat", "/workspace/notes"]);
    assert_eq!(String::from_utf8_lossy(&still.stdout), "work\n");

    // SIGTERM stops it cleanly.
    let pid = rustix::process::Pid::from_raw(up.0.id() as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = up.0.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "roost up did not stop");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");

    // The sandbox outlives `roost up`; `roost purge` removes it and all
    // the rest: its container, every mount, the secrets tmpfs, the data
    // dir, the credentials saved for it.
    let runtime_root = data.join("runner/runtime");
    let init = Command::new("runc")
        .arg(format!("--root={}", runtime_root.display()))
        .args(["state", &kept_id])
        .output()
        .expect("runc state");
    assert!(
        init.status.success(),
        "the sandbox runs after roost up stopped"
    );
    let init_pid = serde_json::from_slice::<Value>(&init.stdout).expect("state")["pid"]
        .as_i64()
        .expect("pid");
    let purged = roost(&[
        "purge",
        "--data-dir",
        data_arg,
        "--runtime",
        "runc",
        "--yes",
        "--json",
    ]);
    assert!(
        purged.status.success(),
        "{}",
        String::from_utf8_lossy(&purged.stderr)
    );
    let purged: Value = serde_json::from_slice(&purged.stdout).expect("json");
    assert_eq!(purged["removed"], true, "{purged}");
    assert_eq!(purged["containers"], json!([kept_id]), "{purged}");
    assert_eq!(
        purged["credentials_removed"],
        credentials.to_str().expect("utf-8"),
        "{purged}"
    );
    assert!(!data.exists(), "the data dir is gone");
    assert!(!credentials.exists(), "the credentials are gone");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let tmp_dir = tmp.path().to_str().expect("utf-8");
    assert!(
        !mountinfo.contains(tmp_dir),
        "a mount is left beneath {tmp_dir}: {mountinfo}"
    );
    assert!(
        !secrets.exists(),
        "the secrets tmpfs {} is gone",
        secrets.display()
    );
    let init_gone = eventually(Duration::from_secs(20), || async move {
        !std::path::Path::new(&format!("/proc/{init_pid}")).exists()
    })
    .await;
    assert!(init_gone, "the sandbox's init {init_pid} was killed");
    // Again: nothing there, nothing to do.
    let again = roost(&["purge", "--data-dir", data_arg, "--yes"]);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing at"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_sandbox_gets_a_network_the_runner_offers_and_a_none_one_does_not() {
    let stack = Stack::start().await;
    let api = stack.api();
    // Admitted only because the runner registered `network:bridge`.
    let bridged = stack.running_sandbox(json!({"network": "bridge"})).await;
    let bid = bridged["id"].as_str().expect("id");
    let routes = sh(api, bid, "cat /proc/net/route").await;
    assert!(
        routes.lines().any(|l| l.starts_with("eth0\t00000000")),
        "a default route via eth0: {routes}"
    );
    let address = sh(
        api,
        bid,
        "python3 -c 'import socket,fcntl,struct; s=socket.socket(); print(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack(\"256s\", b\"eth0\"))[20:24]))'",
    )
    .await;
    assert!(
        address.starts_with("10.88."),
        "an address on the runner's subnet: {address}"
    );
    // The host's end of the bridge answers the sandbox.
    let listener = std::net::TcpListener::bind("10.88.0.1:0").expect("listen on the bridge");
    let port = listener.local_addr().expect("addr").port();
    let reached = sh(
        api,
        bid,
        &format!("python3 -c 'import socket; socket.create_connection((\"10.88.0.1\", {port}), 3); print(\"ok\")'"),
    )
    .await;
    assert_eq!(reached.trim(), "ok");
    let none = stack.running_sandbox(json!({})).await;
    let nid = none["id"].as_str().expect("id");
    let interfaces = sh(api, nid, "ls /sys/class/net").await;
    assert_eq!(interfaces.split_whitespace().collect::<Vec<_>>(), ["lo"]);
    stack.runner.assert_no_errors();
}

/// Issue 13, point 9: on a machine without an OCI runtime, `roost up`
/// says in one line what is missing and how to get it, before starting
/// anything (it used to start the server, then fail inside the runner).
#[test]
fn roost_up_without_a_runtime_says_what_to_install() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A PATH with only `sh`: no runc, no crun, no btrfs.
    let bin = tmp.path().join("bin");
    std::fs::create_dir_all(&bin).expect("bin");
    std::os::unix::fs::symlink("/bin/sh", bin.join("sh")).expect("sh");
    let output = Command::new(BIN)
        .args(["up", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(tmp.path().join("data"))
        .env("PATH", &bin)
        .env("HOME", tmp.path().join("home"))
        .env("XDG_CONFIG_HOME", tmp.path().join("config"))
        .stdin(Stdio::null())
        .output()
        .expect("run roost up");
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(message_lines(&stderr).len(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("no runc or crun") && stderr.contains("apt-get install runc"),
        "{stderr}"
    );
    assert!(
        !tmp.path().join("data/server").exists(),
        "nothing started before the check"
    );
}

impl RunnerProcess {
    /// Every log line the runner wrote so far (its whole stderr).
    pub(crate) fn log_lines(&self) -> Vec<String> {
        self.logs.lock().expect("logs").clone()
    }
}

/// Issue 15, point 4: background work through the sandbox's agent. A
/// running command is listed (`?state=running`, `roost command list
/// --state running`) with its pid inside the sandbox, that pid is the
/// command's process there, and a signal is delivered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_commands_are_listed_with_their_pid_and_a_signal_ends_them() {
    let stack = Stack::start().await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let created = api
        .post(
            &commands,
            json!({"argv": ["sh", "-c", "echo ready; exec sleep 1000"]}),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let cid = created.str("id");

    let deadline = Instant::now() + Duration::from_secs(20);
    let pid = loop {
        let page = api.get(&format!("{commands}?state=running")).await;
        let pid = page.body["commands"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["id"] == cid.as_str())
            .and_then(|c| c["pid"].as_i64());
        if let Some(pid) = pid {
            break pid;
        }
        assert!(
            Instant::now() < deadline,
            "never listed running with a pid: {page:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let cmdline = sh(&api, &sid, &format!("tr '\\0' ' ' < /proc/{pid}/cmdline")).await;
    assert_eq!(cmdline.trim(), "sleep 1000", "pid {pid} is the command");

    // The CLI lists it too, with the pid.
    let output = Command::new(BIN)
        .args(["command", "list", &sid, "--state", "running", "--json"])
        .env("ROOST_URL", &api.url)
        .env("ROOST_TOKEN", &api.token)
        .output()
        .expect("roost command list");
    assert!(output.status.success(), "{output:?}");
    let listed: Value = serde_json::from_slice(&output.stdout).expect("json");
    let pids: Vec<i64> = listed["commands"]
        .as_array()
        .expect("commands")
        .iter()
        .filter_map(|c| c["pid"].as_i64())
        .collect();
    assert!(pids.contains(&pid), "{listed}");

    // A signal ends it at once, and it leaves the running list.
    let signalled = api
        .post(
            &format!("{commands}/{cid}/signal"),
            json!({"signal": "TERM"}),
        )
        .await;
    assert_eq!(signalled.status, 202, "{signalled:?}");
    let ended = wait_command(&api, &sid, &cid, "ended").await;
    assert_eq!(
        state_of(&ended),
        ("interrupted", Some("signal_requested")),
        "{ended}"
    );
    let page = api.get(&format!("{commands}?state=running")).await;
    assert_eq!(page.body["commands"], json!([]), "{page:?}");
    let bogus = api.get(&format!("{commands}?state=asleep")).await;
    assert_eq!(bogus.status, 400, "{bogus:?}");
    assert_eq!(bogus.body["error"]["code"], "invalid_request");
    stack.runner.assert_no_errors();
}

/// The runner's data listener URL, from its log.
pub(crate) fn data_url(runner: &RunnerProcess) -> String {
    runner
        .log_lines()
        .iter()
        .filter(|l| l.contains("data listener bound"))
        .find_map(|l| {
            let value: Value = serde_json::from_str(l).ok()?;
            value["fields"]["url"]
                .as_str()
                .or_else(|| value["url"].as_str())
                .map(str::to_owned)
        })
        .expect("the runner logged its data listener")
}

/// Issue 15, points 2 and 6: a command's stdin, streamed from the client
/// through the server and the data path to the sandbox's agent.
/// `roost exec -i` pipes the local stdin (20 MiB arrive whole and in
/// order; a tar of a tree unpacks in the sandbox). The runner's data
/// listener takes nothing without a token minted for that request, and an
/// org reaches only its own commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_streams_through_the_data_path_and_the_runner_refuses_what_no_server_minted() {
    let stack = Stack::start().await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let dir = tempfile::tempdir().expect("tempdir");

    // 20 MiB of noise through `roost exec -i`: the sandbox's checksum is
    // the local one.
    let payload = dir.path().join("payload");
    let bytes: Vec<u8> = (0..20u32 * 1024 * 1024)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&payload, &bytes).expect("payload");
    let local = Command::new("sha256sum")
        .arg(&payload)
        .output()
        .expect("sha256sum");
    let local = String::from_utf8_lossy(&local.stdout)
        .split_whitespace()
        .next()
        .expect("digest")
        .to_owned();
    let roost = |args: &[&str], stdin: Stdio| {
        Command::new(BIN)
            .args(args)
            .env("ROOST_URL", &api.url)
            .env("ROOST_TOKEN", &api.token)
            .stdin(stdin)
            .output()
            .expect("roost")
    };
    let ran = roost(
        &["exec", "-i", &sid, "--", "sha256sum"],
        Stdio::from(std::fs::File::open(&payload).expect("open")),
    );
    assert!(ran.status.success(), "{ran:?}");
    assert_eq!(
        String::from_utf8_lossy(&ran.stdout)
            .split_whitespace()
            .next(),
        Some(local.as_str())
    );

    // A tree through tar, as the README shows it.
    let tree = dir.path().join("tree");
    std::fs::create_dir_all(tree.join("src/deep")).expect("tree");
    std::fs::write(tree.join("src/deep/main.rs"), "fn main() {}\n").expect("file");
    std::fs::write(tree.join("README"), "hello\n").expect("file");
    let archive = dir.path().join("tree.tar");
    let made = Command::new("tar")
        .arg("cf")
        .arg(&archive)
        .arg("-C")
        .arg(&tree)
        .arg(".")
        .status()
        .expect("tar");
    assert!(made.success());
    let ran = roost(
        &[
            "exec",
            "-i",
            &sid,
            "--",
            "sh",
            "-c",
            "mkdir -p /workspace/src && tar x -C /workspace/src && cat /workspace/src/src/deep/main.rs /workspace/src/README",
        ],
        Stdio::from(std::fs::File::open(&archive).expect("open")),
    );
    assert!(ran.status.success(), "{ran:?}");
    assert_eq!(
        String::from_utf8_lossy(&ran.stdout),
        "fn main() {}\nhello\n"
    );

    // Without `stdin: true` there is no stdin to write (409); after its
    // end neither.
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let created = api.post(&commands, json!({"argv": ["sleep", "30"]})).await;
    let cid = created.str("id");
    let refused = api.post_raw(&format!("{commands}/{cid}/stdin"), "x").await;
    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.body["error"]["code"], "invalid_state");

    // Another org sees no such command.
    let (other, _) = crate::plane::new_org(&stack.plane.admin, "org-stdin", json!({})).await;
    let hidden = other
        .post_raw(&format!("{commands}/{cid}/stdin"), "x")
        .await;
    assert_eq!(hidden.status, 404, "{hidden:?}");

    // The runner's data listener: no token, a forged one, one for another
    // sandbox: 401, nothing written.
    let url = format!(
        "{}/v1/data/sandboxes/{sid}/commands/{cid}/stdin",
        data_url(&stack.runner)
    );
    let http = reqwest::Client::new();
    let no_token = http.post(&url).body("x").send().await.expect("send");
    assert_eq!(no_token.status(), 401);
    let key = api::data_path::new_key().expect("key");
    let claims = api::data_path::DataClaims {
        sandbox_id: sid.clone(),
        epoch: 1,
        op: "stdin".to_owned(),
        command_id: Some(cid.clone()),
        subject: None,
        org_id: None,
        expires_unix_ms: u64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("time")
                .as_millis(),
        )
        .expect("ms")
            + 30_000,
    };
    let forged = http
        .post(&url)
        .bearer_auth(api::data_path::mint(&key, &claims))
        .body("x")
        .send()
        .await
        .expect("send");
    assert_eq!(forged.status(), 401);
    let junk = http
        .post(&url)
        .bearer_auth("roost-data-v1.e30.00")
        .body("x")
        .send()
        .await
        .expect("send");
    assert_eq!(junk.status(), 401);
    api.post(
        &format!("{commands}/{cid}/signal"),
        json!({"signal": "KILL"}),
    )
    .await;
    stack.runner.assert_no_errors();
}

/// Issue 15, point 6: on a deployment of two servers on one PostgreSQL,
/// the server a client happens to reach serves its streams, whichever
/// server the runner talks to: stdin through `roost exec -i` and an
/// attach, both through the second server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_server_of_a_deployment_serves_any_sandboxs_streams() {
    let database = crate::plane::postgres_database("streams");
    let plane = Plane::start_with(&[], &[], Some(&database)).await;
    let dir = tempfile::Builder::new()
        .prefix("roost-streams-")
        .tempdir()
        .expect("tempdir");
    let runner = RunnerProcess::start(
        &plane.server.url,
        &plane.runner_token,
        &dir.path().join("runner"),
        &[],
    );
    let second = crate::plane::start_server(&dir.path().join("b"), Some(&database));
    let via_second = Api::new(&second.url, &plane.org.token);

    let created = plane.org.post("/v1/sandboxes", json!({})).await;
    assert_eq!(created.status, 201, "{created:?}");
    let sid = created.str("id");
    let running = wait_sandbox(&plane.org, &sid, "running").await;
    assert_eq!(running["runner_id"], runner.runner_id.as_str());

    // stdin through the second server, which the runner never dials.
    let ran = Command::new(BIN)
        .args(["exec", "-i", &sid, "--", "sh", "-c", "tr a-z A-Z"])
        .env("ROOST_URL", &second.url)
        .env("ROOST_TOKEN", &plane.org.token)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(b"through the other server\n")?;
            child.wait_with_output()
        })
        .expect("roost exec -i");
    assert!(ran.status.success(), "{ran:?}");
    assert_eq!(
        String::from_utf8_lossy(&ran.stdout),
        "THROUGH THE OTHER SERVER\n"
    );

    // And a command's stdin written through the second server's API.
    let commands = format!("/v1/sandboxes/{sid}/commands");
    let created = via_second
        .post(&commands, json!({"argv": ["wc", "-c"], "stdin": true}))
        .await;
    let cid = created.str("id");
    let written = via_second
        .post_raw(&format!("{commands}/{cid}/stdin"), "12345")
        .await;
    assert_eq!(written.status, 200, "{written:?}");
    assert_eq!(written.body["bytes"], 5);
    let ended = wait_command(&plane.org, &sid, &cid, "ended").await;
    assert_eq!(state_of(&ended), ("exited", None), "{ended}");
    assert_eq!(output(&plane.org, &sid, &cid, "stdout").await.trim(), "5");
    runner.assert_no_errors();
}

/// However quickly a command ends (reported once, its end with its pid,
/// or `running` first), its record says it started, with its pid, before
/// it ended; one that runs a while is seen `running` first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_ends_at_once_is_recorded_started_then_ended_with_its_pid() {
    let stack = Stack::start().await;
    let sandbox = stack.running_sandbox(json!({})).await;
    let sid = sandbox["id"].as_str().expect("id").to_owned();
    let api = stack.api().clone();
    let commands = format!("/v1/sandboxes/{sid}/commands");
    for argv in [json!(["true"]), json!(["sh", "-c", "exit 3"])] {
        let created = api.post(&commands, json!({ "argv": argv })).await;
        assert_eq!(created.status, 201, "{created:?}");
        let ended = wait_command(&api, &sid, &created.str("id"), "ended").await;
        assert_eq!(ended["state"], "exited", "{ended}");
        assert!(ended["pid"].as_i64().is_some_and(|pid| pid > 0), "{ended}");
        let at = |field: &str| ended[field].as_str().expect(field).to_owned();
        let (created_at, started, end) = (at("created_at"), at("started_at"), at("ended_at"));
        assert!(created_at <= started && started <= end, "in order: {ended}");
    }
    let created = api
        .post(&commands, json!({"argv": ["sh", "-c", "sleep 3"]}))
        .await;
    let cid = created.str("id");
    let running = wait_command(&api, &sid, &cid, "running").await;
    assert_eq!(running["state"], "running", "{running}");
    assert!(running["pid"].as_i64().is_some(), "{running}");
    let ended = wait_command(&api, &sid, &cid, "ended").await;
    assert_eq!(
        (ended["state"].as_str(), ended["exit_code"].as_i64()),
        (Some("exited"), Some(0))
    );
}
