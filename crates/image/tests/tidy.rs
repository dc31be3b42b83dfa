//! Tidy checks that keep the image crate's invariants (ARCHITECTURE.md) true,
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
    assert!(files.len() > 2, "found only {} files", files.len());
    files
}

/// Unpacking is done in process (no `tar` or `docker` is run), and the
/// library reports through its errors, never by printing.
#[test]
fn images_are_unpacked_in_process_without_printing() {
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

/// Reading an image source knows nothing of the store or the control
/// plane: the CLI uploads what it unpacked.
#[test]
fn the_image_crate_depends_on_no_store_or_protocol_crate() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .expect("the manifest");
    let dependencies = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("a [dependencies] table");
    for banned in [
        "store", "api", "server", "runner", "oci", "reqwest", "tokio",
    ] {
        let named = dependencies.lines().any(|line| {
            let line = line.trim_start();
            line.starts_with(&format!("{banned}.")) || line.starts_with(&format!("{banned} "))
        });
        assert!(!named, "image depends on {banned}");
    }
}
