//! The agent's time: [`Clock`], read by the lease's bookkeeping and the
//! fence, and slept on by the heartbeats, the fence's ticks, the
//! assignments loop and the workers' passes and save schedules. The real
//! one is tokio's time ([`TokioClock`]); tests use a manual one
//! (`testing::ManualClock`) and move time on themselves, so nothing in
//! them waits for the wall clock.

use std::future::Future;
use std::time::Duration;

use oci::seam::BoxFuture;
use tokio::time::Instant;

/// Now, and waiting.
pub(crate) trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Instant;
    /// Now on the clock of the sandboxes' lease deadlines
    /// (`oci::lease::boottime_ms`), in ms.
    fn boottime_ms(&self) -> u64;
    /// Resolves once `duration` has passed on this clock.
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;
}

/// tokio's time: the agent's clock outside tests.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn boottime_ms(&self) -> u64 {
        oci::lease::boottime_ms()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// `work` took longer than it was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Elapsed;

/// `work`, unless `limit` passes first on `clock` (`tokio::time::timeout`
/// on an injected clock).
pub(crate) async fn timeout<T>(
    clock: &dyn Clock,
    limit: Duration,
    work: impl Future<Output = T>,
) -> Result<T, Elapsed> {
    tokio::select! {
        biased;
        value = work => Ok(value),
        () = clock.sleep(limit) => Err(Elapsed),
    }
}
