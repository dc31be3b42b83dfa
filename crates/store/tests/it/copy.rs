//! `store::copy`: one store into another, verified, incremental and
//! resumable; and `store::check::roots`, which it relies on.

use std::sync::Arc;

use store::backend::LocalBackend;
use store::copy::{CopyOptions, CopyReport};
use store::progress::NoProgress;
use store::store::{KeyKind, ObjectId, PackPart, parse_key};
use store::{Objects, Store};

use crate::backend::s3_backend;
use crate::support::{
    assert_verify_ok, contents, corrupt_stored, home, home_dir, org, pull, push, reachable,
    tempdir, write_files,
};

fn local(dir: &std::path::Path) -> Store {
    Store::new(Arc::new(LocalBackend::open(dir).expect("open")))
}

fn copy(from: &Store, to: &Store) -> CopyReport {
    store::copy::copy(
        from,
        to,
        &CopyOptions {
            progress: &NoProgress,
            after_pack_data: None,
        },
    )
    .expect("copy runs")
}

fn many_files(n: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            (
                format!("d{}/f{i}", i % 7),
                format!("file {i} ").repeat(50).into_bytes(),
            )
        })
        .collect()
}

fn write(dir: &std::path::Path, files: &[(String, Vec<u8>)]) {
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect();
    write_files(dir, &refs);
}

#[test]
fn a_copy_carries_every_home_and_the_next_copy_only_what_changed() {
    let (source_dir, target_dir) = (tempdir(), tempdir());
    let (source, target) = (local(source_dir.path()), local(target_dir.path()));
    let acme = org("acme");
    let files = many_files(300);
    let dir = tempdir();
    write(dir.path(), &files);
    push(&source, &acme, &home("one"), dir.path()).expect("push");
    let other = home_dir(&[("a", b"other org's file")]);
    push(&source, &org("globex"), &home("two"), other.path()).expect("push");

    let first = copy(&source, &target);
    assert!(first.ok(), "{first:?}");
    assert!(
        first.packs_copied >= 2 && first.pointers_copied == 2,
        "{first:?}"
    );
    assert_eq!(first.packs_skipped, 0);
    // The target is a store of its own: verified whole, and pulls back.
    let target = local(target_dir.path());
    assert_verify_ok(&target);
    let out = tempdir();
    pull(&target, &acme, &home("one"), &out.path().join("h")).expect("pull from the copy");
    assert_eq!(contents(&out.path().join("h")), contents(dir.path()));

    // Nothing changed: nothing written.
    let again = copy(&source, &target);
    assert!(again.ok());
    assert_eq!(
        (again.packs_copied, again.objects_copied, again.bytes_copied),
        (0, 0, 0)
    );
    assert_eq!(again.pointers_skipped, 2);
    assert_eq!(again.packs_skipped, first.packs_copied);

    // One file changed: a pack or so, and the pointer.
    write_files(dir.path(), &[("d1/f1", b"changed")]);
    push(&source, &acme, &home("one"), dir.path()).expect("push");
    let incremental = copy(&source, &target);
    assert!(incremental.ok(), "{incremental:?}");
    assert_eq!(incremental.pointers_copied, 1);
    assert!(incremental.objects_copied <= 10, "{incremental:?}");
    assert_eq!(
        target.read_home(&acme, &home("one")).expect("read"),
        source.read_home(&acme, &home("one")).expect("read")
    );
    assert_verify_ok(&target);
}

#[test]
fn a_corrupt_source_object_is_reported_by_name_not_copied_and_the_rest_is() {
    let (source_dir, target_dir) = (tempdir(), tempdir());
    let (source, target) = (local(source_dir.path()), local(target_dir.path()));
    let acme = org("acme");
    let bad_home = home_dir(&[
        ("bad", b"this one gets corrupted"),
        ("good", b"this one not"),
    ]);
    push(&source, &acme, &home("bad"), bad_home.path()).expect("push");
    let good_home = home_dir(&[("x", b"another home, another pack")]);
    push(&source, &acme, &home("good"), good_home.path()).expect("push");
    let bad = ObjectId::block(store::Digest::of(b"this one gets corrupted"));
    corrupt_stored(&source, &acme, &bad);

    let report = copy(&source, &target);
    assert!(!report.ok());
    assert_eq!(report.corrupt.len(), 1, "{report:?}");
    assert!(
        report.corrupt[0].contains(&bad.digest.to_hex()),
        "{report:?}"
    );
    // Not copied; the sound object of that pack is.
    assert_eq!(target.missing(&acme, &[bad]).expect("missing"), vec![bad]);
    let sound = ObjectId::block(store::Digest::of(b"this one not"));
    assert!(target.missing(&acme, &[sound]).expect("missing").is_empty());
    // The home needing it is held back, the other copied.
    assert_eq!(report.pointers_held.len(), 1, "{report:?}");
    assert!(report.pointers_held[0].contains("acme/bad"));
    assert_eq!(target.read_home(&acme, &home("bad")).expect("read"), None);
    assert!(
        target
            .read_home(&acme, &home("good"))
            .expect("read")
            .is_some()
    );
}

#[test]
fn an_interrupted_copy_counts_no_half_written_pack_and_resumes() {
    let (source_dir, target_dir) = (tempdir(), tempdir());
    let source = local(source_dir.path());
    let acme = org("acme");
    for i in 0..4 {
        let dir = home_dir(&[("f", format!("home {i}").as_bytes())]);
        push(&source, &acme, &home(&format!("h{i}")), dir.path()).expect("push");
    }
    // Dies between the first pack's bytes and its index.
    let target = local(target_dir.path());
    let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let die = |_: &store::OrgId, _: &store::pack::PackId| panic!("killed here");
        store::copy::copy(
            &source,
            &target,
            &CopyOptions {
                progress: &NoProgress,
                after_pack_data: Some(&die),
            },
        )
    }));
    assert!(died.is_err());
    let keys: Vec<String> = target
        .backend()
        .list("orgs/")
        .expect("list")
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert!(
        keys.iter().any(|k| matches!(
            parse_key(k),
            Some(KeyKind::Pack {
                part: PackPart::Data,
                ..
            })
        )),
        "a pack's bytes were written: {keys:?}"
    );
    assert!(
        !keys.iter().any(|k| matches!(
            parse_key(k),
            Some(
                KeyKind::Pack {
                    part: PackPart::Index,
                    ..
                } | KeyKind::Home { .. }
            )
        )),
        "no index and no pointer before the kill: {keys:?}"
    );
    // A fresh process sees no object of the half-copied pack.
    let fresh = local(target_dir.path());
    let objects: Vec<ObjectId> = (0..4)
        .map(|i| ObjectId::block(store::Digest::of(format!("home {i}").as_bytes())))
        .collect();
    assert_eq!(fresh.missing(&acme, &objects).expect("missing").len(), 4);
    let resumed = copy(&source, &fresh);
    assert!(resumed.ok(), "{resumed:?}");
    assert_eq!(resumed.pointers_copied, 4);
    assert_verify_ok(&local(target_dir.path()));
}

#[test]
fn loose_objects_are_copied_as_objects() {
    let (source_dir, target_dir) = (tempdir(), tempdir());
    let source = Store::unpacked(Arc::new(
        LocalBackend::open(source_dir.path()).expect("open"),
    ));
    let target = local(target_dir.path());
    let acme = org("acme");
    let dir = home_dir(&[("a", b"loose a"), ("b/c", b"loose c")]);
    push(&source, &acme, &home("old"), dir.path()).expect("push");
    let root = source
        .read_home(&acme, &home("old"))
        .expect("read")
        .expect("home");
    let report = copy(&source, &target);
    assert!(report.ok(), "{report:?}");
    assert_eq!(report.packs_copied, 0);
    let reached = reachable(&source, &acme, root);
    assert_eq!(report.objects_copied, reached.len() as u64);
    for object in reached {
        assert!(
            target
                .backend()
                .get(&Store::object_key(&acme, &object))
                .expect("get")
                .is_some()
        );
    }
    assert_eq!(copy(&source, &target).objects_copied, 0);
}

#[test]
fn check_reports_each_root_with_what_is_missing_below_it() {
    let store_dir = tempdir();
    let store = local(store_dir.path());
    let acme = org("acme");
    let a = home_dir(&[("shared", b"in both"), ("only-a", b"a's own")]);
    let b = home_dir(&[("shared", b"in both"), ("sub/only-b", b"b's own")]);
    push(&store, &acme, &home("a"), a.path()).expect("push");
    push(&store, &acme, &home("b"), b.path()).expect("push");
    let root_a = store
        .read_home(&acme, &home("a"))
        .expect("read")
        .expect("a");
    let root_b = store
        .read_home(&acme, &home("b"))
        .expect("read")
        .expect("b");
    let (status, checked) =
        store::check::roots(&store, &acme, &[root_a, root_b], true).expect("check");
    assert!(status[&root_a].complete() && status[&root_b].complete());
    assert!(checked.trees >= 3 && checked.blocks >= 3, "{checked:?}");
    // b's own block corrupt: only b is incomplete, and deep finds it.
    let own_b = ObjectId::block(store::Digest::of(b"b's own"));
    corrupt_stored(&store, &acme, &own_b);
    let (shallow, _) = store::check::roots(&store, &acme, &[root_a, root_b], false).expect("check");
    assert!(shallow[&root_b].complete(), "present counts without --deep");
    let (deep, _) = store::check::roots(&store, &acme, &[root_a, root_b], true).expect("check");
    assert!(deep[&root_a].complete());
    assert_eq!(deep[&root_b].corrupt, 1);
    assert_eq!(deep[&root_b].first_fault, Some(own_b));
}

#[test]
fn a_local_store_copies_to_s3_and_back() {
    let source_dir = tempdir();
    let source = local(source_dir.path());
    let acme = org("acme");
    let dir = tempdir();
    write(dir.path(), &many_files(50));
    push(&source, &acme, &home("h"), dir.path()).expect("push");
    let s3 = Store::new(s3_backend("copy"));
    assert!(copy(&source, &s3).ok());
    let back_dir = tempdir();
    let back = local(back_dir.path());
    let report = copy(&s3, &back);
    assert!(report.ok(), "{report:?}");
    let out = tempdir();
    pull(&back, &acme, &home("h"), &out.path().join("h")).expect("pull");
    assert_eq!(contents(&out.path().join("h")), contents(dir.path()));
}
