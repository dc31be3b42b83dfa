//! The runner agent (`roost runner`): registers with the control plane,
//! keeps its lease, and reconciles its assignments into containers through
//! the OCI layer (the `oci` crate), reporting what it observes.
//!
//! - [`agent`]: the agent itself, the only code that speaks the runner
//!   protocol (`api`) and stores homes and images (`store`).
//! - [`purge`]: `roost purge`, removing everything a runner made on its
//!   host once it has stopped.
//!
//! The OCI layer below knows neither the control plane nor its protocol;
//! Cargo enforces it (`oci` depends on neither `api` nor `store`). The
//! agent's configuration takes two of its types, re-exported here with
//! [`init`], the PID 1 the `roost` binary runs as `roost init`.

pub mod agent;
pub mod purge;

pub use oci::host::find_binary;
pub use oci::{InitProgram, RuntimeChoice, init};
