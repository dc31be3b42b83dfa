//! Tidy checks that keep the server's invariants (ARCHITECTURE.md) true,
//! read from its sources as text.

use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, with its path relative to `src/`.
fn files_under(dir: &Path) -> Vec<(String, String)> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)
            .expect("a source directory")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let name = path
                    .strip_prefix(src())
                    .expect("under src")
                    .display()
                    .to_string();
                let text = std::fs::read_to_string(&path).expect("a readable source file");
                files.push((name, text));
            }
        }
    }
    assert!(!files.is_empty(), "no sources under {}", dir.display());
    files
}

/// A sandbox's or command's observed fields (state, reason, desired,
/// runner, home saves, output), the event history, and the snapshot and
/// runner rows are written only in `records`, where each write is paired
/// with its event or wake-up. (Placement's lock on a runner row, a counter
/// bumped to serialise placements, is the scheduler's.)
#[test]
fn only_records_writes_sandboxes_commands_events_snapshots_and_runners() {
    const WRITES: &[&str] = &[
        "UPDATE sandboxes",
        "INSERT INTO sandboxes",
        "DELETE FROM sandboxes",
        "INSERT INTO events",
        "UPDATE commands",
        "INSERT INTO commands",
        "INSERT INTO command_output",
        "UPDATE snapshots",
        "INSERT INTO snapshots",
        "DELETE FROM snapshots",
        "UPDATE runners",
        "INSERT INTO runners",
        "UPDATE runner_leases",
        "INSERT INTO runner_leases",
        "DELETE FROM runner_leases",
        "UPDATE images",
        "INSERT INTO images",
        "DELETE FROM images",
        "UPDATE kept_copies",
        "INSERT INTO kept_copies",
        "DELETE FROM kept_copies",
        "INSERT INTO saves",
        "DELETE FROM saves",
        "UPDATE secrets",
        "INSERT INTO secrets",
        "DELETE FROM secrets",
        "INSERT INTO sandbox_secrets",
    ];
    const PLACEMENT_LOCK: &str = "UPDATE runners SET placements = placements + 1";
    let mut found = Vec::new();
    for (name, text) in files_under(&src()) {
        if name.starts_with("records/") {
            continue;
        }
        for (number, line) in text.lines().enumerate() {
            if name == "scheduler.rs" && line.contains(PLACEMENT_LOCK) {
                continue;
            }
            for write in WRITES {
                if line.contains(write) {
                    found.push(format!("{name}:{}: {write}", number + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "write through `records`:\n{}",
        found.join("\n")
    );
}

/// The control plane's rules, records and reconciler know nothing of HTTP:
/// handlers call them, never the other way round.
#[test]
fn the_control_layer_and_records_do_not_import_http() {
    let mut files = files_under(&src().join("control"));
    files.extend(files_under(&src().join("records")));
    for name in ["limits.rs", "reconcile.rs", "scheduler.rs"] {
        let text = std::fs::read_to_string(src().join(name)).expect("a server module");
        files.push((name.to_owned(), text));
    }
    for (name, text) in files {
        for http in ["crate::http", "axum::"] {
            assert!(!text.contains(http), "{name} uses {http}");
        }
    }
    // Idempotency stores and replays HTTP answers, but owns no route.
    let idempotency = std::fs::read_to_string(src().join("idempotency.rs")).expect("idempotency");
    assert!(
        !idempotency.contains("crate::http"),
        "idempotency.rs uses crate::http"
    );
}

/// Handlers parse, call and render: the records are read and written
/// through `records` and `control`, never by SQL in `http/`, and the
/// content store is reached only through `control`.
#[test]
fn handlers_hold_no_sql_and_no_store() {
    for (name, text) in files_under(&src().join("http")) {
        for banned in ["sqlx", "store::", "home_store"] {
            assert!(
                !text.contains(banned),
                "{name} names {banned}; move it below HTTP (records or control)"
            );
        }
    }
}
