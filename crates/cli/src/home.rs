//! `roost home push|pull`: a directory to and from a home in a store.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde_json::json;
use store::pull::{PullOptions, pull};
use store::push::{PushOptions, push};
use store::{HomeName, OrgId, Store};

use crate::output::{Bar, human_bytes, print_json};

/// Attempts at a push that failed for a reason retrying can fix.
const PUSH_ATTEMPTS_MAX: usize = 3;

#[derive(Subcommand)]
pub enum HomeCommand {
    /// Save DIR as the home's new snapshot (only new blocks are uploaded).
    Push {
        /// The directory to save (the whole tree, minus excludes).
        dir: PathBuf,
        #[command(flatten)]
        target: Target,
    },
    /// Materialise the home's snapshot into DEST (empty, or an older copy
    /// updated in place; entries not in the snapshot are removed).
    Pull {
        /// Where to materialise the home (created if absent).
        dest: PathBuf,
        #[command(flatten)]
        target: Target,
        /// Local block cache: read before the store, filled by downloads.
        #[arg(long, value_name = "DIR")]
        cache: Option<PathBuf>,
    },
}

#[derive(Args)]
pub struct Target {
    /// Store URL: a path, file://PATH or s3://BUCKET/PREFIX (a push makes
    /// a local one that is not there yet; a pull needs it to exist).
    #[arg(long, value_name = "URL")]
    store: String,
    /// The organisation: blocks are deduplicated within it, never across.
    #[arg(long)]
    org: String,
    /// The home's name within the org (one current snapshot per home).
    #[arg(long)]
    home: String,
    /// Print one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Where per-directory file indexes and pack index caches are kept
    /// [default: $XDG_STATE_HOME/roost or ~/.local/state/roost].
    #[arg(long, env = "ROOST_STATE_DIR", value_name = "DIR")]
    state_dir: Option<PathBuf>,
}

struct Opened {
    store: Store,
    org: OrgId,
    home: HomeName,
}

impl Target {
    /// The store, org and home. A push (`create`) makes a local store that
    /// is not there yet; a pull needs one that is.
    fn open(&self, create: bool) -> Result<Opened> {
        // The orgs' merged pack indexes (and copies of pack indexes not
        // merged yet), kept per store URL.
        let cache = self
            .state_dir()?
            .join("pack-indexes")
            .join(&store::Digest::of(self.store.as_bytes()).to_hex()[..32]);
        Ok(Opened {
            org: self.org.parse()?,
            home: self.home.parse()?,
            store: if create {
                Store::open(&self.store)?
            } else {
                Store::open_existing(&self.store)?
            }
            .with_index_cache(cache),
        })
    }

    fn state_dir(&self) -> Result<PathBuf> {
        match &self.state_dir {
            Some(dir) => Ok(dir.clone()),
            None => default_state_dir(),
        }
    }

    /// The index for `dir`, named by a hash of its absolute path.
    fn index_path(&self, dir: &Path) -> Result<PathBuf> {
        let state_dir = self.state_dir()?;
        let absolute =
            std::path::absolute(dir).with_context(|| format!("resolving {}", dir.display()))?;
        let name = store::Digest::of(absolute.as_os_str().as_encoded_bytes()).to_hex();
        Ok(state_dir.join("index").join(&name[..32]))
    }
}

fn default_state_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_STATE_HOME") {
        return Ok(PathBuf::from(dir).join("roost"));
    }
    let home = std::env::var_os("HOME").context("neither ROOST_STATE_DIR nor HOME is set")?;
    Ok(PathBuf::from(home).join(".local/state/roost"))
}

pub fn run(command: HomeCommand) -> Result<ExitCode> {
    match command {
        HomeCommand::Push { dir, target } => run_push(&dir, &target),
        HomeCommand::Pull {
            dest,
            target,
            cache,
        } => run_pull(&dest, &target, cache),
    }
}

fn run_push(dir: &Path, target: &Target) -> Result<ExitCode> {
    // Before the store is opened: a mistyped DIR leaves no empty store.
    match std::fs::metadata(dir) {
        Ok(metadata) if metadata.is_dir() => {}
        Ok(_) => bail!("push of {} failed: not a directory", dir.display()),
        Err(err) => {
            return Err(err).with_context(|| format!("push of {} failed", dir.display()));
        }
    }
    let opened = target.open(true)?;
    let mut options = PushOptions::new(target.store.clone());
    options.excludes = store::excludes::Excludes::from_env()?;
    options.index_path = Some(target.index_path(dir)?);
    let started = Instant::now();
    let bar = Bar::new(target.json);
    let mut attempt = 1;
    let report = loop {
        match push(
            &opened.store,
            &opened.org,
            &opened.home,
            dir,
            &options,
            &bar,
        ) {
            Err(err) if err.is_retryable() && attempt < PUSH_ATTEMPTS_MAX => {
                tracing::warn!(%err, attempt, "push failed, retrying");
                attempt += 1;
            }
            other => break other,
        }
    };
    bar.finish();
    let report = report.with_context(|| format!("push of {} failed", dir.display()))?;
    let root = report.root.map(|r| r.to_hex()).unwrap_or_default();
    if target.json {
        print_json(&json!({
            "root": root,
            "org": opened.org.as_str(),
            "home": opened.home.as_str(),
            "unchanged": report.unchanged,
            "files": report.files,
            "dirs": report.dirs,
            "symlinks": report.symlinks,
            "special_skipped": report.special_skipped,
            "excluded": report.excluded,
            "bytes_scanned": report.bytes_scanned,
            "files_hashed": report.files_hashed,
            "bytes_hashed": report.bytes_hashed,
            "blocks_uploaded": report.blocks_uploaded,
            "trees_uploaded": report.trees_uploaded,
            "bytes_uploaded": report.bytes_uploaded,
            "missing_checks": report.missing_checks,
            "seconds": started.elapsed().as_secs_f64(),
        }));
    } else {
        println!(
            "pushed {}/{}: {} files, {} scanned, {} files hashed ({}), {} blocks + {} trees uploaded ({}){}",
            opened.org,
            opened.home,
            report.files,
            human_bytes(report.bytes_scanned),
            report.files_hashed,
            human_bytes(report.bytes_hashed),
            report.blocks_uploaded,
            report.trees_uploaded,
            human_bytes(report.bytes_uploaded),
            if report.unchanged { ", unchanged" } else { "" },
        );
        if report.special_skipped > 0 {
            println!(
                "skipped {} sockets, FIFOs or devices",
                report.special_skipped
            );
        }
        println!("root {root}");
    }
    Ok(ExitCode::SUCCESS)
}

fn run_pull(dest: &Path, target: &Target, cache: Option<PathBuf>) -> Result<ExitCode> {
    let opened = target.open(false)?;
    let options = PullOptions {
        cache,
        fill_cache: true,
        index_path: Some(target.index_path(dest)?),
        store_id: target.store.clone(),
        index_dev: None,
        check_room: false,
        room_also: None,
    };
    // A pull that makes its destination and then fails takes it away
    // again: a partial tree would pass for the home. One into an existing
    // directory leaves it be (what was there may be someone's newest work).
    let creates_dest = std::fs::symlink_metadata(dest).is_err();
    let started = Instant::now();
    let bar = Bar::new(target.json);
    let report = pull(
        &opened.store,
        &opened.org,
        &opened.home,
        dest,
        &options,
        &bar,
    );
    bar.finish();
    if report.is_err()
        && creates_dest
        && let Err(err) = std::fs::remove_dir_all(dest)
        && err.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!(
            "roost: could not remove the partial pull at {}: {err}",
            dest.display()
        );
    }
    let report = report.with_context(|| format!("pull into {} failed", dest.display()))?;
    let root = report.root.map(|r| r.to_hex()).unwrap_or_default();
    if target.json {
        print_json(&json!({
            "root": root,
            "org": opened.org.as_str(),
            "home": opened.home.as_str(),
            "files": report.files,
            "dirs": report.dirs,
            "symlinks": report.symlinks,
            "logical_bytes": report.logical_bytes,
            "files_written": report.files_written,
            "files_unchanged": report.files_unchanged,
            "removed": report.removed,
            "blocks_downloaded": report.blocks_downloaded,
            "bytes_downloaded": report.bytes_downloaded,
            "blocks_from_cache": report.blocks_from_cache,
            "seconds": started.elapsed().as_secs_f64(),
        }));
    } else {
        println!(
            "pulled {}/{} into {}: {} files ({}), {} written, {} unchanged, {} removed, {} blocks downloaded ({}), {} from cache",
            opened.org,
            opened.home,
            dest.display(),
            report.files,
            human_bytes(report.logical_bytes),
            report.files_written,
            report.files_unchanged,
            report.removed,
            report.blocks_downloaded,
            human_bytes(report.bytes_downloaded),
            report.blocks_from_cache,
        );
        println!("root {root}");
    }
    Ok(ExitCode::SUCCESS)
}
