//! `roost store gc|verify|stats`, and pushes that die half way.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::harness::{BIN, Backend, Env, assert_same_tree, bytes, message_lines, n, write};

fn gc(env: &Env, grace: &str) -> serde_json::Value {
    env.json(&[
        "store", "gc", "--store", &env.store, "--grace", grace, "--json",
    ])
}

fn verify_ok(env: &Env) {
    let report = env.json(&["store", "verify", "--store", &env.store, "--json"]);
    assert_eq!(report["ok"], true, "{report}");
}

#[test]
fn gc_removes_old_unreferenced_keeps_young_and_referenced() {
    for backend in [Backend::Local, Backend::S3] {
        let env = Env::new(backend);
        let src = env.path("src");
        write(&src.join("keep.txt"), b"stays referenced");
        write(&src.join("old.bin"), &bytes(1, 50_000));
        env.push(&src, "acme", "h");
        std::fs::remove_file(src.join("old.bin")).expect("rm");
        env.push(&src, "acme", "h");
        // old.bin's block and the first root tree are now unreferenced, but
        // young: a young tree is treated as a root, so both are kept.
        let kept = gc(&env, "1h");
        assert_eq!(n(&kept, "objects"), 4, "{backend:?} {kept}");
        assert_eq!(n(&kept, "deleted"), 0, "{backend:?} {kept}");
        let swept = gc(&env, "0s");
        assert_eq!(n(&swept, "deleted"), 2, "{backend:?} {swept}");
        verify_ok(&env);
        let dest = env.path("dest");
        env.pull(&dest, "acme", "h");
        assert_same_tree(&src, &dest);
        let again = gc(&env, "0s");
        assert_eq!(n(&again, "deleted"), 0, "{backend:?} {again}");
    }
}

/// Makes every object in a local store look two hours old. A gc may be
/// sweeping at the same time: what it removes between the listing and
/// the aging (a repacked pack, an emptied directory) needs no aging.
fn age_local_store(env: &Env) {
    let old = std::time::SystemTime::now() - Duration::from_secs(7200);
    let gone = |err: &std::io::Error| err.kind() == std::io::ErrorKind::NotFound;
    let mut stack = vec![std::path::PathBuf::from(&env.store)];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(err) if gone(&err) => continue,
            Err(err) => panic!("read_dir {}: {err}", dir.display()),
        };
        for entry in entries {
            let path = entry.expect("entry").path();
            // Never the locks (issue 13, point 6): aging a gc's live lock
            // made it look stale, so a push committed in the middle of the
            // sweep, onto objects the sweep deleted, and the next gc found
            // the home pointing at a missing object. Only a holder that
            // stops refreshing lets its lock go stale.
            if path.file_name().is_some_and(|name| name == "locks") {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else {
                match std::fs::File::options().write(true).open(&path) {
                    Ok(file) => file.set_modified(old).expect("age"),
                    Err(err) if gone(&err) => {}
                    Err(err) => panic!("open {}: {err}", path.display()),
                }
            }
        }
    }
}

/// Regression for the bug class "a block reported present by the
/// missing-check is collected before the push commits, leaving a root that
/// points at nothing": pushes keep re-using old, unreferenced objects while
/// gc (default grace) sweeps them in a loop.
#[test]
fn gc_running_during_pushes_never_breaks_a_home() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    let write_version = |version: u64| {
        for i in 0..200 {
            write(
                &src.join(format!("d{}/f{i}", i % 10)),
                &bytes(i + 1000 * version, 2000),
            );
        }
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store = env.store.clone();
    // gc reads a store that is there (a missing one is `no store at`).
    std::fs::create_dir_all(&store).expect("the store's directory");
    let gc_loop = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut deleted = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let output = Command::new(BIN)
                    .args(["store", "gc", "--store", &store, "--json"])
                    .output()
                    .expect("gc");
                assert!(
                    output.status.success(),
                    "{}",
                    String::from_utf8_lossy(&output.stderr)
                );
                let report: serde_json::Value =
                    serde_json::from_slice(&output.stdout).expect("json");
                deleted += report["deleted"].as_u64().expect("deleted");
            }
            deleted
        })
    };
    for round in 0..10u64 {
        // The other version's objects are unreferenced; make them old, so
        // gc may take them at any moment while this push relies on them.
        write_version(round % 2);
        age_local_store(&env);
        env.push(&src, "acme", "h");
        let dest = env.path(&format!("dest{round}"));
        env.pull(&dest, "acme", "h");
        assert_same_tree(&src, &dest);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let deleted = gc_loop.join().expect("gc thread");
    assert!(
        deleted > 0,
        "gc never collected anything: the race was not exercised"
    );
    verify_ok(&env);
}

#[test]
fn push_killed_at_random_points_keeps_the_previous_root() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("v1.txt"), b"version one");
    let first = env.push(&src, "acme", "h");
    let reference = env.path("reference");
    env.pull(&reference, "acme", "h");
    // A bigger second version, so kills land in scan, upload and commit.
    for i in 0..200 {
        write(&src.join(format!("many/f{i}")), &bytes(i, 40_000));
    }
    write(&src.join("large.bin"), &bytes(9, 24 * 1024 * 1024));
    let mut delays_ms = vec![5u64, 20, 40, 60, 90, 130, 200];
    let mut committed = false;
    for delay in delays_ms.drain(..) {
        let mut child = Command::new(BIN)
            .args([
                "home",
                "push",
                src.to_str().expect("utf8"),
                "--store",
                &env.store,
                "--org",
                "acme",
                "--home",
                "h",
            ])
            .env("ROOST_STATE_DIR", env.path("state"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        std::thread::sleep(Duration::from_millis(delay));
        let _ = child.kill();
        let status = child.wait().expect("wait");
        let dest = env.path(&format!("after-{delay}"));
        let pulled = env.pull(&dest, "acme", "h");
        if pulled["root"] == first["root"] {
            assert!(!committed, "the pointer went back to an older root");
            assert_same_tree(&reference, &dest);
        } else {
            // The kill came after the commit: the pointer names the whole new tree.
            committed = true;
            assert!(status.success() || dest.join("large.bin").exists());
            assert_same_tree(&src, &dest);
        }
        verify_ok(&env);
    }
    let finished = env.push(&src, "acme", "h");
    let dest = env.path("final");
    env.pull(&dest, "acme", "h");
    assert_same_tree(&src, &dest);
    assert!(n(&finished, "files") >= 201);
    // Packs the kills tore (a pack without its index) are collected, and
    // nothing the home names goes with them.
    gc(&env, "0s");
    verify_ok(&env);
    let after_gc = env.path("after-gc");
    env.pull(&after_gc, "acme", "h");
    assert_same_tree(&src, &after_gc);
}

#[test]
fn stats_reports_per_org() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("a"), &vec![b'a'; 100_000]);
    env.push(&src, "one", "h");
    env.push(&src, "two", "h");
    let stats = env.json(&["store", "stats", "--store", &env.store, "--json"]);
    let orgs = stats["orgs"].as_array().expect("orgs");
    assert_eq!(orgs.len(), 2);
    for org in orgs {
        assert_eq!(org["homes"], 1);
        assert_eq!(org["logical_bytes"], 100_000);
        assert!(
            org["stored_bytes"].as_u64().expect("n") < 1000,
            "compressed: {org}"
        );
    }
    let table = env.roost(&["store", "stats", "--store", &env.store]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.starts_with("ORG") && table.contains("one") && table.contains("two"),
        "{table}"
    );
}

/// A full disk under the store: the push fails with one line naming the
/// problem and the file, and the home still points at its last snapshot.
#[test]
fn full_store_disk_fails_cleanly_and_keeps_the_previous_root() {
    let env = Env::new(Backend::Local);
    let mount = env.path("small-disk");
    std::fs::create_dir_all(&mount).expect("mkdir");
    let mounted = Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            "size=2m",
            "tmpfs",
            mount.to_str().expect("utf8"),
        ])
        .status()
        .expect("run mount");
    assert!(
        mounted.success(),
        "this test needs root to mount a small tmpfs"
    );
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mount.clone());
    let store = mount.join("store").display().to_string();
    let src = env.path("src");
    write(&src.join("small.txt"), b"fits");
    let push = |env: &Env| {
        let src = src.to_str().expect("utf8");
        env.roost(&[
            "home", "push", src, "--store", &store, "--org", "acme", "--home", "h", "--json",
        ])
    };
    let first = push(&env);
    assert!(first.status.success());
    let first: serde_json::Value = serde_json::from_slice(&first.stdout).expect("json");
    write(&src.join("big.bin"), &bytes(4, 6 * 1024 * 1024));
    let failed = push(&env);
    assert!(!failed.status.success());
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(message_lines(&stderr).len(), 1, "{stderr}");
    assert!(
        stderr.contains("No space left on device")
            && stderr.contains(&store)
            && stderr.contains("/packs/"),
        "the failed pack write is named: {stderr}"
    );
    let dest = env.path("dest");
    let pulled = env.json(&[
        "home",
        "pull",
        dest.to_str().expect("utf8"),
        "--store",
        &store,
        "--org",
        "acme",
        "--home",
        "h",
        "--json",
    ]);
    assert_eq!(pulled["root"], first["root"]);
    assert!(dest.join("small.txt").exists() && !dest.join("big.bin").exists());
}

/// Issue 18, migration: a store written one file per object (as before
/// packs) keeps working with this binary, and `roost store repack` moves
/// its objects into packs online: afterwards no object has a file of its
/// own, the home pulls whole, verify is clean, and stats counts the packs.
#[test]
fn repack_moves_a_store_from_before_packs_into_packs() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    for i in 0..50 {
        write(&src.join(format!("d{}/f{i}", i % 5)), &bytes(i, 3000));
    }
    // Written as a store before packs wrote it: a file per object.
    let legacy =
        store::Store::unpacked(store::backend::open(&env.store).expect("open the store backend"));
    let pushed = store::push::push(
        &legacy,
        &"acme".parse().expect("org"),
        &"h".parse().expect("home"),
        &src,
        &store::push::PushOptions::new(env.store.clone()),
        &store::progress::NoProgress,
    )
    .expect("push one object per file");
    let loose_files = || {
        let mut count = 0;
        let mut stack = vec![std::path::PathBuf::from(&env.store).join("orgs/acme")];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).expect("read_dir") {
                let path = entry.expect("entry").path();
                let name = path
                    .file_name()
                    .expect("name")
                    .to_string_lossy()
                    .into_owned();
                if path.is_dir() && (name == "blocks" || name == "trees" || name.len() == 2) {
                    stack.push(path);
                } else if path.is_file() && name.len() == 64 {
                    count += 1;
                }
            }
        }
        count
    };
    let before = loose_files();
    assert!(before > 50, "{before} objects in their own files");
    let stats = env.json(&["store", "stats", "--store", &env.store, "--json"]);
    assert_eq!(stats["orgs"][0]["loose"], before, "{stats}");

    let repack = env.json(&["store", "repack", "--store", &env.store, "--json"]);
    assert_eq!(repack["objects_moved"], before, "{repack}");
    assert_eq!(loose_files(), 0);
    verify_ok(&env);
    let dest = env.path("dest");
    let pulled = env.pull(&dest, "acme", "h");
    assert_eq!(pulled["root"], pushed.root.expect("root").to_string());
    assert_same_tree(&src, &dest);
    let stats = env.json(&["store", "stats", "--store", &env.store, "--json"]);
    let org = &stats["orgs"][0];
    assert_eq!(org["loose"], 0, "{stats}");
    assert!(org["packs"].as_u64().expect("packs") >= 1, "{stats}");
    assert_eq!(org["objects"], before, "{stats}");
    // Nothing to collect: moving is not deleting.
    let swept = gc(&env, "0s");
    assert_eq!(n(&swept, "deleted"), 0, "{swept}");
}

/// A mistyped local store path is not an empty store: the commands that
/// read one fail naming it and make nothing; only a copy's target (a
/// writer) is made.
#[test]
fn reading_a_store_that_is_not_there_fails_and_makes_nothing() {
    let env = Env::new(Backend::Local);
    let missing = env.path("mistyped");
    let missing_arg = missing.to_str().expect("utf-8");
    for args in [
        &["store", "verify", "--store", missing_arg][..],
        &["store", "stats", "--store", missing_arg, "--json"],
        &["store", "gc", "--store", missing_arg],
        &["store", "repack", "--store", missing_arg],
        &["store", "copy", "--from", missing_arg, "--to", &env.store],
    ] {
        let output = env.roost(args);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(message_lines(&stderr).len(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("no store at {missing_arg}")),
            "{args:?}: {stderr}"
        );
        assert!(output.stdout.is_empty(), "{args:?}: {output:?}");
        assert!(!missing.exists(), "{args:?} made {missing_arg}");
    }
    assert!(
        !std::path::Path::new(&env.store).exists(),
        "a failed copy made its target"
    );
    let src = env.path("src");
    write(&src.join("a.txt"), b"a");
    env.push(&src, "acme", "h");
    let copied = env.json(&[
        "store",
        "copy",
        "--from",
        &env.store,
        "--to",
        missing_arg,
        "--json",
    ]);
    assert_eq!(copied["ok"], true, "{copied}");
    assert_eq!(
        env.json(&["store", "verify", "--store", missing_arg, "--json"])["ok"],
        true
    );
}
