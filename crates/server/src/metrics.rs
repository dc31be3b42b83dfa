//! Prometheus metrics, rendered in the text exposition format at
//! `/metrics`: requests and latency by route, quota rejections, lease
//! expiries, long-poll waiters; sandboxes by state are counted from the
//! records at scrape time (so every server reports the same fleet).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Latency histogram bucket bounds, in seconds.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Save durations, in seconds (a cold save of a large home takes minutes).
const SAVE_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Bytes, for uploads per save and downloads per wake.
const BYTE_BUCKETS: &[f64] = &[1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10];

/// A Prometheus histogram with fixed bounds.
struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, value: f64) {
        for (bound, count) in self.bounds.iter().zip(self.buckets.iter_mut()) {
            if value <= *bound {
                *count += 1;
            }
        }
        self.sum += value;
        self.count += 1;
    }

    /// The `_bucket`, `_sum` and `_count` lines of `name{labels}`.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bound, count) in self.bounds.iter().zip(&self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// Durable homes: what saves and wakes cost, as runners report them.
struct Homes {
    save_seconds: Histogram,
    snapshot_seconds: Histogram,
    save_uploaded_bytes: Histogram,
    /// Wakes on the runner that held the home before, and elsewhere.
    wake_bytes_same: Histogram,
    wake_bytes_other: Histogram,
}

impl Default for Homes {
    fn default() -> Homes {
        Homes {
            save_seconds: Histogram::new(SAVE_BUCKETS),
            snapshot_seconds: Histogram::new(BUCKETS),
            save_uploaded_bytes: Histogram::new(BYTE_BUCKETS),
            wake_bytes_same: Histogram::new(BYTE_BUCKETS),
            wake_bytes_other: Histogram::new(BYTE_BUCKETS),
        }
    }
}

/// How far behind the running durable homes' saves are, read from the
/// records at scrape time (so every server reports the same).
pub struct SaveLag {
    /// The longest time since a running durable sandbox's last completed
    /// save (since its creation before the first), in seconds.
    pub max_seconds: f64,
    /// Running durable sandboxes with no save within twice their interval.
    pub delayed: i64,
}

#[derive(Default)]
struct Route {
    by_status: BTreeMap<u16, u64>,
    buckets: Vec<u64>,
    sum_seconds: f64,
    count: u64,
}

#[derive(Default)]
pub struct Metrics {
    /// Client connections open now, and the most served at once.
    connections_open: AtomicU64,
    connections_max: AtomicU64,
    /// By route, then method: looked up by borrowed strings, so counting a
    /// request allocates nothing once its route has been seen.
    routes: Mutex<BTreeMap<String, BTreeMap<String, Route>>>,
    quota_rejections: Mutex<BTreeMap<String, u64>>,
    lease_expiries: AtomicU64,
    lease_holds: AtomicU64,
    /// Runners' assignments long-polls answered by reading the set, and
    /// answered `unchanged` without reading it.
    assignment_reads: AtomicU64,
    assignments_unchanged: AtomicU64,
    /// The lease watcher's passes on this server: the last one's and the
    /// longest one's duration, in microseconds.
    lease_watch_last_us: AtomicU64,
    lease_watch_max_us: AtomicU64,
    block_bytes_in: AtomicU64,
    block_bytes_out: AtomicU64,
    block_objects_in: AtomicU64,
    block_objects_out: AtomicU64,
    homes: Mutex<Homes>,
    idle: Mutex<Idle>,
    /// The gauges read from the records, with when they were read: one
    /// read a [`FLEET_GAUGES_MAX_AGE`] at most, however often `/metrics`
    /// (which anyone may ask for) is scraped; a scrape meanwhile waits for
    /// the read under way and takes its answer.
    fleet: tokio::sync::Mutex<Option<(Instant, Arc<FleetGauges>)>>,
}

/// Distinct reasons `roost_sleeps_total` labels (the rest are `other`).
pub const SLEEP_REASONS_MAX: usize = 16;

/// How old the gauges read from the records may be when served.
pub const FLEET_GAUGES_MAX_AGE: Duration = Duration::from_secs(1);

/// What `/metrics` reads from the records (every server reports the same).
pub struct FleetGauges {
    pub sandboxes: Vec<(String, i64)>,
    pub lag: SaveLag,
    pub at_risk_s: f64,
}

impl Metrics {
    /// The fleet's gauges: read by `read` when those held are older than
    /// [`FLEET_GAUGES_MAX_AGE`] (or there are none), else those held.
    pub async fn fleet_gauges<F, Fut, E>(&self, read: F) -> Result<Arc<FleetGauges>, E>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<FleetGauges, E>>,
    {
        self.fleet_gauges_within(FLEET_GAUGES_MAX_AGE, read).await
    }

    async fn fleet_gauges_within<F, Fut, E>(
        &self,
        max_age: Duration,
        read: F,
    ) -> Result<Arc<FleetGauges>, E>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<FleetGauges, E>>,
    {
        let mut held = self.fleet.lock().await;
        if let Some((at, gauges)) = held.as_ref()
            && at.elapsed() < max_age
        {
            return Ok(gauges.clone());
        }
        let gauges = Arc::new(read().await?);
        *held = Some((Instant::now(), gauges.clone()));
        Ok(gauges)
    }
}

/// Sleeping and waking (README "Idle sandboxes").
struct Idle {
    /// Sandboxes come to rest `stopped`, by the reason of that state.
    sleeps: BTreeMap<String, u64>,
    /// Wakes, by what woke the sandbox.
    wakes: BTreeMap<String, u64>,
    /// Sleep decisions this server took.
    decisions: u64,
    /// From a command sent to a sleeping sandbox to the command started.
    wake_seconds: Histogram,
}

impl Default for Idle {
    fn default() -> Idle {
        Idle {
            sleeps: BTreeMap::new(),
            wakes: BTreeMap::new(),
            decisions: 0,
            wake_seconds: Histogram::new(BUCKETS),
        }
    }
}

/// The label of a request's method: the methods the API answers by name,
/// any other `other`. hyper takes any token as a method, and a request is
/// counted before it is authenticated: a label per method would let anyone
/// grow the server's memory (and every scrape) one request at a time.
fn method_label(method: &str) -> &str {
    match method {
        "GET" | "HEAD" | "POST" | "PUT" | "PATCH" | "DELETE" | "OPTIONS" => method,
        _ => "other",
    }
}

/// A client connection, counted open while it lives.
pub struct OpenConnection(std::sync::Arc<Metrics>);

impl OpenConnection {
    pub fn new(metrics: std::sync::Arc<Metrics>) -> OpenConnection {
        metrics.connections_open.fetch_add(1, Ordering::Relaxed);
        OpenConnection(metrics)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connections_open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Metrics {
    pub fn set_connections_max(&self, max: usize) {
        self.connections_max.store(max as u64, Ordering::Relaxed);
    }

    pub fn observe_request(&self, method: &str, route: &str, status: u16, elapsed: Duration) {
        let method = method_label(method);
        let mut routes = self
            .routes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !routes.contains_key(route) {
            routes.insert(route.to_owned(), BTreeMap::new());
        }
        let Some(methods) = routes.get_mut(route) else {
            return;
        };
        if !methods.contains_key(method) {
            methods.insert(method.to_owned(), Route::default());
        }
        let Some(entry) = methods.get_mut(method) else {
            return;
        };
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

    /// Objects and their stored bytes through the block service: "in"
    /// (uploads) or "out".
    pub fn block_transfer(&self, direction: &str, objects: u64, bytes: u64) {
        let (object_counter, byte_counter) = if direction == "in" {
            (&self.block_objects_in, &self.block_bytes_in)
        } else {
            (&self.block_objects_out, &self.block_bytes_out)
        };
        object_counter.fetch_add(objects, Ordering::Relaxed);
        byte_counter.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn lease_expired(&self) {
        self.lease_expiries.fetch_add(1, Ordering::Relaxed);
    }

    /// A runner's assignments were read (`true`) or answered `unchanged`
    /// without a read (`false`).
    pub fn assignments_answered(&self, read: bool) {
        let counter = if read {
            &self.assignment_reads
        } else {
            &self.assignments_unchanged
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn homes(&self) -> std::sync::MutexGuard<'_, Homes> {
        self.homes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A completed save: capture to commit, the snapshot's duration (a
    /// running home's), and the stored bytes it uploaded.
    pub fn save_completed(
        &self,
        took: Duration,
        snapshot_ms: Option<f64>,
        uploaded_bytes: Option<u64>,
    ) {
        let mut homes = self.homes();
        homes.save_seconds.observe(took.as_secs_f64());
        if let Some(ms) = snapshot_ms {
            homes.snapshot_seconds.observe(ms / 1000.0);
        }
        if let Some(bytes) = uploaded_bytes {
            homes.save_uploaded_bytes.observe(bytes as f64);
        }
    }

    /// A durable home woken: the stored bytes that came down, on the
    /// runner that held it before (`same`) or on another.
    pub fn woke(&self, downloaded_bytes: u64, same: bool) {
        let mut homes = self.homes();
        let histogram = if same {
            &mut homes.wake_bytes_same
        } else {
            &mut homes.wake_bytes_other
        };
        histogram.observe(downloaded_bytes as f64);
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A sandbox came to rest `stopped` for `reason` (`idle`, …). The
    /// reason is what a runner reported: a label only if it is a word of
    /// `a-z _` and one of the first [`SLEEP_REASONS_MAX`] seen, else
    /// `other`, so no runner can grow the metrics without end.
    pub fn slept(&self, reason: &str) {
        let mut idle = self.idle();
        let word = !reason.is_empty()
            && reason.len() <= 64
            && reason.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
        let label = if word
            && (idle.sleeps.contains_key(reason) || idle.sleeps.len() < SLEEP_REASONS_MAX)
        {
            reason
        } else {
            "other"
        };
        *idle.sleeps.entry(label.to_owned()).or_default() += 1;
    }

    /// A sandbox was woken by `trigger` (`command`).
    pub fn woken(&self, trigger: &str) {
        *self.idle().wakes.entry(trigger.to_owned()).or_default() += 1;
    }

    /// This server decided a sandbox goes to sleep.
    pub fn idle_decided(&self) {
        self.idle().decisions += 1;
    }

    /// A command that woke (or waited for the wake of) its sandbox started
    /// `seconds` after it was sent.
    pub fn wake_latency(&self, seconds: f64) {
        self.idle().wake_seconds.observe(seconds);
    }

    /// A lease watcher pass took `elapsed`.
    pub fn lease_watched(&self, elapsed: Duration) {
        let us = elapsed.as_micros().min(u128::from(u64::MAX)) as u64;
        self.lease_watch_last_us.store(us, Ordering::Relaxed);
        self.lease_watch_max_us.fetch_max(us, Ordering::Relaxed);
    }

    /// A lease watcher pass held off recovery: too much of the fleet lost
    /// its lease at once.
    pub fn lease_held(&self) {
        self.lease_holds.fetch_add(1, Ordering::Relaxed);
    }

    /// The exposition text; `sandboxes` are (state, count) from the records.
    /// `at_risk_s`: the fleet's worst `save.at_risk_s`, from the records.
    pub fn render(
        &self,
        sandboxes: &[(String, i64)],
        waiters: usize,
        lag: &SaveLag,
        at_risk_s: f64,
    ) -> String {
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
        for (route, method, r) in routes
            .iter()
            .flat_map(|(route, methods)| methods.iter().map(move |(method, r)| (route, method, r)))
        {
            for (status, count) in &r.by_status {
                let _ = writeln!(
                    out,
                    "roost_http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} {count}"
                );
            }
        }
        for (name, help, value) in [
            (
                "roost_http_connections_open",
                "Client connections open on this server.",
                &self.connections_open,
            ),
            (
                "roost_http_connections_max",
                "The most client connections this server serves at once (--max-connections, within its open files limit).",
                &self.connections_max,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP roost_http_request_duration_seconds Time to answer, by route."
        );
        let _ = writeln!(out, "# TYPE roost_http_request_duration_seconds histogram");
        for (route, method, r) in routes
            .iter()
            .flat_map(|(route, methods)| methods.iter().map(move |(method, r)| (route, method, r)))
        {
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
            "# HELP roost_runner_assignments_total Runners' assignments long-polls by how they were answered: `read` (the set read from the records) or `unchanged` (nothing written to the set or its records since this server last read it: no read)."
        );
        let _ = writeln!(out, "# TYPE roost_runner_assignments_total counter");
        for (answer, counter) in [
            ("read", &self.assignment_reads),
            ("unchanged", &self.assignments_unchanged),
        ] {
            let _ = writeln!(
                out,
                "roost_runner_assignments_total{{answer=\"{answer}\"}} {}",
                counter.load(Ordering::Relaxed)
            );
        }
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
        for (name, help, value) in [
            (
                "roost_lease_watch_last_seconds",
                "How long this server's last lease watcher pass took.",
                &self.lease_watch_last_us,
            ),
            (
                "roost_lease_watch_max_seconds",
                "The longest lease watcher pass this server ran.",
                &self.lease_watch_max_us,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed) as f64 / 1e6);
        }
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
            "# HELP roost_block_objects_total Objects through the block service (a batch counts each)."
        );
        let _ = writeln!(out, "# TYPE roost_block_objects_total counter");
        for (direction, counter) in [
            ("in", &self.block_objects_in),
            ("out", &self.block_objects_out),
        ] {
            let _ = writeln!(
                out,
                "roost_block_objects_total{{direction=\"{direction}\"}} {}",
                counter.load(Ordering::Relaxed)
            );
        }
        let homes = self.homes();
        for (name, help, histogram) in [
            (
                "roost_save_duration_seconds",
                "Completed saves of durable homes, from capture to commit.",
                &homes.save_seconds,
            ),
            (
                "roost_save_snapshot_seconds",
                "The snapshot of a running home at each save: the most its workload could be held up.",
                &homes.snapshot_seconds,
            ),
            (
                "roost_save_uploaded_bytes",
                "Stored bytes each completed save uploaded.",
                &homes.save_uploaded_bytes,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} histogram");
            histogram.render(&mut out, name, "");
        }
        let _ = writeln!(
            out,
            "# HELP roost_wake_downloaded_bytes Stored bytes downloaded to wake a durable home, on the runner that held it before (same) or another."
        );
        let _ = writeln!(out, "# TYPE roost_wake_downloaded_bytes histogram");
        homes
            .wake_bytes_same
            .render(&mut out, "roost_wake_downloaded_bytes", "runner=\"same\"");
        homes
            .wake_bytes_other
            .render(&mut out, "roost_wake_downloaded_bytes", "runner=\"other\"");
        drop(homes);
        let idle = self.idle();
        let _ = writeln!(
            out,
            "# HELP roost_sleeps_total Sandboxes come to rest stopped, by state_reason (idle: went to sleep without activity; stop_requested: stopped by hand)."
        );
        let _ = writeln!(out, "# TYPE roost_sleeps_total counter");
        for (reason, count) in &idle.sleeps {
            let _ = writeln!(out, "roost_sleeps_total{{reason=\"{reason}\"}} {count}");
        }
        let _ = writeln!(
            out,
            "# HELP roost_wakes_total Stopped sandboxes woken, by what woke them."
        );
        let _ = writeln!(out, "# TYPE roost_wakes_total counter");
        for (trigger, count) in &idle.wakes {
            let _ = writeln!(out, "roost_wakes_total{{trigger=\"{trigger}\"}} {count}");
        }
        let _ = writeln!(
            out,
            "# HELP roost_idle_sleep_decisions_total Sleep decisions this server took at an idle deadline."
        );
        let _ = writeln!(out, "# TYPE roost_idle_sleep_decisions_total counter");
        let _ = writeln!(out, "roost_idle_sleep_decisions_total {}", idle.decisions);
        let _ = writeln!(
            out,
            "# HELP roost_wake_latency_seconds From a command sent to a sleeping sandbox to the command started."
        );
        let _ = writeln!(out, "# TYPE roost_wake_latency_seconds histogram");
        idle.wake_seconds
            .render(&mut out, "roost_wake_latency_seconds", "");
        drop(idle);
        let _ = writeln!(
            out,
            "# HELP roost_save_lag_seconds_max The longest time since a running durable home's last completed save."
        );
        let _ = writeln!(out, "# TYPE roost_save_lag_seconds_max gauge");
        let _ = writeln!(out, "roost_save_lag_seconds_max {}", lag.max_seconds);
        let _ = writeln!(
            out,
            "# HELP roost_saves_delayed Running durable homes with no completed save within twice their interval."
        );
        let _ = writeln!(out, "# TYPE roost_saves_delayed gauge");
        let _ = writeln!(out, "roost_saves_delayed {}", lag.delayed);
        let _ = writeln!(
            out,
            "# HELP roost_save_at_risk_seconds_max The most work a host failure would cost a durable home now: the largest save.at_risk_s across the fleet."
        );
        let _ = writeln!(out, "# TYPE roost_save_at_risk_seconds_max gauge");
        let _ = writeln!(out, "roost_save_at_risk_seconds_max {at_risk_s}");
        let _ = writeln!(
            out,
            "# HELP roost_long_poll_waiters Requests waiting in a long-poll."
        );
        let _ = writeln!(out, "# TYPE roost_long_poll_waiters gauge");
        let _ = writeln!(out, "roost_long_poll_waiters {waiters}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Audit finding: a runner chose the reason each sleep was counted
    /// under, one label each: a loop of reports grew the metrics (and
    /// every scrape) without end.
    #[test]
    fn sleep_reasons_are_few_words() {
        let metrics = Metrics::default();
        metrics.slept("idle");
        for n in 0..1000u32 {
            // Words of letters: "r" and the number's digits as a-j.
            let word: String = n
                .to_string()
                .bytes()
                .map(|digit| char::from(b'a' + digit - b'0'))
                .collect();
            metrics.slept(&format!("r_{word}"));
        }
        metrics.slept("bad\nreason");
        metrics.slept("idle");
        let idle = metrics.idle();
        assert_eq!(idle.sleeps.len(), SLEEP_REASONS_MAX + 1, "and other");
        assert_eq!(idle.sleeps["idle"], 2);
        assert_eq!(
            idle.sleeps["other"],
            1000 - (SLEEP_REASONS_MAX as u64 - 1) + 1
        );
    }

    /// Audit finding: a request with a method of its own added a series
    /// (and kept its name) for good, before any token was checked.
    #[test]
    fn methods_past_the_apis_own_are_counted_as_other() {
        let metrics = Metrics::default();
        for n in 0..500 {
            let method = format!("X{n}{}", "A".repeat(1000));
            metrics.observe_request(&method, "unmatched", 405, Duration::from_millis(1));
        }
        metrics.observe_request("GET", "unmatched", 404, Duration::from_millis(1));
        let routes = metrics.routes.lock().expect("routes");
        let methods = &routes["unmatched"];
        assert_eq!(methods.keys().collect::<Vec<_>>(), ["GET", "other"]);
        assert_eq!(methods["other"].count, 500);
    }

    /// Audit finding: every scrape of `/metrics`, which needs no token,
    /// scanned the fleet's records. Scrapes within a second, at once or
    /// one after the other, share one read.
    #[tokio::test]
    async fn scrapes_within_a_second_share_one_read_of_the_records() {
        let metrics = Metrics::default();
        let reads = AtomicUsize::new(0);
        let read = || async {
            reads.fetch_add(1, Ordering::SeqCst);
            // Slow enough that the scrapes below overlap it.
            tokio::task::yield_now().await;
            Ok::<_, ()>(FleetGauges {
                sandboxes: vec![("running".to_owned(), 3)],
                lag: SaveLag {
                    max_seconds: 0.0,
                    delayed: 0,
                },
                at_risk_s: 0.0,
            })
        };
        // An hour for "a second": the machine's pace does not matter.
        let hour = Duration::from_secs(3600);
        let scrapes =
            futures::future::join_all((0..50).map(|_| metrics.fleet_gauges_within(hour, read)))
                .await;
        assert!(
            scrapes
                .iter()
                .all(|g| g.as_ref().is_ok_and(|g| g.sandboxes[0].1 == 3))
        );
        metrics.fleet_gauges_within(hour, read).await.expect("held");
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        // Past the age, read again.
        metrics
            .fleet_gauges_within(Duration::ZERO, read)
            .await
            .expect("read again");
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }
}
