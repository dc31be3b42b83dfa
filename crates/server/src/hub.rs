//! Long-poll wake-ups. A waiter registers interest in a key (a sandbox,
//! command or runner id) before reading the record, then sleeps until the
//! key is notified or its timeout passes. On PostgreSQL every write also
//! sends `NOTIFY`, and a listener task turns notifications from any server
//! into local wake-ups, so a waiter on server A wakes for a write on B.
//! A missed wake-up costs latency (the waiter still answers at its
//! timeout), never a wrong answer.
//!
//! The hub also remembers what a runner's assignments long-poll answered
//! ([`Hub::remember`]) and what the answer was read from: the runner's key
//! and the key of every sandbox, command, snapshot and kept copy in it.
//! Every write of a record notifies the record's own key, and a write that
//! brings a new record into a runner's set (a placement, a new command,
//! snapshot or kept copy) notifies the runner's; so while none of those
//! keys was notified since the read began, a read would answer the same
//! ([`Hub::unchanged_since`]), and the long-poll waits, and answers
//! "unchanged" at its timeout, without reading: a fleet costs reads only
//! of the sets that change. A write that no such answer can be stale
//! for only wakes its key's waiters ([`Hub::wake`]; on PostgreSQL a
//! payload prefixed [`WAKE_ONLY_PREFIX`]): a command's hand-over, done by
//! the very read that answers it. A runner just registered is remembered with
//! the empty set's answer (nothing can name its new id before its
//! registration commits), and a poll of a set known empty is answered
//! without a read whatever ETag it brings: a fleet starting at once does
//! not read every runner's set in the seconds of its first heartbeats.
//! That trusts notifications, so it holds only while they are complete
//! (always with one server; on PostgreSQL while the listener is
//! connected) and for [`UNCHANGED_FOR_AT_MOST`]: past it the set is read
//! again whatever the hub saw.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

pub const PG_CHANNEL: &str = "roost_changes";

/// A NOTIFY payload that only wakes the key after it ([`Hub::wake`]).
pub const WAKE_ONLY_PREFIX: &str = "wake:";

/// The key woken by a change to any sandbox (its own key starts with
/// `sbx_`), whatever its org: list waiters re-read and compare.
pub const ANY_SANDBOX: &str = "sandboxes:any";
const SANDBOX_ID_PREFIX: &str = "sbx_";

/// How long an answer remembered by [`Hub::remember`] may stand in for a
/// read: a change to a runner's set that notified none of its keys (none
/// is known; `records` notifies where it writes) is seen at most this late.
pub const UNCHANGED_FOR_AT_MOST: Duration = Duration::from_secs(60);

/// How many keys' last notifications the hub keeps (each for twice
/// [`UNCHANGED_FOR_AT_MOST`]). Past it they are all forgotten at once, and
/// with them every answer remembered so far: memory stays bounded whatever
/// the write rate, at the cost of a read per runner.
const NOTIFIED_AT_MOST: usize = 200_000;

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

/// Answers by key, the count just after each key's last notification,
/// and when entries past their time were last dropped (at most once per
/// [`UNCHANGED_FOR_AT_MOST`]: a fleet's every read must not walk every
/// runner's entry).
struct RememberedAnswers {
    by_key: HashMap<String, Remembered>,
    notified: HashMap<String, Notified>,
    /// The count when every key may have changed (notifications lost, or
    /// `notified` forgotten).
    all_changed_at: u64,
    pruned_at: Instant,
}

struct Notified {
    changes: u64,
    at: Instant,
}

/// Where a read began: the notification count, and when.
#[derive(Clone, Copy, Debug)]
pub struct ReadStart {
    changes: u64,
    at: Instant,
}

/// An answer given for a key, the keys it was read from, and where the
/// read began.
struct Remembered {
    answer: String,
    read_from: Vec<String>,
    start: ReadStart,
}

impl RememberedAnswers {
    /// Drops answers past their time, and notifications twice as old:
    /// every answer read before one of those has expired already.
    fn prune(&mut self, now: Instant) {
        if now.duration_since(self.pruned_at) < UNCHANGED_FOR_AT_MOST {
            return;
        }
        self.by_key
            .retain(|_, r| now.duration_since(r.start.at) < UNCHANGED_FOR_AT_MOST);
        self.notified
            .retain(|_, n| now.duration_since(n.at) < 2 * UNCHANGED_FOR_AT_MOST);
        self.pruned_at = now;
    }
}

impl Default for Hub {
    fn default() -> Hub {
        Hub {
            inner: Arc::default(),
            changes: Arc::default(),
            complete: Arc::new(AtomicBool::new(true)),
            remembered: Arc::new(Mutex::new(RememberedAnswers {
                by_key: HashMap::new(),
                notified: HashMap::new(),
                all_changed_at: 0,
                pruned_at: Instant::now(),
            })),
        }
    }
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

    /// A write to `key`'s record: wakes its waiters, and no answer read
    /// from it before now stands (see [`Hub::unchanged_since`]).
    pub fn notify(&self, key: &str) {
        {
            // Counted under the lock: a check never sees the count moved
            // without the key's entry.
            let mut remembered = self.remembered();
            let changes = self.changes.fetch_add(1, Ordering::SeqCst) + 1;
            let now = Instant::now();
            remembered.prune(now);
            if remembered.notified.len() >= NOTIFIED_AT_MOST
                && !remembered.notified.contains_key(key)
            {
                remembered.notified.clear();
                remembered.all_changed_at = changes;
            }
            remembered
                .notified
                .insert(key.to_owned(), Notified { changes, at: now });
        }
        self.wake(key);
    }

    /// Wakes `key`'s waiters for a write that changes no remembered
    /// answer (see `WriteTx::woken`).
    pub fn wake(&self, key: &str) {
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
        self.all_changed();
        for watched in self.lock().values() {
            watched.notify.notify_waiters();
        }
    }

    /// Where a read begins: take it before the read, then
    /// [`Hub::remember`] the answer with it.
    pub fn read_start(&self) -> ReadStart {
        ReadStart {
            changes: self.changes.load(Ordering::SeqCst),
            at: Instant::now(),
        }
    }

    /// Whether notifications from every server reach this hub (see
    /// [`listen_postgres`]).
    pub fn set_complete(&self, complete: bool) {
        self.complete.store(complete, Ordering::SeqCst);
        if !complete {
            self.all_changed();
        }
    }

    /// No answer remembered so far stands any more.
    fn all_changed(&self) {
        let mut remembered = self.remembered();
        remembered.all_changed_at = self.changes.fetch_add(1, Ordering::SeqCst) + 1;
    }

    /// Keeps `answer` (an ETag) as what `key` read, from the records
    /// named by `read_from` (besides `key`'s own), in the read that began
    /// at `start`.
    pub fn remember(&self, key: &str, answer: &str, read_from: Vec<String>, start: ReadStart) {
        let mut remembered = self.remembered();
        remembered.prune(Instant::now());
        remembered.by_key.insert(
            key.to_owned(),
            Remembered {
                answer: answer.to_owned(),
                read_from,
                start,
            },
        );
    }

    /// Whether a read of `key` would still answer `answer`: it was the
    /// answer remembered, neither `key` nor any record it was read from was
    /// notified since its read began, notifications are complete, and it
    /// is recent enough.
    pub fn unchanged_since(&self, key: &str, answer: &str) -> bool {
        if answer.is_empty() || !self.complete.load(Ordering::SeqCst) {
            return false;
        }
        let remembered = self.remembered();
        let Some(r) = remembered.by_key.get(key) else {
            return false;
        };
        let unnotified = |k: &str| {
            remembered
                .notified
                .get(k)
                .is_none_or(|n| n.changes <= r.start.changes)
        };
        r.answer == answer
            && r.start.changes >= remembered.all_changed_at
            && r.start.at.elapsed() < UNCHANGED_FOR_AT_MOST
            && unnotified(key)
            && r.read_from.iter().all(|k| unnotified(k))
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
                            Ok(Some(notification)) => {
                                match notification.payload().strip_prefix(WAKE_ONLY_PREFIX) {
                                    Some(key) => hub.wake(key),
                                    None => hub.notify(notification.payload()),
                                }
                            }
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

    fn read_from() -> Vec<String> {
        vec!["sbx_1".to_owned(), "cmd_1".to_owned()]
    }

    #[test]
    fn an_answer_stands_while_nothing_it_was_read_from_is_notified() {
        let hub = Hub::default();
        assert!(!hub.unchanged_since("runner:a", "e1"), "nothing remembered");
        hub.remember("runner:a", "e1", read_from(), hub.read_start());
        assert!(hub.unchanged_since("runner:a", "e1"));
        assert!(!hub.unchanged_since("runner:a", "e0"), "another answer");
        assert!(!hub.unchanged_since("runner:a", ""), "no answer");
        assert!(!hub.unchanged_since("runner:b", "e1"), "another key");
        // Writes to records of other runners' sets leave it standing.
        hub.notify("sbx_other");
        hub.notify("runner:b");
        assert!(hub.unchanged_since("runner:a", "e1"));
        // A write to one of its records, or to the runner's set, does not.
        hub.notify("cmd_1");
        assert!(!hub.unchanged_since("runner:a", "e1"));
        hub.remember("runner:a", "e1", read_from(), hub.read_start());
        hub.notify("runner:a");
        assert!(!hub.unchanged_since("runner:a", "e1"));
        hub.remember("runner:a", "e1", read_from(), hub.read_start());
        hub.notify("sbx_1");
        assert!(!hub.unchanged_since("runner:a", "e1"));
    }

    #[tokio::test]
    async fn a_wake_wakes_waiters_and_leaves_answers_standing() {
        let hub = Hub::default();
        hub.remember("runner:a", "e1", read_from(), hub.read_start());
        let watch = hub.watch("cmd_1");
        let woken = watch.notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        hub.wake("cmd_1");
        tokio::time::timeout(std::time::Duration::from_secs(10), woken)
            .await
            .expect("the waiter woken");
        assert!(hub.unchanged_since("runner:a", "e1"));
        hub.notify("cmd_1");
        assert!(!hub.unchanged_since("runner:a", "e1"));
    }

    #[test]
    fn a_read_that_began_before_a_notification_of_its_records_is_not_trusted_after_it() {
        let hub = Hub::default();
        let start = hub.read_start();
        hub.notify("sbx_1");
        hub.remember("runner:a", "e2", read_from(), start);
        assert!(!hub.unchanged_since("runner:a", "e2"));
        // Of another record: it stands.
        let start = hub.read_start();
        hub.notify("sbx_2");
        hub.remember("runner:a", "e2", read_from(), start);
        assert!(hub.unchanged_since("runner:a", "e2"));
    }

    #[test]
    fn no_answer_stands_while_notifications_may_be_missing() {
        let hub = Hub::default();
        hub.remember("runner:a", "e2", read_from(), hub.read_start());
        // A PostgreSQL listener down.
        hub.set_complete(false);
        assert!(!hub.unchanged_since("runner:a", "e2"));
        hub.set_complete(true);
        assert!(
            !hub.unchanged_since("runner:a", "e2"),
            "the gap is a change"
        );
        hub.remember("runner:a", "e2", read_from(), hub.read_start());
        hub.notify_all();
        assert!(!hub.unchanged_since("runner:a", "e2"));
    }

    #[test]
    fn forgetting_notifications_to_stay_bounded_forgets_every_answer() {
        let hub = Hub::default();
        hub.remember("runner:a", "e1", read_from(), hub.read_start());
        for i in 0..NOTIFIED_AT_MOST {
            hub.notify(&format!("sbx_other_{i}"));
        }
        assert!(hub.unchanged_since("runner:a", "e1"), "all unrelated");
        assert_eq!(hub.remembered().notified.len(), NOTIFIED_AT_MOST);
        hub.notify("sbx_one_more");
        assert_eq!(hub.remembered().notified.len(), 1);
        assert!(
            !hub.unchanged_since("runner:a", "e1"),
            "a notification of its records may have been forgotten"
        );
    }
}
