//! Tidy checks that keep the store's invariants (ARCHITECTURE.md) true,
//! read from its sources and manifest as text.

use std::path::{Path, PathBuf};

fn sources() -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)
            .expect("a source directory")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("a readable source file");
                files.push((path, text));
            }
        }
    }
    assert!(files.len() > 5, "found only {} files", files.len());
    files
}

/// The store is a library under the CLI and the server: it reports through
/// its errors and `Progress`, never by printing, and runs no program.
#[test]
fn the_store_never_prints_and_runs_no_program() {
    for (path, text) in sources() {
        for banned in [
            "println!",
            "eprintln!",
            "print!(",
            "eprint!(",
            "dbg!(",
            "process::Command",
        ] {
            assert!(!text.contains(banned), "{} uses {banned}", path.display());
        }
    }
}

/// The store knows nothing of HTTP, the command line or the control plane.
#[test]
fn the_store_depends_on_no_protocol_or_command_line_crate() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .expect("the manifest");
    let dependencies = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("a [dependencies] table");
    for banned in [
        "api", "server", "runner", "axum", "hyper", "reqwest", "clap", "sqlx",
    ] {
        let named = dependencies.lines().any(|line| {
            let line = line.trim_start();
            line.starts_with(&format!("{banned}.")) || line.starts_with(&format!("{banned} "))
        });
        assert!(!named, "store depends on {banned}");
    }
}
