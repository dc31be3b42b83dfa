//! `roost store gc|verify|stats|repack|copy`: maintenance over a whole
//! store.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Subcommand;
use serde_json::json;
use store::Store;

use crate::output::{Bar, human_bytes, print_json};

#[derive(Subcommand)]
pub enum StoreCommand {
    /// Delete objects no home references and older than the grace period.
    Gc {
        /// The store: a directory, file://PATH or s3://BUCKET/PREFIX (a
        /// local one must exist).
        #[arg(long, value_name = "URL")]
        store: String,
        /// Objects younger than this are kept (protects pushes in flight).
        #[arg(long, default_value = "1h", value_parser = crate::sandbox::parse_duration)]
        grace: Duration,
        /// Print one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Check every object reachable from every home exists and hashes right.
    Verify {
        /// The store: a directory, file://PATH or s3://BUCKET/PREFIX (a
        /// local one must exist).
        #[arg(long, value_name = "URL")]
        store: String,
        /// Print one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Objects, stored and logical bytes, and dedup ratio per org.
    Stats {
        /// The store: a directory, file://PATH or s3://BUCKET/PREFIX (a
        /// local one must exist).
        #[arg(long, value_name = "URL")]
        store: String,
        /// Print one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Move objects stored one per file (stores from before packs) into
    /// packs, online: pushes, pulls and gc may run meanwhile.
    Repack {
        /// The store: a directory, file://PATH or s3://BUCKET/PREFIX (a
        /// local one must exist).
        #[arg(long, value_name = "URL")]
        store: String,
        /// Print one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Copy what the target store lacks of the source (packs whole,
    /// every object verified, home pointers last): incremental,
    /// resumable, safe while the source is in use. Exits non-zero if a
    /// source object is corrupt (reported, not copied) or a pointer's tree
    /// could not be completed.
    Copy {
        /// The store to copy from: a directory, file://PATH or
        /// s3://BUCKET/PREFIX (a local one must exist).
        #[arg(long, value_name = "URL")]
        from: String,
        /// The store to copy into (a local directory is made if absent).
        #[arg(long, value_name = "URL")]
        to: String,
        /// Print one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// The fault point between a copied pack's bytes and its index (the
/// crash tests' contract: renaming it disarms them).
pub const FAILPOINT_COPY_AFTER_PACK_DATA: &str = "store_copy:after_pack_data";

/// Copies `from` into `to` with a progress bar; the report.
pub fn copy_stores(from: &Store, to: &Store, json: bool) -> Result<store::copy::CopyReport> {
    let bar = Bar::new(json);
    let failpoints = api::failpoint::Failpoints::from_env();
    let hit =
        |_: &store::OrgId, _: &store::pack::PackId| failpoints.hit(FAILPOINT_COPY_AFTER_PACK_DATA);
    let options = store::copy::CopyOptions {
        progress: &bar,
        after_pack_data: Some(&hit),
    };
    let report = store::copy::copy(from, to, &options);
    bar.finish();
    Ok(report?)
}

/// A copy's report as JSON (`roost store copy --json`, backup manifests).
pub fn copy_json(report: &store::copy::CopyReport) -> serde_json::Value {
    json!({
        "ok": report.ok(),
        "packs_copied": report.packs_copied,
        "packs_skipped": report.packs_skipped,
        "objects_copied": report.objects_copied,
        "objects_skipped": report.objects_skipped,
        "bytes_copied": report.bytes_copied,
        "pointers_copied": report.pointers_copied,
        "pointers_skipped": report.pointers_skipped,
        "pointers_held": report.pointers_held,
        "corrupt": report.corrupt,
    })
}

pub fn run(command: StoreCommand) -> Result<ExitCode> {
    match command {
        StoreCommand::Gc { store, grace, json } => {
            let store = Store::open_existing(&store)?;
            let report = store::gc::gc(&store, grace).context("gc failed")?;
            if json {
                print_json(&json!({
                    "roots": report.roots,
                    "objects": report.objects,
                    "marked": report.marked,
                    "kept_young": report.kept_young,
                    "deleted": report.deleted,
                    "bytes_deleted": report.bytes_deleted,
                    "packs": report.packs,
                    "packs_deleted": report.packs_deleted,
                    "packs_written": report.packs_written,
                    "bytes_copied": report.bytes_copied,
                    "dead_kept": report.dead_kept,
                    "packs_refused": report.packs_refused,
                }));
            } else {
                println!(
                    "gc: {} objects, {} reachable from {} homes, {} kept (younger than {}), {} deleted ({})",
                    report.objects,
                    report.marked,
                    report.roots,
                    report.kept_young,
                    humantime::format_duration(grace),
                    report.deleted,
                    human_bytes(report.bytes_deleted),
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        StoreCommand::Verify { store, json } => {
            let store = Store::open_existing(&store)?;
            let report = store::gc::verify(&store).context("verify failed")?;
            if json {
                print_json(&json!({
                    "ok": report.ok(),
                    "roots": report.roots,
                    "objects_checked": report.objects_checked,
                    "packs_checked": report.packs_checked,
                    "errors": report.errors,
                }));
            } else {
                for error in &report.errors {
                    println!("error: {error}");
                }
                println!(
                    "verify: {} homes, {} objects and {} packs checked, {}",
                    report.roots,
                    report.objects_checked,
                    report.packs_checked,
                    if report.ok() {
                        "ok".to_owned()
                    } else {
                        format!("{} errors", report.errors.len())
                    }
                );
            }
            Ok(if report.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        StoreCommand::Stats { store, json } => {
            let store = Store::open_existing(&store)?;
            let orgs = store::gc::stats(&store).context("stats failed")?;
            if json {
                let orgs: Vec<_> = orgs
                    .iter()
                    .map(|o| {
                        json!({
                            "org": o.org,
                            "homes": o.homes,
                            "objects": o.objects,
                            "blocks": o.blocks,
                            "trees": o.trees,
                            "stored_bytes": o.stored_bytes,
                            "logical_bytes": o.logical_bytes,
                            "dedup_ratio": o.dedup_ratio,
                            "packs": o.packs,
                            "loose": o.loose,
                            "dead_bytes": o.dead_bytes,
                            "repack_candidates": o.repack_candidates,
                            "packs_refused": o.packs_refused,
                        })
                    })
                    .collect();
                print_json(&json!({ "orgs": orgs }));
            } else {
                println!(
                    "{:<24} {:>6} {:>10} {:>12} {:>12} {:>7} {:>6} {:>10} {:>8}",
                    "ORG",
                    "HOMES",
                    "OBJECTS",
                    "STORED",
                    "LOGICAL",
                    "RATIO",
                    "PACKS",
                    "DEAD",
                    "REPACK"
                );
                for o in &orgs {
                    println!(
                        "{:<24} {:>6} {:>10} {:>12} {:>12} {:>6.1}x {:>6} {:>10} {:>8}",
                        o.org,
                        o.homes,
                        o.objects,
                        human_bytes(o.stored_bytes),
                        human_bytes(o.logical_bytes),
                        o.dedup_ratio,
                        o.packs,
                        human_bytes(o.dead_bytes),
                        o.repack_candidates
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        StoreCommand::Copy { from, to, json } => {
            let source = Store::open_existing(&from).with_context(|| format!("opening {from}"))?;
            let target = Store::open(&to).with_context(|| format!("opening {to}"))?;
            let report = copy_stores(&source, &target, json).context("copy failed")?;
            if json {
                print_json(&copy_json(&report));
            } else {
                for corrupt in &report.corrupt {
                    println!("corrupt, not copied: {corrupt}");
                }
                for held in &report.pointers_held {
                    println!("pointer not copied: {held}");
                }
                println!(
                    "copy: {} packs and {} objects copied ({}), {} packs and {} objects already there, {} pointers copied, {} unchanged{}",
                    report.packs_copied,
                    report.objects_copied,
                    human_bytes(report.bytes_copied),
                    report.packs_skipped,
                    report.objects_skipped,
                    report.pointers_copied,
                    report.pointers_skipped,
                    if report.ok() {
                        ""
                    } else {
                        "; NOT complete (see above)"
                    },
                );
            }
            Ok(if report.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        StoreCommand::Repack { store, json } => {
            let store = Store::open_existing(&store)?;
            let report = store::gc::repack_loose(&store).context("repack failed")?;
            if json {
                print_json(&json!({
                    "objects_moved": report.objects_moved,
                    "bytes_moved": report.bytes_moved,
                    "packs_written": report.packs_written,
                    "corrupt": report.corrupt,
                }));
            } else {
                for corrupt in &report.corrupt {
                    println!("left in place: {corrupt}");
                }
                println!(
                    "repack: {} objects ({}) moved into {} packs",
                    report.objects_moved,
                    human_bytes(report.bytes_moved),
                    report.packs_written
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
