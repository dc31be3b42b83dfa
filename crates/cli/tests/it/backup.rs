//! Backup and restore of a deployment (issue 22): `roost admin backup`
//! of a running server's records and store, the data dir and store lost,
//! `roost admin restore` into fresh ones, and the durable sandbox woken
//! on a fresh runner with its files byte for byte. Then the faults: a
//! `roost store copy` killed between a pack and its index and resumed, a
//! corrupt object in the source, a backup destination that fills up, and
//! a restore into a target that is not empty.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

use crate::durable::{Fleet, LISTING, replicated_snapshot};
use crate::harness::{BIN, Backend, Env, message_lines};
use crate::plane::{Api, start_server_listening};
use crate::runner_e2e::{RunnerProcess, sh, wait_sandbox};

fn roost(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command.args(args).env_remove("ROOST_FAILPOINT");
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("run roost")
}

/// Runs a command that must succeed and print one JSON object.
fn roost_json(args: &[&str]) -> Value {
    let output = roost(args, &[]);
    assert!(
        output.status.success(),
        "roost {args:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("one JSON object on stdout")
}

fn utf8(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

const WRITE: &str = "cd /workspace && mkdir -p src/deep notes && head -c 2500000 /dev/urandom > big.bin \
    && printf 'hello\\n' > notes/a.txt && printf '#!/bin/sh\\necho hi\\n' > src/run.sh \
    && chmod 0750 src/run.sh && ln -s notes/a.txt link \
    && for i in $(seq 1 200); do echo \"file $i\" > src/deep/f$i; done";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_lost_whole_comes_back_from_its_backup_with_every_file() {
    let work = tempfile::tempdir().expect("tempdir");
    let store_dir = work.path().join("store");
    let mut fleet = Fleet::start_on(Some(utf8(&store_dir)), &[], &[]).await;
    fleet.runner("a");
    let id = fleet.create(json!({"storage_class": "durable"})).await;
    let api = fleet.api();
    sh(api, &id, WRITE).await;
    let before = sh(api, &id, LISTING).await;
    assert!(before.contains("./src/run.sh 750"), "{before}");
    let snapshot = replicated_snapshot(api, &id).await;
    assert_eq!(
        api.post(&format!("/v1/sandboxes/{id}/stop"), json!({}))
            .await
            .status,
        202
    );
    let stopped = wait_sandbox(api, &id, "stopped").await;
    assert_eq!(stopped["save"]["state"], "ok", "{stopped}");

    // The backup, the server still running.
    let data_dir = fleet.plane._tmp.path().join("data");
    let dest = work.path().join("backup");
    let backup = roost_json(&[
        "admin",
        "backup",
        utf8(&dest),
        "--data-dir",
        utf8(&data_dir),
        "--store",
        utf8(&store_dir),
        "--json",
    ]);
    assert_eq!(backup["counts"]["sandboxes"], 1, "{backup}");
    assert_eq!(backup["counts"]["snapshots"], 1, "{backup}");
    assert_eq!(backup["roots"]["snapshots"][0]["id"], snapshot.as_str());
    assert!(
        backup["copy"]["packs_copied"].as_u64() > Some(0),
        "{backup}"
    );

    // Everything lost: runner, server, data dir, store.
    let (url, runner_token) = (
        fleet.plane.server.url.clone(),
        fleet.plane.runner_token.clone(),
    );
    let org_token = fleet.api().token.clone();
    fleet.runners.clear();
    let _ = fleet.plane.server.child.kill();
    let _ = fleet.plane.server.child.wait();
    std::fs::remove_dir_all(&data_dir).expect("lose the data dir");
    std::fs::remove_dir_all(&store_dir).expect("lose the store");

    let restored = roost_json(&[
        "admin",
        "restore",
        utf8(&dest),
        "--data-dir",
        utf8(&data_dir),
        "--store",
        utf8(&store_dir),
        "--json",
    ]);
    assert_eq!(restored["ok"], true, "{restored}");
    assert_eq!(restored["sandboxes"], 1, "{restored}");
    assert_eq!(restored["snapshots"], 1, "{restored}");
    let check = roost_json(&[
        "admin",
        "check",
        "--data-dir",
        utf8(&data_dir),
        "--store",
        utf8(&store_dir),
        "--deep",
        "--json",
    ]);
    assert_eq!(check["ok"], true, "{check}");
    // The same records against a store that lost its pack indexes: every
    // root reported by kind and id, exit 1.
    let broken = work.path().join("broken");
    let copied = Command::new("cp")
        .args(["-a", utf8(&store_dir), utf8(&broken)])
        .status()
        .expect("cp");
    assert!(copied.success());
    for org in walk(&broken.join("orgs")) {
        let packs = broken.join("orgs").join(org).join("packs");
        for file in walk(&packs).iter().filter(|f| f.ends_with(".idx")) {
            std::fs::remove_file(packs.join(file)).expect("remove an index");
        }
    }
    let output = roost(
        &[
            "admin",
            "check",
            "--data-dir",
            utf8(&data_dir),
            "--store",
            utf8(&broken),
            "--json",
        ],
        &[],
    );
    assert!(!output.status.success());
    let report: Value = serde_json::from_slice(&output.stdout).expect("json");
    let named: Vec<(String, String)> = report["incomplete"]
        .as_array()
        .expect("incomplete")
        .iter()
        .map(|i| {
            (
                i["kind"].as_str().unwrap_or("").to_owned(),
                i["id"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert!(
        named.contains(&("sandbox".to_owned(), id.clone())),
        "{report}"
    );
    assert!(
        named.contains(&("snapshot".to_owned(), snapshot.clone())),
        "{report}"
    );

    // A fresh server on the restored data dir and store, a fresh runner.
    let listen = url.strip_prefix("http://").expect("http url").to_owned();
    let server = start_server_listening(
        &data_dir,
        &listen,
        &[
            "--store",
            utf8(&store_dir),
            "--lease-ttl",
            "3s",
            "--save-interval-min",
            "1s",
        ],
        &[],
    );
    let api = Api::new(&server.url, &org_token);
    let _runner = RunnerProcess::start(
        &server.url,
        &runner_token,
        &work.path().join("runner-b"),
        &[],
    );
    assert_eq!(
        api.post(&format!("/v1/sandboxes/{id}/start"), json!({}))
            .await
            .status,
        202
    );
    let running = wait_sandbox(&api, &id, "running").await;
    assert_eq!(running["state"], "running", "{running}");
    let after = sh(&api, &id, LISTING).await;
    assert_eq!(after, before, "the restored home differs");
    // The snapshot's tree is whole too: a child starts from it.
    let child = api
        .post(
            "/v1/sandboxes",
            json!({"storage_class": "durable", "from_snapshot": snapshot}),
        )
        .await;
    assert_eq!(child.status, 201, "{child:?}");
    let child_id = child.str("id");
    assert_eq!(
        wait_sandbox(&api, &child_id, "running").await["state"],
        "running"
    );
    assert_eq!(sh(&api, &child_id, LISTING).await, before);
}

/// Homes pushed into a local store at `env.store` (several packs).
fn pushed_store(env: &Env, homes: usize) {
    for i in 0..homes {
        let dir = env.path(&format!("home{i}"));
        std::fs::create_dir_all(&dir).expect("mkdir");
        for f in 0..20 {
            std::fs::write(
                dir.join(format!("f{f}")),
                format!("home {i} file {f} ").repeat(200),
            )
            .expect("write");
        }
        env.push(&dir, "acme", &format!("h{i}"));
    }
}

#[test]
fn a_copy_killed_between_a_pack_and_its_index_resumes_and_counts_nothing_half_written() {
    let env = Env::new(Backend::Local);
    pushed_store(&env, 3);
    let target = env.path("target");
    let args = [
        "store",
        "copy",
        "--from",
        &env.store,
        "--to",
        utf8(&target),
        "--json",
    ];
    let killed = roost(&args, &[("ROOST_FAILPOINT", "store_copy:after_pack_data")]);
    assert!(!killed.status.success(), "the failpoint killed it");
    let packs: Vec<String> = walk(&target.join("orgs/acme/packs"));
    assert!(packs.iter().any(|p| p.ends_with(".pack")), "{packs:?}");
    assert!(
        !packs.iter().any(|p| p.ends_with(".idx")),
        "no index before the kill: {packs:?}"
    );
    assert!(
        !target.join("orgs/acme/homes").exists(),
        "no pointer before the kill"
    );
    // Verify finds nothing to count in the target: no home, no pack.
    let verify = roost_json(&["store", "verify", "--store", utf8(&target), "--json"]);
    assert_eq!(
        (verify["roots"].as_u64(), verify["packs_checked"].as_u64()),
        (Some(0), Some(0))
    );

    let resumed = roost_json(&args);
    assert_eq!(resumed["ok"], true, "{resumed}");
    assert_eq!(resumed["pointers_copied"], 3, "{resumed}");
    let verify = roost_json(&["store", "verify", "--store", utf8(&target), "--json"]);
    assert_eq!(
        (verify["ok"].as_bool(), verify["roots"].as_u64()),
        (Some(true), Some(3)),
        "{verify}"
    );
    let again = roost_json(&args);
    assert_eq!(
        (
            again["packs_copied"].as_u64(),
            again["bytes_copied"].as_u64()
        ),
        (Some(0), Some(0))
    );
}

fn walk(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_corrupt_source_object_is_reported_not_copied_and_the_copy_exits_non_zero() {
    let env = Env::new(Backend::Local);
    pushed_store(&env, 1);
    let packs = Path::new(&env.store).join("orgs/acme/packs");
    let pack = walk(&packs)
        .into_iter()
        .find(|p| p.ends_with(".pack"))
        .expect("a pack");
    let path = packs.join(&pack);
    let mut bytes = std::fs::read(&path).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x55;
    std::fs::write(&path, bytes).expect("corrupt");
    // Another home, in another pack, stays sound.
    let dir = env.path("sound");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("x"), "sound").expect("write");
    env.push(&dir, "acme", "sound");

    let target = env.path("target");
    let output = roost(
        &[
            "store",
            "copy",
            "--from",
            &env.store,
            "--to",
            utf8(&target),
            "--json",
        ],
        &[],
    );
    assert!(!output.status.success());
    let report: Value = serde_json::from_slice(&output.stdout).expect("json");
    let corrupt = report["corrupt"].as_array().expect("corrupt");
    assert_eq!(corrupt.len(), 1, "{report}");
    let pack_id = pack.trim_end_matches(".pack");
    assert!(
        corrupt[0].as_str().expect("text").contains(pack_id),
        "{report}"
    );
    assert_eq!(report["pointers_copied"], 1, "{report}");
    assert!(
        report["pointers_held"][0]
            .as_str()
            .expect("held")
            .contains("acme/h0"),
        "{report}"
    );
    assert!(target.join("orgs/acme/homes/sound").exists());
    assert!(!target.join("orgs/acme/homes/h0").exists());
}

/// A tmpfs of `bytes` for one test, unmounted when dropped.
struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    fn mount(bytes: u64) -> SmallDisk {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("mount (the tests run as root)");
        assert!(status.success(), "mount a tmpfs");
        SmallDisk(dir)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

/// A server's data dir (its records) next to `env.store`.
fn records_of(env: &Env) -> std::path::PathBuf {
    let data_dir = env.path("data");
    // Started once: it makes and migrates the database, then goes.
    drop(crate::plane::start_server_with(
        &data_dir,
        &["--store", &env.store, "--no-secret-key"],
        &[],
    ));
    data_dir
}

#[test]
fn a_backup_destination_that_fills_up_fails_in_one_line_and_leaves_the_last_backup() {
    let env = Env::new(Backend::Local);
    let data_dir = records_of(&env);
    pushed_store(&env, 1);
    let disk = SmallDisk::mount(1024 * 1024);
    let dest = disk.0.path().join("dest");
    let args = [
        "admin",
        "backup",
        utf8(&dest),
        "--data-dir",
        utf8(&data_dir),
        "--store",
        &env.store,
        "--json",
    ];
    let first = roost_json(&args);
    let kept = Path::new(first["path"].as_str().expect("path")).to_owned();
    let manifest = std::fs::read(kept.join("manifest.json")).expect("manifest");

    // A home bigger than the disk: the next backup cannot fit.
    let big = env.path("big");
    std::fs::create_dir_all(&big).expect("mkdir");
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let noise: Vec<u8> = (0..3_000_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(big.join("noise"), noise).expect("write");
    env.push(&big, "acme", "big");
    std::thread::sleep(std::time::Duration::from_millis(1100)); // a new stamp
    let full = roost(&args, &[]);
    assert!(!full.status.success());
    let stderr = String::from_utf8_lossy(&full.stderr);
    assert_eq!(message_lines(&stderr).len(), 1, "one line: {stderr}");
    assert!(stderr.contains("backup_destination_full"), "{stderr}");
    assert_eq!(
        std::fs::read(kept.join("manifest.json")).expect("kept"),
        manifest
    );
    let left = walk(&dest.join("backups"));
    assert_eq!(
        left,
        vec![
            kept.file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned()
        ],
        "{left:?}"
    );
}

#[test]
fn a_restore_into_a_target_that_is_not_empty_is_refused_unless_forced() {
    let env = Env::new(Backend::Local);
    let data_dir = records_of(&env);
    pushed_store(&env, 1);
    let dest = env.path("dest");
    roost_json(&[
        "admin",
        "backup",
        utf8(&dest),
        "--data-dir",
        utf8(&data_dir),
        "--store",
        &env.store,
        "--json",
    ]);
    // The original deployment is still there: not empty.
    let args = [
        "admin",
        "restore",
        utf8(&dest),
        "--data-dir",
        utf8(&data_dir),
        "--store",
        &env.store,
    ];
    let refused = roost(&args, &[]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("restore_target_not_empty"), "{stderr}");
    assert!(
        stderr.contains("roost.db exists") && stderr.contains("holds objects"),
        "{stderr}"
    );
    // An empty data dir but a used store: still refused.
    let fresh = env.path("fresh");
    let refused = roost(
        &[
            "admin",
            "restore",
            utf8(&dest),
            "--data-dir",
            utf8(&fresh),
            "--store",
            &env.store,
        ],
        &[],
    );
    assert!(!refused.status.success());
    assert!(!fresh.join("roost.db").exists(), "nothing restored");
    let mut forced: Vec<&str> = args.to_vec();
    forced.extend(["--force", "--json"]);
    assert_eq!(roost_json(&forced)["ok"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_deployment_is_backed_up_with_pg_dump_and_restored_into_an_empty_database() {
    let env = Env::new(Backend::Local);
    let database = crate::plane::postgres_database("backup_src");
    let plane =
        crate::plane::Plane::start_with(&["--store", &env.store], &[], Some(&database)).await;
    let dest = env.path("dest");
    let data_dir = env.path("unused-data");
    let backup = roost_json(&[
        "admin",
        "backup",
        utf8(&dest),
        "--data-dir",
        utf8(&data_dir),
        "--database",
        &database,
        "--store",
        &env.store,
        "--json",
    ]);
    assert_eq!(backup["records"]["engine"], "postgres", "{backup}");
    let path = Path::new(backup["path"].as_str().expect("path")).to_owned();
    assert!(
        std::fs::metadata(path.join("records.pgdump"))
            .expect("dump")
            .len()
            > 0
    );

    // Not into the database it came from; into an empty one, yes.
    let refused = roost(
        &[
            "admin",
            "restore",
            utf8(&dest),
            "--data-dir",
            utf8(&data_dir),
            "--database",
            &database,
            "--store",
            utf8(&env.path("store2")),
        ],
        &[],
    );
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("has tables"));
    let target = crate::plane::postgres_database("backup_dst");
    let restored = roost_json(&[
        "admin",
        "restore",
        utf8(&dest),
        "--data-dir",
        utf8(&data_dir),
        "--database",
        &target,
        "--store",
        utf8(&env.path("store2")),
        "--json",
    ]);
    assert_eq!(restored["ok"], true, "{restored}");
    // The org the plane made is in the restored records.
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&target).await.expect("connect");
    let (orgs,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM orgs WHERE id = $1")
        .bind(&plane.org_id)
        .fetch_one(&mut conn)
        .await
        .expect("count");
    assert_eq!(orgs, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_whose_records_name_a_tree_the_store_lacks_writes_no_backup_and_names_it() {
    let env = Env::new(Backend::Local);
    let data_dir = records_of(&env);
    pushed_store(&env, 1);
    // An image row naming a tree that is in no store (as if gc had taken
    // it between the records copy and the store copy).
    let absent = "ab".repeat(32);
    {
        use sqlx::Connection;
        let url = format!("sqlite://{}", data_dir.join("roost.db").display());
        let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open");
        sqlx::query(
            "INSERT INTO images (org_id, name, root, files, logical_bytes, created_at_ms, updated_at_ms)
             VALUES ('acme', 'ghost', $1, 0, 0, 0, 0)",
        )
        .bind(&absent)
        .execute(&mut conn)
        .await
        .expect("insert");
    }
    let dest = env.path("dest");
    let output = roost(
        &[
            "admin",
            "backup",
            utf8(&dest),
            "--data-dir",
            utf8(&data_dir),
            "--store",
            &env.store,
        ],
        &[],
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("backup_incomplete"), "{stderr}");
    assert!(
        stderr.contains("image ghost") && stderr.contains(&absent),
        "{stderr}"
    );
    assert!(walk(&dest.join("backups")).is_empty(), "no backup written");
}
