//! The control layer: the control plane's rules as functions of a write
//! transaction (or the shared state) and typed inputs, answering
//! `ControlError`. The HTTP layer parses, authenticates, calls and
//! renders; the reconciler calls these and never `http`. Issue 12 point 2
//! moves the rest of the handlers' rules here (admission, the runner
//! protocol, saves).
//!
//! - [`placement`]: placing a sandbox, or recording why it waits.
//! - [`home_store`]: the content store as the control plane uses it.
//! - [`snapshots`]: failing snapshots that can no longer keep their promise.

pub mod home_store;
pub mod placement;
pub mod snapshots;

use std::sync::Arc;

use crate::db::Db;
use crate::metrics::Metrics;

#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    /// The content store (`--store`): images, and the block service.
    pub store: Option<Arc<store::Store>>,
    pub config: Arc<crate::Config>,
    pub metrics: Arc<Metrics>,
}
