//! `roost admin backup|restore|check`: a deployment's records and store,
//! backed up together, brought back, and checked whole.
//!
//! These read the server's data dir, database and store directly (the
//! flags `roost server` takes), not a running server's API: the database
//! makes its own consistent copy (SQLite `VACUUM INTO`, PostgreSQL
//! `pg_dump` of an exported snapshot) while servers keep writing, and the
//! store copy reads the store. Why records first and the store second is
//! consistent is in `server::backup`.
//!
//! A backup directory `DEST`:
//!
//! ```text
//! DEST/store/                    the store copy (incremental: each backup
//!                                adds what is new; nothing is removed)
//! DEST/backups/STAMP/            one backup: records.db (SQLite) or
//!                                records.pgdump (pg_dump custom format),
//!                                and manifest.json
//! DEST/backups/.partial-STAMP-…  a backup being written: renamed to
//!                                STAMP only once whole
//! ```

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Instant, SystemTime};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;
use server::backup as records;
use server::records::backup::{RecordRoot, RecordRoots};
use store::Store;

use crate::output::{human_bytes, print_json};
use crate::store_admin::{copy_json, copy_stores};

/// Where the deployment's records and store are: as `roost server` takes them.
#[derive(Args)]
pub struct Deployment {
    /// The server's data dir (its SQLite database, unless --database).
    #[arg(long, default_value = "/var/lib/roost")]
    data_dir: PathBuf,
    /// `sqlite://PATH` or `postgres://…` (default: SQLite in the data dir).
    #[arg(long, value_name = "URL")]
    database: Option<String>,
    /// The deployment's home store.
    #[arg(long, value_name = "URL")]
    store: String,
}

impl Deployment {
    /// The database as `roost server` would open it, but never made anew
    /// here: a missing SQLite file is an error, not an empty deployment.
    fn database_url(&self) -> String {
        self.database.clone().unwrap_or_else(|| {
            records::default_database_url(&self.data_dir).replace("?mode=rwc", "?mode=rw")
        })
    }
}

#[derive(Args)]
pub struct BackupArgs {
    /// The backup directory (made if absent).
    dest: PathBuf,
    #[command(flatten)]
    deployment: Deployment,
    /// Copy the store here instead of DEST/store (e.g. `s3://BUCKET/PREFIX`).
    #[arg(long, value_name = "URL")]
    store_to: Option<String>,
    /// Print one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// A backup directory (its newest backup) or one backup in it
    /// (`DEST/backups/STAMP`).
    src: PathBuf,
    /// The deployment to restore into: an empty data dir or database and
    /// an empty store.
    #[command(flatten)]
    deployment: Deployment,
    /// Restore into a target that is not empty (its records are replaced,
    /// its store added to).
    #[arg(long)]
    force: bool,
    /// Print one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct CheckArgs {
    #[command(flatten)]
    deployment: Deployment,
    /// Read and verify every block too (default: every tree read and
    /// verified, every block present).
    #[arg(long)]
    deep: bool,
    /// Print one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

/// Attempts at a backup whose store copy misses a root of its records
/// copy (gc took a root unpinned meanwhile: see `server::backup`).
const BACKUP_ATTEMPTS: usize = 3;

/// The stamp of a backup, sortable: UTC seconds, RFC 3339 without colons.
fn stamp(at: SystemTime) -> String {
    humantime::format_rfc3339_seconds(at)
        .to_string()
        .replace(':', "")
}

/// A failure writing the destination as one line: a full disk says so.
fn destination_error(err: anyhow::Error, dest: &Path) -> anyhow::Error {
    let full = err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::StorageFull)
            || cause
                .downcast_ref::<store::Error>()
                .is_some_and(store::Error::is_out_of_space)
            || cause.to_string().contains("No space left on device")
    });
    if full {
        anyhow::anyhow!(
            "backup_destination_full: no space left on device under {}; the previous backup there is untouched",
            dest.display()
        )
    } else {
        err
    }
}

pub fn run_backup(args: BackupArgs) -> Result<ExitCode> {
    let dest = args.dest.clone();
    let result = backup(args);
    let backups = dest.join("backups");
    // Whatever failed, no partial backup is left to be taken for one.
    if result.is_err() {
        for entry in std::fs::read_dir(&backups).into_iter().flatten().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(&format!(".partial-{}-", std::process::id()))
            {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    result.map_err(|err| destination_error(err, &dest))
}

fn backup(args: BackupArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let at = SystemTime::now();
    let backups = args.dest.join("backups");
    std::fs::create_dir_all(&backups).with_context(|| format!("making {}", backups.display()))?;
    let store_to = match &args.store_to {
        Some(url) => url.clone(),
        None => args.dest.join("store").display().to_string(),
    };
    let partial = backups.join(format!(".partial-{}-{}", std::process::id(), stamp(at)));
    std::fs::create_dir(&partial).with_context(|| format!("making {}", partial.display()))?;
    let source = Store::open_existing(&args.deployment.store)
        .with_context(|| format!("opening the store {}", args.deployment.store))?;
    let target = Store::open(&store_to).with_context(|| format!("opening {store_to}"))?;
    let database = args.deployment.database_url();
    let runtime = crate::control::runtime()?;
    let db = runtime
        .block_on(records::connect(&database))
        .context("opening the records database")?;
    let mut attempt = 0;
    let (records_file, roots, copied, checked) = loop {
        attempt += 1;
        // 1. The records: a consistent copy, and the roots it names.
        let (records_file, roots) = dump_records(&runtime, &db, &partial)?;
        // 2. The store: after the records, so each of their roots is in it.
        let copied = copy_stores(&source, &target, args.json).context("store copy failed")?;
        // 3. Every root of the records copy whole in the store copy.
        let checked = check_roots(&target, &roots, false)?;
        if checked.incomplete.is_empty() || attempt == BACKUP_ATTEMPTS {
            break (records_file, roots, copied, checked);
        }
        tracing::warn!(
            incomplete = checked.incomplete.len(),
            "roots of the records copy missing from the store copy (gc took them meanwhile); taking both again"
        );
    };
    if !copied.corrupt.is_empty() || !checked.incomplete.is_empty() {
        for corrupt in &copied.corrupt {
            eprintln!("corrupt in the source, not copied: {corrupt}");
        }
        for line in &checked.incomplete {
            eprintln!("incomplete in the backup: {}", line.describe());
        }
        bail!(
            "backup_incomplete: {} roots of the records are not whole in the store copy, {} corrupt source objects; no backup written",
            checked.incomplete.len(),
            copied.corrupt.len()
        );
    }
    let manifest = json!({
        "version": 1,
        "created_at": humantime::format_rfc3339_seconds(at).to_string(),
        "seconds": started.elapsed().as_secs_f64(),
        "records": {
            "engine": if records_file.ends_with(".db") { "sqlite" } else { "postgres" },
            "file": records_file,
        },
        // null: DEST/store, found from the backup's own place (DEST may move).
        "store": args.store_to,
        "counts": {
            "sandboxes": roots.sandboxes.len(),
            "snapshots": roots.snapshots.len(),
            "images": roots.images.len(),
            "trees": checked.trees,
            "blocks": checked.blocks,
        },
        "roots": roots_json(&roots),
        "copy": copy_json(&copied),
        "bytes": {
            "records": std::fs::metadata(partial.join(&records_file)).map(|m| m.len()).unwrap_or(0),
            "store_copied": copied.bytes_copied,
        },
    });
    write_synced(
        &partial.join("manifest.json"),
        manifest.to_string().as_bytes(),
    )?;
    // Its entries durable before its name says it is whole.
    sync_dir(&partial)?;
    let done = backups.join(stamp(at));
    std::fs::rename(&partial, &done).with_context(|| format!("renaming to {}", done.display()))?;
    sync_dir(&backups)?;
    if args.json {
        let mut out = manifest;
        out["path"] = json!(done.display().to_string());
        print_json(&out);
    } else {
        println!(
            "backup {}: {} sandboxes, {} snapshots, {} images; store: {} packs and {} objects copied ({}), {} already there",
            done.display(),
            roots.sandboxes.len(),
            roots.snapshots.len(),
            roots.images.len(),
            copied.packs_copied,
            copied.objects_copied,
            human_bytes(copied.bytes_copied),
            copied.packs_skipped + copied.objects_skipped,
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The records' consistent copy into `dir` (replacing an earlier
/// attempt's); its file name and the roots it names.
fn dump_records(
    runtime: &tokio::runtime::Runtime,
    db: &server::db::Db,
    dir: &Path,
) -> Result<(String, RecordRoots)> {
    match db.engine {
        server::db::Engine::Sqlite => {
            let file = dir.join("records.db");
            let _ = std::fs::remove_file(&file);
            let roots = runtime
                .block_on(records::dump_sqlite(db, &file))
                .context("copying the records (VACUUM INTO)")?;
            std::fs::File::open(&file)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("syncing {}", file.display()))?;
            Ok(("records.db".to_owned(), roots))
        }
        server::db::Engine::Postgres => {
            let file = dir.join("records.pgdump");
            let url = db.url.to_string();
            let out = file.clone();
            let roots = runtime
                .block_on(records::dump_postgres(db, move |snapshot| {
                    let args = [
                        format!("--snapshot={snapshot}"),
                        "--format=custom".to_owned(),
                        format!("--file={}", out.display()),
                    ];
                    run_pg_tool("pg_dump", &args, &url)
                }))
                .context("dumping the records (pg_dump)")?;
            std::fs::File::open(&file)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("syncing {}", file.display()))?;
            Ok(("records.pgdump".to_owned(), roots))
        }
    }
}

/// Runs a PostgreSQL client tool (`pg_dump`, `pg_restore`) on the
/// database at `url`. The URL's password goes to the tool in
/// `PGPASSWORD`, never on its command line (which any user of the host
/// reads in `ps`) nor in the error, which names the command.
fn run_pg_tool(program: &str, args: &[String], url: &str) -> Result<(), String> {
    let command = pg_tool_command(program, args, url)?;
    oci::host::run_command(command, None)
        .map(drop)
        .map_err(|f| format!("{} failed: {}", f.command, f.said("; ")))
}

/// The command [`run_pg_tool`] runs: `--dbname` the URL without its
/// password, which is in the environment.
fn pg_tool_command(
    program: &str,
    args: &[String],
    url: &str,
) -> Result<std::process::Command, String> {
    let mut parsed = reqwest::Url::parse(url)
        .map_err(|e| format!("{program}: the database URL does not parse: {e}"))?;
    let password = parsed.password().map(|encoded| {
        percent_encoding::percent_decode_str(encoded)
            .decode_utf8_lossy()
            .into_owned()
    });
    if password.is_some() && parsed.set_password(None).is_err() {
        return Err(format!(
            "{program}: the database URL's password cannot be taken out of it"
        ));
    }
    let mut command = std::process::Command::new(program);
    command.arg(format!("--dbname={parsed}")).args(args);
    if let Some(password) = password {
        command.env("PGPASSWORD", password);
    }
    Ok(command)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut file =
        std::fs::File::create(path).with_context(|| format!("writing {}", path.display()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", path.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing {}", dir.display()))
}

fn roots_json(roots: &RecordRoots) -> serde_json::Value {
    let list = |rows: &[RecordRoot]| -> Vec<serde_json::Value> {
        rows.iter()
            .map(|r| json!({ "id": r.id, "org_id": r.org_id, "root": r.root }))
            .collect()
    };
    json!({
        "sandboxes": list(&roots.sandboxes),
        "snapshots": list(&roots.snapshots),
        "images": list(&roots.images),
    })
}

/// One root of the records that is not whole in the store.
struct Incomplete {
    kind: &'static str,
    record: RecordRoot,
    missing: u64,
    corrupt: u64,
    first: Option<String>,
}

impl Incomplete {
    fn describe(&self) -> String {
        format!(
            "{} {} (org {}): tree {} incomplete: {} missing, {} corrupt{}",
            self.kind,
            self.record.id,
            self.record.org_id,
            self.record.root,
            self.missing,
            self.corrupt,
            self.first
                .as_ref()
                .map(|d| format!(", e.g. object {d}"))
                .unwrap_or_default()
        )
    }
}

struct Checked {
    incomplete: Vec<Incomplete>,
    trees: u64,
    blocks: u64,
}

/// Checks every root of `roots` in `store`, org by org.
fn check_roots(store: &Store, roots: &RecordRoots, deep: bool) -> Result<Checked> {
    let mut by_org: std::collections::BTreeMap<&str, Vec<(&'static str, &RecordRoot)>> =
        Default::default();
    for (kind, rows) in [
        ("sandbox", &roots.sandboxes),
        ("snapshot", &roots.snapshots),
        ("image", &roots.images),
    ] {
        for row in rows {
            by_org.entry(&row.org_id).or_default().push((kind, row));
        }
    }
    let mut checked = Checked {
        incomplete: Vec::new(),
        trees: 0,
        blocks: 0,
    };
    for (org, rows) in by_org {
        let mut digests = Vec::new();
        for (kind, row) in &rows {
            match row.root.parse::<store::Digest>() {
                Ok(digest) => digests.push(digest),
                Err(_) => checked.incomplete.push(Incomplete {
                    kind,
                    record: (*row).clone(),
                    missing: 1,
                    corrupt: 0,
                    first: Some(format!("{:?} (not a digest)", row.root)),
                }),
            }
        }
        let store_org: store::OrgId = org
            .parse()
            .with_context(|| format!("org {org:?} is not a store org"))?;
        let (statuses, totals) = store::check::roots(store, &store_org, &digests, deep)
            .with_context(|| format!("checking org {org}'s trees"))?;
        checked.trees += totals.trees;
        checked.blocks += totals.blocks;
        for (kind, row) in rows {
            let Ok(digest) = row.root.parse::<store::Digest>() else {
                continue;
            };
            let status = statuses.get(&digest).cloned().unwrap_or_default();
            if !status.complete() {
                checked.incomplete.push(Incomplete {
                    kind,
                    record: row.clone(),
                    missing: status.missing,
                    corrupt: status.corrupt,
                    first: status.first_fault.map(|o| o.digest.to_hex()),
                });
            }
        }
    }
    Ok(checked)
}

/// Prints a check's outcome; the exit code.
fn report_check(
    checked: &Checked,
    roots: &RecordRoots,
    deep: bool,
    seconds: f64,
    json: bool,
    extra: serde_json::Value,
) -> ExitCode {
    let ok = checked.incomplete.is_empty();
    if json {
        let incomplete: Vec<serde_json::Value> = checked
            .incomplete
            .iter()
            .map(|i| {
                json!({
                    "kind": i.kind,
                    "id": i.record.id,
                    "org_id": i.record.org_id,
                    "root": i.record.root,
                    "missing": i.missing,
                    "corrupt": i.corrupt,
                    "first_fault": i.first,
                })
            })
            .collect();
        let mut out = json!({
            "ok": ok,
            "deep": deep,
            "sandboxes": roots.sandboxes.len(),
            "snapshots": roots.snapshots.len(),
            "images": roots.images.len(),
            "trees": checked.trees,
            "blocks": checked.blocks,
            "seconds": seconds,
            "incomplete": incomplete,
        });
        if let (Some(out), Some(extra)) = (out.as_object_mut(), extra.as_object()) {
            out.extend(extra.clone());
        }
        print_json(&out);
    } else {
        for line in &checked.incomplete {
            println!("error: {}", line.describe());
        }
        println!(
            "check: {} sandboxes, {} snapshots, {} images; {} trees read and verified, {} blocks {} in {seconds:.1}s: {}",
            roots.sandboxes.len(),
            roots.snapshots.len(),
            roots.images.len(),
            checked.trees,
            checked.blocks,
            if deep { "read and verified" } else { "present" },
            if ok {
                "ok".to_owned()
            } else {
                format!("{} incomplete", checked.incomplete.len())
            }
        );
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

pub fn run_check(args: CheckArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let runtime = crate::control::runtime()?;
    let db = runtime
        .block_on(records::connect(&args.deployment.database_url()))
        .context("opening the records database")?;
    let roots = runtime
        .block_on(records::read_roots(&db))
        .context("reading the records")?;
    let store = Store::open_existing(&args.deployment.store)
        .with_context(|| format!("opening the store {}", args.deployment.store))?;
    let checked = check_roots(&store, &roots, args.deep)?;
    Ok(report_check(
        &checked,
        &roots,
        args.deep,
        started.elapsed().as_secs_f64(),
        args.json,
        json!({}),
    ))
}

/// The backup `src` names: itself if it holds a manifest, else the newest
/// complete one under `src/backups`.
fn chosen_backup(src: &Path) -> Result<PathBuf> {
    if src.join("manifest.json").is_file() {
        return Ok(src.to_owned());
    }
    let backups = src.join("backups");
    let mut complete: Vec<PathBuf> = std::fs::read_dir(&backups)
        .with_context(|| format!("reading {}", backups.display()))?
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").is_file())
        .collect();
    complete.sort();
    complete
        .pop()
        .with_context(|| format!("no complete backup under {}", backups.display()))
}

pub fn run_restore(args: RestoreArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let chosen = chosen_backup(&args.src)?;
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(chosen.join("manifest.json"))
            .with_context(|| format!("reading {}", chosen.join("manifest.json").display()))?,
    )
    .context("manifest.json is not JSON")?;
    let records_file = manifest["records"]["file"]
        .as_str()
        .context("manifest.json names no records file")?;
    let backup_store = match manifest["store"].as_str() {
        Some(url) => url.to_owned(),
        // DEST/backups/STAMP → DEST/store.
        None => chosen
            .parent()
            .and_then(Path::parent)
            .context("the backup is not under DEST/backups")?
            .join("store")
            .display()
            .to_string(),
    };
    let database = args.deployment.database_url();
    let runtime = crate::control::runtime()?;
    let target = Store::open(&args.deployment.store)
        .with_context(|| format!("opening the store {}", args.deployment.store))?;
    // 1. The targets are empty, or the operator said to go on anyway.
    let sqlite = database.starts_with("sqlite:");
    if sqlite != (records_file == "records.db") {
        bail!(
            "restore_engine_mismatch: the backup's records are {records_file}, the target database is {database}"
        );
    }
    let sqlite_file = args.deployment.data_dir.join("roost.db");
    if !args.force {
        let mut occupied = Vec::new();
        if sqlite && args.deployment.database.is_none() && sqlite_file.exists() {
            occupied.push(format!("{} exists", sqlite_file.display()));
        }
        if !sqlite || args.deployment.database.is_some() {
            let db = runtime.block_on(records::connect(&database))?;
            if !runtime.block_on(records::is_empty(&db))? {
                occupied.push(format!("the database {database} has tables"));
            }
        }
        if target
            .backend()
            .any_under(Store::orgs_prefix())
            .context("listing the target store")?
        {
            occupied.push(format!("the store {} holds objects", args.deployment.store));
        }
        if !occupied.is_empty() {
            bail!(
                "restore_target_not_empty: {}; restore into an empty data dir and store, or pass --force",
                occupied.join(", ")
            );
        }
    }
    // 2. The records.
    let records_path = chosen.join(records_file);
    if sqlite {
        let file = match &args.deployment.database {
            None => sqlite_file,
            Some(url) => PathBuf::from(
                url.trim_start_matches("sqlite://")
                    .trim_start_matches("sqlite:")
                    .split('?')
                    .next()
                    .unwrap_or_default(),
            ),
        };
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("making {}", parent.display()))?;
        }
        for stale in ["-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{stale}", file.display()));
        }
        let temp = file.with_extension("db.restoring");
        std::fs::copy(&records_path, &temp)
            .with_context(|| format!("copying the records to {}", temp.display()))?;
        std::fs::File::open(&temp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", temp.display()))?;
        std::fs::rename(&temp, &file).with_context(|| format!("renaming to {}", file.display()))?;
        // The rename durable too (a relative file's directory is `.`).
        sync_dir(
            file.parent()
                .filter(|parent| !parent.as_os_str().is_empty())
                .unwrap_or(Path::new(".")),
        )?;
    } else {
        let mut restore_args = vec!["--no-owner".to_owned()];
        if args.force {
            restore_args.extend(["--clean".to_owned(), "--if-exists".to_owned()]);
        }
        restore_args.push(records_path.display().to_string());
        run_pg_tool("pg_restore", &restore_args, &database).map_err(anyhow::Error::msg)?;
    }
    // 3. The store, then the pins of every root the records name.
    let source = Store::open_existing(&backup_store)
        .with_context(|| format!("opening the backup's store {backup_store}"))?;
    let copied = copy_stores(&source, &target, args.json).context("store copy failed")?;
    let db = runtime
        .block_on(records::connect(&database))
        .context("opening the restored records")?;
    let roots = runtime
        .block_on(records::read_roots(&db))
        .context("reading the restored records")?;
    let pinned = records::pin_roots(&target, &roots)
        .map_err(|e| anyhow::anyhow!("pinning the restored roots: {e}"))?;
    target.sync().context("syncing the restored store")?;
    // 4. The check.
    let checked = check_roots(&target, &roots, false)?;
    if !args.json {
        println!(
            "restored {} into {} and {}: {} packs and {} objects copied ({}), {} roots pinned",
            chosen.display(),
            database,
            args.deployment.store,
            copied.packs_copied,
            copied.objects_copied,
            human_bytes(copied.bytes_copied),
            pinned
        );
    }
    Ok(report_check(
        &checked,
        &roots,
        false,
        started.elapsed().as_secs_f64(),
        args.json,
        json!({ "restored_from": chosen.display().to_string(), "copy": copy_json(&copied), "pinned": pinned }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Audit finding: `pg_dump` and `pg_restore` were given the database
    /// URL whole, password included, in their arguments (any user of the
    /// host reads them in `ps`) and in the error that names the command.
    #[test]
    fn a_postgres_password_goes_in_the_environment_never_in_the_arguments() {
        let args = ["--format=custom".to_owned()];
        let command = pg_tool_command(
            "pg_dump",
            &args,
            "postgres://roost:s3cr%40t@db.example:5432/roost?sslmode=require",
        )
        .expect("a command");
        let argv: Vec<String> = command
            .get_args()
            .map(|arg| arg.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            argv,
            [
                "--dbname=postgres://roost@db.example:5432/roost?sslmode=require",
                "--format=custom"
            ]
        );
        let password = command
            .get_envs()
            .find(|(name, _)| *name == "PGPASSWORD")
            .and_then(|(_, value)| value)
            .map(|value| value.to_string_lossy().into_owned());
        assert_eq!(password.as_deref(), Some("s3cr@t"), "decoded");

        // No password: nothing in the environment either.
        let command = pg_tool_command("pg_restore", &args, "postgres://roost@127.0.0.1/db")
            .expect("a command");
        assert!(command.get_envs().all(|(name, _)| name != "PGPASSWORD"));
        // What a failure says names no password.
        let failed = oci::host::run_command(
            pg_tool_command(
                "/nonexistent/pg_dump",
                &args,
                "postgres://roost:hunter2@127.0.0.1/db",
            )
            .expect("a command"),
            None,
        )
        .expect_err("no such program");
        assert!(!failed.command.contains("hunter2"), "{}", failed.command);
    }
}
