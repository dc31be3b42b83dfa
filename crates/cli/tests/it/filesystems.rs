//! Shared filesystems end to end (issue 17, points 1-5): runners declaring
//! one host directory as filesystem `team`, org bindings through `roost
//! admin filesystem`, mounts on create and every refusal, two sandboxes on
//! two runners writing through it, and a durable sandbox whose own home
//! moves to `/private` and is the only thing saved.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use crate::durable::Fleet;
use crate::harness::BIN;
use crate::plane::{Api, new_org};
use crate::runner_e2e::{RunnerProcess, exec, sh, wait_sandbox};

/// Starts a runner declaring `filesystems` (`ID=PATH`); its index.
fn runner_with(fleet: &mut Fleet, data: &Path, name: &str, filesystems: &[String]) -> usize {
    let mut args = Vec::new();
    for declared in filesystems {
        args.extend(["--filesystem", declared.as_str()]);
    }
    let runner = RunnerProcess::start_in(
        &fleet.plane.server.url,
        &fleet.plane.runner_token,
        &data.join(name),
        &[],
        None,
        &args,
    );
    fleet.runners.push(runner);
    fleet.runners.len() - 1
}

/// `roost admin filesystem ARGS… --json`, which must succeed.
fn admin_fs(fleet: &Fleet, args: &[&str]) -> Value {
    let output = Command::new(BIN)
        .args(["admin", "filesystem"])
        .args(args)
        .arg("--json")
        .env("ROOST_URL", &fleet.plane.server.url)
        .env("ROOST_TOKEN", &fleet.plane.admin_token)
        .output()
        .expect("run roost admin filesystem");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("json")
}

async fn sandbox_count(api: &Api) -> usize {
    api.get("/v1/sandboxes").await.body["sandboxes"]
        .as_array()
        .map_or(0, Vec::len)
}

/// Creates the sandbox and waits for it to run or fail; its record.
async fn create_settled(api: &Api, body: Value) -> Value {
    let created = api.post("/v1/sandboxes", body).await;
    assert_eq!(created.status, 201, "{created:?}");
    wait_sandbox(api, &created.str("id"), "running").await
}

/// The shared directory. The runners make it a `nosuid,nodev` mount on
/// itself (`oci::shared::ensure_host_safe`); that mount is detached here,
/// last, so none outlives the test.
struct SharedDir(tempfile::TempDir);

impl SharedDir {
    fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.0.path())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runners_share_a_filesystem_and_every_refusal_holds() {
    let shared = SharedDir(tempfile::tempdir().expect("shared dir"));
    std::fs::create_dir(shared.path().join("proj")).expect("mkdir proj");
    std::os::unix::fs::symlink("/etc", shared.path().join("escape")).expect("symlink");
    std::os::unix::fs::symlink("../..", shared.path().join("up")).expect("symlink");
    let team = format!("team={}", shared.path().display());
    let data = tempfile::tempdir().expect("runner dirs");
    let mut fleet = Fleet::start_on(None, &[], &[]).await;
    let plain = fleet.runner("plain");
    let a = runner_with(&mut fleet, data.path(), "a", std::slice::from_ref(&team));
    let b = runner_with(&mut fleet, data.path(), "b", std::slice::from_ref(&team));
    let ids: Vec<String> = fleet.runners.iter().map(|r| r.runner_id.clone()).collect();
    let runners = fleet.plane.admin.get("/v1/admin/runners").await.body;
    let offers = |id: &str| {
        runners
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["id"] == id)
            .map(|r| r["capabilities"].to_string())
            .unwrap_or_default()
    };
    assert!(offers(&ids[a]).contains("\"filesystem:team\""), "{runners}");
    assert!(!offers(&ids[plain]).contains("filesystem:"), "{runners}");
    // A root over the runner's own data dir (every org's homes below it)
    // is refused at the runner's start.
    let over = Command::new(BIN)
        .args(["runner", "--server", &fleet.plane.server.url, "--data-dir"])
        .arg(data.path().join("c"))
        .arg("--filesystem")
        .arg(format!("team={}", data.path().display()))
        .env("ROOST_RUNNER_TOKEN", &fleet.plane.runner_token)
        .output()
        .expect("roost runner");
    let said = String::from_utf8_lossy(&over.stderr);
    assert!(
        !over.status.success() && said.contains("overlaps the runner's data dir"),
        "{over:?}"
    );
    let api = fleet.api().clone();
    let mount = |path: &str| json!({"filesystem": "team", "subpath": "proj", "path": path});

    // Not bound to the org yet: refused, nothing created.
    let refused = api
        .post("/v1/sandboxes", json!({"mounts": [mount("/mnt/team")]}))
        .await;
    assert_eq!(refused.status, 422, "{refused:?}");
    assert_eq!(refused.body["error"]["code"], "unsupported_capability");
    assert_eq!(
        refused.body["error"]["details"]["missing"],
        json!(["filesystem:team"])
    );
    assert_eq!(sandbox_count(&api).await, 0);

    // Bound (the CLI, the admin API): listed.
    let bound = admin_fs(&fleet, &["bind", "team", "--org", "acme"]);
    assert_eq!(bound["filesystem"], "team");
    assert_eq!(bound["read_only"], false);
    let listed = admin_fs(&fleet, &["list"]);
    assert_eq!(
        listed["bindings"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );

    // Bound, but no runner offers it: unsupported_capability naming it.
    admin_fs(&fleet, &["bind", "nowhere", "--org", "acme"]);
    let refused = api
        .post(
            "/v1/sandboxes",
            json!({"mounts": [{"filesystem": "nowhere", "path": "/mnt/x"}]}),
        )
        .await;
    assert_eq!(refused.status, 422, "{refused:?}");
    assert_eq!(refused.body["error"]["code"], "unsupported_capability");
    assert_eq!(
        refused.body["error"]["details"]["missing"],
        json!(["filesystem:nowhere"])
    );

    // Bad places and `..`: 400, nothing created.
    for bad in [
        json!({"filesystem": "team", "path": "/etc"}),
        json!({"filesystem": "team", "path": "/mnt"}),
        json!({"filesystem": "team", "path": "/mnt/../etc"}),
        json!({"filesystem": "team", "path": "/workspace/x"}),
        json!({"filesystem": "team", "subpath": "../x", "path": "/mnt/x"}),
        json!({"filesystem": "team", "subpath": "proj/../../x", "path": "/mnt/x"}),
        json!({"filesystem": "team", "subpath": "/proj", "path": "/mnt/x"}),
    ] {
        let refused = api.post("/v1/sandboxes", json!({"mounts": [bad]})).await;
        assert_eq!(refused.status, 400, "{bad}: {refused:?}");
        assert_eq!(refused.body["error"]["code"], "invalid_request");
    }
    let overlapping = json!({"mounts": [mount("/mnt/a"), mount("/mnt/a/b")]});
    assert_eq!(api.post("/v1/sandboxes", overlapping).await.status, 400);
    assert_eq!(sandbox_count(&api).await, 0);

    // A subdirectory that does not exist: refused at create (422, naming
    // it; a runner offering the filesystem was asked), nothing created.
    let missing = api
        .post(
            "/v1/sandboxes",
            json!({"mounts": [{"filesystem": "team", "subpath": "nope", "path": "/mnt/x"}]}),
        )
        .await;
    assert_eq!(missing.status, 422, "{missing:?}");
    assert_eq!(missing.body["error"]["code"], "unsupported_capability");
    assert_eq!(
        missing.body["error"]["details"]["missing"],
        json!(["directory:team/nope"])
    );
    assert!(
        missing.body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("nope"),
        "{missing:?}"
    );
    assert_eq!(sandbox_count(&api).await, 0);
    assert!(!shared.path().join("nope").exists());
    // A symlink out of the filesystem is not followed: refused at create.
    for escape in ["escape", "up"] {
        let out = api
            .post(
                "/v1/sandboxes",
                json!({"mounts": [{"filesystem": "team", "subpath": escape, "path": "/mnt/x"}]}),
            )
            .await;
        assert_eq!(out.status, 400, "{escape}: {out:?}");
        assert!(
            out.body["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("outside"),
            "{out:?}"
        );
    }
    assert_eq!(sandbox_count(&api).await, 0);
    // A directory that goes away after the create: the runner checks
    // again at launch, and the sandbox fails naming it.
    std::fs::create_dir(shared.path().join("gone")).expect("mkdir gone");
    let going = create_settled(
        &api,
        json!({"mounts": [{"filesystem": "team", "subpath": "gone", "path": "/mnt/x"}]}),
    )
    .await;
    assert_eq!(going["state"], "running", "{going}");
    let gid = going["id"].as_str().expect("id").to_owned();
    api.post(&format!("/v1/sandboxes/{gid}/stop"), json!({}))
        .await;
    assert_eq!(
        wait_sandbox(&api, &gid, "stopped").await["state"],
        "stopped"
    );
    std::fs::remove_dir(shared.path().join("gone")).expect("rmdir gone");
    api.post(&format!("/v1/sandboxes/{gid}/start"), json!({}))
        .await;
    let failed = wait_sandbox(&api, &gid, "failed").await;
    assert_eq!(failed["state_reason"], "mount_source_missing", "{failed}");
    assert!(
        failed["state_message"]
            .as_str()
            .unwrap_or("")
            .contains("gone"),
        "{failed}"
    );
    assert!(!shared.path().join("gone").exists());
    let deleted = api.delete(&format!("/v1/sandboxes/{gid}")).await;
    assert_eq!(deleted.status, 202, "{deleted:?}");
    assert_eq!(
        wait_sandbox(&api, &gid, "deleted").await["state"],
        "deleted"
    );

    // Two sandboxes on two runners (the first's runner drained meanwhile,
    // so the second lands on the other), one at /mnt/team, one owning
    // /workspace: each sees the other's writes.
    let one = create_settled(&api, json!({"mounts": [mount("/mnt/team")]})).await;
    assert_eq!(one["state"], "running", "{one}");
    let one_runner = one["runner_id"].as_str().unwrap_or("").to_owned();
    assert_ne!(
        one_runner, ids[plain],
        "placed on a runner without the filesystem"
    );
    assert_eq!(
        one["mounts"],
        json!([{"filesystem": "team", "subpath": "proj", "path": "/mnt/team", "read_only": false}])
    );
    let drain = |action: &'static str, id: String| {
        let admin = fleet.plane.admin.clone();
        async move {
            let answer = admin
                .post(&format!("/v1/admin/runners/{id}/{action}"), json!({}))
                .await;
            assert_eq!(answer.status, 200, "{answer:?}");
        }
    };
    drain("drain", one_runner.clone()).await;
    let two = create_settled(&api, json!({"mounts": [mount("/workspace")]})).await;
    assert_eq!(two["state"], "running", "{two}");
    let two_runner = two["runner_id"].as_str().unwrap_or("").to_owned();
    assert!(
        [&ids[a], &ids[b]].contains(&&two_runner) && two_runner != one_runner,
        "{two}"
    );
    drain("undrain", one_runner).await;
    let (one, two) = (
        one["id"].as_str().unwrap_or(""),
        two["id"].as_str().unwrap_or(""),
    );
    sh(&api, one, "echo from-one > /mnt/team/one.txt").await;
    assert_eq!(sh(&api, two, "cat /workspace/one.txt").await, "from-one\n");
    sh(&api, two, "echo from-two > /workspace/two.txt").await;
    assert_eq!(sh(&api, one, "cat /mnt/team/two.txt").await, "from-two\n");
    assert_eq!(
        std::fs::read_to_string(shared.path().join("proj/two.txt")).expect("on the host"),
        "from-two\n"
    );
    // The sandbox owning /workspace has its own home at /private, not
    // shared; HOME stays /workspace. No host path in its environment.
    sh(&api, two, "echo mine > /private/p.txt").await;
    assert!(!shared.path().join("proj/p.txt").exists());
    assert_eq!(sh(&api, two, "echo $HOME").await, "/workspace\n");
    let env = sh(&api, two, "env").await;
    assert!(!env.contains(&shared.path().display().to_string()), "{env}");
    // nosuid,nodev on the shared mount.
    let options = sh(&api, one, "grep ' /mnt/team ' /proc/self/mountinfo").await;
    assert!(
        options.contains("nosuid") && options.contains("nodev"),
        "{options}"
    );

    // Read-only, asked for or forced by the binding (another org's).
    let ro = create_settled(
        &api,
        json!({"mounts": [{"filesystem": "team", "subpath": "proj", "path": "/mnt/ro", "read_only": true}]}),
    )
    .await;
    let ro = ro["id"].as_str().unwrap_or("");
    let (write, _, _) = exec(
        &api,
        ro,
        json!({"argv": ["sh", "-c", "echo x > /mnt/ro/ro.txt"]}),
    )
    .await;
    assert_ne!(write["exit_code"], 0, "{write}");
    assert_eq!(sh(&api, ro, "cat /mnt/ro/one.txt").await, "from-one\n");
    let (beta, _) = new_org(&fleet.plane.admin, "beta", json!({})).await;
    let forced = admin_fs(&fleet, &["bind", "team", "--org", "beta", "--read-only"]);
    assert_eq!(forced["read_only"], true);
    let record = create_settled(&beta, json!({"mounts": [mount("/mnt/team")]})).await;
    assert_eq!(record["mounts"][0]["read_only"], true, "{record}");
    let id = record["id"].as_str().unwrap_or("");
    let (write, _, _) = exec(
        &beta,
        id,
        json!({"argv": ["sh", "-c", "echo x > /mnt/team/b.txt"]}),
    )
    .await;
    assert_ne!(write["exit_code"], 0, "{write}");
    assert!(!shared.path().join("proj/b.txt").exists());

    // Unbound: refused again.
    let removed = admin_fs(&fleet, &["unbind", "team", "--org", "beta"]);
    assert_eq!(removed["org_name"], "beta");
    let refused = beta
        .post("/v1/sandboxes", json!({"mounts": [mount("/mnt/team")]}))
        .await;
    assert_eq!(refused.status, 422, "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_workspace_keeps_private_across_runners_and_out_of_snapshots() {
    let shared = tempfile::tempdir().expect("shared dir");
    std::fs::create_dir(shared.path().join("ws")).expect("mkdir ws");
    let team = format!("team={}", shared.path().display());
    let data = tempfile::tempdir().expect("runner dirs");
    let mut fleet = Fleet::start_on(None, &[], &[]).await;
    let first = runner_with(&mut fleet, data.path(), "a", std::slice::from_ref(&team));
    admin_fs(&fleet, &["bind", "team", "--org", "acme"]);
    let api = fleet.api().clone();
    let created = create_settled(
        &api,
        json!({
            "storage_class": "durable",
            "mounts": [{"filesystem": "team", "subpath": "ws", "path": "/workspace"}],
        }),
    )
    .await;
    assert_eq!(created["state"], "running", "{created}");
    let id = created["id"].as_str().unwrap_or("").to_owned();
    sh(
        &api,
        &id,
        "echo mine > /private/mine.txt && echo ours > /workspace/shared.txt",
    )
    .await;

    // Stopped (secured), its runner drained: started on another runner,
    // /private comes back from the store, the shared files attached again.
    api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
        .await;
    let stopped = wait_sandbox(&api, &id, "stopped").await;
    assert_eq!(stopped["save"]["state"], "ok", "{stopped}");
    let second = runner_with(&mut fleet, data.path(), "b", std::slice::from_ref(&team));
    let first_id = fleet.runners[first].runner_id.clone();
    let drained = fleet
        .plane
        .admin
        .post(&format!("/v1/admin/runners/{first_id}/drain"), json!({}))
        .await;
    assert_eq!(drained.status, 200, "{drained:?}");
    api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
        .await;
    let running = wait_sandbox(&api, &id, "running").await;
    assert_eq!(
        running["runner_id"],
        fleet.runners[second].runner_id.as_str(),
        "{running}"
    );
    assert_eq!(sh(&api, &id, "cat /private/mine.txt").await, "mine\n");
    assert_eq!(sh(&api, &id, "cat /workspace/shared.txt").await, "ours\n");

    // A snapshot holds the private home only; a child without mounts
    // gets no shared file.
    let snapshot_id = crate::durable::replicated_snapshot(&api, &id).await;
    let child = create_settled(&api, json!({"from_snapshot": snapshot_id})).await;
    assert_eq!(child["state"], "running", "{child}");
    assert!(child.get("mounts").is_none(), "{child}");
    let child = child["id"].as_str().unwrap_or("");
    assert_eq!(sh(&api, child, "ls -A /workspace").await, "mine.txt\n");
}
