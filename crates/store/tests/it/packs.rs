//! Packs (issue 18): where objects are written, how they are read (either
//! layout, ranged reads), how gc rewrites packs, and what happens to packs
//! and indexes that are truncated, lie, are missing or belong elsewhere.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use store::backend::{Backend, MemoryBackend};
use store::gc;
use store::pack::{PackId, PackIndex};
use store::store::{KeyKind, ObjectId, PackPart, parse_key};
use store::{Error, Objects, OrgId, Store};

use crate::support::{
    Double, Faults, assert_present_trees_are_complete, assert_verify_ok, contents, home, home_dir,
    object_keys, org, pull, push, reachable, tempdir,
};

/// Every pack of `org` in the backend, with its index.
fn packs_of(backend: &dyn Backend, org: &OrgId) -> Vec<PackIndex> {
    let mut out = Vec::new();
    for meta in backend.list(&Store::packs_prefix(org)).expect("list") {
        if let Some(KeyKind::Pack {
            pack,
            part: PackPart::Index,
            ..
        }) = parse_key(&meta.key)
        {
            let bytes = backend.get(&meta.key).expect("get").expect("listed");
            out.push(store::pack::decode_index(org, &pack, &bytes).expect("a sound index"));
        }
    }
    out
}

/// Keys of objects stored one per key (the layout before packs).
fn loose_keys(backend: &dyn Backend) -> Vec<String> {
    backend
        .list(Store::orgs_prefix())
        .expect("list")
        .into_iter()
        .filter(|meta| matches!(parse_key(&meta.key), Some(KeyKind::Object { .. })))
        .map(|meta| meta.key)
        .collect()
}

fn many_files(prefix: &str, count: usize, bytes: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let mut content = format!("{prefix} file {i} ").into_bytes();
            // Distinct, barely compressible content of about `bytes`.
            let mut x = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            while content.len() < bytes {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                content.push(x as u8);
            }
            (format!("{prefix}/d{}/f{i}", i % 7), content)
        })
        .collect()
}

fn refs(files: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
    files
        .iter()
        .map(|(path, content)| (path.as_str(), content.as_slice()))
        .collect()
}

/// A push writes packs, not a key per object: a few packs for hundreds of
/// objects, every object found through the index.
#[test]
fn a_push_writes_a_few_packs_and_no_key_per_object() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let store = Store::new(Arc::clone(&backend));
    let acme = org("acme");
    let files = many_files("src", 600, 3000);
    let src = home_dir(&refs(&files));
    let report = push(&store, &acme, &home("h"), src.path()).expect("push");
    assert!(
        loose_keys(backend.as_ref()).is_empty(),
        "no object under its own key"
    );
    let packs = packs_of(backend.as_ref(), &acme);
    let packed: usize = packs.iter().map(|p| p.entries.len()).sum();
    assert_eq!(
        packed as u64,
        report.blocks_uploaded + report.trees_uploaded,
        "every uploaded object is in exactly one pack"
    );
    assert!(
        packs.len() <= 6,
        "{} packs for {packed} objects",
        packs.len()
    );
    let dest = tempdir();
    pull(&Store::new(backend), &acme, &home("h"), dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
}

/// Migration: a store written one key per object keeps working. A push
/// into it finds the old objects present (no upload) and writes only new
/// ones, in packs; pull reads both layouts; `repack_loose` moves the old
/// objects into packs while the homes stay readable and verify stays
/// clean.
#[test]
fn old_stores_read_in_either_layout_and_repack_moves_them_online() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let acme = org("acme");
    let old_files = many_files("old", 120, 2000);
    let old_src = home_dir(&refs(&old_files));
    let legacy = Store::unpacked(Arc::clone(&backend));
    push(&legacy, &acme, &home("a"), old_src.path()).expect("push, one key per object");
    let loose_before = loose_keys(backend.as_ref());
    assert!(!loose_before.is_empty() && packs_of(backend.as_ref(), &acme).is_empty());

    // The same files plus new ones, through a store that writes packs.
    let mut both = old_files.clone();
    both.extend(many_files("new", 30, 2000));
    let both_src = home_dir(&refs(&both));
    let store = Store::new(Arc::clone(&backend));
    let report = push(&store, &acme, &home("b"), both_src.path()).expect("push");
    assert_eq!(
        report.blocks_uploaded, 30,
        "old blocks found in the old layout"
    );
    assert_eq!(
        loose_keys(backend.as_ref()),
        loose_before,
        "new writes go to packs"
    );
    for (name, src) in [("a", &old_src), ("b", &both_src)] {
        let dest = tempdir();
        pull(
            &Store::new(Arc::clone(&backend)),
            &acme,
            &home(name),
            dest.path(),
        )
        .expect("pull");
        assert_eq!(contents(dest.path()), contents(src.path()), "home {name}");
    }

    let objects_before = object_keys(backend.as_ref());
    // A reader that loaded the index before the move still reads after it.
    let reader = Store::new(Arc::clone(&backend));
    let root = reader
        .read_home(&acme, &home("a"))
        .expect("read")
        .expect("a");
    let reached: Vec<ObjectId> = reachable(&reader, &acme, root).into_iter().collect();
    let moved = gc::repack_loose(&store).expect("repack");
    assert_eq!(moved.objects_moved as usize, loose_before.len());
    assert!(moved.corrupt.is_empty());
    assert!(
        loose_keys(backend.as_ref()).is_empty(),
        "every old object moved"
    );
    assert_eq!(
        object_keys(backend.as_ref()),
        objects_before,
        "nothing lost or added"
    );
    assert!(reader.missing(&acme, &reached).expect("missing").is_empty());
    for object in &reached {
        reader
            .get_object(&acme, object)
            .expect("reads after the move");
    }
    assert_verify_ok(&store);
    assert_present_trees_are_complete(&store);
    // A fresh gc of a store that moved finds nothing to delete.
    let swept = gc::gc(&store, gc::DEFAULT_GRACE).expect("gc");
    assert_eq!(swept.deleted, 0, "{swept:?}");
}

/// A batch of objects from one pack is one ranged read, not one per
/// object.
#[test]
fn a_batch_reads_each_pack_in_one_ranged_read() {
    let double = Double::new(Arc::new(MemoryBackend::default()));
    let store = Store::new(double.clone());
    let acme = org("acme");
    let files = many_files("f", 300, 1500);
    let src = home_dir(&refs(&files));
    let root = push(&store, &acme, &home("h"), src.path())
        .expect("push")
        .root
        .expect("root");
    let objects: Vec<ObjectId> = reachable(&store, &acme, root).into_iter().collect();
    let packs = packs_of(double.as_ref(), &acme).len() as u64;
    double.arm(Faults::default());
    let fresh = Store::new(double.clone());
    let read = fresh.get_batch(&acme, &objects).expect("batch");
    assert!(read.iter().all(Option::is_some));
    for (object, stored) in objects.iter().zip(&read) {
        store::block::decode(&object.digest, stored.as_deref().expect("read")).expect("verifies");
    }
    assert!(
        double.ranged_reads() <= packs,
        "{} ranged reads for {} objects in {packs} packs",
        double.ranged_reads(),
        objects.len()
    );
    assert_eq!(double.single_gets(), 0);
}

/// gc rewrites a pack once enough of it is dead (or it is small), keeps a
/// large mostly-live pack as it is, and stats reports packs, dead bytes
/// and candidates.
#[test]
fn gc_rewrites_packs_past_the_dead_share_and_leaves_mostly_live_ones() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let store = Store::new(Arc::clone(&backend));
    let acme = org("acme");
    // 2.4 MB of blocks, barely compressible: a large pack.
    let mut files = many_files("f", 400, 6000);
    let src = tempdir();
    let write = |files: &[(String, Vec<u8>)]| {
        let _ = std::fs::remove_dir_all(src.path());
        crate::support::write_files(src.path(), &refs(files));
    };
    write(&files);
    push(&store, &acme, &home("h"), src.path()).expect("push");
    // 5% of the files change: their old blocks are dead, below the share.
    for (path, content) in files.iter_mut().step_by(20) {
        content.extend_from_slice(path.as_bytes());
    }
    write(&files);
    push(&store, &acme, &home("h"), src.path()).expect("push");
    let stats = gc::stats(&store).expect("stats");
    assert_eq!(stats.len(), 1);
    assert!(stats[0].packs >= 2 && stats[0].dead_bytes > 0, "{stats:?}");
    let swept = gc::gc(&store, Duration::ZERO).expect("gc");
    assert_eq!(
        swept.dead_kept, 20,
        "dead blocks below the share stay: {swept:?}"
    );
    assert!(
        swept.packs_deleted >= 1,
        "the old trees' pack went: {swept:?}"
    );
    assert_verify_ok(&store);

    // Half the files change: their pack passes the share and is rewritten.
    for (path, content) in files.iter_mut().step_by(2) {
        content.extend_from_slice(path.as_bytes());
    }
    write(&files);
    push(&store, &acme, &home("h"), src.path()).expect("push");
    let before = gc::stats(&store).expect("stats");
    assert!(before[0].repack_candidates >= 1, "{before:?}");
    let swept = gc::gc(&store, Duration::ZERO).expect("gc");
    assert!(
        swept.packs_written >= 1 && swept.bytes_copied > 0,
        "{swept:?}"
    );
    assert!(swept.deleted >= 200, "{swept:?}");
    let after = gc::stats(&store).expect("stats");
    assert!(
        after[0].dead_bytes < before[0].dead_bytes,
        "{before:?} {after:?}"
    );
    assert_verify_ok(&store);
    assert_present_trees_are_complete(&store);
    let dest = tempdir();
    pull(&store, &acme, &home("h"), dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
}

/// A reader whose index names a pack gc has since rewritten reads the
/// object from the new pack (it lists the packs again), never fails.
#[test]
fn a_reader_whose_pack_was_rewritten_finds_the_new_one() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let store = Store::new(Arc::clone(&backend));
    let acme = org("acme");
    // Files to keep and to drop, interleaved: every blocks pack holds both.
    let files: Vec<(String, Vec<u8>)> = (0..20)
        .map(|i| {
            let name = if i % 2 == 0 { "keep" } else { "go" };
            (format!("{name}{i}.txt"), format!("{name} {i}").into_bytes())
        })
        .collect();
    let keep = home_dir(&refs(&files));
    push(&store, &acme, &home("h"), keep.path()).expect("push");
    for (path, _) in files.iter().skip(1).step_by(2) {
        std::fs::remove_file(keep.path().join(path)).expect("rm");
    }
    push(&store, &acme, &home("h"), keep.path()).expect("push");
    let reader = Store::new(Arc::clone(&backend));
    let root = reader
        .read_home(&acme, &home("h"))
        .expect("read")
        .expect("h");
    let live: Vec<ObjectId> = reachable(&reader, &acme, root).into_iter().collect();
    let swept = gc::gc(&store, Duration::ZERO).expect("gc");
    assert!(swept.packs_written >= 1, "a pack was rewritten: {swept:?}");
    for object in &live {
        reader
            .get_object(&acme, object)
            .expect("read from the new pack");
    }
    let dest = tempdir();
    pull(&reader, &acme, &home("h"), dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(keep.path()));
}

/// The first (only) pack holding `object`, as (pack, its index).
fn pack_holding(store: &Store, org: &OrgId, object: &ObjectId) -> PackId {
    store
        .locate(org, object)
        .expect("locate")
        .expect("packed")
        .pack
}

/// A truncated pack: pull fails naming the object's path and the pack,
/// verify names the object and the pack; nothing is written as data.
#[test]
fn a_truncated_pack_is_named_by_pull_and_verify() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let store = Store::new(Arc::clone(&backend));
    let acme = org("acme");
    let src = home_dir(&[("a.txt", b"first file"), ("b.bin", &[3u8; 5000])]);
    let root = push(&store, &acme, &home("h"), src.path())
        .expect("push")
        .root
        .expect("root");
    let tree = store.get_tree(&acme, &root).expect("root");
    let Some(store::tree::EntryKind::File { blocks }) = tree
        .entries
        .iter()
        .find(|e| e.name == b"b.bin")
        .map(|e| e.kind.clone())
    else {
        panic!("b.bin is a file");
    };
    let block = ObjectId::block(blocks[0]);
    let pack = pack_holding(&store, &acme, &block);
    let key = Store::pack_key(&acme, &pack, PackPart::Data);
    let bytes = backend.get(&key).expect("get").expect("pack");
    backend
        .put(&key, &bytes[..bytes.len() - 2])
        .expect("truncate");

    let fresh = Store::new(Arc::clone(&backend));
    let dest = tempdir();
    let err = pull(&fresh, &acme, &home("h"), dest.path()).expect_err("truncated");
    let message = err.to_string();
    assert!(
        matches!(err, Error::Corrupt { .. })
            && message.contains("truncated pack")
            && message.contains(&pack.to_hex())
            && message.contains("b.bin"),
        "{message}"
    );
    assert!(!dest.path().join("b.bin").exists());
    let report = gc::verify(&fresh).expect("verify runs");
    let name = block.digest.to_hex();
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.contains(&pack.to_hex()) && e.contains(&name)),
        "{:?}",
        report.errors
    );
    assert!(
        report.errors.iter().any(|e| e.contains("b.bin")),
        "{:?}",
        report.errors
    );
}

/// Rewrites `pack`'s index with `lie` applied (a valid checksum: a lie,
/// not a torn write).
fn lie_in_index(backend: &dyn Backend, org: &OrgId, pack: &PackId, lie: impl Fn(&mut PackIndex)) {
    let key = Store::pack_key(org, pack, PackPart::Index);
    let bytes = backend.get(&key).expect("get").expect("index");
    let mut index = store::pack::decode_index(org, pack, &bytes).expect("sound");
    lie(&mut index);
    backend
        .put(&key, &store::pack::encode_index(org, &index))
        .expect("put");
}

/// An index that lies (an offset past the pack's end, overlapping ranges)
/// is refused: its objects count as absent (a missing-check says so, so a
/// push that needs them uploads them again), nothing is read through it,
/// gc keeps the pack, and verify names the pack and the object of the lie.
#[test]
fn lying_indexes_are_refused_and_nothing_is_read_through_them() {
    for lie in ["past the end", "overlapping"] {
        let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
        let store = Store::new(Arc::clone(&backend));
        let acme = org("acme");
        let files = many_files("f", 20, 500);
        let src = home_dir(&refs(&files));
        let root = push(&store, &acme, &home("h"), src.path())
            .expect("push")
            .root
            .expect("root");
        let objects: Vec<ObjectId> = reachable(&store, &acme, root).into_iter().collect();
        let packs = packs_of(backend.as_ref(), &acme);
        let blocks_pack = packs
            .iter()
            .max_by_key(|p| p.entries.len())
            .expect("a pack");
        assert!(blocks_pack.entries.len() >= 2);
        let victim = blocks_pack.entries[1].object;
        lie_in_index(
            backend.as_ref(),
            &acme,
            &blocks_pack.pack,
            |index| match lie {
                "past the end" => index.entries[1].offset = index.pack_bytes + 10,
                _ => index.entries[1].offset -= 1,
            },
        );

        let fresh = Store::new(Arc::clone(&backend));
        let missing = fresh.missing(&acme, &objects).expect("missing");
        assert!(
            missing.contains(&victim),
            "{lie}: the lying pack's objects are absent"
        );
        let report = gc::verify(&fresh).expect("verify runs");
        assert!(
            report
                .errors
                .iter()
                .any(|e| e.contains(&blocks_pack.pack.to_hex())
                    && e.contains("index refused")
                    && e.contains(&victim.digest.to_hex())),
            "{lie}: {:?}",
            report.errors
        );
        // gc keeps what it cannot read; a push repairs the home.
        let swept = gc::gc(&fresh, Duration::ZERO).expect("gc");
        assert_eq!(swept.packs_refused, 1, "{lie}: {swept:?}");
        assert!(
            backend
                .head(&Store::pack_key(&acme, &blocks_pack.pack, PackPart::Data))
                .expect("head")
                .is_some(),
            "{lie}: gc removed a pack it could not read"
        );
        // Nothing is read through it: the home's objects there are missing
        // (a hole `verify` names, as for any lost object), never data.
        let dest = tempdir();
        match pull(
            &Store::new(Arc::clone(&backend)),
            &acme,
            &home("h"),
            dest.path(),
        ) {
            Err(Error::MissingObject { path: Some(_), .. }) => {}
            other => panic!("{lie}: expected a missing object at a path, got {other:?}"),
        }
    }
}

/// A pack without its index (a writer killed between the two, or an index
/// lost): its objects are absent, so the next push uploads them again
/// and commits a whole home; gc removes the torn pack once it is older
/// than the grace period, and keeps it while it is younger.
#[test]
fn a_pack_without_its_index_is_invisible_and_collected_when_old() {
    let inner = Arc::new(MemoryBackend::default());
    let backend: Arc<dyn Backend> = inner.clone();
    let store = Store::new(Arc::clone(&backend));
    let acme = org("acme");
    let src = home_dir(&[("a.txt", b"alpha"), ("b.txt", b"beta")]);
    push(&store, &acme, &home("h"), src.path()).expect("push");
    // Every index gone: the home points at objects no one can find.
    let torn: Vec<PackId> = packs_of(backend.as_ref(), &acme)
        .iter()
        .map(|p| p.pack)
        .collect();
    for pack in &torn {
        backend
            .delete(&Store::pack_key(&acme, pack, PackPart::Index))
            .expect("delete index");
    }
    let fresh = Store::new(Arc::clone(&backend));
    let dest = tempdir();
    assert!(matches!(
        pull(&fresh, &acme, &home("h"), dest.path()),
        Err(Error::MissingObject { .. })
    ));
    let again = push(&fresh, &acme, &home("h"), src.path()).expect("the next push recovers");
    assert!(again.blocks_uploaded == 2 || again.unchanged, "{again:?}");
    // The pointer already named this root: the push found it unchanged
    // and uploaded nothing, so a push of another home uploads the objects.
    push(&fresh, &acme, &home("h2"), src.path()).expect("push");
    let dest = tempdir();
    pull(
        &Store::new(Arc::clone(&backend)),
        &acme,
        &home("h"),
        dest.path(),
    )
    .expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));

    let kept = gc::gc(&fresh, gc::DEFAULT_GRACE).expect("gc");
    assert_eq!(
        kept.packs_deleted, 0,
        "a young torn pack may be a writer's: {kept:?}"
    );
    let swept = gc::gc(&fresh, Duration::ZERO).expect("gc");
    assert!(swept.packs_deleted >= torn.len() as u64, "{swept:?}");
    for pack in &torn {
        assert!(
            backend
                .head(&Store::pack_key(&acme, pack, PackPart::Data))
                .expect("head")
                .is_none()
        );
    }
    assert_verify_ok(&fresh);
}

/// An index copied into another org's prefix (naming that org's pack)
/// is refused there: no org reads another's objects through it.
#[test]
fn an_index_naming_another_orgs_pack_is_refused() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let store = Store::new(Arc::clone(&backend));
    let (acme, evil) = (org("acme"), org("evil"));
    let src = home_dir(&[("secret.txt", b"acme's secret")]);
    let root = push(&store, &acme, &home("h"), src.path())
        .expect("push")
        .root
        .expect("root");
    let objects: Vec<ObjectId> = reachable(&store, &acme, root).into_iter().collect();
    for index in packs_of(backend.as_ref(), &acme) {
        for part in [PackPart::Data, PackPart::Index] {
            let bytes = backend
                .get(&Store::pack_key(&acme, &index.pack, part))
                .expect("get")
                .expect("present");
            backend
                .put(&Store::pack_key(&evil, &index.pack, part), &bytes)
                .expect("copy");
        }
    }
    let fresh = Store::new(Arc::clone(&backend));
    let mut missing = fresh.missing(&evil, &objects).expect("missing");
    missing.sort();
    let mut all = objects.clone();
    all.sort();
    assert_eq!(
        missing, all,
        "evil sees acme's objects through a copied index"
    );
    assert!(matches!(
        fresh.get_object(&evil, &ObjectId::tree(root)),
        Err(Error::MissingObject { .. })
    ));
    let report = gc::verify(&fresh).expect("verify");
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.starts_with("evil: pack") && e.contains("org \"acme\"")),
        "{:?}",
        report.errors
    );
}

/// The gc/push race on packs: b pushes content a has just dropped, and a
/// gc runs between b's upload and its commit, rewriting the mixed packs
/// (live objects copied, a's old ones dropped, some of which b found
/// present and relies on). b's commit finds them gone under the commit
/// lock, uploads them again and commits a whole home (or says
/// `CommitRaced`, and a retry does).
#[test]
fn a_push_relying_on_objects_a_pack_rewrite_drops_uploads_them_again() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let store = Store::new(Arc::clone(&backend));
    let acme = org("acme");
    let old = many_files("src", 40, 800);
    let mut new = old.clone();
    for (path, content) in new.iter_mut().step_by(2) {
        content.extend_from_slice(path.as_bytes());
    }
    let old_dir = home_dir(&refs(&old));
    push(&store, &acme, &home("a"), old_dir.path()).expect("push a (old)");
    push(&store, &acme, &home("a"), home_dir(&refs(&new)).path()).expect("push a (new)");

    let reports = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&reports);
    let gc_store = Store::new(Arc::clone(&backend));
    let mut options = crate::support::push_options();
    options.before_commit = Some(Box::new(move || {
        let report = gc::gc(&gc_store, Duration::ZERO).expect("gc between upload and commit");
        seen.lock().expect("lock").push(report);
    }));
    let b_dir = home_dir(&refs(&old));
    let raced = store::push::push(
        &store,
        &acme,
        &home("b"),
        b_dir.path(),
        &options,
        &store::progress::NoProgress,
    );
    let report = reports.lock().expect("lock")[0].clone();
    assert!(
        report.deleted > 0 && report.packs_written > 0,
        "gc rewrote mixed packs: {report:?}"
    );
    match raced {
        Ok(_) => {}
        Err(Error::CommitRaced) => {
            push(&store, &acme, &home("b"), b_dir.path()).expect("the retry commits");
        }
        Err(other) => panic!("unexpected {other}"),
    }
    assert_verify_ok(&store);
    assert_present_trees_are_complete(&store);
    let dest = tempdir();
    pull(&Store::new(backend), &acme, &home("b"), dest.path()).expect("pull b");
    assert_eq!(contents(dest.path()), contents(b_dir.path()));
}

/// The org's index from the local cache: a new process with the cache
/// reads no index from the store; with the cache lost, it reads them again
/// (and keeps them again); a damaged merged index is rebuilt from the
/// store, never trusted.
#[test]
fn the_index_cache_serves_a_new_process_and_is_rebuilt_when_lost() {
    let double = Double::new(Arc::new(MemoryBackend::default()));
    let acme = org("acme");
    let src = home_dir(&refs(&many_files("f", 200, 1000)));
    let root = push(&Store::new(double.clone()), &acme, &home("h"), src.path())
        .expect("push")
        .root
        .expect("root");
    let packs = packs_of(double.as_ref(), &acme).len();
    let cache = tempdir();
    let index_reads = |expected: usize, what: &str| {
        double.arm(Faults::default());
        let store = Store::new(double.clone()).with_index_cache(cache.path().join("store"));
        assert!(
            store
                .missing(&acme, &[ObjectId::tree(root)])
                .expect("missing")
                .is_empty()
        );
        let read: usize = double.get_batches().iter().sum();
        assert_eq!(read, expected, "{what}");
    };
    index_reads(packs, "a first process reads every index");
    index_reads(0, "the next reads them from the cache");
    std::fs::remove_dir_all(cache.path().join("store")).expect("lose the cache");
    index_reads(packs, "a lost cache is rebuilt from the store");
    // The cache holds the org's merged index (the copies of the indexes
    // it merged are pruned): damaged, it is rebuilt from the store.
    let merged = cache.path().join("store/acme/merged.midx");
    std::fs::write(&merged, b"damaged").expect("damage");
    index_reads(packs, "a damaged merged index is rebuilt");
}

/// `count` small objects (every fifth a tree by name: the kind is part of
/// an object's name in the index) with their stored bytes.
fn small_objects(seed: &str, count: usize) -> Vec<(ObjectId, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let plain = format!("{seed} object {i}").into_bytes();
            let digest = store::Digest::of(&plain);
            let object = if i % 5 == 0 {
                ObjectId::tree(digest)
            } else {
                ObjectId::block(digest)
            };
            (object, store::block::encode(&plain))
        })
        .collect()
}

/// Writes `objects` as packs of `per_pack`, one `write_packs` each.
fn write_in_packs(
    store: &Store,
    org: &OrgId,
    objects: &[(ObjectId, Vec<u8>)],
    per_pack: usize,
) -> Vec<PackIndex> {
    objects
        .chunks(per_pack)
        .flat_map(|chunk| {
            let refs: Vec<(ObjectId, &[u8])> = chunk
                .iter()
                .map(|(object, stored)| (*object, stored.as_slice()))
                .collect();
            store.write_packs(org, &refs, None).expect("write packs")
        })
        .collect()
}

/// Asserts `store` locates every entry of `indexes` where it is, and reads
/// a sample of them back.
fn assert_located(store: &Store, org: &OrgId, indexes: &[PackIndex]) {
    for index in indexes {
        for entry in &index.entries {
            assert_eq!(
                store.locate(org, &entry.object).expect("locate"),
                Some(store::store::Location {
                    pack: index.pack,
                    offset: entry.offset,
                    length: entry.length,
                }),
                "{:?}",
                entry.object
            );
        }
        let first = index.entries[0].object;
        store.get_object(org, &first).expect("reads back");
    }
}

/// Issue 18, point 2 at scale: the org's index is a merged file sorted by
/// object (not a map in memory); every object of hundreds of packs is
/// found through it, where it is, blocks and trees apart; absent objects
/// and other orgs' are not.
#[test]
fn lookups_through_the_merged_index_find_every_object_across_many_packs() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let acme = org("acme");
    let objects = small_objects("many", 20_000);
    let written = write_in_packs(&Store::new(Arc::clone(&backend)), &acme, &objects, 100);
    assert_eq!(written.len(), 200);
    // One object stored twice (two pushes racing): either copy is right.
    let (twice, stored) = &objects[7];
    let copy = Store::new(Arc::clone(&backend))
        .write_packs(&acme, &[(*twice, stored.as_slice())], None)
        .expect("a second copy");

    let cache = tempdir();
    let store = Store::new(Arc::clone(&backend)).with_index_cache(cache.path().to_owned());
    let ids: Vec<ObjectId> = objects.iter().map(|(object, _)| *object).collect();
    assert!(store.missing(&acme, &ids).expect("missing").is_empty());
    let stats = store.index_stats(&acme);
    assert_eq!(
        (
            stats.merged_packs,
            stats.merged_entries,
            stats.overlay_objects
        ),
        (201, 20_001, 0),
        "every entry in the merged file, none in memory"
    );
    let first_copy: Vec<PackIndex> = written
        .iter()
        .map(|index| PackIndex {
            entries: index
                .entries
                .iter()
                .filter(|entry| entry.object != *twice)
                .copied()
                .collect(),
            ..index.clone()
        })
        .collect();
    assert_located(&store, &acme, &first_copy);
    let at = store.locate(&acme, twice).expect("locate").expect("found");
    assert!(at.pack == copy[0].pack || written.iter().any(|i| i.pack == at.pack));

    let absent = small_objects("absent", 2_000);
    let absent_ids: Vec<ObjectId> = absent.iter().map(|(object, _)| *object).collect();
    assert_eq!(
        store.missing(&acme, &absent_ids).expect("missing"),
        absent_ids
    );
    // The same digest as the other kind is another object.
    let other_kind: Vec<ObjectId> = ids[..50]
        .iter()
        .map(|object| match object.kind {
            store::store::ObjectKind::Block => ObjectId::tree(object.digest),
            store::store::ObjectKind::Tree => ObjectId::block(object.digest),
        })
        .collect();
    assert_eq!(
        store.missing(&acme, &other_kind).expect("missing"),
        other_kind
    );
    assert_eq!(
        store.missing(&org("other"), &ids[..10]).expect("missing"),
        ids[..10].to_vec()
    );
    let read = store.get_batch(&acme, &ids[..2_000]).expect("batch");
    for ((object, stored), bytes) in objects.iter().zip(read) {
        assert_eq!(bytes.as_deref(), Some(stored.as_slice()), "{object:?}");
    }
}

/// The merged file is a cache never trusted without its checksum: one
/// with an entry's offset altered, one cut short, one of another org and
/// an empty one are each rebuilt (to the same bytes), and every answer
/// meanwhile is right.
#[test]
fn a_damaged_truncated_or_foreign_merged_index_is_rebuilt_and_answers_stay_right() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let acme = org("acme");
    let written = write_in_packs(
        &Store::new(Arc::clone(&backend)),
        &acme,
        &small_objects("acme", 1_500),
        50,
    );
    let cache = tempdir();
    let cached = || Store::new(Arc::clone(&backend)).with_index_cache(cache.path().to_owned());
    assert_located(&cached(), &acme, &written);
    let path = cached().merged_index_path(&acme);
    let good = std::fs::read(&path).expect("a merged index was written");

    let other = org("other");
    write_in_packs(
        &Store::new(Arc::clone(&backend)),
        &other,
        &small_objects("other", 300),
        50,
    );
    assert!(cached().missing(&other, &[]).expect("list").is_empty());
    let foreign = std::fs::read(cached().merged_index_path(&other)).expect("other's");

    // Entry 0's offset, past the header (magic, version, org, packs).
    let entry_offset = 7 + "acme".len() + 4 + 16 * written.len() + 37;
    let mut altered = good.clone();
    altered[entry_offset] ^= 0x40;
    let damages: [(&str, Vec<u8>); 4] = [
        ("an altered entry", altered),
        ("cut short", good[..good.len() / 2].to_vec()),
        ("another org's", foreign),
        ("empty", Vec::new()),
    ];
    for (what, bytes) in damages {
        std::fs::write(&path, &bytes).expect("damage");
        let store = cached();
        assert_located(&store, &acme, &written);
        assert_eq!(
            store.index_stats(&acme).merged_packs,
            written.len(),
            "{what}"
        );
        assert!(
            std::fs::read(&path).expect("rebuilt") == good,
            "{what}: rebuilt"
        );
    }
}

/// gc rewrites mixed packs (removing the old ones) after a process wrote
/// the merged file: neither a later process reading that stale file nor
/// the process that wrote it (once it lists again) locates anything in a
/// removed pack, the file is rebuilt without them, and the home reads
/// whole.
#[test]
fn a_pack_gc_removed_is_never_located_through_a_stale_merged_index() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let acme = org("acme");
    let old = many_files("src", 40, 800);
    let mut new = old.clone();
    for (path, content) in new.iter_mut().step_by(2) {
        content.extend_from_slice(path.as_bytes());
    }
    let plain = Store::new(Arc::clone(&backend));
    push(&plain, &acme, &home("a"), home_dir(&refs(&old)).path()).expect("push old");
    let new_dir = home_dir(&refs(&new));
    push(&plain, &acme, &home("a"), new_dir.path()).expect("push new");

    let cache = tempdir();
    let cached = || Store::new(Arc::clone(&backend)).with_index_cache(cache.path().to_owned());
    let first = cached();
    assert!(first.missing(&acme, &[]).expect("list").is_empty());
    let before = packs_of(backend.as_ref(), &acme);
    let path = first.merged_index_path(&acme);
    let stale = std::fs::read(&path).expect("merged");

    let report = gc::gc(&Store::new(Arc::clone(&backend)), Duration::ZERO).expect("gc");
    assert!(report.deleted > 0 && report.packs_written > 0, "{report:?}");
    let listed: std::collections::HashSet<PackId> = packs_of(backend.as_ref(), &acme)
        .iter()
        .map(|index| index.pack)
        .collect();
    let gone: Vec<&PackIndex> = before
        .iter()
        .filter(|index| !listed.contains(&index.pack))
        .collect();
    assert!(!gone.is_empty(), "gc removed packs");
    assert!(
        std::fs::read(&path).expect("merged") == stale,
        "still stale"
    );

    // A later process opens the stale file; then the one that wrote it
    // lists again.
    let later = cached();
    for store in [&later, &first] {
        assert!(store.missing(&acme, &[]).expect("list").is_empty());
        for index in &gone {
            for entry in &index.entries {
                if let Some(at) = store.locate(&acme, &entry.object).expect("locate") {
                    assert!(
                        listed.contains(&at.pack),
                        "located in removed pack {}",
                        at.pack
                    );
                }
            }
        }
    }
    let rebuilt = store::midx::MergedIndex::open(&path, &acme)
        .expect("sound")
        .expect("there");
    assert!(rebuilt.packs().iter().all(|pack| listed.contains(pack)));
    assert_eq!(rebuilt.packs().len(), listed.len());
    let dest = tempdir();
    pull(&cached(), &acme, &home("a"), dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(new_dir.path()));
}

/// A new process answers from the merged file alone: the first reads
/// every pack index from the store once and merges them (keeping no copy
/// of them), the next reads none and holds no entry in memory, and after
/// another process adds a pack, the next reads that one index only.
#[test]
fn a_new_process_reads_the_merged_index_not_every_pack_index() {
    let double = Double::new(Arc::new(MemoryBackend::default()));
    let acme = org("acme");
    let objects = small_objects("n", 800);
    write_in_packs(&Store::new(double.clone()), &acme, &objects, 20);
    let ids: Vec<ObjectId> = objects.iter().map(|(object, _)| *object).collect();
    let cache = tempdir();
    let index_reads = |expected: usize, what: &str| -> store::store::IndexStats {
        double.arm(Faults::default());
        let store = Store::new(double.clone()).with_index_cache(cache.path().to_owned());
        assert!(store.missing(&acme, &ids).expect("missing").is_empty());
        let read: usize = double.get_batches().iter().sum();
        assert_eq!(read, expected, "{what}");
        store.index_stats(&acme)
    };
    index_reads(40, "the first process reads every index");
    let names: Vec<String> = std::fs::read_dir(cache.path().join("acme"))
        .expect("cache")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .into_string()
                .expect("utf-8")
        })
        .collect();
    assert_eq!(names, ["merged.midx"], "only the merged file is kept");
    let stats = index_reads(0, "the next reads none");
    assert_eq!(
        (stats.merged_entries, stats.overlay_objects),
        (800, 0),
        "all through the file"
    );
    let more = small_objects("more", 20);
    write_in_packs(&Store::new(double.clone()), &acme, &more, 20);
    let stats = index_reads(1, "only the pack not merged yet");
    assert_eq!((stats.merged_entries, stats.overlay_objects), (800, 20));
    index_reads(0, "its copy is kept until merged");
}

/// The in-memory overlay (packs written or listed since the file was
/// merged) stays within its bound: past it, its packs are merged into
/// the file, by this process's own writes and by a listing that finds
/// many new packs; everything stays found, here and in a new process.
#[test]
fn the_overlay_is_merged_into_the_file_once_past_its_bound() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let acme = org("acme");
    let cache = tempdir();
    let cached = || {
        Store::new(Arc::clone(&backend))
            .with_index_cache(cache.path().to_owned())
            .with_overlay_max(100)
    };
    let store = cached();
    let mut written = Vec::new();
    for round in 0..10 {
        let objects = small_objects(&format!("round {round}"), 30);
        written.extend(write_in_packs(&store, &acme, &objects, 30));
        let stats = store.index_stats(&acme);
        assert!(stats.overlay_objects <= 100, "round {round}: {stats:?}");
        // Never more room than the bound and the pack past it need.
        assert!(
            stats.overlay_capacity <= 2 * 130,
            "round {round}: {stats:?}"
        );
        assert_eq!(
            stats.merged_entries as usize + stats.overlay_objects,
            30 * (round + 1)
        );
    }
    let stats = store.index_stats(&acme);
    assert!(stats.merged_entries >= 200, "merged: {stats:?}");
    let on_disk = store::midx::MergedIndex::open(&store.merged_index_path(&acme), &acme)
        .expect("sound")
        .expect("there");
    assert_eq!(on_disk.len(), stats.merged_entries);
    assert_located(&store, &acme, &written);

    // Another writer adds 150 objects: this process's next listing merges.
    let objects = small_objects("elsewhere", 150);
    written.extend(write_in_packs(
        &Store::new(Arc::clone(&backend)),
        &acme,
        &objects,
        30,
    ));
    assert!(store.missing(&acme, &[]).expect("list").is_empty());
    let stats = store.index_stats(&acme);
    assert_eq!((stats.merged_entries, stats.overlay_objects), (450, 0));
    // The emptied overlay gives its table back.
    assert_eq!(stats.overlay_capacity, 0, "{stats:?}");
    assert_located(&store, &acme, &written);
    assert_located(&cached(), &acme, &written);
}

/// A cache directory that cannot be written (here a file stands where it
/// should be) costs memory, never answers: the index stays whole in
/// memory, as before merged files, and pushes and pulls work.
#[test]
fn an_unwritable_index_cache_keeps_the_index_in_memory() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let acme = org("acme");
    let written = write_in_packs(
        &Store::new(Arc::clone(&backend)),
        &acme,
        &small_objects("w", 300),
        30,
    );
    let blocked = tempdir();
    let not_a_dir = blocked.path().join("cache");
    std::fs::write(&not_a_dir, b"a file").expect("file");
    let store = Store::new(Arc::clone(&backend)).with_index_cache(not_a_dir.clone());
    assert_located(&store, &acme, &written);
    let stats = store.index_stats(&acme);
    assert_eq!((stats.merged_entries, stats.overlay_objects), (0, 300));

    let src = home_dir(&refs(&many_files("u", 30, 500)));
    push(&store, &acme, &home("h"), src.path()).expect("push");
    let dest = tempdir();
    pull(&store, &acme, &home("h"), dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
    assert_eq!(std::fs::read(&not_a_dir).expect("still a file"), b"a file");
}

/// A pull on a fresh machine of a home of many small directories reads
/// the store in pack order: one ranged read per pack (not one per pack
/// per directory window), so its requests stay within the bound
/// of stored bytes / 4 MiB plus a constant, the constant here scaled to
/// the home: one read per pack index, one per pack, one per tree level.
/// (Directory by directory, this home took 20 reads.)
#[test]
fn a_fresh_pull_of_many_directories_reads_each_pack_about_once() {
    let double = Double::batching(Arc::new(MemoryBackend::default()));
    let acme = org("acme");
    // 2,400 files of ~3 KB in 600 leaf directories under 150 others.
    let files: Vec<(String, Vec<u8>)> = many_files("x", 2400, 3000)
        .into_iter()
        .enumerate()
        .map(|(i, (_, content))| {
            let path = format!("t{}/m{}/l{}/f{i}", i % 6, (i / 6) % 25, (i / 150) % 4);
            (path, content)
        })
        .collect();
    let src = home_dir(&refs(&files));
    push(&Store::new(double.clone()), &acme, &home("h"), src.path()).expect("push");
    let packs = packs_of(double.as_ref(), &acme).len() as u64;
    let stored: u64 = double
        .list(&Store::packs_prefix(&acme))
        .expect("list")
        .iter()
        .map(|meta| meta.size)
        .sum();
    double.arm(Faults::default());
    let dest = tempdir();
    let report = pull(&Store::new(double.clone()), &acme, &home("h"), dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
    assert_eq!(report.files_written, 2400);
    // Tree levels: the root, t*, m*, l*.
    let levels = 4;
    let bound = 2 * packs + levels;
    assert!(
        double.read_requests() <= bound,
        "{} read requests for {stored} bytes in {packs} packs (bound {bound})",
        double.read_requests()
    );
}

/// The block service as a pull sees it: it does not say where objects
/// lie, and answers a batch in the order asked. Records that order.
struct Unlocated {
    store: Store,
    asked: Mutex<Vec<ObjectId>>,
}

impl Objects for Unlocated {
    fn missing(&self, org: &OrgId, objects: &[ObjectId]) -> store::Result<Vec<ObjectId>> {
        self.store.missing(org, objects)
    }

    fn put_batch(&self, org: &OrgId, objects: &[(ObjectId, &[u8])]) -> store::Result<()> {
        self.store.put_batch(org, objects)
    }

    fn get(&self, org: &OrgId, object: &ObjectId) -> store::Result<Option<Vec<u8>>> {
        self.store.get(org, object)
    }

    fn get_batch(&self, org: &OrgId, objects: &[ObjectId]) -> store::Result<Vec<Option<Vec<u8>>>> {
        self.asked.lock().expect("lock").extend_from_slice(objects);
        self.store.get_batch(org, objects)
    }

    fn reads_in_batches(&self) -> bool {
        true
    }
}

/// Issue 18: a fresh pull from a store that does not say where objects
/// lie (the block service) asks for the blocks in the order of its walk
/// (directories depth first, entries by name: the push's order), so that
/// each part it writes holds a few directories' files, as a pull from a
/// store that knows where they lie does. (In hash order every part was
/// spread over every directory of its window.)
#[test]
fn a_fresh_pull_from_the_block_service_asks_for_blocks_in_walk_order() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::default());
    let acme = org("acme");
    // 400 files of ~1.5 KB in seven directories: one window.
    let files = many_files("w", 400, 1500);
    let src = home_dir(&refs(&files));
    let root = push(
        &Store::new(Arc::clone(&backend)),
        &acme,
        &home("h"),
        src.path(),
    )
    .expect("push")
    .root
    .expect("a root");
    let unlocated = Unlocated {
        store: Store::new(backend),
        asked: Mutex::default(),
    };
    let dest = tempdir();
    store::pull::materialize(
        &unlocated,
        &acme,
        "h",
        &root,
        dest.path(),
        &crate::support::pull_options(),
        &store::progress::NoProgress,
    )
    .expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));

    let mut walk: Vec<&(String, Vec<u8>)> = files.iter().collect();
    walk.sort_by(|a, b| a.0.split('/').cmp(b.0.split('/')));
    let expected: Vec<ObjectId> = walk
        .iter()
        .map(|(_, content)| ObjectId::block(store::Digest::of(content)))
        .collect();
    let asked: Vec<ObjectId> = unlocated
        .asked
        .into_inner()
        .expect("lock")
        .into_iter()
        .filter(|object| object.kind == store::store::ObjectKind::Block)
        .collect();
    // Each block's place in the walk, in the order asked.
    let place: std::collections::HashMap<ObjectId, usize> =
        expected.iter().enumerate().map(|(i, o)| (*o, i)).collect();
    let order: Vec<usize> = asked.iter().map(|object| place[object]).collect();
    assert_eq!(order.len(), expected.len(), "each block asked for once");
    assert!(
        order.is_sorted(),
        "blocks asked for out of the walk's order: {:?}",
        &order[..order.len().min(20)]
    );
}

const SPLIT_BLOCK: usize = 4 * 1024 * 1024;

/// `len` bytes of lines naming `seed`: each 4 MiB block distinct from
/// every other, and compressible, so that several share a pack.
fn split_content(seed: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 64);
    let mut line = 0u64;
    while out.len() < len {
        out.extend_from_slice(format!("file {seed} line {line}\n").as_bytes());
        line += 1;
    }
    out.truncate(len);
    out
}

/// Issue 18: a pull on a fresh machine reads the blocks of files of
/// several 4 MiB blocks in the same pack windows as small files, so each
/// pack is read about once (one block per request made the blocks of the
/// generated home's large files alone more requests than the bound of
/// stored bytes / 4 MiB). The home: small files in many directories,
/// six files of three blocks, and one with a hole (an all-zero block,
/// never fetched) and a block repeated.
#[test]
fn a_fresh_pull_reads_split_files_in_the_same_pack_windows() {
    let double = Double::batching(Arc::new(MemoryBackend::default()));
    let acme = org("acme");
    let mut files: Vec<(String, Vec<u8>)> = many_files("x", 600, 2000)
        .into_iter()
        .enumerate()
        .map(|(i, (_, content))| (format!("t{}/m{}/f{i}", i % 6, (i / 6) % 25), content))
        .collect();
    for f in 0..6 {
        files.push((
            format!("t{f}/big{f}"),
            split_content(f, 2 * SPLIT_BLOCK + 1000 * (f + 1)),
        ));
    }
    let mut sparse = split_content(100, 4 * SPLIT_BLOCK + 5);
    sparse[SPLIT_BLOCK..2 * SPLIT_BLOCK].fill(0);
    sparse.copy_within(0..SPLIT_BLOCK, 3 * SPLIT_BLOCK);
    files.push(("sparse".to_owned(), sparse));
    let src = home_dir(&refs(&files));
    push(&Store::new(double.clone()), &acme, &home("h"), src.path()).expect("push");
    let packs = packs_of(double.as_ref(), &acme).len() as u64;
    let stored: u64 = double
        .list(&Store::packs_prefix(&acme))
        .expect("list")
        .iter()
        .map(|meta| meta.size)
        .sum();

    double.arm(Faults::default());
    let dest = tempdir();
    let report = pull(&Store::new(double.clone()), &acme, &home("h"), dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
    assert_eq!(report.files_written, 607);
    // Each pack's index and its data once, the home pointer, and the
    // trees: the root, then t* with m*'s parents, then m*.
    let levels = 3;
    let bound = 2 * packs + 1 + levels;
    assert!(
        double.read_requests() <= bound,
        "{} read requests for {stored} bytes in {packs} packs (bound {bound})",
        double.read_requests()
    );
    let sparse = std::fs::metadata(dest.path().join("sparse")).expect("sparse");
    assert_eq!(sparse.len(), 4 * SPLIT_BLOCK as u64 + 5);
    assert!(
        std::os::unix::fs::MetadataExt::blocks(&sparse) * 512 < 4 * SPLIT_BLOCK as u64,
        "the zero block is a hole"
    );
}

/// A fresh pull whose split file has a corrupt block fails naming the
/// file, and leaves neither the file under its name nor a temporary.
#[test]
fn a_fresh_pull_with_a_corrupt_block_of_a_split_file_leaves_nothing_half_written() {
    let double = Double::batching(Arc::new(MemoryBackend::default()));
    let store = Store::new(double.clone());
    let acme = org("acme");
    let big = split_content(7, 2 * SPLIT_BLOCK + 3);
    let src = home_dir(&[("small", b"small file"), ("d/big", &big)]);
    let root = push(&store, &acme, &home("h"), src.path())
        .expect("push")
        .root
        .expect("root");
    let tree = store.get_tree(&acme, &root).expect("root");
    let Some(store::tree::EntryKind::Dir { tree: d }) = tree
        .entries
        .iter()
        .find(|e| e.name == b"d")
        .map(|e| e.kind.clone())
    else {
        panic!("d is a directory");
    };
    let Some(store::tree::EntryKind::File { blocks }) = store
        .get_tree(&acme, &d)
        .expect("d")
        .entries
        .first()
        .map(|e| e.kind.clone())
    else {
        panic!("big is a file");
    };
    crate::support::corrupt_stored(&store, &acme, &ObjectId::block(blocks[2]));

    let dest = tempdir();
    let err = pull(&Store::new(double.clone()), &acme, &home("h"), dest.path())
        .expect_err("a corrupt block");
    assert!(
        matches!(err, Error::Corrupt { .. }) && err.to_string().contains("d/big"),
        "{err}"
    );
    let names: Vec<String> = std::fs::read_dir(dest.path().join("d"))
        .expect("d was created")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert!(names.is_empty(), "left in d: {names:?}");
}

/// Regular files of exactly `size` bytes anywhere under `dir`.
fn files_of_size(dir: &std::path::Path, size: u64) -> usize {
    let mut count = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => stack.push(entry.path()),
                Ok(kind) if kind.is_file() => {
                    count += usize::from(entry.metadata().is_ok_and(|m| m.len() == size));
                }
                _ => {}
            }
        }
    }
    count
}

/// A batch handed on as it arrives (`Objects::get_batch_each`) is the
/// batch: every object once, the bytes `get_batch` gives, objects larger
/// than the pieces a read arrives in (64 KiB here) and ones sharing a
/// piece alike, and objects are handed on before their read has ended.
#[test]
fn a_batch_handed_on_as_it_arrives_is_the_batch() {
    let double = Double::new(Arc::new(MemoryBackend::default()));
    let store = Store::new(double.clone());
    let acme = org("acme");
    let mut files = many_files("large", 40, 150_000);
    files.extend(many_files("small", 300, 700));
    let src = home_dir(&refs(&files));
    let root = push(&store, &acme, &home("h"), src.path())
        .expect("push")
        .root
        .expect("root");
    let objects: Vec<ObjectId> = reachable(&store, &acme, root).into_iter().collect();
    let fresh = Store::new(double.clone());
    let whole = fresh.get_batch(&acme, &objects).expect("batch");

    let handed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handed_mid_read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let (handed, handed_mid_read) = (Arc::clone(&handed), Arc::clone(&handed_mid_read));
        double.between_range_pieces(move |_, _| {
            let now = handed.load(std::sync::atomic::Ordering::SeqCst);
            handed_mid_read.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
        });
    }
    let mut each: Vec<Option<Option<Vec<u8>>>> = vec![None; objects.len()];
    fresh
        .get_batch_each(&acme, &objects, &mut |i, stored| {
            assert!(each[i].is_none(), "object {i} handed on twice");
            each[i] = Some(stored);
            handed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        })
        .expect("batch handed on");
    let each: Vec<Option<Vec<u8>>> = each
        .into_iter()
        .map(|stored| stored.expect("every object handed on"))
        .collect();
    assert_eq!(each, whole);
    assert!(each.iter().all(Option::is_some));
    assert!(
        handed_mid_read.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "no object was handed on before its read ended"
    );
}

/// Issue 18 (a fresh pull's peak memory): a pull on a fresh machine
/// writes a pack's first files while the rest of the pack is still
/// arriving, so it holds parts of packs, not whole ones (it held two
/// 16 MiB windows). The store here stops a read past its first 4.6 MB
/// until files are on disk.
#[test]
fn a_fresh_pull_writes_files_while_their_pack_is_still_arriving() {
    const FILE_BYTES: usize = 200_000;
    let double = Double::batching(Arc::new(MemoryBackend::default()));
    let acme = org("acme");
    let files = many_files("x", 60, FILE_BYTES);
    let src = home_dir(&refs(&files));
    // Two uploading threads (`support::push`): ~12 MB in packs of several
    // MB, each read in one ranged read.
    push(&Store::new(double.clone()), &acme, &home("h"), src.path()).expect("push");
    double.arm(Faults::default());

    let dest = tempdir();
    let written_mid_read = Arc::new(Mutex::new(None));
    {
        let (dest, written_mid_read) = (dest.path().to_owned(), Arc::clone(&written_mid_read));
        double.between_range_pieces(move |handed, len| {
            // Past the first parts handed to the writer (2 MiB each),
            // before the read's end.
            let mut mid_read = written_mid_read.lock().expect("lock");
            if handed < 4_600_000 || handed == len || mid_read.is_some() {
                return;
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            let mut written = files_of_size(&dest, FILE_BYTES as u64);
            while written == 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
                written = files_of_size(&dest, FILE_BYTES as u64);
            }
            *mid_read = Some(written);
        });
    }
    let report = pull(&Store::new(double.clone()), &acme, &home("h"), dest.path()).expect("pull");
    assert_eq!(contents(dest.path()), contents(src.path()));
    assert_eq!(report.files_written, 60);
    let written = *written_mid_read.lock().expect("lock");
    assert!(
        written.is_some_and(|n| n > 0),
        "files written before the pack's read ended: {written:?}"
    );
}

/// A pack cut short is named by a pull on a fresh machine too, whose
/// reads are streamed: the objects the read did not complete do not
/// decode, and their own reads name the pack.
#[test]
fn a_truncated_pack_is_named_by_a_fresh_pull() {
    let double = Double::batching(Arc::new(MemoryBackend::default()));
    let store = Store::new(double.clone());
    let acme = org("acme");
    let files = many_files("x", 20, 100_000);
    let src = home_dir(&refs(&files));
    push(&store, &acme, &home("h"), src.path()).expect("push");
    // A pack whose last object is a block (trees are read before writing
    // begins, each batch whole), cut inside that block.
    let index = packs_of(double.as_ref(), &acme)
        .into_iter()
        .find(|index| {
            index
                .entries
                .last()
                .is_some_and(|last| last.object.kind == store::store::ObjectKind::Block)
        })
        .expect("a pack ending in a block");
    let key = Store::pack_key(&acme, &index.pack, PackPart::Data);
    let bytes = double.get(&key).expect("get").expect("pack");
    double
        .put(&key, &bytes[..bytes.len() - 50_000])
        .expect("truncate");
    let dest = tempdir();
    let err =
        pull(&Store::new(double.clone()), &acme, &home("h"), dest.path()).expect_err("truncated");
    assert!(
        matches!(err, Error::Corrupt { .. }) && err.to_string().contains("truncated pack"),
        "{err}"
    );
}
