//! Org secrets end to end: `roost secret set` (stdin, never argv), a
//! durable sandbox given one as env and as a file, then saves, a stop
//! (securing), a snapshot and a recovery on another runner after a host
//! loss; the database, the store, both runners' data dirs and every log
//! are searched for the value's bytes: none. The sandbox sees it (env, and
//! `/run/secrets` mode 0400), and what it wrote to `/tmp` and `/run` never
//! comes back: only `/workspace` is saved.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::BIN;
use crate::plane::{Api, Plane, eventually, new_org, start_server_logging};
use crate::runner_e2e::{
    RunnerProcess, create_running, force_delete_containers, sh, unmount_homes, wait_sandbox,
};

/// A distinctive value: a prefix and 32 random hex digits.
fn distinctive(prefix: &str) -> String {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .expect("random bytes");
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// `roost ARGS…` against the server as the org, `stdin` piped in.
fn roost_as(api: &Api, args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .env("ROOST_URL", &api.url)
        .env("ROOST_TOKEN", &api.token)
        .env("HOME", "/nonexistent")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run roost");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin)
        .expect("write stdin");
    child.wait_with_output().expect("roost output")
}

/// sha256 of `value`, by the host's `sha256sum` (the value on stdin).
fn sha256_hex(value: &str) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(value.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("sha256sum output");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("a hash")
        .to_owned()
}

/// Files under `dir` (recursively, not following links) whose bytes
/// contain `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&path) {
                stack.extend(entries.flatten().map(|e| e.path()));
            }
        } else if meta.is_file()
            && let Ok(bytes) = std::fs::read(&path)
            && bytes.windows(needle.len()).any(|w| w == needle)
        {
            found.push(path);
        }
    }
    found
}

/// What the sandbox sees of its secrets: the env's and the file's hashes,
/// the file's mode and owner, and whether /run/secrets refuses a write.
/// (Hashes, not values: command output is stored.)
const SEEN: &str = "printf %s \"$API_TOKEN\" | sha256sum | cut -d' ' -f1; \
    sha256sum < /run/secrets/token | cut -d' ' -f1; stat -c '%a %u' /run/secrets/token; \
    if touch /run/secrets/x 2>/dev/null; then echo writable; else echo read-only; fi";

async fn assert_sees(api: &Api, id: &str, value: &str) {
    let hash = sha256_hex(value);
    let seen = sh(api, id, SEEN).await;
    assert_eq!(
        seen,
        format!("{hash}\n{hash}\n400 0\nread-only\n"),
        "what the sandbox sees of its secret"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivered_secret_is_seen_by_the_sandbox_and_nowhere_else() {
    let tmp = tempfile::Builder::new()
        .prefix("roost-secrets-")
        .tempdir()
        .expect("tempdir");
    let (server_dir, store_dir) = (tmp.path().join("server"), tmp.path().join("store"));
    let server_log = tmp.path().join("server.log");
    let server = start_server_logging(
        &server_dir,
        &[
            "--store",
            store_dir.to_str().expect("utf-8"),
            "--lease-ttl",
            "3s",
            "--save-interval-min",
            "1s",
        ],
        &[("ROOST_LOG", "debug")],
        std::fs::File::create(&server_log).expect("server log"),
    );
    let admin = Api::new(
        &server.url,
        server.admin_token.as_deref().expect("admin token"),
    );
    let (api, _) = new_org(&admin, "acme", json!({})).await;
    let runner_token = admin
        .post("/v1/admin/runner-tokens", json!({}))
        .await
        .str("token");
    let debug = [("ROOST_LOG", "debug")];
    let mut first = RunnerProcess::start(&server.url, &runner_token, &tmp.path().join("a"), &debug);

    // Set twice (a rotation): both versions' bytes must stay out of sight.
    let (old, secret, control) = (
        distinctive("roost-secret-old"),
        distinctive("roost-secret"),
        distinctive("roost-control"),
    );
    for value in [&old, &secret] {
        let set = roost_as(
            &api,
            &["secret", "set", "api-token", "--json"],
            value.as_bytes(),
        );
        assert!(set.status.success(), "{set:?}");
    }
    let listed = roost_as(&api, &["secret", "list", "--json"], b"");
    assert!(listed.status.success(), "{listed:?}");
    let listed: Value = serde_json::from_slice(&listed.stdout).expect("list json");
    assert_eq!(listed["secrets"][0]["name"], "api-token", "{listed}");
    assert_eq!(listed["secrets"][0]["version"], 2, "{listed}");
    assert!(listed["secrets"][0].get("value").is_none(), "{listed}");

    let id = create_running(
        &api,
        json!({
            "storage_class": "durable",
            "save_interval_s": 1,
            "secrets": [
                {"name": "api-token", "env": "API_TOKEN"},
                {"name": "api-token", "file": "token"},
            ],
        }),
    )
    .await;
    assert_sees(&api, &id, &secret).await;
    // A control value written to the home (so it is saved) and markers in
    // /tmp and /run (never saved).
    sh(
        &api,
        &id,
        &format!("printf %s {control} > /workspace/control; echo tmp-marker > /tmp/marker; echo run-marker > /run/marker"),
    )
    .await;

    // A snapshot, a save after the writes, a stop (securing), a start.
    let snapshot_id = crate::durable::replicated_snapshot(&api, &id).await;
    let now = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    assert!(
        eventually(Duration::from_secs(40), || async {
            let sandbox = api.get(&format!("/v1/sandboxes/{id}")).await.body;
            // A completed save holds the writes as of `safe_until`
            // (a later save may find the home unchanged and commit nothing).
            sandbox["save"]["safe_until"].as_str().unwrap_or("") > now.as_str()
        })
        .await,
        "no save completed after the writes"
    );
    let stop = api
        .post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    assert_eq!(stop.status, 202, "{stop:?}");
    assert_eq!(wait_sandbox(&api, &id, "stopped").await["state"], "stopped");
    let start = api
        .post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    assert_eq!(start.status, 202, "{start:?}");
    assert_eq!(wait_sandbox(&api, &id, "running").await["state"], "running");
    assert_sees(&api, &id, &secret).await;

    // The first runner's data dir, before its host goes.
    let first_dir = first.data_dir.clone();
    let in_first: Vec<PathBuf> = [&old, &secret]
        .iter()
        .flat_map(|v| files_containing(&first_dir, v.as_bytes()))
        .collect();
    assert!(
        in_first.is_empty(),
        "the secret is on the first runner's disk: {in_first:?}"
    );
    let first_logs = first.log_lines();

    // Host loss: the sandbox is recovered on a second runner from its last
    // save, and is given its secret there.
    let second = RunnerProcess::start(&server.url, &runner_token, &tmp.path().join("b"), &debug);
    first.kill9();
    force_delete_containers(&first.runtime_root());
    unmount_homes(&first_dir);
    std::fs::remove_dir_all(&first_dir).expect("delete the first runner's data dir");
    let on_second = second.runner_id.clone();
    assert!(
        eventually(Duration::from_secs(60), || async {
            let sandbox = api.get(&format!("/v1/sandboxes/{id}")).await.body;
            sandbox["state"] == "running" && sandbox["runner_id"] == on_second.as_str()
        })
        .await,
        "the sandbox did not come back on the second runner: {}",
        api.get(&format!("/v1/sandboxes/{id}")).await.body
    );
    assert_sees(&api, &id, &secret).await;
    // The home came back; /tmp and /run did not.
    let after = sh(
        &api,
        &id,
        "cat /workspace/control; echo; ls /tmp/marker /run/marker 2>&1 | grep -c 'No such file'",
    )
    .await;
    assert_eq!(after, format!("{control}\n2\n"));

    // A child of the snapshot gets the home's files, no secret it did not
    // ask for.
    let child = create_running(&api, json!({"from_snapshot": snapshot_id})).await;
    let child_sees = sh(&api, &child, "cat /workspace/control; echo; ls /run/secrets 2>&1 | grep -c 'No such file'; echo \"${API_TOKEN:-unset}\"").await;
    assert_eq!(child_sees, format!("{control}\n1\nunset\n"));

    // The bytes are nowhere at rest or in a log: the control value, saved
    // in the home, is found in the store the same way.
    let mut logs = first_logs;
    logs.extend(second.log_lines());
    let logs = logs.join("\n");
    let server_logs = std::fs::read(&server_log).expect("server log");
    for value in [&old, &secret] {
        for dir in [&server_dir, &store_dir, &second.data_dir] {
            let found = files_containing(dir, value.as_bytes());
            assert!(found.is_empty(), "a secret's bytes in {found:?}");
        }
        assert!(
            !logs.contains(value.as_str()),
            "a secret in the runners' logs"
        );
        assert!(
            !server_logs
                .windows(value.len())
                .any(|w| w == value.as_bytes()),
            "a secret in the server's log"
        );
    }
    assert!(
        !files_containing(&store_dir, control.as_bytes()).is_empty(),
        "the control value is not found in the store: the search proves nothing"
    );

    // Deleted, the secret cannot be delivered to a later launch.
    let stop = api
        .post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    assert_eq!(stop.status, 202, "{stop:?}");
    assert_eq!(wait_sandbox(&api, &id, "stopped").await["state"], "stopped");
    let deleted = roost_as(&api, &["secret", "delete", "api-token"], b"");
    assert!(deleted.status.success(), "{deleted:?}");
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    let failed = wait_sandbox(&api, &id, "failed").await;
    assert_eq!(
        (failed["state"].as_str(), failed["state_reason"].as_str()),
        (Some("failed"), Some("secret_unavailable")),
        "{failed}"
    );

    drop(second);
    drop(first);
    // The runners' tmpfs mounts for secrets (this machine is both hosts).
    for name in ["a", "b"] {
        let dir = tmp.path().join(name);
        let mount = PathBuf::from("/run/roost/secrets").join(
            dir.to_string_lossy()
                .trim_matches('/')
                .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "_"),
        );
        let _ = Command::new("umount").arg("-l").arg(&mount).status();
        let _ = std::fs::remove_dir(&mount);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_without_a_secret_key_refuses_secrets() {
    let plane = Plane::start(&["--no-secret-key"]).await;
    let api = &plane.org;
    let set = roost_as(api, &["secret", "set", "x"], b"value");
    assert!(!set.status.success());
    assert!(
        String::from_utf8_lossy(&set.stderr).contains("unsupported_capability"),
        "{set:?}"
    );
    let refused = api
        .post(
            "/v1/sandboxes",
            json!({"secrets": [{"name": "x", "env": "X"}]}),
        )
        .await;
    refused.assert_error(422, "unsupported_capability");
    assert_eq!(
        refused.body["error"]["details"]["missing"],
        json!(["secrets"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_checked_at_create_and_never_shown() {
    let plane = Plane::start(&[]).await;
    let api = &plane.org;
    // The key file is made 0600 in the server's data dir.
    let key = plane._tmp.path().join("data").join("secret-key");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&key)
            .expect("secret key file")
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    let value = distinctive("roost-secret");
    let set = roost_as(api, &["secret", "set", "tok"], value.as_bytes());
    assert!(set.status.success(), "{set:?}");
    assert!(!String::from_utf8_lossy(&set.stdout).contains(&value));
    let list = roost_as(api, &["secret", "list"], b"");
    assert!(
        String::from_utf8_lossy(&list.stdout).contains("tok"),
        "{list:?}"
    );
    assert!(!String::from_utf8_lossy(&list.stdout).contains(&value));
    let from_file = plane._tmp.path().join("value");
    std::fs::write(&from_file, "from a file").expect("write");
    let set = roost_as(
        api,
        &[
            "secret",
            "set",
            "tok2",
            "--from-file",
            from_file.to_str().expect("utf-8"),
        ],
        b"",
    );
    assert!(set.status.success(), "{set:?}");
    for (body, field) in [
        (json!([{"name": "missing", "env": "X"}]), "secrets"),
        (json!([{"name": "tok"}]), "secrets"),
        (json!([{"name": "tok", "env": "X", "file": "f"}]), "secrets"),
        (json!([{"name": "tok", "file": "../etc"}]), "secrets.file"),
        (json!([{"name": "tok", "env": "1X"}]), "secrets.env"),
        (
            json!([{"name": "tok", "env": "X"}, {"name": "tok2", "env": "X"}]),
            "secrets",
        ),
    ] {
        let refused = api.post("/v1/sandboxes", json!({"secrets": body})).await;
        refused.assert_error(400, "invalid_request");
        assert_eq!(
            refused.body["error"]["details"]["field"], field,
            "{refused:?}"
        );
    }
}

/// On PostgreSQL: the runner a sandbox is placed on reads which secrets it
/// asked for in its assignment (names only) and their values only with its
/// own credential at the placement's epoch; another runner, an old epoch
/// and a deleted secret are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_placements_runner_reads_the_values() {
    let plane =
        Plane::start_with(&[], &[], Some(&crate::plane::postgres_database("secrets"))).await;
    let api = &plane.org;
    let value = distinctive("roost-secret");
    let set = roost_as(api, &["secret", "set", "tok"], value.as_bytes());
    assert!(set.status.success(), "{set:?}");
    let runner = plane
        .runner("r1", "on_demand", crate::plane::STANDARD)
        .await;
    let sandbox = plane
        .running_sandbox(
            &runner,
            json!({"secrets": [{"name": "tok", "env": "TOK"}, {"name": "tok", "file": "tok"}]}),
        )
        .await;
    let id = sandbox["id"].as_str().expect("id").to_owned();
    assert!(!sandbox.to_string().contains(&value));
    let assignment = runner.assignment(&id).await;
    assert_eq!(
        assignment["secrets"],
        json!([{"name": "tok", "env": "TOK"}, {"name": "tok", "file": "tok"}])
    );
    assert!(!assignment.to_string().contains(&value));
    let epoch = assignment["epoch"].as_u64().expect("epoch");
    let path = format!("/v1/runner/sandboxes/{id}/secrets");
    let values = runner
        .api
        .post(&path, json!({"runner_id": runner.id, "epoch": epoch}))
        .await;
    assert_eq!(values.status, 200, "{values:?}");
    assert_eq!(values.body["secrets"][0]["value"], value.as_str());
    assert_eq!(values.body["secrets"][1]["file"], "tok");

    let stale = runner
        .api
        .post(&path, json!({"runner_id": runner.id, "epoch": epoch + 1}))
        .await;
    stale.assert_error(409, "fenced");
    let other = plane
        .runner("r2", "on_demand", crate::plane::STANDARD)
        .await;
    let elsewhere = other
        .api
        .post(&path, json!({"runner_id": other.id, "epoch": epoch}))
        .await;
    elsewhere.assert_error(409, "fenced");
    let impersonated = other
        .api
        .post(&path, json!({"runner_id": runner.id, "epoch": epoch}))
        .await;
    impersonated.assert_error(404, "not_found");
    // The org token reaches no value.
    api.post(&path, json!({"runner_id": runner.id, "epoch": epoch}))
        .await
        .assert_error(404, "not_found");

    let deleted = roost_as(api, &["secret", "delete", "tok"], b"");
    assert!(deleted.status.success(), "{deleted:?}");
    let gone = runner
        .api
        .post(&path, json!({"runner_id": runner.id, "epoch": epoch}))
        .await;
    gone.assert_error(404, "not_found");
    assert!(!gone.body.to_string().contains(&value));

    // Audit finding: a sandbox that ended keeps its `runner_id`, and its
    // runner kept reading the org's current secret values and its store
    // for as long as it liked. Once the sandbox is to be deleted, neither.
    let set = roost_as(api, &["secret", "set", "tok"], value.as_bytes());
    assert!(set.status.success(), "{set:?}");
    let org_id = sandbox["org_id"].as_str().expect("org id");
    let block = format!("/v1/blocks/{org_id}/block/{}", "ab".repeat(32));
    let held = runner.api.get(&block).await;
    assert_eq!(held.status, 404, "{held:?}");
    assert!(held.body.to_string().contains("no object"), "{held:?}");
    let deleting = api.delete(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!(deleting.status, 202, "{deleting:?}");
    let after = runner
        .api
        .post(&path, json!({"runner_id": runner.id, "epoch": epoch}))
        .await;
    after.assert_error(409, "invalid_state");
    assert!(!after.body.to_string().contains(&value));
    let store_closed = runner.api.get(&block).await;
    assert_eq!(store_closed.status, 404, "{store_closed:?}");
    assert!(
        store_closed.body.to_string().contains("no such org"),
        "{store_closed:?}"
    );
}

/// A sandbox whose workload died keeps no secret on its runner: the
/// values go with its container, not at its delete (which may never
/// come), so a failed sandbox leaves nothing on the host and one org's
/// failures cannot fill the secrets' tmpfs every sandbox there shares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_sandboxs_secrets_leave_its_runner() {
    let stack = crate::runner_e2e::Stack::start_full(&[], &[]).await;
    let api = stack.api();
    let value = distinctive("roost-secret-failed");
    let set = roost_as(api, &["secret", "set", "api-token"], value.as_bytes());
    assert!(set.status.success(), "{set:?}");
    let id = create_running(
        api,
        json!({"secrets": [{"name": "api-token", "file": "token"}]}),
    )
    .await;
    assert_eq!(sh(api, &id, "cat /run/secrets/token").await, value);
    let delivered = crate::runner_e2e::secrets_root(&stack.runner.data_dir).join(&id);
    assert!(delivered.is_dir(), "{} holds them", delivered.display());

    let pid = stack.runner.init_pid(&id);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).expect("a pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the init");
    assert_eq!(wait_sandbox(api, &id, "failed").await["state"], "failed");
    assert!(
        eventually(Duration::from_secs(10), || {
            let gone = !delivered.exists();
            async move { gone }
        })
        .await,
        "the failed sandbox's secrets stay at {}",
        delivered.display()
    );
}
