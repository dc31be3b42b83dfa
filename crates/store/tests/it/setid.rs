//! Issue 14, "no setuid program reaches the host": setuid and setgid bits
//! are cleared by the scan every client push goes through, refused in an
//! uploaded tree, and never written by pull, whoever pulls (these tests
//! run as root in CI, which is the case that matters: a root pull of a
//! `04755` file would make a setuid-root program).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use store::backend::MemoryBackend;
use store::objects::put_tree_checked;
use store::store::ObjectId;
use store::tree::{Entry, EntryKind, Tree};
use store::{Digest, Error, Store, block};

use crate::support::{home, home_dir, org, pull, push};

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

fn mode_of(path: &Path) -> u32 {
    fs::symlink_metadata(path)
        .expect("lstat")
        .permissions()
        .mode()
        & 0o7777
}

fn entry<'t>(tree: &'t Tree, name: &str) -> &'t Entry {
    tree.entries
        .iter()
        .find(|e| e.name == name.as_bytes())
        .unwrap_or_else(|| panic!("no entry {name:?}"))
}

#[test]
fn a_push_stores_no_setuid_or_setgid_bit_and_keeps_the_rest() {
    let store = Store::new(Arc::new(MemoryBackend::default()));
    let org = org("acme");
    let dir = home_dir(&[("bin/id", b"#!/bin/sh\nid\n"), ("shared/f", b"f")]);
    chmod(&dir.path().join("bin/id"), 0o4755);
    chmod(&dir.path().join("shared/f"), 0o2640);
    chmod(&dir.path().join("shared"), 0o3775);
    push(&store, &org, &home("h"), dir.path()).expect("a push strips the bits, it does not fail");

    let root = store
        .read_home(&org, &home("h"))
        .expect("pointer")
        .expect("pushed");
    let top = store.get_tree(&org, &root).expect("root tree");
    // The sticky bit is kept: it protects, it grants nothing.
    assert_eq!(entry(&top, "shared").mode, 0o1775);
    let subtree = |name: &str| match &entry(&top, name).kind {
        EntryKind::Dir { tree } => store.get_tree(&org, tree).expect("tree"),
        other => panic!("{name} is not a directory: {other:?}"),
    };
    assert_eq!(entry(&subtree("bin"), "id").mode, 0o755);
    assert_eq!(entry(&subtree("shared"), "f").mode, 0o640);

    let dest = crate::support::tempdir();
    pull(&store, &org, &home("h"), dest.path()).expect("pull");
    assert_eq!(mode_of(&dest.path().join("bin/id")), 0o755);
    assert_eq!(mode_of(&dest.path().join("shared")), 0o1775);
}

#[test]
fn a_stored_setuid_tree_is_refused_at_upload_and_never_restored_by_pull() {
    let store = Store::new(Arc::new(MemoryBackend::default()));
    let org = org("acme");
    let content = b"#!/bin/sh\nid\n";
    let blob = Digest::of(content);
    store
        .put_object(&org, &ObjectId::block(blob), content)
        .expect("block");
    // What a hostile client uploads, or a store written before the rule
    // holds: `Tree::encode` refuses the mode, so the bytes are crafted.
    let plain = Tree {
        entries: vec![Entry {
            name: b"id".to_vec(),
            mode: 0o6755,
            size: content.len() as u64,
            mtime_ns: 0,
            kind: EntryKind::File { blocks: vec![blob] },
        }],
    }
    .encode_unchecked();
    let digest = Digest::of(&plain);
    match put_tree_checked(&store, &org, &digest, &block::encode(&plain)) {
        Err(Error::MalformedTree { reason, .. }) => {
            assert!(
                reason.contains("\"id\"") && reason.contains("6755"),
                "{reason}"
            );
        }
        other => panic!("an uploaded setuid tree is refused, got {other:?}"),
    }

    // Stored anyway (an older store): it still reads, and pull, as root
    // here, writes the file without the bits.
    store
        .put_object(&org, &ObjectId::tree(digest), &plain)
        .expect("legacy tree");
    store
        .write_home(&org, &home("legacy"), &digest)
        .expect("pointer");
    let dest = crate::support::tempdir();
    pull(&store, &org, &home("legacy"), dest.path()).expect("a legacy tree still pulls");
    assert_eq!(mode_of(&dest.path().join("id")), 0o755);
    assert_eq!(fs::read(dest.path().join("id")).expect("read"), content);
}
