//! Integration tests of the `api` crate, one binary for the crate.
//!
//! - `fuzz`: property-based fuzzing of the block service's batch and fetch
//!   frame parsers, bounded in cases.
//!
//! Tests named `regression_*` pin bugs found and fixed; each says which.

mod fuzz;
