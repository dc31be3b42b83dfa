//! A test-only init: `roost-test-init [-- WORKLOAD…]` runs
//! `oci::init`, the same code `roost init` runs, so the crate's tests can
//! put the real init in real containers without the CLI crate.

fn main() -> std::process::ExitCode {
    oci::init::run_from_args(std::env::args_os().skip(1))
}
