//! `GET /v1/deployment`: what the running deployment promises (its live
//! configuration), the bounds that follow from it, and what its own
//! records observed. README's host-failure table is
//! [`host_failure_table`] of the default configuration, so the document
//! and the API never disagree.

use std::fmt::Write;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::lifecycle::CommandState;

/// `GET /v1/deployment` (any token).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Deployment {
    pub configured: Configured,
    pub store: StoreLocation,
    pub bounds: Bounds,
    pub after_host_loss: AfterHostLoss,
    pub observed: Observed,
}

/// The running server's configuration, as it applies it now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Configured {
    /// Seconds between saves of a running durable home (`--save-interval`),
    /// unless its create asks for another within the bounds below.
    pub save_interval_s: f64,
    /// Seconds: the shortest save interval a create may ask for
    /// (`--save-interval-min`).
    pub save_interval_min_s: f64,
    /// Seconds: the longest save interval a create may ask for
    /// (`--save-interval-max`).
    pub save_interval_max_s: f64,
    /// Seconds without activity before a running sandbox sleeps, unless
    /// its create asks otherwise (`--idle-timeout`; 0: never).
    pub idle_timeout_s: f64,
    /// Seconds: the shortest idle timeout a sandbox may ask for other than
    /// 0 (`--idle-timeout-min`).
    pub idle_timeout_min_s: f64,
    /// Seconds: the longest (`--idle-timeout-max`).
    pub idle_timeout_max_s: f64,
    /// Seconds a runner's lease lasts after the server received its
    /// heartbeat (`--lease-ttl`).
    pub lease_ttl_s: f64,
    /// Seconds between a runner's heartbeats: a third of the lease.
    pub heartbeat_interval_s: f64,
    /// Seconds after it sent its last answered heartbeat that a runner
    /// freezes its sandboxes: two thirds of the lease.
    pub freeze_after_s: f64,
    /// Seconds after that send that each sandbox's init stops its
    /// processes itself, should the runner not have frozen them: five
    /// sixths of the lease.
    pub init_stop_after_s: f64,
    /// Seconds past a lease's expiry the server still waits before it
    /// declares the runner lost (`--fence-margin`).
    pub fence_margin_s: f64,
    /// Seconds between passes of the reconcilers (the lease watcher
    /// among them) (`--reconcile-interval`).
    pub reconcile_interval_s: f64,
    /// A share of the live runners, 0 to 1 (above 1: never): when at least
    /// this share (and at least two) lose their lease at once, recovery
    /// holds off (`--mass-loss-threshold`).
    pub mass_loss_threshold: f64,
    /// Seconds recovery holds off after such a mass loss
    /// (`--mass-loss-grace`).
    pub mass_loss_grace_s: f64,
    /// Seconds a stop waits between SIGTERM and SIGKILL of the workload
    /// (`--stop-grace`; runners take it from the server when they
    /// register).
    pub stop_grace_s: f64,
    /// Seconds ended sandboxes stay readable, and kept copies of homes
    /// are kept at most (`--retention`).
    pub retention_s: f64,
    /// A count: the most sandboxes running at once across the fleet
    /// (`--fleet-max-running`); null: no ceiling.
    pub fleet_max_running: Option<u64>,
}

/// Where durable homes are saved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StoreLocation {
    /// `local` (a directory on the server's host), `s3`, or `none` (no
    /// store: `durable` is refused).
    pub kind: String,
    /// `s3` only: the host name (and port) of the endpoint the server
    /// writes to.
    pub endpoint_host: Option<String>,
    /// `s3` only: the bucket.
    pub bucket: Option<String>,
    /// True when the store is known to live on no runner's host, so a
    /// host failure cannot take it with a sandbox: `s3` on an endpoint
    /// other than loopback. A `local` store is on the server's host, which
    /// may run runners too (`roost up` does): false.
    pub independent_of_runners: bool,
}

/// What follows from the configuration, each with its formula.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Bounds {
    /// Seconds: the most recent work a host failure can lose for a durable
    /// sandbox saving at the default interval while its saves succeed:
    /// `save_interval_s + 2 × longest_save_s`. A save captures the home,
    /// uploads and commits; the next one starts an interval after it
    /// ended, and a failure just before that one commits loses all since
    /// the first's capture.
    pub durable_loss_max_s: f64,
    /// Seconds: the longest save in the observation window
    /// (`observed.save_duration.max_s`), the term of the formula above; 0
    /// when none was observed yet (the bound then holds only for instant
    /// saves).
    pub longest_save_s: f64,
    /// Seconds from a host failure until the server declares its runner
    /// lost and recovery starts, at the least: `lease_ttl_s +
    /// fence_margin_s − heartbeat_interval_s` (the host failed just before
    /// a heartbeat).
    pub detection_min_s: f64,
    /// Seconds, at the most: `lease_ttl_s + fence_margin_s +
    /// reconcile_interval_s` (it failed just after one).
    pub detection_max_s: f64,
    /// Seconds, at the most, when a large share of the fleet is lost at
    /// once: `detection_max_s + mass_loss_grace_s`.
    pub detection_max_mass_loss_s: f64,
}

/// What reruns after a host loss: nothing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AfterHostLoss {
    /// Whether a command that was running on the lost host runs again:
    /// never (it may have had effects; the caller decides).
    pub commands_rerun: bool,
    /// The states the lost host's commands end in: `infrastructure_lost`
    /// (seen running), `unknown` (handed over, never confirmed),
    /// `not_launched` (still queued).
    pub command_states: Vec<CommandState>,
    /// What becomes of a durable sandbox.
    pub durable: String,
    /// What becomes of a standard sandbox.
    pub standard: String,
}

/// Figures from the server's own records (its saves and events), over
/// the last `window_s` seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Observed {
    /// Seconds: the figures cover what completed since this long ago.
    pub window_s: f64,
    /// Completed saves, from the home's capture to the commit.
    pub save_duration: Figure,
    /// Completed saves: the work at risk just before each committed, from
    /// the previous save's capture to this one's commit (first saves not
    /// counted).
    pub save_lag: Figure,
    /// Durable sandboxes recovered after a host loss: from the server
    /// declaring the runner lost (`recovering`) to running again.
    pub host_loss_to_running: Figure,
    /// Sandboxes that ran before, placed again on the runner they last ran
    /// on: from placement (`starting`) to running.
    pub wake_same_runner: Figure,
    /// The same, placed on another runner.
    pub wake_other_runner: Figure,
}

/// Percentiles of one kind of observation (nearest rank).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Figure {
    /// A count: how many observations the percentiles are of.
    pub count: u64,
    /// Seconds: the median; null with nothing observed.
    pub p50_s: Option<f64>,
    /// Seconds: the 90th percentile; null with nothing observed.
    pub p90_s: Option<f64>,
    /// Seconds: the 99th percentile; null with nothing observed.
    pub p99_s: Option<f64>,
    /// Seconds: the longest; null with nothing observed.
    pub max_s: Option<f64>,
}

impl Figure {
    /// The figure of `seconds` (any order; non-finite values ignored).
    pub fn of(mut seconds: Vec<f64>) -> Figure {
        seconds.retain(|s| s.is_finite());
        seconds.sort_by(f64::total_cmp);
        let rank = |p: f64| -> Option<f64> {
            // Nearest rank: the smallest value with at least p of them at
            // or below it.
            let n = seconds.len();
            let index = ((p * n as f64).ceil() as usize).clamp(1, n.max(1)) - 1;
            seconds.get(index).copied()
        };
        Figure {
            count: seconds.len() as u64,
            p50_s: rank(0.50),
            p90_s: rank(0.90),
            p99_s: rank(0.99),
            max_s: seconds.last().copied(),
        }
    }
}

/// A duration as README and `roost info` print it: `9 s`, `7.5 s`, `24 h`.
pub fn seconds_text(seconds: f64) -> String {
    let round = |v: f64| {
        let text = format!("{:.3}", v);
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    };
    if seconds >= 3600.0 && seconds % 3600.0 == 0.0 {
        format!("{} h", round(seconds / 3600.0))
    } else {
        format!("{} s", round(seconds))
    }
}

/// `A–B s` (or one value when they are equal).
fn range_text(low: f64, high: f64) -> String {
    let low = seconds_text(low);
    let high = seconds_text(high);
    match (low.strip_suffix(" s"), high.strip_suffix(" s")) {
        _ if low == high => low,
        (Some(low), Some(high)) => format!("{low}–{high} s"),
        _ => format!("{low} – {high}"),
    }
}

/// README's host-failure table: what happens when, and its value in this
/// deployment (`value_header` names that column). The timings come from
/// `configured` and `bounds`; the loss bound's observed term only when
/// `observed` has a save.
pub fn host_failure_table(deployment: &Deployment, value_header: &str) -> String {
    let c = &deployment.configured;
    let b = &deployment.bounds;
    let loss = match deployment.observed.save_duration.max_s {
        Some(_) => seconds_text(b.durable_loss_max_s),
        None => format!("{} + 2 × the longest save", seconds_text(c.save_interval_s)),
    };
    let rows: [(&str, &str, String); 10] = [
        (
            "heartbeat",
            "every third of the lease",
            seconds_text(c.heartbeat_interval_s),
        ),
        (
            "runner freezes its sandboxes (cgroup freezer, through the runtime's pause)",
            "two thirds of the lease after it sent its last heartbeat the server answered",
            seconds_text(c.freeze_after_s),
        ),
        (
            "each sandbox's init stops its processes itself (SIGSTOP), should the runner not have",
            "five sixths of the lease after that send",
            seconds_text(c.init_stop_after_s),
        ),
        (
            "the server's lease expires",
            "a lease after it received that heartbeat (`--lease-ttl`)",
            seconds_text(c.lease_ttl_s),
        ),
        (
            "the server declares the runner lost, fences it (epoch + 1) and places its durable sandboxes elsewhere",
            "lease + fence margin (`--fence-margin`) after that heartbeat (+ up to one reconcile interval)",
            range_text(
                c.lease_ttl_s + c.fence_margin_s,
                c.lease_ttl_s + c.fence_margin_s + c.reconcile_interval_s,
            ),
        ),
        (
            "a host failure is detected (the above, counted from the failure)",
            "lease + fence margin − a heartbeat interval, to lease + fence margin + a reconcile interval",
            range_text(b.detection_min_s, b.detection_max_s),
        ),
        (
            "… when a large share of the fleet is lost at once",
            "recovery holds off for the mass-loss grace more (`--mass-loss-grace`)",
            format!("up to {}", seconds_text(b.detection_max_mass_loss_s)),
        ),
        (
            "a running durable home is saved",
            "`--save-interval` (a sandbox may ask within `--save-interval-min` and `--save-interval-max`)",
            format!(
                "{} ({} to {})",
                seconds_text(c.save_interval_s),
                seconds_text(c.save_interval_min_s),
                seconds_text(c.save_interval_max_s)
            ),
        ),
        (
            "the most recent work a host failure can lose (durable, saves succeeding)",
            "save interval + 2 × the longest recent save",
            loss,
        ),
        (
            "a stop waits for the workload before it kills it (SIGTERM, then SIGKILL)",
            "`--stop-grace`",
            seconds_text(c.stop_grace_s),
        ),
    ];
    let mut out = format!("| what | when | {value_header} |\n|---|---|---|\n");
    for (what, when, value) in rows {
        let _ = writeln!(out, "| {what} | {when} | {value} |");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_nearest_rank_percentiles() {
        let none = Figure::of(Vec::new());
        assert_eq!(none, Figure::default());
        let one = Figure::of(vec![2.0]);
        assert_eq!((one.count, one.p50_s, one.max_s), (1, Some(2.0), Some(2.0)));
        let hundred = Figure::of((1..=100).rev().map(f64::from).collect());
        assert_eq!(hundred.p50_s, Some(50.0));
        assert_eq!(hundred.p90_s, Some(90.0));
        assert_eq!(hundred.p99_s, Some(99.0));
        assert_eq!(hundred.max_s, Some(100.0));
        assert_eq!(Figure::of(vec![f64::NAN]).count, 0);
    }

    #[test]
    fn durations_print_short() {
        assert_eq!(seconds_text(9.0), "9 s");
        assert_eq!(seconds_text(7.5), "7.5 s");
        assert_eq!(seconds_text(0.25), "0.25 s");
        assert_eq!(seconds_text(86_400.0), "24 h");
        assert_eq!(seconds_text(300.0), "300 s");
        assert_eq!(range_text(10.0, 11.0), "10–11 s");
        assert_eq!(range_text(3.0, 3.0), "3 s");
    }
}
