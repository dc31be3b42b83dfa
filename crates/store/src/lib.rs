//! The content-addressed home store: blocks, Merkle trees of directories,
//! push (scan → missing-check → upload → commit) and pull (materialise).
//!
//! This crate knows nothing about HTTP or the command line. Everything that
//! touches the outside world goes through [`backend::Backend`] (object
//! storage, under [`Store`]), [`Objects`] (an org's objects by name: a
//! [`Store`], or the block service's client that `api` provides) or the
//! local filesystem under a directory the caller names.

pub mod backend;
pub mod block;
pub mod check;
pub mod copy;
pub mod digest;
mod error;
pub mod excludes;
pub mod gc;
pub mod ids;
pub mod index;
pub mod midx;
pub mod objects;
pub mod pack;
pub mod progress;
pub mod pull;
pub mod push;
mod scan;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tree;

pub use digest::Digest;
pub use error::{Corruption, Error, Result};
pub use ids::{HomeName, OrgId};
pub use objects::Objects;
pub use store::{LockTiming, Store};
