//! Tidy checks that keep ARCHITECTURE.md's invariants true across the
//! workspace's sources (read as text, no build of other crates needed).

use std::path::{Path, PathBuf};

/// Every `.rs` file under `crates/*/{src,tests,examples}`.
fn rust_files() -> Vec<PathBuf> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .expect("the crates directory")
        .flatten()
        .flat_map(|krate| ["src", "tests", "examples"].map(|d| krate.path().join(d)))
        .filter(|dir| dir.is_dir())
        .collect();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)
            .expect("a source directory")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    assert!(files.len() > 50, "found only {} files", files.len());
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).expect("a readable source file")
}

#[test]
fn every_file_says_what_it_is_for() {
    let missing: Vec<_> = rust_files()
        .into_iter()
        .filter(|path| !read(path).starts_with("//!"))
        .collect();
    assert!(missing.is_empty(), "no leading `//!` line: {missing:?}");
}

/// The lifecycle is `api::lifecycle`'s enums: a state compared as a string
/// anywhere else is the drift the typed vocabulary removed.
#[test]
fn no_lifecycle_state_is_compared_as_a_string() {
    const WORDS: &[&str] = &[
        "pending",
        "starting",
        "running",
        "stopping",
        "securing",
        "stopped",
        "recovering",
        "failed",
        "terminated",
        "deleting",
        "deleted",
        "queued",
        "exited",
        "timed_out",
        "interrupted",
        "launch_failed",
        "not_launched",
        "infrastructure_lost",
        "standard",
        "durable",
        "spot_first",
        "non_preemptible",
    ];
    let mut found = Vec::new();
    for path in rust_files() {
        let text = read(&path);
        for (number, line) in text.lines().enumerate() {
            for field in ["state", "desired", "storage_class", "placement"] {
                for op in ["==", "!="] {
                    for word in WORDS {
                        if line.contains(&format!(".{field} {op} \"{word}\"")) {
                            found.push(format!(
                                "{}:{}: {}",
                                path.display(),
                                number + 1,
                                line.trim()
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "compare with api::lifecycle enums:\n{}",
        found.join("\n")
    );
}

/// Only `oci` may spawn the container runtime, and it knows no protocol.
#[test]
fn the_oci_crate_speaks_no_protocol() {
    let manifest = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../oci/Cargo.toml"));
    let dependencies = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("oci has dependencies");
    for forbidden in ["api", "store", "server"] {
        assert!(
            !dependencies.lines().any(|line| line
                .trim_start()
                .starts_with(&format!("{forbidden}."))
                || line.trim_start().starts_with(&format!("{forbidden} "))),
            "oci depends on {forbidden}"
        );
    }
}

/// One fault-point mechanism: only `api::failpoint` reads
/// `ROOST_FAILPOINT` or kills a process at a named point; the server and
/// the runner hold a `Failpoints` (tests may set the variable).
#[test]
fn only_api_failpoint_arms_fault_points() {
    for path in rust_files() {
        let shown = path.display().to_string();
        if shown.ends_with("api/src/failpoint.rs") || shown.contains("/tests/") {
            continue;
        }
        let text = read(&path);
        assert!(
            !text.contains("\"ROOST_FAILPOINT\"") && !text.contains("failpoint reached"),
            "{shown} arms a fault point of its own: use api::failpoint::Failpoints"
        );
    }
}

/// The agent reaches the server, the runtime and time only through its
/// seams (`ControlPlane`, `oci::ContainerRuntime`, `Clock`), so that its
/// unit tests can put fakes there: only `mod.rs` (which builds the real
/// ones), `control.rs` (which implements `ControlPlane` for the client)
/// and the tests' fakes name the concrete client or driver types.
#[test]
fn the_agent_reaches_the_server_and_the_runtime_only_through_its_seams() {
    let agent = Path::new(env!("CARGO_MANIFEST_DIR")).join("../runner/src/agent");
    const CONCRETE: &[&str] = &[
        "client::Client;",
        "client::Client,",
        "Client::new",
        "runtime::Runtime",
        "Runtime::open",
        "oci::Sandbox",
        "runtime::Sandbox",
        "Execution",
    ];
    for entry in std::fs::read_dir(&agent).expect("the agent").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if ["mod.rs", "control.rs", "testing.rs"].contains(&name.as_str()) {
            continue;
        }
        let text = read(&entry.path());
        for word in CONCRETE {
            assert!(
                !text.contains(word),
                "agent/{name} names {word}: go through the agent's seams"
            );
        }
    }
}

/// Domain types are not serialized: only `api`'s wire types derive
/// `Serialize` (the CLI builds any other JSON explicitly).
#[test]
fn only_api_types_derive_serialize() {
    let mut found = Vec::new();
    for path in rust_files() {
        let shown = path.display().to_string();
        if shown.contains("/api/src/") || path.ends_with("tidy.rs") {
            continue;
        }
        let text = read(&path);
        for (number, line) in text.lines().enumerate() {
            if line.contains("derive(") && line.contains("Serialize") {
                found.push(format!("{}:{}", path.display(), number + 1));
            }
        }
    }
    assert!(found.is_empty(), "Serialize outside api: {found:?}");
}
