//! Lease renewals committed in groups: a heartbeat joins the batch being
//! gathered, and one transaction renews every lease in it. While one
//! batch is written the next gathers, so a fleet's heartbeats cost a few
//! commits per second instead of one each, and a heartbeat still waits
//! for its own renewal to be committed before it is answered.

use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::db::{Db, now_ms};
use crate::records::runners;

type Renewed = Result<bool, Arc<sqlx::Error>>;

/// One server's gathering of lease renewals (on `AppState`).
#[derive(Default)]
pub struct LeaseRenewals {
    /// Heartbeats waiting for the next batch: the runner and where its
    /// answer goes.
    gathering: Mutex<Vec<(String, oneshot::Sender<Renewed>)>>,
    /// Held while a batch is written, so arrivals meanwhile gather.
    writing: tokio::sync::Mutex<()>,
    batches: std::sync::atomic::AtomicU64,
}

impl LeaseRenewals {
    /// Renews the runner's lease to `lease_ms` from the commit, unless the
    /// watcher has declared it lost (false: an expired lease stays
    /// expired). Answers once the renewal is committed.
    pub async fn renew(&self, db: &Db, runner_id: &str, lease_ms: i64) -> Renewed {
        let (answer, answered) = oneshot::channel();
        self.gathering
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((runner_id.to_owned(), answer));
        // Whoever holds `writing` writes everything gathered by then (its
        // own and others'). A heartbeat whose renewal another wrote is
        // answered at once, without queueing for `writing` behind the
        // next batches.
        tokio::pin!(answered);
        loop {
            tokio::select! {
                biased;
                renewed = &mut answered => {
                    return renewed.unwrap_or_else(|_| Err(Arc::new(sqlx::Error::WorkerCrashed)));
                }
                _writing = self.writing.lock() => {
                    let batch = std::mem::take(
                        &mut *self.gathering.lock().unwrap_or_else(|p| p.into_inner()),
                    );
                    if !batch.is_empty() {
                        self.batches
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        // On a task of its own: a heartbeat whose client
                        // goes away (its future dropped) must not cancel
                        // the others' write.
                        let db = db.clone();
                        let write =
                            tokio::spawn(async move { write_batch(&db, batch, lease_ms).await });
                        let _ = write.await;
                    }
                }
            }
        }
    }

    /// Batches written so far (each one transaction).
    pub fn batches(&self) -> u64 {
        self.batches.load(std::sync::atomic::Ordering::Relaxed)
    }
}

async fn write_batch(db: &Db, batch: Vec<(String, oneshot::Sender<Renewed>)>, lease_ms: i64) {
    let ids: Vec<String> = batch.iter().map(|(id, _)| id.clone()).collect();
    // The lease runs from the commit's start, at least as late as each
    // heartbeat's arrival: the runner, counting from when it sent, never
    // believes in a lease the records have ended.
    match runners::renew_leases(db, &ids, now_ms() + lease_ms).await {
        Ok(renewed) => {
            for (id, answer) in batch {
                let _ = answer.send(Ok(renewed.contains(&id)));
            }
        }
        Err(err) => {
            let err = Arc::new(err);
            for (_, answer) in batch {
                let _ = answer.send(Err(err.clone()));
            }
        }
    }
}
