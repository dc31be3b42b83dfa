//! The block service, through its client (`api::blocks::RemoteBackend`),
//! is an `Objects` like the store engine: the same conformance suite,
//! at full scale so that every request limit is crossed. And it stores
//! only what it can check, which a store this process holds leaves to
//! its caller.

use api::blocks::RemoteBackend;
use store::store::ObjectId;
use store::testing::{Scale, conformance};
use store::tree::{Entry, EntryKind, Tree};
use store::{Digest, Objects, block};

use crate::support::TestServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_service_conforms() {
    let server = TestServer::start().await;
    let (client, org) = server.org("acme").await;
    let objects = RemoteBackend::new(client, tokio::runtime::Handle::current());
    // The client blocks on the runtime: it runs on a plain thread.
    tokio::task::spawn_blocking(move || conformance(&objects, &org, Scale::Full))
        .await
        .expect("the suite passes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_service_refuses_what_it_cannot_check_and_stores_none_of_it() {
    let server = TestServer::start().await;
    let (client, org) = server.org("acme").await;
    let objects = RemoteBackend::new(client, tokio::runtime::Handle::current());
    tokio::task::spawn_blocking(move || {
        let plain = b"a block the service checks".to_vec();
        let good = (ObjectId::block(Digest::of(&plain)), block::encode(&plain));
        let lying = (
            ObjectId::block(Digest::of(b"other content")),
            block::encode(&plain),
        );
        let (tree_digest, tree_plain) = Tree {
            entries: vec![Entry {
                name: b"never-uploaded".to_vec(),
                mode: 0o644,
                size: 3,
                mtime_ns: 0,
                kind: EntryKind::File {
                    blocks: vec![Digest::of(b"abc")],
                },
            }],
        }
        .encode()
        .expect("a valid tree");
        let incomplete = (ObjectId::tree(tree_digest), block::encode(&tree_plain));
        for (what, bad) in [
            ("a hash mismatch", &lying),
            ("an incomplete tree", &incomplete),
        ] {
            let batch = [(good.0, good.1.as_slice()), (bad.0, bad.1.as_slice())];
            assert!(
                objects.put_batch(&org, &batch).is_err(),
                "a batch with {what} is refused"
            );
            assert_eq!(
                objects.missing(&org, &[good.0, bad.0]).expect("missing"),
                vec![good.0, bad.0],
                "nothing of a batch with {what} is stored"
            );
        }
    })
    .await
    .expect("the checks pass");
}
