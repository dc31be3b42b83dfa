//! Long-poll wake-ups. A waiter registers interest in a key (a sandbox,
//! command or runner id) before reading the record, then sleeps until the
//! key is notified or its timeout passes. On PostgreSQL every write also
//! sends `NOTIFY`, and a listener task turns notifications from any server
//! into local wake-ups, so a waiter on server A wakes for a write on B.
//! Nothing here is needed for correctness: a missed wake-up costs latency
//! (the waiter still answers at its timeout), never a wrong answer.
//!
//! The hub also counts every notification it sees ([`Hub::changes`]), so a
//! long-poll can tell that nothing at all was written since it last read
//! ([`Hub::remember`], [`Hub::unchanged_since`]): the runners' assignments
//! long-poll then answers "unchanged" without reading, and a fleet at rest
//! costs no reads of its sandboxes. That trusts notifications, so it holds
//! only while they are complete (always with one server; on PostgreSQL
//! while the listener is connected) and for [`UNCHANGED_FOR_AT_MOST`]:
//! past it the record is read again whatever the count says.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

pub const PG_CHANNEL: &str = "roost_changes";

/// The key woken by a change to any sandbox (its own key starts with
/// `sbx_`), whatever its org: list waiters re-read and compare.
pub const ANY_SANDBOX: &str = "sandboxes:any";
const SANDBOX_ID_PREFIX: &str = "sbx_";

/// How long an answer remembered by [`Hub::remember`] may stand in for a
/// read: a write whose commit notified nothing at all (none is known; every
/// change of a record wakes its own key) is seen at most this late.
pub const UNCHANGED_FOR_AT_MOST: Duration = Duration::from_secs(300);

#[derive(Clone)]
pub struct Hub {
    inner: Arc<Mutex<HashMap<String, Watched>>>,
    /// Notifications seen, of any key, from any server.
    changes: Arc<AtomicU64>,
    /// Whether every write of every server is notified here: false while
    /// the PostgreSQL listener is not connected.
    complete: Arc<AtomicBool>,
    remembered: Arc<Mutex<RememberedAnswers>>,
}

/// Answers by key, and when entries past [`UNCHANGED_FOR_AT_MOST`] were
/// last dropped (at most once per that period: a fleet's every read must
/// not walk every runner's entry).
struct RememberedAnswers {
    by_key: HashMap<String, Remembered>,
    pruned_at: Instant,
}

impl Default for Hub {
    fn default() -> Hub {
        Hub {
            inner: Arc::default(),
            changes: Arc::default(),
            complete: Arc::new(AtomicBool::new(true)),
            remembered: Arc::new(Mutex::new(RememberedAnswers {
                by_key: HashMap::new(),
                pruned_at: Instant::now(),
            })),
        }
    }
}

/// An answer given for a key, and the notification count before the read
/// it came from.
struct Remembered {
    answer: String,
    changes: u64,
    at: Instant,
}

struct Watched {
    notify: Arc<Notify>,
    waiters: usize,
}

/// Interest in one key; dropping it unregisters.
pub struct Watch {
    hub: Hub,
    key: String,
    pub notify: Arc<Notify>,
}

impl Hub {
    pub fn watch(&self, key: &str) -> Watch {
        let mut map = self.lock();
        let entry = map.entry(key.to_owned()).or_insert_with(|| Watched {
            notify: Arc::new(Notify::new()),
            waiters: 0,
        });
        entry.waiters += 1;
        Watch {
            hub: self.clone(),
            key: key.to_owned(),
            notify: entry.notify.clone(),
        }
    }

    pub fn notify(&self, key: &str) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        let map = self.lock();
        if let Some(watched) = map.get(key) {
            watched.notify.notify_waiters();
        }
        // A change to any sandbox also wakes lists that watch for changes
        // (`GET /v1/sandboxes` with `If-None-Match`): they re-read their
        // page and answer only if it differs.
        if key.starts_with(SANDBOX_ID_PREFIX)
            && let Some(watched) = map.get(ANY_SANDBOX)
        {
            watched.notify.notify_waiters();
        }
    }

    /// After notifications may have been lost (a listener reconnect).
    pub fn notify_all(&self) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        for watched in self.lock().values() {
            watched.notify.notify_waiters();
        }
    }

    /// The notification count: take it before a read, then
    /// [`Hub::remember`] the answer with it.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// Whether notifications from every server reach this hub (see
    /// [`listen_postgres`]).
    pub fn set_complete(&self, complete: bool) {
        self.complete.store(complete, Ordering::SeqCst);
        if !complete {
            self.changes.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Keeps `answer` (an ETag) as what `key` read when the count was
    /// `changes`.
    pub fn remember(&self, key: &str, answer: &str, changes: u64) {
        let mut remembered = self.remembered();
        let now = Instant::now();
        // Bounded by the keys answered lately (one per runner).
        if now.duration_since(remembered.pruned_at) >= UNCHANGED_FOR_AT_MOST {
            remembered
                .by_key
                .retain(|_, r| now.duration_since(r.at) < UNCHANGED_FOR_AT_MOST);
            remembered.pruned_at = now;
        }
        remembered.by_key.insert(
            key.to_owned(),
            Remembered {
                answer: answer.to_owned(),
                changes,
                at: now,
            },
        );
    }

    /// Whether a read of `key` would still answer `answer`: it was the
    /// answer remembered, no notification of any key arrived since the read
    /// it came from, notifications are complete, and it is recent enough.
    pub fn unchanged_since(&self, key: &str, answer: &str) -> bool {
        if answer.is_empty() || !self.complete.load(Ordering::SeqCst) {
            return false;
        }
        self.remembered().by_key.get(key).is_some_and(|r| {
            r.answer == answer
                && r.changes == self.changes()
                && r.at.elapsed() < UNCHANGED_FOR_AT_MOST
        })
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, RememberedAnswers> {
        self.remembered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn waiters(&self) -> usize {
        self.lock().values().map(|w| w.waiters).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watched>> {
        // A panic while holding this lock cannot leave the map inconsistent
        // (every update is one statement), so poisoning is ignored.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut map = self.hub.lock();
        if let Some(watched) = map.get_mut(&self.key) {
            watched.waiters -= 1;
            if watched.waiters == 0 {
                map.remove(&self.key);
            }
        }
    }
}

/// Waits on `watch` until `ready` returns a value or `timeout` passes, in
/// which case the last value read is returned. `read` is called first,
/// after registering, so no change between read and sleep is missed.
pub async fn wait_until<T, E, F, Fut>(
    watch: &Watch,
    timeout: Duration,
    mut read: F,
    ready: impl Fn(&T) -> bool,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let notified = watch.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // Boxed: the database read's future is large and lives only while
        // it runs; inline, every sleeping waiter would carry its size.
        let value = Box::pin(read()).await?;
        if ready(&value) || tokio::time::Instant::now() >= deadline {
            return Ok(value);
        }
        tokio::select! {
            () = &mut notified => {}
            () = tokio::time::sleep_until(deadline) => {}
        }
    }
}

/// Forwards PostgreSQL notifications from every server to local waiters.
/// The hub counts as complete only while LISTEN is in effect; a lost
/// connection is reconnected from scratch (never silently), and everything
/// is woken once it listens again.
pub async fn listen_postgres(url: String, hub: Hub) {
    loop {
        hub.set_complete(false);
        match sqlx::postgres::PgListener::connect(&url).await {
            Ok(mut listener) => {
                if let Err(err) = listener.listen(PG_CHANNEL).await {
                    tracing::warn!(%err, "LISTEN failed");
                } else {
                    hub.set_complete(true);
                    // Anything written while we were not listening.
                    hub.notify_all();
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(notification)) => hub.notify(notification.payload()),
                            Ok(None) => {
                                tracing::warn!("notification connection lost; reconnecting");
                                break;
                            }
                            Err(err) => {
                                tracing::warn!(%err, "notification listener failed");
                                break;
                            }
                        }
                    }
                }
            }
            Err(err) => tracing::warn!(%err, "cannot connect the notification listener"),
        }
        hub.set_complete(false);
        hub.notify_all();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_stands_only_while_nothing_at_all_was_notified_and_notifications_are_complete() {
        let hub = Hub::default();
        assert!(!hub.unchanged_since("runner:a", "e1"), "nothing remembered");
        hub.remember("runner:a", "e1", hub.changes());
        assert!(hub.unchanged_since("runner:a", "e1"));
        assert!(!hub.unchanged_since("runner:a", "e0"), "another answer");
        assert!(!hub.unchanged_since("runner:a", ""), "no answer");
        assert!(!hub.unchanged_since("runner:b", "e1"), "another key");
        // A write to anything, for anyone, since.
        hub.notify("sbx_other");
        assert!(!hub.unchanged_since("runner:a", "e1"));
        // A read that began before a notification is not trusted after it.
        let before = hub.changes();
        hub.notify("cmd_x");
        hub.remember("runner:a", "e2", before);
        assert!(!hub.unchanged_since("runner:a", "e2"));
        hub.remember("runner:a", "e2", hub.changes());
        assert!(hub.unchanged_since("runner:a", "e2"));
        // Notifications that may be missing (a PostgreSQL listener down).
        hub.set_complete(false);
        assert!(!hub.unchanged_since("runner:a", "e2"));
        hub.set_complete(true);
        assert!(
            !hub.unchanged_since("runner:a", "e2"),
            "the gap is a change"
        );
        hub.remember("runner:a", "e2", hub.changes());
        hub.notify_all();
        assert!(!hub.unchanged_since("runner:a", "e2"));
    }
}
