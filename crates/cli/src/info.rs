//! `roost info`: what the deployment promises and observed (`GET
//! /v1/deployment`), with any token.

use std::process::ExitCode;

use anyhow::{Context, Result};
use api::deployment::{Deployment, Figure, host_failure_table, seconds_text};
use clap::Args;

use crate::output::{print_fields, print_record, print_table};
use crate::sandbox::OrgTarget;

#[derive(Args)]
#[command(mut_arg("token", |token| token.help(
    "Any token: an org, admin or runner token [default: the one `roost up` saved, for its URL]"
)))]
pub struct InfoArgs {
    #[command(flatten)]
    target: OrgTarget,
}

pub fn run(args: InfoArgs) -> Result<ExitCode> {
    crate::control::runtime()?.block_on(async move {
        let deployment = args
            .target
            .client()?
            .deployment()
            .await
            .context("reading the deployment failed")?;
        if args.target.json {
            print_record(&deployment)?;
        } else {
            print_text(&deployment);
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn print_text(d: &Deployment) {
    let store = &d.store;
    let location = match (&store.endpoint_host, &store.bucket) {
        (Some(host), Some(bucket)) => format!("{} (bucket {bucket} at {host})", store.kind),
        _ => store.kind.clone(),
    };
    let independent = if store.independent_of_runners {
        "independent of every runner"
    } else {
        "not known to be independent of every runner"
    };
    let c = &d.configured;
    let b = &d.bounds;
    print_fields(&[
        ("store", format!("{location}, {independent}")),
        ("retention", seconds_text(c.retention_s)),
        (
            "fleet max running",
            c.fleet_max_running
                .map_or_else(|| "no ceiling".to_owned(), |n| n.to_string()),
        ),
        (
            "idle sandboxes sleep after",
            if c.idle_timeout_s == 0.0 {
                format!(
                    "never by default (a sandbox may ask for {} to {})",
                    seconds_text(c.idle_timeout_min_s),
                    seconds_text(c.idle_timeout_max_s)
                )
            } else {
                format!(
                    "{} without activity by default (a sandbox may ask for 0, never, or {} to {})",
                    seconds_text(c.idle_timeout_s),
                    seconds_text(c.idle_timeout_min_s),
                    seconds_text(c.idle_timeout_max_s)
                )
            },
        ),
        (
            "durable loss at most",
            format!(
                "{} (save interval {} + 2 × longest recent save {})",
                seconds_text(b.durable_loss_max_s),
                seconds_text(c.save_interval_s),
                seconds_text(b.longest_save_s)
            ),
        ),
        (
            "after a host loss",
            format!(
                "nothing reruns; commands end {}",
                d.after_host_loss
                    .command_states
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
    ]);
    println!();
    print!("{}", host_failure_table(d, "value"));
    println!();
    let o = &d.observed;
    println!("observed over the last {}:", seconds_text(o.window_s));
    let cell = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), seconds_text);
    let row = |name: &str, f: &Figure| {
        vec![
            name.to_owned(),
            f.count.to_string(),
            cell(f.p50_s),
            cell(f.p90_s),
            cell(f.p99_s),
            cell(f.max_s),
        ]
    };
    print_table(
        &["WHAT", "COUNT", "P50", "P90", "P99", "MAX"],
        &[
            row("save duration", &o.save_duration),
            row("save lag", &o.save_lag),
            row("host loss to running", &o.host_loss_to_running),
            row("wake, same runner", &o.wake_same_runner),
            row("wake, other runner", &o.wake_other_runner),
        ],
    );
}
