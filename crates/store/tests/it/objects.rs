//! The store engine passes the `Objects` conformance suite over every
//! backend: local directory, memory and S3 (which needs the server
//! `scripts/test.sh` starts, as the backend suite does).

use std::sync::Arc;

use store::Store;
use store::backend::{LocalBackend, MemoryBackend};
use store::testing::{Scale, conformance};

use crate::support::{org, tempdir};

#[test]
fn the_store_over_a_local_directory_conforms() {
    let dir = tempdir();
    let backend = LocalBackend::open(dir.path().join("store")).expect("open");
    conformance(&Store::new(Arc::new(backend)), &org("acme"), Scale::Full);
}

#[test]
fn the_store_over_memory_conforms() {
    conformance(
        &Store::new(Arc::new(MemoryBackend::default())),
        &org("acme"),
        Scale::Full,
    );
}

#[test]
fn the_store_over_s3_conforms() {
    let store = Store::new(crate::backend::s3_backend("objects"));
    conformance(&store, &org("acme"), Scale::Small);
}
