//! `roost snapshot …`: capture a sandbox's home at one instant into the
//! store, follow the receipt's durability, list and delete snapshots. New
//! sandboxes start from one with `roost sandbox create --from-snapshot`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use api::snapshots::{CreateSnapshotRequest, Snapshot};
use clap::Subcommand;

use crate::control::runtime;
use crate::output::{
    age, collect_pages, or_dash, print_fields, print_record, print_table, time_and_age,
};
use crate::sandbox::{LONG_POLL_SECONDS_MAX, OrgTarget};

#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Snapshot a sandbox's home; prints the receipt.
    #[command(
        after_help = "The receipt's durability moves pending → local (captured on the runner) → \
                      replicated (every object in the central store), or ends failed. With \
                      --wait, waits until the requested durability is reached and exits 1 if \
                      the snapshot failed instead (durability_deadline_exceeded when --deadline \
                      passed first)."
    )]
    Create {
        /// The sandbox (`sbx_…`).
        sandbox_id: String,
        /// `local` or `replicated`.
        #[arg(long, default_value = "replicated", value_parser = ["local", "replicated"])]
        durability: String,
        /// How long the requested durability may take (seconds, or e.g.
        /// `30s`, `5m`); past it the snapshot fails.
        #[arg(long, value_name = "DURATION", value_parser = crate::sandbox::parse_duration)]
        deadline: Option<Duration>,
        /// Makes the request safe to retry: the same key returns the same snapshot.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
        /// Wait for the requested durability (or the failure).
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Show a snapshot, optionally waiting for a durability.
    Get {
        /// The snapshot's id (`snp_…`).
        id: String,
        /// Wait until the snapshot has this durability (or failed); exit 1
        /// if it failed instead.
        #[arg(long, value_name = "DURABILITY", value_parser = ["pending", "local", "replicated", "failed"])]
        wait_for: Option<String>,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// List snapshots (all of the org's, or one sandbox's).
    List {
        /// Only this sandbox's snapshots.
        #[arg(long, value_name = "SANDBOX_ID")]
        sandbox: Option<String>,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Delete a snapshot (children keep their homes).
    Delete {
        /// The snapshot's id (`snp_…`).
        id: String,
        #[command(flatten)]
        target: OrgTarget,
    },
}

pub fn run(command: SnapshotCommand) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        match command {
            SnapshotCommand::Create {
                sandbox_id,
                durability,
                deadline,
                idempotency_key,
                wait,
                target,
            } => {
                let client = target.client()?;
                let request = CreateSnapshotRequest {
                    durability: Some(durability.clone()),
                    deadline: deadline.map(|d| d.as_secs().max(1)),
                };
                let snapshot = client
                    .create_snapshot(&sandbox_id, &request, idempotency_key.as_deref())
                    .await
                    .context("snapshot create failed")?;
                if !wait {
                    print_snapshot(&snapshot, target.json)?;
                    return Ok(ExitCode::SUCCESS);
                }
                wait_for(&client, &snapshot.id, &durability, &target).await
            }
            SnapshotCommand::Get {
                id,
                wait_for: Some(durability),
                target,
            } => {
                let client = target.client()?;
                wait_for(&client, &id, &durability, &target).await
            }
            SnapshotCommand::Get {
                id,
                wait_for: None,
                target,
            } => {
                let client = target.client()?;
                let snapshot = client
                    .get_snapshot(&id)
                    .await
                    .context("snapshot get failed")?;
                print_snapshot(&snapshot, target.json)?;
                Ok(ExitCode::SUCCESS)
            }
            SnapshotCommand::List { sandbox, target } => {
                let client = target.client()?;
                let (snapshots, _) = collect_pages(true, |cursor| {
                    let (client, sandbox) = (&client, sandbox.as_deref());
                    async move {
                        let page = client
                            .list_snapshots(sandbox, None, cursor.as_deref())
                            .await
                            .context("snapshot list failed")?;
                        Ok((page.snapshots, page.next_cursor))
                    }
                })
                .await?;
                if target.json {
                    print_record(&serde_json::json!({ "snapshots": snapshots }))?;
                } else {
                    let rows: Vec<Vec<String>> = snapshots
                        .iter()
                        .map(|s| {
                            vec![
                                s.id.clone(),
                                s.sandbox_id.clone(),
                                s.durability.clone(),
                                or_dash(s.reason.as_deref()),
                                s.captured_at
                                    .as_deref()
                                    .map(age)
                                    .unwrap_or_else(|| "-".to_owned()),
                            ]
                        })
                        .collect();
                    print_table(
                        &["ID", "SANDBOX", "DURABILITY", "REASON", "CAPTURED"],
                        &rows,
                    );
                }
                Ok(ExitCode::SUCCESS)
            }
            SnapshotCommand::Delete { id, target } => {
                let client = target.client()?;
                let snapshot = client
                    .delete_snapshot(&id)
                    .await
                    .context("snapshot delete failed")?;
                if target.json {
                    print_record(&snapshot)?;
                } else {
                    println!("deleted snapshot {}", snapshot.id);
                }
                Ok(ExitCode::SUCCESS)
            }
        }
    })
}

/// Long-polls until `durability` (or a failure); exit 1 unless reached.
pub async fn wait_for(
    client: &api::client::Client,
    id: &str,
    durability: &str,
    target: &OrgTarget,
) -> Result<ExitCode> {
    loop {
        let snapshot = client
            .wait_snapshot(id, durability, LONG_POLL_SECONDS_MAX)
            .await
            .context("snapshot get failed")?;
        if api::snapshots::wait_is_over(&snapshot.durability, durability) {
            print_snapshot(&snapshot, target.json)?;
            return Ok(
                if api::snapshots::reached(&snapshot.durability, durability) {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                },
            );
        }
    }
}

pub fn print_snapshot(snapshot: &Snapshot, json: bool) -> Result<()> {
    if json {
        return print_record(snapshot);
    }
    let durability = match &snapshot.reason {
        Some(reason) => format!("{} ({reason})", snapshot.durability),
        None => snapshot.durability.clone(),
    };
    print_fields(&[
        ("id", snapshot.id.clone()),
        ("sandbox", snapshot.sandbox_id.clone()),
        ("durability", durability),
        ("requested", snapshot.requested.clone()),
        ("deadline", or_dash(snapshot.deadline.as_deref())),
        ("root", or_dash(snapshot.root.as_deref())),
        (
            "files",
            snapshot
                .files
                .map_or_else(|| "-".to_owned(), |f| f.to_string()),
        ),
        ("captured", time_and_age(snapshot.captured_at.as_deref())),
        ("created", time_and_age(Some(&snapshot.created_at))),
        (
            "salvaged from",
            snapshot.salvaged_from.as_ref().map_or_else(
                || "-".to_owned(),
                |from| {
                    format!(
                        "kept copy {} on runner {}, kept {}",
                        from.copy_id, from.runner_id, from.kept_at
                    )
                },
            ),
        ),
    ]);
    Ok(())
}
