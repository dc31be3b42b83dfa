//! Prometheus metrics, rendered in the text exposition format at
//! `/metrics`: requests and latency by route, quota rejections, lease
//! expiries, long-poll waiters; sandboxes by state are counted from the
//! records at scrape time (so every server reports the same fleet).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Latency histogram bucket bounds, in seconds.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Default)]
struct Route {
    by_status: BTreeMap<u16, u64>,
    buckets: Vec<u64>,
    sum_seconds: f64,
    count: u64,
}

#[derive(Default)]
pub struct Metrics {
    routes: Mutex<BTreeMap<(String, String), Route>>,
    quota_rejections: Mutex<BTreeMap<String, u64>>,
    lease_expiries: AtomicU64,
    lease_holds: AtomicU64,
    block_bytes_in: AtomicU64,
    block_bytes_out: AtomicU64,
}

impl Metrics {
    pub fn observe_request(&self, method: &str, route: &str, status: u16, elapsed: Duration) {
        let mut routes = self
            .routes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = routes
            .entry((method.to_owned(), route.to_owned()))
            .or_default();
        if entry.buckets.is_empty() {
            entry.buckets = vec![0; BUCKETS.len()];
        }
        *entry.by_status.entry(status).or_default() += 1;
        let seconds = elapsed.as_secs_f64();
        for (bound, count) in BUCKETS.iter().zip(entry.buckets.iter_mut()) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        entry.sum_seconds += seconds;
        entry.count += 1;
    }

    pub fn quota_rejected(&self, metric: &str) {
        *self
            .quota_rejections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(metric.to_owned())
            .or_default() += 1;
    }

    /// Stored bytes through the block service: "in" (uploads) or "out".
    pub fn block_bytes(&self, direction: &str, bytes: u64) {
        let counter = if direction == "in" {
            &self.block_bytes_in
        } else {
            &self.block_bytes_out
        };
        counter.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn lease_expired(&self) {
        self.lease_expiries.fetch_add(1, Ordering::Relaxed);
    }

    /// A lease watcher pass held off recovery: too much of the fleet lost
    /// its lease at once.
    pub fn lease_held(&self) {
        self.lease_holds.fetch_add(1, Ordering::Relaxed);
    }

    /// The exposition text; `sandboxes` are (state, count) from the records.
    pub fn render(&self, sandboxes: &[(String, i64)], waiters: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP roost_http_requests_total HTTP requests by route and status."
        );
        let _ = writeln!(out, "# TYPE roost_http_requests_total counter");
        let routes = self
            .routes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for ((method, route), r) in routes.iter() {
            for (status, count) in &r.by_status {
                let _ = writeln!(
                    out,
                    "roost_http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} {count}"
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP roost_http_request_duration_seconds Time to answer, by route."
        );
        let _ = writeln!(out, "# TYPE roost_http_request_duration_seconds histogram");
        for ((method, route), r) in routes.iter() {
            let labels = format!("method=\"{method}\",route=\"{route}\"");
            for (bound, count) in BUCKETS.iter().zip(&r.buckets) {
                let _ = writeln!(
                    out,
                    "roost_http_request_duration_seconds_bucket{{{labels},le=\"{bound}\"}} {count}"
                );
            }
            let _ = writeln!(
                out,
                "roost_http_request_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
                r.count
            );
            let _ = writeln!(
                out,
                "roost_http_request_duration_seconds_sum{{{labels}}} {}",
                r.sum_seconds
            );
            let _ = writeln!(
                out,
                "roost_http_request_duration_seconds_count{{{labels}}} {}",
                r.count
            );
        }
        drop(routes);
        let _ = writeln!(
            out,
            "# HELP roost_sandboxes Sandboxes by observed state (whole fleet)."
        );
        let _ = writeln!(out, "# TYPE roost_sandboxes gauge");
        for (state, count) in sandboxes {
            let _ = writeln!(out, "roost_sandboxes{{state=\"{state}\"}} {count}");
        }
        let _ = writeln!(
            out,
            "# HELP roost_quota_rejections_total Creates refused by a quota, by metric."
        );
        let _ = writeln!(out, "# TYPE roost_quota_rejections_total counter");
        for (metric, count) in self
            .quota_rejections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            let _ = writeln!(
                out,
                "roost_quota_rejections_total{{metric=\"{metric}\"}} {count}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP roost_lease_expiries_total Runner leases this server expired."
        );
        let _ = writeln!(out, "# TYPE roost_lease_expiries_total counter");
        let _ = writeln!(
            out,
            "roost_lease_expiries_total {}",
            self.lease_expiries.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP roost_lease_holds_total Lease watcher passes that held off recovery because a large share of the fleet lost its lease at once."
        );
        let _ = writeln!(out, "# TYPE roost_lease_holds_total counter");
        let _ = writeln!(
            out,
            "roost_lease_holds_total {}",
            self.lease_holds.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP roost_block_bytes_total Stored object bytes through the block service."
        );
        let _ = writeln!(out, "# TYPE roost_block_bytes_total counter");
        for (direction, counter) in [("in", &self.block_bytes_in), ("out", &self.block_bytes_out)] {
            let _ = writeln!(
                out,
                "roost_block_bytes_total{{direction=\"{direction}\"}} {}",
                counter.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP roost_long_poll_waiters Requests waiting in a long-poll."
        );
        let _ = writeln!(out, "# TYPE roost_long_poll_waiters gauge");
        let _ = writeln!(out, "roost_long_poll_waiters {waiters}");
        out
    }
}
