//! `roost home push|pull` behaviour, run against both store backends.

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::harness::{
    BIN, Backend, Env, assert_same_tree, bytes, message_lines, n, sample_home, settle, write,
};

macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod local {
            $(#[test] fn $name() { super::$name(crate::harness::Backend::Local) })*
        }
        mod s3 {
            $(#[test] fn $name() { super::$name(crate::harness::Backend::S3) })*
        }
    };
}

on_both_backends!(
    round_trip_keeps_everything,
    unchanged_repush_hashes_and_uploads_nothing,
    one_file_change_uploads_its_block_and_the_path_to_root,
    same_toolchain_cache_in_two_homes_is_stored_once,
    another_org_cannot_read_or_dedupe_against_a_home,
    pull_in_place_updates_an_older_copy,
);

fn round_trip_keeps_everything(backend: Backend) {
    let env = Env::new(backend);
    let src = env.path("src");
    sample_home(&src);
    let pushed = env.push(&src, "acme", "agent-1");
    assert_eq!(n(&pushed, "files"), 11);
    let dest = env.path("dest");
    let pulled = env.pull(&dest, "acme", "agent-1");
    assert_eq!(pulled["root"], pushed["root"]);
    assert_same_tree(&src, &dest);
    // The sparse image's zero blocks came back as holes, not 64 MiB of data.
    use std::os::unix::fs::MetadataExt;
    let sparse = fs::metadata(dest.join("data/sparse.img")).expect("stat");
    assert!(
        sparse.blocks() * 512 < 16 * 1024 * 1024,
        "sparse file was filled in"
    );
}

fn unchanged_repush_hashes_and_uploads_nothing(backend: Backend) {
    let env = Env::new(backend);
    let src = env.path("src");
    sample_home(&src);
    settle();
    let first = env.push(&src, "acme", "h");
    assert!(n(&first, "blocks_uploaded") > 0);
    let again = env.push(&src, "acme", "h");
    assert_eq!(again["root"], first["root"]);
    assert_eq!(n(&again, "files_hashed"), 0, "{again}");
    assert_eq!(n(&again, "bytes_hashed"), 0);
    assert_eq!(n(&again, "blocks_uploaded"), 0);
    assert_eq!(n(&again, "bytes_uploaded"), 0);
    assert_eq!(n(&again, "missing_checks"), 0);
}

fn one_file_change_uploads_its_block_and_the_path_to_root(backend: Backend) {
    let env = Env::new(backend);
    let src = env.path("src");
    sample_home(&src);
    settle();
    env.push(&src, "acme", "h");
    // project/src/deep/er/still/lib.rs: four directories below the root.
    write(
        &src.join("project/src/deep/er/still/lib.rs"),
        &bytes(99, 3000),
    );
    let changed = env.push(&src, "acme", "h");
    assert_eq!(n(&changed, "files_hashed"), 1, "{changed}");
    assert_eq!(n(&changed, "blocks_uploaded"), 1);
    assert_eq!(
        n(&changed, "trees_uploaded"),
        6,
        "root + project + src + deep + er + still"
    );
    assert!(n(&changed, "missing_checks") <= 2, "{changed}");
    let dest = env.path("dest");
    env.pull(&dest, "acme", "h");
    assert_same_tree(&src, &dest);
}

fn same_toolchain_cache_in_two_homes_is_stored_once(backend: Backend) {
    let env = Env::new(backend);
    for home in ["a", "b"] {
        let dir = env.path(home);
        for i in 0..40 {
            write(
                &dir.join(format!(".cargo/registry/src/crate-{i}/lib.rs")),
                &bytes(1000 + i, 20_000),
            );
        }
        write(
            &dir.join(format!("own-{home}.txt")),
            &bytes(home.len() as u64 + home.as_bytes()[0] as u64, 5000),
        );
    }
    let a = env.push(&env.path("a"), "acme", "a");
    assert_eq!(n(&a, "blocks_uploaded"), 41);
    let b = env.push(&env.path("b"), "acme", "b");
    assert_eq!(n(&b, "blocks_uploaded"), 1, "only b's own file: {b}");
    let stats = env.json(&["store", "stats", "--store", &env.store, "--json"]);
    let org = &stats["orgs"][0];
    assert_eq!(org["org"], "acme");
    assert!(org["dedup_ratio"].as_f64().expect("ratio") > 1.8, "{stats}");
}

fn another_org_cannot_read_or_dedupe_against_a_home(backend: Backend) {
    let env = Env::new(backend);
    let src = env.path("src");
    write(&src.join("private.txt"), &bytes(7, 10_000));
    env.push(&src, "acme", "h");
    let err = env.pull_fails(&env.path("dest"), "evil", "h");
    assert!(err.contains("no such home: evil/h"), "{err}");
    // Same content under another org is uploaded again, not linked.
    let evil = env.push(&src, "evil", "h");
    assert_eq!(n(&evil, "blocks_uploaded"), 1, "{evil}");
}

fn pull_in_place_updates_an_older_copy(backend: Backend) {
    let env = Env::new(backend);
    let src = env.path("src");
    sample_home(&src);
    env.push(&src, "acme", "h");
    let dest = env.path("dest");
    env.pull(&dest, "acme", "h");
    settle();
    // Change the home: edit, delete, replace a file by a directory.
    write(&src.join("notes/todo.md"), b"done\n");
    fs::remove_dir_all(src.join("empty")).expect("rm");
    fs::remove_file(src.join("secret.txt")).expect("rm");
    write(&src.join("secret.txt/now-a-dir"), b"x");
    env.push(&src, "acme", "h");
    // And litter the old copy with things the snapshot does not have.
    write(&dest.join("stray/file"), b"stray");
    let pulled = env.pull(&dest, "acme", "h");
    assert_same_tree(&src, &dest);
    assert!(
        n(&pulled, "files_unchanged") >= 8,
        "unchanged files are not rewritten: {pulled}"
    );
    assert!(n(&pulled, "removed") >= 2, "{pulled}");
    assert!(n(&pulled, "files_written") <= 3, "{pulled}");
}

#[test]
fn pull_right_after_pull_then_push_hashes_nothing() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    sample_home(&src);
    env.push(&src, "acme", "h");
    let dest = env.path("dest");
    env.pull(&dest, "acme", "h");
    settle();
    // The pull recorded what it wrote: pushing the copy reads nothing again.
    let again = env.push(&dest, "acme", "h");
    assert!(again["unchanged"].as_bool().expect("bool"));
    assert!(n(&again, "bytes_hashed") < 1024 * 1024, "{again}");
}

#[test]
fn excludes_default_and_from_environment() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("pkg/__pycache__/m.cpython-311.pyc"), b"x");
    write(&src.join("a.pyc"), b"x");
    write(&src.join("scratch.tmp"), b"x");
    write(&src.join(".cache/pip/wheels/w"), b"x");
    write(&src.join(".cache/ms-playwright/chromium/c"), b"x");
    write(&src.join(".dartServer/x"), b"x");
    write(&src.join(".npm/_cacache/kept"), b"kept");
    write(&src.join(".cargo/registry/kept"), b"kept");
    write(&src.join(".gradle/kept"), b"kept");
    write(&src.join(".pub-cache/kept"), b"kept");
    write(&src.join("keep.txt"), b"kept");
    env.push(&src, "acme", "h");
    let dest = env.path("dest");
    env.pull(&dest, "acme", "h");
    for gone in [
        "pkg/__pycache__",
        "a.pyc",
        "scratch.tmp",
        ".cache/pip",
        ".cache/ms-playwright",
        ".dartServer",
    ] {
        assert!(!dest.join(gone).exists(), "{gone} should be excluded");
    }
    for kept in [
        ".npm/_cacache/kept",
        ".cargo/registry/kept",
        ".gradle/kept",
        ".pub-cache/kept",
        "keep.txt",
    ] {
        assert!(dest.join(kept).exists(), "{kept} should be kept");
    }
    // The variable replaces the default list.
    let output = std::process::Command::new(crate::harness::BIN)
        .args([
            "home",
            "push",
            src.to_str().expect("utf8"),
            "--store",
            &env.store,
            "--org",
            "acme",
            "--home",
            "h2",
            "--json",
        ])
        .env("ROOST_STATE_DIR", env.path("state"))
        .env("ROOST_HOME_EXCLUDES", "keep.txt,.npm")
        .output()
        .expect("run");
    assert!(output.status.success());
    let dest2 = env.path("dest2");
    env.pull(&dest2, "acme", "h2");
    assert!(!dest2.join("keep.txt").exists());
    assert!(!dest2.join(".npm").exists());
    assert!(dest2.join("a.pyc").exists(), "defaults no longer apply");
}

#[test]
fn block_cache_serves_a_second_pull() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("big.bin"), &bytes(5, 9 * 1024 * 1024));
    env.push(&src, "acme", "h");
    let cache = env.path("cache");
    let cache = cache.to_str().expect("utf8");
    let pull = |dest: &str| {
        let dest = env.path(dest);
        env.json(&[
            "home",
            "pull",
            dest.to_str().expect("utf8"),
            "--store",
            &env.store,
            "--org",
            "acme",
            "--home",
            "h",
            "--cache",
            cache,
            "--json",
        ])
    };
    let first = pull("d1");
    assert_eq!(n(&first, "blocks_from_cache"), 0);
    assert!(n(&first, "blocks_downloaded") >= 3);
    let second = pull("d2");
    assert_eq!(n(&second, "blocks_downloaded"), 0, "{second}");
    assert_eq!(n(&second, "bytes_downloaded"), 0);
    assert_same_tree(&src, &env.path("d2"));
}

#[test]
fn missing_directory_and_bad_names_fail_with_one_line() {
    let env = Env::new(Backend::Local);
    let output = env.roost(&[
        "home",
        "push",
        "/nonexistent/dir",
        "--store",
        &env.store,
        "--org",
        "acme",
        "--home",
        "h",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/dir"), "{stderr}");
    assert_eq!(message_lines(&stderr).len(), 1);
    // The missing directory is found before the store is opened: no
    // empty store is left behind.
    assert!(!Path::new(&env.store).exists(), "{} was made", env.store);
    let output = env.roost(&[
        "home", "push", "/tmp", "--store", &env.store, "--org", "../x", "--home", "h",
    ]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("invalid org name"));
    // A pull needs a store there.
    let err = env.pull_fails(&env.path("d"), "acme", "nothing-here");
    assert!(err.contains(&format!("no store at {}", env.store)), "{err}");
    assert!(!Path::new(&env.store).exists(), "{} was made", env.store);
    let src = env.path("src");
    write(&src.join("a.txt"), b"a");
    env.push(&src, "acme", "h");
    let err = env.pull_fails(&env.path("d"), "acme", "nothing-here");
    assert!(err.contains("no such home: acme/nothing-here"), "{err}");
}

/// Logs go to stderr beside the error, as plain text when stderr is a pipe
/// or a file (no terminal colour codes in anyone's log file), and the
/// error is still its one line among them.
#[test]
fn logs_to_a_pipe_are_plain_text_and_the_error_stays_one_line() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("a.txt"), b"a");
    // A state dir that is a file: the push fails after it has logged.
    let state = env.path("state");
    write(&state, b"not a directory");
    let output = Command::new(BIN)
        .args(["home", "push", src.to_str().expect("utf-8")])
        .args(["--store", &env.store, "--org", "acme", "--home", "h"])
        .env("ROOST_STATE_DIR", &state)
        .env("ROOST_LOG", "debug")
        .output()
        .expect("run roost");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("DEBUG"), "logs at debug: {stderr}");
    assert!(
        !stderr.contains('\x1b'),
        "colour codes in a pipe: {stderr:?}"
    );
    let message = message_lines(&stderr);
    assert_eq!(message.len(), 1, "{stderr}");
    assert!(message[0].contains("Not a directory"), "{stderr}");
}

/// Issue 14: a home nested 700 directories deep made `roost home push`
/// overflow its stack, and a stored tree 3,000 deep `roost home pull`.
/// Both now end with one line naming the bound, and no signal.
#[test]
fn too_deep_homes_are_refused_by_push_and_pull_without_a_crash() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    let mut deepest = src.clone();
    for _ in 0..700 {
        deepest.push("d");
    }
    fs::create_dir_all(&deepest).expect("mkdir -p");
    let output = env.roost(&[
        "home",
        "push",
        src.to_str().expect("utf-8"),
        "--store",
        &env.store,
        "--org",
        "acme",
        "--home",
        "deep",
    ]);
    assert!(
        output.status.code().is_some_and(|code| code != 0),
        "{:?}",
        output.status
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("too deep at d/d/d/"), "{stderr}");
    assert!(
        stderr.contains(&store::tree::DEPTH_MAX.to_string()),
        "{stderr}"
    );
    assert_eq!(message_lines(&stderr).len(), 1, "{stderr}");

    // A tree no push makes: 3,000 nested trees put into the store directly.
    let store = store::Store::open(&env.store).expect("open the store");
    let acme: store::OrgId = "acme".parse().expect("org");
    let put = |tree: store::tree::Tree| {
        let (digest, bytes) = tree.encode().expect("valid tree");
        store
            .put_object(&acme, &store::store::ObjectId::tree(digest), &bytes)
            .expect("put");
        digest
    };
    let mut root = put(store::tree::Tree::default());
    for _ in 0..3000 {
        root = put(store::tree::Tree {
            entries: vec![store::tree::Entry {
                name: b"d".to_vec(),
                mode: 0o755,
                size: 0,
                mtime_ns: 0,
                kind: store::tree::EntryKind::Dir { tree: root },
            }],
        });
    }
    store
        .write_home(&acme, &"deep".parse().expect("home"), &root)
        .expect("point the home");
    let err = env.pull_fails(&env.path("dest"), "acme", "deep");
    assert!(err.contains("too deep at d/d/d/"), "{err}");
}

#[test]
fn unreachable_store_is_named() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("f"), b"x");
    let output = std::process::Command::new(crate::harness::BIN)
        .args([
            "home",
            "push",
            src.to_str().expect("utf8"),
            "--store",
            "s3://roost-nowhere/p",
            "--org",
            "a",
            "--home",
            "h",
        ])
        .env("ROOST_STATE_DIR", env.path("state"))
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .env("AWS_ALLOW_HTTP", "true")
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("store unreachable"), "{stderr}");
    assert_eq!(message_lines(&stderr).len(), 1, "{stderr}");
}

#[test]
fn permission_denied_names_the_path() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("locked/f"), b"x");
    fs::set_permissions(
        src.join("locked"),
        std::os::unix::fs::PermissionsExt::from_mode(0o000),
    )
    .expect("chmod");
    // The suite runs as root, who reads everything: drop to nobody, whose
    // access to the unreadable directory is denied.
    let state = env.path("nobody-state");
    fs::create_dir_all(&state).expect("mkdir");
    for dir in [env.tmp.path(), &src, &state] {
        fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .expect("chmod");
    }
    let output = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            crate::harness::BIN,
        ])
        .args([
            "home",
            "push",
            src.to_str().expect("utf8"),
            "--store",
            "memory:",
            "--org",
            "a",
            "--home",
            "h",
        ])
        .env("ROOST_STATE_DIR", &state)
        .output()
        .expect("run setpriv");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "permission denied at {}",
            src.join("locked").display()
        )),
        "{stderr}"
    );
    fs::set_permissions(
        src.join("locked"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
}

/// Racy timestamps: a file pushed while its timestamps are within the
/// filesystem's granularity of the scan is not trusted from the index next
/// time (a same-tick rewrite would leave its stat unchanged); once its
/// timestamps are safely old, it is.
#[test]
fn files_pushed_while_racy_are_rehashed_once() {
    let env = Env::new(Backend::Local);
    let src = env.path("src");
    write(&src.join("fresh.txt"), b"just written");
    write(&src.join("also/fresh.bin"), &bytes(3, 5000));
    let first = env.push(&src, "acme", "h");
    assert_eq!(n(&first, "files_hashed"), 2);
    settle();
    let second = env.push(&src, "acme", "h");
    assert_eq!(
        n(&second, "files_hashed"),
        2,
        "racy entries must not be trusted: {second}"
    );
    let third = env.push(&src, "acme", "h");
    assert_eq!(
        n(&third, "files_hashed"),
        0,
        "settled entries are trusted: {third}"
    );
}

/// Peak memory of a push is bounded by buffers, not multiplied by them:
/// each uploading thread holds one block-sized read buffer and one pack,
/// encoded straight into it (issue 18). With two threads, sixteen
/// single-block 8 MiB files and 2,000 small ones peaked ~50 MiB above
/// the push of a one-file home (release build) when the read buffer grew
/// to 16 MiB and each batch was held as objects and again as a pack;
/// ~35 MiB now (two 8 MiB buffers and two 8 MiB packs). Peak RSS
/// (`VmHWM`) is polled from `/proc` while the process runs.
#[test]
fn push_peak_memory_is_a_buffer_and_a_pack_per_thread() {
    let env = Env::new(Backend::Local);
    let tiny = env.path("tiny");
    write(&tiny.join("a.txt"), b"one small file");
    let src = env.path("src");
    for i in 0..16 {
        write(&src.join(format!("big{i}.bin")), &bytes(100 + i, 8 << 20));
    }
    for i in 0..2000 {
        write(&src.join(format!("small/f{i}.txt")), &bytes(i, 1000));
    }
    let base = push_peak_kib(&env, &tiny, "tiny");
    let peak = push_peak_kib(&env, &src, "h");
    assert!(
        peak.saturating_sub(base) < 48 * 1024,
        "push peaked {} MiB above a one-file push ({} MiB), bound 48",
        peak.saturating_sub(base) / 1024,
        base / 1024
    );
}

/// Runs `roost home push` of `dir` with two threads and returns its peak
/// RSS in KiB, polled from `/proc/PID/status` until it exits.
fn push_peak_kib(env: &Env, dir: &std::path::Path, home: &str) -> u64 {
    let mut child = std::process::Command::new(crate::harness::BIN)
        .args(["home", "push", dir.to_str().expect("utf-8")])
        .args(["--store", env.path("store").to_str().expect("utf-8")])
        .args(["--org", "acme", "--home", home, "--json"])
        .env("ROOST_STATE_DIR", env.path("state"))
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("ROOST_HOME_EXCLUDES")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("run roost");
    let status_path = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    let status = loop {
        if let Ok(status) = fs::read_to_string(&status_path) {
            let hwm = status
                .lines()
                .find_map(|line| line.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
            peak_kib = peak_kib.max(hwm.unwrap_or(0));
        }
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    assert!(status.success(), "push of {} failed", dir.display());
    assert!(peak_kib > 0, "no VmHWM read");
    peak_kib
}
