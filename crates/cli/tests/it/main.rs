//! End-to-end tests of the `roost` binary. Each runs the real binary
//! against a local directory store and, where marked, the real
//! S3-compatible server that `scripts/test.sh` starts on loopback.

mod backup;
mod browser;
mod commands;
mod control;
mod convergence;
mod dashboard;
mod durable;
mod failover;
mod fault_matrix;
mod files;
mod filesystems;
mod harness;
mod home;
mod hostile;
mod idle;
mod images;
mod leases;
mod plane;
mod proxy;
mod runner_e2e;
mod sandbox_cli;
mod sandboxes;
mod secrets;
mod setid;
mod store_admin;
mod store_faults;
mod terminal;
