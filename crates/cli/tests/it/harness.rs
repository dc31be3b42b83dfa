//! Running the binary, building sample homes, comparing trees.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_roost");

/// Which store a test runs against.
#[derive(Clone, Copy, Debug)]
pub enum Backend {
    Local,
    S3,
}

pub struct Env {
    pub tmp: tempfile::TempDir,
    pub store: String,
}

impl Env {
    pub fn new(backend: Backend) -> Env {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = match backend {
            Backend::Local => tmp.path().join("store").display().to_string(),
            Backend::S3 => {
                let bucket = std::env::var("ROOST_TEST_S3_BUCKET").expect(
                    "S3 tests need the server scripts/test.sh starts (ROOST_TEST_S3_BUCKET unset)",
                );
                let unique = tmp
                    .path()
                    .file_name()
                    .expect("name")
                    .to_string_lossy()
                    .to_lowercase();
                format!("s3://{bucket}/{}", unique.trim_start_matches('.'))
            }
        };
        Env { tmp, store }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    pub fn roost(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .env("ROOST_STATE_DIR", self.path("state"))
            .env_remove("ROOST_HOME_EXCLUDES")
            .output()
            .expect("run roost")
    }

    /// Runs a command that must succeed and print one JSON object.
    pub fn json(&self, args: &[&str]) -> Value {
        let output = self.roost(args);
        assert!(
            output.status.success(),
            "roost {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_plain_stderr(args, &output.stderr);
        serde_json::from_slice(&output.stdout).expect("one JSON object on stdout")
    }

    pub fn push(&self, dir: &Path, org: &str, home: &str) -> Value {
        let dir = dir.to_str().expect("utf-8 path");
        self.json(&[
            "home",
            "push",
            dir,
            "--store",
            &self.store,
            "--org",
            org,
            "--home",
            home,
            "--json",
        ])
    }

    pub fn pull(&self, dest: &Path, org: &str, home: &str) -> Value {
        let dest = dest.to_str().expect("utf-8 path");
        self.json(&[
            "home",
            "pull",
            dest,
            "--store",
            &self.store,
            "--org",
            org,
            "--home",
            home,
            "--json",
        ])
    }

    pub fn pull_fails(&self, dest: &Path, org: &str, home: &str) -> String {
        let dest = dest.to_str().expect("utf-8 path");
        let output = self.roost(&[
            "home",
            "pull",
            dest,
            "--store",
            &self.store,
            "--org",
            org,
            "--home",
            home,
        ]);
        assert!(!output.status.success(), "pull unexpectedly succeeded");
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(message_lines(&stderr).len(), 1, "one line: {stderr}");
        stderr
    }
}

/// The lines of a command's stderr that are its own words. tracing's log
/// lines are left out (a slow statement on a loaded machine, a request
/// retried): a test of "one line naming the problem" asserts that line,
/// not that nothing else happened to be logged.
pub fn message_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|line| !is_log_line(line)).collect()
}

/// A line of tracing's text format: `2026-12-02T02:40:14.057897Z  WARN …`.
fn is_log_line(line: &str) -> bool {
    let b = line.as_bytes();
    let head = &b[..b.len().min(40)];
    b.len() > 30
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[10] == b'T'
        && ["TRACE", "DEBUG", " INFO", " WARN", "ERROR"]
            .iter()
            .any(|level| head.windows(5).any(|w| w == level.as_bytes()))
}

/// What a command run without a terminal may write to stderr: whole log
/// lines (a push that raced gc says it uploads again, a client that retried
/// says so) but no progress drawing and no error. Tests assert on what a
/// command did, not on its silence: a warning about a correct retry is not
/// a failure.
pub fn assert_plain_stderr(args: &[&str], stderr: &[u8]) {
    let text = String::from_utf8_lossy(stderr);
    assert!(
        !text.contains('\r') && !text.contains('\x1b'),
        "roost {args:?} drew progress without a terminal: {text:?}"
    );
    assert!(
        !text
            .lines()
            .any(|line| line.starts_with("error") || line.contains("ERROR")),
        "roost {args:?} reported an error on stderr: {text}"
    );
}

pub fn n(value: &Value, field: &str) -> u64 {
    value[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} missing in {value}"))
}

/// Deterministic pseudo-random bytes (xorshift), distinct per seed.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

pub fn write(path: &Path, content: &[u8]) {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("mkdir");
    }
    fs::write(path, content).expect("write");
}

/// Files written within the racy window are re-hashed on the next scan;
/// tests that count hashing wait until their files are safely old.
pub fn settle() {
    std::thread::sleep(std::time::Duration::from_millis(250));
}

/// A small home with the shapes that matter: nesting, modes, symlinks,
/// empty directories, unicode and non-UTF-8 names, a large sparse file.
pub fn sample_home(root: &Path) {
    use std::os::unix::ffi::OsStrExt;
    write(&root.join("notes/todo.md"), b"fix the parser\n");
    write(&root.join("project/src/main.rs"), b"fn main() {}\n");
    write(
        &root.join("project/src/deep/er/still/lib.rs"),
        &bytes(1, 3000),
    );
    write(&root.join("run.sh"), b"#!/bin/sh\necho hi\n");
    fs::set_permissions(root.join("run.sh"), fs::Permissions::from_mode(0o755)).expect("chmod");
    write(&root.join("secret.txt"), b"k");
    fs::set_permissions(root.join("secret.txt"), fs::Permissions::from_mode(0o600)).expect("chmod");
    write(&root.join("empty-file"), b"");
    fs::create_dir_all(root.join("empty/dir")).expect("mkdir");
    fs::set_permissions(root.join("project"), fs::Permissions::from_mode(0o750)).expect("chmod");
    std::os::unix::fs::symlink("notes/todo.md", root.join("todo-link")).expect("symlink");
    std::os::unix::fs::symlink("/nonexistent/absolute", root.join("dangling")).expect("symlink");
    write(&root.join("ünïcødé/日本語.txt"), "こんにちは".as_bytes());
    let raw = std::ffi::OsStr::from_bytes(b"latin1-\xe9t\xe9");
    write(&root.join(raw), b"non-utf8 name");
    write(
        &root.join("data/exact-8mib.bin"),
        &bytes(2, 8 * 1024 * 1024),
    );
    write(
        &root.join("data/over-8mib.bin"),
        &bytes(3, 8 * 1024 * 1024 + 1),
    );
    // Sparse: 64 MiB with data only at the start and the end.
    let sparse = fs::File::create(root.join("data/sparse.img")).expect("create");
    sparse.set_len(64 * 1024 * 1024).expect("truncate");
    use std::os::unix::fs::FileExt;
    sparse.write_all_at(b"head", 0).expect("write");
    sparse
        .write_all_at(b"tail", 64 * 1024 * 1024 - 4)
        .expect("write");
}

/// Asserts two trees are equal: kinds, content, symlink targets,
/// permission bits, and mtimes of files and directories.
pub fn assert_same_tree(expected: &Path, actual: &Path) {
    let mut names_expected: Vec<_> = fs::read_dir(expected)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    let mut names_actual: Vec<_> = fs::read_dir(actual)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    names_expected.sort();
    names_actual.sort();
    assert_eq!(
        names_expected,
        names_actual,
        "entries of {}",
        actual.display()
    );
    for name in names_expected {
        let (e, a) = (expected.join(&name), actual.join(&name));
        let (me, ma) = (
            fs::symlink_metadata(&e).expect("stat"),
            fs::symlink_metadata(&a).expect("stat"),
        );
        assert_eq!(me.file_type(), ma.file_type(), "type of {}", a.display());
        if me.file_type().is_symlink() {
            assert_eq!(
                fs::read_link(&e).expect("readlink"),
                fs::read_link(&a).expect("readlink")
            );
            continue;
        }
        assert_eq!(
            me.mode() & 0o7777,
            ma.mode() & 0o7777,
            "mode of {}",
            a.display()
        );
        if me.is_dir() {
            assert_same_tree(&e, &a);
        } else {
            assert_eq!(me.len(), ma.len(), "size of {}", a.display());
            assert!(
                fs::read(&e).expect("read") == fs::read(&a).expect("read"),
                "content of {}",
                a.display()
            );
        }
        // After the recursion: a directory's mtime must survive its children.
        assert_eq!(
            (me.mtime(), me.mtime_nsec()),
            (ma.mtime(), ma.mtime_nsec()),
            "mtime of {}",
            a.display()
        );
    }
}
