//! Integration tests of the OCI layer, one binary for the crate.
//! They run real containers with runc on this machine, as root, with the
//! crate's `roost-test-init` as PID 1:
//!
//! - `lifecycle`: PID 1 and reaping, the filesystem layout, pause/resume,
//!   deaths and their causes, stop, delete.
//! - `agent`: the in-sandbox agent: attach again, stdin, listings, hostile requests.
//! - `agent_files`: the agent's file operations: uploads, ranges, listings,
//!   tar streams, symlinks and hostile tars, a full disk, bad paths.
//! - `exec`: command outcomes, output, env, cwd, timeout, signals.
//! - `limits`: cgroup limits (memory → OOM, pids → fork bomb, cpu).
//! - `network`: `bridge` (address, routes, NAT, isolation, leases,
//!   recovery) and `none` networking.
//! - `security`: capabilities, no-new-privileges, seccomp.
//! - `selection`: which runtime `auto` picks, an explicit crun, a missing
//!   binary.
//! - `shared`: a shared filesystem's root made `nosuid,nodev` for the host.
//! - `support`: temp sandboxes and a guard that force-deletes them.

mod agent;
mod agent_files;
mod exec;
mod image;
mod lifecycle;
mod limits;
mod network;
mod security;
mod selection;
mod shared;
mod support;
mod tmpfs;
mod volumes;
