//! Integration tests of the home store, one binary for the crate.
//!
//! - `backend`: the conformance suite every `Backend` must pass (local
//!   directory, memory, S3 against the server `scripts/test.sh` starts).
//! - `objects`: the `Objects` conformance suite (`store::testing`) for the
//!   store engine over each backend; the server's tests run it against the
//!   block service.
//! - `engine`: push, pull, gc and verify end to end through the library.
//! - `bounds`: trees nested too deep, expanding too far or with sizes that
//!   overflow are refused, and no walk recurses with its input.
//! - `setid`: no setuid or setgid bit is pushed, accepted or pulled.
//! - `fuzz`: property-based fuzzing of the tree decoder and block frames
//!   (hostile bytes from a store or a client), bounded in cases.
//! - `packs`: the pack layout: objects read from either layout and moved
//!   into packs, ranged reads, gc rewriting packs, and packs or indexes
//!   that are truncated, lie, are missing or belong to another org.
//! - `copy`: one store copied into another (verified, incremental,
//!   resumable, corrupt source objects reported) and root checks.
//! - `support`: temp homes, directory snapshots and a backend test double
//!   that records calls and injects faults.
//!
//! Tests named `regression_*` pin bugs found and fixed; each says which.

mod backend;
mod bounds;
mod copy;
mod engine;
mod fuzz;
mod objects;
mod packs;
mod setid;
mod support;
