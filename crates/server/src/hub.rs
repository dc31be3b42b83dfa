//! Long-poll wake-ups. A waiter registers interest in a key (a sandbox,
//! command or runner id) before reading the record, then sleeps until the
//! key is notified or its timeout passes. On PostgreSQL every write also
//! sends `NOTIFY`, and a listener task turns notifications from any server
//! into local wake-ups, so a waiter on server A wakes for a write on B.
//! Nothing here is needed for correctness: a missed wake-up costs latency
//! (the waiter still answers at its timeout), never a wrong answer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

pub const PG_CHANNEL: &str = "roost_changes";

/// The key woken by a change to any sandbox (its own key starts with
/// `sbx_`), whatever its org: list waiters re-read and compare.
pub const ANY_SANDBOX: &str = "sandboxes:any";
const SANDBOX_ID_PREFIX: &str = "sbx_";

#[derive(Clone, Default)]
pub struct Hub {
    inner: Arc<Mutex<HashMap<String, Watched>>>,
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
        for watched in self.lock().values() {
            watched.notify.notify_waiters();
        }
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
pub async fn listen_postgres(url: String, hub: Hub) {
    loop {
        match sqlx::postgres::PgListener::connect(&url).await {
            Ok(mut listener) => {
                if let Err(err) = listener.listen(PG_CHANNEL).await {
                    tracing::warn!(%err, "LISTEN failed");
                } else {
                    // Anything written while we were not listening.
                    hub.notify_all();
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(notification)) => hub.notify(notification.payload()),
                            Ok(None) => {
                                tracing::warn!("notification connection lost; reconnecting");
                                hub.notify_all();
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
        hub.notify_all();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
