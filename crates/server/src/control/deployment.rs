//! What the running deployment promises (`GET /v1/deployment`): its live
//! configuration, the bounds that follow from it (each with its formula in
//! `api::deployment`'s field descriptions), and what its own records
//! observed over a window. [`of_config`] is pure, so README's host-failure
//! table is rendered from exactly what the API answers (a test compares).

use std::time::Duration;

use super::AppState;
use crate::Config;
use crate::db::now_ms;
use crate::error::ControlError;
use crate::records::observed;
use api::deployment::{
    AfterHostLoss, Bounds, Configured, Deployment, Figure, Observed, StoreLocation,
};
use api::lifecycle::CommandState;

/// How far back the observed figures look (saves older than this are
/// forgotten by the reconciler).
pub const OBSERVED_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// The most saves, and sandboxes' histories, one answer reads: the newest
/// ones, so the cost of an answer does not grow with the fleet.
const OBSERVATIONS_MAX: usize = 10_000;
const HISTORIES_MAX: usize = 1_000;

/// The deployment as `config` makes it, with `observed` figures.
pub fn of_config(config: &Config, observed: Observed) -> Deployment {
    let configured = configured(config);
    let bounds = bounds(&configured, observed.save_duration.max_s);
    Deployment {
        configured,
        store: store_location(config.store_url.as_deref()),
        bounds,
        after_host_loss: after_host_loss(),
        observed,
    }
}

/// Nothing observed yet (and the window it would cover).
pub fn nothing_observed() -> Observed {
    Observed {
        window_s: OBSERVED_WINDOW.as_secs_f64(),
        save_duration: Figure::default(),
        save_lag: Figure::default(),
        host_loss_to_running: Figure::default(),
        wake_same_runner: Figure::default(),
        wake_other_runner: Figure::default(),
    }
}

/// The answer of `GET /v1/deployment`: the live configuration and the
/// records of the last [`OBSERVED_WINDOW`].
pub async fn deployment(state: &AppState) -> Result<Deployment, ControlError> {
    let observed = observe(state).await?;
    Ok(of_config(&state.config, observed))
}

fn configured(config: &Config) -> Configured {
    let lease = config.lease_ttl;
    let freeze_after = crate::freeze_after(lease);
    Configured {
        save_interval_s: config.save_interval.as_secs_f64(),
        save_interval_min_s: config.save_interval_min.as_secs_f64(),
        save_interval_max_s: config.save_interval_max.as_secs_f64(),
        idle_timeout_s: config.idle_timeout.as_secs_f64(),
        idle_timeout_min_s: config.idle_timeout_min.as_secs_f64(),
        idle_timeout_max_s: config.idle_timeout_max.as_secs_f64(),
        lease_ttl_s: lease.as_secs_f64(),
        // What `register` answers runners.
        heartbeat_interval_s: (lease / 3).as_secs_f64(),
        freeze_after_s: freeze_after.as_secs_f64(),
        // The runner's rule for its inits' deadline (`agent::fence`):
        // halfway from its freeze to the lease's end.
        init_stop_after_s: (freeze_after + (lease - freeze_after) / 2).as_secs_f64(),
        fence_margin_s: config.fence_margin.as_secs_f64(),
        reconcile_interval_s: config.reconcile_interval.as_secs_f64(),
        mass_loss_threshold: config.mass_loss_threshold,
        mass_loss_grace_s: config.mass_loss_grace.as_secs_f64(),
        stop_grace_s: config.stop_grace.as_secs_f64(),
        retention_s: config.retention.as_secs_f64(),
        fleet_max_running: config.fleet_max_running,
    }
}

/// The formulas stated in `api::deployment::Bounds`.
fn bounds(c: &Configured, longest_save_s: Option<f64>) -> Bounds {
    let longest_save_s = longest_save_s.unwrap_or(0.0);
    let declared = c.lease_ttl_s + c.fence_margin_s;
    let detection_max_s = declared + c.reconcile_interval_s;
    Bounds {
        durable_loss_max_s: c.save_interval_s + 2.0 * longest_save_s,
        longest_save_s,
        detection_min_s: (declared - c.heartbeat_interval_s).max(0.0),
        detection_max_s,
        detection_max_mass_loss_s: detection_max_s + c.mass_loss_grace_s,
    }
}

fn after_host_loss() -> AfterHostLoss {
    AfterHostLoss {
        commands_rerun: false,
        command_states: vec![
            CommandState::InfrastructureLost,
            CommandState::Unknown,
            CommandState::NotLaunched,
        ],
        durable: "recovering (node_lost): placed on another runner, its home restored from the last completed save; the workload starts again from its image, no command reruns".to_owned(),
        standard: "failed (node_lost): the home was on the lost host; only snapshots survive".to_owned(),
    }
}

/// Where the store is, from `--store` and, for S3, the endpoint the
/// store's client reads from the environment. Only the endpoint's host is
/// shown, never credentials or a path.
fn store_location(url: Option<&str>) -> StoreLocation {
    let none = |kind: &str| StoreLocation {
        kind: kind.to_owned(),
        endpoint_host: None,
        bucket: None,
        independent_of_runners: false,
    };
    let Some(url) = url else {
        return none("none");
    };
    if url == "memory:" {
        return none("memory");
    }
    let Some(rest) = url.strip_prefix("s3://") else {
        return none("local");
    };
    let bucket = rest.split('/').next().unwrap_or_default().to_owned();
    let endpoint = ["AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
        .iter()
        .find_map(|name| std::env::var(name).ok())
        .filter(|value| !value.is_empty());
    let host = match &endpoint {
        Some(endpoint) => endpoint_host(endpoint),
        None => "s3.amazonaws.com".to_owned(),
    };
    StoreLocation {
        kind: "s3".to_owned(),
        independent_of_runners: !is_loopback(&host),
        endpoint_host: Some(host),
        bucket: Some(bucket),
    }
}

/// `http://user:secret@host:port/path` → `host:port`.
fn endpoint_host(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
        .to_owned()
}

/// A store on this machine's loopback shares a host with the server (and
/// whatever runs there).
fn is_loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified())
}

/// The figures of the last [`OBSERVED_WINDOW`], from the saves' history
/// and the events.
async fn observe(state: &AppState) -> Result<Observed, ControlError> {
    let since = now_ms() - OBSERVED_WINDOW.as_millis() as i64;
    let seconds = |ms: i64| ms.max(0) as f64 / 1000.0;
    let saves = observed::saves_since(&state.db.pool, since, OBSERVATIONS_MAX).await?;
    let durations = saves
        .iter()
        .map(|s| seconds(s.completed_at_ms - s.captured_at_ms))
        .collect();
    let lags = saves
        .iter()
        .filter_map(|s| Some(seconds(s.completed_at_ms - s.previous_captured_at_ms?)))
        .collect();
    let histories = observed::running_histories(&state.db.pool, since, HISTORIES_MAX).await?;
    let timings = observed::timings(&histories, since);
    let figure = |ms: Vec<i64>| Figure::of(ms.into_iter().map(seconds).collect());
    Ok(Observed {
        save_duration: Figure::of(durations),
        save_lag: Figure::of(lags),
        host_loss_to_running: figure(timings.recoveries_ms),
        wake_same_runner: figure(timings.wakes_same_ms),
        wake_other_runner: figure(timings.wakes_other_ms),
        ..nothing_observed()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_says_where_it_is_and_never_a_secret() {
        let local = store_location(Some("/var/lib/roost/store"));
        assert_eq!(
            (local.kind.as_str(), local.independent_of_runners),
            ("local", false)
        );
        assert_eq!(store_location(None).kind, "none");
        assert_eq!(
            endpoint_host("https://key:secret@s3.example.com:9000/x"),
            "s3.example.com:9000"
        );
        assert_eq!(endpoint_host("http://127.0.0.1:39123"), "127.0.0.1:39123");
        assert!(is_loopback("127.0.0.1:39123"));
        assert!(is_loopback("localhost"));
        assert!(is_loopback("[::1]:9000"));
        assert!(!is_loopback("s3.example.com:9000"));
        assert!(!is_loopback("10.0.0.5"));
    }

    #[test]
    fn the_bounds_follow_their_formulas() {
        let config = Config::new(
            "127.0.0.1:0".parse().expect("address"),
            std::path::PathBuf::from("/nonexistent"),
        );
        let deployment = of_config(&config, nothing_observed());
        let c = &deployment.configured;
        assert_eq!(
            (c.lease_ttl_s, c.heartbeat_interval_s, c.freeze_after_s),
            (9.0, 3.0, 6.0)
        );
        assert_eq!(c.init_stop_after_s, 7.5);
        let b = &deployment.bounds;
        assert_eq!((b.detection_min_s, b.detection_max_s), (7.0, 11.0));
        assert_eq!(b.detection_max_mass_loss_s, 131.0);
        assert_eq!(b.durable_loss_max_s, 300.0);
        let observed = Observed {
            save_duration: Figure::of(vec![1.0, 4.0]),
            ..nothing_observed()
        };
        assert_eq!(
            of_config(&config, observed).bounds.durable_loss_max_s,
            308.0
        );
    }
}
